"""Who may read and write this repository's data files (patches/, overlay/, overlay.json) at once.

``--export`` rewrites them (all or none: staged, then renamed into place), while a run on
another checkout may be reading them: its series at the start, overlay files as it builds.
A reader that saw half the renames would publish a series that never existed. So a run
that reads them holds the project's lock shared for the whole job (many runs at once), and
an export holds it exclusive (none beside it).

The export's writes are recorded in the project's own journal, not its checkout's: a
killed export's half-renamed files are finished or undone by the next run that takes the
lock, from whatever checkout. Lock and journal live in the project's ``.git`` folder where
it has one (``k3overlay-project.lock``, ``.journal``), so runs under every cache (``sudo``,
another ``HOME``) share them; else in the cache. The journal is acted on for the export's
steps alone, in the project's own tree (``recovery.recover``'s ``steps``).

Reading the project needs no write to it. Where its lock file is there but not this user's
to write in (another user's: every lock file is readable to all; a read-only mount), a run
locks it read-only (``lock.lock_file``). Where it is missing and cannot be made there (the
git folder another user's, or on a read-only file system), a reader locks the project in
its own cache instead, as a project without a git folder does; an export, which could not
write the project either, stops in one line. Such a reader and an export through another
name that can write (the owner's; the read-write mount under a read-only one) do not see
each other, but only until the first export: it makes the lock file, which stays, and
every later reader takes it read-only (``docs/apply.md``: make it once in a shared install).
"""

from __future__ import annotations

import contextlib
import errno
import os
from collections.abc import Callable, Iterator
from pathlib import Path

from . import journal, recovery
from .claim import git_folder
from .errors import UsageError
from .lock import CannotMake, holding, journal_path, take, workdir_lock_path
from .project import Project

_STEPS = ("write", "rename")  # what an export records in the project's journal


@contextlib.contextmanager
def reading(project: Project, say: Callable[[str], None]) -> Iterator[None]:
    """Hold ``project``'s lock shared for the block, after finishing or undoing what a killed
    export left in its files (with the lock exclusive meanwhile: one lock, so two readers
    turning theirs into exclusive ones never wait on each other). Raises as
    ``recovery.recover`` (UsageError: a file changed since; OverlayError). Where the lock file
    cannot be made in the project's git folder (not this user's to write in), the project is
    locked in this user's cache (the module's docstring says what that leaves out)."""
    lock, _ = _files(project)
    with contextlib.ExitStack() as stack:
        try:
            fd = stack.enter_context(holding(lock, project.root, say, shared=True))
        except CannotMake:  # (nothing held yet)
            lock = workdir_lock_path(project.root)
            fd = stack.enter_context(holding(lock, project.root, say, shared=True))
        while _journal(project).unfinished():
            take(fd, lock, project.root, say, shared=False)  # (another reader may finish it first)
            _recover(project, say)
            take(fd, lock, project.root, say, shared=True)
        yield


@contextlib.contextmanager
def writing(project: Project, say: Callable[[str], None]) -> Iterator[None]:
    """Hold ``project``'s lock exclusive for the block, after finishing or undoing what a killed
    export left. Raises as ``reading``; UsageError (one line) first where the folder of the
    project's journal (its git folder) is not this user's to write in: an export writes the
    project, and its journal there."""
    lock, journal_file = _files(project)
    _refuse_unwritable(journal_file.parent)
    with holding(lock, project.root, say, shared=False):
        _recover(project, say)
        yield


def recording(project: Project) -> contextlib.AbstractContextManager[journal.Journal]:
    """The block (inside ``writing``) whose steps are recorded in ``project``'s journal."""
    return journal.recording(_files(project)[1], project.root, lambda _: None)


def _refuse_unwritable(folder: Path) -> None:
    if os.access(folder, os.W_OK, effective_ids=os.access in os.supports_effective_ids):
        return
    try:
        read_only = bool(os.statvfs(folder).f_flag & os.ST_RDONLY)
    except OSError:
        read_only = False
    why = os.strerror(errno.EROFS if read_only else errno.EACCES)
    raise UsageError(f"cannot write in {folder} ({why}): --export writes this repository's files, "
                     f"and its journal there; run it where you can write them")


def _recover(project: Project, say: Callable[[str], None]) -> None:
    recovery.recover(_journal(project), say, steps=_STEPS)


def _journal(project: Project) -> journal.Journal:
    return journal.Journal(_files(project)[1], str(project.root))


def _files(project: Project) -> tuple[Path, Path]:
    """The project's lock file and journal: in its ``.git`` folder, else in the cache."""
    git_dir = git_folder(project.root)
    if git_dir is not None:
        return git_dir / "k3overlay-project.lock", git_dir / "k3overlay-project.journal"
    return workdir_lock_path(project.root), journal_path(project.root)
