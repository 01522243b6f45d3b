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

import hashlib
import json
import os
import stat
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

from . import git
from .errors import UsageError
from .files import digest, read_regular, write_all_in_tree, write_atomically

NEW = "new"
REGULAR_MODES = ("100644", "100755")
_MODE_WORDS = {"120000": "a symbolic link", "040000": "a folder", "160000": "a submodule"}
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
        text = read_regular(manifest_path)  # a FIFO there is not waited on
        if text is None:
            raise OSError(f"{manifest_path.name} is missing or not a regular file")
        data = json.loads(text)
        files = tuple(OverlayFile(f["path"], f["base_blob"]) for f in data["files"])
        manifest = Manifest(data["base"], files)
    except (OSError, ValueError, KeyError, TypeError, RecursionError) as err:
        raise UsageError(f"cannot read overlay manifest {manifest_path}: {_one_line(err)}") from err
    if not isinstance(manifest.base, str) or not manifest.base:
        raise UsageError(f"overlay manifest: 'base' must be a ref name, not {manifest.base!r}")
    for f in files:
        if not plain_path(f.path):
            raise UsageError(f"overlay manifest: bad path {f.path!r}")
        if f.base_blob != NEW and not (isinstance(f.base_blob, str) and len(f.base_blob) == 40
                                       and _is_hex(f.base_blob)):
            raise UsageError(f"overlay manifest: bad base_blob for {f.path}: {f.base_blob!r}")
    paths = [f.path for f in files]
    if len(set(paths)) != len(paths):
        raise UsageError(f"overlay manifest lists a path twice: "
                         f"{sorted({p for p in paths if paths.count(p) > 1})[0]}")
    listed = {f.path for f in files}
    for path in sorted(listed):
        _refuse_link(overlay_dir, path)
    present = {p.relative_to(overlay_dir).as_posix() for p in overlay_dir.rglob("*")
               if p.is_file() and "__pycache__" not in p.parts}
    if listed - present:
        raise UsageError(f"overlay manifest lists files missing under overlay/: "
                         f"{', '.join(sorted(listed - present))}")
    if present - listed:
        raise UsageError(f"files under overlay/ missing from the manifest: "
                         f"{', '.join(sorted(present - listed))}")
    return manifest


def plain_path(path: object) -> bool:
    """A relative ``/`` path of printable characters with no empty, ``.``, ``..`` or ``.git``
    part (any case, NTFS/HFS trailing dots and spaces too): one that stays inside a tree
    and out of its repository."""
    if not isinstance(path, str) or not path or not path.isprintable() or "\\" in path:
        return False
    return all(part not in ("", ".", "..") and part.lower().rstrip(". ") != ".git"
               for part in path.split("/"))


def _refuse_link(overlay_dir: Path, path: str) -> None:
    """Raise UsageError if ``overlay/path``, or a folder on its way, is a link or no file."""
    parts = path.split("/")
    for depth in range(1, len(parts) + 1):
        here = overlay_dir.joinpath(*parts[:depth])
        try:
            mode = here.lstat().st_mode
        except OSError:
            return  # missing: the completeness check below names it
        if stat.S_ISLNK(mode):
            raise UsageError(f"overlay/{'/'.join(parts[:depth])} is a symbolic link: overlay "
                             f"files and their folders must be real ones")
    if not stat.S_ISREG(mode):
        raise UsageError(f"overlay/{path} is not a regular file")


def _one_line(err: BaseException) -> str:
    return " ".join(str(err).split()) or type(err).__name__


def save(manifest: Manifest, manifest_path: Path) -> None:
    """Write ``manifest`` (``dumps``), atomically."""
    write_atomically(manifest_path, dumps(manifest))


def dumps(manifest: Manifest) -> bytes:
    """``manifest`` as the file holds it: files in their given order, stable formatting."""
    data = {"base": manifest.base,
            "files": [{"path": f.path, "base_blob": f.base_blob} for f in manifest.files]}
    return (json.dumps(data, indent=2) + "\n").encode()


def _is_hex(text: str) -> bool:
    return all(c in "0123456789abcdef" for c in text)


def check(repo: git.Repo, ref: str, manifest: Manifest) -> list[FileResult]:
    """Classify each overlay file against upstream at ``ref``: added, replaced or drift.

    A destination that upstream made a link, a folder or a submodule (or that
    lies below one, or below a file) is ``conflict``: we never write through it.
    """
    return [_check_one(repo, ref, f) for f in manifest.files]


def _check_one(repo: git.Repo, ref: str, f: OverlayFile) -> FileResult:
    problem = destination_problem(repo, ref, f.path)
    if problem:
        return FileResult(f.path, CONFLICT, f"{problem}; not written through")
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


def destination_problem(repo: git.Repo, ref: str, path: str) -> str | None:
    """Why ``path`` at commit ``ref`` is no place to write a file, or None if it is.

    Fine: a regular file (100644/100755) or nothing, below folders or nothing.
    Not: a link, folder or submodule at ``path``, or anything but a folder above it.
    """
    parts = path.split("/")
    prefixes = ["/".join(parts[:depth]) for depth in range(1, len(parts) + 1)]
    entries = git.tree_entries(repo, ref, prefixes)
    for prefix in prefixes[:-1]:
        mode = entries.get(prefix, ("040000",))[0]
        if mode != "040000":
            return (f"{prefix} is {_MODE_WORDS.get(mode, 'a file')} at {ref[:12]}, "
                    f"not a folder")
    mode = entries.get(path, ("100644",))[0]
    if mode not in REGULAR_MODES:
        return f"{path} is {_MODE_WORDS.get(mode, f'mode {mode}')} at {ref[:12]}, not a file"
    return None


def lay(repo: git.Repo, laid: dict[str, tuple[bytes, bool]]) -> dict[str, tuple[bytes, bool]]:
    """Write ``laid`` (``to_lay``'s ``path: (bytes, executable)``) into ``repo``'s work tree;
    return it, for ``commit_laid``. The one write path into a tree: the destination's type
    in git at HEAD is checked first, nothing is ever written through a link and every file
    or none is written (``files.write_all_in_tree``). Raises UsageError, before writing
    anything, if a destination at HEAD is a link, folder or submodule."""
    for path in laid:
        problem = destination_problem(repo, "HEAD", path)
        if problem:
            raise UsageError(f"refusing to lay overlay file {path}: {problem}")
    write_all_in_tree(Path(repo.working_tree_dir), laid)
    return laid


def to_lay(overlay_dir: Path, results: list[FileResult], *,
           with_conflicts: bool = False) -> dict[str, tuple[bytes, bool]]:
    """What ``lay`` writes for each overlay file of ``results``: ``path: (bytes, executable)``.

    Our file for added/replaced/drift, the merge for merged; each keeps the overlay file's
    executable bit. A conflicted file keeps upstream's version (it is left out) unless
    ``with_conflicts``, which writes the merge with its conflict markers for a maintainer
    to resolve."""
    laid = {}
    for result in results:
        if result.status == CONFLICT and not (with_conflicts and result.merged is not None):
            continue
        source = overlay_dir / result.path
        data = result.merged if result.merged is not None else source.read_bytes()
        laid[result.path] = (data, bool(os.stat(source).st_mode & stat.S_IXUSR))
    return laid


def undo_laid(repo: git.Repo, head: str, laid: dict[str, tuple[str, bool]]) -> int | None:
    """Put back what a run laid into ``repo``'s work tree (and staged) on top of commit ``head``
    and did not commit (killed, interrupted): ``laid`` is ``path: (sha256, executable)`` of
    each file it wrote. Each path holding that file goes back to ``head``'s (or away, where
    ``head`` has none), with its index entry. Only while HEAD is still ``head`` and every path
    holds, in the work tree, ``head``'s file or the laid one (its content and mode) and, in
    the index, ``head``'s entry or the laid file's: anything else is somebody's since. Returns
    how many files were put back (0: nothing was laid yet, or it was committed: HEAD is the
    commit on ``head`` holding them), or None if left as it is."""
    now = git.resolve(repo, "HEAD")
    if now != head:
        committed = git.read_files(repo, now, sorted(laid)) if now else {}
        ours = git.resolve(repo, "HEAD~1") == head and all(
            hashlib.sha256(committed.get(p, b"")).hexdigest() == sha for p, (sha, _x) in laid.items())
        return 0 if ours else None
    top, paths = Path(repo.working_tree_dir), sorted(laid)
    old = git.tree_entries(repo, head, paths)
    index = git.index_entries(repo, paths)
    work = git.work_tree_entries(repo, paths)
    ours = [p for p in paths if digest(top, p) == laid[p][0]
            and work.get(p, ("", ""))[0] == git.file_mode(laid[p][1])]
    if any(p not in ours and work.get(p) != old.get(p) for p in paths) \
            or any(index.get(p) not in (old.get(p), work.get(p) if p in ours else old.get(p)) for p in paths):
        return None
    back = [p for p in ours if p in old]
    if back:
        git.run(repo, "checkout", "--quiet", head, "--", *git.literal(back))
    gone = [p for p in ours if p not in old]
    if gone:
        git.run(repo, "rm", "--quiet", "--cached", "--ignore-unmatch", "--", *git.literal(gone))
        for path in gone:
            os.unlink(top / path)
    return len(ours)


def commit_laid(repo: git.Repo, laid: dict[str, tuple[bytes, bool]], message: str, *,
                env: dict[str, str]) -> str:
    """Stage exactly the files ``lay`` wrote, commit them, and check the commit holds them.

    Returns the new HEAD (HEAD as it was if nothing changed). Raises UsageError
    if a committed blob or mode is not the laid file's (see ``committed_mismatches``).
    """
    git.stage_exact(repo, laid)
    sha = git.commit_staged(repo, message, env=env)
    mismatches = committed_mismatches(repo, sha, laid)
    if mismatches:
        raise UsageError(f"the overlay commit {sha[:12]} does not hold what was laid: "
                         f"{mismatches[0]}")
    return sha


def committed_mismatches(repo: git.Repo, sha: str, laid: dict[str, tuple[bytes, bool]]) -> list[str]:
    """One line per laid file whose blob or mode in commit ``sha`` is not what was laid."""
    entries = git.tree_entries(repo, sha, sorted(laid))
    problems = []
    for path, (data, executable) in sorted(laid.items()):
        want = (git.file_mode(executable), git.write_blob(repo, data))
        got = entries.get(path)
        if got != want:
            problems.append(f"{path}: committed {got[0] + ' ' + got[1][:12] if got else 'nothing'}, "
                            f"laid {want[0]} {want[1][:12]}")
    return problems


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
