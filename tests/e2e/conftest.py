"""Shared fixtures of the e2e tier: the real release mirror and the patched pinned base."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from k3overlay import git, source
from k3overlay.mirror import release_of
from k3overlay.project import ROOT

LLG = "vllm/models/kimi_k3/nvidia/low_latency_gemm.py"  # upstream's, left as upstream has it
DISPATCH = "vllm/models/kimi_k3/nvidia/low_latency_gemm_dispatch.py"  # ours, which the model uses
MTP = "vllm/models/kimi_k3/nvidia/mtp.py"


def pytest_collection_modifyitems(items):
    here = Path(__file__).parent
    for item in items:  # everything in this folder is the e2e tier
        if Path(str(item.fspath)).parent == here:
            item.add_marker(pytest.mark.e2e)


def require_vllm_deps() -> None:
    """Skip (or, under ci/test.sh, fail) when vLLM's own requirements are not installed."""
    missing = [m for m in ("torch", "transformers", "fastapi", "pytest")
               if importlib.util.find_spec(m) is None]
    if missing:
        message = (f"vLLM v0.28.0 requirements not installed ({', '.join(missing)} missing); "
                   f"ci/test.sh installs them")
        if os.environ.get("K3_CPU_TIER") == "required":
            pytest.fail(message)
        pytest.skip(message)


@pytest.fixture(scope="session")
def mirror_repo():
    mirror = source.default_mirror()
    mirror.ensure([release_of("v0.28.0"), release_of("v0.29.0")])
    return git.init_bare(mirror.path)


@pytest.fixture(scope="session")
def applied(mirror_repo, tmp_path_factory):
    """README command 1, as a user runs it (but into a temporary workdir)."""
    wd = tmp_path_factory.mktemp("e2e") / "vllm"
    out = wd.parent / "report.json"
    proc = subprocess.run([sys.executable, str(ROOT / "apply.py"), "--workdir", str(wd),
                           "--json", str(out)], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return wd, json.loads(out.read_text())


