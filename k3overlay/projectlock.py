"""Who may read and write this repository's data files (patches/, overlay/, overlay.json) at once.

``--export`` rewrites them (all or none: staged, then renamed into place), while a run on
another checkout may be reading them: its series at the start, overlay files as it builds.
A reader that saw half the renames would publish a series that never existed. So a run
that reads them holds the project's lock shared for the whole job (many runs at once), and
an export holds it exclusive (none beside it).

The export's writes are recorded in the project's own journal (``journal``, keyed by the
project's root like a checkout's), not its checkout's: a killed export's half-renamed
files are finished or undone by the next run that takes the lock, from whatever checkout
(before, a run on another checkout read them as the kill left them).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator

from . import journal, recovery
from .lock import journal_path, workdir_lock
from .project import Project


@contextlib.contextmanager
def reading(project: Project, say: Callable[[str], None]) -> Iterator[None]:
    """Hold ``project``'s lock shared for the block, after finishing or undoing what a killed
    export left in its files (with the lock exclusive meanwhile). Raises as
    ``recovery.recover`` (UsageError: a file changed since; OverlayError)."""
    with workdir_lock(project.root, say, shared=True) as relock:
        while _journal(project).unfinished():
            relock(True)  # (another reader may finish it first: then this finds nothing)
            _recover(project, say)
            relock(False)
        yield


@contextlib.contextmanager
def writing(project: Project, say: Callable[[str], None]) -> Iterator[None]:
    """Hold ``project``'s lock exclusive for the block, after finishing or undoing what a killed
    export left. Raises as ``reading``."""
    with workdir_lock(project.root, say):
        _recover(project, say)
        yield


def recording(project: Project) -> contextlib.AbstractContextManager[journal.Journal]:
    """The block (inside ``writing``) whose steps are recorded in ``project``'s journal."""
    return journal.recording(journal_path(project.root), project.root, lambda _: None)


def _recover(project: Project, say: Callable[[str], None]) -> None:
    recovery.recover(_journal(project), say)


def _journal(project: Project) -> journal.Journal:
    return journal.Journal(journal_path(project.root), str(project.root))
