"""Extracting archives on a Python whose tarfile has no ``filter=`` (3.11.0-3.11.3, Debian 12's 3.11.2).

Each case runs twice: with this Python's tarfile, and with the ``filter`` keyword taken away
as those Pythons lack it, where ``untar`` must apply the same rules itself.
"""

from __future__ import annotations

import contextlib
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
    with untar.opened(tmp_path / "s.tar") as archive, pytest.raises(untar.TooLarge, match="sparse"):
        list(untar.members(archive))


def test_unpack_refuses_a_bomb_in_one_line(tmp_path, monkeypatch):
    monkeypatch.setattr(untar, "MAX_STREAM_BYTES", 1 << 20)
    sdist = gz_of(tmp_path, (info("vllm-1.0.0/zeros"), bytes(4 << 20)))
    with pytest.raises(errors.SourceError, match=r"cannot unpack bomb.tar.gz: it unpacks to more than 1 MiB"):
        unpack(sdist, tmp_path / "tree")
    assert not (tmp_path / "tree").exists()
