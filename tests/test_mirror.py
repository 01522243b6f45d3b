"""The release mirror: sdists -> one tagged root commit per release, the same on every machine."""

from __future__ import annotations

import io
import tarfile
import time
from pathlib import Path

import pytest
from packaging.version import Version

from k3overlay import errors, git, source, untar
from k3overlay.mirror import MIRROR_NAME, release_of, unpack
from k3overlay.project import cache_dir

from .conftest import g

RELEASES = {"0.1.0": "A = 1\n", "0.1.5": "A = 15\n", "0.2.0": "A = 2\n"}


def sdist_bytes(version: str, files: dict[str, str], extra: list[tarfile.TarInfo] = (),
                mtime: int = 1_700_000_000) -> bytes:
    """A gzip sdist with everything under ``vllm-<version>/`` like the real ones."""
    out = io.BytesIO()
    with tarfile.open(fileobj=out, mode="w:gz") as tar:
        for rel, text in files.items():
            data = text.encode()
            info = tarfile.TarInfo(f"vllm-{version}/{rel}")
            info.size, info.mtime = len(data), mtime
            tar.addfile(info, io.BytesIO(data))
        for info in extra:
            tar.addfile(info, io.BytesIO(b"x" * info.size))
    return out.getvalue()


@pytest.fixture
def index(fake_index):
    """The fake index publishing three small releases, each uploaded on a known day."""
    for version, text in RELEASES.items():
        day = int(version.split(".")[1]) + 1
        fake_index.publish(f"vllm-{version}.tar.gz", sdist_bytes(version, {"vllm/a.py": text}),
                           uploaded=f"2026-08-{day:02d}T10:00:00Z")
    return fake_index


def mirror_at(tmp_path: Path, name: str, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / name))
    return source.default_mirror()


def tag_shas(mirror) -> dict[str, str]:
    repo = git.init_bare(mirror.path)
    return {tag: git.resolve(repo, tag) for tag in sorted(git.tags(repo))}


def test_release_of():
    assert release_of("v0.28.0") == Version("0.28.0")
    assert release_of("0.28.0") is None and release_of("main") is None and release_of("v1.2") is None


def test_each_release_is_a_root_commit_of_the_published_sdist(tmp_path, index, monkeypatch, capsys):
    mirror = mirror_at(tmp_path, "m", monkeypatch)
    mirror.ensure([Version("0.2.0"), Version("0.1.0")])
    said = [line for line in capsys.readouterr().err.splitlines() if line.startswith("… ")]
    assert "… unpacking vllm-0.1.0.tar.gz" in said and "… committing vllm-0.2.0.tar.gz as v0.2.0" in said
    assert mirror.path == cache_dir() / MIRROR_NAME
    assert mirror.releases() == [Version("0.1.0"), Version("0.2.0")]
    for tag in ("v0.1.0", "v0.2.0"):
        assert g(mirror.path, "rev-list", "--parents", "-n1", tag).split()[1:] == []  # no parent
    assert g(mirror.path, "show", "v0.2.0:vllm/a.py") == "A = 2\n"
    assert g(mirror.path, "log", "-1", "--format=%an|%cn|%aI|%cI|%s", "v0.1.0").strip() == \
        "vLLM release mirror|vLLM release mirror|2026-08-02T10:00:00+00:00|2026-08-02T10:00:00+00:00|" \
        "vLLM v0.1.0"
    mirror.ensure([Version("0.1.0")])
    assert index.downloads == {"vllm-0.1.0.tar.gz": 1, "vllm-0.2.0.tar.gz": 1}  # nothing twice


def test_same_shas_on_any_machine_whatever_the_fetch_order(tmp_path, index, monkeypatch):
    one = mirror_at(tmp_path, "one", monkeypatch)
    one.ensure([Version(v) for v in RELEASES])
    two = mirror_at(tmp_path, "two", monkeypatch)
    for version in ("0.2.0", "0.1.0", "0.1.5"):  # newest first, then one in between
        two.ensure([Version(version)])
    assert tag_shas(one) == tag_shas(two) and len(tag_shas(one)) == 3


def test_adding_an_older_release_never_moves_a_tag(tmp_path, index, monkeypatch):
    mirror = mirror_at(tmp_path, "m", monkeypatch)
    mirror.ensure([Version("0.1.0"), Version("0.2.0")])
    before = tag_shas(mirror)
    mirror.ensure([Version("0.1.5")])
    after = tag_shas(mirror)
    assert {t: after[t] for t in before} == before and "v0.1.5" in after


def test_a_format_1_mirror_is_left_alone(tmp_path, index, monkeypatch):
    mirror = mirror_at(tmp_path, "m", monkeypatch)
    old = cache_dir() / "mirror.git"
    g(tmp_path, "init", "-q", "--bare", str(old))
    empty_tree = "4b825dc642cb6eb9a060e54bf8d69288fbee4904"
    g(old, "tag", "v0.1.0", g(old, "commit-tree", empty_tree, "-m", "format 1").strip())
    old_tags = g(old, "show-ref", "--tags")
    mirror.ensure([Version("0.1.0")])
    assert g(old, "show-ref", "--tags") == old_tags
    assert tag_shas(mirror)["v0.1.0"] not in old_tags


@pytest.fixture
def far_from_utc(monkeypatch):
    """The machine's time zone UTC+9: a date read in local time would be off by nine hours."""
    monkeypatch.setenv("TZ", "Asia/Tokyo")
    time.tzset()
    yield
    monkeypatch.undo()
    time.tzset()


def test_upload_date_comes_from_the_sdist_when_the_index_gives_none(tmp_path, index, monkeypatch,
                                                                     far_from_utc):
    index.publish("vllm-0.1.0.tar.gz", sdist_bytes("0.1.0", {"vllm/a.py": "A = 1\n"},
                                                   mtime=1_750_000_000), uploaded=None)
    mirror = mirror_at(tmp_path, "m", monkeypatch)
    mirror.ensure([Version("0.1.0")])
    assert g(mirror.path, "log", "-1", "--format=%aI", "v0.1.0").strip() == "2025-06-15T15:06:40+00:00"


def test_unpack_strips_top_folder_and_refuses_escapes(tmp_path):
    folder = tarfile.TarInfo("vllm-1.0.0")
    folder.type = tarfile.DIRTYPE
    stray = tarfile.TarInfo("stray.txt")  # beside the top folder: not part of the tree
    stray.size = 1
    good = tmp_path / "good.tar.gz"
    good.write_bytes(sdist_bytes("1.0.0", {"setup.py": "", "vllm/x.py": "X = 1\n"}, [folder, stray]))
    unpack(good, tmp_path / "out")
    assert (tmp_path / "out/vllm/x.py").read_text() == "X = 1\n"
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == ["setup.py", "vllm"]
    escape = tarfile.TarInfo("vllm-1.0.0/../../evil")
    escape.size = 1
    bad = tmp_path / "bad.tar.gz"
    bad.write_bytes(sdist_bytes("1.0.0", {}, [escape]))
    with pytest.raises(errors.SourceError, match="cannot unpack"):
        unpack(bad, tmp_path / "out2")
    assert not (tmp_path / "evil").exists()


@pytest.mark.parametrize("kind", ["link out", "link inside", "hard link inside", "deep link chain", "fifo"])
def test_unpack_takes_no_link_of_any_kind(tmp_path, kind):
    """Round 8: tarfile's data filter on Python < 3.11.13 lets a chain of deeply nested links
    (realpath gives up resolving them) carry a hard link, then a file, outside the tree
    (CVE-2025-4517). No release sdist holds a link, so none is taken, even a harmless one."""
    def member(name, type_, linkname=""):
        info = tarfile.TarInfo(f"vllm-1.0.0/{name}")
        info.type, info.linkname = type_, linkname
        return info

    deep = "d" * 200
    members = {
        "link out": [member("vllm/passwd.py", tarfile.SYMTYPE, "/etc/passwd")],
        "link inside": [member("vllm/y.py", tarfile.SYMTYPE, "x.py")],
        "hard link inside": [member("vllm/y.py", tarfile.LNKTYPE, "vllm-1.0.0/vllm/x.py")],
        "deep link chain": [member(f"{deep}", tarfile.SYMTYPE, "."),
                            member(f"{deep}/{deep}", tarfile.SYMTYPE, "."),
                            member("escape", tarfile.SYMTYPE, f"{deep}/{deep}/../../../evil")],
        "fifo": [member("vllm/f", tarfile.FIFOTYPE)],
    }[kind]
    sdist = tmp_path / "linked.tar.gz"
    sdist.write_bytes(sdist_bytes("1.0.0", {"vllm/x.py": ""}, members))
    with pytest.raises(errors.SourceError, match="cannot unpack linked.tar.gz: .* which no release sdist holds"):
        unpack(sdist, tmp_path / "out3")
    assert not (tmp_path / "out3").exists() and not (tmp_path / "evil").exists()


@pytest.mark.parametrize("damage", ["not a tarball", "truncated", "empty"])
def test_damaged_archive_is_a_source_error_and_leaves_nothing(tmp_path, damage):
    data = sdist_bytes("1.0.0", {f"vllm/m{i}.py": f"x = {i}\n" * 5000 for i in range(20)})
    data = {"not a tarball": b"not a tarball", "truncated": data[: len(data) // 2],
            "empty": b""}[damage]
    if damage == "truncated":  # what tarfile alone makes of it: not one of its own errors
        with pytest.raises(EOFError), tarfile.open(fileobj=io.BytesIO(data)) as archive:
            untar.extract(archive, tmp_path / "raw")
    broken = tmp_path / "vllm-1.0.0.tar.gz"
    broken.write_bytes(data)
    with pytest.raises(errors.SourceError, match="cannot unpack vllm-1.0.0.tar.gz"):
        unpack(broken, tmp_path / "out")
    assert not (tmp_path / "out").exists()
