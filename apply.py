#!/usr/bin/env python3
"""Apply the vllm-k3-overlay patch series and overlay onto a vLLM checkout.

Run ``python apply.py --help``; exit codes are listed there and in README.md.
"""

import sys

from k3overlay.cli import main

if __name__ == "__main__":
    sys.exit(main())
