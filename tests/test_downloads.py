"""The download cache: every cached file (sdist and release wheel) checked against the
index's sha256 on every use, re-fetched once when it fails, else exit 6 in one line."""

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

from k3overlay import errors, lock, progress, source
from k3overlay.job import Options, run_apply
from k3overlay.mirror import unpack
from k3overlay.project import ROOT, cache_dir
from k3overlay.wheel import readable

from .conftest import g
from .test_mirror import sdist_bytes
from .wheels import wheel_bytes

V = Version("0.1.0")


def release_file(kind: str, text: str) -> tuple[str, bytes]:
    """(file name, bytes) of a tiny sdist or wheel of vLLM 0.1.0 holding ``vllm/a.py``."""
    if kind == "sdist":
        return "vllm-0.1.0.tar.gz", sdist_bytes("0.1.0", {"vllm/a.py": text})
    return "vllm-0.1.0-py3-none-any.whl", wheel_bytes("0.1.0", {"vllm/a.py": text})


def a_py(kind: str, path, tmp_path) -> str:
    """What ``vllm/a.py`` says in the file the cache handed out (the consumers' own readers)."""
    if kind == "sdist":
        out = tmp_path / f"out{len(list(tmp_path.glob('out*')))}"
        unpack(path, out)
        return (out / "vllm/a.py").read_text()
    from .wheels import member

    return member(readable(path), "vllm/a.py").decode()


def use(kind: str, tmp_path) -> str:
    files = source.release_files()
    pkg = files.sdist(V) if kind == "sdist" else files.wheel(V)
    return files.use(pkg, lambda path: a_py(kind, path, tmp_path))


KINDS = ["sdist", "wheel"]


@pytest.mark.parametrize("kind", KINDS)
def test_downloaded_once_then_read_from_the_cache(kind, fake_index, tmp_path):
    name, data = release_file(kind, "A = 1\n")
    fake_index.publish(name, data)
    assert use(kind, tmp_path) == "A = 1\n" and use(kind, tmp_path) == "A = 1\n"
    assert fake_index.downloads[name] == 1
    cached = cache_dir() / ("sdists" if kind == "sdist" else "wheels") / name
    assert cached.read_bytes() == data
    assert [p.name for p in cached.parent.iterdir() if not p.name.startswith(".")] == [name]
    umask = os.umask(0o022)
    os.umask(umask)
    assert stat.S_IMODE(cached.stat().st_mode) == 0o644 & ~umask  # data, not a program


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("damage", ["truncated", "tampered"])
def test_a_damaged_cached_file_is_fetched_again(kind, damage, fake_index, tmp_path):
    name, data = release_file(kind, "A = 1\n")
    fake_index.publish(name, data)
    use(kind, tmp_path)
    cached = next(cache_dir().rglob(name))
    # tampered: a valid archive of the same name with other content, as a poisoned cache holds
    cached.write_bytes(data[: len(data) // 2] if damage == "truncated"
                       else release_file(kind, "A = 666\n")[1])
    assert use(kind, tmp_path) == "A = 1\n"
    assert fake_index.downloads[name] == 2 and cached.read_bytes() == data


@pytest.mark.parametrize("kind", KINDS)
def test_a_download_not_matching_the_index_is_exit_6_and_leaves_nothing(kind, fake_index, tmp_path):
    name, data = release_file(kind, "A = 1\n")
    fake_index.publish(name, data)
    fake_index.files[name] = release_file(kind, "A = 2\n")[1]  # served bytes != published sha256
    with pytest.raises(errors.SourceError, match=f"{name} from the package index does not match") as err:
        use(kind, tmp_path)
    assert err.value.exit_code == errors.SOURCE and "\n" not in str(err.value)
    assert not list(cache_dir().rglob("vllm-*"))


@pytest.mark.parametrize("kind", KINDS)
def test_an_unreadable_archive_is_fetched_again_once_then_exit_6(kind, fake_index, tmp_path,
                                                                 monkeypatch, capsys):
    monkeypatch.setattr(progress, "quiet", False)
    name, data = release_file(kind, "A = 1\n")
    fake_index.publish(name, data[: len(data) // 2])  # the index's own file is broken
    with pytest.raises(errors.SourceError, match="cannot be read, even fetched again") as err:
        use(kind, tmp_path)
    assert fake_index.downloads[name] == 2 and "\n" not in str(err.value)
    said = [line for line in capsys.readouterr().err.splitlines() if "fetching it again" in line]
    assert len(said) == 1 and said[0].startswith(f"{name} cannot be read (")
    assert not list(cache_dir().rglob("vllm-*"))


def test_no_published_sha256_means_no_use(fake_index, tmp_path):
    name, data = release_file("wheel", "A = 1\n")
    fake_index.publish(name, data)
    fake_index.digests[name] = ""
    with pytest.raises(errors.SourceError, match="publishes no sha256"):
        use("wheel", tmp_path)
    assert fake_index.downloads[name] == 0


def test_an_unreachable_index_is_exit_6(monkeypatch, tmp_path):
    monkeypatch.setenv("PIP_INDEX_URL", "http://127.0.0.1:9/simple/")  # discard port: refused
    with pytest.raises(errors.SourceError, match="cannot reach the package index: ") as err:
        use("sdist", tmp_path)
    assert "host='127.0.0.1', port=9" in str(err.value)  # requests' own first line, not a stand-in


def test_the_index_cannot_name_a_file_outside_the_cache(fake_index, tmp_path):
    fake_index.publish("vllm-0.1.0-py3-none-any.whl", release_file("wheel", "A = 1\n")[1])
    files = source.release_files()
    pkg = files.wheel(V)
    object.__setattr__(pkg, "filename", "../vllm-0.1.0-py3-none-any.whl")
    with pytest.raises(errors.SourceError, match="refusing to write it"):
        files.fetch(pkg)


def test_the_wheel_that_installs_here_is_chosen(fake_index):
    fake_index.publish("vllm-0.2.0-py3-none-any.whl", b"w")  # another release: never chosen
    fake_index.publish("vllm-0.1.0-cp38-abi3-win_arm64.whl", b"x")
    assert pytest.raises(errors.UsageError, source.release_files().wheel, V).match("--release-wheel")
    fake_index.publish("vllm-0.1.0-py3-none-any.whl", b"y")
    assert source.release_files().wheel(V).filename == "vllm-0.1.0-py3-none-any.whl"


def test_apply_with_a_truncated_release_on_the_index_is_one_line_exit_6(fake_index, tmp_path):
    """Issue 8's case end to end: before, a truncated sdist raised EOFError on every run."""
    sdist = sdist_bytes("0.28.0", {f"vllm/m{i}.py": f"x = {i}\n" * 5000 for i in range(20)})
    fake_index.publish("vllm-0.28.0.tar.gz", sdist[: len(sdist) // 2])
    proc = subprocess.run([sys.executable, str(ROOT / "apply.py"), "--check", "-q",
                           "--workdir", str(tmp_path / "wd")], capture_output=True, text=True)
    assert proc.returncode == errors.SOURCE, proc.stderr
    assert proc.stderr.count("\n") == 1 and "Traceback" not in proc.stderr
    assert "vllm-0.28.0.tar.gz" in proc.stderr and fake_index.downloads["vllm-0.28.0.tar.gz"] == 2


def test_the_latest_release_is_the_newest_final_sdist(fake_index):
    for version in ("0.1.0", "0.3.0rc1", "0.2.0.dev5"):  # a pre-release and a dev build: not final
        fake_index.publish(f"vllm-{version}.tar.gz", sdist_bytes(version, {"vllm/a.py": ""}))
    fake_index.publish("vllm-0.4.0-py3-none-any.whl", wheel_bytes("0.4.0", {"vllm/a.py": ""}))
    assert source.release_files().latest() == Version("0.1.0")


def test_no_final_release_on_the_index_is_exit_6(fake_index):
    fake_index.publish("vllm-0.3.0rc1.tar.gz", sdist_bytes("0.3.0rc1", {"vllm/a.py": ""}))
    with pytest.raises(errors.SourceError, match="^the package index lists no vLLM release sdist$"):
        source.release_files().latest()


# -- Found after issue 8: the cache's own files (``~/.cache/vllm-k3-overlay``) were opened by
# name, following links and waiting on FIFOs. A FIFO at the download lock hung the run for
# good; a link at a partial download was written through. Every file the tool keeps there
# (lock files, cached and partial downloads, the test environments' records, the CuTe DSL
# mark) is now opened without following a link or waiting on a FIFO: anything but a regular
# file is one line, exit 2, and left as it was.


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
