"""One scratch folder per run: every temporary file of the tool and of its children goes with it.

A run makes many temporary folders (``k3-diff-*``, ``k3-mailsplit-*``, an unpacked release
in ``k3-sdist-*``, a whole ``pip install`` in ``k3-wheel-install-*``, git's and pip's own),
each removed when its step ends; but a run killed (SIGKILL, the OOM killer) removes none,
and nothing did later: a machine's disk filled up with them. So for the whole run
(``per_run``) Python's ``tempfile.tempdir`` and the ``TMPDIR`` of every child (git, pip)
point at one folder of its own, ``$TMPDIR/k3overlay-<uid>/run-XXXXXXXX``: every
temporary folder of the run, its prefix kept, lands in it and goes with it.

Each run folder holds ``owner.lock``, locked while its run lives, a copy with the watchdog
until the killed run's children are gone (``lock.owned_scratch``); every run removes, as it
ends, the folders whose lock is free (a killed run's; never a live run's), then
``k3overlay-<uid>`` if that left it empty. Not as it starts: the killed run's journal names
folders in it (a temporary worktree, a ``--check`` clone), and the next run on its checkout
says what it removed of them.

``k3overlay-<uid>`` is this user's alone (mode 0700), or not used: a link there is never
followed and another user's folder never written in or removed; the run is refused in one
line (exit 2), saying so. Two runs of one user share it; one removing it empty never
pulls it from under one making its folder there (``_held``).
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import os
import pwd
import stat
import tempfile
import threading
from collections.abc import Iterator
from pathlib import Path

from . import lock
from .errors import UsageError
from .regular import kind_of

RUN_PREFIX = "run-"

# This process's run folders, oldest first, each with what TMPDIR and tempfile.tempdir were
# before it pointed them at itself (tests call cli.main many times, some in threads).
_runs: list[tuple[Path, str | None, str | None]] = []
_runs_lock = threading.Lock()


def parent_of(tmp: str | Path) -> Path:
    """The folder of this user's run folders in the temporary folder ``tmp``."""
    return Path(tmp) / f"k3overlay-{os.geteuid()}"


@contextlib.contextmanager
def per_run() -> Iterator[Path]:
    """A fresh run folder (``parent_of`` the temporary folder) for the block, ``tempfile.tempdir``
    and ``TMPDIR`` pointing at it; after, both as they were, the folder removed and each one
    a killed run left. Raises UsageError (one line) if it cannot be made, or its parent is no
    folder of this user's (``_held``)."""
    with _runs_lock:  # (the temporary folder before any run of this process pointed it elsewhere)
        before = os.environ.get("TMPDIR"), tempfile.tempdir  # (before gettempdir sets the latter)
        outer = _runs[0][0].parent.parent if _runs else tempfile.gettempdir()
    parent = parent_of(outer)
    try:
        with contextlib.ExitStack() as stack:
            with _held(parent):  # (checked, and not removed empty by another run meanwhile)
                folder = _made(stack, parent)
            _point_at(folder, *before)
            try:
                yield folder
            finally:
                _point_back(folder)
    finally:
        _remove_if_empty(parent)


def _made(stack: contextlib.ExitStack, parent: Path) -> Path:
    """The run's own folder in ``parent`` (``lock.owned_scratch``), its removal on ``stack``.
    Where there is no room for it (killed runs' folders filled the disk), those go first, then
    it is made. Raises UsageError if it cannot be made."""
    for sweep_first in (False, True):
        try:
            return stack.enter_context(lock.owned_scratch(
                parent, RUN_PREFIX, moved_by="TMPDIR", sweep_first=sweep_first))
        except OSError as err:
            if sweep_first or err.errno not in (errno.ENOSPC, errno.EDQUOT):
                raise _unusable(parent, err.strerror or str(err)) from err
    raise AssertionError("unreachable")


@contextlib.contextmanager
def machine_tmpdir() -> Iterator[None]:
    """``TMPDIR`` as it was before this process's first run (``per_run``), for the children
    started in the block: for one that keeps there what every run on the machine shares (the
    GPU stage's lock, ``ci/gpu_stage``), no temporary file. Python's own stay in the run's."""
    with _runs_lock:
        if not _runs:
            now = None
        else:
            now, before = os.environ.get("TMPDIR"), _runs[0][1]
            _set_tmpdir(before)
    try:
        yield
    finally:
        if now is not None:
            with _runs_lock:
                _set_tmpdir(now)


def _held(parent: Path) -> contextlib.AbstractContextManager[int]:
    """``parent`` (made if missing, 0700), checked this user's folder and no link, held for the
    block (its descriptor, locked shared): a run removing it empty (``_remove_if_empty``) takes
    it exclusive first, and no other user can replace a folder of this user's in a TMPDIR such
    as /tmp (sticky), so the path names it for the block. Raises UsageError if it is another
    user's or no folder, or cannot be made."""
    for _ in range(20):  # (each time, removed by a run that found it empty as this one came)
        try:
            os.mkdir(parent, 0o700)
        except FileExistsError:
            pass  # (a link too, even a dangling one: mkdir follows none)
        except OSError as err:
            raise _unusable(parent, err.strerror) from err
        try:
            fd = os.open(parent, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
        except FileNotFoundError:
            continue
        except OSError as err:  # ELOOP: a link; ENOTDIR: a file, a FIFO; EACCES: another user's
            raise _not_ours(parent, _what(parent)) from err
        try:
            lock.flock(fd, parent, fcntl.LOCK_SH, moved_by="TMPDIR")
            info = os.fstat(fd)
            if info.st_nlink == 0 or not _names(parent, info):
                os.close(fd)
                continue  # removed (and maybe made again) meanwhile: look again
            if info.st_uid != os.geteuid():
                raise _not_ours(parent, f"is {_user(info.st_uid)}'s")
            if stat.S_IMODE(info.st_mode) != 0o700:
                os.fchmod(fd, 0o700)  # this user's own: made by hand, chmod'ed
        except BaseException:
            with contextlib.suppress(OSError):
                os.close(fd)
            raise
        return _closing(fd)
    raise _unusable(parent, "it was removed again and again as the run made it")


@contextlib.contextmanager
def _closing(fd: int) -> Iterator[int]:
    try:
        yield fd
    finally:
        os.close(fd)


def _what(parent: Path) -> str:
    """What ``parent`` is, for a refusal: whose folder, or what else."""
    try:
        info = os.lstat(parent)
    except OSError as err:
        return f"cannot be read ({err.strerror})"
    if stat.S_ISDIR(info.st_mode) and info.st_uid != os.geteuid():
        return f"is {_user(info.st_uid)}'s"
    return f"is a {kind_of(parent)}"


def _names(parent: Path, info: os.stat_result) -> bool:
    """Whether the path ``parent`` still names the folder ``info`` was read from (not a link)."""
    try:
        now = os.lstat(parent)
    except OSError:
        return False
    return (now.st_dev, now.st_ino) == (info.st_dev, info.st_ino)


def _remove_if_empty(parent: Path) -> None:
    """Remove ``parent`` if no run folder is left in it, unless a run is making one there."""
    try:
        fd = os.open(parent, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError:
        return
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        info = os.fstat(fd)
        if info.st_uid == os.geteuid() and _names(parent, info):
            os.rmdir(parent)  # (fails, as it should, where anything is left in it)
    except OSError:
        pass
    finally:
        os.close(fd)


def _point_at(folder: Path, env: str | None, tempdir: str | None) -> None:
    """``TMPDIR`` and ``tempfile.tempdir`` at ``folder``; ``env`` and ``tempdir``: what they were."""
    with _runs_lock:
        if _runs:  # another thread's run began meanwhile: this one's "before" is that run's folder
            env, tempdir = os.environ.get("TMPDIR"), tempfile.tempdir
        _runs.append((folder, env, tempdir))
        os.environ["TMPDIR"] = tempfile.tempdir = str(folder)


def _point_back(folder: Path) -> None:
    """``TMPDIR`` and ``tempfile.tempdir`` as they were before ``folder``'s run; where a later
    run (another thread's) pointed them at its own since, that run goes back to these."""
    with _runs_lock:
        at = next(i for i, (f, _, _) in enumerate(_runs) if f == folder)
        _, env, tempdir = _runs.pop(at)
        if at < len(_runs):  # (a later one's "before" is this folder: it becomes this one's)
            later = _runs[at][0]
            _runs[at] = (later, env, tempdir)
            return
        _set_tmpdir(env)
        tempfile.tempdir = tempdir


def _set_tmpdir(value: str | None) -> None:
    if value is None:
        os.environ.pop("TMPDIR", None)
    else:
        os.environ["TMPDIR"] = value


def _not_ours(parent: Path, what: str) -> UsageError:
    return UsageError(f"{parent} {what}, not a folder of this user's; refusing to use it for the "
                      f"run's temporary files (remove it, or point TMPDIR at another folder)")


def _unusable(parent: Path, why: str) -> UsageError:
    return UsageError(f"cannot make a folder for the run's temporary files in {parent}: {why}; "
                      f"point TMPDIR at a folder with room that this user can write in")


def _user(uid: int) -> str:
    try:
        return pwd.getpwuid(uid).pw_name
    except KeyError:
        return f"uid {uid}"
