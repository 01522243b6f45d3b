"""Regenerate ``patches/`` and ``overlay.json`` from a maintainer's work branch.

The work branch (made by ``apply.py`` or ``apply.py --rebase-to``) is
upstream REF, then one commit per patch, then commits touching only overlay
files. Export writes each patch commit as a format-patch (stable names and
numbering, zeroed commit ids, no version signature; the Date is the author
date ``git am`` kept), copies the overlay files from the branch tip back to
``overlay/``, and re-records every base blob at REF. Patches that landed
upstream are absent from the branch, so they drop out of the series.
"""

from __future__ import annotations

import shutil
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

from . import git
from . import manifest as manifest_mod
from . import series as series_mod
from .errors import UsageError
from .job import BASE_KEY, record
from .project import Project


@dataclass
class ExportResult:
    base: str
    patches: list[str] = field(default_factory=list)
    dropped: list[str] = field(default_factory=list)
    range_diff: str = ""


def export(project: Project, workdir: Path) -> ExportResult:
    """Write the checkout's work branch back into this repository's data files.

    Raises UsageError if the checkout is unsafe (dirty, operation in
    progress), its branch was not made by apply.py, a commit mixes overlay
    and upstream files, a patch commit lacks ``Upstream-Status:``, or this
    repository has uncommitted changes in the files export rewrites.
    """
    _refuse_dirty_project(project)
    repo = git.open_repo(workdir)
    op = git.operation_in_progress(repo)
    if op or git.is_dirty(repo):
        raise UsageError(f"{workdir} has {op + ' in progress' if op else 'uncommitted changes'}; "
                         f"finish and commit first")
    branch = git.current_branch(repo)
    base_ref = branch and git.config_get(repo, BASE_KEY.format(branch))
    if not base_ref:
        raise UsageError(f"{workdir} is not on a work branch made by apply.py")
    base_sha = git.resolve(repo, base_ref)
    manifest = manifest_mod.load(project.manifest_path, project.overlay_dir)
    old_patches = series_mod.load(project.patches_dir)
    commits = _patch_commits(repo, f"{base_sha}..HEAD", {f.path for f in manifest.files})
    result = ExportResult(base_ref)
    with tempfile.TemporaryDirectory(prefix="k3-export-") as tmp:
        new = _write_patches(repo, commits, old_patches, Path(tmp))
        new_patches = [series_mod.read_patch(path) for path in new]  # validates Upstream-Status
        result.range_diff = _range_diff(repo, manifest.base, old_patches, base_sha, commits)
        for old in project.patches_dir.glob("*.patch"):
            old.unlink()
        for path in new:
            shutil.copyfile(path, project.patches_dir / path.name)
    (project.patches_dir / "series").write_text("".join(f"{p.name}\n" for p in new_patches))
    result.patches = [p.name for p in new_patches]
    kept = {p.subject for p in new_patches}
    result.dropped = [p.name for p in old_patches if p.subject not in kept]
    files = []
    for f in manifest.files:
        blob = git.blob_at(repo, "HEAD", f.path)
        if blob is None:
            raise UsageError(f"the work branch has no {f.path}; restore it or drop it from overlay.json")
        (project.overlay_dir / f.path).write_bytes(git.read_blob(repo, blob))
        base_blob = git.blob_at(repo, base_sha, f.path) or manifest_mod.NEW
        files.append(manifest_mod.OverlayFile(f.path, base_blob))
    manifest_mod.save(manifest_mod.Manifest(base_ref, tuple(files)), project.manifest_path)
    record(repo, branch, base_ref)  # what the branch holds is in patches/ now: apply may rebuild it
    return result


def _write_patches(repo: git.Repo, commits: list[str], old: list[series_mod.Patch],
                   out: Path) -> list[Path]:
    """Format each commit; a patch whose subject the old series had keeps its file name
    (stable names, no churn), a new one is numbered after the highest number in use."""
    names = {p.subject: p.name for p in old}
    number = max((int(p.name[:4]) for p in old if p.name[:4].isdigit()), default=0)
    paths = []
    for sha in commits:
        staged = out / "staged"
        path = git.format_patch(repo, sha, staged, number + 1)
        subject = series_mod.read_patch(path).subject
        if subject in names:
            final = out / names[subject]
        else:
            number += 1
            final = out / path.name
        path.rename(final)
        paths.append(final)
    return paths


def _patch_commits(repo: git.Repo, rev_range: str, overlay_paths: set[str]) -> list[str]:
    """Commits of ``rev_range`` that are patches (those touching only overlay files are not)."""
    commits = []
    for sha, _ in git.log_subjects(repo, rev_range):
        paths = git.commit_paths(repo, sha)
        mixed = paths & overlay_paths
        if mixed == paths:
            continue
        if mixed:
            raise UsageError(f"commit {sha[:12]} changes overlay files ({', '.join(sorted(mixed))}) "
                             f"and upstream files; split it")
        commits.append(sha)
    return commits


def _range_diff(repo: git.Repo, old_base: str, old_patches: list[series_mod.Patch],
                new_base: str, new_commits: list[str]) -> str:
    """``git range-diff`` of the old series (re-applied on its base) and the new one."""
    old_sha = git.resolve(repo, old_base)
    if old_sha is None or not new_commits:
        return ""
    with git.temporary_worktree(repo, old_sha) as tree:
        env = git.environ(GIT_COMMITTER_NAME="k3-export", GIT_COMMITTER_EMAIL="k3@export.invalid")
        for patch in old_patches:
            if not git.am(tree, patch.path, env=env)[0]:
                git.am_abort(tree)
        old_tip = git.resolve(tree, "HEAD")
        return git.range_diff(repo, f"{old_sha}..{old_tip}", f"{new_base}..{new_commits[-1]}")


def _refuse_dirty_project(project: Project) -> None:
    try:
        repo = git.open_repo(project.root)
    except git.GitError:
        return  # not a git checkout (e.g. an unpacked release): nothing to protect but the files
    paths = [str(project.patches_dir), str(project.overlay_dir), str(project.manifest_path)]
    if git.run(repo, "status", "--porcelain", "--", *paths).strip():
        raise UsageError("patches/, overlay/ or overlay.json have uncommitted changes; "
                         "commit or stash them before --export")
