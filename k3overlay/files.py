"""Reading and writing files without surprises: never through a link, never half-written.

  ``read_regular``     the bytes of a regular file; None for a link, a FIFO, anything else
  ``open_regular``     a descriptor of one of the tool's own files (a lock file, a cached
                       download, a partial one): a link, a FIFO or a device there is refused
                       in one line, never followed or waited on;
  ``write_in_tree``    a file laid into a tree (a vLLM work tree, ``overlay/``): every folder
                       below the tree's top is opened without following links, so a link
                       anywhere on the way (``pkg -> /etc``) or at the destination is refused,
                       never written through; ``write_all_in_tree`` several such files, all
                       or none (the overlay laid into a checkout, an export of patches/);
  ``write_atomically`` a file the user named (a report): the whole text or nothing; a full
                       disk leaves the previous file as it was. A stream the user named
                       (``/dev/stdout``, ``/dev/fd/N`` of ``>(cmd)``, a FIFO, a device) is
                       written to in place, never replaced by a file.
Both writers write a temporary file next to the destination, flush it to disk and rename
it into place, so a reader never sees a half-written file and an interrupted run leaves
the old one.
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import os
import re
import secrets
import stat
import sys
from pathlib import Path

from .errors import UsageError
from .interrupts import deferred
from .regular import kind_of, open_regular, read_regular  # noqa: F401  (the tool's readers)

_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC

# What writing can fail with that is the disk's or the user's, never the data's: a full disk, a
# quota, a read-only mount, a folder not ours to write.
CANNOT_WRITE = frozenset({errno.ENOSPC, errno.EDQUOT, errno.EFBIG, errno.EROFS, errno.EACCES,
                          errno.EPERM})


def write_in_tree(root: Path, rel: str, data: bytes, *, executable: bool = False) -> None:
    """Write ``data`` to ``root/rel`` (a ``/``-separated path), following no link below ``root``.

    Missing folders are made. The file gets mode 0o777 (``executable``) or 0o666,
    less the umask, like a file git checks out. Raises UsageError, writing
    nothing, when a folder on the way is a link or not a folder, or the
    destination is a link, a folder or anything but a regular file.
    """
    write_all_in_tree(root, {rel: (data, executable)})


STAGING = ".k3-tmp"  # the project's folder for an export's temporary files (its .gitignore names it)


def write_all_in_tree(root: Path, files: dict[str, tuple[bytes, bool]], *,
                      staging: str | None = None, remove: tuple[str, ...] = (),
                      unchanged: dict[str, str | None] | None = None) -> None:
    """Write each ``rel: (data, executable)`` under ``root`` as ``write_in_tree`` does, all or
    none: every file is first written whole to a temporary file and flushed to disk, and
    only then are they all renamed into place. A refused path, a full disk or Ctrl-C before
    the renames leaves every destination as it was (a folder made on the way may stay,
    empty). The temporary files are named with a token of this call, which the journal
    records, so a killed run's are found by the next (``recovery.write``) and nobody
    else's is ever taken for them. They lie beside their destinations, or, with
    ``staging`` (a folder under ``root`` that git ignores: ``STAGING``), in a folder of
    this call's own there: a killed ``--export`` then leaves nothing in ``overlay/`` or
    ``patches/`` that other runs would read as data or ``git add -A`` would commit.
    ``remove``: files (``rel`` paths) unlinked once every file is in place (an export's
    patches that left the series). Once all is staged, the renames and removals are
    journaled as one ``rename`` step (each path with its old and new sha256): a run
    killed part-way through them is finished by the next (``finish_renames``), never
    left half old, half new. ``unchanged``: ``{rel: sha256, or None for nothing}`` each
    destination and removed file held when the caller read them; one that holds anything
    else once all is staged (the user's edit while the run went on) stops the call before
    any rename: UsageError naming it, nothing written. Raises UsageError as ``write_in_tree``.
    """
    from . import journal  # (the journal opens its own file with ``open_regular``)

    token = secrets.token_hex(4)
    own = f"{staging}/{token}" if staging else None
    with journal.step("write", root=str(root), folders=sorted({r.rpartition("/")[0] for r in files}),
                      token=token, staging=own):
        _write_files(root, files, token, own, remove, unchanged)


def _write_files(root: Path, files: dict[str, tuple[bytes, bool]], token: str, own: str | None,
                 remove: tuple[str, ...], unchanged: dict[str, str | None] | None = None) -> None:
    from . import journal

    folders: dict[str, int] = {}  # folder (relative to root) -> its descriptor, opened once
    staged: list[tuple[int, str, int, str]] = []  # (its folder, temporary name, folder, name)
    moves: list[list[str | None]] = []  # [temporary file, destination, old sha256, new sha256]
    try:
        here = _folder_of(root, f"{own}/-", folders)[0] if own else None
        for number, (rel, (data, executable)) in enumerate(files.items()):
            dirfd, name = _folder_of(root, rel, folders)
            where = dirfd if here is None else here
            temp = f".{number}.{name[:56]}.{token}.k3-tmp" if own else f".{name[:64]}.{token}.k3-tmp"
            try:
                _stage(where, name, data, 0o777 if executable else 0o666, temp=temp)
            except OSError as err:
                raise UsageError(f"cannot write {rel}: {err.strerror}") from err
            staged.append((where, temp, dirfd, name))
            moves.append([f"{own or rel.rpartition('/')[0]}/{temp}".lstrip("/"), rel,
                          digest(root, rel), hashlib.sha256(data).hexdigest()])
        gone = [[rel, digest(root, rel)] for rel in remove]
        if unchanged is not None:  # the last look before the renames: an edit since the caller's read stays
            now = {rel: digest(root, rel) for rel in files} | dict(gone)  # all staged: read again
            edited = sorted(rel for rel, digest in now.items() if digest != unchanged.get(rel))
            if edited:
                raise UsageError(f"{edited[0]}{f' and {len(edited) - 1} more' if len(edited) > 1 else ''} "
                                 f"changed while this run went on; nothing was written, your change is "
                                 f"as you left it: commit or stash it, then run again")
        journal.point("write.staged")
        name = ""
        try:
            with journal.step("rename", root=str(root), moves=moves, remove=gone), \
                    deferred():  # Ctrl-C waits for the last rename: all of them, or none
                while staged:
                    where, temp, dirfd, name = staged[0]
                    os.rename(temp, name, src_dir_fd=where, dst_dir_fd=dirfd)
                    staged.pop(0)
                for rel, _old in gone:
                    dirfd, name = _folder_of(root, rel, folders)
                    with contextlib.suppress(FileNotFoundError):
                        os.unlink(name, dir_fd=dirfd)
                for dirfd in folders.values():
                    os.fsync(dirfd)  # the renames themselves survive a crash
        except OSError as err:
            raise UsageError(f"cannot write {name}: {err.strerror}") from err
    finally:
        for where, temp, _dirfd, _name in staged:
            with contextlib.suppress(OSError):
                os.unlink(temp, dir_fd=where)
        if own and "" in folders:
            for folder in (own, own.rpartition("/")[0]):  # (the second only if it is empty)
                with contextlib.suppress(OSError):
                    os.rmdir(folder, dir_fd=folders[""])
        for dirfd in folders.values():
            os.close(dirfd)


def digest(root: Path, rel: str) -> str | None:
    """The sha256 of the regular file ``root/rel``, read following no link below ``root``;
    None if nothing is there, "other" for anything but a regular file."""
    folders: dict[str, int] = {}
    try:
        dirfd, name = _folder_of(root, rel, folders, make=False)
        fd = os.open(name, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC, dir_fd=dirfd)
    except FileNotFoundError:
        return None
    except UsageError as err:  # (a folder on the way missing, a link, no folder)
        return None if isinstance(err.__cause__, FileNotFoundError) else "other"
    except OSError:
        return "other"
    finally:
        for each in folders.values():
            os.close(each)
    with os.fdopen(fd, "rb") as f:
        return hashlib.sha256(f.read()).hexdigest() if stat.S_ISREG(os.fstat(f.fileno()).st_mode) else "other"


def finish_renames(root: Path, moves: list, remove: list) -> bool | None:
    """Finish a killed ``rename`` step (``write_all_in_tree``) that had begun renaming: rename
    each staged file still there into place, then remove what it was to remove. One that
    had renamed nothing yet is left to ``recovery.write`` (its staged files removed: the
    tree is as it was). Only where the tree is still as the kill left it: every destination
    already renamed holds its new content, every other its old (or its new), every file to
    remove its old one (or nothing). A file put back since (``git checkout -- patches/series``
    after the kill) leaves the whole step as it is: finishing the rest around it would leave
    the tree half old, half new (the series listing a patch the step removes). True if
    finished, False if left as it is (changed since), None if there was nothing to finish."""
    staged = {dest: digest(root, temp) == new for temp, dest, _old, new in moves}
    left = [(temp, dest) for temp, dest, _old, _new in moves if staged[dest]]
    doomed = [rel for rel, _old in remove if digest(root, rel) is not None]
    begun = any(digest(root, dest) == new != old for _temp, dest, old, new in moves) \
        or any(old is not None and digest(root, rel) is None for rel, old in remove)
    if not begun or (not left and not doomed):
        return None
    as_left = {dest: (old, new) if staged[dest] else (new,) for _temp, dest, old, new in moves}
    if any(digest(root, dest) not in held for dest, held in as_left.items()) \
            or any(digest(root, rel) not in (old, None) for rel, old in remove):
        return False
    folders: dict[str, int] = {}
    try:
        for temp, dest in left:
            where, temp_name = _folder_of(root, temp, folders, make=False)
            dirfd, name = _folder_of(root, dest, folders)
            os.rename(temp_name, name, src_dir_fd=where, dst_dir_fd=dirfd)
        for rel in doomed:
            dirfd, name = _folder_of(root, rel, folders, make=False)
            with contextlib.suppress(FileNotFoundError):
                os.unlink(name, dir_fd=dirfd)
        for dirfd in folders.values():
            os.fsync(dirfd)
    except OSError as err:
        raise UsageError(f"cannot finish writing into {root}: {err.strerror}") from err
    finally:
        for dirfd in folders.values():
            os.close(dirfd)
    return True


def _folder_of(root: Path, rel: str, folders: dict[str, int], *, make: bool = True) -> tuple[int, str]:
    """A descriptor of the folder ``rel``'s file goes in, and the file's name. The folder is
    made if missing, every folder below ``root`` opened without following a link, and kept
    open in ``folders`` (its caller closes them). UsageError if a folder on the way or the
    destination itself is no place to write a file."""
    parts = rel.split("/")
    if not rel or any(part in ("", ".", "..") for part in parts):
        raise UsageError(f"refusing to write {rel!r}: not a plain path inside the tree")
    try:
        if "" not in folders:
            folders[""] = os.open(root, _DIR_FLAGS)
        for depth, name in enumerate(parts[:-1], 1):
            here, above = "/".join(parts[:depth]), "/".join(parts[:depth - 1])
            if here in folders:
                continue
            if make:
                with contextlib.suppress(FileExistsError):
                    os.mkdir(name, dir_fd=folders[above])
            try:
                folders[here] = os.open(name, _DIR_FLAGS | os.O_NOFOLLOW, dir_fd=folders[above])
            except OSError as err:
                if err.errno not in (errno.ELOOP, errno.ENOTDIR):
                    raise
                raise UsageError(f"refusing to write {rel}: {here} is a "
                                 f"{kind_of(name, folders[above])}, not a folder") from err
        dirfd, name = folders["/".join(parts[:-1])], parts[-1]
        with contextlib.suppress(FileNotFoundError):
            if not stat.S_ISREG(os.lstat(name, dir_fd=dirfd).st_mode):
                raise UsageError(f"refusing to write {rel}: it is a {kind_of(name, dirfd)} in the "
                                 f"tree, not a file")
    except OSError as err:
        raise UsageError(f"cannot write {rel}: {err.strerror}") from err
    return dirfd, name


def write_atomically(path: Path, data: bytes) -> None:
    """Replace the file at ``path`` with ``data`` in one step, on disk before returning.

    A temporary file in the same folder is written, flushed to disk and renamed
    over ``path`` (whose link, if it is one, is followed: the user named it).
    An existing file keeps its permission bits. Raises UsageError (one line) if
    it cannot be written; ``path`` is then as it was and no temporary file is left.
    A stream (see ``stream_target``) is written to as it is: renaming a file over
    ``/dev/null`` or a FIFO would destroy it, and over the file behind ``/dev/stdout``
    would cut off what was already printed.
    """
    stream = stream_target(path)
    if stream is not None:
        _write_stream(path, stream, data)
        return
    target = Path(os.path.realpath(path))
    try:
        dirfd = os.open(target.parent, _DIR_FLAGS)
    except OSError as err:
        raise UsageError(f"cannot write {path}: {err.strerror}") from err
    try:
        try:
            mode = stat.S_IMODE(os.stat(target.name, dir_fd=dirfd).st_mode)
        except FileNotFoundError:
            mode = None
        _replace(dirfd, target.name, data, 0o666, keep_mode=mode)
    except OSError as err:
        raise UsageError(f"cannot write {path}: {err.strerror}") from err
    finally:
        os.close(dirfd)


def refuse_one_file_twice(named: list[tuple[Path | None, str]]) -> None:
    """Raise UsageError if two options name one file (links followed; a stream such as
    ``/dev/stdout`` may be named twice): ``named`` is ``(path or None, option)`` in the
    order they are written or read, and the later write would replace the earlier file
    (a report, or an input the run reads, such as ``--release-wheel``)."""
    seen: dict[object, tuple[Path, str]] = {}
    for path, option in named:
        if path is None or stream_target(path) is not None:
            continue
        try:  # one inode under two names realpath cannot join (a hard link, a bind mount, a case)
            info = os.stat(path)
            first = seen.setdefault((info.st_dev, info.st_ino), (path, option))
            if first[1] != option:
                raise UsageError(f"{option} {path} is the file {first[1]} {first[0]} names; "
                                 f"give each its own")
        except OSError:
            pass
        first = seen.setdefault(os.path.realpath(path), (path, option))
        if first[1] != option:
            raise UsageError(f"{option} {path} is the file {first[1]} {first[0]} names; give each "
                             f"its own")


_OWN_FD = re.compile(r"/(?:dev|proc/self|proc/(\d+))/fd/(\d+)")
_STD = {"/dev/stdout": 1, "/dev/stderr": 2}


def stream_target(path: Path) -> int | str | None:
    """What ``path`` names if it is no place for a file: an open descriptor of this process
    (``/dev/stdout``, ``/dev/stderr``, ``/dev/fd/N``, ``/proc/self/fd/N``; an int), or an
    existing FIFO, socket or device (links followed; ``"special"``). None for anything else
    (a regular file, a folder, nothing yet)."""
    name = os.path.abspath(path)
    fd = _STD.get(name)
    match = _OWN_FD.fullmatch(name)
    if match and (match.group(1) is None or int(match.group(1)) == os.getpid()):
        fd = int(match.group(2))
    if fd is not None:
        with contextlib.suppress(OSError):
            os.fstat(fd)
            return fd
    try:
        mode = os.stat(path).st_mode
    except OSError:
        return None
    return None if stat.S_ISREG(mode) or stat.S_ISDIR(mode) else "special"


def _write_stream(path: Path, stream: int | str, data: bytes) -> None:
    """Write ``data`` to an open descriptor of ours, or open the special file and write it."""
    for console in (sys.stdout, sys.stderr):  # what was printed comes first
        with contextlib.suppress(Exception):
            console.flush()
    try:
        fd = stream if isinstance(stream, int) else os.open(path, os.O_WRONLY | os.O_CLOEXEC)
        try:
            _write_all(fd, data)
        finally:
            if not isinstance(stream, int):
                os.close(fd)
    except OSError as err:
        raise UsageError(f"cannot write {path}: {err.strerror}") from err


def _replace(dirfd: int, name: str, data: bytes, mode: int, keep_mode: int | None = None) -> None:
    """Write ``data`` to a new temporary file in folder ``dirfd``, flush it to disk and
    rename it to ``name``. The rename replaces ``name`` itself (never follows a link there)."""
    temp = _stage(dirfd, name, data, mode, keep_mode)
    try:
        os.rename(temp, name, src_dir_fd=dirfd, dst_dir_fd=dirfd)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(temp, dir_fd=dirfd)
        raise
    os.fsync(dirfd)  # the rename itself survives a crash


TEMPORARY = re.compile(r"^\..*\.[0-9a-f]{8}\.k3-tmp$")  # what ``_stage`` names its files


def _stage(dirfd: int, name: str, data: bytes, mode: int, keep_mode: int | None = None,
           temp: str | None = None) -> str:
    """A new temporary file (``temp``, or a name of its own beside ``name``) in folder
    ``dirfd`` holding ``data``, flushed to disk; its name. Nothing is left if it cannot be
    written whole."""
    temp = temp or f".{name[:64]}.{secrets.token_hex(4)}.k3-tmp"
    fd = os.open(temp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, mode,
                 dir_fd=dirfd)
    try:
        try:
            _write_all(fd, data)
            if keep_mode is not None:
                os.fchmod(fd, keep_mode)
            os.fsync(fd)
        finally:
            os.close(fd)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(temp, dir_fd=dirfd)
        raise
    return temp


def _write_all(fd: int, data: bytes) -> None:
    """``os.write`` until every byte is written (a pipe or a full disk may take fewer)."""
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view):]
