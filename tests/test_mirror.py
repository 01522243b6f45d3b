"""The release mirror: sdists -> tagged commits, reproducibly, without rewriting tags."""

from __future__ import annotations

import io
import tarfile
from datetime import datetime, timezone
from pathlib import Path

import pytest
from packaging.version import Version

from k3overlay import errors, git
from k3overlay.mirror import ReleaseMirror, release_of, unpack


def sdist(path: Path, version: str, files: dict[str, str], extra: list[tarfile.TarInfo] = ()) -> Path:
    """A gzip sdist with everything under ``vllm-<version>/`` like the real ones."""
    with tarfile.open(path, "w:gz") as tar:
        for rel, text in files.items():
            data = text.encode()
            info = tarfile.TarInfo(f"vllm-{version}/{rel}")
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
        for info in extra:
            tar.addfile(info, io.BytesIO(b"x" * info.size))
    return path


@pytest.fixture
def fake_index(tmp_path, monkeypatch):
    """Serve sdists from tmp_path instead of the package index; records what was asked."""
    asked = []
    contents = {"0.1.0": {"vllm/a.py": "A = 1\n"}, "0.2.0": {"vllm/a.py": "A = 2\n"},
                "0.1.5": {"vllm/a.py": "A = 15\n"}}

    def download(self, version):
        asked.append(str(version))
        path = sdist(tmp_path / f"vllm-{version}.tar.gz", str(version), contents[str(version)])
        return path, datetime(2026, 8, int(str(version).split(".")[1]) + 1, tzinfo=timezone.utc)

    monkeypatch.setattr(ReleaseMirror, "_download", download)
    return asked


def make(tmp_path, name):
    return ReleaseMirror(tmp_path / name / "mirror.git", tmp_path / name / "sdists")


def test_release_of():
    assert release_of("v0.28.0") == Version("0.28.0")
    assert release_of("0.28.0") is None and release_of("main") is None and release_of("v1.2") is None


def test_one_tagged_commit_per_release_in_version_order(tmp_path, fake_index):
    mirror = make(tmp_path, "m")
    mirror.ensure([Version("0.2.0"), Version("0.1.0")])
    assert mirror.releases() == [Version("0.1.0"), Version("0.2.0")]
    repo = git.init_bare(mirror.path)
    assert git.resolve(repo, "v0.2.0~1") == git.resolve(repo, "v0.1.0")
    assert git.read_blob(repo, git.blob_at(repo, "v0.2.0", "vllm/a.py")) == b"A = 2\n"
    assert git.run(repo, "log", "-1", "--format=%an %aI", "v0.1.0").strip() == \
        "vLLM release mirror 2026-08-02T00:00:00+00:00"
    mirror.ensure([Version("0.1.0")])
    assert fake_index == ["0.1.0", "0.2.0"]  # nothing fetched twice


def test_same_releases_same_shas_on_any_machine(tmp_path, fake_index):
    one, two = make(tmp_path, "one"), make(tmp_path, "two")
    one.ensure([Version("0.1.0"), Version("0.2.0")])
    two.ensure([Version("0.1.0"), Version("0.2.0")])
    r1, r2 = git.init_bare(one.path), git.init_bare(two.path)
    assert git.resolve(r1, "v0.2.0") == git.resolve(r2, "v0.2.0")


def test_adding_an_older_release_never_moves_a_tag(tmp_path, fake_index):
    mirror = make(tmp_path, "m")
    mirror.ensure([Version("0.1.0"), Version("0.2.0")])
    repo = git.init_bare(mirror.path)
    tip = git.resolve(repo, "v0.2.0")
    mirror.ensure([Version("0.1.5")])
    assert git.resolve(repo, "v0.2.0") == tip
    assert git.resolve(repo, "v0.1.5~1") == git.resolve(repo, "v0.1.0")


def test_unpack_strips_top_folder_and_refuses_escapes(tmp_path):
    good = sdist(tmp_path / "good.tar.gz", "1.0.0", {"setup.py": "", "vllm/x.py": "X = 1\n"})
    unpack(good, tmp_path / "out")
    assert (tmp_path / "out/vllm/x.py").read_text() == "X = 1\n"
    escape = tarfile.TarInfo("vllm-1.0.0/../../evil")
    escape.size = 1
    bad = sdist(tmp_path / "bad.tar.gz", "1.0.0", {}, [escape])
    with pytest.raises(errors.SourceError, match="cannot unpack"):
        unpack(bad, tmp_path / "out2")
    assert not (tmp_path / "evil").exists()


def test_damaged_archive_is_a_source_error(tmp_path):
    broken = tmp_path / "vllm-1.0.0.tar.gz"
    broken.write_bytes(b"not a tarball")
    with pytest.raises(errors.SourceError):
        unpack(broken, tmp_path / "out")
