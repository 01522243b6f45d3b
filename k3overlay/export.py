"""Regenerate ``patches/`` and ``overlay.json`` from a maintainer's work branch.

The work branch (made by ``apply.py`` or ``apply.py --rebase-to``) is
upstream REF, then one commit per patch, then commits touching only overlay
files. Export writes each patch commit as a format-patch (stable names and
numbering, zeroed commit ids, no version signature; the Date is the author
date ``git am`` kept), copies the overlay files from the branch tip back to
``overlay/``, and re-records every base blob at REF. Patches that landed
upstream are absent from the branch, so they drop out of the series.

Everything is checked before anything is written: a refused export leaves
``patches/``, ``overlay/`` and ``overlay.json`` as they were.
"""

from __future__ import annotations

import hashlib
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

from . import git, projectlock
from . import manifest as manifest_mod
from . import series as series_mod
from .errors import UsageError
from .files import STAGING, write_all_in_tree
from .interrupts import deferred
from .job import BASE_KEY, locked, record, aside, verify_change
from .project import COMMITTER, Project
from .safety import refuse_git_locks


@dataclass
class ExportResult:
    base: str
    patches: list[str] = field(default_factory=list)
    dropped: list[str] = field(default_factory=list)
    range_diff: str = ""
    interrupted: bool = False  # a signal came while writing: the writing was finished first


def export(project: Project, workdir: Path) -> ExportResult:
    """Write the checkout's work branch back into this repository's data files.

    Raises UsageError, writing nothing, if: the checkout is unsafe (dirty,
    operation in progress) or not on a work branch made by apply.py; the
    branch has a merge commit, a commit mixing overlay and upstream files,
    two patches with one subject, or a patch without ``Upstream-Status:``;
    an overlay file is missing, still has conflict markers, is upstream's
    rather than ours, or was laid over upstream's changes with
    ``--allow-drift``; the branch fails verification; or this repository has
    uncommitted changes in the files export rewrites. The writing itself is
    not cut short by Ctrl-C. It holds this repository's lock (``projectlock``: no run
    reads its files meanwhile, two exports wait for each other), then the checkout's
    like apply does; a killed export's writes are finished or undone by the next run.
    """
    with projectlock.writing(project, aside), locked(workdir, overlay_dir=project.overlay_dir):
        return _export(project, workdir)


def _export(project: Project, workdir: Path) -> ExportResult:
    # What the files export rewrites hold, read before the check that they are committed
    # (an edit in between fails that check): one made later stops the export before
    # anything is written (write_all_in_tree's last look).
    start = _contents(project)
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
    refuse_git_locks(repo, branch)  # a `git commit --amend` with its editor open: wait for it
    base_sha = git.resolve(repo, base_ref)
    if base_sha is None:
        raise UsageError(f"the work branch's base {base_ref!r} is not in {workdir} (a deleted tag "
                         f"or branch?): fetch it, then export again")
    manifest = manifest_mod.load(project.manifest_path, project.overlay_dir)
    old_patches = series_mod.load(project.patches_dir)
    overlay_paths = {f.path for f in manifest.files}
    commits = _patch_commits(repo, f"{base_sha}..HEAD", overlay_paths)
    overlay = {f.path: _overlay_content(repo, base_sha, project, f) for f in manifest.files}
    _refuse_allowed_drift(repo, f"{base_sha}..HEAD", overlay_paths)
    checked = verify_change(repo, base_sha, "HEAD")
    if not checked.ok:
        raise UsageError(f"the work branch fails verification: {checked.errors[0]}")
    result = ExportResult(base_ref)
    with tempfile.TemporaryDirectory(prefix="k3-export-") as tmp:
        new = _write_patches(repo, commits, old_patches, Path(tmp))
        new_patches = [series_mod.read_patch(path) for path in new]  # validates Upstream-Status
        result.range_diff = _range_diff(repo, (manifest.base, old_patches), (base_sha, new_patches))
        patch_files = {path.name: path.read_bytes() for path in new}
    modes = git.tree_entries(repo, "HEAD", sorted(overlay))
    files = tuple(manifest_mod.OverlayFile(f.path, git.blob_at(repo, base_sha, f.path)
                                           or manifest_mod.NEW) for f in manifest.files)
    # Checked; now write every file or none (each whole, on disk before any is renamed into
    # place), never through a link: not even patches/, overlay/ or overlay.json being one.
    writes = {_rel(project, project.patches_dir / name): (content, False)
              for name, content in patch_files.items()}
    writes[_rel(project, project.patches_dir / "series")] = (
        "".join(f"{p.name}\n" for p in new_patches).encode(), False)
    writes |= {_rel(project, project.overlay_dir / path): (content, modes[path][0] == "100755")
               for path, content in overlay.items()}
    writes[_rel(project, project.manifest_path)] = (
        manifest_mod.dumps(manifest_mod.Manifest(base_ref, files)), False)
    with deferred(then_raise=False) as received:  # Ctrl-C waits: half an export is worse than a second's wait
        # (killed while staging: nothing in overlay/; while renaming: the next run finishes)
        remove = tuple(_rel(project, old) for old in project.patches_dir.glob("*.patch")
                       if old.name not in patch_files)
        with projectlock.recording(project):  # (a killed export: any run on any checkout finishes it)
            write_all_in_tree(project.root, writes, staging=STAGING, remove=remove,
                              unchanged={rel: start.get(rel) for rel in (*writes, *remove)})
        record(repo, branch, base_ref)  # the branch is in patches/ now: apply may rebuild it
    result.interrupted = bool(received)
    result.patches = [p.name for p in new_patches]
    kept = {p.subject for p in new_patches}
    result.dropped = [p.name for p in old_patches if p.subject not in kept]
    return result


def _contents(project: Project) -> dict[str, str]:
    """``{rel: sha256}`` of every file in ``patches/``, ``overlay/`` and ``overlay.json``."""
    paths = [project.manifest_path, *project.patches_dir.glob("*"), *project.overlay_dir.rglob("*")]
    return {_rel(project, p): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in paths if p.is_file() and not p.is_symlink()}


def _rel(project: Project, path: Path) -> str:
    """``path`` (one of the project's data files) relative to the project's root, ``/``-separated."""
    return path.relative_to(project.root).as_posix()


def _overlay_content(repo: git.Repo, base_sha: str, project: Project,
                     f: manifest_mod.OverlayFile) -> bytes:
    """Our file as the branch tip has it, refusing what must not become the overlay."""
    blob = git.blob_at(repo, "HEAD", f.path)
    if blob is None:
        raise UsageError(f"the work branch has no {f.path}: finish apply.py --rebase-to first")
    content = git.read_blob(repo, blob)
    if any(line.startswith((b"<<<<<<< ", b">>>>>>> ")) for line in content.splitlines()):
        raise UsageError(f"{f.path} on the work branch still has conflict markers")
    ours = (project.overlay_dir / f.path).read_bytes()
    if blob == git.blob_at(repo, base_sha, f.path) and content != ours:
        raise UsageError(f"the work branch has upstream's {f.path}, not ours: "
                         f"finish apply.py --rebase-to first")
    return content


def _patch_commits(repo: git.Repo, rev_range: str, overlay_paths: set[str]) -> list[str]:
    """Commits of ``rev_range`` that are patches (those touching only overlay files are not)."""
    merges = git.run(repo, "rev-list", "--merges", rev_range).split()
    if merges:
        raise UsageError(f"the work branch has merge commit {merges[0][:12]}; make it linear first")
    commits, subjects = [], {}
    for sha, subject in git.log_subjects(repo, rev_range):
        paths = git.commit_paths(repo, sha)
        mixed = paths & overlay_paths
        if mixed == paths:
            continue
        if mixed:
            raise UsageError(f"commit {sha[:12]} changes overlay files ({', '.join(sorted(mixed))}) "
                             f"and upstream files; split it")
        if subject in subjects:
            raise UsageError(f"commits {subjects[subject][:12]} and {sha[:12]} share the subject "
                             f"{subject!r}; squash or reword one")
        subjects[subject] = sha
        commits.append(sha)
    return commits


def _refuse_allowed_drift(repo: git.Repo, rev_range: str, overlay_paths: set[str]) -> None:
    """An overlay laid with --allow-drift threw upstream's changes away: never record that."""
    for sha, _ in git.log_subjects(repo, rev_range):
        if git.commit_paths(repo, sha) <= overlay_paths:
            message = git.run(repo, "show", "-s", "--format=%B", sha)
            drifted = [line[len("drift: "):] for line in message.splitlines()
                       if line.startswith("drift: ")]
            if drifted:
                raise UsageError(f"{drifted[0]} was laid over upstream's changes (--allow-drift); "
                                 f"merge them with apply.py --rebase-to before exporting")


def _write_patches(repo: git.Repo, commits: list[str], old: list[series_mod.Patch],
                   out: Path) -> list[Path]:
    """Format each commit; a patch whose subject the old series had keeps its file name
    (stable names, no churn), a new one is numbered after the highest number in use."""
    olds = {p.subject: p for p in old}
    number = max((int(p.name[:4]) for p in old if p.name[:4].isdigit()), default=0)
    paths = []
    for sha in commits:
        staged = out / "staged"
        path = git.format_patch(repo, sha, staged, number + 1)
        subject = series_mod.read_patch(path).subject
        if subject in olds:
            final = out / olds[subject].name
            # Notes below ``---`` never reach a commit (git am drops them): carried over
            # from the old file, byte for byte.
            _, notes, _ = series_mod.split_notes(olds[subject].path.read_bytes())
            if notes:
                path.write_bytes(series_mod.with_notes(path.read_bytes(), notes))
        else:
            number += 1
            final = out / path.name
        path.rename(final)
        paths.append(final)
    return paths


def _range_diff(repo: git.Repo, old: tuple[str, list[series_mod.Patch]],
                new: tuple[str, list[series_mod.Patch]]) -> str:
    """``git range-diff`` of two series, each applied afresh on its own base."""
    old_tip, old_base = _applied(repo, *old), git.resolve(repo, old[0])
    new_tip, new_base = _applied(repo, *new), git.resolve(repo, new[0])
    if None in (old_tip, new_tip, old_base, new_base) or old_tip == old_base or new_tip == new_base:
        return ""  # range-diff needs two non-empty ranges; ``dropped`` tells the rest
    return git.range_diff(repo, f"{old_base}..{old_tip}", f"{new_base}..{new_tip}")


def _applied(repo: git.Repo, base: str, patches: list[series_mod.Patch]) -> str | None:
    """The tip after applying ``patches`` on ``base`` in a throwaway worktree (None: no base)."""
    sha = git.resolve(repo, base)
    if sha is None:
        return None
    with git.temporary_worktree(repo, sha) as tree, \
            tempfile.TemporaryDirectory(prefix="k3-notes-") as tmp:
        with_notes = [series_mod.notes_in_message(p, Path(tmp)) for p in patches]
        series_mod.apply(tree, with_notes, env=git.environ(**COMMITTER), ref_sha=sha)
        return git.resolve(tree, "HEAD")


def _refuse_dirty_project(project: Project) -> None:
    try:
        repo = git.open_repo(project.root)
    except git.GitError:
        return  # not a git checkout (e.g. an unpacked release): nothing to protect but the files
    paths = [str(project.patches_dir), str(project.overlay_dir), str(project.manifest_path)]
    if git.run(repo, "status", "--porcelain", "--", *paths).strip():
        raise UsageError("patches/, overlay/ or overlay.json have uncommitted changes; "
                         "commit or stash them before --export")
