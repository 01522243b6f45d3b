#!/usr/bin/env python3
"""Apply the vllm-k3-overlay patch series and overlay onto a vLLM checkout.

Run ``python apply.py --help``; exit codes are listed there and in README.md.
"""

import sys

try:
    from k3overlay.cli import main
except ModuleNotFoundError as err:  # run outside the venv README command 1 makes
    print(f"apply.py: error: missing dependency {err.name!r}; run `.venv/bin/pip install -e .` "
          f"and use .venv/bin/python (README, quick start)", file=sys.stderr)
    sys.exit(2)
except KeyboardInterrupt:  # Ctrl-C while starting up: nothing was done yet
    print("apply.py: interrupted; the checkout was left as it was", file=sys.stderr)
    sys.exit(130)

if __name__ == "__main__":
    try:  # main() catches Ctrl-C itself; this catches one landing on its first instruction
        code = main()
    except KeyboardInterrupt:
        print("apply.py: interrupted; the checkout was left as it was", file=sys.stderr)
        code = 130
    sys.exit(code)
