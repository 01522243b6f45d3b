"""Extracting a tar archive safely on every Python ``requires-python`` admits.

tarfile's ``data`` filter (no absolute paths, nothing outside the destination,
no links out of it, no device files, no set-uid bits) came with Python 3.11.4;
Debian 12's own Python is 3.11.2, where ``extractall(filter=...)`` is a
TypeError. Where tarfile has the filter it is used as is; elsewhere each member
is checked here by the same rules, then extracted one by one.

An archive from an index is also bounded before it is read (``opened``, ``members``): a
decompression bomb (GiBs of zeros in a few MiB of gzip), a header declaring GiBs that
tarfile would read into memory, or millions of members is refused, not unpacked.
"""

from __future__ import annotations

import bz2
import contextlib
import copy
import gzip
import lzma
import os
import tarfile
from collections.abc import Iterable, Iterator
from pathlib import Path

# vLLM 0.34.0's sdist unpacks to a 0.11 GiB tar stream of 8,000 members: far under both.
MAX_STREAM_BYTES = 4 << 30
MAX_MEMBERS = 200_000
_COMPRESSED = ((b"\x1f\x8b", lambda f: gzip.GzipFile(fileobj=f, mode="rb")), (b"BZh", bz2.BZ2File),
               (b"\xfd7zXZ\x00", lzma.LZMAFile))


class UnsafeMember(tarfile.TarError):
    """A member the ``data`` filter would refuse (absolute, escaping, a device file)."""


class TooLarge(tarfile.TarError):
    """An archive past ``MAX_STREAM_BYTES`` unpacked or ``MAX_MEMBERS`` members, or a sparse member."""


@contextlib.contextmanager
def opened(path: Path, max_bytes: int | None = None) -> Iterator[tarfile.TarFile]:
    """The tar archive ``path`` (plain, gzip, bzip2 or xz, by its magic bytes) for reading, its
    unpacked stream capped at ``max_bytes`` (default ``MAX_STREAM_BYTES``): a read or seek past
    it raises TooLarge before anything is decompressed or allocated for it. Raises OSError if
    ``path`` cannot be read."""
    max_bytes = MAX_STREAM_BYTES if max_bytes is None else max_bytes
    with open(path, "rb") as raw:
        magic = raw.read(6)
        raw.seek(0)
        opener = next((cls for prefix, cls in _COMPRESSED if magic.startswith(prefix)), None)
        with contextlib.ExitStack() as stack:
            stream = stack.enter_context(opener(raw)) if opener else raw
            yield stack.enter_context(tarfile.open(fileobj=_Capped(stream, max_bytes), mode="r:"))


def members(archive: tarfile.TarFile, max_members: int | None = None) -> Iterator[tarfile.TarInfo]:
    """``archive``'s members, read one at a time; TooLarge at the one past ``max_members``
    (default ``MAX_MEMBERS``), or at a sparse member (unpacked, it could be far larger than the
    stream says)."""
    max_members = MAX_MEMBERS if max_members is None else max_members
    for count, member in enumerate(archive, 1):
        if count > max_members:
            raise TooLarge(f"more than {max_members} members")
        if member.issparse():
            raise TooLarge(f"{member.name!r} is a sparse file")
        yield member


class _Capped:
    """A seekable stream that refuses to go past ``limit`` bytes: the decompressor's read or
    seek is refused before it decompresses (or tarfile allocates) what lies beyond."""

    def __init__(self, stream, limit: int) -> None:
        self._stream, self._limit = stream, limit

    def read(self, size: int = -1) -> bytes:
        left = self._limit - self._stream.tell()
        if size is None or size < 0:
            data = self._stream.read(left + 1)
            if len(data) > left:
                raise self._past()
            return data
        if size > left:
            raise self._past()
        return self._stream.read(size)

    def seek(self, offset: int, whence: int = os.SEEK_SET) -> int:
        if whence == os.SEEK_SET and offset > self._limit:
            raise self._past()
        return self._stream.seek(offset, whence)

    def tell(self) -> int:
        return self._stream.tell()

    def _past(self) -> TooLarge:
        return TooLarge(f"it unpacks to more than {self._limit >> 20} MiB")


def extract(archive: tarfile.TarFile, dest: Path, members: Iterable[tarfile.TarInfo] | None = None) -> None:
    """Extract ``members`` (default: all) of ``archive`` under ``dest`` by the ``data`` filter's rules.

    Raises a tarfile.TarError (tarfile's own FilterError, or UnsafeMember where
    tarfile has no filter) for a member that would land outside ``dest``, a link
    pointing out of it, or a device or FIFO; what was extracted before stays.
    """
    chosen = archive.getmembers() if members is None else list(members)
    if hasattr(tarfile, "data_filter"):
        archive.extractall(dest, members=chosen, filter="data")
        return
    dest = Path(os.path.realpath(dest))
    for member in chosen:  # checked just before it is written, so links made earlier count
        safe = _checked(member, dest)
        archive.extract(safe, dest, set_attrs=safe.mode is not None)


def _checked(member: tarfile.TarInfo, dest: Path) -> tarfile.TarInfo:
    """A copy of ``member`` safe to extract under ``dest``, as ``tarfile.data_filter`` makes it."""
    if not (member.isreg() or member.isdir() or member.issym() or member.islnk()):
        raise UnsafeMember(f"{member.name!r} is a special file")
    if member.name.startswith("/") or os.path.isabs(member.name):
        raise UnsafeMember(f"{member.name!r} is an absolute path")
    target = _inside(dest, dest / member.name, member.name)
    if member.issym():
        if os.path.isabs(member.linkname):
            raise UnsafeMember(f"{member.name!r} links to the absolute path {member.linkname!r}")
        _inside(dest, target.parent / member.linkname, member.name)
    elif member.islnk():
        _inside(dest, dest / member.linkname, member.name)
    safe = copy.copy(member)
    safe.uid, safe.gid = os.getuid(), os.getgid()  # never chown to the archive's owner, even as root
    safe.uname = safe.gname = ""
    # the filter's rule: no set-uid or group/other write; owner reads and writes; exec only if
    # the owner's; a folder's or link's mode is not set at all (None: skip its attributes)
    mode = member.mode & 0o755
    if member.isreg() or member.islnk():
        safe.mode = (mode if mode & 0o100 else mode & ~0o111) | 0o600
    else:
        safe.mode = None
    return safe


def _inside(dest: Path, path: Path, name: str) -> Path:
    """``path`` resolved, which must stay under ``dest``; UnsafeMember otherwise."""
    resolved = Path(os.path.realpath(path))
    if resolved != dest and dest not in resolved.parents:
        raise UnsafeMember(f"{name!r} would be extracted outside the destination")
    return resolved
