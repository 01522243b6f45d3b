"""How the next run finishes or undoes each step a killed run left unfinished (``journal``).

Each function takes the facts the step recorded and returns the one-line note to
print, or None when nothing was left to do. Scratch folders are removed only where
their names are the tool's own (a journal is no licence to delete anything else).
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

from . import git, publish
from .files import TEMPORARY


def _scratch(facts: dict, prefix: str, what: str) -> str | None:
    folder = Path(facts["scratch"])
    if not folder.name.startswith(prefix) or not folder.exists():
        return None
    shutil.rmtree(folder, ignore_errors=True)
    return f"its {what} {folder} was removed"


def clone(facts: dict) -> str | None:
    """A clone into a fresh work directory: its scratch folder beside it goes."""
    return _scratch(facts, facts.get("prefix", ".k3-clone-"), "half-made clone")


def check(facts: dict) -> str | None:
    """``--check``'s throwaway clone goes."""
    return _scratch(facts, "k3-check-", "--check clone")


def worktree(facts: dict) -> str | None:
    """A temporary worktree: git's entry for it and its folder go."""
    parent = Path(facts["parent"])
    if not parent.name.startswith(git._WORKTREE_PREFIX):
        return None
    try:
        repo = git.open_repo(Path(facts["repo"]))
    except git.GitError:
        repo = None  # its repository is gone (a --check clone): only the folder is left
    if repo is not None:
        git._remove_worktree(repo, parent)
    elif parent.exists():
        shutil.rmtree(parent, ignore_errors=True)
    else:
        return None
    return f"its temporary worktree {parent / 'tree'} was removed"


def fetch(facts: dict) -> str | None:
    """A fetch into the checkout: lock files its killed git left are removed (git's own
    writes are atomic: a ref is moved whole or not at all)."""
    try:
        repo = git.open_repo(Path(facts["repo"]))
    except git.GitError:
        return None
    removed = publish.drop_stale_locks(repo, facts["since"])
    return f"it was fetching into {facts['repo']}: removed {', '.join(removed)}" if removed else None


def write(facts: dict) -> str | None:
    """Files laid into a tree: the temporary files staged beside their destinations go (a
    rename is whole: each destination is the old file or the new one)."""
    root, removed = Path(facts["root"]), 0
    for folder in facts["folders"]:
        where = root / folder if folder else root
        if where.is_symlink() or not where.is_dir():
            continue
        for entry in os.scandir(where):
            if TEMPORARY.match(entry.name) and entry.is_file(follow_symlinks=False):
                os.unlink(entry.path)
                removed += 1
    return f"removed {removed} half-written file(s) it left in {root}" if removed else None


HANDLERS = {"clone": clone, "check": check, "worktree": worktree, "fetch": fetch,
            "publish": publish.finish, "write": write}
