"""What a checkout must be before the tool writes to it: each check a one-line refusal.

One set of checks for every step that writes the user's checkout: a normal run
(``refuse_unsafe``, before any work) and the next run finishing a killed switch
(``resume``), which must never be stronger than a normal run. Each refusal is a
UsageError (exit 2) saying what to do.
"""

from __future__ import annotations

from pathlib import Path

from . import git
from .errors import UsageError
from .project import IDENTITY
from .publish import BASE_KEY, TIP_KEY, refuse_checked_out_elsewhere  # noqa: F401  (a check of the switch's)


def refuse_unsafe(repo: git.Repo, branch: str) -> None:
    """Raise UsageError (one line, what to do) if touching this checkout could lose work."""
    refuse_operation(repo)
    refuse_dirty(repo)
    head = git.resolve(repo, "HEAD")
    if head and git.current_branch(repo) is None and not git.reachable_from_refs(repo, head):
        raise UsageError(f"HEAD is detached at {head}, which no branch or tag holds: switching "
                         f"away would leave it only in the reflog; `git branch NAME {head[:12]}` "
                         f"first (or use --check)")
    refuse_git_locks(repo, branch)
    refuse_checked_out_elsewhere(repo, branch)
    refuse_foreign_branch(repo, branch)


def refuse_operation(repo: git.Repo) -> None:
    """UsageError if an am/rebase/merge/cherry-pick/revert/bisect is unfinished in ``repo``."""
    op = git.operation_in_progress(repo)
    if op:
        raise UsageError(f"{repo.working_tree_dir} has a {op} in progress; finish or abort it first")


def dirty(repo: git.Repo) -> UsageError:
    """The refusal of a checkout with uncommitted changes (staged, unstaged or untracked)."""
    return UsageError(f"{repo.working_tree_dir} has uncommitted changes; commit or stash them "
                      f"first (or use --check)")


def refuse_dirty(repo: git.Repo) -> None:
    if git.is_dirty(repo):
        raise dirty(repo)


def refuse_foreign_branch(repo: git.Repo, branch: str, allowed: tuple[str, ...] = ()) -> None:
    """UsageError if ``branch`` exists and apply.py may not rewrite it: it did not create it
    (no record), or its tip is not the one recorded (nor one of ``allowed``: what a killed
    switch wrote). The record moves only with what apply.py wrote itself, or once
    ``--export`` saved the branch into patches/ (a ``--rebase-to`` holding the
    maintainer's resolutions does not record it: ``foreign_commits``)."""
    tip = git.branch_tip(repo, branch)
    if tip is None or tip in allowed:
        return
    ours = git.config_get(repo, TIP_KEY.format(branch))
    if ours is None:
        raise UsageError(f"branch {branch} exists and was not created by apply.py; "
                         f"choose another with --branch")
    if ours != tip:
        raise UsageError(f"branch {branch} has commits apply.py did not write (tip {tip[:12]}), "
                         f"and a branch someone added commits to is never rewritten: keep them "
                         f"with apply.py --export (a --rebase-to's resolutions), move them to "
                         f"another branch, or choose another with --branch")


def foreign_commits(repo: git.Repo, branch: str, tip: str) -> list[str]:
    """Commits on ``branch`` (up to ``tip``) that no other branch, tag or remote branch holds
    (nor the upstream ref it was built on, ``BASE_KEY``) and that apply.py did not commit
    (its committer identity is fixed, ``IDENTITY``), newest first: a maintainer's ``git am
    --continue`` or ``git commit`` during ``--rebase-to``."""
    ref = git.config_get(repo, BASE_KEY.format(branch))
    base = git.resolve(repo, ref) if ref else None
    out = git.run(repo, "rev-list", "--format=%H %ce", "--no-commit-header", tip, "--not",
                  f"--exclude={branch}", "--branches", "--tags", "--remotes", *filter(None, [base]))
    email = IDENTITY["GIT_COMMITTER_EMAIL"]
    return [line.split(" ", 1)[0] for line in out.splitlines()
            if " " in line and line.split(" ", 1)[1] != email]


def refuse_git_locks(repo: git.Repo, branch: str) -> None:
    """UsageError if a lock file git takes to switch ``branch`` or record it is there
    (``index.lock``, ``HEAD.lock``, the branch's, ``config.lock``): a git command runs there
    (the user's ``git commit`` with its editor open, a ``git config``), or a killed one left
    it (the tool's own record of the branch is a ``git config``). The tool never deletes one
    it did not take."""
    paths = ("index.lock", "HEAD.lock", f"refs/heads/{branch}.lock", "config.lock")
    for name in paths:
        where = Path(git.run(repo, "rev-parse", "--path-format=absolute", "--git-path", name).strip())
        if where.exists() or where.is_symlink():
            raise UsageError(f"{where} exists: a git command is running in {repo.working_tree_dir} "
                             f"(or one was killed); let it finish, or remove the file if no git "
                             f"runs there, then run again")
