"""The overlay manifest (``overlay.json``): our files, and the upstream blob each replaces.

Format::

    {"base": "v0.28.0",
     "files": [{"path": "vllm/.../low_latency_gemm.py", "base_blob": "64ea39b4…"},
               {"path": "tests/.../test_x.py", "base_blob": "new"}]}

``path`` is the destination in the vLLM tree and the source under ``overlay/``.
``base_blob`` is ``git hash-object`` of upstream's file at the pinned base, or
``new`` when upstream has no such file. If upstream's blob at a ref differs,
copying our file over would silently throw upstream's work away: that is drift.
"""

from __future__ import annotations

import json
import shutil
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

from . import git
from .errors import UsageError

NEW = "new"
ADDED = "added"
REPLACED = "replaced"
DRIFT = "drift"
MERGED = "merged"
CONFLICT = "conflict"


@dataclass(frozen=True)
class OverlayFile:
    path: str
    base_blob: str  # 40-hex sha, or NEW


@dataclass(frozen=True)
class Manifest:
    base: str
    files: tuple[OverlayFile, ...]


@dataclass
class FileResult:
    """One overlay file on one ref.

    ``upstream_diff``: upstream's own base→ref diff, on drift. ``merged``: the
    3-way merge's output (with conflict markers when ``status`` is conflict).
    """

    path: str
    status: str
    detail: str = ""
    upstream_diff: str = field(default="", repr=False)
    merged: bytes | None = field(default=None, repr=False)


def load(manifest_path: Path, overlay_dir: Path) -> Manifest:
    """Read and check the manifest against the files under ``overlay_dir``.

    Raises UsageError on unreadable JSON, a listed file missing under
    ``overlay_dir``, a file there the manifest does not list, or a
    ``base_blob`` that is neither a 40-hex sha nor ``new``.
    """
    try:
        data = json.loads(manifest_path.read_text())
        files = tuple(OverlayFile(f["path"], f["base_blob"]) for f in data["files"])
        manifest = Manifest(data["base"], files)
    except (OSError, ValueError, KeyError, TypeError) as err:
        raise UsageError(f"cannot read overlay manifest {manifest_path}: {err}") from err
    if not isinstance(manifest.base, str) or not manifest.base:
        raise UsageError(f"overlay manifest: 'base' must be a ref name, not {manifest.base!r}")
    for f in files:
        if not isinstance(f.path, str) or not f.path or f.path.startswith("/") \
                or ".." in f.path.split("/"):
            raise UsageError(f"overlay manifest: bad path {f.path!r}")
        if f.base_blob != NEW and not (isinstance(f.base_blob, str) and len(f.base_blob) == 40
                                       and _is_hex(f.base_blob)):
            raise UsageError(f"overlay manifest: bad base_blob for {f.path}: {f.base_blob!r}")
    paths = [f.path for f in files]
    if len(set(paths)) != len(paths):
        raise UsageError(f"overlay manifest lists a path twice: "
                         f"{sorted({p for p in paths if paths.count(p) > 1})[0]}")
    listed = {f.path for f in files}
    present = {p.relative_to(overlay_dir).as_posix() for p in overlay_dir.rglob("*")
               if p.is_file() and "__pycache__" not in p.parts}
    if listed - present:
        raise UsageError(f"overlay manifest lists files missing under overlay/: "
                         f"{', '.join(sorted(listed - present))}")
    if present - listed:
        raise UsageError(f"files under overlay/ missing from the manifest: "
                         f"{', '.join(sorted(present - listed))}")
    return manifest


def save(manifest: Manifest, manifest_path: Path) -> None:
    """Write ``manifest`` (files in their given order, stable formatting)."""
    data = {"base": manifest.base,
            "files": [{"path": f.path, "base_blob": f.base_blob} for f in manifest.files]}
    manifest_path.write_text(json.dumps(data, indent=2) + "\n")


def _is_hex(text: str) -> bool:
    return all(c in "0123456789abcdef" for c in text)


def check(repo: git.Repo, ref: str, manifest: Manifest) -> list[FileResult]:
    """Classify each overlay file against upstream at ``ref``: added, replaced or drift."""
    return [_check_one(repo, ref, f) for f in manifest.files]


def _check_one(repo: git.Repo, ref: str, f: OverlayFile) -> FileResult:
    blob = git.blob_at(repo, ref, f.path)
    if f.base_blob == NEW:
        if blob is None:
            return FileResult(f.path, ADDED)
        return FileResult(f.path, DRIFT, "upstream now has a file at this path")
    if blob == f.base_blob:
        return FileResult(f.path, REPLACED)
    if blob is None:
        return FileResult(f.path, DRIFT, "upstream removed this file")
    return FileResult(f.path, DRIFT, f"upstream blob {blob[:8]} differs from base {f.base_blob[:8]}")


def upstream_diff(repo: git.Repo, base: str, ref: str, path: str) -> str:
    """Upstream's own diff of ``path`` from ``base`` to ``ref`` (empty if either lacks it)."""
    if git.resolve(repo, base) is None:
        return ""
    return git.diff(repo, base, ref, path)


def lay(tree: Path, overlay_dir: Path, results: list[FileResult], *,
        with_conflicts: bool = False) -> None:
    """Write each overlay file of ``results`` into ``tree``.

    Our file for added/replaced/drift, the merge for merged. A conflicted
    file keeps upstream's version unless ``with_conflicts``, which writes the
    merge with its conflict markers for a maintainer to resolve.
    """
    for result in results:
        if result.status == CONFLICT and not (with_conflicts and result.merged is not None):
            continue
        dest = tree / result.path
        dest.parent.mkdir(parents=True, exist_ok=True)
        if result.merged is not None:
            dest.write_bytes(result.merged)
        else:
            shutil.copyfile(overlay_dir / result.path, dest)


def merge(repo: git.Repo, overlay_dir: Path, f: OverlayFile, ref: str,
          result: FileResult) -> FileResult:
    """3-way merge a drifted file: base = upstream at our base, ours = overlay, theirs = ref.

    Returns ``merged`` or ``conflict`` with the merge output in ``merged``
    (None when it could not be attempted, e.g. the base blob is missing).
    """
    theirs_blob = git.blob_at(repo, ref, f.path)
    with tempfile.TemporaryDirectory(prefix="k3-merge-") as tmp:
        base, theirs = Path(tmp) / "base", Path(tmp) / "theirs"
        try:
            base.write_bytes(_blob_or_empty(repo, None if f.base_blob == NEW else f.base_blob))
            theirs.write_bytes(_blob_or_empty(repo, theirs_blob))
            clean, merged = git.merge_file(overlay_dir / f.path, base, theirs)
        except git.GitError as err:
            return FileResult(f.path, CONFLICT, f"{result.detail}; cannot merge: {err}",
                              result.upstream_diff)
    if clean:
        return FileResult(f.path, MERGED, f"{result.detail}; 3-way merge clean",
                          result.upstream_diff, merged)
    regions = merged.count(b"\n<<<<<<< ") + merged.startswith(b"<<<<<<< ")
    return FileResult(f.path, CONFLICT, f"{result.detail}; 3-way merge: {regions} conflicting "
                      f"region(s)", result.upstream_diff, merged)


def _blob_or_empty(repo: git.Repo, sha: str | None) -> bytes:
    return b"" if sha is None else git.read_blob(repo, sha)
