"""Finishing a switch a killed run began (the journal's ``publish`` step), never with more
licence than a normal run has.

Between the kill and the next run the user may have edited, staged, committed,
switched branches or stashed. The switch is finished only where a normal run would be
allowed to make it: no git lock file is there (the tool deletes none it did not take),
no am/rebase/merge is in progress, the work branch is not checked out in another
worktree and holds no commit apply.py did not make, and every path that differs from a
clean checkout is one the switch writes and holds either the old or the new content
(index and work tree). Anything else stops the run with the normal run's own refusal,
after a note of what the killed run left (``LeftAlone``); a file the switch writes that
holds neither is named.

No file is taken for the one git was writing when the run was killed, not even the start
(or none) of the new content: the journal's ``publish`` entry is written before git's
checkout starts, so it cannot tell a kill before git wrote anything (the user then
emptied the file, or cut it to its first lines) from one in the middle of git's write,
and forcing the checkout over the user's edit loses it. A kill inside git's checkout
leaves git's ``index.lock`` (the run stops at it first); once the user removed that, the
cut-short file is refused like an edit: ``git checkout -- FILE`` drops it, a commit or a
stash keeps it, and the switch goes on.
"""

from __future__ import annotations

import os
from pathlib import Path

from . import git, safety
from .errors import UsageError
from .publish import record, switching


class LeftAlone(UsageError):
    """A normal run's refusal (its message, exit 2), and ``note``: what the killed run left."""

    def __init__(self, refusal: UsageError, note: str) -> None:
        super().__init__(str(refusal))
        self.note = note


def finish(facts: dict) -> str | None:
    """Finish the switch ``facts`` (a ``publish`` entry) record; the note to print, or None if
    there is nothing to finish. Raises LeftAlone where a normal run would refuse the checkout."""
    top = Path(facts["repo"])
    try:
        repo = git.open_repo(top)
    except git.GitError:
        return None  # the checkout is gone: nothing to finish
    branch, sha = facts["branch"], facts["sha"]
    if git.resolve(repo, sha) is None:
        return None
    said = f"it was switching {top} to {branch} ({sha[:12]})"
    if git.branch_tip(repo, branch) is None and _left_since(repo, branch, facts["since"]):
        return f"{said}: the user left {branch} and deleted it since; nothing of it is left to finish"
    with switching(repo):  # (the check and the switch one step in every worktree of the repository)
        try:
            switch = _may_switch(repo, facts)
        except UsageError as err:
            raise LeftAlone(err, f"{said}: left as it is") from err
        if switch and (git.current_branch(repo) != branch or git.branch_tip(repo, branch) != sha
                       or git.is_dirty(repo)):
            git.run(repo, "checkout", "--quiet", "--force", "--no-overwrite-ignore", "-B", branch, sha)
    if not switch and git.branch_tip(repo, branch) != sha:
        if git.resolve(repo, "HEAD") is None:  # (a new workdir's clone: the run taking it up switches it)
            return f"{said}: its new clone had nothing checked out yet; it is taken up as it is"
        return f"{said}: HEAD was moved since; nothing of it is left to finish"
    record(repo, branch, facts["ref"])  # the tip is the one it wrote (the journal says so)
    if not switch:
        return f"{said}: HEAD was moved since; the branch it wrote was recorded, not checked out"
    return f"{said}: finished"


def _left_since(repo: git.Repo, branch: str, since: float) -> bool:
    """Whether HEAD's reflog records the killed run's switch to ``branch`` (at ``since`` or
    later) and, after it, a move away from ``branch``: the user undid the switch by hand
    (finishing it again would bring back a branch they deleted). The user's own entry is
    known by its order, not its date (their git may run with a fixed date). False where
    there is no reflog (``core.logAllRefUpdates`` off): then nobody can tell."""
    ok, out = git.attempt(repo, "reflog", "show", "--date=unix", "--format=%gd %gs", "HEAD", "--")
    moves = []  # newest first: (stamp, subject)
    for line in out.splitlines() if ok else []:
        selector, _, subject = line.partition(" ")
        stamp = selector.rpartition("{")[2].rstrip("}")
        moves.append((int(stamp) if stamp.isdigit() else -1, subject))
    switched = next((i for i, (stamp, subject) in enumerate(moves) if stamp >= int(since)
                     and subject.startswith("checkout: moving from ") and subject.endswith(f" to {branch}")),
                    None)
    return switched is not None and any(subject.startswith(f"checkout: moving from {branch} to ")
                                        for _, subject in moves[:switched])


def _may_switch(repo: git.Repo, facts: dict) -> bool:
    """Whether the switch may be finished (HEAD is where the switch left it: before or
    after); UsageError, the normal run's, where the checkout must not be touched."""
    branch, sha, old_head = facts["branch"], facts["sha"], facts["old_head"]
    safety.refuse_git_locks(repo, branch)
    safety.refuse_operation(repo)
    safety.refuse_checked_out_elsewhere(repo, branch)
    safety.refuse_foreign_branch(repo, branch, allowed=(sha,))
    head = git.resolve(repo, "HEAD")
    ours = git.current_branch(repo) == branch or (old_head is not None and head == old_head)
    writes = set(git.changed_paths(repo, old_head, sha)) if ours and old_head else set()
    status = git.run(repo, "status", "--porcelain", "-z", "--no-renames", "--untracked-files=all",
                     "--ignored=matching")
    entries = [entry for entry in status.split("\0") if len(entry) > 3]
    changed = sorted({entry[3:] for entry in entries if not entry.startswith("!! ")})
    # The finishing checkout is forced (over the files git wrote whole), and a forced checkout
    # also overwrites files git ignores, which status never shows: one in the switch's way
    # counts as a change, one on its way (a folder where a file goes) refuses.
    in_way, blocking = _ignored_in_the_way(repo, [e[3:] for e in entries if e.startswith("!! ")], writes)
    blocking += _neither_old_nor_new(repo, old_head, sha, in_way)  # not git's own write
    if blocking:
        named = ", ".join(sorted(blocking)[:3]) + (" ..." if len(blocking) > 3 else "")
        raise UsageError(f"{repo.working_tree_dir}: files git ignores are where {branch} has files, "
                         f"and a checkout would overwrite them: {named}; move them away first")
    mine = _neither_old_nor_new(repo, old_head, sha, [path for path in changed if path in writes])
    if mine:  # what the forced checkout would overwrite: named (a file git cut short is one too)
        named = ", ".join(mine[:3]) + (" ..." if len(mine) > 3 else "")
        raise UsageError(f"{safety.dirty(repo)}: the killed switch to {branch} would overwrite {named}, "
                         f"which {'holds' if len(mine) == 1 else 'hold'} neither its old nor its new "
                         f"content (an edit of yours, or the file git was writing when it was killed: "
                         f"`git checkout -- FILE` drops that)")
    if any(path not in writes for path in changed):
        raise safety.dirty(repo)
    return ours


def _ignored_in_the_way(repo: git.Repo, ignored: list[str], writes: set[str]) -> tuple[list[str], list[str]]:
    """Of the ignored paths status lists (a wholly ignored folder as ``dir/``), those a checkout
    writing ``writes`` overwrites: (written paths to hold the old or the new content, like any
    change; paths it would remove: a file where a folder goes, a folder where a file goes, and
    inside an ignored folder anything but a folder on the way to a written file)."""
    top = Path(repo.working_tree_dir)
    folders = {str(parent) for w in writes for parent in Path(w).parents}  # (every folder on the way)
    in_way, blocking = set(), set()
    for entry in ignored:
        path = entry.rstrip("/")
        if path in writes:
            in_way.add(path)
        elif any(str(parent) in writes for parent in Path(path).parents):
            blocking.add(path)  # inside a folder where the switch writes a file
        elif path in folders and not (entry.endswith("/") and _is_folder(top / path)):
            blocking.add(path)  # a file (or a link) where the switch makes a folder
        elif path in folders:  # an ignored folder the switch writes files in: look at each
            for w in sorted(w for w in writes if w.startswith(path + "/")):
                on_way = [str(p) for p in reversed(Path(w).relative_to(path).parents) if str(p) != "."]
                stop = next((f"{path}/{p}" for p in on_way if os.path.lexists(top / path / p)
                             and not _is_folder(top / path / p)), None)
                if stop:
                    blocking.add(stop)  # a file or link of the user's where a folder goes
                elif os.path.lexists(top / w):
                    in_way.add(w)
    return sorted(in_way), sorted(blocking)


def _is_folder(path: Path) -> bool:
    return path.is_dir() and not path.is_symlink()


def _neither_old_nor_new(repo: git.Repo, old: str | None, new: str, paths: list[str]) -> list[str]:
    """Those of ``paths`` that do not hold, in the index and in the work tree, what commit
    ``old`` or commit ``new`` has there (mode and content; absent where the commit has none).

    A file holding only the start of ``new``'s (or nothing) is one of them: the journal
    cannot tell it from the user's edit (emptied, cut to its first lines), see the module's
    docstring, and it is never overwritten."""
    if not paths:
        return []
    trees = [git.tree_entries(repo, old, paths) if old else {}, git.tree_entries(repo, new, paths)]
    index = git.index_entries(repo, paths)
    work = git.work_tree_entries(repo, paths)
    return [p for p in paths if index.get(p) not in {t.get(p) for t in trees}
            or work.get(p) not in {t.get(p) for t in trees}]
