"""Handles to the kernels the GPU tier times: cuBLAS, v0.28.0's CuTe skinny GEMM, dsv3.

Nothing here re-implements a kernel. The CuTe kernel is vLLM v0.28.0's own
``ShapeDynamicSkinnyGemm`` from the patched tree installed by the bundle; the
dsv3 fused-A kernel is v0.28.0's CUDA source built on the GPU machine by
``dsv3_build.py`` (absent when that build failed).

All callables take ``x`` ``[M, K]`` and ``w`` ``[N, K]`` bf16 CUDA tensors and
return a new ``[M, N]`` bf16 tensor.
"""

from __future__ import annotations

import importlib
import importlib.util
import os
import sys
import types
from typing import Callable, Optional

import torch

KERNEL_MODULE = "vllm.model_executor.kernels.linear.cute_dsl.skinny_gemm"
_loaded: dict[str, object] = {}


def _load_standalone(vllm_root: str):
    """Load the two kernel files with two stand-ins, bypassing vLLM's package init.

    Fallback for a tree whose package imports fail: the kernel module only
    needs ``current_stream`` and ``is_arch_support_pdl`` from vLLM.
    """
    base = os.path.join(vllm_root, "vllm/model_executor/kernels/linear/cute_dsl")
    pkg = types.ModuleType("_k3_cute_dsl")
    pkg.__path__ = [base]
    sys.modules["_k3_cute_dsl"] = pkg
    tu = types.ModuleType("vllm.utils.torch_utils")
    tu.current_stream = torch.cuda.current_stream
    plat = types.ModuleType("vllm.platforms")

    class _P:
        @staticmethod
        def is_arch_support_pdl() -> bool:
            return torch.cuda.get_device_capability()[0] >= 9

    plat.current_platform = _P()
    for name in ("vllm", "vllm.utils"):
        sys.modules.setdefault(name, types.ModuleType(name))
    sys.modules["vllm.utils.torch_utils"] = tu
    sys.modules["vllm.platforms"] = plat
    mods = {}
    for stem in ("_skinny_gemm", "skinny_gemm"):
        spec = importlib.util.spec_from_file_location(
            f"_k3_cute_dsl.{stem}", os.path.join(base, f"{stem}.py")
        )
        mod = importlib.util.module_from_spec(spec)
        sys.modules[spec.name] = mod
        spec.loader.exec_module(mod)
        mods[stem] = mod
    return mods["skinny_gemm"]


def skinny_module():
    """v0.28.0's ``skinny_gemm`` module; records how it was loaded in ``LOAD_PATH``."""
    global LOAD_PATH
    if "sg" in _loaded:
        return _loaded["sg"]
    try:
        mod = importlib.import_module(KERNEL_MODULE)
        LOAD_PATH = "vllm package import"
    except Exception as exc:  # a broken tree must not stop the sweep
        root = os.environ.get("K3_VLLM_ROOT")
        if not root:
            raise
        print(f"[kernels] package import failed ({exc!r}); loading kernel files directly")
        mod = _load_standalone(root)
        LOAD_PATH = "standalone kernel files"
    _loaded["sg"] = mod
    return mod


LOAD_PATH = "not loaded"


def cute_available() -> bool:
    try:
        import cutlass  # noqa: F401
        import cutlass.cute  # noqa: F401
    except Exception:
        return False
    return True


def cute_fn(m: int, cfg) -> Callable:
    """Callable running v0.28.0's CuTe kernel with ``cfg`` at ``num_rows = m``.

    ``cfg`` is ``(block_size, outputs_per_block, k_unroll, vector_width, static_k)``.
    The returned callable is ``f(x, w, residual=None) -> out``; the first call
    compiles (seconds). Raises ``ValueError`` from the kernel for illegal shapes.
    """
    sg = skinny_module()
    bs, opb, ku, vw, sk = cfg
    config = sg.SkinnyGemmConfig(m, bs, opb, ku, vw, sk)
    kern = sg.shape_dynamic_skinny_gemm

    def f(x, w, residual=None):
        return kern(x, w, config, residual)

    return f


def cute_compile(m: int, cfg) -> None:
    """Compile ``cfg`` at ``num_rows = m`` without launching anything (CPU only).

    Uses v0.28.0's private ``_compile`` so the tuner can compile while another
    process holds the GPU for timing; the next ``cute_fn`` call reuses it.
    """
    import torch as _t

    sg = skinny_module()
    bs, opb, ku, vw, sk = cfg
    config = sg.SkinnyGemmConfig(m, bs, opb, ku, vw, sk)
    kern = sg.shape_dynamic_skinny_gemm
    if (_t.bfloat16, config, False) not in getattr(kern, "_compiled", {}):
        kern._compile(_t.bfloat16, config, False)


def cublas(x: torch.Tensor, w: torch.Tensor, residual=None) -> torch.Tensor:
    """The fallback the table must beat: ``torch.mm`` (cuBLAS) / ``addmm``."""
    if residual is None:
        return torch.mm(x, w.t())
    return torch.addmm(residual, x, w.t())


def dsv3_fn() -> Optional[Callable]:
    """``f(x, w)`` through ``torch.ops._C.dsv3_fused_a_gemm`` if it was built, else None."""
    lib = os.environ.get("K3_DSV3_LIB")
    if not lib or not os.path.exists(lib):
        return None
    if "dsv3" not in _loaded:
        try:
            torch.ops.load_library(lib)
            _loaded["dsv3"] = torch.ops._C.dsv3_fused_a_gemm
        except Exception as exc:
            print(f"[kernels] dsv3 library did not load: {exc!r}")
            _loaded["dsv3"] = None
    op = _loaded["dsv3"]
    if op is None:
        return None

    def f(x, w, residual=None):
        out = torch.empty((x.shape[0], w.shape[0]), dtype=x.dtype, device=x.device)
        op(out, x, w.t(), True)
        return out

    return f
