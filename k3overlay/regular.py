"""Files of the tool's own, and files it reads, are regular files: never a link followed,
never a FIFO waited on.

  ``read_regular``  the bytes of a regular file; None for a link, a FIFO, anything else
  ``open_regular``  a descriptor of one of the tool's own files (a lock file, a cached
                    download, the journal): a link, a FIFO or a device there is refused in
                    one line, never followed or waited on; with ``one_link``, a hard link
                    too (a file with another name, which writing in would change).
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


class CannotOpen(UsageError):
    """``open_regular`` failed on a regular file (or on nothing there, with ``O_CREAT``);
    ``errno`` says why (EACCES, EROFS: a caller may try again read-only)."""

    def __init__(self, message: str, errno: int | None) -> None:
        super().__init__(message)
        self.errno = errno


def open_regular(path: Path, flags: int, mode: int = 0o600, *, one_link: bool = False) -> int:
    """A descriptor of the regular file at ``path`` (made, with ``mode``, if ``flags`` has
    ``O_CREAT``), opened without following a link and without waiting on a FIFO.

    For the files the tool keeps for itself (``~/.cache/vllm-k3-overlay``: lock files,
    cached and partial downloads): nothing else should ever sit there, so a link, a
    FIFO, a socket, a device or a folder is refused, not used; with ``one_link``, so is a
    file with more than one name (a hard link: ``cp -al`` makes them), which a write would
    change under its other names too. Raises FileNotFoundError if there is nothing at
    ``path`` (and no ``O_CREAT``), else UsageError (one line): "PATH is a KIND, not a
    regular file; …", "PATH is a hard link …" or "cannot open PATH: …" (``CannotOpen``).
    """
    try:
        fd = os.open(path, flags | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC, mode)
    except FileNotFoundError:
        raise
    except OSError as err:  # ELOOP (a link), ENXIO (a FIFO nobody reads), EISDIR, EACCES, ...
        kind = kind_of(path)
        if kind not in ("file", "missing path"):
            raise _not_regular(path, kind) from err
        raise CannotOpen(f"cannot open {path}: {err.strerror}", err.errno) from err
    info = os.fstat(fd)
    if not stat.S_ISREG(info.st_mode) or (one_link and info.st_nlink != 1):
        os.close(fd)
        if stat.S_ISREG(info.st_mode):
            raise _not_one(path, info.st_nlink)
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


def _not_one(path: Path, links: int) -> UsageError:
    if links == 0:  # (removed between the open and the look)
        return UsageError(f"{path} was removed as the tool opened it; run again")
    return UsageError(f"{path} is a hard link (one file with {links} names, as `cp -al` makes): refusing to "
                      f"write in it, which would change the file under its other names; remove it (the "
                      f"tool makes its own)")


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
