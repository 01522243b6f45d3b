"""The apply job: a vLLM checkout at a ref -> the patched work branch, or a clear reason why not.

All patching happens in a temporary worktree at the ref; the user's checkout
is touched only at the very end, and only when everything succeeded: its
work branch is pointed at the result and checked out (a step Ctrl-C does not
cut in half). With ``check`` the last step is skipped, so the checkout stays
exactly as it was. One job at a time per work directory (``lock``).

Commits are made with a fixed identity and dates taken from the patches and
the ref, so the same series on the same ref gives the same shas: a re-run is
a no-op.
"""

from __future__ import annotations

import contextlib
import os
import secrets
import shutil
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from rich.markup import escape

from . import claim, errors, git, journal, progress, projectlock, recovery, source
from . import manifest as manifest_mod
from . import series as series_mod
from .errors import UsageError
from .files import read_regular
from .interrupts import deferred
from .lock import journal_path, workdir_lock
from .progress import step
from .project import COMMITTER, IDENTITY, Project
from .publish import BASE_KEY, TIP_KEY, publish, record
from .report import Report
from .safety import refuse_unsafe
from .verify import VerifyResult, verify

__all__ = ["BASE_KEY", "TIP_KEY", "record", "refuse_unsafe"]  # (``publish``, ``safety``)


@dataclass(frozen=True)
class Options:
    """What the user asked for. ``ref`` None = the pinned base from the manifest."""

    ref: str | None = None
    vllm_repo: str | None = None
    workdir: Path | None = None
    branch: str | None = None
    check: bool = False
    allow_drift: bool = False


def run_apply(project: Project, opts: Options) -> Report:
    """Apply the series and overlay onto ``opts.ref``; return the report.

    Raises OverlayError (UsageError, SourceError, GitError) for bad input or
    an unsafe checkout, before anything is changed. Patch conflicts, drift
    and verification failures come back in the report (see ``exit_code``).
    """
    with projectlock.reading(project, aside):  # (an export from another checkout waits)
        return _run_apply(project, opts)


def _run_apply(project: Project, opts: Options) -> Report:
    manifest = manifest_mod.load(project.manifest_path, project.overlay_dir)
    patches = series_mod.load(project.patches_dir)
    refuse_unsafe_patches(patches, manifest)
    ref = opts.ref or manifest.base
    branch = work_branch(project, opts)
    workdir = (opts.workdir or project.default_workdir).resolve()
    report = Report(project.version, manifest.base, ref, branch=branch, workdir=str(workdir),
                    allow_drift=opts.allow_drift, **next_args(opts))

    try:
        with locked(workdir, check=opts.check, overlay_dir=project.overlay_dir):
            _apply_locked(project, opts, manifest, patches, ref, branch, workdir, report)
    except KeyboardInterrupt:
        if not report.published:
            raise  # (nothing of the checkout changed: said so by the CLI)
        # after the switch (as the run let go of its locks): what was done is said, not undone
        report.error = f"interrupted after the switch: branch {branch} is published"
        report.error_code = errors.INTERRUPTED
    return report


def refuse_unsafe_patches(patches: list[series_mod.Patch], manifest: manifest_mod.Manifest) -> None:
    """UsageError, before any work, if a patch changes (or renames, or deletes) an overlay file's
    path: the overlay is laid whole after the patches, so the patch's change was lost while
    the report said "applied", and ``--export``, which takes a commit touching only overlay
    files for the overlay's own, then dropped the patch from the series. Or if it writes
    where no patch may (``_forbidden``): git refuses such a path, and the run used to call
    it a conflict and tell the user to ``git add`` it."""
    overlay, links = {f.path for f in manifest.files}, set()
    for patch in patches:  # (in series order: a link an earlier patch makes counts for the later)
        try:
            touched = git.paths_touched(patch.path)
            links |= git.links_made(patch.path)
        except git.GitError as err:
            raise UsageError(str(err)) from err
        for path in sorted(touched):
            why = _forbidden(path, links)
            if why:
                raise UsageError(f"{patch.name} writes {path!r}, {why}: git refuses it, and no patch of "
                                 f"the series may; take it out of the patch")
        hit = sorted(touched & overlay)
        if hit:
            raise UsageError(f"{patch.name} changes {hit[0]}, an overlay file: the overlay is laid whole "
                             f"over the patch's change, which would be lost (and --export would drop the "
                             f"patch); make that change in overlay/{hit[0]} instead")


def _forbidden(path: str, links: set[str]) -> str | None:
    """Why a patch may not write ``path`` (relative to the tree's top), or None: absolute, out of
    the tree (``..``), inside a git folder (``.git`` in any case, with the trailing dots and
    spaces and the 8.3 name ``git~1`` that some file systems drop or map to it), or below a
    link the same patch makes."""
    parts = path.split("/")
    if path.startswith("/"):
        return "an absolute path"
    if ".." in parts:
        return "a path out of the tree"
    if "." in parts or "" in parts:
        return "a path with a '.' or an empty part"
    if any(_as_a_file_system_may_read(part) in (".git", "git~1") for part in parts):
        return "a path inside a git folder"
    through = next((link for link in sorted(links) if path.startswith(link + "/")), None)
    if through:
        return f"a path through {through}, a symbolic link the patch makes"
    return None


# What HFS+ ignores in a name (git's is_hfs_dotgit): zero-width joiners, marks, BiDi controls.
_IGNORED = dict.fromkeys([0x200C, 0x200D, 0x200E, 0x200F, *range(0x202A, 0x202F), *range(0x206A, 0x2070),
                          0xFEFF])


def _as_a_file_system_may_read(part: str) -> str:
    """``part`` as NTFS or HFS+ may read it: lower case, no ignorable characters, no ``:stream``
    (NTFS's alternate data streams, ``.git::$INDEX_ALLOCATION``), no trailing dots or spaces."""
    return part.translate(_IGNORED).lower().split(":", 1)[0].rstrip(". ")


def overlay_folders(manifest: manifest_mod.Manifest) -> set[str]:
    """The top folders the overlay's files live in (``vllm``, ``tests``): a checkout of the
    project the overlay is for has them."""
    return {f.path.split("/", 1)[0] for f in manifest.files if "/" in f.path}


def next_args(opts: Options) -> dict[str, str]:
    """What the report's next commands repeat of the run's arguments: the source (without
    credentials), the checkout and the branch, where the user gave them."""
    from .redact import url_without_credentials

    return {"vllm_repo": url_without_credentials(opts.vllm_repo) if opts.vllm_repo else "",
            "workdir_arg": str(Path(opts.workdir).resolve()) if opts.workdir else "",
            "branch_arg": opts.branch or ""}


def work_branch(project: Project, opts: Options) -> str:
    """The work branch's name (``--branch``, else from VERSION); UsageError, before any work,
    if git would refuse it as a branch name (git itself says so only when publishing)."""
    branch = opts.branch or project.default_branch
    if not git.is_branch_name(branch):
        where = "--branch" if opts.branch else "the work branch (from VERSION)"
        raise UsageError(f"{where} {branch!r} is not a valid git branch name")
    return branch


def aside(text: str) -> None:
    """Print a line aside, even with -q: a run that waits must say why, a recovery what it did."""
    progress.console.print(f"[dim]…[/dim] {escape(text)}")


@contextlib.contextmanager
def locked(workdir: Path, *, check: bool = False, overlay_dir: Path | None = None) -> Iterator[None]:
    """Hold ``workdir``'s lock (see ``lock``) and its claim (``claim``: runs under another cache
    or another name of it), saying so if another run has either; first finish or undo what a
    killed run left (``journal``; with ``check``, only say what is left: a --check writes
    nothing), then record this run's steps."""
    with workdir_lock(workdir, say=aside):
        path = journal_path(workdir)

        def recover(unfinished: journal.Journal) -> None:
            recovery.recover(unfinished, aside, act=not check, overlay_dir=overlay_dir)

        try:
            with claim.claimed(workdir, path, aside, recover, check=check), \
                    journal.recording(path, workdir, recover):
                yield
        finally:
            claim.release(workdir, path)  # (a new workdir's clone: claimed inside the journal's life)


def _apply_locked(project: Project, opts: Options, manifest: manifest_mod.Manifest,
                  patches: list[series_mod.Patch], ref: str, branch: str, workdir: Path,
                  report: Report) -> None:
    source.check_ref(manifest.base, what="base in overlay.json")
    existing = open_checkout(workdir)
    if existing is not None:
        source.refuse_foreign_checkout(existing, workdir, overlay_folders(manifest))
        refuse_merge_attributes(existing)
    if existing is not None and not opts.check:
        refuse_unsafe(existing, branch)
    origin = source.locate(opts.vllm_repo, [manifest.base, ref])
    with _work_repo(existing, origin, workdir, ref, opts.check) as (repo, report.ref_sha):
        if git.resolve(repo, manifest.base) is None:
            report.notes.append(f"note: base {manifest.base} is not in this checkout (shallow or "
                                f"foreign clone?): no upstream diff of drifted files")
        with git.temporary_worktree(repo, report.ref_sha) as tree:
            result_sha = build(project, manifest, patches, tree, report)
        if opts.check:
            report.notes.append("--check: nothing was written to the checkout")
        elif result_sha:
            with deferred(then_raise=False) as received:  # the last step: finish it, then stop
                _publish(repo, branch, result_sha, report)
            if received:  # stopped after all: no wheel is built after it, the exit is 130
                report.error = (f"interrupted while switching the checkout: the switch was finished "
                                f"first, branch {branch} is published")
                report.error_code = errors.INTERRUPTED


@contextlib.contextmanager
def _work_repo(existing: git.Repo | None, origin: str, workdir: Path, ref: str,
               check: bool) -> Iterator[tuple[git.Repo, str]]:
    """The repository to work in and the commit ``ref`` names, as a normal run resolves it
    (``source.ensure_ref``); and what to clean up after.

    ``--check`` never writes to a user's checkout, not even a fetched ref: unless the
    checkout's own answer is final (``source.settled_locally``: a full sha, a release tag
    it has), the ref is fetched into a throwaway clone, and only a name the source lacks
    is read from the checkout (as a normal run falls back to a local branch). A clone made
    into a fresh ``workdir`` is removed again if the run is interrupted or fails with an
    exception, so no half-made checkout is left.
    """
    if existing is not None and not check:
        yield existing, fetched(existing, origin, ref)
        return
    settled = source.settled_locally(existing, ref) if existing is not None else None
    if settled:
        yield existing, settled
        return
    if check:
        local = source.fallback(existing, ref) if existing is not None else None
        scratch = Path(tempfile.mkdtemp(prefix="k3-check-"))
        try:
            with journal.step("check", scratch=str(scratch)):
                try:
                    try:
                        clone = source.clone(origin, scratch / "vllm")
                        sha = fetched(clone, origin, ref)
                    except errors.OverlayError:
                        if local is None:  # the source cannot answer, and the checkout may not
                            raise
                        sha = None
                    if sha is not None:
                        yield clone, sha
                finally:
                    with deferred():
                        shutil.rmtree(scratch, ignore_errors=True)
        finally:
            with deferred():
                shutil.rmtree(scratch, ignore_errors=True)  # (the journal could not be written)
        if sha is None:  # a name only the checkout knows: a normal run takes it too
            yield existing, local
        return
    with fresh_clone(origin, workdir) as repo:
        yield repo, fetched(repo, origin, ref)


def open_checkout(workdir: Path) -> git.Repo | None:
    """The checkout at ``workdir`` (``source.open_existing``), or None where there is none yet
    or it is a killed run's clone never switched (``recovery.abandoned``: ``fresh_clone`` takes
    it up). Raises UsageError as ``source.open_existing``."""
    existing = source.open_existing(workdir)
    return None if existing is not None and recovery.abandoned(workdir) is not None else existing


@contextlib.contextmanager
def fresh_clone(origin: str, workdir: Path) -> Iterator[git.Repo]:
    """A clone of ``origin`` into the new ``workdir`` (``source.clone``), or the one a killed run
    left there unswitched (``recovery.abandoned``), the run's own until its switch (the block):
    removed if the block raises. A clone of the release mirror (tags, no branch) has nothing
    checked out, so one the run made and did not switch (a conflict, drift, a failed
    verification) is removed at the end; one taken up is never removed (the next run takes it
    up again). The mark is dropped once the clone is switched.

    The run claims the clone (``claim.held``) before it is put in place and holds the claim to
    the end: a run under another cache finding it there waits, rather than taking it up as a
    killed run's and switching it under this one. Raises UsageError where the clone to take
    up was another live run's, switched while this run waited for it."""
    left = recovery.abandoned(workdir)
    taken_up, mark = left is not None, left or secrets.token_hex(8)
    journal_file = journal_path(workdir)
    with contextlib.ExitStack() as held:
        def claimed(git_dir: Path, before=lambda fd: None) -> None:
            held.enter_context(claim.held(git_dir, workdir, journal_file, aside, before=before))

        if taken_up:  # (claimed before its step: a run killed while it waits leaves no step on it)
            # The clone's run, killed under another cache, left its steps in the journal its
            # claim names: finished or undone now (its switch too), not at some later run.
            claimed(claim.git_folder(workdir) or workdir / ".git", before=lambda fd: claim.recover_named(
                fd, workdir, journal_file, lambda left: recovery.recover(left, aside)))
            if not recovery.unswitched(workdir, left):
                raise errors.UsageError(f"{workdir} was made by another run, which switched it while "
                                        f"this one waited: run again")
        held.enter_context(journal.step("fresh", repo=str(workdir), mark=mark))
        # (if the clone fails, there is nothing of ours to remove)
        repo = git.open_repo(workdir) if taken_up else source.clone(origin, workdir, mark=mark,
                                                                     before_placed=claimed)
        try:
            yield repo
        except BaseException:
            if not taken_up:
                with deferred():
                    shutil.rmtree(workdir, ignore_errors=True)
            raise
        with deferred():
            if recovery.unswitched(workdir, mark):
                if not taken_up:  # (one taken up stays: the user had it for a while, and may borrow from it)
                    shutil.rmtree(workdir, ignore_errors=True)
            else:
                with contextlib.suppress(OSError):
                    os.unlink(workdir / ".git" / source.FRESH_MARK)


def fetched(repo: git.Repo, origin: str, ref: str) -> str:
    """``source.ensure_ref`` into the checkout, recorded in the journal: git writes refs
    whole, but a killed fetch leaves lock files that every later fetch stops at."""
    with journal.step("fetch", repo=repo.working_tree_dir, since=time.time() - 1):
        return source.ensure_ref(repo, origin, ref)


def build(project: Project, manifest: manifest_mod.Manifest, patches: list[series_mod.Patch],
          tree: git.Repo, report: Report, *, merge: bool = False,
          best_effort: bool = False) -> str | None:
    """Apply patches and overlay in ``tree`` (a worktree at ``report.ref_sha``).

    Fills ``report``; returns the resulting commit sha, or None when the
    result is not fit to publish (conflict, unaccepted drift, failed verify).
    With ``merge``, drifted overlay files are 3-way merged instead of refused.
    With ``best_effort`` (the rebase job), conflicting patches and files are
    left out and the rest is still committed and verified, so tests can run.
    """
    report.patches = apply_patches(tree, patches, report.ref_sha,
                                   git.resolve(tree, manifest.base))
    report.overlay = classify_overlay(tree, project, manifest, report.ref_sha, merge=merge)
    blocked = report.exit_code in (errors.CONFLICT, errors.DRIFT)
    if blocked and not best_effort:
        return None
    laid = manifest_mod.lay(tree, manifest_mod.to_lay(project.overlay_dir, report.overlay))
    sha = commit_overlay(tree, project, report, laid)
    if blocked:  # what applied is built for the tests, never verified (``VerifyResult``)
        return None
    report.verify = verify_change(tree, report.ref_sha, sha)
    return sha if report.verify.ok else None


def verify_change(repo: git.Repo, old: str, new: str) -> VerifyResult:
    """Verify the files that differ between commits ``old`` and ``new`` (the work tree's)."""
    touched = git.changed_paths(repo, old, new)
    before = git.read_files(repo, old, [path for path in touched if path.endswith(".py")])
    return verify(Path(repo.working_tree_dir), touched, before)


def apply_patches(tree: git.Repo, patches: list[series_mod.Patch], ref_sha: str,
                  base_sha: str | None = None) -> list[series_mod.PatchResult]:
    """Apply the series onto ``tree`` (see ``series.apply``: ``base_sha`` lets it find
    patches upstream took by patch-id), committer = the tool."""
    env = git.environ(**COMMITTER)
    with step(f"applying {len(patches)} patch(es) with git am --3way"):
        return series_mod.apply(tree, patches, env=env, ref_sha=ref_sha, base_sha=base_sha)


def classify_overlay(tree: git.Repo, project: Project, manifest: manifest_mod.Manifest,
                     ref_sha: str, *, merge: bool) -> list[manifest_mod.FileResult]:
    """Each overlay file's status at ``ref_sha``; drifted ones carry upstream's diff
    and, with ``merge``, the outcome of a 3-way merge."""
    results = manifest_mod.check(tree, ref_sha, manifest)
    files = {f.path: f for f in manifest.files}
    for i, result in enumerate(results):
        if result.status != manifest_mod.DRIFT:
            continue
        result.upstream_diff = manifest_mod.upstream_diff(tree, manifest.base, ref_sha, result.path)
        if merge:
            results[i] = manifest_mod.merge(tree, project.overlay_dir, files[result.path],
                                            ref_sha, result)
    return results


def commit_overlay(tree: git.Repo, project: Project, report: Report,
                   laid: dict[str, tuple[bytes, bool]]) -> str:
    """Commit exactly what ``lay`` wrote, dated like HEAD so the sha is reproducible."""
    when = git.run(tree, "show", "-s", "--format=%cI", "HEAD").strip()
    return manifest_mod.commit_laid(tree, laid, _overlay_message(project, report), env=git.environ(
        **IDENTITY, GIT_AUTHOR_DATE=when, GIT_COMMITTER_DATE=when))


def _overlay_message(project: Project, report: Report) -> str:
    lines = [f"k3-overlay: lay overlay files (vllm-k3-overlay {project.version})", ""]
    lines += [f"{f.status}: {f.path}" for f in report.overlay]
    return "\n".join(lines + ["", f"Overlay-Version: {project.version}", ""])


def refuse_merge_attributes(repo: git.Repo) -> None:
    """UsageError if the checkout's own ``info/attributes`` sets a ``merge`` or ``filter``
    attribute. No config can shut that file out, and the tool's temporary worktrees share
    it: a merge driver of the user's would run in the tool's 3-way merges and its output
    be published as the patched tree, ``merge=binary`` would turn a clean 3-way into a
    conflict."""
    path = Path(git.run(repo, "rev-parse", "--path-format=absolute", "--git-path",
                        "info/attributes").strip())
    for line in (read_regular(path) or b"").decode(errors="replace").splitlines():
        if line.strip().startswith("#"):
            continue
        names = {token.lstrip("-").split("=", 1)[0] for token in line.split()[1:]
                 if not token.startswith("!")}  # "!merge" is git's default again: harmless
        for name in sorted(names & {"merge", "filter"}):
            raise UsageError(f"{path} sets the {name!r} attribute ({line.strip()!r}): git would use "
                             f"it in the tool's own 3-way merges; remove the line, or give a fresh "
                             f"clone as --workdir")


def _publish(repo: git.Repo, branch: str, sha: str, report: Report) -> None:
    """Point ``branch`` at ``sha`` and check it out (a no-op when already there)."""
    if git.branch_tip(repo, branch) == sha and git.current_branch(repo) == branch:
        report.notes.append(f"branch {branch} already at {sha[:12]}: nothing to do")
        report.published = True
        return
    publish(repo, branch, sha, report.ref)
    report.published = True
