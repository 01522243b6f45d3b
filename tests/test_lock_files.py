"""Lock files the tool writes into: what else may sit at their paths, and who may take them.

A tester found three faults: a hard link at a lock file (what ``cp -al`` of a checkout
makes) had its other name truncated and rewritten; one ``sudo apply.py`` left lock files
only root could open, and every later run of the user's failed; a project the user cannot
write (a read-only mount, a shared install of root's) failed every run, ``--check`` too,
as its lock could not be made in its git folder. A lock needs only a descriptor to
``flock``, read-only will do: a lock file is made readable to every user, written only
where it can be, and a reader of a project whose lock cannot be made there locks it in its
cache. The tests that need another user run as root (a child becomes ``nobody``), and the
read-only ones mount a folder read-only; each skips, saying why, where it cannot.
"""

from __future__ import annotations

import fcntl
import os
import shutil
import signal
import stat
import subprocess
import sys
import sysconfig
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import pytest

from k3overlay import claim, lock, projectlock
from k3overlay.errors import UsageError
from k3overlay.export import export
from k3overlay.job import Options, run_apply
from k3overlay.project import Project

from .conftest import g

ROOT = Path(__file__).resolve().parent.parent
RUNNER = ("import sys; from pathlib import Path; from k3overlay import cli; "
          "from k3overlay.project import Project; cli.Project = lambda: Project(Path(sys.argv[1])); "
          "sys.exit(cli.main(sys.argv[2:]))")
USER = 65534  # nobody: the other user of the tests that need one
VICTIM = "the user's own file: never truncated, never rewritten\n"


def committed(root: Path) -> Path:
    """``root`` made a git checkout of its files (the project's lock then lives in its ``.git``)."""
    (root / ".gitignore").write_bytes((ROOT / ".gitignore").read_bytes())
    g(root, "init", "-q")
    g(root, "add", "-A")
    g(root, "commit", "-q", "-m", "the project")
    return root


def one_line(err: pytest.ExceptionInfo) -> str:
    text = str(err.value)
    assert "\n" not in text and "Traceback" not in text, text
    return text


# --- a hard link at a lock file --------------------------------------------------------------------

@pytest.mark.parametrize("where", ["the checkout's claim", "the project's lock",
                                   "the workdir's lock in the cache", "a place lock in the cache"])
def test_a_hard_link_at_a_lock_file_is_refused_and_its_other_name_kept(project, upstream, tmp_path, where):
    """A hard link at a lock file (``rm wd/.git/k3overlay.lock; ln victim …``, or a copy made
    with ``cp -al``) had the file it is truncated and the holder's pid written in it."""
    committed(project.root)
    wd = tmp_path / "wd"
    for _ in range(2):  # the second run claims the checkout the first made
        assert run_apply(project, Options(vllm_repo=str(upstream), workdir=wd)).ok
    path = {"the checkout's claim": wd / ".git" / claim.FILE,
            "the project's lock": project.root / ".git" / "k3overlay-project.lock",
            "the workdir's lock in the cache": lock.workdir_lock_path(wd),
            "a place lock in the cache": sorted((lock.cache_dir() / "locks").glob("place-*.lock"))[-1]}[where]
    assert path.is_file()
    victim = tmp_path / "victim"
    victim.write_text(VICTIM)
    path.unlink()
    os.link(victim, path)
    for check in (True, False):
        with pytest.raises(UsageError) as err:
            run_apply(project, Options(vllm_repo=str(upstream), workdir=wd, check=check))
        said = one_line(err)
        assert str(path) in said and "hard link" in said and "remove it" in said
        assert victim.read_text() == VICTIM and os.stat(victim).st_nlink == 2


def test_apply_with_a_hard_link_at_the_claim_is_one_line_exit_2(project, upstream, tmp_path):
    """The tester's own command: ``apply.py --workdir wd`` after ``ln victim wd/.git/k3overlay.lock``."""
    wd = tmp_path / "wd"
    for _ in range(2):
        assert run_apply(project, Options(vllm_repo=str(upstream), workdir=wd)).ok
    victim = tmp_path / "victim"
    victim.write_text(VICTIM)
    (wd / ".git" / claim.FILE).unlink()
    os.link(victim, wd / ".git" / claim.FILE)
    ran = subprocess.run([sys.executable, "-c", RUNNER, str(project.root), "-q", "--vllm-repo", str(upstream),
                          "--workdir", str(wd)], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert ran.returncode == 2, ran.stderr
    assert ran.stderr.count("\n") == 1 and f"{wd / '.git' / claim.FILE} is a hard link" in ran.stderr
    assert victim.read_text() == VICTIM


@pytest.mark.parametrize("name", ["sdists/.lock", ".mirror.lock", "envs/x.lock"])
def test_a_hard_link_at_a_cache_lock_is_refused(tmp_path, name):
    """The cache's own locks (downloads, the release mirror, test environments) alike."""
    path = lock.cache_dir() / name
    path.parent.mkdir(parents=True, exist_ok=True)
    victim = tmp_path / "victim"
    victim.write_text(VICTIM)
    os.link(victim, path)
    with pytest.raises(UsageError) as err, lock.held(path):
        pass
    assert str(path) in one_line(err) and "hard link" in str(err.value)
    assert victim.read_text() == VICTIM


# --- who may take a lock file --------------------------------------------------------------------

def test_a_lock_file_is_made_readable_to_every_user_whatever_the_umask(tmp_path):
    """A lock file another user's run made must open for this one: a lock needs only a
    descriptor, and ``flock`` takes one opened read-only. ``sudo`` with umask 077 made them
    0600, which no one else can open."""
    old = os.umask(0o077)
    try:
        with lock.held(tmp_path / "a.lock"), lock.holding(tmp_path / "b.lock", tmp_path, print, shared=True):
            pass
    finally:
        os.umask(old)
    for name in ("a.lock", "b.lock"):
        mode = stat.S_IMODE(os.stat(tmp_path / name).st_mode)
        assert mode & 0o044 == 0o044 and mode & 0o022 == 0, oct(mode)


def _dead_pid() -> int:
    child = subprocess.Popen(["true"])
    child.wait()
    return child.pid


@pytest.mark.parametrize("content, holder", [
    ("apply.py (pid {me})\n", "apply.py (pid {me})"),
    ("apply.py (pid {me})\n{{\"journal\": \"/x\"}}\n", "apply.py (pid {me})"),  # a claim
    ("apply.py (pid {dead})\n", "another run"),  # written by a run gone since: this holder could not write
    ("\x1b]0;pwned\x07\x1b[2J rm -rf ~\n", "another run"),
    ("", "another run"),
    ("\udcff\udcfe" * 150, "another run")])  # (bytes no UTF-8 decoder takes)
def test_whom_a_run_waits_for_is_read_from_the_lock_file_safely(tmp_path, content, holder):
    """The holder's line is what the last run that could write in the lock file wrote: a run
    holding it read-only (another user's file) writes none, so a line may be stale, or anyone's."""
    path = tmp_path / "x.lock"
    path.write_bytes(content.format(me=os.getpid(), dead=_dead_pid()).encode(errors="surrogateescape"))
    fd = os.open(path, os.O_RDONLY)
    fcntl.flock(fd, fcntl.LOCK_EX)  # a holder that could not write its line
    said: list[str] = []

    def wait() -> None:
        with lock.holding(path, tmp_path, said.append, shared=True):
            pass

    waiter = threading.Thread(target=wait, daemon=True)
    waiter.start()
    deadline = time.monotonic() + 10
    while not said and time.monotonic() < deadline:
        time.sleep(0.02)
    os.close(fd)
    waiter.join(10)
    assert said == [f"waiting for {holder.format(me=os.getpid())} to finish with {tmp_path}"]


# --- another user: a run of root's, a project of root's ------------------------------------------

@dataclass
class Shared:
    folder: Path  # USER can reach it (tmp_path is under pytest's folder, which only root enters)
    env: dict[str, str]  # a child's as USER: its own HOME, cache, TMPDIR and global git config
    python: str  # a python USER can run with the tool's packages

    def run(self, project_root: Path, *args: str) -> subprocess.CompletedProcess:
        """apply.py on the project at ``project_root``, as USER."""
        return subprocess.run([self.python, "-c", RUNNER, str(project_root), *args], cwd=ROOT, env=self.env,
                              capture_output=True, text=True, timeout=180, preexec_fn=_become_user)

    def copy(self, source: Path, name: str) -> Path:
        target = self.folder / name
        shutil.copytree(source, target, symlinks=True)
        return target


def _become_user() -> None:
    signal.signal(signal.SIGINT, signal.SIG_DFL)
    os.setgroups([])
    os.setgid(USER)
    os.setuid(USER)


def chown_tree(top: Path, uid: int, keep: tuple[Path, ...] = ()) -> None:
    os.lchown(top, uid, uid)
    for folder, folders, files in os.walk(top):
        for name in folders + files:
            if Path(folder, name) not in keep:
                os.lchown(Path(folder, name), uid, uid)


def _runs(python: str, env: dict[str, str]) -> bool:
    """Whether USER can run ``python`` with the tool's packages."""
    try:
        return subprocess.run([python, "-c", "import k3overlay.cli"], cwd=ROOT, env=env, capture_output=True,
                              preexec_fn=_become_user, timeout=60).returncode == 0
    except OSError:  # (not there, or below a folder USER cannot enter)
        return False


@pytest.fixture
def shared():
    if os.geteuid() != 0:
        pytest.skip("needs root: a child runs as another user (CI runs as root)")
    folder = Path(tempfile.mkdtemp(prefix="k3-lock-files-"))
    try:
        os.chmod(folder, 0o755)
        home = folder / "home"
        for sub in ("t", "cache"):
            (home / sub).mkdir(parents=True)
        (home / "gitconfig").write_text("")
        chown_tree(home, USER)
        env = {**os.environ, "HOME": str(home), "XDG_CACHE_HOME": str(home / "cache"),
               "TMPDIR": str(home / "t"), "GIT_CONFIG_GLOBAL": str(home / "gitconfig"),
               "PYTHONPATH": os.pathsep.join([str(ROOT), sysconfig.get_paths()["purelib"]])}
        # sys.executable may be below a folder only root enters (/root/.pyenv): else the system's
        candidates = [sys.executable, f"/usr/bin/python{sys.version_info[0]}.{sys.version_info[1]}"]
        python = next((c for c in candidates if _runs(c, env)), None)
        if python is None:
            pytest.skip(f"no python that uid {USER} can run with the tool's packages")
        yield Shared(folder, env, python)
    finally:
        shutil.rmtree(folder, ignore_errors=True)


def test_one_run_as_root_does_not_lock_the_user_out(project, upstream, shared):
    """``sudo apply.py`` once (here with umask 077) left the project's lock and the claim root's,
    0600: every later run of the user's failed, "cannot open …/k3overlay-project.lock:
    Permission denied", even a ``--check`` into another workdir. (What else root's git wrote
    in the checkout is git's and sudo's business: the test gives it back to the user.)"""
    up = shared.copy(upstream, "upstream")
    proj = committed(shared.copy(project.root, "project"))
    wd = shared.folder / "wd"
    old = os.umask(0o077)
    try:
        for _ in range(2):  # the second run claims the checkout the first made
            assert run_apply(Project(proj), Options(vllm_repo=str(up), workdir=wd)).ok
    finally:
        os.umask(old)
    roots = (proj / ".git" / "k3overlay-project.lock", wd / ".git" / claim.FILE)
    chown_tree(shared.folder, USER, keep=roots)
    assert [os.stat(p).st_uid for p in roots] == [0, 0]
    again = shared.run(proj, "-q", "--vllm-repo", str(up), "--workdir", str(wd))
    assert again.returncode == 0, again.stderr
    # the claim held read-only names no journal: said, with what to do
    assert f"note: {roots[1]} is not yours to write: held, but a killed run's steps are found only under " \
        f"this cache; remove it once no run is going" in again.stderr, again.stderr
    check = shared.run(proj, "-q", "--check", "--vllm-repo", str(up), "--workdir", str(shared.folder / "w2"))
    assert check.returncode == 0, check.stderr
    exported = shared.run(proj, "-q", "--export", "--workdir", str(wd))  # a writer takes it read-only too
    assert exported.returncode == 0, exported.stderr
    assert [os.stat(p).st_uid for p in roots] == [0, 0]  # taken read-only, never replaced


@pytest.mark.parametrize("lock_file", ["none yet", "made by an export"])
def test_a_project_the_user_cannot_write_is_read_all_the_same(project, upstream, shared, lock_file):
    """A shared install of root's, run by a user: every run failed ("cannot open
    …/.git/k3overlay-project.lock: Permission denied"); before the lock moved into the
    project's git folder, apply and --check worked. A reader locks the project read-only where
    its lock file is there (an export made it), else in its own cache; an export, which could
    not write the project anyway, stops in one line."""
    up = shared.copy(upstream, "upstream")
    proj = committed(shared.copy(project.root, "project"))
    chown_tree(shared.folder / "upstream", USER)
    os.chown(shared.folder, USER, USER)  # the user's workdirs go there; the project stays root's
    lock_path = proj / ".git" / "k3overlay-project.lock"
    if lock_file == "made by an export":
        old = os.umask(0o077)
        try:
            with projectlock.writing(Project(proj), print):
                pass
        finally:
            os.umask(old)
    before = g(proj, "status", "--porcelain", "--untracked-files=all", "--ignored")
    wd = shared.folder / "wd"
    check = shared.run(proj, "-q", "--check", "--vllm-repo", str(up), "--workdir", str(wd))
    assert check.returncode == 0, check.stderr
    ran = shared.run(proj, "-q", "--vllm-repo", str(up), "--workdir", str(wd))
    assert ran.returncode == 0, ran.stderr
    exported = shared.run(proj, "-q", "--export", "--workdir", str(wd))
    assert exported.returncode == 2 and exported.stderr.count("\n") == 1, exported.stderr
    assert g(proj, "status", "--porcelain", "--untracked-files=all", "--ignored") == before
    assert lock_path.exists() == (lock_file == "made by an export")


def test_a_reader_and_an_export_of_two_users_take_one_lock(tmp_path, shared):
    """Where both reach the project's lock file, a reader holding it read-only still waits for
    an export, and says for whom."""
    proj = shared.folder / "project"
    proj.mkdir()
    g(proj, "init", "-q")
    old = os.umask(0o077)
    try:
        with projectlock.writing(Project(proj), print):
            child = subprocess.Popen(
                [shared.python, "-c", "import sys; from pathlib import Path; "
                 "from k3overlay import projectlock; from k3overlay.project import Project\n"
                 "with projectlock.reading(Project(Path(sys.argv[1])), lambda s: print(s, flush=True)):\n"
                 "    print('reading', flush=True)", str(proj)],
                cwd=ROOT, env=shared.env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                preexec_fn=_become_user)
            first = child.stdout.readline()
            assert first == f"waiting for apply.py (pid {os.getpid()}) to finish with {proj}\n", \
                first + child.stderr.read() if first == "" else first
            time.sleep(0.3)
            assert child.poll() is None  # still waiting
    finally:
        os.umask(old)
    out, err = child.communicate(timeout=30)
    assert child.returncode == 0 and out == "reading\n", err


# --- a read-only file system -------------------------------------------------------------------

class ReadOnly:
    """``source`` mounted read-only at ``at`` for the block (skips where it cannot mount)."""

    def __init__(self, source: Path, at: Path) -> None:
        self.source, self.at = source, at

    def __enter__(self) -> Path:
        self.at.mkdir()
        if os.geteuid() != 0 or subprocess.run(["mount", "--bind", str(self.source), str(self.at)],
                                               capture_output=True).returncode:
            pytest.skip("a read-only bind mount needs root (CI runs as root)")
        if subprocess.run(["mount", "-o", "remount,bind,ro", str(self.at)], capture_output=True).returncode:
            subprocess.run(["umount", str(self.at)], check=True)
            pytest.skip("this system cannot remount a bind mount read-only")
        return self.at

    def __exit__(self, *exc: object) -> None:
        subprocess.run(["umount", str(self.at)], check=True)


@pytest.mark.parametrize("lock_file", ["none yet", "made by an export"])
def test_a_project_on_a_read_only_file_system_is_read_all_the_same(project, upstream, tmp_path, lock_file):
    """A project bind-mounted read-only: apply and --check failed, "cannot open
    …/.git/k3overlay-project.lock: Read-only file system". Reading the project writes nothing
    in it; an export stops in one line."""
    committed(project.root)
    if lock_file == "made by an export":
        with projectlock.writing(project, print):
            pass
    before = g(project.root, "status", "--porcelain", "--untracked-files=all", "--ignored")
    with ReadOnly(project.root, tmp_path / "ro") as alias:
        read_only = Project(alias)
        assert run_apply(read_only, Options(vllm_repo=str(upstream), workdir=tmp_path / "w1", check=True)).ok
        assert run_apply(read_only, Options(vllm_repo=str(upstream), workdir=tmp_path / "w2")).ok
        with pytest.raises(UsageError) as err:
            export(read_only, tmp_path / "w2")
        assert "Read-only file system" in one_line(err)
    assert g(project.root, "status", "--porcelain", "--untracked-files=all", "--ignored") == before
    assert (project.root / ".git" / "k3overlay-project.lock").exists() == (lock_file == "made by an export")


def test_a_read_only_checkouts_claim_is_waited_on_read_only(project, upstream, tmp_path):
    """A checkout mounted read-only: --check waits on its claim (made by an earlier run) read-only.
    (--check itself then stops in one line: its scratch tree commits into the checkout's
    object store, ``gitworktree``; it stopped at the claim, "Read-only file system".)"""
    wd = tmp_path / "wd"
    for _ in range(2):
        assert run_apply(project, Options(vllm_repo=str(upstream), workdir=wd)).ok
    assert (wd / ".git" / claim.FILE).is_file()
    with ReadOnly(wd, tmp_path / "ro") as alias:
        with claim.claimed(alias, tmp_path / "a.journal", print, lambda _: None, check=True):
            pass
        with pytest.raises(UsageError) as err:
            run_apply(project, Options(vllm_repo=str(upstream), workdir=alias, check=True))
        assert one_line(err).startswith(f"cannot write git objects into {alias / '.git' / 'objects'}")
