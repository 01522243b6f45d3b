"""Switching the user's checkout to the work branch: all of it or none of it, even when killed.

The one step that writes the user's files (``apply.py`` without ``--check``, and
``--rebase-to`` as it starts): point the work branch at the result, check it out,
and record in the checkout's config that apply.py wrote that tip (``TIP_KEY``; without
it every later run refuses the branch as someone else's).

- **A failure** part-way (a full disk, a read-only file system, a file the user changed
  while the run went on): whatever git wrote is undone (``_undo``), and only that: a
  path the switch changes whose content is now the new commit's goes back to the old
  one (or goes, where only the new commit has it); one that holds neither (the user's
  edit, or the file git was writing when it failed) is left as it is and named; HEAD,
  the branch and the record are put back; then the error, in one line.
- **A kill** (SIGKILL, power cut): the step was recorded ahead in the journal; the
  next run finishes it (``resume.finish``) where a normal run could make the switch,
  and otherwise stops with a normal run's refusal.
"""

from __future__ import annotations

import contextlib
import os
import time
from pathlib import Path

from . import git, journal
from .errors import UsageError
from .lock import held

SWITCH_LOCK = "k3overlay-switch.lock"  # in the repository's common git folder
TIP_KEY = "branch.{}.k3overlaytip"  # the sha we last wrote: proof we own the branch
BASE_KEY = "branch.{}.k3overlaybase"  # the upstream ref the branch is built on (for --export)


def record(repo: git.Repo, branch: str, ref: str) -> None:
    """Remember that we wrote ``branch`` (its tip now) on top of upstream ``ref``."""
    git.config_set(repo, TIP_KEY.format(branch), git.branch_tip(repo, branch))
    git.config_set(repo, BASE_KEY.format(branch), ref)


def publish(repo: git.Repo, branch: str, sha: str, ref: str) -> None:
    """Point ``branch`` at ``sha``, check it out and ``record`` it (the checkout is clean).

    Raises UsageError, changing nothing, where ``branch`` is checked out in another worktree
    (``refuse_checked_out_elsewhere``, checked again under the repository's ``switching``
    lock); GitError (exit 2, one line: git's reason) when it cannot, after putting the
    checkout back as it was: branches, HEAD, index, files, config. If even that fails,
    UsageError says so, and the journal keeps the step: the next run finishes it.
    """
    top = Path(repo.working_tree_dir)
    with switching(repo):
        # again, now that no run in another worktree of the repository can switch: one may
        # have checked the branch out there since this run's start-of-run check
        refuse_checked_out_elsewhere(repo, branch)
        _publish(repo, top, branch, sha, ref)


@contextlib.contextmanager
def switching(repo: git.Repo):
    """Hold the switch lock of ``repo``'s common git folder for the block (waiting for it): a
    check that a branch is checked out in no other worktree, and the switch to it, are one
    step for every worktree of a repository. (Each checkout's own claim keeps runs on one
    checkout apart; two runs on two worktrees of one repository both switched to the work
    branch, and the user's next commit in one showed as a staged revert in the other.)"""
    common = git.run(repo, "rev-parse", "--path-format=absolute", "--git-common-dir").strip()
    with held(Path(common) / SWITCH_LOCK):
        yield


def _publish(repo: git.Repo, top: Path, branch: str, sha: str, ref: str) -> None:
    before = _state(repo, branch, sha)
    with _recorded(repo, branch, sha, ref, before) as finished:
        try:
            git.set_branch(repo, branch, sha)
            journal.point("publish.switched")
            record(repo, branch, ref)
        except (git.GitError, OSError) as err:
            hint = _space_hint(top)  # before the undo frees it
            # git refused before writing anything (the user's change in its way): no file of
            # the checkout is git's to put back
            refused = isinstance(err, git.GitError) and "would be overwritten by checkout" in str(err)
            try:
                kept = _undo(repo, top, branch, before, files=not refused)
            except (git.GitError, OSError) as undo_err:
                raise UsageError(f"{_reason(err)}; putting {top} back failed too ({_reason(undo_err)}): "
                                 f"free the space, then run apply.py again, which finishes it") from err
            finished.append(True)
            if kept:  # never overwritten: the user's edits since the run started, most likely
                named = ", ".join(kept[:3]) + (" ..." if len(kept) > 3 else "")
                raise git.GitError(f"{err}; {top} was put back but for {len(kept)} file(s) that hold "
                                   f"neither its old nor its new content, left as they are (edits of "
                                   f"yours?): {named}") from err
            if hint and isinstance(err, git.GitError):  # git says only "unable to write file X"
                raise git.GitError(f"{err} ({hint}); {top} was left as it was") from err
            raise  # git's own words: the checkout is as it was
        finished.append(True)


def refuse_checked_out_elsewhere(repo: git.Repo, branch: str) -> None:
    """UsageError if ``branch`` is checked out in another worktree of ``repo``: moving it
    here would leave that worktree's index and files on the old commit (staged changes
    nobody made)."""
    here = Path(repo.working_tree_dir).resolve()
    # The main worktree is listed first, under a path git may get wrong where the git folder
    # is apart from the files (``clone --separate-git-dir``, a submodule: git 2.39 lists the
    # git folder): where this checkout is the main one, that entry is this checkout.
    common = Path(git.run(repo, "rev-parse", "--path-format=absolute", "--git-common-dir").strip()).resolve()
    main_here = Path(git.run(repo, "rev-parse", "--absolute-git-dir").strip()).resolve() == common
    tree, index = None, -1
    for line in git.run(repo, "worktree", "list", "--porcelain", "-z").split("\0"):
        if line.startswith("worktree "):
            tree, index = Path(line[len("worktree "):]), index + 1
        elif line == f"branch refs/heads/{branch}" and tree is not None and tree.resolve() != here \
                and not (index == 0 and main_here):
            where = (f"the main worktree of {common} (git does not record where its files are)"
                     if tree.resolve() == common else f"the worktree {tree}")
            run_there = "in that worktree" if tree.resolve() == common else f"with --workdir {tree}"
            raise UsageError(f"branch {branch} is checked out in {where}; moving it from here would "
                             f"leave that worktree on the old files; run apply.py {run_there}, or "
                             f"choose another with --branch")


@contextlib.contextmanager
def _recorded(repo: git.Repo, branch: str, sha: str, ref: str, before: dict):
    """The journal's ``publish`` step for the block: done only if the block says so."""
    current = journal._current
    entry = None
    if current is not None:
        entry = current.begin("publish", repo=repo.working_tree_dir, branch=branch, sha=sha, ref=ref,
                              old_head=before["head"], old_tip=before["tip"],
                              since=time.time() - 1)
    finished: list[bool] = []
    try:
        yield finished
    finally:
        if entry is not None and finished:
            current.done(entry)


def _space_hint(top: Path) -> str:
    """"the disk holding TOP has N KiB free" when it is (nearly) full, else ""."""
    try:
        info = os.statvfs(top)
    except OSError:
        return ""
    free = info.f_bavail * info.f_frsize
    return f"the disk holding {top} has {free // 1024} KiB free" if free < (1 << 20) else ""


def _reason(err: BaseException) -> str:
    return str(err) if isinstance(err, git.GitError) else (getattr(err, "strerror", None) or str(err))


def _state(repo: git.Repo, branch: str, sha: str) -> dict:
    """What ``_undo`` puts back: HEAD (symbolic or not), the branch's tip and record, and
    which paths only ``sha`` has that already exist in the work tree (ignored files: never
    removed), with the folders that exist above them."""
    head = git.resolve(repo, "HEAD")
    top = Path(repo.working_tree_dir)
    new_only, changed, old, new = [], [], {}, {}
    if head:
        changed = git.changed_paths(repo, head, sha)
        old = git.tree_entries(repo, head, changed)
        new = git.tree_entries(repo, sha, changed)
        new_only = [p for p in changed if p not in old]
    folders = {str(Path(p).parent) for p in new_only}
    folders |= {str(parent) for f in list(folders) for parent in Path(f).parents}
    return {"head": head, "symbolic": git.current_branch(repo), "tip": git.branch_tip(repo, branch),
            "record": [git.config_get(repo, key.format(branch)) for key in (TIP_KEY, BASE_KEY)],
            "new_only": new_only, "changed": changed, "old": old, "new": new, "new_sha": sha,
            "there": {p for p in new_only if os.path.lexists(top / p)},
            "folders": {f for f in folders if os.path.lexists(top / f)}}


def _undo(repo: git.Repo, top: Path, branch: str, before: dict, files: bool = True) -> list[str]:
    """Put back what ``before`` (``_state``) says: first remove the new files git wrote
    (freeing the space the restore may need), then HEAD, the branch, the files git changed
    with their index entries, and the record. Returns the paths the switch changes that
    hold neither content: left as they are (the run's start found the tree clean, so they
    are the user's edits since, or the one file git was writing when it failed). Without
    ``files`` (git refused the checkout before it wrote any) no file is touched."""
    entries = git.work_tree_entries(repo, before["changed"]) if before["head"] and files else {}
    blobs = {p: entries[p][1] for p in before["changed"] if p in entries}  # absent: nothing there
    wrote = {p for p, blob in blobs.items() if p in before["new"] and blob == before["new"][p][1]}
    odd = [p for p, blob in blobs.items() if p not in wrote and p not in before["there"]
           and (p not in before["old"] or blob != before["old"][p][1])]  # there before: never touched
    index = git.index_entries(repo, odd)  # a short file is git's only while the index is old
    short = [p for p in odd if index.get(p) == before["old"].get(p)]
    wrote |= git.cut_short(repo, short, before["new_sha"]) if short else set()
    kept = sorted(p for p in odd if p not in wrote)
    for path in sorted(before["new_only"], key=lambda p: -p.count("/")):
        if path in wrote and path not in before["there"] and os.path.lexists(top / path):
            with contextlib.suppress(IsADirectoryError):
                os.unlink(top / path)
    for folder in sorted({str(Path(p).parent) for p in before["new_only"]}, key=lambda f: -f.count("/")):
        for parent in [Path(folder), *Path(folder).parents]:
            if str(parent) in before["folders"] or str(parent) == ".":
                break
            with contextlib.suppress(OSError):
                os.rmdir(top / parent)  # only if empty: ours
    # Each write only where git changed something: on a read-only file system nothing did.
    if git.current_branch(repo) != before["symbolic"] or git.resolve(repo, "HEAD") != before["head"]:
        if before["symbolic"]:
            git.run(repo, "symbolic-ref", "HEAD", f"refs/heads/{before['symbolic']}")
        elif before["head"]:
            git.run(repo, "update-ref", "--no-deref", "HEAD", before["head"])
    if git.branch_tip(repo, branch) != before["tip"]:
        if before["tip"]:
            git.run(repo, "update-ref", f"refs/heads/{branch}", before["tip"])
        else:
            git.run(repo, "update-ref", "-d", f"refs/heads/{branch}")
    # Git's own writes only: what it wrote, or removed, of the paths the switch changes.
    # The index is written last by a checkout, so a failed one left it as it was.
    back = [p for p in before["old"] if p in wrote or (files and blobs.get(p) is None and p not in kept)]
    _per_path(repo, ("checkout", "--quiet", before["head"]), back)
    # files only the new commit has, removed above: their index entries
    _per_path(repo, ("rm", "--quiet", "--cached", "--ignore-unmatch"), sorted(wrote - set(before["old"])))
    # the files left as they are: their index entries only
    _per_path(repo, ("reset", "--quiet", before["head"]), kept)
    for key, value in zip((TIP_KEY, BASE_KEY), before["record"]):
        if git.config_get(repo, key.format(branch)) == value:
            continue
        if value is not None:
            git.config_set(repo, key.format(branch), value)
        else:
            git.run(repo, "config", "--local", "--unset", key.format(branch))
    return kept


def _per_path(repo: git.Repo, command: tuple[str, ...], paths: list[str]) -> None:
    """``git COMMAND -- PATHS`` for exactly these paths, a thousand a call (a switch of a
    whole release changes thousands; one command line cannot hold them all)."""
    for start in range(0, len(paths), 1000):
        git.run(repo, *command, "--", *git.literal(paths[start:start + 1000]))


def drop_stale_locks(repo: git.Repo, since: float) -> list[str]:
    """Remove the lock files a killed ``git fetch`` left in ``repo``'s git folder (made at or
    after ``since``, seconds since the epoch): those of refs (``refs/…/x.lock``,
    ``packed-refs.lock``) and ``shallow.lock``, which every later fetch stops at. Never
    ``index.lock``, ``HEAD.lock`` or ``config.lock``, which a fetch does not take and the
    user's own git (a ``git commit`` with its editor open) does; never in ``objects/`` or
    another worktree's folder. Returns the paths removed."""
    common = Path(git.run(repo, "rev-parse", "--path-format=absolute", "--git-common-dir").strip())
    found = [common / "packed-refs.lock", common / "shallow.lock", *common.glob("refs/**/*.lock")]
    removed = []
    for lock in found:
        with contextlib.suppress(OSError):
            info = lock.lstat()
            if lock.is_file() and not lock.is_symlink() and info.st_mtime >= since:
                lock.unlink()
                removed.append(str(lock.relative_to(common)))
    return removed
