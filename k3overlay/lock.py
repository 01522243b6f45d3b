"""One run at a time per checkout: a lock per work directory, held for the whole job.

Two runs on one checkout (even two ``--check``) would share its temporary
worktrees, fetches and branch switch; two runs into one fresh ``--workdir``
would clone into the same folder. So every job holds an exclusive ``flock``
keyed by the work directory's absolute path (the folder need not exist yet),
and a second run waits, saying for whom. The lock files live in the cache
directory, never in the user's checkout; the kernel drops a lock when its
holder dies, so a killed run never leaves a stale lock behind.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import os
from collections.abc import Callable, Iterator
from pathlib import Path

from .errors import UsageError
from .project import cache_dir


@contextlib.contextmanager
def workdir_lock(workdir: Path, say: Callable[[str], None]) -> Iterator[None]:
    """Hold the lock of ``workdir`` (need not exist yet) for the block.

    If another run holds it, ``say`` is told once and the call waits (Ctrl-C
    stops the wait). Raises UsageError if the lock file cannot be made.
    """
    workdir = workdir.resolve()  # one folder, one lock, however it was named
    key = hashlib.sha256(os.fsencode(workdir)).hexdigest()[:32]
    path = cache_dir() / "locks" / f"{key}.lock"
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    except OSError as err:
        raise UsageError(f"cannot make the lock file {path}: {err.strerror}") from err
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.pread(fd, 200, 0).decode(errors="replace").strip() or "another run"
            say(f"waiting for {holder} to finish with {workdir}")
            fcntl.flock(fd, fcntl.LOCK_EX)
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"apply.py (pid {os.getpid()})\n".encode(), 0)
        yield
    finally:
        os.close(fd)  # releases the lock
