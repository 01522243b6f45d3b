"""How the next run finishes or undoes each step a killed run left unfinished (``journal``).

Each function takes the facts the step recorded and returns the one-line note to
print, or None when nothing was left to do. Scratch folders are removed only where
their names are the tool's own (a journal is no licence to delete anything else).
"""

from __future__ import annotations

import contextlib
import functools
import os
import re
import shutil
from collections.abc import Callable, Collection
from pathlib import Path

from . import git, publish, resume
from . import journal as journal_
from .errors import OverlayError, UsageError
from .files import STAGING, TEMPORARY, digest, finish_renames
from .manifest import plain_path, undo_laid
from .regular import read_regular
from .source import FRESH_MARK

# The facts each step records, and their types (``journal``'s docstring). An entry
# without them (written by another version of the tool, or damaged) is set aside, never
# acted on: recovery must not fail on it, and a journal is no licence for anything else.
_NUMBER = (int, float)
FACTS: dict[str, dict[str, type | tuple[type, ...]]] = {
    "clone": {"scratch": str}, "fresh": {"repo": str}, "check": {"scratch": str},
    "worktree": {"repo": str, "parent": str}, "fetch": {"repo": str, "since": _NUMBER},
    "publish": {"repo": str, "branch": str, "sha": str, "ref": str, "since": _NUMBER,
                "old_head": (str, type(None)), "old_tip": (str, type(None))},
    "write": {"root": str, "folders": list},
    "rename": {"root": str, "moves": list, "remove": list},
    "lay": {"repo": str, "head": str, "files": list},
}


def readable(entry: dict) -> bool:
    """Whether ``entry`` holds every fact its step records, each of its type, and nothing
    that points outside what the step made (a write's folders are relative, without ``..``)."""
    facts = FACTS.get(entry.get("step"), {})
    if not facts or not all(isinstance(entry.get(k), t) and not isinstance(entry.get(k), bool)
                            for k, t in facts.items()):
        return False
    if entry["step"] == "write":
        token = entry.get("token")  # (absent from an older version's entry)
        ours = token is None or (isinstance(token, str) and re.fullmatch(r"[0-9a-f]{8}", token)
                                 and entry.get("staging") in (None, f"{STAGING}/{token}"))
        return bool(ours) and all(_plain(f) for f in entry["folders"])
    if entry["step"] == "rename":
        return all(isinstance(m, list) and len(m) == 4 and _plain(m[0]) and _plain(m[1])
                   and TEMPORARY.match(m[0].rpartition("/")[2]) and isinstance(m[3], str)
                   and isinstance(m[2], (str, type(None))) for m in entry["moves"]) \
            and all(isinstance(r, list) and len(r) == 2 and _plain(r[0])
                    and isinstance(r[1], (str, type(None))) for r in entry["remove"])
    if entry["step"] == "lay":  # (nothing in .git: a journal is no licence to touch git's files)
        return all(isinstance(f, list) and len(f) == 3 and plain_path(f[0]) and isinstance(f[1], str)
                   and isinstance(f[2], bool) for f in entry["files"])
    return True


def _plain(path: object) -> bool:
    """A path relative to the step's root that stays inside it."""
    return isinstance(path, str) and not os.path.isabs(path) and ".." not in Path(path).parts


def _scratch(facts: dict, marker: str, what: str) -> str | None:
    folder = Path(facts["scratch"])
    if marker not in folder.name or not folder.exists():
        return None
    shutil.rmtree(folder, ignore_errors=True)
    return f"its {what} {folder} was removed"


def clone(facts: dict) -> str | None:
    """A clone into a fresh work directory: its scratch folder beside it goes (one named
    ``.WORKDIR.k3-clone-…``, whatever prefix the entry says)."""
    return _scratch(facts, ".k3-clone-", "half-made clone")


def fresh(facts: dict) -> str | None:
    """A new work directory's clone the run had not yet switched: kept, never removed (another
    repository of the user's may borrow its objects: ``git clone --shared``), and taken up by
    the next run as its own clone (``abandoned``) while it is the run's own (its git folder
    holds the entry's ``mark``) and still as the clone left it; anything more is somebody's."""
    top, mark = Path(facts["repo"]), facts.get("mark")
    if not isinstance(mark, str) or not unswitched(top, mark):
        return None
    return f"its clone {top}, not yet switched to a branch, is kept for this run to take up"


def abandoned(top: Path) -> str | None:
    """The mark of the clone a killed run made for the new work directory ``top`` and never
    switched (``unswitched``, by the mark its git folder holds); None where ``top`` is no such
    clone. The next run takes it up as its own fresh clone, where before it was removed (with
    the objects a ``--shared`` clone of the user's borrowed from it) or, had it stayed,
    refused as "a repository with no commit yet"."""
    mark = read_regular(top / ".git" / FRESH_MARK)
    try:
        return mark.decode() if mark and unswitched(top, mark.decode()) else None
    except UnicodeDecodeError:
        return None


# The refs a clone of the release mirror and the run's fetches make (tags; a source's
# remote-tracking refs): one beside them (a remote of the user's fetched, a stash) is theirs.
_CLONES_REFS = ("refs/tags/", "refs/remotes/origin/")


def unswitched(top: Path, mark: str) -> bool:
    """Whether ``top`` is the fresh clone marked ``mark`` (``source.clone``), with no commit
    checked out, no ref but the clone's, no linked worktree (the user's commits on a detached
    HEAD there live in this ``.git``) and nothing beside its ``.git``."""
    if read_regular(top / ".git" / FRESH_MARK) != mark.encode():
        return False
    try:
        repo = git.open_repo(top)
        refs = git.run(repo, "for-each-ref", "--format=%(refname)").split()
        return os.listdir(top) == [".git"] and git.resolve(repo, "HEAD") is None \
            and all(ref.startswith(_CLONES_REFS) for ref in refs) \
            and not os.path.lexists(top / ".git" / "worktrees")
    except (git.GitError, OSError):
        return False


def check(facts: dict) -> str | None:
    """``--check``'s throwaway clone goes."""
    if not Path(facts["scratch"]).name.startswith("k3-check-"):
        return None
    return _scratch(facts, "k3-check-", "--check clone")


def worktree(facts: dict) -> str | None:
    """A temporary worktree (a scratch repository on the checkout's objects, or a linked
    worktree of an older run): its folder goes, and git's entry for a linked one."""
    parent = Path(facts["parent"])
    if not parent.name.startswith(git._WORKTREE_PREFIX):
        return None
    try:
        repo = git.open_repo(Path(facts["repo"]))
    except git.GitError:
        repo = None  # its repository is gone (a --check clone): only the folder is left
    if repo is not None and (parent / "tree" / ".git").is_file():  # a linked worktree (older runs)
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
    """Files laid into a tree: the temporary files it staged go (a rename is whole: each
    destination is the old file or the new one), and its staging folder if it had one.
    Only names with its own token are removed (a journal of an older version, without one:
    any the tool names so); a file of someone else's is never taken for one of them."""
    root, removed = Path(facts["root"]), 0
    token, staging = facts.get("token"), facts.get("staging")
    ours = re.compile(rf"^\..*\.{re.escape(token)}\.k3-tmp$") if token else TEMPORARY
    for folder in [*facts["folders"], *([staging] if staging else [])]:
        where = root / folder if folder else root
        try:
            if where.is_symlink() or not where.is_dir():
                continue
            entries = list(os.scandir(where))
        except OSError:  # a name too long, a folder gone: nothing of ours can be there
            continue
        for entry in entries:
            if ours.match(entry.name) and entry.is_file(follow_symlinks=False):
                os.unlink(entry.path)
                removed += 1
    if staging:
        for folder in (staging, staging.rpartition("/")[0]):  # each only if empty now
            with contextlib.suppress(OSError):
                os.rmdir(root / folder)
    return f"removed {removed} half-written file(s) it left in {root}" if removed else None


def rename(facts: dict) -> str | None:
    """A write's staged files being renamed into place (and an export's dropped patches
    removed): finished, so the tree is never left half old, half new, where every
    destination still holds its old or its new content; else left (the write's own step
    then removes the staged files)."""
    root = Path(facts["root"])
    finished = finish_renames(root, facts["moves"], facts["remove"])
    if finished is None:
        return None
    said = f"it was renaming {len(facts['moves'])} written file(s) into place in {root}"
    return f"{said}: finished" if finished else f"{said}: left as it is (changed since)"


def lay(facts: dict, overlay_dir: Path | None = None) -> str | None:
    """The overlay laid into a checkout by ``--rebase-to`` and not yet committed: put back
    (``manifest.undo_laid``), so that the run again lays and commits it. Only paths the
    project's ``overlay_dir`` holds, and a file the checkout's HEAD lacks only where it is
    that overlay file's content: a journal is no licence to remove a file of the user's."""
    top = Path(facts["repo"])
    try:
        repo = git.open_repo(top)
    except git.GitError:
        return None
    laid = {path: (sha, x) for path, sha, x in facts["files"]}
    said = f"it was laying the overlay into {top}, not yet committed"
    if not _overlay_files(repo, facts["head"], laid, overlay_dir):
        return f"{said}: left as it is (not this project's overlay files)"
    back = undo_laid(repo, facts["head"], laid)
    if back is None:
        return f"{said}: left as it is (changed since)"
    return f"{said}: put back ({back} file(s) as {facts['head'][:12]} has them)" if back else None


def _overlay_files(repo: git.Repo, head: str, laid: dict[str, tuple[str, bool]],
                   overlay_dir: Path | None) -> bool:
    """Whether each path of a lay entry is a file under ``overlay_dir`` (the project's), and
    each one commit ``head`` lacks (an added file, which undoing removes) holds its content."""
    if overlay_dir is None or git.resolve(repo, head) is None:
        return False
    ours = {path: digest(overlay_dir, path) for path in laid}
    if any(found in (None, "other") for found in ours.values()):
        return False
    at_head = git.tree_entries(repo, head, sorted(laid))
    return all(path in at_head or ours[path] == sha for path, (sha, _x) in laid.items())


HANDLERS = {"clone": clone, "fresh": fresh, "check": check, "worktree": worktree, "fetch": fetch,
            "publish": resume.finish, "write": write, "rename": rename, "lay": lay}


# The fact naming the tree each step writes in, for the steps that write in the work directory.
_WRITES_IN = {"fresh": "repo", "fetch": "repo", "publish": "repo", "lay": "repo", "write": "root",
              "rename": "root"}


def _elsewhere(entry: dict, workdir: str) -> str | None:
    """The other checkout ``entry`` names (its work directory, or the tree a step writes in:
    a journal is no licence to write in another folder), or None if it is ``workdir``'s own."""
    if entry["workdir"] != workdir:
        return entry["workdir"]
    repo = entry.get(_WRITES_IN.get(entry.get("step"), ""))
    if isinstance(repo, str) and os.path.realpath(repo) != os.path.realpath(workdir):
        return repo
    return None


_SCRATCH = git._WORKTREE_PREFIX


def _in_scratch(entry: dict, entries: list[dict], workdir: str) -> bool:
    """Whether ``entry`` wrote in a temporary worktree that a ``worktree`` step of the same
    work directory's journal (``entries``) made: its recovery removes that folder whole."""
    tree = entry.get(_WRITES_IN.get(entry.get("step"), ""))
    if not isinstance(tree, str) or entry.get("workdir") != workdir:
        return False
    return any(e.get("step") == "worktree" and e.get("workdir") == workdir
               and isinstance(e.get("parent"), str) and Path(e["parent"]).name.startswith(_SCRATCH)
               and Path(os.path.realpath(tree)).is_relative_to(os.path.realpath(e["parent"]))
               for e in entries)  # fmt: skip


def recover(journal: journal_.Journal, say: Callable[[str], None], *, act: bool = True,
            overlay_dir: Path | None = None, steps: Collection[str] = tuple(HANDLERS)) -> None:
    """Finish or undo every step a killed run left unfinished on ``journal.workdir`` (newest
    first), then empty the journal. Steps naming another work directory (a copied or
    restored cache) are left alone. With ``act`` False (``--check``) nothing is done: what
    is left is said, and the journal kept for the next run. Only ``steps`` are acted on (the
    project's journal: an export's ``write`` and ``rename``); the rest is left alone as
    unreadable. Raises what a recovery raises
    (UsageError: the user must decide; ``resume.LeftAlone`` after saying what was left)."""
    unfinished = journal.unfinished()
    # Steps that wrote in one of the run's own scratch trees need nothing: the tree goes whole.
    unfinished = [e for e in unfinished if not _in_scratch(e, unfinished, journal.workdir)]
    named = [e for e in unfinished if isinstance(e.get("workdir"), str)]
    mine = [e for e in named if _elsewhere(e, journal.workdir) is None]
    entries = [e for e in mine if e.get("step") in steps and readable(e)]
    # Scratch trees go first: what was written inside one then needs nothing more.
    entries.sort(key=lambda e: e["step"] not in journal_.SCRATCH)
    notes: list[str] = []
    if not act:  # --check: only the tool's scratch trees outside the checkout go
        scratch = [e for e in entries if e["step"] in journal_.SCRATCH]
        notes += [note for note in (HANDLERS[e["step"]](e) for e in scratch) if note]
        for entry in scratch:
            journal.settle(entry)
        left = [e["step"] for e in entries if e["step"] not in journal_.SCRATCH]
        if left:
            notes.append(f"it left {', '.join(left)} unfinished in {journal.workdir}: --check "
                         f"leaves that as it is (a run without --check finishes it)")
        unread = len(unfinished) - len(entries)  # another version's, or another checkout's
        if unread:
            notes.append(f"{unread} step(s) of its journal {journal.path} were not read (another "
                         f"version of the tool, or another checkout): --check keeps the journal")
        if notes:
            say(f"note: the last run was killed; {'; '.join(notes)}")
        if not left and not unread:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(journal.path)
        return
    try:
        handlers = {**HANDLERS, "lay": functools.partial(lay, overlay_dir=overlay_dir)}
        notes += [note for note in (handlers[e["step"]](e) for e in entries) if note]
    except resume.LeftAlone as err:
        say(f"note: the last run was killed; {'; '.join([*notes, err.note])}")
        raise  # the normal run's refusal; the journal is kept
    except UsageError:
        raise  # the user must decide (it says so); the journal is kept
    except OverlayError as err:  # git failed (a full disk?): the journal is kept, the next run tries again
        raise type(err)(f"the last run was killed, and finishing its work failed: {err}") from err
    if len(named) > len(mine):
        others = sorted(filter(None, (_elsewhere(e, journal.workdir) for e in named)))
        notes.append(f"{len(named) - len(mine)} step(s) of its journal {journal.path} name another "
                     f"checkout ({others[0]}: a copied cache?) and were left alone")
    if len(entries) < len(unfinished) - (len(named) - len(mine)):
        notes.append(f"{len(unfinished) - (len(named) - len(mine)) - len(entries)} step(s) of its "
                     f"journal {journal.path} could not be read (another version of the tool?) "
                     f"and were left alone")
    if notes:
        say(f"note: the last run was killed; {'; '.join(notes)}")
    with contextlib.suppress(FileNotFoundError):
        os.unlink(journal.path)
