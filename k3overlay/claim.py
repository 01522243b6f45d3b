"""A checkout's own record of the run working on it, found under any name and any cache.

The lock and the journal of a checkout live in the cache, keyed by its path (``lock``,
``journal``). A run under another cache (``sudo``, another ``HOME`` or ``XDG_CACHE_HOME``)
took other locks, so two runs could switch one checkout at once; and the run after a kill
looked for the journal under its own cache and name only, so a killed run's steps under
another cache or another name of the checkout (a bind mount) were never finished or undone.

So a run also holds ``.git/k3overlay.lock`` in the checkout (an ``flock``, after the
cache's locks: every run of every cache takes it), which names the journal of the run
holding it, and is emptied when that run ends clean. A run finding another journal named
there with steps left finishes or undoes them first, as its own, where that journal's
checkout is this one; where it cannot read it, or the name no longer reaches this checkout,
it stops in one line naming the journal, before anything is changed.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import stat
from collections.abc import Callable, Iterator
from pathlib import Path

from . import journal as journal_
from .errors import UsageError
from .lock import journal_key, lock_file, take, watched
from .project import CACHE_NAME

FILE = "k3overlay.lock"


@contextlib.contextmanager
def claimed(workdir: Path, journal_path: Path, say: Callable[[str], None],
            recover: Callable[[journal_.Journal], None], *, check: bool = False) -> Iterator[None]:
    """Hold ``workdir``'s claim for the block (waiting, and telling ``say``, while another run
    holds it), after recovering (``recover``) the steps another cache's or another name's
    journal left on it. ``check`` (a ``--check``) writes no claim: it only waits for one.
    Nothing is claimed where ``workdir`` has no ``.git`` folder (a fresh workdir, a linked
    worktree). Raises UsageError for a journal it cannot act on, or a claim file it cannot make."""
    git_dir = workdir / ".git"
    if git_dir.is_symlink() or not git_dir.is_dir() or (check and not os.path.lexists(git_dir / FILE)):
        yield
        return
    path = git_dir / FILE
    fd = lock_file(path)
    try:
        take(fd, path, workdir, say, shared=False)
        with watched(fd, path):
            other = _named(fd)
            if other and other != str(journal_path):
                _recover_elsewhere(Path(other), workdir, recover)
            if not check:  # (a --check records no step: it writes nothing in the checkout)
                _write(fd, json.dumps({"journal": str(journal_path), "pid": os.getpid()}))
            yield
            if not check and not os.path.lexists(journal_path):  # ended clean: no step left for anyone
                _write(fd, "")
    finally:
        os.close(fd)


def _named(fd: int) -> str | None:
    """The journal the claim file names (None: none, or not a claim this tool wrote)."""
    try:
        named = json.loads(os.pread(fd, 65536, 0) or b"null")
    except ValueError:
        return None
    return named.get("journal") if isinstance(named, dict) and isinstance(named.get("journal"), str) else None


def _recover_elsewhere(path: Path, workdir: Path, recover: Callable[[journal_.Journal], None]) -> None:
    """Recover the steps left in the journal ``path`` (another cache's, or this cache's under
    another name of ``workdir``) as this run's own. UsageError where they cannot be, or where
    ``path`` is no journal this user's tool wrote for a name of ``workdir`` (``_foreign``)."""
    claim = workdir / ".git" / FILE
    try:
        if not os.path.lexists(path):
            return  # its run ended clean after all, or the user emptied that cache
        why = _foreign(path)
        entries = journal_.Journal(path, str(workdir)).unfinished() if why is None else []
    except (OSError, UsageError) as err:
        why = f"cannot be read ({getattr(err, 'strerror', None) or err})"
    if why is not None:
        raise UsageError(f"{claim} names {path} as a killed run's journal, which {why}: not acted on; "
                         f"run again as that run did (its user, HOME and XDG_CACHE_HOME), or remove "
                         f"{claim} if no run of the tool was killed there")
    if not entries:
        return
    names = {e.get("workdir") for e in entries}
    name = names.pop() if len(names) == 1 else None
    if not isinstance(name, str) or not _same_folder(name, workdir) or path.stem != journal_key(name):
        raise UsageError(f"a killed run left unfinished steps in {path} under another name of {workdir} "
                         f"({name or 'several'}), which no longer reaches it: run again under that name")
    recover(journal_.Journal(path, name))


def _foreign(path: Path) -> str | None:
    """Why ``path`` is no journal this user's tool wrote (None: it is one): a journal is a
    licence to remove and rename files, so one another user could have written, or that is
    not where the tool keeps them (``CACHE/vllm-k3-overlay/locks/KEY.journal``), is none."""
    info, folder = os.lstat(path), os.lstat(path.parent)
    if not stat.S_ISREG(info.st_mode):
        return "is no regular file"
    if info.st_uid != os.getuid() or folder.st_uid != os.getuid() or folder.st_mode & 0o022:
        return "another user could have written (its owner, or its folder's)"
    if path.parent.name != "locks" or path.parent.parent.name != CACHE_NAME \
            or not re.fullmatch(r"[0-9a-f]{32}\.journal", path.name):
        return "is not where the tool keeps its journals"
    return None


def _same_folder(a: str, b: Path) -> bool:
    try:
        return os.path.samefile(a, b)
    except OSError:
        return False


def _write(fd: int, text: str) -> None:
    with contextlib.suppress(OSError):  # a full disk: the claim is still held, its note is lost
        os.ftruncate(fd, 0)
        os.pwrite(fd, text.encode(), 0)
        os.fsync(fd)

