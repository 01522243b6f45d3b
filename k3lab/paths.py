"""Where the lab reads and writes: this checkout, its committed results and the overlay.

What git does not keep (a device call's logs and tarballs, raw runs) goes to the cache
folder's ``lab/`` (``~/.cache/vllm-k3-overlay/lab/``, ``$XDG_CACHE_HOME`` honoured) or to
CI artifacts; results/README.md says which file is which. Nothing here imports the tool, so
the lab's GPU-side modules run on a machine that has only ``k3lab/`` and ``overlay/``.
"""

from __future__ import annotations

from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
RESULTS = REPO / "results"  # what git keeps: indexed in results/README.md
OVERLAY_NVIDIA = REPO / "overlay" / "vllm" / "models" / "kimi_k3" / "nvidia"
SM90_TABLE = OVERLAY_NVIDIA / "low_latency_gemm_sm90.py"
