"""What a run is doing to a checkout, written ahead, so the next run can finish or undo it.

A run that is killed (SIGKILL, the OOM killer, a power cut) cleans nothing up. So
every step that leaves something behind when cut short is recorded before it
starts: one JSON line appended to the work directory's journal (beside its lock in
the cache, never in the checkout) and flushed to disk; the step is marked done
after its own cleanup. The next run on that work directory, once it holds the lock
(and so once the killed run's git children are gone, see ``reaper``), takes the
steps begun and not done, newest first (scratch trees first of all), and finishes or
undoes each (``recover``), saying what it did in one line on stderr; then the journal
is removed. A line cut short by the kill is no step: its step had not begun. Only steps
naming the run's own work directory are acted on; ``--check`` acts on none (it says what
is left, and keeps the journal for the next run).

Steps (``STEPS``; the facts each records):
  clone      ``scratch``: a clone being made beside the work directory -> removed
  fresh      ``repo``, ``mark``: a new ``--workdir``'s clone, until the run's switch gave it a
             commit -> kept, and taken up by the next run as its own clone while its ``.git``
             holds ``mark`` (``source.FRESH_MARK``: not a repository the user made there since)
             and it still has no commit, no ref but tags and ``origin``'s, no linked worktree
             and nothing but ``.git``; never removed (a repository of the user's may borrow its
             objects), nor refused (a clone of the release mirror checks nothing out)
  check      ``scratch``: ``--check``'s throwaway clone -> removed
  worktree   ``repo``, ``parent``: a temporary worktree -> git's entry and the folder removed
  fetch      ``repo``, ``since``: a fetch into the checkout -> ref lock files its git left removed
  publish    ``repo``, ``branch``, ``sha``, ``ref``, ``old_head``, ``old_tip``, ``since``: the
             checkout being switched to the work branch -> finished (``resume.finish``) where
             a normal run could switch it, else left as it is with the normal run's refusal
  write      ``root``, ``folders``: files laid into a tree, all or none (``files``: the overlay
             into a checkout, an export into patches/) -> the temporary files, not yet renamed
             into place, removed
  rename     ``root``, ``moves`` ([temporary, destination, old sha256, new sha256]), ``remove``
             ([path, old sha256]): a write's files all staged, being renamed into place ->
             finished where the tree is as the kill left it (renamed: new content; the rest:
             old), else left
  lay        ``repo``, ``head``, ``files`` ([path, sha256, executable]): ``--rebase-to``'s overlay
             laid into the checkout and not yet committed -> put back as ``head`` has it where
             each path is one of the project's overlay files and holds that or the laid file
             (``manifest.undo_laid``), else left

Tests stop a run at each ``POINTS`` entry with SIGKILL (``point``): only with
``K3OVERLAY_TEST_KILL_AT`` naming it *and* pytest's ``PYTEST_CURRENT_TEST`` set, so a
user's run can never be stopped by it (``K3OVERLAY_TEST_KILL_AT_SIGNAL``: another signal
than SIGKILL, e.g. ``SIGHUP``).
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import time
from collections.abc import Callable, Iterator
from pathlib import Path

from .errors import UsageError
from .regular import open_regular

STEPS = ("clone", "fresh", "check", "worktree", "fetch", "publish", "write", "rename", "lay")
# Where a test may kill a run: each step just recorded, publishing after the switch
# and before the branch record, --rebase-to's overlay committed and the step not yet
# done, and each step's end just recorded.
POINTS = (*STEPS, "clone.cloned", "worktree.added", "publish.switched", "write.staged", "lay.committed",
          *(f"{s}.done" for s in STEPS))
KILL_AT = "K3OVERLAY_TEST_KILL_AT"
SCRATCH = ("clone", "check", "worktree")
MAX_BYTES = 16 << 20  # a run writes a few kB  # steps whose recovery removes a whole tree

_current: Journal | None = None


class Journal:
    """The journal file at ``path`` (the work directory ``workdir``'s, an absolute path)."""

    def __init__(self, path: Path, workdir: str) -> None:
        self.path = path
        self.workdir = workdir
        self.pending: list[dict] = []

    def begin(self, step: str, **facts: object) -> dict:
        """Record that ``step`` starts, on disk before returning; every entry names the work
        directory (``workdir``): a journal copied to another one's name is never acted on.
        UsageError if it cannot be written (a full disk): the step must then not be taken."""
        entry = {"step": step, "id": f"{os.getpid()}.{time.monotonic_ns()}",
                 "workdir": self.workdir, **facts}
        self._append(entry)
        self.pending.append(entry)
        point(step)
        return entry

    def done(self, entry: dict) -> None:
        """Record that ``entry``'s step is over (done or cleaned up). A write error is not
        raised: the step is over, and the next run finds nothing to do for it."""
        with contextlib.suppress(UsageError):
            self._append({"done": entry["id"]})
        self.pending.remove(entry)
        point(f"{entry['step']}.done")

    def settle(self, entry: dict) -> None:
        """Record that a killed run's ``entry`` needs nothing more (as ``done`` does)."""
        with contextlib.suppress(UsageError):
            self._append({"done": entry["id"]})

    def _append(self, entry: dict) -> None:
        line = (json.dumps(entry, sort_keys=True) + "\n").encode()
        try:
            # (one name only: a ``cp -al`` copy's journal would be appended to the original's)
            fd = open_regular(self.path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, one_link=True)
            try:
                if os.write(fd, line) != len(line):
                    raise OSError(28, os.strerror(28))
                os.fsync(fd)
            finally:
                os.close(fd)
        except OSError as err:
            raise UsageError(f"cannot record the next step in {self.path} ({err.strerror}); "
                             f"nothing was changed") from err

    def unfinished(self) -> list[dict]:
        """Steps begun and not done by earlier runs, newest first. UsageError for a journal over
        ``MAX_BYTES`` (no run writes that much) or not a regular file (``open_regular``)."""
        try:
            fd = open_regular(self.path, os.O_RDONLY)
        except FileNotFoundError:
            return []
        with os.fdopen(fd, "rb") as f:
            size = os.fstat(f.fileno()).st_size
            if size > MAX_BYTES:  # (read whole: one named by a forged claim could be any file)
                raise UsageError(f"the journal {self.path} is {size} bytes, more than any run writes; "
                                 f"not read")
            lines = f.read().splitlines()
        begun: dict[str, dict] = {}
        for line in lines:
            try:
                entry = json.loads(line)
            except (ValueError, RecursionError):  # (RecursionError: a line nested past the parser)
                continue  # cut short as it was written: that step had not begun
            if not isinstance(entry, dict):
                continue  # no line this tool writes
            if isinstance(entry.get("done"), str):
                begun.pop(entry["done"], None)
            elif isinstance(entry.get("step"), str) and isinstance(entry.get("id"), str):
                # its facts are checked by whoever undoes it; a path no file can have (a NUL) is
                # refused by every call on a path, and a step of another version of the tool is
                # no step this one can undo: such an entry keeps only its step and id, and is
                # still a step begun (said, and kept by ``--check`` for the run that knows it)
                usable = entry["step"] in STEPS and not _unusable(entry)
                begun[entry["id"]] = entry if usable else {"step": entry["step"], "id": entry["id"]}
        return list(reversed(begun.values()))


@contextlib.contextmanager
def recording(path: Path, workdir: Path, recover: Callable[[Journal], None]) -> Iterator[Journal]:
    """For the block (the holder of ``workdir``'s lock): first recover what a killed run left
    (``recover``: ``recovery.recover``, which knows every step's undo), then record this
    run's steps in ``path``; the file is removed when no step is left unfinished (one a
    ``--check`` left for the next run keeps it)."""
    global _current
    journal = Journal(path, str(workdir))
    recover(journal)
    previous, _current = _current, journal
    try:
        yield journal
    finally:
        _current = previous
        if not journal.pending and not journal.unfinished():
            with contextlib.suppress(OSError):
                os.unlink(path)


@contextlib.contextmanager
def step(name: str, **facts: object) -> Iterator[None]:
    """Record step ``name`` for the block when a journal is being kept (a work directory's
    lock is held); a no-op otherwise (the rebase job's throwaway clones)."""
    journal = _current
    if journal is None:
        yield
        return
    entry = journal.begin(name, **facts)
    try:
        yield
    finally:
        journal.done(entry)


def _unusable(value: object) -> bool:
    """Whether a string of the JSON value ``value`` can name no file: a NUL, or a lone
    surrogate (``\\ud800``) no file name encodes to. Every call on such a path raises.
    (Walked with a list, not recursion: a line nests as deep as it likes.)"""
    left = [value]
    while left:
        item = left.pop()
        if isinstance(item, str):
            try:
                item.encode("utf-8", "surrogateescape")
            except UnicodeEncodeError:
                return True
            if "\0" in item:
                return True
        elif isinstance(item, dict):
            left += [*item.keys(), *item.values()]
        elif isinstance(item, list):
            left += item
    return False


def point(name: str) -> None:
    """A place where a test may kill the run (see the module's docstring)."""
    if os.environ.get(KILL_AT) == name and os.environ.get("PYTEST_CURRENT_TEST"):
        os.kill(os.getpid(), getattr(signal, os.environ.get(KILL_AT + "_SIGNAL", "SIGKILL")))
