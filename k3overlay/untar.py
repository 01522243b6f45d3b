"""Extracting a tar archive safely on every Python ``requires-python`` admits.

tarfile's ``data`` filter (no absolute paths, nothing outside the destination,
no links out of it, no device files, no set-uid bits) came with Python 3.11.4;
Debian 12's own Python is 3.11.2, where ``extractall(filter=...)`` is a
TypeError. Where tarfile has the filter it is used as is; elsewhere each member
is checked here by the same rules, then extracted one by one.

An archive from an index is also bounded before it is read (``opened``, ``members``): a
decompression bomb (GiBs of zeros in a few MiB of gzip), a header declaring GiBs that
tarfile would read into memory, or millions of members is refused, not unpacked. So is a
header tarfile would follow out of bounds, before it reads or seeks for it: a negative size
(base-256 size fields and pax ``size`` records admit one; tarfile would read the whole stream
for it, or seek back to an earlier header and loop), a member whose header is not after the
one before it, more than ``MAX_HEADER_BYTES`` of long-name and pax headers before one member
(tarfile reads them whole, one nested call each), and any sparse member, GNU or pax.
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
# a member's GNU long name/link and pax headers: a few paths and keywords in any real archive
MAX_HEADER_BYTES = 64 << 10
_COMPRESSED = ((b"\x1f\x8b", lambda f: gzip.GzipFile(fileobj=f, mode="rb")), (b"BZh", bz2.BZ2File),
               (b"\xfd7zXZ\x00", lzma.LZMAFile))


class UnsafeMember(tarfile.TarError):
    """A member the ``data`` filter would refuse (absolute, escaping, a device file)."""


class TooLarge(tarfile.TarError):
    """An archive past ``MAX_STREAM_BYTES`` unpacked or ``MAX_MEMBERS`` members, a member with more
    than ``MAX_HEADER_BYTES`` of extended headers, or a sparse member."""


class BadHeader(tarfile.TarError):
    """A header tarfile would follow out of bounds: a negative size, or one pointing back."""


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
            yield stack.enter_context(tarfile.open(fileobj=_Capped(stream, max_bytes), mode="r:",
                                                   tarinfo=_Header))


def members(archive: tarfile.TarFile, max_members: int | None = None) -> Iterator[tarfile.TarInfo]:
    """``archive``'s members, read one at a time; TooLarge at the one past ``max_members``
    (default ``MAX_MEMBERS``), or at a sparse member (unpacked, it could be far larger than the
    stream says); BadHeader at a member with a negative size (a pax ``size`` record can give
    one) or one whose header is not after the one before: tarfile went back, and would loop."""
    max_members = MAX_MEMBERS if max_members is None else max_members
    previous = -1
    for count, member in enumerate(archive, 1):
        if count > max_members:
            raise TooLarge(f"more than {max_members} members")
        if member.issparse():
            raise TooLarge(f"{member.name!r} is a sparse file")
        if member.size < 0:
            raise BadHeader(f"{member.name!r} has a header with a negative size")
        if member.offset <= previous:
            raise BadHeader(f"{member.name!r} has a header pointing back at an earlier one")
        previous = member.offset
        yield member


class _Header(tarfile.TarInfo):
    """A TarInfo that refuses, before tarfile reads or seeks for it, a header with a negative size,
    more than ``MAX_HEADER_BYTES`` of long-name and pax headers before one member (read whole,
    each nesting a call), and a sparse member (GNU's extended headers or pax 1.0's map are read
    block by block, as many as the stream holds)."""

    def _proc_member(self, tarfile_):
        if self.size < 0:
            raise BadHeader(f"{self.name!r} has a header with a negative size")
        if self.type == tarfile.GNUTYPE_SPARSE:
            raise TooLarge(f"{self.name!r} is a sparse file")
        # tarfile_.offset is where this member's first header began; the headers so far lie between
        headers = self.offset - tarfile_.offset + tarfile.BLOCKSIZE
        if self.type in _EXTENDED:
            headers += self._block(self.size)
        if headers > MAX_HEADER_BYTES:
            raise TooLarge(f"{self.name!r} has more than {MAX_HEADER_BYTES >> 10} KiB of headers")
        return super()._proc_member(tarfile_)

    def _proc_gnusparse_00(self, member, *_):
        raise TooLarge(f"{member.name!r} is a sparse file")

    _proc_gnusparse_01 = _proc_gnusparse_10 = _proc_gnusparse_00


_EXTENDED = (tarfile.GNUTYPE_LONGNAME, tarfile.GNUTYPE_LONGLINK, tarfile.XHDTYPE, tarfile.XGLTYPE,
             tarfile.SOLARIS_XHDTYPE)


class _Capped:
    """A seekable stream that refuses to go past ``limit`` bytes: the decompressor's read or
    seek is refused before it decompresses (or tarfile allocates) what lies beyond.

    tarfile reading an archive (``open``, iterating, extracting) always reads a size: a read of
    no size or a negative one comes from a header with a negative size, and is refused unread,
    as is a seek to before the start."""

    def __init__(self, stream, limit: int) -> None:
        self._stream, self._limit = stream, limit

    def read(self, size: int | None = -1) -> bytes:
        if size is None or size < 0:
            raise BadHeader("a header with a negative size")
        if size > self._limit - self._stream.tell():
            raise self._past()
        return self._stream.read(size)

    def seek(self, offset: int, whence: int = os.SEEK_SET) -> int:
        if whence == os.SEEK_SET and offset < 0:
            raise BadHeader("a header pointing before the start of the archive")
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
