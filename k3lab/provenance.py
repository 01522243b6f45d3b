"""Where a lab figure comes from: GPU, capability, date, versions and run id.

Every results JSON the lab writes carries ``provenance(run_id)`` (plus what its own tool
adds: the kernel, Triton or FlashInfer versions), so a figure is never separated from the
GPU, run and versions it was measured with. Needs torch and a CUDA GPU.
"""

from __future__ import annotations

import datetime
import importlib.metadata as md


def version_of(dist: str) -> str:
    """The installed version of distribution ``dist``, or ``"absent"``."""
    try:
        return md.version(dist)
    except md.PackageNotFoundError:
        return "absent"


def provenance(run_id: str, kernel: str = "vLLM v0.28.0 ShapeDynamicSkinnyGemm (CuTe DSL)") -> dict:
    """``{"gpu", "capability", "date", "torch", "cutlass_dsl", "cuda", "run_id", "kernel"}``
    of GPU 0 today; ``kernel`` names what was timed."""
    import torch

    cap = torch.cuda.get_device_capability(0)
    return {
        "gpu": torch.cuda.get_device_name(0),
        "capability": f"{cap[0]}.{cap[1]}",
        "date": datetime.date.today().isoformat(),
        "torch": torch.__version__,
        "cutlass_dsl": version_of("nvidia-cutlass-dsl"),
        "cuda": torch.version.cuda,
        "run_id": run_id,
        "kernel": kernel,
    }


def environment() -> dict:
    """``{"date" (UTC), "gpu", "torch", "triton", "cuda", "python"}`` of GPU 0 now: the
    header of the decode-step benchmarks' JSON (``k3lab/decode_step/``)."""
    import platform
    import time

    import torch
    import triton

    return {"date": time.strftime("%Y-%m-%d", time.gmtime()), "gpu": torch.cuda.get_device_name(),
            "torch": torch.__version__, "triton": triton.__version__, "cuda": torch.version.cuda,
            "python": platform.python_version()}  # fmt: skip
