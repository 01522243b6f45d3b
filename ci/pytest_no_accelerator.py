"""pytest plugin: run vLLM's kernel test files on a machine with no accelerator.

vLLM's ``tests/conftest.py`` has an autouse fixture that, after every test, calls
``cleanup_dist_env_and_memory()``, which calls ``torch.accelerator.empty_cache()``. On a
CPU-only torch that raises "Cannot access accelerator device when none is available",
so every test, passed or skipped, also reports an error at teardown (v0.28.0's
test_bf16_skinny_gemm.py: 85 passed, 156 skipped, 241 errors).

vLLM already provides the switch for this: tests marked ``skip_global_cleanup`` skip
that cleanup. Without an accelerator there is no device memory or process group to
clean up, so this plugin marks every collected test with it. With an accelerator it
does nothing. GPU test cases then skip through their own ``pytest.skip(reason)``
checks instead of erroring. No file of the vLLM tree is changed.

Load with ``-p pytest_no_accelerator`` (this directory on PYTHONPATH).
"""

from __future__ import annotations

import pytest

_MARKER = "skip_global_cleanup"
GPU_MARKER = "gpu: needs a CUDA GPU (our overlay's GPU test files); skipped without one"


def _has_accelerator() -> bool:
    import torch

    return torch.accelerator.is_available()


def pytest_configure(config: pytest.Config) -> None:
    # vLLM's pyproject registers the marker; register it too so that strict-marker
    # runs from another rootdir do not reject it.
    config.addinivalue_line("markers", f"{_MARKER}: skip global cleanup after the test")
    # Our overlay's GPU test files are marked ``gpu``; vLLM's tree does not register it.
    config.addinivalue_line("markers", GPU_MARKER)


def pytest_collection_modifyitems(
    config: pytest.Config, items: list[pytest.Item]
) -> None:
    if _has_accelerator():
        return
    for item in items:
        item.add_marker(_MARKER)
