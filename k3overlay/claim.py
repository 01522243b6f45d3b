"""A checkout's own record of the run working on it, found under any name and any cache.

The lock and the journal of a checkout live in the cache, keyed by its path (``lock``,
``journal``). A run under another cache (``sudo``, another ``HOME`` or ``XDG_CACHE_HOME``)
took other locks, so two runs could switch one checkout at once; and the run after a kill
looked for the journal under its own cache and name only, so a killed run's steps under
another cache or another name of the checkout (a bind mount) were never finished or undone.

So a run also holds ``.git/k3overlay.lock`` in the checkout (a linked worktree: in its own
git folder; an ``flock``, after the cache's locks: every run of every cache takes it), which
names the journal of the run holding it, and is emptied when that run ends clean. A run
finding another journal named there with steps left finishes or undoes them first, as its
own, where it is a journal this user's tool wrote for a name of this checkout
(``_foreign``); else it stops in one line naming the claim, before anything is changed.
A journal is a licence to remove and rename files: a forged one is never acted on.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import re
import stat
import threading
from collections.abc import Callable, Iterator
from pathlib import Path

from . import journal as journal_
from .errors import UsageError
from .gitfolder import git_folder
from .lock import journal_key, lock_file, take, watched, writable
from .outputs import same
from .project import CACHE_NAME

FILE = "k3overlay.lock"


@contextlib.contextmanager
def claimed(workdir: Path, journal_path: Path, say: Callable[[str], None],
            recover: Callable[[journal_.Journal], None], *, check: bool = False) -> Iterator[None]:
    """Hold ``workdir``'s claim for the block (waiting, and telling ``say``, while another run
    holds it), after recovering (``recover``) the steps another cache's or another name's
    journal left on it. ``check`` (a ``--check``) writes no claim: it only waits for one.
    Nothing is claimed here where ``workdir`` has no git folder yet (a fresh workdir): the run
    claims the clone it makes before putting it in place (``held``). Raises UsageError for a
    journal it cannot act on, or a claim file it cannot make."""
    git_dir = git_folder(workdir)
    if git_dir is None or (check and not os.path.lexists(git_dir / FILE)):
        yield
        return
    if check:  # (a --check records no step: it writes nothing in the checkout)
        with _taken(git_dir, workdir, say) as fd:
            recover_named(fd, workdir, journal_path, recover)
            yield
        return
    with held(git_dir, workdir, journal_path, say, before=lambda fd: recover_named(
            fd, workdir, journal_path, recover)):
        yield


@contextlib.contextmanager
def held(git_dir: Path, workdir: Path, journal_path: Path, say: Callable[[str], None],
         before: Callable[[int], None] = lambda fd: None) -> Iterator[None]:
    """Hold the claim in ``git_dir`` (``workdir``'s git folder) naming ``journal_path`` for the
    block, waiting while another run holds it; ``before`` runs once it is taken, before it is
    written. Where this run holds it already (its ``claimed``), the block just runs: a second
    ``flock`` of the same file by this process would wait for itself. Emptied once the run's
    journal is gone (``release``). Raises UsageError for a claim file it cannot make."""
    key, ours = os.path.realpath(git_dir), _ours()
    if key in ours:
        yield
        return
    with _taken(git_dir, workdir, say) as fd:
        before(fd)
        if not writable(fd) and os.fstat(fd).st_uid != os.geteuid():  # a sudo run's: held, naming nothing
            say(f"note: {git_dir / FILE} is not yours to write: held, but a killed run's steps are found "
                f"only under this cache; remove it once no run is going")
        # (the first line for a run that waits, as in every lock file: ``lock.take``)
        _write(fd, f"apply.py (pid {os.getpid()})\n{json.dumps({'journal': str(journal_path)})}\n")
        ours.add(key)
        try:
            yield
        finally:
            ours.discard(key)


def release(workdir: Path, journal_path: Path) -> None:
    """Empty ``workdir``'s claim where it still names ``journal_path`` and that journal is gone
    (the run ended, clean or refused: no step left for anyone), once every claim of the run is
    let go (``job.locked``: a new workdir's clone is claimed inside its journal's life, so its
    claim outlives the journal). A claim left naming a removed journal of another user's (a
    ``sudo`` run's) had the user's next run refused, that journal unreadable. Left as it is
    where another run holds it now."""
    try:
        git_dir = git_folder(workdir)
        if git_dir is None or os.path.lexists(journal_path) or not os.path.lexists(git_dir / FILE):
            return
        fd = lock_file(git_dir / FILE)
    except (OSError, UsageError):
        return
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        if _named(fd) == str(journal_path):
            _write(fd, "")
    except OSError:  # (held by another run now: its claim, not ours)
        pass
    finally:
        os.close(fd)


_held = threading.local()


def _ours() -> set[str]:
    """The git folders whose claim this run holds (a run is a thread: tests run two at once)."""
    if not hasattr(_held, "folders"):
        _held.folders = set()
    return _held.folders


@contextlib.contextmanager
def _taken(git_dir: Path, workdir: Path, say: Callable[[str], None]) -> Iterator[int]:
    """The claim file in ``git_dir``, open and locked (waiting) for the block, a copy with the
    watchdog (``lock.watched``)."""
    path = git_dir / FILE
    fd = lock_file(path)
    try:
        take(fd, path, workdir, say, shared=False)
        with watched(fd, path):
            yield fd
    finally:
        os.close(fd)


def recover_named(fd: int, workdir: Path, journal_path: Path,
                  recover: Callable[[journal_.Journal], None]) -> None:
    """Recover (``recover``) the steps left in the journal the claim open as ``fd`` names, where
    that is not ``journal_path`` (this run's own): another cache's, or another name's.
    UsageError as ``_recover_elsewhere``."""
    other = _named(fd)
    if other and other != str(journal_path):
        _recover_elsewhere(Path(other), workdir, recover)


def _named(fd: int) -> str | None:
    """The journal the claim file names (None: none, or not a claim this tool wrote)."""
    try:
        named = json.loads((os.pread(fd, 65536, 0).splitlines() or [b"null"])[-1])
    except (ValueError, RecursionError):  # (RecursionError: a line nested past the parser)
        return None
    return named.get("journal") if isinstance(named, dict) and isinstance(named.get("journal"), str) else None


def _recover_elsewhere(path: Path, workdir: Path, recover: Callable[[journal_.Journal], None]) -> None:
    """Recover the steps left in the journal ``path`` (another cache's, or this cache's under
    another name of ``workdir``) as this run's own. UsageError where they cannot be, or where
    ``path`` is no journal this user's tool wrote for a name of ``workdir`` (``_foreign``)."""
    claim = (git_folder(workdir) or workdir / ".git") / FILE
    try:
        try:
            os.lstat(path)
        except FileNotFoundError:
            return  # its run ended clean after all, or the user emptied that cache
        why = _foreign(path)  # (one this user cannot look at: "cannot be read", below)
        entries = journal_.Journal(path, str(workdir)).unfinished() if why is None else []
    except (OSError, ValueError, UsageError) as err:  # (ValueError: a NUL, a lone surrogate in the name)
        why = f"cannot be read ({getattr(err, 'strerror', None) or err})"
    if why is not None:
        raise UsageError(f"{claim} names {path} as a killed run's journal, which {why}: not acted on; "
                         f"run again as that run did (its user, HOME and XDG_CACHE_HOME), or remove "
                         f"{claim} if no run of the tool was killed there")
    if not entries:
        return
    names = {e.get("workdir") if isinstance(e.get("workdir"), str) else None for e in entries}
    name = names.pop() if len(names) == 1 else None
    if not isinstance(name, str) or not same(Path(name), workdir) or path.stem != journal_key(name):
        raise UsageError(_not_here(claim, path, workdir, name))
    recover(journal_.Journal(path, name))


def _not_here(claim: Path, path: Path, workdir: Path, name: str | None) -> str:
    """Why the steps a killed run left for the checkout ``name`` (its journal ``path``) are
    not finished here, and what to do: the claim came with a copy of that checkout, or the
    checkout was moved (a journal's steps are acted on only where they were recorded)."""
    start = f"{claim} names a killed run's unfinished steps in {path}, recorded for "
    if name is None:
        return (f"{start}several checkouts, or for none it can read: not acted on; check {workdir} with git "
                f"status, then remove {claim}")
    if os.path.lexists(name):
        return (f"{start}{name}, another checkout (this one a copy of it?): not acted on here; run "
                f"again with --workdir {name} to finish them there, and remove {claim}")
    return (f"{start}{name}, which is gone (moved here?): not acted on; check {workdir} with git "
            f"status, then remove {claim}")


def _foreign(path: Path) -> str | None:
    """Why ``path`` is no journal this user's tool wrote (None: it is one): a journal is a
    licence to remove and rename files, so one another user could have written, or that is
    not where the tool keeps them (``CACHE/vllm-k3-overlay/locks/KEY.journal``), is none.
    Every folder on its way must be no link, and this user's or root's, writable by no one
    else (or sticky, as ``/tmp``): else another user could swap the file or a folder between
    this look and the reads after it."""
    info = os.lstat(path)
    if not stat.S_ISREG(info.st_mode):
        return "is no regular file"
    if info.st_uid != os.getuid():
        return "another user could have written (its owner)"
    for folder in Path(os.path.abspath(path)).parents:
        above = os.lstat(folder)
        if stat.S_ISLNK(above.st_mode):
            return f"is reached through a link ({folder})"
        if above.st_uid not in (os.getuid(), 0) or \
                (above.st_mode & 0o022 and not above.st_mode & stat.S_ISVTX):
            return f"another user could have written (the folder {folder})"
    if path.parent.name != "locks" or path.parent.parent.name != CACHE_NAME \
            or not re.fullmatch(r"[0-9a-f]{32}\.journal", path.name):
        return "is not where the tool keeps its journals"
    return None


def _write(fd: int, text: str) -> None:
    with contextlib.suppress(OSError):  # a full disk: the claim is still held, its note is lost
        os.ftruncate(fd, 0)
        os.pwrite(fd, text.encode(), 0)
        os.fsync(fd)

