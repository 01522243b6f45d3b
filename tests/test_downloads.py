"""The download cache: every cached file (sdist and release wheel) checked against the
index's sha256 on every use, re-fetched once when it fails, else exit 6 in one line."""

from __future__ import annotations

import os
import stat
import subprocess
import sys

import pytest
from packaging.version import Version

from k3overlay import errors, progress, source
from k3overlay.mirror import unpack
from k3overlay.project import ROOT, cache_dir
from k3overlay.wheel import readable

from .test_mirror import sdist_bytes
from .wheels import wheel_bytes

V = Version("0.1.0")


def release_file(kind: str, text: str) -> tuple[str, bytes]:
    """(file name, bytes) of a tiny sdist or wheel of vLLM 0.1.0 holding ``vllm/a.py``."""
    if kind == "sdist":
        return "vllm-0.1.0.tar.gz", sdist_bytes("0.1.0", {"vllm/a.py": text})
    return "vllm-0.1.0-py3-none-any.whl", wheel_bytes("0.1.0", {"vllm/a.py": text})


def a_py(kind: str, path, tmp_path) -> str:
    """What ``vllm/a.py`` says in the file the cache handed out (the consumers' own readers)."""
    if kind == "sdist":
        out = tmp_path / f"out{len(list(tmp_path.glob('out*')))}"
        unpack(path, out)
        return (out / "vllm/a.py").read_text()
    from .wheels import member

    return member(readable(path), "vllm/a.py").decode()


def use(kind: str, tmp_path) -> str:
    files = source.release_files()
    pkg = files.sdist(V) if kind == "sdist" else files.wheel(V)
    return files.use(pkg, lambda path: a_py(kind, path, tmp_path))


KINDS = ["sdist", "wheel"]


@pytest.mark.parametrize("kind", KINDS)
def test_downloaded_once_then_read_from_the_cache(kind, fake_index, tmp_path):
    name, data = release_file(kind, "A = 1\n")
    fake_index.publish(name, data)
    assert use(kind, tmp_path) == "A = 1\n" and use(kind, tmp_path) == "A = 1\n"
    assert fake_index.downloads[name] == 1
    cached = cache_dir() / ("sdists" if kind == "sdist" else "wheels") / name
    assert cached.read_bytes() == data
    assert [p.name for p in cached.parent.iterdir() if not p.name.startswith(".")] == [name]
    umask = os.umask(0o022)
    os.umask(umask)
    assert stat.S_IMODE(cached.stat().st_mode) == 0o644 & ~umask  # data, not a program


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("damage", ["truncated", "tampered"])
def test_a_damaged_cached_file_is_fetched_again(kind, damage, fake_index, tmp_path):
    name, data = release_file(kind, "A = 1\n")
    fake_index.publish(name, data)
    use(kind, tmp_path)
    cached = next(cache_dir().rglob(name))
    # tampered: a valid archive of the same name with other content, as a poisoned cache holds
    cached.write_bytes(data[: len(data) // 2] if damage == "truncated"
                       else release_file(kind, "A = 666\n")[1])
    assert use(kind, tmp_path) == "A = 1\n"
    assert fake_index.downloads[name] == 2 and cached.read_bytes() == data


@pytest.mark.parametrize("kind", KINDS)
def test_a_download_not_matching_the_index_is_exit_6_and_leaves_nothing(kind, fake_index, tmp_path):
    name, data = release_file(kind, "A = 1\n")
    fake_index.publish(name, data)
    fake_index.files[name] = release_file(kind, "A = 2\n")[1]  # served bytes != published sha256
    with pytest.raises(errors.SourceError, match=f"{name} from the package index does not match") as err:
        use(kind, tmp_path)
    assert err.value.exit_code == errors.SOURCE and "\n" not in str(err.value)
    assert not list(cache_dir().rglob("vllm-*"))


@pytest.mark.parametrize("kind", KINDS)
def test_an_unreadable_archive_is_fetched_again_once_then_exit_6(kind, fake_index, tmp_path,
                                                                 monkeypatch, capsys):
    monkeypatch.setattr(progress, "quiet", False)
    name, data = release_file(kind, "A = 1\n")
    fake_index.publish(name, data[: len(data) // 2])  # the index's own file is broken
    with pytest.raises(errors.SourceError, match="cannot be read, even fetched again") as err:
        use(kind, tmp_path)
    assert fake_index.downloads[name] == 2 and "\n" not in str(err.value)
    said = [line for line in capsys.readouterr().err.splitlines() if "fetching it again" in line]
    assert len(said) == 1 and said[0].startswith(f"{name} cannot be read (")
    assert not list(cache_dir().rglob("vllm-*"))


def test_no_published_sha256_means_no_use(fake_index, tmp_path):
    name, data = release_file("wheel", "A = 1\n")
    fake_index.publish(name, data)
    fake_index.digests[name] = ""
    with pytest.raises(errors.SourceError, match="publishes no sha256"):
        use("wheel", tmp_path)
    assert fake_index.downloads[name] == 0


def test_an_unreachable_index_is_exit_6(monkeypatch, tmp_path):
    monkeypatch.setenv("PIP_INDEX_URL", "http://127.0.0.1:9/simple/")  # discard port: refused
    with pytest.raises(errors.SourceError, match="cannot reach the package index: ") as err:
        use("sdist", tmp_path)
    assert "host='127.0.0.1', port=9" in str(err.value)  # requests' own first line, not a stand-in


def test_the_index_cannot_name_a_file_outside_the_cache(fake_index, tmp_path):
    fake_index.publish("vllm-0.1.0-py3-none-any.whl", release_file("wheel", "A = 1\n")[1])
    files = source.release_files()
    pkg = files.wheel(V)
    object.__setattr__(pkg, "filename", "../vllm-0.1.0-py3-none-any.whl")
    with pytest.raises(errors.SourceError, match="refusing to write it"):
        files.fetch(pkg)


def test_the_wheel_that_installs_here_is_chosen(fake_index):
    fake_index.publish("vllm-0.2.0-py3-none-any.whl", b"w")  # another release: never chosen
    fake_index.publish("vllm-0.1.0-cp38-abi3-win_arm64.whl", b"x")
    assert pytest.raises(errors.UsageError, source.release_files().wheel, V).match("--release-wheel")
    fake_index.publish("vllm-0.1.0-py3-none-any.whl", b"y")
    assert source.release_files().wheel(V).filename == "vllm-0.1.0-py3-none-any.whl"


def test_apply_with_a_truncated_release_on_the_index_is_one_line_exit_6(fake_index, tmp_path):
    """Issue 8's case end to end: before, a truncated sdist raised EOFError on every run."""
    sdist = sdist_bytes("0.28.0", {f"vllm/m{i}.py": f"x = {i}\n" * 5000 for i in range(20)})
    fake_index.publish("vllm-0.28.0.tar.gz", sdist[: len(sdist) // 2])
    proc = subprocess.run([sys.executable, str(ROOT / "apply.py"), "--check", "-q",
                           "--workdir", str(tmp_path / "wd")], capture_output=True, text=True)
    assert proc.returncode == errors.SOURCE, proc.stderr
    assert proc.stderr.count("\n") == 1 and "Traceback" not in proc.stderr
    assert "vllm-0.28.0.tar.gz" in proc.stderr and fake_index.downloads["vllm-0.28.0.tar.gz"] == 2


def test_the_latest_release_is_the_newest_final_sdist(fake_index):
    for version in ("0.1.0", "0.3.0rc1", "0.2.0.dev5"):  # a pre-release and a dev build: not final
        fake_index.publish(f"vllm-{version}.tar.gz", sdist_bytes(version, {"vllm/a.py": ""}))
    fake_index.publish("vllm-0.4.0-py3-none-any.whl", wheel_bytes("0.4.0", {"vllm/a.py": ""}))
    assert source.release_files().latest() == Version("0.1.0")


def test_no_final_release_on_the_index_is_exit_6(fake_index):
    fake_index.publish("vllm-0.3.0rc1.tar.gz", sdist_bytes("0.3.0rc1", {"vllm/a.py": ""}))
    with pytest.raises(errors.SourceError, match="^the package index lists no vLLM release sdist$"):
        source.release_files().latest()
