"""Files of the tool's own, and files it reads, are regular files: never a link followed,
never a FIFO waited on.

  ``read_regular``  the bytes of a regular file; None for a link, a FIFO, anything else
  ``open_regular``  a descriptor of one of the tool's own files (a lock file, a cached
                    download, the journal): a link, a FIFO or a device there is refused in
                    one line, never followed or waited on.
  ``own_folder``    one of the tool's own folders in the cache (locks and journals, the
                    mirror, downloads): made if missing; a link or anything but a folder
                    there is refused in one line, nothing made through it.

Apart from ``files`` (which writes) so that what ``files`` builds on (the journal of a
killed run's steps) can read and open without importing the writers.
"""

from __future__ import annotations

import os
import stat
from pathlib import Path

from .errors import UsageError


def read_regular(file: Path) -> bytes | None:
    """The bytes of ``file`` if it is a regular file we can read; None for anything else.

    A link (dangling, or out of the tree) is never followed, a FIFO never waited on.
    """
    try:
        fd = os.open(file, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError:
        return None  # missing, a link (ELOOP), unreadable
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            return None
        with os.fdopen(fd, "rb", closefd=False) as stream:
            return stream.read()
    except OSError:
        return None
    finally:
        os.close(fd)


def open_regular(path: Path, flags: int, mode: int = 0o600) -> int:
    """A descriptor of the regular file at ``path`` (made, with ``mode``, if ``flags`` has
    ``O_CREAT``), opened without following a link and without waiting on a FIFO.

    For the files the tool keeps for itself (``~/.cache/vllm-k3-overlay``: lock files,
    cached and partial downloads): nothing else should ever sit there, so a link, a
    FIFO, a socket, a device or a folder is refused, not used. Raises
    FileNotFoundError if there is nothing at ``path`` (and no ``O_CREAT``), else
    UsageError (one line): "PATH is a KIND, not a regular file; …" or "cannot open PATH: …".
    """
    try:
        fd = os.open(path, flags | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC, mode)
    except FileNotFoundError:
        raise
    except OSError as err:  # ELOOP (a link), ENXIO (a FIFO nobody reads), EISDIR, EACCES, ...
        kind = kind_of(path)
        if kind not in ("file", "missing path"):
            raise _not_regular(path, kind) from err
        raise UsageError(f"cannot open {path}: {err.strerror}") from err
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        os.close(fd)
        raise _not_regular(path, kind_of(path))
    os.set_blocking(fd, True)
    return fd


def own_folder(path: Path) -> Path:
    """``path``, a folder the tool keeps in its cache, made (and the cache above it) if
    missing. Returns ``path``. Raises UsageError (one line) if a link (even to a folder: its
    files would land wherever it points), a file or anything but a folder is there, or it
    cannot be made."""
    kind = kind_of(path)
    if kind == "missing path":
        try:
            path.mkdir(parents=True, exist_ok=True)
        except OSError as err:
            raise UsageError(f"cannot make {path}: {err.strerror}") from err
        kind = kind_of(path)
    if kind != "folder":
        raise UsageError(f"{path} is a {kind}, not a folder; refusing to write through it (the "
                         f"tool keeps only its own files there: remove it)")
    return path


def _not_regular(path: Path, kind: str) -> UsageError:
    return UsageError(f"{path} is a {kind}, not a regular file; refusing to use it (the tool "
                      f"keeps only its own files there: remove it)")


def kind_of(name: str | Path, dirfd: int | None = None, *, follow: bool = False) -> str:
    """What ``name`` (in folder ``dirfd``) is, in words (for an error message); with ``follow``,
    what a link there leads to."""
    try:
        mode = os.stat(name, dir_fd=dirfd, follow_symlinks=follow).st_mode
    except OSError:
        return "missing path"
    kinds = ((stat.S_ISREG, "file"), (stat.S_ISLNK, "symbolic link"), (stat.S_ISDIR, "folder"),
             (stat.S_ISFIFO, "FIFO"), (stat.S_ISSOCK, "socket"))
    return next((word for test, word in kinds if test(mode)), "device")
