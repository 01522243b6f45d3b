"""One run at a time per checkout: a lock per work directory, held for the whole job.

Two runs on one checkout (even two ``--check``) would share its temporary
worktrees, fetches and branch switch; two runs into one fresh ``--workdir``
would clone into the same folder. So every job holds an exclusive ``flock``
keyed by the work directory's absolute path (the folder need not exist yet), and
one keyed by the folder's device and inode where it exists (one checkout reached by
two names); a second run waits, saying for whom. The lock files live in the cache
directory, never in the user's checkout; the kernel drops a lock when its
holder dies, so a killed run never leaves a stale lock behind; but not before the
killed run's git children are gone: a copy of each lock is held by its watchdog
(``reaper``) until then, so the next run waits for them instead of racing them.

``held`` is the same exclusive lock for the cache's own files (downloads, the
release mirror, test environments). Every lock file is opened without following
a link or waiting on a FIFO (``files.open_regular``): anything but a regular
file with one name at its path (a hard link too: writing the holder's line in it
would change the file under its other names) is refused in one line, exit 2.

A lock needs only a descriptor to ``flock``, and one opened read-only will do: a
lock file is made readable to every user (0644, whatever the umask), and one this
user cannot write in (another user's: a run under ``sudo`` made it; a read-only
file system) is opened read-only, its holder's line left as it is. So one run as
root locks no one out, and the user's runs and root's still wait for each other.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import hashlib
import os
import pwd
import re
import secrets
import shutil
import stat
import time
from collections.abc import Callable, Iterator
from pathlib import Path

from . import reaper
from .errors import UsageError
from .files import open_regular
from .interrupts import deferred
from .project import cache_dir
from .regular import CannotOpen, own_folder

# why a lock file cannot be opened for writing where it may still be opened read-only (or why
# one cannot be made: its folder is another user's, or on a read-only file system)
_NOT_WRITABLE = (errno.EACCES, errno.EPERM, errno.EROFS)
_HOLDER = re.compile(r"apply\.py \(pid ([1-9][0-9]{0,9})\)")  # a lock file's first line


class CannotMake(UsageError):
    """A lock file is not there and cannot be made: its folder is not this user's to write in
    (another user's, a read-only file system). ``projectlock`` then locks a reader elsewhere."""


@contextlib.contextmanager
def workdir_lock(workdir: Path, say: Callable[[str], None]) -> Iterator[None]:
    """Hold the lock of ``workdir`` (need not exist yet) for the block; the locks of its places
    (its names below each existing folder above it, that folder known by device and inode: a
    fresh workdir reached by two names, before either run made it or the folders on its way);
    and where it exists the lock of the folder itself (its device and inode): one checkout
    reached by two names (a bind mount, a second mount of a network share) shares them.

    If another run holds one, ``say`` is told once and the call waits (Ctrl-C stops the
    wait). Raises UsageError if a lock file cannot be made.
    """
    locks = own_folder(cache_dir() / "locks")
    paths = [workdir_lock_path(workdir)]
    # the same names below the same folder, under any name of that folder: every folder above
    # that exists, as a run that made the folders between sees them and one before it did not
    paths += [locks / f"place-{hashlib.sha256(place.encode()).hexdigest()[:32]}.lock"
              for place in _places(workdir)]
    try:
        st = os.stat(workdir)
    except OSError:  # a fresh workdir (or none can be: the job says why): its place stands for it
        st = None
    if st is not None:
        paths.append(locks / f"folder-{st.st_dev}-{st.st_ino}.lock")
    with contextlib.ExitStack() as stack:  # (always in this order: no two runs wait on each other)
        for path in paths:
            stack.enter_context(holding(path, workdir, say, shared=False))
        yield


@contextlib.contextmanager
def holding(path: Path, workdir: Path, say: Callable[[str], None], *, shared: bool) -> Iterator[int]:
    """Hold the lock file ``path`` (made if missing) exclusive or ``shared`` for the block (yields
    its descriptor, for ``take`` to turn it into the other kind), waiting (and telling ``say``
    once whom for) while another run holds it; the holder's pid is written in it for the next
    one, where this user can write in it (``lock_file``). Raises UsageError as ``lock_file``."""
    fd = lock_file(path)
    try:
        take(fd, path, workdir, say, shared)
        if writable(fd):
            with contextlib.suppress(OSError):  # who holds it, for a run that waits: not on a full disk
                os.ftruncate(fd, 0)
                os.pwrite(fd, f"apply.py (pid {os.getpid()})\n".encode(), 0)
        with watched(fd, path):
            yield fd
    finally:
        os.close(fd)


def take(fd: int, path: Path, workdir: Path, say: Callable[[str], None], shared: bool) -> None:
    """Lock the lock file ``path`` (open as ``fd``) exclusive or ``shared``, telling ``say`` once
    whom it waits for (the pid the holder wrote: ``holder``) while another run holds it."""
    mode = fcntl.LOCK_SH if shared else fcntl.LOCK_EX
    try:
        flock(fd, path, mode | fcntl.LOCK_NB)
    except BlockingIOError:
        say(f"waiting for {holder(fd)} to finish with {workdir}")
        flock(fd, path, mode)


def holder(fd: int) -> str:
    """Who holds the lock file open as ``fd``, from its first line: "apply.py (pid N)" where
    process N lives; else "another run". The line is the last one a run that could write in
    the file wrote: a holder that could not (another user's file) left it stale, and text
    that is no such line (anyone's, with a terminal's control codes) is never shown."""
    try:
        found = _HOLDER.fullmatch(os.pread(fd, 200, 0).split(b"\n", 1)[0].decode("ascii", "replace").strip())
    except OSError:
        found = None
    if found is None:
        return "another run"
    try:
        os.kill(int(found[1]), 0)  # (signal 0: only whether it is there)
    except PermissionError:
        pass  # another user's process: there
    except (OSError, OverflowError):  # gone (ProcessLookupError), or no pid this system has
        return "another run"
    return found[0]


def _places(workdir: Path) -> list[str]:
    """``workdir`` as each existing folder above it (its device and inode) and the names below
    that folder, the topmost first."""
    places = []
    for above in reversed(workdir.parents):
        try:
            st = os.stat(above)
        except OSError:
            break  # (nothing below a folder that is not there)
        places.append(f"{st.st_dev}-{st.st_ino}/{workdir.relative_to(above)}")
    return places


def workdir_lock_path(workdir: Path) -> Path:
    """The lock file of ``workdir`` (one folder, one lock, however it was named); its
    journal (``journal``) is the same path ending in ``.journal``. UsageError if ``locks/``
    in the cache is a link or no folder (``regular.own_folder``)."""
    return own_folder(cache_dir() / "locks") / f"{journal_key(workdir)}.lock"


def journal_key(workdir: str | Path) -> str:
    """The name of ``workdir``'s lock and journal in the cache: its resolved path, hashed."""
    return hashlib.sha256(os.fsencode(Path(workdir).resolve())).hexdigest()[:32]


def journal_path(workdir: Path) -> Path:
    """The journal of ``workdir`` (``journal``): beside its lock in the cache."""
    return workdir_lock_path(workdir).with_suffix(".journal")


@contextlib.contextmanager
def held(path: Path) -> Iterator[None]:
    """Hold the exclusive lock of the lock file ``path`` (made if missing) for the block,
    waiting for whoever holds it. Raises UsageError as ``lock_file``."""
    fd = lock_file(path)
    try:
        flock(fd, path, fcntl.LOCK_EX)
        with watched(fd, path):
            yield
    finally:
        os.close(fd)


@contextlib.contextmanager
def watched(fd: int, path: Path) -> Iterator[None]:
    """The lock on ``fd`` held for the block, a copy of it with the watchdog (``reaper``):
    if the tool is killed, the lock is free only once its git children are gone."""
    reaper.hold(str(path), fd)
    try:
        yield
    finally:
        fcntl.flock(fd, fcntl.LOCK_UN)  # every copy: the watchdog's too
        reaper.drop(str(path))


def flock(fd: int, path: Path, operation: int, *, moved_by: str = "XDG_CACHE_HOME") -> None:
    """``flock`` the lock file ``path``. BlockingIOError (held, with ``LOCK_NB``) goes to the
    caller; any other failure (a network file system without locks: ENOLCK, ENOSYS,
    EOPNOTSUPP) is a UsageError in one line: point ``moved_by`` at a local disk."""
    try:
        fcntl.flock(fd, operation)
    except BlockingIOError:
        raise
    except OSError as err:
        raise UsageError(f"cannot lock {path} ({err.strerror}): its file system does not "
                         f"support locks; point {moved_by} at a local disk") from err


def lock_file(path: Path) -> int:
    """A descriptor of the lock file ``path``, made (and its folder) if missing, readable to
    every user whatever the umask (0644: another user's run may need to take it too).

    A lock needs only a descriptor to ``flock``: a lock file this user cannot write in
    (another user's, a read-only file system) is opened read-only (``writable`` says which).
    Raises CannotMake (a UsageError) if it is missing and its folder is not this user's to
    write in (EACCES, EPERM, EROFS); UsageError (one line) if it cannot be made or opened
    otherwise (another user's that this one cannot read), or if anything but a regular file
    with one name is there (a link is not followed, a FIFO not waited on, a hard link not
    written in: ``open_regular``).
    """
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
    except OSError as err:
        kind = CannotMake if err.errno in _NOT_WRITABLE else UsageError
        raise kind(f"cannot make the lock file {path}: {err.strerror}") from err
    try:
        fd = open_regular(path, os.O_RDWR | os.O_CREAT, 0o644, one_link=True)
    except CannotOpen as err:
        if err.errno not in _NOT_WRITABLE:
            raise
        return _read_only(path, err)
    except OSError as err:  # (its folder removed meanwhile)
        raise UsageError(f"cannot make the lock file {path}: {err.strerror}") from err
    info = os.fstat(fd)
    if info.st_uid == os.geteuid() and stat.S_IMODE(info.st_mode) & 0o044 != 0o044:
        with contextlib.suppress(OSError):  # made under a strict umask (sudo's), or by an older version
            os.fchmod(fd, stat.S_IMODE(info.st_mode) | 0o044)
    return fd


def _read_only(path: Path, why: CannotOpen) -> int:
    """``path`` opened read-only, as it could not be for writing (``why``)."""
    try:
        return open_regular(path, os.O_RDONLY, one_link=True)
    except FileNotFoundError:
        raise CannotMake(f"cannot make the lock file {path}: {os.strerror(why.errno or 0)}") from why
    except CannotOpen as err:
        if err.errno not in _NOT_WRITABLE:
            raise
        try:
            owner = _user(os.stat(path).st_uid)
        except OSError:
            owner = "another user"
        raise UsageError(f"cannot open the lock file {path}: {os.strerror(err.errno or 0)}; it is {owner}'s "
                         f"(made by a run as that user, sudo?): have it made readable to every user "
                         f"(chmod a+r), or removed while no run of the tool is going on") from err


def _user(uid: int) -> str:
    try:
        return pwd.getpwuid(uid).pw_name
    except KeyError:
        return f"uid {uid}"


def writable(fd: int) -> bool:
    """Whether the lock file open as ``fd`` (``lock_file``) is open for writing: not where
    this user cannot write in it, which is then open read-only."""
    return fcntl.fcntl(fd, fcntl.F_GETFL) & os.O_ACCMODE != os.O_RDONLY


STALE_AFTER_S = 60  # a folder without owner.lock younger than this may be one being made now
OWNER = "owner.lock"
_NEW_OWNER = "new-owner.lock"  # owner.lock until it is locked: every owner.lock seen is locked once


@contextlib.contextmanager
def owned_scratch(parent: Path, prefix: str, *, moved_by: str = "--wheel-dir",
                  sweep_first: bool = True) -> Iterator[Path]:
    """A fresh folder ``parent/<prefix>XXXXXXXX`` (0700) for the block, removed after (not cut
    short by Ctrl-C). It holds ``owner.lock``, locked while the block runs, a copy of the lock
    with the watchdog (``reaper``): a folder a killed run left is free once that run's children
    are gone, and is removed (``remove_stale``) by the next call for the same ``parent`` and
    ``prefix``, as it starts (``sweep_first``) and as it ends; a live run's is left alone.
    Raises OSError as ``mkdtemp``; UsageError if the lock cannot be taken (a file system
    without locks: point ``moved_by`` at a local disk)."""
    if sweep_first:
        remove_stale(parent, prefix)
    folder, fd = _made_owned(parent, prefix, moved_by)
    key = str(folder / OWNER)
    try:
        reaper.hold(key, fd)
        yield folder
    finally:
        with deferred():
            try:
                shutil.rmtree(folder, ignore_errors=True)  # still locked: no sweep races it
                fcntl.flock(fd, fcntl.LOCK_UN)  # every copy: the watchdog's too
            finally:
                os.close(fd)
                reaper.drop(key)
            remove_stale(parent, prefix)  # what a killed run left meanwhile (its lock was held till now)


def _made_owned(parent: Path, prefix: str, moved_by: str) -> tuple[Path, int]:
    """A new folder ``parent/<prefix>XXXXXXXX`` and the descriptor of its ``owner.lock``, locked
    before it has that name (made as ``new-owner.lock``, locked, then renamed): no sweep ever
    finds it unlocked while its run lives, however young the folder."""
    for _ in range(100):
        folder = parent / (prefix + secrets.token_hex(4))
        try:
            os.mkdir(folder, 0o700)
            break
        except FileExistsError:
            continue
    else:
        raise FileExistsError(errno.EEXIST, "no free name", str(parent / prefix))
    try:
        inside = os.open(folder, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
        try:
            fd = os.open(_NEW_OWNER, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC,
                         0o600, dir_fd=inside)
            try:
                flock(fd, folder / OWNER, fcntl.LOCK_EX, moved_by=moved_by)
                os.rename(_NEW_OWNER, OWNER, src_dir_fd=inside, dst_dir_fd=inside)
            except BaseException:
                os.close(fd)
                raise
        finally:
            os.close(inside)
    except BaseException:
        with deferred():
            shutil.rmtree(folder, ignore_errors=True)
        raise
    return folder, fd


def remove_stale(parent: Path, prefix: str) -> list[Path]:
    """Remove each ``parent/<prefix>*`` folder of this user's whose ``owner.lock`` nobody holds
    (the lock alone says whether its run is alive: ``owned_scratch`` locks it before it has
    that name), and one older than ``STALE_AFTER_S`` holding nothing but a ``new-owner.lock``
    (a run killed as it made it). A link, another user's folder, a folder this user cannot
    lock and one without either file (never ours) are left. Returns those removed."""
    removed = []
    for folder in sorted(parent.glob(glob_escape(prefix) + "*")):
        try:
            info = os.lstat(folder)
            if not stat.S_ISDIR(info.st_mode) or info.st_uid != os.geteuid():
                continue  # a link is never followed; another user's is theirs
            fd = os.open(folder / OWNER, os.O_RDWR | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
        except FileNotFoundError:
            if _half_made(folder):
                with deferred():
                    shutil.rmtree(folder, ignore_errors=True)
                removed.append(folder)
            continue
        except OSError:
            continue
        try:
            if not stat.S_ISREG(os.fstat(fd).st_mode):
                continue
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            continue  # a live run's
        else:
            with deferred():
                shutil.rmtree(folder, ignore_errors=True)
            removed.append(folder)
        finally:
            os.close(fd)
    return removed


def _half_made(folder: Path) -> bool:
    """Whether ``folder`` (no ``owner.lock`` in it) is one a run was killed making: nothing in it
    but ``new-owner.lock`` (or nothing at all), and older than ``STALE_AFTER_S``."""
    try:
        return set(os.listdir(folder)) <= {_NEW_OWNER} and \
            time.time() - os.lstat(folder).st_mtime >= STALE_AFTER_S
    except OSError:
        return False


def glob_escape(text: str) -> str:
    return "".join(f"[{c}]" if c in "*?[" else c for c in text)
