"""The pytest plugins our tests run under in a vLLM tree (CPU tier, GPU stage) register our marks."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from k3overlay.project import ROOT

MARKED = "import pytest\n\n\n@pytest.mark.gpu\ndef test_marked():\n    pass\n"


@pytest.mark.parametrize("plugin", ["pytest_no_accelerator", "gpu_stage.pytest_record"])
def test_the_gpu_mark_is_known_under_each_plugin(plugin, tmp_path):
    """A vLLM tree registers no ``gpu`` mark; our GPU test files use it. An unknown mark is
    a warning (PytestUnknownMarkWarning) in every CPU-tier run: made an error here."""
    (tmp_path / "test_marked.py").write_text(MARKED)
    (tmp_path / "pytest.ini").write_text("[pytest]\n")  # the tree's own config: no markers
    stub = tmp_path / "stub" / "torch"  # the plugin asks torch for an accelerator: say none, fast
    stub.mkdir(parents=True)
    (stub / "__init__.py").write_text("class accelerator:\n    is_available = staticmethod(lambda: False)\n")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT / "ci"), str(stub.parent)])}
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", plugin, "-p", "no:cacheprovider",
                           "-W", "error::pytest.PytestUnknownMarkWarning", "test_marked.py"],
                          cwd=tmp_path, env=env, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert "1 passed" in proc.stdout

