"""Found after issue 8: the cache's own files (``~/.cache/vllm-k3-overlay``) were opened by
name, following links and waiting on FIFOs. A FIFO at the download lock hung the run for
good; a link at a partial download was written through. Every file the tool keeps there
(lock files, cached and partial downloads, the test environments' records, the CuTe DSL
mark) is now opened without following a link or waiting on a FIFO: anything but a regular
file is one line, exit 2, and left as it was."""

from __future__ import annotations

import errno
import fcntl
import hashlib
import os
import signal
import stat
import subprocess
import sys
from pathlib import Path

import pytest
from packaging.version import Version

from k3overlay import errors, lock, source
from k3overlay.job import Options, run_apply
from k3overlay.project import ROOT, cache_dir

from .conftest import g
from .test_downloads import release_file
from .test_mirror import sdist_bytes

sys.path.insert(0, str(ROOT / "ci"))

import target_env  # noqa: E402
from gpu_stage import ab, stage  # noqa: E402

WAIT_S = 30  # far more than any case takes; a run waiting on a FIFO fails instead of hanging
WHAT = ["FIFO", "link to a file outside", "dangling link"]
KIND_WORD = {"FIFO": "FIFO", "link to a file outside": "symbolic link",
             "dangling link": "symbolic link"}


@pytest.fixture(autouse=True)
def no_hang():
    """Turn a wait on a FIFO into a failure after WAIT_S seconds (the open is interrupted)."""
    def expire(_signum, _frame):
        raise TimeoutError(f"still waiting after {WAIT_S} s")

    previous = signal.signal(signal.SIGALRM, expire)
    signal.alarm(WAIT_S)
    yield
    signal.alarm(0)
    signal.signal(signal.SIGALRM, previous)


def plant(path: Path, what: str, outside: Path):
    """Put ``what`` at ``path``; return a check that it and what it points at are as they were."""
    path.parent.mkdir(parents=True, exist_ok=True)
    outside.parent.mkdir(parents=True, exist_ok=True)
    if what == "FIFO":
        os.mkfifo(path)
        return lambda: stat.S_ISFIFO(os.lstat(path).st_mode)
    if what == "link to a file outside":
        outside.write_bytes(b"keep\n")
    os.symlink(outside, path)
    exists = outside.exists()
    return lambda: (path.is_symlink() and outside.exists() == exists
                    and (not exists or outside.read_bytes() == b"keep\n"))


@pytest.mark.parametrize("what", WHAT)
@pytest.mark.parametrize("name", [".lock", "{file}", "{file}.part"])
@pytest.mark.parametrize("kind", ["sdist", "wheel"])
def test_a_cache_file_that_is_not_a_regular_file_is_refused(kind, name, what, fake_index, tmp_path):
    file, data = release_file(kind, "A = 1\n")
    fake_index.publish(file, data)
    path = cache_dir() / f"{kind}s" / name.format(file=file)
    as_it_was = plant(path, what, tmp_path / "outside" / "target")
    files = source.release_files()
    pkg = files.sdist(Version("0.1.0")) if kind == "sdist" else files.wheel(Version("0.1.0"))
    with pytest.raises(errors.UsageError) as err:
        files.fetch(pkg)
    assert str(err.value).startswith(f"{path} is a {KIND_WORD[what]}, not a regular file; ")
    assert err.value.exit_code == errors.USAGE and "\n" not in str(err.value)
    assert as_it_was() and fake_index.downloads[file] == 0


def workdir_lock_path(workdir: Path) -> Path:
    """Where README's lock scheme puts the lock of ``workdir``: sha256 of its absolute path."""
    key = hashlib.sha256(os.fsencode(workdir.resolve())).hexdigest()[:32]
    return cache_dir() / "locks" / f"{key}.lock"


@pytest.mark.parametrize("where", ["the download lock", "the mirror lock", "the workdir lock"])
def test_apply_with_a_fifo_at_a_lock_file_is_one_line_exit_2_not_a_hang(where, fake_index, tmp_path):
    """The reported case, end to end: before, ``apply.py`` waited on the FIFO for good."""
    fake_index.publish("vllm-0.28.0.tar.gz", sdist_bytes("0.28.0", {"vllm/a.py": "A = 1\n"}))
    workdir = tmp_path / "wd"
    path = {"the download lock": cache_dir() / "sdists" / ".lock",
            "the mirror lock": cache_dir() / ".mirror.lock",
            "the workdir lock": workdir_lock_path(workdir)}[where]
    as_it_was = plant(path, "FIFO", tmp_path / "unused")
    proc = subprocess.run([sys.executable, str(ROOT / "apply.py"), "--check", "-q",
                           "--workdir", str(workdir)], capture_output=True, text=True,
                          timeout=WAIT_S - 5)
    assert proc.returncode == errors.USAGE, proc.stderr
    assert proc.stderr.splitlines() == [
        f"apply.py: error: {path} is a FIFO, not a regular file; refusing to use it (the tool "
        f"keeps only its own files there: remove it)"]
    assert as_it_was() and not workdir.exists()


def test_target_environment_lock_and_record_are_never_followed_or_waited_on(tmp_path, monkeypatch):
    tree = tmp_path / "tree"
    (tree / "requirements").mkdir(parents=True)
    (tree / "requirements" / "common.txt").write_text("regex\n")
    key = target_env.spec_of(tree).key
    root = tmp_path / "envs"
    lock_as_it_was = plant(root / f"{key}.lock", "FIFO", tmp_path / "unused")
    with pytest.raises(errors.UsageError, match="is a FIFO, not a regular file"):
        target_env.ensure(tree, root)
    assert lock_as_it_was()
    os.unlink(root / f"{key}.lock")

    # a record that is a FIFO is not read (it would never end): the environment is built again
    (root / key).mkdir(parents=True)
    os.mkfifo(root / key / "env.json")
    built = []

    def build(spec, tree, home):
        built.append(home)
        (home / "env.json").unlink()  # the real build starts from an empty folder too
        (home / "env.json").write_text('{"installed_torch": "2.13.0"}')

    monkeypatch.setattr(target_env, "_build", build)
    env = target_env.ensure(tree, root)
    assert built == [root / key] and env.torch == "2.13.0"


def test_cute_dsl_mark_is_not_written_through_a_link(tmp_path, monkeypatch):
    lines = ("nvidia-cutlass-dsl==4.8.0",)
    key = hashlib.sha256(b'["nvidia-cutlass-dsl==4.8.0"]').hexdigest()[:16]
    outside = tmp_path / "outside" / "mark"
    as_it_was = plant(cache_dir() / "cute-dsl" / key / ".complete", "dangling link", outside)
    monkeypatch.setattr(stage.subprocess, "run", lambda *a, **k: subprocess.CompletedProcess(a, 0))
    with pytest.raises(RuntimeError, match=r"refusing to write \.complete: it is a symbolic link"):
        stage.cute_dsl_site(lines)
    assert as_it_was() and not outside.exists()


@pytest.mark.parametrize("what", WHAT)
def test_gpu_lock_in_the_shared_tmp_is_never_followed_or_waited_on(what, tmp_path):
    with ab.GpuLock(str(tmp_path / "fine.lock")):  # a regular file, made on first use
        assert (tmp_path / "fine.lock").is_file()
    path = tmp_path / "k3-gpu.lock"
    as_it_was = plant(path, what, tmp_path / "outside" / "target")
    with pytest.raises(OSError):
        with ab.GpuLock(str(path)):
            pass
    assert as_it_was()


def test_a_relative_xdg_cache_home_is_ignored(monkeypatch, tmp_path):
    """Found by the second adversarial pass: ``XDG_CACHE_HOME=cache`` put the lock files and the
    release mirror under the folder apply.py ran from (a checkout, this repository); the XDG
    spec says a relative path there is to be ignored."""
    from k3overlay.project import cache_dir

    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    monkeypatch.chdir(tmp_path)
    for relative in ("cache", "./cache", "~/cache"):
        monkeypatch.setenv("XDG_CACHE_HOME", relative)
        assert cache_dir() == tmp_path / "home" / ".cache" / "vllm-k3-overlay", relative
    for home in ("home", "./home"):  # no absolute home either: said, not a cache in this folder
        monkeypatch.setenv("HOME", home)
        with pytest.raises(errors.UsageError) as err:
            cache_dir()
        assert str(err.value) == (f"no folder for the cache: $HOME is {home!r}; set XDG_CACHE_HOME "
                                  f"(or HOME) to an absolute path")


@pytest.mark.parametrize("where, moved_by", [(".lock", "XDG_CACHE_HOME"), ("owner.lock", "TMPDIR")])
def test_a_file_system_without_locks_is_one_line_not_a_traceback(project, upstream, tmp_path,
                                                                monkeypatch, where, moved_by):
    """Found by the second adversarial pass: a cache (or TMPDIR) on a network file system
    without flock (NFS without lockd, Lustre mounted noflock: common home folders on GPU
    clusters) ended the run in a traceback (OSError ENOLCK)."""
    real = fcntl.flock
    wd = tmp_path / "wd"
    g(tmp_path, "clone", "-q", str(upstream), str(wd))  # an existing checkout: a worktree is made

    def no_locks_there(fd, operation):
        if os.readlink(f"/proc/self/fd/{fd}").endswith(where):
            raise OSError(errno.ENOLCK, os.strerror(errno.ENOLCK))
        real(fd, operation)

    monkeypatch.setattr(lock.fcntl, "flock", no_locks_there)
    with pytest.raises(errors.UsageError) as err:
        run_apply(project, Options(vllm_repo=str(upstream), workdir=wd, check=True))
    message = str(err.value)
    assert message.startswith("cannot lock ") and message.endswith(
        f".lock (No locks available): its file system does not support locks; point {moved_by} "
        f"at a local disk")
    assert g(wd, "worktree", "list", "--porcelain").count("worktree ") == 1  # none of ours left
