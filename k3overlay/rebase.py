"""Rebasing the overlay onto newer upstream refs.

``run_rebase`` is the CI job's core: for each target ref, in a throwaway clone
and worktree, classify every patch, 3-way merge every drifted overlay file,
verify, and hand the trees to the job's stages (tests and more, module
``stages``), so one report says what landed, what drifted and what broke.

``rebase_to`` is the maintainer's step: rebuild the work branch on a new ref
in the checkout itself, stopping where a human must resolve a conflict;
``export`` (module ``export``) then turns the branch back into ``patches/``.
"""

from __future__ import annotations

import hashlib
import re
import shutil
import tempfile
from dataclasses import replace
from pathlib import Path

from . import errors, git, journal, projectlock, source
from . import manifest as manifest_mod
from . import series as series_mod
from .interrupts import deferred
from .job import (
    BASE_KEY,
    aside,
    Options,
    build,
    classify_overlay,
    commit_overlay,
    fetched,
    fresh_clone,
    locked,
    next_args,
    open_checkout,
    overlay_folders,
    publish,
    record,
    refuse_merge_attributes,
    refuse_unsafe_patches,
    refuse_unsafe,
    verify_change,
    work_branch,
)
from .project import COMMITTER, Project
from .report import Report
from .safety import foreign_commits, refuse_git_locks
from .stages import Stages, Target
from .wheel import WheelOptions, build_for


def run_rebase(project: Project, refs: list[str], *, vllm_repo: str | None = None,
               stages: Stages | None = None, wheels: WheelOptions | None = None) -> list[Report]:
    """One report per ref in ``refs``; nothing of the user's is touched.

    Per ref: every patch classified, every drifted overlay file 3-way merged,
    what went in committed (and verified when all of it did: ``VerifyResult``).
    ``stages`` (the CI job's, module ``stages``) then gets the ``Target`` once
    and its ``StageResults`` go into the report as they are. With ``wheels``,
    each ref whose series and overlay applied and verified gets its wheel
    built (``wheel.build_for``; the report's ``wheel``). A ref that cannot be
    found yields a report with ``error`` rather than stopping the others.
    Raises OverlayError for a bad series/manifest or an unreachable source.
    """
    with projectlock.reading(project, aside):  # (an export waits until the last ref is done)
        return _run_rebase(project, refs, vllm_repo, stages, wheels)


def _run_rebase(project: Project, refs: list[str], vllm_repo: str | None, stages: Stages | None,
                wheels: WheelOptions | None) -> list[Report]:
    manifest = manifest_mod.load(project.manifest_path, project.overlay_dir)
    patches = series_mod.load(project.patches_dir)
    refuse_unsafe_patches(patches, manifest)
    origin = source.locate(vllm_repo, [manifest.base])
    scratch = Path(tempfile.mkdtemp(prefix="k3-rebase-"))
    try:
        repo = source.clone(origin, scratch / "vllm")
        source.ensure_ref(repo, origin, manifest.base)  # drift merges read upstream's base blobs
        return [_one(project, manifest, patches, repo, vllm_repo, ref, stages, wheels)
                for ref in refs]
    finally:
        shutil.rmtree(scratch, ignore_errors=True)


def _one(project, manifest, patches, repo, vllm_repo, ref, stages, wheels) -> Report:
    report = Report(project.version, manifest.base, ref, vllm_repo=vllm_repo or "")
    try:  # one bad or unknown ref must not cost the other refs their reports
        origin = source.locate(vllm_repo, [ref])
        report.ref_sha = source.ensure_ref(repo, origin, ref)
    except errors.OverlayError as err:
        report.error, report.error_code = str(err), err.exit_code
        return report
    with git.temporary_worktree(repo, report.ref_sha) as tree:
        sha = build(project, manifest, patches, tree, report, merge=True, best_effort=True)
        if stages is not None:
            with git.temporary_worktree(repo, report.ref_sha) as released:
                conflicts = tuple(f.path for f in report.overlay
                                  if f.status == manifest_mod.CONFLICT)
                found = stages(Target(report.ref, report.ref_sha,
                                      Path(released.working_tree_dir), Path(tree.working_tree_dir),
                                      tuple(report.missing), conflicts))
            report.runs, report.sections = list(found.runs), list(found.sections)
        if wheels is not None and sha is not None:
            own = replace(wheels, wheel_dir=wheels.wheel_dir / target_folder(report.ref))
            report.wheel = build_for(project, tree, report, sha, own)
    return report


_PLAIN = re.compile(r"[A-Za-z0-9][A-Za-z0-9._+-]*")


def target_folder(ref: str) -> str:
    """The folder (one path part) of target ``ref``'s wheel under ``--wheels DIR``: two
    targets of one vLLM release build one wheel file name (``main`` and ``v0.29.0``), so
    each gets its own folder and no report names a file another target replaced. A ref
    that is a plain file name is its own folder; any other (``main~2``, ``refs/tags/x``)
    is made one, with a hash of the ref so two such refs never share a folder."""
    if _PLAIN.fullmatch(ref) and ".." not in ref:
        return ref
    plain = re.sub(r"[^A-Za-z0-9._+-]+", "_", ref).strip("._") or "ref"
    return f"{plain}-{hashlib.sha256(ref.encode()).hexdigest()[:8]}"


def rebase_to(project: Project, opts: Options) -> Report:
    """Rebuild the work branch on ``opts.ref`` in the checkout, for a maintainer.

    Landed patches are dropped; a conflicting patch stops with ``git am``
    left in progress (resolve, ``git am --continue``, run this again to go
    on); drifted overlay files are 3-way merged, conflicts left as markers in
    the work tree (resolve, commit, then ``--export``). Raises UsageError on
    an unsafe checkout or an unknown ref.
    """
    workdir = (opts.workdir or project.default_workdir).resolve()
    with projectlock.reading(project, aside), locked(workdir, overlay_dir=project.overlay_dir):
        return _rebase_to(project, opts, workdir)


def _rebase_to(project: Project, opts: Options, workdir: Path) -> Report:
    manifest = manifest_mod.load(project.manifest_path, project.overlay_dir)
    patches = series_mod.load(project.patches_dir)
    refuse_unsafe_patches(patches, manifest)
    branch = work_branch(project, opts)
    report = Report(project.version, manifest.base, opts.ref, branch=branch, workdir=str(workdir),
                    **next_args(opts))
    source.check_ref(manifest.base, what="base in overlay.json")
    origin = source.locate(opts.vllm_repo, [manifest.base, opts.ref])
    repo = open_checkout(workdir)
    if repo is not None:
        source.refuse_foreign_checkout(repo, workdir, overlay_folders(manifest))
        continuing = _switched(repo, origin, opts, workdir, manifest, patches, branch, report)
    else:  # (the run's own clone: no foreign-checkout check)
        with fresh_clone(origin, workdir) as repo:
            continuing = _switched(repo, origin, opts, workdir, manifest, patches, branch, report)
    # A patch is on the branch when a commit there has its subject (git am keeps it verbatim);
    # one whose change is on the branch only in another form is "redundant", never landed:
    # landed-upstream is proven against REF's tree, or by an upstream commit's patch-id.
    done = {subject for _, subject in git.log_subjects(repo, f"{report.ref_sha}..HEAD")}
    base_sha = git.resolve(repo, manifest.base)
    env = git.environ(**COMMITTER)
    for patch in patches:
        if patch.subject in done:
            report.patches.append(series_mod.PatchResult(patch.name, series_mod.APPLIED))
            continue
        result = series_mod.apply_one(repo, patch, env=env, ref_sha=report.ref_sha,
                                      keep_conflict=True, base_sha=base_sha)
        report.patches.append(result)
        if result.status == series_mod.CONFLICT:
            report.notes.append(f"resolve {', '.join(result.files)}, `git add` them, run "
                                f"`git am --continue` in {workdir}, then run apply.py --rebase-to "
                                f"{opts.ref} again (or `git am --abort`, drop the patch from "
                                f"patches/series, re-run)")
            return report
    if _overlay_committed(repo, report.ref_sha, {f.path for f in manifest.files}):
        # Checked again as it stands now: a run that stopped at verification must not
        # come back "ok" because nothing was left to lay (round 5, F4).
        report.verify = verify_change(repo, report.ref_sha, "HEAD")
        report.notes.append("the overlay is already committed on the branch (a resolution is "
                            "never overwritten): " + ("run apply.py --export" if report.verify.ok else
                                                      "fix what verify found, commit, run this again"))
        return report
    report.overlay = classify_overlay(repo, project, manifest, report.ref_sha, merge=True)
    laid = manifest_mod.to_lay(project.overlay_dir, report.overlay, with_conflicts=True)
    # Laid but not yet committed, the files would read as the maintainer's resolution to
    # every later run ("commit the resolution first"): a killed run's are put back (recovery).
    head = git.resolve(repo, "HEAD")
    files = {p: (hashlib.sha256(data).hexdigest(), executable) for p, (data, executable) in laid.items()}
    with journal.step("lay", repo=repo.working_tree_dir, head=head,
                      files=[[p, *f] for p, f in files.items()]):
        try:
            manifest_mod.lay(repo, laid)
            conflicted = [f.path for f in report.overlay if f.status == manifest_mod.CONFLICT]
            if conflicted:
                git.stage_exact(repo, {path: laid[path] for path in laid if path not in conflicted})
                report.notes.append(f"resolve the conflict markers in {', '.join(conflicted)}, "
                                    f"`git commit -a`, then run apply.py --export")
                return report
            sha = commit_overlay(repo, project, report, laid)
        except BaseException:  # (Ctrl-C, a full disk): put back now, as a killed run's would be
            with deferred():
                manifest_mod.undo_laid(repo, head, files)
            raise
        journal.point("lay.committed")
    # The tip is recorded as apply.py's (a plain run may then rebuild it) only if apply.py
    # made every commit on it: a maintainer's resolutions are saved by --export first.
    if not foreign_commits(repo, branch, sha):
        record(repo, branch, opts.ref)
    report.verify = verify_change(repo, report.ref_sha, sha)
    report.notes.append("now run apply.py --export to regenerate patches/ and overlay.json")
    return report


def _switched(repo: git.Repo, origin: str, opts: Options, workdir: Path, manifest: manifest_mod.Manifest,
              patches: list[series_mod.Patch], branch: str, report: Report) -> bool:
    """The checkout made ready for the series: REF and the base fetched (``report.ref_sha``),
    a normal run's refusals, and the switch to ``branch`` at REF, unless the run goes on with
    the branch a former run made for REF (True: the maintainer's resolutions are on it).
    Raises UsageError where the checkout must not be touched."""
    refuse_merge_attributes(repo)
    # Continuing skips refuse_unsafe (the branch holds the maintainer's resolutions by design),
    # never git's own locks: the maintainer's `git commit` with its editor open holds index.lock,
    # and the overlay used to be laid into the work tree before staging failed on it. Locks
    # first: a killed `git am` leaves one, and `git am --abort` fails on it.
    refuse_git_locks(repo, branch)
    op = git.operation_in_progress(repo)
    if op:
        raise errors.UsageError(f"{workdir} has a {op} in progress; finish it (git am --continue) "
                                f"or abort it, then run --rebase-to again")
    report.ref_sha = fetched(repo, origin, opts.ref)
    fetched(repo, origin, manifest.base)  # drift merges read upstream's base blobs
    continuing = (git.current_branch(repo) == branch
                  and git.config_get(repo, BASE_KEY.format(branch)) == opts.ref)
    if not continuing:
        refuse_unsafe(repo, branch)
    elif git.is_dirty(repo):
        raise errors.UsageError(f"{workdir} has uncommitted changes; commit the resolution first")
    _refuse_untracked_in_the_way(repo, patches, manifest)
    _refuse_tree_merge_attributes(repo, report.ref_sha, opts.ref, patches, manifest)
    if not continuing:
        with deferred():  # switched but not recorded, the branch would be refused as not ours
            publish(repo, branch, report.ref_sha, opts.ref)
    return continuing


def _refuse_untracked_in_the_way(repo: git.Repo, patches: list[series_mod.Patch],
                                 manifest: manifest_mod.Manifest) -> None:
    """UsageError if a file git does not track (one it ignores) sits where a patch or an
    overlay file will be written in the checkout: ``git am --3way`` and laying a file
    would overwrite it without a word."""
    paths = [f.path for f in manifest.files]
    for patch in patches:
        paths += git.patch_paths(repo, patch.path)
    in_the_way = git.untracked_in_the_way(repo, list(dict.fromkeys(paths)))
    if in_the_way:
        raise errors.UsageError(f"{in_the_way[0]} in {repo.working_tree_dir} is not tracked by "
                                f"git (ignored) and the series or overlay writes there; move it "
                                f"away first")


def _refuse_tree_merge_attributes(repo: git.Repo, ref_sha: str, ref: str,
                                  patches: list[series_mod.Patch],
                                  manifest: manifest_mod.Manifest) -> None:
    """UsageError if REF's ``.gitattributes`` (any depth, macros too) give a path the series or
    the overlay writes a ``merge`` or ``filter`` attribute. ``--rebase-to`` merges in the
    checkout itself, where git follows them (``merge=union`` takes both sides of a
    conflict); apply.py and the rebase job merge in a scratch repository where they count
    for nothing. An ``!merge`` line in the checkout's info/attributes restores the default."""
    paths = [f.path for f in manifest.files]
    for patch in patches:
        paths += git.patch_paths(repo, patch.path)
    found = git.attributes_at(repo, ref_sha, list(dict.fromkeys(paths)), ["merge", "filter"])
    for path, attributes in found.items():
        name, value = next(iter(attributes.items()))
        raise errors.UsageError(
            f"{ref}'s .gitattributes give {path} {name}={value}: --rebase-to merges in the checkout, "
            f"where git would follow it (a line both sides changed would not be a conflict); add "
            f"'{path} !{name}' to {repo.git_dir}/info/attributes first")


def _overlay_committed(repo: git.Repo, ref_sha: str, overlay_paths: set[str]) -> bool:
    """True if a commit on the branch since ``ref_sha`` touches only overlay files."""
    return any(git.commit_paths(repo, sha) <= overlay_paths
               for sha, _ in git.log_subjects(repo, f"{ref_sha}..HEAD"))
