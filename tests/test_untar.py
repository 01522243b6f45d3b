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
