"""Host side of the GPU stage: hand a target tree to a GPU, and take its results back.

* ``meta(report, tree_sha, upstream, ours, prefer)``: what ``run.py`` needs to know of a
  target (ref, the built tree's commit, both tables as ``table_dump`` read them, where
  our module comes from when its merge conflicted).
* ``export(tree, meta, out, ref)``: the tree as the job built it, for the offline bundle:
  ``out/REF/tree.tar.xz`` (``vllm/``, ``tests/kernels/``, ``pyproject.toml``, our overlay
  package as ``k3_ours/`` when it must win the import) and ``out/REF/meta.json``.
* ``run_here(tree, meta, ...)``: ``--gpu`` on a runner with a GPU and package access:
  the CuTe DSL release the target pins into a cached ``pip --target`` folder, then
  ``run.py all`` in a subprocess.
* ``attach(report, result, tree_sha)``: a result into the report's ``gpu``/``ab``; one
  measured on another tree (its commit differs) is refused as an environment error.
"""

from __future__ import annotations

import hashlib
import io
import json
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path

from k3lab.bundle import version_of, write_dist_info
from k3overlay.errors import UsageError
from k3overlay.files import read_regular, write_all_in_tree, write_in_tree
from k3overlay.project import cache_dir

REPO = Path(__file__).resolve().parent.parent.parent
RUN = "ci.gpu_stage.run"  # run from REPO as a module
OURS_DIR = "k3_ours"  # our overlay package inside an exported tree
TREE_PARTS = ("vllm", "tests/kernels", "pyproject.toml")
# vLLM's skinny-GEMM test reads the dsv3 kernel's source to check its instantiations
# (csrc/libtorch_stable/ in v0.28.0/v0.29.0, csrc/ in v0.33.0).
TREE_GLOBS = ("csrc/**/dsv3_fused_a_gemm.cu",)


def meta(report, tree_sha: str, upstream: dict, ours: dict, prefer: Path | None,
         cute_dsl: tuple[str, ...]) -> dict:
    """``meta.json`` of one target (see the module docstring)."""
    return {"ref": report.ref, "ref_sha": report.ref_sha, "tree_sha": tree_sha,
            "cute_dsl": list(cute_dsl), "prefer": str(prefer) if prefer else None,
            "tables": {"upstream": upstream, "ours": ours}}


def export(tree: Path, target_meta: dict, out: Path, ref: str) -> None:
    """Write ``out/REF/tree.tar.xz`` and ``out/REF/meta.json`` (``prefer`` made tree-relative).

    The tarball also holds a ``vllm-<version>.dist-info`` (vLLM finds its platform
    through the installed distribution; ``k3lab/bundle.py`` does the same for the base).
    Both files land whole or not at all, never through a link under ``out``
    (``write_all_in_tree``): an interrupted export leaves no truncated tarball that looks
    like a bundle. Raises UsageError if they cannot be written.
    """
    data = dict(target_meta)
    skip = lambda ti: None if "__pycache__" in ti.name else ti  # noqa: E731
    version = version_of(str(tree))
    packed = io.BytesIO()  # the Python tree, compressed: a few MB
    with tempfile.TemporaryDirectory() as tmp, tarfile.open(fileobj=packed, mode="w:xz", preset=6) as tar:
        write_dist_info(tmp, version)
        tar.add(Path(tmp) / f"vllm-{version}.dist-info", arcname=f"vllm-{version}.dist-info")
        for part in TREE_PARTS:
            if (tree / part).exists():
                tar.add(tree / part, arcname=part, filter=skip)
        for pattern in TREE_GLOBS:
            for path in sorted(tree.glob(pattern)):
                tar.add(path, arcname=str(path.relative_to(tree)))
        if data["prefer"]:
            tar.add(data["prefer"], arcname=OURS_DIR, filter=skip)
            data["prefer"] = OURS_DIR
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as err:
        raise UsageError(f"--gpu-export {out}: cannot create it ({err.strerror})") from err
    write_all_in_tree(out, {f"{ref}/tree.tar.xz": (packed.getvalue(), False),
                            f"{ref}/meta.json": ((json.dumps(data, indent=1, sort_keys=True) + "\n")
                                                 .encode(), False)})


def cute_dsl_site(lines: tuple[str, ...]) -> Path:
    """A ``pip --target`` folder holding the CuTe DSL release of ``lines``, cached by hash.

    Raises RuntimeError if pip fails, or the ``.complete`` mark cannot be written (a link
    there is neither taken for the mark nor written through).
    """
    key = hashlib.sha256(json.dumps(sorted(lines)).encode()).hexdigest()[:16]
    site = cache_dir() / "cute-dsl" / key
    if read_regular(site / ".complete") is None:
        site.mkdir(parents=True, exist_ok=True)
        proc = subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--upgrade",
                               "--target", str(site), *lines], stdout=sys.stderr)
        if proc.returncode:
            raise RuntimeError(f"pip could not install {' '.join(lines)}")
        try:
            write_in_tree(site, ".complete", ("\n".join(lines) + "\n").encode())
        except UsageError as err:
            raise RuntimeError(str(err)) from err
    return site


def run_here(tree: Path, target_meta: dict, workers: int = 4, deadline_s: float = 600.0) -> dict:
    """``run.py all`` on this machine's GPU for one target; its result JSON.

    Returns ``{"gpu": {"env_error": ...}}`` when the CuTe DSL cannot be installed.
    """
    try:
        site = cute_dsl_site(tuple(target_meta["cute_dsl"]))
    except RuntimeError as err:
        return {"tree_sha": target_meta["tree_sha"], "gpu": {"env_error": str(err)}}
    with tempfile.TemporaryDirectory(prefix="k3-gpu-") as tmp:
        meta_path, out = Path(tmp) / "meta.json", Path(tmp) / "out.json"
        meta_path.write_text(json.dumps(target_meta))
        subprocess.run([sys.executable, "-m", RUN, "all", "--tree", str(tree), "--meta",
                        str(meta_path), "--out", str(out), "--site", str(site),
                        "--workers", str(workers), "--deadline-s", str(deadline_s)],
                       stdout=sys.stderr, cwd=REPO)
        if not out.is_file():
            return {"tree_sha": target_meta["tree_sha"],
                    "gpu": {"env_error": "the GPU stage wrote no result"}}
        return json.loads(out.read_text())


def attach(report, result: dict, tree_sha: str) -> None:
    """Put ``result``'s ``gpu`` and ``ab`` on ``report`` if it was measured on this tree."""
    if result.get("tree_sha") != tree_sha:
        report.gpu = {"env_error": f"GPU results are for tree {str(result.get('tree_sha'))[:12]}, "
                                   f"this job built {tree_sha[:12]}"}
        return
    report.gpu = result.get("gpu")
    report.ab = result.get("ab")


def load_results(folder: Path) -> dict[str, dict]:
    """``{ref: result}`` of every ``*.json`` under ``folder`` that ``run.py`` wrote."""
    found = {}
    for path in sorted(folder.glob("*.json")):
        data = json.loads(path.read_text())
        if isinstance(data, dict) and "ref" in data and "tree_sha" in data:
            found[data["ref"]] = data
    return found
