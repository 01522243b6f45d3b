"""The internal wheel of the pinned base, repacked from vLLM 0.28.0's release wheel (tier e2e).

README's command, as a user runs it: ``apply.py --build-wheel``. The first run on a
machine downloads the release wheel (314,500,103 bytes) into the release cache;
after that the module costs about 1.5 minutes here (apply, pack, the tool's checks,
and this test's own ``pip install --no-deps --target``).
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import json
import shlex
import subprocess
import sys
import zipfile
import zlib

import pytest

from k3overlay import git
from k3overlay.project import ROOT, Project, cache_dir
from k3overlay.series import load as load_series
from k3overlay.wheel import PRINT_RECORD

from ..conftest import g
from .conftest import DISPATCH, LLG, MTP

SO = "vllm/_C_stable_libtorch.abi3.so"


@pytest.fixture(scope="module")
def built(mirror_repo, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("wheel")
    out = tmp / "report.json"
    proc = subprocess.run([sys.executable, str(ROOT / "apply.py"), "--workdir", str(tmp / "vllm"),
                           "--build-wheel", "--wheel-dir", str(tmp / "wheels"), "--json", str(out)],
                          capture_output=True, text=True)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    report = json.loads(out.read_text())
    wheel = tmp / "wheels" / report["wheel"]["name"]
    target = tmp / "target"
    subprocess.run([sys.executable, "-m", "pip", "install", "--isolated", "--no-deps", "--no-index",
                    "--no-compile", "--quiet", "--target", str(target), str(wheel)], check=True)
    return tmp / "vllm", report, wheel, target


def release_wheel() -> zipfile.ZipFile:
    return zipfile.ZipFile(next((cache_dir() / "wheels").glob("vllm-0.28.0-*.whl")))


def test_the_wheel_is_the_local_version_and_the_report_says_which(built):
    _, report, wheel, _ = built
    version = Project().version
    assert wheel.name == f"vllm-0.28.0+k3ov.{version}-cp38-abi3-manylinux_2_28_x86_64.whl"
    assert report["wheel"]["size"] == wheel.stat().st_size
    assert report["wheel"]["sha256"] == hashlib.sha256(wheel.read_bytes()).hexdigest()


def test_installed_python_is_the_patched_tree(built):
    wd, _, _, target = built
    assert (target / MTP).read_bytes() == (wd / MTP).read_bytes()
    assert "self.eh_proj = ReplicatedLinear(" in (target / MTP).read_text()
    assert (target / DISPATCH).read_bytes() == (Project().overlay_dir / DISPATCH).read_bytes()
    assert (target / LLG).read_bytes() == (wd / LLG).read_bytes()  # upstream's, as released


def test_compiled_code_is_the_release_one(built):
    _, _, _, target = built
    with release_wheel() as release:
        info = release.getinfo(SO)
    data = (target / SO).read_bytes()
    assert len(data) == info.file_size and zlib.crc32(data) == info.CRC


def test_version_carries_the_local_label(built):
    _, _, _, target = built
    local = f"0.28.0+k3ov.{Project().version}"
    [dist] = importlib.metadata.distributions(path=[str(target)])
    assert dist.metadata["Name"] == "vllm" and dist.version == local
    scope: dict = {}
    exec((target / "vllm/_version.py").read_text(), scope)
    assert scope["__version__"] == scope["version"] == local


def test_provenance_record_matches_the_repo(built, mirror_repo):
    wd, report, wheel, target = built
    project = Project()
    # The venv's own interpreter: a fresh Debian has no `python` on PATH (the docs' hint
    # assumes an activated venv; ci/test.sh runs pytest without activating it).
    command = PRINT_RECORD.replace("python ", f"{shlex.quote(sys.executable)} ", 1)
    printed = subprocess.run(command, shell=True, cwd=target, capture_output=True, text=True)
    assert printed.returncode == 0, printed.stderr
    record = json.loads(printed.stdout)
    assert record == json.loads((target / "vllm/k3_overlay.json").read_text())
    series = load_series(project.patches_dir)
    mirror_sha = git.resolve(mirror_repo, "v0.28.0")
    assert record["overlay_version"] == project.version
    assert record["base"] == {"ref": "v0.28.0", "sha": mirror_sha}
    assert record["target"] == {**record["base"], "commit_id": "g2cf0a6915"}  # upstream's v0.28.0
    assert record["result_sha"] == g(wd, "rev-parse", "HEAD").strip()
    scope: dict = {}
    exec((target / "vllm/_version.py").read_text(), scope)
    assert scope["__commit_id__"] == f"g{record['result_sha'][:12]}"  # what the wheel is built from
    patch_bytes = b"".join(p.path.read_bytes() for p in series)
    assert record["series_sha256"] == hashlib.sha256(patch_bytes).hexdigest()
    assert [p["name"] for p in record["patches"]] == [p.name for p in series]
    assert record["patches"] == [{"name": p["name"], "status": p["status"]} for p in report["patches"]]
    manifest = json.loads(project.manifest_path.read_text())
    assert record["overlay"] == [{"path": f["path"], "status": s["status"],
                                  "blob": g(wd, "rev-parse", f"HEAD:{f['path']}").strip()}
                                 for f, s in zip(manifest["files"], report["overlay"])]
    with release_wheel() as release:
        name = release.filename.rsplit("/", 1)[-1]
    assert record["build"]["method"] == "repack" and record["build"]["release_wheel"] == name
