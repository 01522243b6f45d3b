"""Round 10: a run killed (SIGKILL, the OOM killer) left its temporary folders in TMPDIR for
good (``k3-diff-*``, ``k3-mailinfo-*``, an unpacked release, a whole ``pip install`` of the
wheel checked), and ``--build-wheel``'s pip went on installing after the tool was gone. Each
run now keeps every temporary file of its own and of its children in one folder
(``scratch``), which the next run removes once its lock says the run is dead; pip runs
through the watchdog (``reaper.run``) as git does."""

from __future__ import annotations

import errno
import fcntl
import os
import signal
import stat
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

from k3overlay import cli, errors, scratch
from k3overlay.lock import owned_scratch, remove_stale, workdir_lock

from .conftest import alive, as_in_a_terminal, killed_in_owned_scratch
from .test_wheel import setup, vupstream  # noqa: F401  (fixtures: a project, its release wheel)

ROOT = Path(__file__).resolve().parent.parent
# apply.py's own main on a synthetic project (argv[1]); with KILL_IN set, the run SIGKILLs
# itself as soon as it has made a temporary folder whose name starts with that, and has
# written in it. Every tempfile folder is made by ``mkdtemp`` (TemporaryDirectory too).
PRELUDE = ("import os, signal, sys, tempfile; from pathlib import Path\n"
          "from k3overlay import cli\nfrom k3overlay.project import Project\n"
          "real = tempfile.mkdtemp\n"
          "def mkdtemp(*args, **kwargs):\n"
          "    path = real(*args, **kwargs)\n"
          "    if os.environ.get('KILL_IN') and os.path.basename(path).startswith(os.environ['KILL_IN']):\n"
          "        Path(path, 'half-done').write_bytes(b'x' * 4096)\n"
          "        os.kill(os.getpid(), signal.SIGKILL)\n"
          "    return path\n"
          "tempfile.mkdtemp = mkdtemp\n"
          "if os.environ.get('PIP_STAND_IN'):  # the wheel check's pip, as a stand-in that hangs\n"
          "    from types import SimpleNamespace\n"
          "    from k3overlay import wheelcheck\n"
          "    wheelcheck.sys = SimpleNamespace(executable=os.environ['PIP_STAND_IN'])\n")
RUNNER = PRELUDE + "cli.Project = lambda: Project(Path(sys.argv[1]))\nsys.exit(cli.main(sys.argv[2:]))\n"
# the rebase job (ci/rebase.py) the same way, its stages (environments, test tiers) none
JOB = str(ROOT / "ci" / "rebase.py")
REBASE = PRELUDE + (f"import importlib.util\n"
                    f"spec = importlib.util.spec_from_file_location('ci_rebase', {JOB!r})\n"
                    f"job = importlib.util.module_from_spec(spec)\nspec.loader.exec_module(job)\n"
                    f"from k3overlay.stages import StageResults\n"
                    f"job.Project = lambda: Project(Path(sys.argv[1]))\n"
                    f"job.JobStages = lambda *args, **kwargs: (lambda target: StageResults())\n"
                    f"sys.exit(job.main(sys.argv[2:]))\n")


@pytest.fixture
def tmp(tmp_path) -> Path:
    """The runs' TMPDIR: empty, of the test's own."""
    (tmp_path / "t").mkdir()
    return tmp_path / "t"


def run_tool(project, tmp: Path, *args: str, runner: str = RUNNER, **env: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", runner, str(project.root), *args], cwd=ROOT,
                          env={**os.environ, "TMPDIR": str(tmp), **env}, capture_output=True, text=True,
                          timeout=120, preexec_fn=as_in_a_terminal)


def spawn(project, tmp: Path, *args: str, **env: str) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-c", RUNNER, str(project.root), *args], cwd=ROOT,
                            env={**os.environ, "TMPDIR": str(tmp), **env}, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, preexec_fn=as_in_a_terminal)


def everything(tmp: Path) -> list[str]:
    return sorted(str(p.relative_to(tmp)) for p in tmp.rglob("*"))


def wait_for(condition, what: str, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.02)


# -- a killed run's temporary folders are removed by the next run -----------------------------

@pytest.mark.parametrize("prefix", ["k3-mailinfo-", "k3-diff-"])
@pytest.mark.parametrize("mode", [[], ["--check"]])
def test_a_run_killed_in_a_temporary_folder_leaves_nothing_after_the_next_run(project, upstream, tmp_path,
                                                                               tmp, prefix, mode):
    args = ["-q", "--vllm-repo", str(upstream), "--workdir", str(tmp_path / "wd"), *mode]
    killed = run_tool(project, tmp, *args, KILL_IN=prefix)
    assert killed.returncode == -signal.SIGKILL, killed.stderr
    assert [p for p in everything(tmp) if Path(p).name.startswith(prefix)]  # what it left
    again = run_tool(project, tmp, *args)
    assert again.returncode == 0, again.stderr
    assert everything(tmp) == []  # the killed run's folder too, and nothing of its own


def test_a_rebase_job_killed_in_its_clone_leaves_nothing_after_the_next_job(project, upstream, tmp):
    args = ["-q", "--no-tests", "--onto", "v1.1.0", "--vllm-repo", str(upstream)]
    killed = run_tool(project, tmp, *args, runner=REBASE, KILL_IN="k3-rebase-")
    assert killed.returncode == -signal.SIGKILL, killed.stderr
    assert [p for p in everything(tmp) if Path(p).name.startswith("k3-rebase-")]
    again = run_tool(project, tmp, *args, runner=REBASE)
    assert again.returncode == 0, again.stderr
    assert everything(tmp) == []


def test_the_gpu_stage_gets_the_machines_tmpdir_for_its_lock(tmp, monkeypatch):
    """The GPU stage (a child of the rebase job) keeps its lock, one per GPU machine, in TMPDIR:
    in the run's own folder every job would have a lock of its own."""
    monkeypatch.setattr(tempfile, "tempdir", None)
    monkeypatch.setenv("TMPDIR", str(tmp))
    echo = ["sh", "-c", 'echo "$TMPDIR"']
    with scratch.per_run() as folder:
        with scratch.machine_tmpdir():
            assert subprocess.run(echo, capture_output=True, text=True).stdout.strip() == str(tmp)
            assert tempfile.gettempdir() == str(folder)  # Python's own: still the run's
        assert subprocess.run(echo, capture_output=True, text=True).stdout.strip() == str(folder)
    assert os.environ["TMPDIR"] == str(tmp) and everything(tmp) == []


def test_a_run_points_python_and_its_children_at_its_own_folder_then_back(project, upstream, tmp_path,
                                                                         tmp, monkeypatch):
    monkeypatch.setattr(tempfile, "tempdir", None)
    monkeypatch.setenv("TMPDIR", str(tmp))
    monkeypatch.setattr(cli, "Project", lambda: project)
    seen = {}

    def job(_project, _opts):  # what the job sees: Python's folder, and a child's
        seen["python"] = tempfile.gettempdir()
        seen["child"] = subprocess.run(["sh", "-c", 'echo "$TMPDIR"'], capture_output=True,
                                       text=True).stdout.strip()
        seen["listed"] = everything(tmp)
        seen["mode"] = stat.S_IMODE(scratch.parent_of(tmp).stat().st_mode)
        raise errors.UsageError("stopped here")

    monkeypatch.setattr(cli, "run_apply", job)
    assert cli.main(["-q", "--vllm-repo", str(upstream), "--workdir", str(tmp_path / "wd")]) == errors.USAGE
    parent = scratch.parent_of(tmp)
    assert seen["python"] == seen["child"] and Path(seen["python"]).parent == parent
    assert Path(seen["python"]).name.startswith(scratch.RUN_PREFIX) and seen["mode"] == 0o700
    assert seen["listed"] == sorted([parent.name, f"{parent.name}/{Path(seen['python']).name}",
                                     f"{parent.name}/{Path(seen['python']).name}/owner.lock"])
    assert os.environ["TMPDIR"] == str(tmp) and tempfile.tempdir is None  # as they were
    assert everything(tmp) == []


# -- a live run's folder is never removed -----------------------------------------------------

def test_a_live_runs_folder_is_left_alone_by_a_run_that_ends_meanwhile(project, upstream, tmp_path, tmp):
    first, second = tmp_path / "first", tmp_path / "second"
    args = ["-q", "--vllm-repo", str(upstream), "--workdir"]
    with workdir_lock(first, say=lambda _: None):  # the first run waits for it, its folder made
        waiting = spawn(project, tmp, *args, str(first))
        try:
            parent = scratch.parent_of(tmp)
            wait_for(lambda: parent.is_dir() and any(parent.iterdir()), "the first run's folder")
            [theirs] = list(parent.iterdir())
            (theirs / "in-use").write_text("the first run's\n")
            done = run_tool(project, tmp, *args, str(second))
            assert done.returncode == 0, done.stderr
            assert list(parent.iterdir()) == [theirs] and (theirs / "in-use").is_file()
        except BaseException:
            waiting.kill()
            raise
    out, err = waiting.communicate(timeout=120)
    assert waiting.returncode == 0, err
    assert everything(tmp) == []


def test_a_tmpdir_killed_runs_filled_does_not_lock_the_next_run_out(tmp, monkeypatch):
    """No room left for a new run's folder: the killed runs' go first (not only at the end)."""
    monkeypatch.setattr(tempfile, "tempdir", None)
    monkeypatch.setenv("TMPDIR", str(tmp))
    killed = subprocess.run([sys.executable, "-c",
                             "import os, signal; from k3overlay import scratch\n"
                             "with scratch.per_run() as folder:\n"
                             "    (folder / 'big').write_bytes(b'x' * 100_000)\n"
                             "    os.kill(os.getpid(), signal.SIGKILL)\n"], cwd=ROOT, env=dict(os.environ))
    assert killed.returncode == -signal.SIGKILL
    parent = scratch.parent_of(tmp)
    [dead] = list(parent.iterdir())
    wait_for(lambda: _free(dead), "the killed run's watchdog to let its lock go", 30)
    real = os.mkdir

    def full(path, *args, **kwargs):  # a run's folder: no room while dead is there
        if Path(path).parent == parent and dead.exists():
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        return real(path, *args, **kwargs)

    monkeypatch.setattr(os, "mkdir", full)
    with scratch.per_run() as folder:
        assert list(parent.iterdir()) == [folder]
    assert everything(tmp) == []


def test_stale_folders_go_at_once_a_live_ones_links_and_other_users_stay(tmp_path):
    """The lock alone says whether a folder's run lives: a killed run's is removed by the very
    next call, however young (it waited a minute before); a live one's never."""
    parent = tmp_path / "p"
    parent.mkdir()
    killed_in_owned_scratch(parent, "run-", "half", b"x" * 100)
    [dead] = list(parent.iterdir())
    victim = tmp_path / "victim"  # a link to a folder whose owner.lock is free: never followed
    victim.mkdir()
    (victim / "owner.lock").write_text("")
    (parent / "run-link").symlink_to(victim)
    others = []
    if os.geteuid() == 0:  # another user's, its lock free: theirs
        foreign = parent / "run-foreign"
        foreign.mkdir()
        (foreign / "owner.lock").write_text("")
        for path in (foreign / "owner.lock", foreign):
            os.chown(path, 12345, 12345)
        others.append(foreign.name)
    with owned_scratch(parent, "run-", sweep_first=False) as live:
        wait_for(lambda: _free(dead), "the killed run's watchdog to let its lock go", 30)
        assert remove_stale(parent, "run-") == [dead]
        assert live.is_dir() and (parent / "run-link").is_symlink() and (victim / "owner.lock").exists()
    assert sorted(p.name for p in parent.iterdir()) == sorted(["run-link", *others])


def _free(folder: Path) -> bool:
    fd = os.open(folder / "owner.lock", os.O_RDWR)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        fcntl.flock(fd, fcntl.LOCK_UN)
        return True
    except OSError:
        return False
    finally:
        os.close(fd)


# -- the folder of this user's run folders ----------------------------------------------------

@pytest.mark.parametrize("what", ["link", "another user's", "file"])
def test_a_link_or_another_users_folder_in_its_place_is_refused_never_used(project, upstream, tmp,
                                                                          tmp_path, monkeypatch, capsys,
                                                                          what):
    if what == "another user's" and os.geteuid() != 0:
        pytest.skip("needs root to make another user's folder")
    monkeypatch.setattr(tempfile, "tempdir", str(tmp))
    monkeypatch.setattr(cli, "Project", lambda: project)
    parent, elsewhere = scratch.parent_of(tmp), tmp_path / "elsewhere"
    elsewhere.mkdir()
    stale = elsewhere / "run-stale"  # what looks like a killed run's folder: not ours to remove
    stale.mkdir()
    (stale / "owner.lock").write_text("")
    if what == "link":
        parent.symlink_to(elsewhere)
    elif what == "file":
        parent.write_text("someone's\n")
    else:
        os.rename(elsewhere, parent)
        os.chown(parent, 12345, 12345)
        os.chown(parent / "run-stale", 12345, 12345)
        elsewhere = parent
    code = cli.main(["-q", "--vllm-repo", str(upstream), "--workdir", str(tmp_path / "wd")])
    err = capsys.readouterr().err
    assert code == errors.USAGE and len(err.splitlines()) == 1, err
    assert err.startswith(f"apply.py: error: {parent} is ") and "not a folder of this user's" in err
    if what != "file":
        assert sorted(p.name for p in elsewhere.iterdir()) == ["run-stale"]  # nothing made, nothing removed
    assert not (tmp_path / "wd").exists()


def test_its_own_folder_made_loose_is_made_this_users_alone_again(project, upstream, tmp, tmp_path,
                                                                   monkeypatch):
    monkeypatch.setattr(tempfile, "tempdir", str(tmp))
    monkeypatch.setattr(cli, "Project", lambda: project)
    parent = scratch.parent_of(tmp)
    parent.mkdir()
    os.chmod(parent, 0o777)  # (by hand: the tool makes it 0700)
    (parent / "keep").write_text("")  # (so it is not removed empty at the end)

    def job(_project, _opts):
        raise errors.UsageError("stopped here")

    monkeypatch.setattr(cli, "run_apply", job)
    assert cli.main(["-q", "--vllm-repo", str(upstream), "--workdir", str(tmp_path / "wd")]) == errors.USAGE
    assert stat.S_IMODE(parent.stat().st_mode) == 0o700 and os.listdir(parent) == ["keep"]


# -- no pip child outlives the tool -----------------------------------------------------------

PIP = """#!/bin/sh
# the wheel check's pip: it and a child of its own, in its group, hang till killed
sleep 600 &
echo "$$ $!" > "$PIP_MARK.new" && mv "$PIP_MARK.new" "$PIP_MARK"
wait
"""


@pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="reads /proc to see processes")
def test_the_wheel_checks_pip_does_not_outlive_a_killed_build_and_leaves_nothing(setup, tmp_path, tmp):
    project, release, _repo, report, _tip = setup
    pip, mark, wheels = tmp_path / "pip", tmp_path / "pip.pids", tmp_path / "wheels"
    pip.write_text(PIP)
    pip.chmod(0o755)
    args = ["-q", "--vllm-repo", report.workdir, "--workdir", report.workdir, "--build-wheel",
            "--release-wheel", str(release), "--wheel-dir", str(wheels)]
    tool = spawn(project, tmp, *args, PIP_STAND_IN=str(pip), PIP_MARK=str(mark))
    pids: list[int] = []
    try:
        wait_for(lambda: mark.exists() or tool.poll() is not None, "the wheel check's pip")
        assert tool.poll() is None, tool.communicate()
        pids = [int(word) for word in mark.read_text().split()]
        assert all(alive(pid) for pid in pids)
        tool.kill()  # SIGKILL: the tool alone, as the OOM killer does
        tool.communicate()
        wait_for(lambda: not any(alive(pid) for pid in pids), "pip and its child to be stopped", 10)
    finally:
        tool.kill()
        for pid in pids:
            if alive(pid):
                os.kill(pid, signal.SIGKILL)
    assert [p for p in everything(tmp) if "k3-wheel-install-" in p]  # what it left
    again = run_tool(project, tmp, *args)  # with pip itself
    assert again.returncode == 0, again.stderr
    assert everything(tmp) == []
    assert [p.name for p in wheels.iterdir()] == ["vllm-0.1.0+k3ov.9.9.9-py3-none-any.whl"]


def test_a_childs_group_is_announced_by_the_child_and_withdrawn_once_it_ended(monkeypatch):
    from k3overlay import reaper

    said: list[str] = []
    monkeypatch.setattr(reaper, "forget", lambda group: said.append(f"- {group}"))
    proc = reaper.run([sys.executable, "-c", "import os; print(os.getpid(), os.getpgid(0), os.getsid(0))"],
                      capture_output=True, text=True)
    pid, group, session = (int(word) for word in proc.stdout.split())
    assert group == session == pid != os.getpgid(0)  # a session of its own
    assert said == [f"- {pid}"]


def test_an_interrupt_stops_what_a_childs_child_started(tmp_path):
    """Ctrl-C (here SIGTERM, as a cancelled CI job) while pip runs: pip's own children go too."""
    mark = tmp_path / "pids"
    child = subprocess.Popen([sys.executable, "-c",
                              "import signal, sys\n"
                              "from k3overlay import reaper\n"
                              "def stop(*_): raise KeyboardInterrupt\n"
                              "signal.signal(signal.SIGTERM, stop)\n"
                              "try:\n"
                              "    reaper.run(['sh', '-c', sys.argv[1]])\n"
                              "except KeyboardInterrupt:\n"
                              "    print('stopped', flush=True); sys.stdin.read()\n",
                              f'sleep 600 & echo "$$ $!" > {mark}.new && mv {mark}.new {mark}; wait'],
                             cwd=ROOT, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    pids: list[int] = []
    try:
        wait_for(mark.exists, "the child's child")
        pids = [int(word) for word in mark.read_text().split()]
        child.send_signal(signal.SIGTERM)
        assert child.stdout.readline() == "stopped\n"
        assert not any(alive(pid) for pid in pids)  # gone before the interrupt went on
    finally:
        child.kill()
        child.communicate()
        for pid in pids:
            if alive(pid):
                os.kill(pid, signal.SIGKILL)


def test_a_tmpdir_whose_name_is_no_utf8_is_used_not_a_traceback(project, upstream, tmp_path):
    """Round 10b: a TMPDIR named with a byte that is no UTF-8 ended every run in a traceback
    (UnicodeEncodeError telling the watchdog of the run folder's lock); XDG_CACHE_HOME too."""
    odd = os.fsencode(tmp_path) + b"/\xff"
    os.makedirs(odd)
    env = {**os.environb, b"TMPDIR": odd, b"XDG_CACHE_HOME": odd + b"/cache"}
    code = ("import sys; from pathlib import Path; from k3overlay import cli, project\n"
            "cli.Project = lambda: project.Project(Path(sys.argv[1]))\n"
            "sys.exit(cli.main(sys.argv[2:]))")
    proc = subprocess.run([sys.executable, "-c", code, str(project.root), "-q", "--vllm-repo", str(upstream),
                           "--workdir", str(tmp_path / "wd")], env=env, capture_output=True, text=True,
                          timeout=120, cwd=str(Path(__file__).parent.parent))
    assert proc.returncode == errors.OK and "Traceback" not in proc.stderr, proc.stderr
    assert os.listdir(odd) == [b"cache"]  # its run folder gone with it
