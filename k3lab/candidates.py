"""Callables ``f(x, w) -> y`` for every decode-GEMM candidate (GPU side).

``x`` is ``[M, K]``, ``w`` ``[N, K]``, both bf16 CUDA tensors; each callable returns a
new bf16 ``[M, N]`` tensor. Nothing here re-implements a kernel:

* ``cublas``: ``torch.mm``, the fallback every table row must beat;
* ``swap_ab``: our Triton kernel (``overlay/.../swap_ab_gemm.py``), through the
  overlay's own launch path when vLLM is importable, else straight from the file;
* ``cute``, ``ll_bf16``, ``tinygemm``: through ``low_latency_gemm_dispatch._launch``, the
  very code a routed row runs (needs the bundle's vLLM tree; tinygemm also FlashInfer);
* ``trivial``: a one-store Triton kernel, the launch floor small shapes are held to.
"""

from __future__ import annotations

import importlib
import importlib.util
import os
import sys
import types
from typing import Callable

import torch

from k3lab import paths

OVERLAY_DIR = str(paths.OVERLAY_NVIDIA)
SWAP_AB_MODULE = "vllm.models.kimi_k3.nvidia.swap_ab_gemm"
LLG_MODULE = "vllm.models.kimi_k3.nvidia.low_latency_gemm_dispatch"
LL_BF16_MODULE = "vllm.models.kimi_k3.nvidia.gemm_backends.ll_bf16"
_cache: dict[str, object] = {}


def swap_ab_module():
    """The overlay's ``swap_ab_gemm`` module: vLLM's copy if it imports, else the file.

    The file is loaded with a stand-in ``vllm.triton_utils`` (it needs nothing else
    from vLLM), from ``$K3_SWAP_AB_FILE`` or this checkout's overlay.
    """
    if "sab" in _cache:
        return _cache["sab"]
    try:
        mod = importlib.import_module(SWAP_AB_MODULE)
    except Exception:
        import triton
        import triton.language as tl

        for name in ("vllm", "vllm.triton_utils"):
            sys.modules.setdefault(name, types.ModuleType(name))
        sys.modules["vllm.triton_utils"].tl = tl
        sys.modules["vllm.triton_utils"].triton = triton
        path = os.environ.get("K3_SWAP_AB_FILE") or os.path.join(OVERLAY_DIR, "swap_ab_gemm.py")
        spec = importlib.util.spec_from_file_location("k3_swap_ab_gemm", path)
        mod = importlib.util.module_from_spec(spec)
        sys.modules[spec.name] = mod
        spec.loader.exec_module(mod)
    _cache["sab"] = mod
    return mod


def cublas(x, w, residual=None):
    """``torch.mm`` (cuBLAS), or ``addmm`` with a residual."""
    return torch.mm(x, w.t()) if residual is None else torch.addmm(residual, x, w.t())


def swap_ab(cfg, pdl: bool = True) -> Callable:
    """Our kernel at ``cfg`` = ``(block_n, block_k, split_k, num_warps, num_stages)``."""
    mod = swap_ab_module()
    config = mod.SwapAbConfig(*cfg)

    def f(x, w, residual=None):
        return mod.swap_ab_gemm(x, w, config, residual, pdl=pdl)

    return f


def routed(backend: str, cfg, m: int) -> Callable:
    """``low_latency_gemm_dispatch._launch`` for one table entry at M = ``m`` (the dispatch's code)."""
    llg = importlib.import_module(LLG_MODULE)
    call = llg.PlannedCall(backend, llg.config_from_data(backend, m, cfg))

    def f(x, w, residual=None):
        return llg._launch(call, x, w)

    return f


def warm(backend: str, cfg, m: int, k: int) -> None:
    """Compile what ``routed(backend, cfg, m)`` needs for K = ``k`` (before any timing).

    ``ll_bf16``: vLLM's own warm-up of the pinned variant; ``tinygemm``: one call, on
    which FlashInfer JIT-builds its module. Raises whatever the compile raises.
    """
    llg = importlib.import_module(LLG_MODULE)
    if backend == "ll_bf16":
        runner = importlib.import_module(LL_BF16_MODULE).runner(llg.config_from_data(backend, m, cfg))
        runner.warmup(shapes=[(k, 16)], m_values=[m])
        return
    x = torch.zeros(m, k, dtype=torch.bfloat16, device="cuda")
    w = torch.zeros(16, k, dtype=torch.bfloat16, device="cuda")
    routed(backend, cfg, m)(x, w)
    torch.cuda.synchronize()


def available(backend: str) -> bool:
    """Whether ``backend`` can run here (module importable and kernel present)."""
    try:
        if backend in ("cublas", "trivial"):
            return torch.cuda.is_available()
        if backend == "swap_ab":
            swap_ab_module()
            return True
        llg = importlib.import_module(LLG_MODULE)
        return llg._backend_available(backend)
    except Exception as exc:  # a missing optional stack is an answer, not an error
        print(f"[candidates] {backend} unavailable: {type(exc).__name__}: {exc}"[:300])
        return False


def trivial(pdl: bool) -> Callable:
    """A Triton kernel that stores one int: the fastest launch a graph can hold."""
    import triton
    import triton.language as tl

    if "tick" not in _cache:

        @triton.jit
        def _tick(ptr, USE_PDL: tl.constexpr):
            if USE_PDL:
                tl.extra.cuda.gdc_launch_dependents()
                tl.extra.cuda.gdc_wait()
            tl.store(ptr, 1)

        _cache["tick"] = _tick
    tick = _cache["tick"]
    extra = {"launch_pdl": True} if pdl else {}

    def f(x, w, residual=None):
        out = torch.empty(1, dtype=torch.int32, device=x.device)
        tick[(1,)](out, USE_PDL=pdl, num_warps=1, **extra)
        return out

    return f


#: The fused decode ops' backends (``gemm_backends/``, ops other than ``gemm``) and the
#: lab tool that measures each for its table rows (``low_latency_fused_sm90.py``). They
#: take more than ``(x, w)``, so no callable above: the tools call their kernels.
FUSED = {
    "swap_ab_rmsnorm": "k3lab.decode_step.prologue_bench (norm) and k3lab.decode_step.replay",
    "swap_ab_add_rmsnorm": "k3lab.decode_step.prologue_bench (add_norm)",
    "pdl_rmsnorm": "k3lab.decode_step.replay (kv_a_norm, MTP norms)",
    "pdl_act_mul": "k3lab.decode_step.replay (situ_and_mul)",
    "pdl_sigmoid_mul": "k3lab.decode_step.replay (gate_sigmoid_mul)",
    "pdl_mtp_input": "k3lab.decode_step.replay (fused_mtp_input)",
    "swap_ab_gate": "k3lab.decode_step.gate_stack_bench and k3lab.decode_step.replay",
}
