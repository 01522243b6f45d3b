"""Stand-in for ``vllm._C_stable_libtorch`` on a GPU runner with no compiled vLLM.

The k3 GPU bundle ships vLLM's Python tree only (the CuTe kernels need nothing
compiled). vLLM's CUDA platform imports this extension at import time and a few
modules ask ``torch.ops._C.*supports*`` capability questions at import; here the
honest answer is False (no compiled CUTLASS kernels). Every other ``_C`` op is
looked up for real, so ops loaded later (e.g. ``dsv3_build.py``'s library via
``torch.ops.load_library``) are found, and absent ones still raise
``AttributeError`` (``hasattr`` checks stay truthful).
"""

import torch

_real = torch.ops._C


class _NoCompiledOps:
    def __getattr__(self, name):
        try:
            return getattr(_real, name)
        except AttributeError:
            if "supports" in name or name.endswith("supported"):
                return lambda *args, **kwargs: False
            raise


torch.ops.__dict__["_C"] = _NoCompiledOps()


# vllm.vllm_flash_attn raises ImportError without its compiled FA2/FA3 extensions,
# and attention helpers import it at module level on CUDA. GEMM code never calls
# it: give importers a stand-in that reports FA unavailable and raises if called.
def _fa_unavailable(*args, **kwargs):
    raise RuntimeError("flash attention is not built on this runner (k3 GPU bundle)")


def _fa_stub(name):
    import types

    mod = types.ModuleType(name)
    mod.__path__ = []
    mod.FA2_AVAILABLE = mod.FA3_AVAILABLE = False
    mod.fa_version_unsupported_reason = lambda *a, **k: "not built on this runner"
    mod.is_fa_version_supported = lambda *a, **k: False
    for fn in ("flash_attn_varlen_func", "get_scheduler_metadata",
               "compile_flash_attn_varlen_func_from_specs", "flash_attn_with_kvcache"):
        setattr(mod, fn, _fa_unavailable)
    return mod


def _install_fa_stub():
    import glob
    import os
    import sys

    # Decide by the extension files rather than importing the real package here:
    # this shim runs while vLLM is still resolving its platform.
    pkg = os.path.dirname(os.path.abspath(__file__))
    if glob.glob(os.path.join(pkg, "_vllm_fa[23]_C*.so")):
        return
    for name in ("vllm.vllm_flash_attn", "vllm.vllm_flash_attn.flash_attn_interface"):
        sys.modules[name] = _fa_stub(name)


_install_fa_stub()
