"""Extracting archives on a Python whose tarfile has no ``filter=`` (3.11.0-3.11.3, Debian 12's 3.11.2).

Each case runs twice: with this Python's tarfile, and with the ``filter`` keyword taken away
as those Pythons lack it, where ``untar`` must apply the same rules itself.
"""

from __future__ import annotations

import contextlib
import gzip
import io
import os
import stat
import tarfile

import pytest

from k3overlay import errors, untar
from k3overlay.mirror import unpack


@pytest.fixture(params=["this python", "no filter="])
def tarfile_kind(request, monkeypatch):
    """tarfile as it is, or as Python 3.11.2 has it: no data_filter, extractall(filter=) a TypeError."""
    if request.param == "no filter=":
        monkeypatch.delattr(tarfile, "data_filter", raising=False)
        real_extractall, real_extract = tarfile.TarFile.extractall, tarfile.TarFile.extract

        def old_extractall(self, path=".", members=None, *, numeric_owner=False, **kw):
            if kw:
                raise TypeError(f"TarFile.extractall() got an unexpected keyword argument {next(iter(kw))!r}")
            return real_extractall(self, path, members, numeric_owner=numeric_owner)

        def old_extract(self, member, path="", set_attrs=True, *, numeric_owner=False, **kw):
            if kw:
                raise TypeError(f"TarFile.extract() got an unexpected keyword argument {next(iter(kw))!r}")
            return real_extract(self, member, path, set_attrs, numeric_owner=numeric_owner)

        monkeypatch.setattr(tarfile.TarFile, "extractall", old_extractall)
        monkeypatch.setattr(tarfile.TarFile, "extract", old_extract)
    return request.param


def tar_of(tmp_path, *members: tuple[tarfile.TarInfo, bytes]):
    path = tmp_path / "a.tar"
    with tarfile.open(path, "w") as tar:
        for info, data in members:
            info.size = len(data) if info.isreg() else 0
            tar.addfile(info, io.BytesIO(data))
    return path


def info(name: str, kind=tarfile.REGTYPE, linkname: str = "", mode: int = 0o644) -> tarfile.TarInfo:
    member = tarfile.TarInfo(name)
    member.type, member.linkname, member.mode = kind, linkname, mode
    return member


def test_good_archive_extracts_with_safe_modes(tmp_path, tarfile_kind):
    path = tar_of(tmp_path, (info("pkg", tarfile.DIRTYPE, mode=0o755), b""),
                  (info("pkg/a.py", mode=0o4777), b"A = 1\n"), (info("pkg/run.sh", mode=0o700), b"#!/bin/sh\n"),
                  (info("pkg/b.py", tarfile.SYMTYPE, "a.py"), b""),
                  (info("pkg/c.py", tarfile.LNKTYPE, "pkg/a.py"), b""))
    with tarfile.open(path) as archive:
        untar.extract(archive, tmp_path / "out")
    out = tmp_path / "out/pkg"
    assert (out / "a.py").read_text() == (out / "b.py").read_text() == (out / "c.py").read_text() == "A = 1\n"
    assert os.readlink(out / "b.py") == "a.py"
    assert stat.S_IMODE((out / "a.py").stat().st_mode) & 0o4022 == 0  # no set-uid, no group/other write
    assert stat.S_IMODE((out / "run.sh").stat().st_mode) & 0o100


@pytest.mark.parametrize("bad", ["../evil", "/abs/evil", "link-out", "link-abs", "hardlink-out", "fifo",
                                 "through-link"])
def test_unsafe_members_are_refused(tmp_path, tarfile_kind, bad):
    members = {
        "../evil": [(info("../evil"), b"x")],
        "/abs/evil": [(info(str(tmp_path / "abs-evil")), b"x")],
        "link-out": [(info("pkg/l", tarfile.SYMTYPE, "../../outside"), b"")],
        "link-abs": [(info("pkg/l", tarfile.SYMTYPE, "/etc/passwd"), b"")],
        "hardlink-out": [(info("pkg/l", tarfile.LNKTYPE, "../outside"), b"")],
        "fifo": [(info("pkg/f", tarfile.FIFOTYPE), b"")],
        # a link inside the tree to its parent, then a file written through it
        "through-link": [(info("up", tarfile.SYMTYPE, "."), b""), (info("up/../../evil"), b"x")],
    }[bad]
    path = tar_of(tmp_path, *members)
    with tarfile.open(path) as archive:
        if bad == "/abs/evil":  # tarfile's filter strips the leading "/", ours refuses: never outside
            with contextlib.suppress(untar.UnsafeMember):
                untar.extract(archive, tmp_path / "out")
        else:
            with pytest.raises(tarfile.TarError):
                untar.extract(archive, tmp_path / "out")
    assert not (tmp_path / "evil").exists() and not (tmp_path / "abs-evil").exists()
    assert not (tmp_path / "outside").exists()


def test_unpack_works_without_filter(tmp_path, tarfile_kind):
    """mirror.unpack, README command 1's first extraction, on a Python without ``filter=``."""
    out = io.BytesIO()
    with tarfile.open(fileobj=out, mode="w:gz") as tar:
        member = info("vllm-1.0.0/vllm/x.py")
        member.size = 6
        tar.addfile(member, io.BytesIO(b"X = 1\n"))
        escape = info("vllm-1.0.0/../../evil")
        escape.size = 1
    sdist = tmp_path / "vllm-1.0.0.tar.gz"
    sdist.write_bytes(out.getvalue())
    unpack(sdist, tmp_path / "tree")
    assert (tmp_path / "tree/vllm/x.py").read_text() == "X = 1\n"
    with tarfile.open(fileobj=(bad := io.BytesIO()), mode="w:gz") as tar:
        tar.addfile(escape, io.BytesIO(b"x"))
    sdist.write_bytes(bad.getvalue())
    with pytest.raises(errors.SourceError, match="cannot unpack"):
        unpack(sdist, tmp_path / "tree2")
    assert not (tmp_path / "evil").exists() and not (tmp_path / "tree2").exists()


def gz_of(tmp_path, *members: tuple[tarfile.TarInfo, bytes], mode: str = "w:gz"):
    path = tmp_path / "bomb.tar.gz"
    with tarfile.open(path, mode) as tar:
        for member, data in members:
            member.size = len(data)
            tar.addfile(member, io.BytesIO(data))
    return path


@pytest.mark.parametrize("mode", ["w:gz", "w:bz2", "w:xz", "w:"])
def test_an_archive_unpacking_past_the_cap_is_refused_as_it_is_read(tmp_path, mode):
    """A decompression bomb: 4 MiB of zeros, a few kB compressed, against a 1 MiB cap."""
    path = gz_of(tmp_path, (info("pkg/zeros"), bytes(4 << 20)), mode=mode)
    with untar.opened(path) as archive:  # the default cap: read as before
        assert [m.name for m in untar.members(archive)] == ["pkg/zeros"]
    with pytest.raises(untar.TooLarge, match="more than 1 MiB"):
        with untar.opened(path, max_bytes=1 << 20) as archive:
            untar.extract(archive, tmp_path / "out", untar.members(archive))
    assert not (tmp_path / "out/pkg/zeros").exists() or (tmp_path / "out/pkg/zeros").stat().st_size < 4 << 20


def test_a_header_declaring_more_than_the_cap_is_refused_unread(tmp_path):
    """A pax header is read whole into memory by tarfile: its size is checked first."""
    member = info("pkg/a")
    member.pax_headers = {"comment": "x" * (2 << 20)}
    path = gz_of(tmp_path, (member, b"a"), mode="w:gz")
    with pytest.raises(untar.TooLarge):
        with untar.opened(path, max_bytes=1 << 20) as archive:
            list(untar.members(archive))


def test_too_many_members_or_a_sparse_one_is_refused(tmp_path):
    path = gz_of(tmp_path, *((info(f"pkg/{i}"), b"") for i in range(11)))
    with untar.opened(path) as archive:
        assert len(list(untar.members(archive, max_members=11))) == 11
    with untar.opened(path) as archive, pytest.raises(untar.TooLarge, match="more than 10 members"):
        list(untar.members(archive, max_members=10))
    sparse = info("pkg/s", kind=tarfile.GNUTYPE_SPARSE)
    with tarfile.open(tmp_path / "s.tar", "w", format=tarfile.GNU_FORMAT) as tar:
        tar.addfile(sparse, io.BytesIO(b""))
    with pytest.raises(untar.TooLarge, match="sparse"):  # at its header: even tarfile.open, if first
        with untar.opened(tmp_path / "s.tar") as archive:
            list(untar.members(archive))


def test_unpack_refuses_a_bomb_in_one_line(tmp_path, monkeypatch):
    monkeypatch.setattr(untar, "MAX_STREAM_BYTES", 1 << 20)
    sdist = gz_of(tmp_path, (info("vllm-1.0.0/zeros"), bytes(4 << 20)))
    with pytest.raises(errors.SourceError, match=r"cannot unpack bomb.tar.gz: it unpacks to more than 1 MiB"):
        unpack(sdist, tmp_path / "tree")
    assert not (tmp_path / "tree").exists()


def header(name: str, size: int, kind: bytes = tarfile.REGTYPE,
           extra: dict[int, bytes] | None = None) -> bytes:
    """One raw 512-byte ustar header, ``size`` in base-256 when negative (first byte 0xFF), as tarfile
    reads it; ``extra`` writes bytes at other offsets (a sparse header's fields)."""
    buf = bytearray(512)
    buf[0:100] = name.encode().ljust(100, b"\0")
    buf[100:124] = b"0000644\0" + b"0000000\0" * 2
    buf[124:136] = (size % (1 << 96)).to_bytes(12, "big") if size < 0 else b"%011o\0" % size
    buf[136:157] = b"00000000000\0" + b" " * 8 + kind
    buf[257:265] = b"ustar\x0000"
    for at, data in (extra or {}).items():
        buf[at:at + len(data)] = data
    buf[148:156] = b"%06o\0 " % sum(buf)
    return bytes(buf)


def pax(**records: str) -> bytes:
    """A pax header's data, padded to whole blocks: its records, each led by its own length."""
    data = b""
    for key, value in records.items():
        body = f" {key}={value}\n".encode()
        length = len(body) + len(str(len(body)))
        length += len(str(length)) - len(str(len(body)))  # 99 + 2 digits makes 101: 3 digits
        data += str(length).encode() + body
    return data.ljust(-(-len(data) // 512) * 512, b"\0")


def raw_tar(tmp_path, *blocks: bytes, gz: bool = False):
    data = b"".join(blocks) + bytes(1024)
    path = tmp_path / ("raw.tar.gz" if gz else "raw.tar")
    path.write_bytes(gzip.compress(data, compresslevel=1) if gz else data)
    return path


@pytest.fixture
def bytes_read(monkeypatch) -> list[int]:
    """The size of each read untar's capped stream gave tarfile."""
    counts, real = [], untar._Capped.read

    def read(self, size=-1):
        data = real(self, size)
        counts.append(len(data))
        return data

    monkeypatch.setattr(untar._Capped, "read", read)
    return counts


def read_all(path, max_members: int | None = None) -> list[str]:
    names = []
    with untar.opened(path) as archive:
        for member in untar.members(archive, max_members):
            names.append(member.name)
    return names


@pytest.mark.parametrize("kind", [tarfile.GNUTYPE_LONGNAME, tarfile.GNUTYPE_LONGLINK, tarfile.XHDTYPE,
                                  tarfile.XGLTYPE])
def test_an_extended_header_with_a_negative_size_is_refused_unread(tmp_path, bytes_read, kind):
    """tarfile reads a long name or pax header whole, by its size: read(-1024) must not read the stream."""
    path = raw_tar(tmp_path, header("././@LongLink", -1024, kind), header("pkg/a", 0), bytes(8 << 20),
                   gz=True)
    with pytest.raises(untar.BadHeader, match="negative size"):
        read_all(path)
    assert sum(bytes_read) <= 1024


def test_the_capped_stream_never_reads_unbounded():
    stream = untar._Capped(io.BytesIO(bytes(4096)), 1 << 30)
    for size in (-1, -1024, None):
        with pytest.raises(untar.BadHeader, match="negative size"):
            stream.read(size)
    with pytest.raises(untar.BadHeader):
        stream.seek(-1)
    assert stream.tell() == 0 and stream.read(512) == bytes(512)


@pytest.mark.parametrize("gz", [False, True])
@pytest.mark.parametrize("how", ["size field", "pax size"])
def test_a_header_pointing_back_is_refused_not_looped(tmp_path, gz, how):
    """A member whose size sends tarfile back to an earlier header would loop to MAX_MEMBERS, each
    step re-decompressing the gzip from its start: it is refused at once."""
    if how == "size field":  # pkg/c at 1024, its data at 1536, the next header at 1536 - 1024: pkg/b
        blocks = [header("pkg/c", -1024)]
    else:  # a pax header at 1024 and its data, pkg/c at 2048, its data at 2560, back 2048: pkg/b
        blocks = [header("././@PaxHeader", 512, tarfile.XHDTYPE), pax(size="-2048"), header("pkg/c", 0)]
    path = raw_tar(tmp_path, header("pkg/a", 0), header("pkg/b", 0), *blocks, gz=gz)
    with pytest.raises(untar.BadHeader, match="negative size"):
        read_all(path, max_members=1000)


def test_members_refuses_a_member_not_after_the_one_before():
    def at(name: str, offset: int) -> tarfile.TarInfo:
        member = tarfile.TarInfo(name)
        member.offset = offset
        return member

    assert [m.name for m in untar.members([at("a", 0), at("b", 512)])] == ["a", "b"]
    seen = []
    with pytest.raises(untar.BadHeader, match="pointing back"):
        for member in untar.members([at("a", 0), at("b", 512), at("c", 1024), at("b", 512)]):
            seen.append(member.name)
    assert seen == ["a", "b", "c"]


@pytest.mark.parametrize("how", ["gnu", "pax 1.0"])
def test_a_sparse_member_is_refused_before_its_map_is_read(tmp_path, bytes_read, how):
    """A sparse map is read block by block, as long as the stream goes: refused at its first header."""
    if how == "gnu":  # every block says another follows (isextended), each with 21 (offset, size) pairs
        block = (b"00000000001\0" * 42).ljust(504, b"\0") + b"\1"
        blocks = [header("pkg/s", 0, tarfile.GNUTYPE_SPARSE, {482: b"\1"}), block.ljust(512, b"\0") * 4096]
    else:  # a map said to hold 10**9 numbers, then "1\n" as far as the stream goes
        blocks = [header("././@PaxHeader", 512, tarfile.XHDTYPE), pax(**{"GNU.sparse.major": "1",
                  "GNU.sparse.minor": "0"}), header("pkg/s", 0), b"1000000000\n" + b"1\n" * (1 << 20)]
    with pytest.raises(untar.TooLarge, match="sparse"):
        read_all(raw_tar(tmp_path, *blocks, gz=True))
    assert sum(bytes_read) <= 2048


@pytest.mark.parametrize("how", ["one pax header", "a chain of long names"])
def test_more_than_max_header_bytes_before_a_member_is_refused_unread(tmp_path, bytes_read, how):
    """tarfile holds every extended header before a member in memory, one nested call each."""
    if how == "one pax header":
        blocks = [header("././@PaxHeader", 1 << 20, tarfile.XHDTYPE), pax(comment="x" * ((1 << 20) - 100))]
    else:
        blocks = [header("././@LongLink", 512, tarfile.GNUTYPE_LONGNAME) + b"n" * 512] * 2000
    path = raw_tar(tmp_path, *blocks, header("pkg/a", 0), gz=True)
    with pytest.raises(untar.TooLarge, match="KiB of headers"):
        read_all(path)
    assert sum(bytes_read) <= untar.MAX_HEADER_BYTES + 512  # and the one header that tipped it


@pytest.mark.parametrize("fmt", [tarfile.GNU_FORMAT, tarfile.PAX_FORMAT])
def test_long_names_and_pax_headers_still_read_and_extract(tmp_path, fmt):
    """Real archives' extended headers (long names, links, pax records) are well under the bounds."""
    name = "vllm-1.0.0/" + "d" * 200 + "/" + "f" * 200 + ".py"
    members = [(info(name), b"X = 1\n"), (info("vllm-1.0.0/b.py"), b"B = 2\n")]
    members[1][0].pax_headers = {"comment": "c" * 4000} if fmt == tarfile.PAX_FORMAT else {}
    path = tmp_path / "long.tar.gz"
    with tarfile.open(path, "w:gz", format=fmt) as tar:
        for member, data in members:
            member.size = len(data)
            tar.addfile(member, io.BytesIO(data))
    assert read_all(path) == [name, "vllm-1.0.0/b.py"]
    unpack(path, tmp_path / "tree")
    assert (tmp_path / "tree" / name.partition("/")[2]).read_text() == "X = 1\n"
    assert (tmp_path / "tree/b.py").read_text() == "B = 2\n"
