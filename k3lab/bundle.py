"""Build the offline GPU bundle: everything an air-gapped GPU runner needs, in parts.

Contents (one ``payload.tar``, split into ``part-NNN/bundle.partNNN`` files of at
most ``--part-mib`` MiB, default 60, each folder also holding ``BUNDLE.json``):

* ``wheels/``: the wheels of ``requirements-gpu.txt`` for the runner's Python and
  platform (default cp312 manylinux x86_64), downloaded with ``pip download
  --no-deps --only-binary=:all:`` (or taken from ``--wheels-dir``);
* ``vllm_tree.tar.xz``: the patched ``vllm/`` Python tree (a checkout made by
  ``apply.py``) plus a ``vllm-<ver>.dist-info`` so vLLM's platform detection finds
  the package;
* ``k3/``: the lab package (``k3/k3lab/``, its tests left out), the overlay's GPU tests,
  the upstream tables as data (``priors.json``, for seeds and the v0.29.0 comparison),
  and the few v0.28.0 ``csrc`` files ``device/dsv3_build.py`` compiles.

The rebase job's targets add-on (each target's tree and wheels) is built from the same
parts by ``python -m ci.gpu_stage.addon`` (``ci/gpu_stage/build_addon.sh``).

``install.sh`` reassembles the parts, checks sha256s, installs the wheels with
``pip --no-index --no-deps --target`` and prints the ``export`` lines.

Usage::

    python -m k3lab.bundle --out k3lab/_stage [--tree work/vllm] [--compare-ref v0.29.0]

Without ``--tree`` the overlay is applied to the pinned base now (``apply.py``'s job,
into a temporary folder). Upstream tables come from the release mirror.
Raises ``SystemExit`` with a message if the overlay does not apply or pip fails.
"""

from __future__ import annotations

import argparse
import datetime
import io
import json
import os
import re
import shutil
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path

from k3lab import paths, upstream_tables
from k3overlay import git, source
from k3overlay import manifest as overlay_manifest
from k3overlay.downloads import file_sha256
from k3overlay.job import Options, run_apply
from k3overlay.mirror import release_of
from k3overlay.project import Project

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = str(paths.REPO)
PLATFORMS = ("manylinux_2_31_x86_64", "manylinux_2_28_x86_64", "manylinux_2_27_x86_64",
             "manylinux_2_26_x86_64", "manylinux_2_24_x86_64", "manylinux_2_17_x86_64",
             "manylinux2014_x86_64", "manylinux1_x86_64", "any")
DSV3_SRC = "csrc/libtorch_stable/dsv3_fused_a_gemm.cu"
UPSTREAM_MODULE = "vllm/models/kimi_k3/nvidia/low_latency_gemm.py"


def download_wheels(dest: str, python_version: str, req: str) -> None:
    cmd = [sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--only-binary=:all:",
           "--python-version", python_version, "--implementation", "cp", "-d", dest, "-r", req]
    for p in PLATFORMS:
        cmd += ["--platform", p]
    if subprocess.call(cmd):
        raise SystemExit("pip download failed: " + " ".join(cmd))


def patched_tree(dest: str) -> str:
    """Apply the series and overlay onto the pinned base into ``dest`` (apply.py's job)."""
    report = run_apply(Project(), Options(workdir=Path(dest)))
    if not report.ok:
        raise SystemExit(f"the overlay does not apply on {report.ref} (exit {report.exit_code})")
    return dest


def upstream_file(ref: str, path: str, into: str) -> str:
    """Write upstream's ``path`` at release ``ref`` (from the release mirror) to ``into``."""
    mirror = source.default_mirror()
    mirror.ensure([release_of(ref)])
    repo = git.init_bare(mirror.path)
    with open(into, "wb") as f:
        f.write(git.read_blob(repo, git.blob_at(repo, ref, path)))
    return into


def version_of(tree: str) -> str:
    text = open(os.path.join(tree, "vllm", "_version.py")).read()
    return re.search(r"__version__ = version = '([^']+)'", text).group(1)


def write_dist_info(tree: str, version: str) -> None:
    d = os.path.join(tree, f"vllm-{version}.dist-info")
    os.makedirs(d, exist_ok=True)
    with open(os.path.join(d, "METADATA"), "w") as f:
        f.write(f"Metadata-Version: 2.1\nName: vllm\nVersion: {version}\n"
                "Summary: vLLM Python tree + vllm-k3-overlay (no compiled extensions)\n")
    for name, text in (("INSTALLER", "k3-bundle\n"), ("top_level.txt", "vllm\n"), ("RECORD", "")):
        with open(os.path.join(d, name), "w") as f:
            f.write(text)


def include_closure(csrc_root: str, start: str) -> list[str]:
    """``start`` plus every quoted ``#include`` it reaches inside ``csrc_root``."""
    seen, todo = set(), [start]
    while todo:
        rel = todo.pop()
        if rel in seen:
            continue
        seen.add(rel)
        text = open(os.path.join(csrc_root, rel), errors="replace").read()
        for inc in re.findall(r'#include\s+"([^"]+)"', text):
            for cand in (os.path.join(os.path.dirname(rel), inc), inc):
                cand = os.path.normpath(cand)
                if os.path.exists(os.path.join(csrc_root, cand)):
                    todo.append(cand)
                    break
    return sorted(seen)


def add_tree(tar: tarfile.TarFile, src: str, arc: str) -> None:
    tar.add(src, arcname=arc, filter=lambda ti: None if "__pycache__" in ti.name else ti)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description="Build the offline GPU bundle in parts.")
    ap.add_argument("--out", default=os.path.join(HERE, "_stage"))
    ap.add_argument("--part-mib", type=float, default=60.0)
    ap.add_argument("--python-version", default="3.12")
    ap.add_argument("--wheels-dir", help="use these wheels instead of downloading")
    ap.add_argument("--requirements", default=os.path.join(HERE, "requirements-gpu.txt"))
    ap.add_argument("--tree", help="a checkout made by apply.py (default: apply now, to a temp folder)")
    ap.add_argument("--compare-ref", default="v0.29.0",
                    help="upstream release whose SM90 table the benchmark measures against ours")
    args = ap.parse_args(argv)
    work, payload = start_parts(args)
    wheels = args.wheels_dir or os.path.join(work, "wheels")
    if not args.wheels_dir:
        os.makedirs(wheels)
        download_wheels(wheels, args.python_version, args.requirements)
    tree = args.tree or patched_tree(os.path.join(work, "tree"))
    version = version_of(tree)
    write_dist_info(work, version)  # beside, not into, the user's checkout
    tree_xz = os.path.join(work, "vllm_tree.tar.xz")
    with tarfile.open(tree_xz, "w:xz", preset=6) as t:
        add_tree(t, os.path.join(tree, "vllm"), "vllm")
        add_tree(t, os.path.join(work, f"vllm-{version}.dist-info"), f"vllm-{version}.dist-info")

    base = overlay_manifest.load(Project().manifest_path, Project().overlay_dir).base
    priors = {ref: upstream_tables.extract(upstream_file(ref, UPSTREAM_MODULE, os.path.join(work, ref)))
              for ref in (base, args.compare_ref)}
    csrc = os.path.join(tree, "csrc")  # upstream's CUDA sources, untouched by the overlay
    csrc_files = include_closure(csrc, os.path.relpath(os.path.join(tree, DSV3_SRC), csrc))
    wheel_files = sorted(f for f in os.listdir(wheels) if f.endswith(".whl"))
    if not wheel_files:
        raise SystemExit(f"no wheels in {wheels}: the runner could not import the CuTe DSL")
    with tarfile.open(payload, "w") as t:
        for f in wheel_files:
            t.add(os.path.join(wheels, f), arcname=f"wheels/{f}")
        t.add(tree_xz, arcname="vllm_tree.tar.xz")
        t.add(HERE, arcname="k3/k3lab", filter=_lab_file)
        test_dir = os.path.join(REPO, "overlay", "tests")
        if os.path.isdir(test_dir):
            add_tree(t, test_dir, "k3/tests")
        data = json.dumps(priors, indent=1, sort_keys=True).encode()
        ti = tarfile.TarInfo("k3/priors.json")
        ti.size = len(data)
        t.addfile(ti, io.BytesIO(data))
        for rel in csrc_files:
            t.add(os.path.join(csrc, rel), arcname=f"k3/csrc/{rel}")
    return write_parts(args, work, payload, {
        "kind": "base", "vllm_version": version, "wheels": wheel_files, "csrc": csrc_files,
        "targets": []})


def _lab_file(ti: tarfile.TarInfo):
    """The lab's code and data as the runner needs them: no tests, caches or earlier bundles."""
    parts = ti.name.split("/")
    if any(p in ("tests", "__pycache__") or p.startswith("_stage") for p in parts):
        return None
    return ti if ti.isdir() or ti.name.endswith((".py", ".sh", ".cpp", ".txt", ".md", ".json")) else None


def start_parts(args) -> tuple[str, str]:
    """Empty ``args.out`` of an earlier bundle's parts (refusing any other file) and make
    a scratch folder; returns ``(work, payload path)``. Raises SystemExit on bad input."""
    if args.part_mib <= 0:
        raise SystemExit("--part-mib must be > 0")
    if os.path.exists(args.out):
        earlier = {name: _part_files(args.out, name) for name in sorted(os.listdir(args.out))}
        foreign = [name for name, files in earlier.items() if files is None]
        if foreign:  # never delete what is not an earlier bundle's part
            raise SystemExit(f"--out {args.out} holds other files ({foreign[0]}); pick an empty folder")
        for name, files in earlier.items():
            for file in files:
                os.unlink(os.path.join(args.out, name, file))
            os.rmdir(os.path.join(args.out, name))
    os.makedirs(args.out, exist_ok=True)
    work = tempfile.mkdtemp(prefix="k3bundle-")
    return work, os.path.join(work, "payload.tar")


def _part_files(out: str, name: str) -> list[str] | None:
    """The files of ``out/name`` if it is a part ``write_parts`` made (a folder ``part-NNN``
    holding no more than ``bundle.partNNN`` and ``BUNDLE.json``, plain files); else None."""
    folder = os.path.join(out, name)
    match = re.fullmatch(r"part-(\d{3})", name)
    if not match or os.path.islink(folder) or not os.path.isdir(folder):
        return None
    files = os.listdir(folder)
    allowed = {f"bundle.part{match.group(1)}", "BUNDLE.json"}
    plain = all(os.path.isfile(os.path.join(folder, f)) and not os.path.islink(os.path.join(folder, f))
                for f in files)
    return files if set(files) <= allowed and plain else None


def write_parts(args, work: str, payload: str, about: dict) -> int:
    """Split ``payload`` into ``args.out/part-NNN/`` with a BUNDLE.json each; remove ``work``."""
    part = int(args.part_mib * (1 << 20))
    parts = []
    with open(payload, "rb") as f:
        i = 0
        while chunk := f.read(part):
            d = os.path.join(args.out, f"part-{i:03d}")
            os.makedirs(d)
            p = os.path.join(d, f"bundle.part{i:03d}")
            with open(p, "wb") as o:
                o.write(chunk)
            parts.append({"name": os.path.basename(p), "bytes": len(chunk), "sha256": file_sha256(Path(p))})
            i += 1
    git = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO,
                         capture_output=True, text=True).stdout.strip()
    manifest = {
        "created": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "repo_commit": git, "python": args.python_version,
        "payload_sha256": file_sha256(Path(payload)), "payload_bytes": os.path.getsize(payload),
        "parts": parts, **about,
    }
    for i in range(len(parts)):
        with open(os.path.join(args.out, f"part-{i:03d}", "BUNDLE.json"), "w") as f:
            json.dump(manifest, f, indent=1)
    shutil.rmtree(work)
    print(f"bundle ({about['kind']}): {len(parts)} parts of <= {args.part_mib} MiB in {args.out} "
          f"({manifest['payload_bytes'] / 2**20:.1f} MiB; targets {', '.join(about['targets']) or '-'})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
