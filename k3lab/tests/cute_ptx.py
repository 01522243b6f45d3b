"""The PTX of one build of a CuTe DSL kernel module of the overlay, compiled for sm_90a
without a GPU: shared by the CPU tests that read a kernel's instruction order."""

from __future__ import annotations

import os
import pathlib
import subprocess
import sys

import pytest


def sm90a_ptx(out: pathlib.Path, module: pathlib.Path, build: str) -> str:
    """``mod.compile_build(<build>)`` for the module at ``module`` (loaded by path as
    ``mod``: it needs neither torch nor vLLM to compile), in a child process, since the CuTe
    DSL reads its dump settings at import; returns the one PTX file it writes under ``out``.
    Skips the calling test where nvidia-cutlass-dsl is not importable."""
    pytest.importorskip("cutlass.cute", reason="nvidia-cutlass-dsl is not installed here")
    script = (
        "import importlib.util\n"
        f"spec = importlib.util.spec_from_file_location('mod', {str(module)!r})\n"
        "mod = importlib.util.module_from_spec(spec); spec.loader.exec_module(mod)\n"
        f"mod.compile_build({build})\n"
    )
    env = {**os.environ, "CUTE_DSL_ARCH": "sm_90a", "CUTE_DSL_KEEP": "ptx", "CUTE_DSL_DUMP_DIR": str(out)}
    proc = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True,
                          timeout=600)  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    (path,) = out.glob("*.ptx")
    return path.read_text()
