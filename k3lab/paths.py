"""Where the lab reads and writes: this checkout, its committed results, the overlay, and
the cache folder for what git does not keep (logs, tarballs, raw runs)."""

from __future__ import annotations

from pathlib import Path

from k3overlay.project import cache_dir

REPO = Path(__file__).resolve().parent.parent
RESULTS = REPO / "results"  # what git keeps: indexed in results/README.md
OVERLAY_NVIDIA = REPO / "overlay" / "vllm" / "models" / "kimi_k3" / "nvidia"
SM90_TABLE = OVERLAY_NVIDIA / "low_latency_gemm_sm90.py"


def lab_cache() -> Path:
    """``~/.cache/vllm-k3-overlay/lab`` (``$XDG_CACHE_HOME`` honoured): raw runs, logs and
    tarballs a device call brought back, kept out of git."""
    return cache_dir() / "lab"
