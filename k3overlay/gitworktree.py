"""The state of a work tree (dirty, an operation in progress, untracked files in the way)
and the temporary worktrees the tool builds in."""

from __future__ import annotations

import contextlib
import fcntl
import os
import shutil
import stat
import tempfile
from collections.abc import Iterator
from pathlib import Path

from . import journal
from .errors import UsageError
from .files import read_regular
from .gitproc import (GitError, Repo, _cwd, _execute, _text, _z, attempt, checkouts_eol, first_line,
                      literal, run)
from .interrupts import deferred
from .lock import flock


def operation_in_progress(repo: Repo) -> str | None:
    """Name of an unfinished am/rebase/merge/cherry-pick/revert/bisect in ``repo``, or None."""
    markers = {
        "rebase-apply/applying": "git am",
        "rebase-apply": "git rebase",
        "rebase-merge": "git rebase",
        "MERGE_HEAD": "git merge",
        "CHERRY_PICK_HEAD": "git cherry-pick",
        "REVERT_HEAD": "git revert",
        "BISECT_LOG": "git bisect",
        "sequencer": "git cherry-pick/revert sequence",
    }
    for marker, name in markers.items():
        path = run(repo, "rev-parse", "--git-path", marker).strip()
        if (Path(repo.working_tree_dir) / path).exists():
            return name
    return None


def untracked_in_the_way(repo: Repo, paths: list[str]) -> list[str]:
    """Those of ``paths`` where something git does not track sits in the work tree (a file,
    link or folder; with a clean status, one git ignores): what a checkout, ``git am
    --3way`` or laying a file there would destroy."""
    top = Path(repo.working_tree_dir)
    present = [path for path in paths if os.path.lexists(top / path)]
    tracked = set(_z(run(repo, "ls-files", "-z", "--", *literal(present)))) if present else set()
    return [path for path in present
            if path not in tracked and not any(t.startswith(path + "/") for t in tracked)]


def work_tree_entries(repo: Repo, paths: list[str]) -> dict[str, tuple[str, str]]:
    """``path: (mode, blob sha)`` of what the work tree holds at each of ``paths`` (a file as
    ``git add`` would store it, its filters applied; a link's target); absent if nothing is
    there, ``("other", "")`` for a folder or anything else. What tells a file git wrote (the
    old or the new commit's entry) from one somebody else changed.

    A file is hashed as it is (the pinned line-ending settings), except where the checkout's
    own settings (``checkouts_eol``: ``core.autocrlf=true``) convert it into the blob its index
    holds there: its own git wrote that blob with CRLF, and its `git status` calls it
    unchanged. Not simply converted: git converts a file on the way in only where the index's
    blob holds no CR ("safer autocrlf"), and ``hash-object`` reads no index, so a file
    committed with CRLF (vLLM has some), written as it is, would hash as another blob."""
    top = Path(repo.working_tree_dir)
    found: dict[str, tuple[str, str]] = {}
    files = []
    for path in paths:
        try:
            info = os.lstat(top / path)
        except (FileNotFoundError, NotADirectoryError):  # (a file where a folder on its way was)
            continue
        if stat.S_ISLNK(info.st_mode):
            target = os.fsencode(os.readlink(top / path))
            blob = _execute(["hash-object", "--no-filters", "--stdin"], cwd=top, stdin=target)[1]
            found[path] = ("120000", _text(blob).strip())
        elif stat.S_ISREG(info.st_mode):
            files.append(path)
            found[path] = ("100755" if info.st_mode & 0o111 else "100644", "")
        else:
            found[path] = ("other", "")
    if files:
        blobs = _hashes(top, files, eol=False)
        if checkouts_eol(top):
            index = index_entries(repo, files)
            converted = _hashes(top, files, eol=True)
            blobs = {p: converted[p] if converted.get(p) and converted[p] == index.get(p, ("", ""))[1]
                     else blob for p, blob in blobs.items()}
        for path, blob in blobs.items():
            found[path] = (found[path][0], blob)
    return found


def _hashes(top: Path, files: list[str], eol: bool) -> dict[str, str]:
    """``path: blob sha`` of each of ``files`` (regular files under ``top``) as ``hash-object``
    stores it, with the pinned line-ending settings or (``eol``) the checkout's own; none
    where git fails."""
    status, out, _ = _execute(["hash-object", "--stdin-paths"], cwd=top, eol=eol,
                              stdin="".join(f"{p}\n" for p in files).encode(errors="surrogateescape"))
    return dict(zip(files, _text(out).split())) if status == 0 else {}


def index_entries(repo: Repo, paths: list[str]) -> dict[str, tuple[str, str]]:
    """``path: (mode, blob sha)`` of the index's entry at each of ``paths`` that has one
    (``("conflict", "")`` for an unmerged one)."""
    index: dict[str, tuple[str, str]] = {}
    if not paths:
        return index
    for entry in _z(run(repo, "ls-files", "-s", "-z", "--", *literal(paths))):
        info, path = entry.split("\t", 1)
        mode, blob, stage = info.split(" ")
        index[path] = (mode, blob) if stage == "0" and path not in index else ("conflict", "")
    return index


def cut_short(repo: Repo, paths: list[str], rev: str) -> set[str]:
    """Those of ``paths`` whose work-tree file is a prefix (maybe empty) of the file commit
    ``rev`` has there: the file git was writing when the disk filled up.

    Only for a run's own checkout that git began and that failed (``publish._undo``): git
    checked the files it changes were unchanged before it wrote any, so the run saw git
    write. Never for a killed run's switch (``resume``): its journal entry is written before
    git starts, and an emptied file or the first lines of the new content are as likely the
    user's edit since, which a forced checkout would destroy. Callers ask only where the
    index still holds the old entry: git writes the index once, after every file, so once it
    holds the new one a short file is somebody's edit."""
    from .gitobjects import read_files

    top = Path(repo.working_tree_dir)
    cut = set()
    for path, data in read_files(repo, rev, paths).items():
        with contextlib.suppress(OSError):
            info = os.lstat(top / path)
            if stat.S_ISREG(info.st_mode) and info.st_size <= len(data) \
                    and data.startswith((top / path).read_bytes()):
                cut.add(path)
    return cut


def is_dirty(repo: Repo) -> bool:
    """True if ``repo`` has staged, unstaged or untracked (not ignored) changes, as its own
    `git status` says for line endings (``status`` takes the checkout's own ``core.autocrlf``,
    ``core.eol``, ``core.safecrlf``: gitproc's ``_EOL_VERBS``). Raises GitError."""
    return bool(run(repo, "status", "--porcelain", "--untracked-files=normal").strip())


_WORKTREE_PREFIX = "k3-worktree-"


# Written as the scratch repository's own info/attributes, which beats every .gitattributes
# of the tree: REF's attributes never choose how the series or the overlay is merged
# (merge=union would take both sides of a conflict), filtered, converted (text, eol, ident,
# working-tree-encoding) or diffed in the tool's own work. "!" is "unspecified", git's
# default, also for an attribute a macro of REF's sets.
NEUTRAL_ATTRIBUTES = ("* !merge !filter !diff !text !eol !crlf !ident !working-tree-encoding "
                      "!export-ignore !export-subst !delta !whitespace\n")


@contextlib.contextmanager
def temporary_worktree(repo: Repo, sha: str) -> Iterator[Repo]:
    """A scratch repository with ``sha`` checked out (detached), removed on exit.

    It shares ``repo``'s object store (its ``objects`` is a link to it, as
    git-new-workdir makes one), so the commits made there are ``repo``'s to publish,
    and starts with a copy of its refs, but has git folder, refs, index and
    info/attributes of its own (``NEUTRAL_ATTRIBUTES``):
    nothing of ``repo``'s (refs, config, worktree list) is touched, and no attribute
    of the tree decides a merge or a conversion.

    It lives in a fresh temporary folder holding ``owner.lock``, which this process
    keeps locked while it exists: a leftover of a run that was killed (lock free) is
    removed first, one of a run still working (lock held) is left alone, and so is a
    folder without the lock (never ours). Removal is not cut short by Ctrl-C (it is
    finished, then the interrupt goes on).
    """
    _remove_stale_worktrees(repo)
    _remove_stale_scratch(Path(tempfile.gettempdir()))
    parent = Path(tempfile.mkdtemp(prefix=_WORKTREE_PREFIX))
    owner = os.open(parent / "owner.lock", os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
    try:
        flock(owner, parent / "owner.lock", fcntl.LOCK_EX, moved_by="TMPDIR")
        with journal.step("worktree", repo=_cwd(repo), parent=str(parent)):  # for a killed run's
            try:
                scratch = _scratch(repo, parent / "tree", sha)
                journal.point("worktree.added")
                yield scratch
            finally:
                with deferred():
                    shutil.rmtree(parent, ignore_errors=True)  # the objects link is unlinked
    finally:
        with deferred():
            shutil.rmtree(parent, ignore_errors=True)  # the journal could not be written
            os.close(owner)


def _scratch(repo: Repo, tree: Path, sha: str) -> Repo:
    """``tree``: a new repository on ``repo``'s objects (and its shallow list), with a copy of
    its refs, ``sha`` checked out."""
    common = Path(run(repo, "rev-parse", "--path-format=absolute", "--git-common-dir").strip())
    commit = run(repo, "rev-parse", "--verify", "--end-of-options", f"{sha}^{{commit}}").strip()
    _refuse_unwritable_objects(common / "objects")
    status, _, err = _execute(["init", "--quiet", "--", str(tree)], cwd=tree.parent)
    if status != 0:
        raise GitError(f"git init failed: {first_line(_text(err))}")
    git_dir = tree / ".git"
    shutil.rmtree(git_dir / "objects")
    os.symlink(common / "objects", git_dir / "objects", target_is_directory=True)
    if (common / "shallow").is_file():
        shutil.copyfile(common / "shallow", git_dir / "shallow")
    # repo's refs, as a linked worktree would see them (tags, branches, remote branches), copied
    (git_dir / "packed-refs").write_text(run(repo, "for-each-ref", "--format=%(objectname) %(refname)"))
    (git_dir / "info").mkdir(exist_ok=True)
    (git_dir / "info" / "attributes").write_text(NEUTRAL_ATTRIBUTES)
    scratch = Repo(tree)
    for key, value in _promisor_settings(repo):
        run(scratch, "config", "--local", "--", key, value)
    run(scratch, "checkout", "--quiet", "--detach", commit, "--")
    return scratch


# What makes ``repo`` a partial clone (``git clone --filter=blob:none``): the scratch
# repository needs it too, or a blob or tree not fetched yet is "unable to read" there
# instead of being fetched from the promisor remote as in the checkout itself.
_PROMISOR = ("core.repositoryformatversion", "extensions.partialclone",
             r"remote\..*\.(url|promisor|partialclonefilter)")


def _promisor_settings(repo: Repo) -> list[tuple[str, str]]:
    """(key, value) of ``repo``'s own config that make it a partial clone; none if it is not."""
    ok, out = attempt(repo, "config", "--local", "--null", "--get-regexp", f"^({'|'.join(_PROMISOR)})$")
    entries = [tuple(record.split("\n", 1)) for record in out.split("\0") if "\n" in record] if ok else []
    promisor = any(k == "extensions.partialclone" or k.endswith(".promisor") for k, _ in entries)
    return entries if promisor else []


def _refuse_unwritable_objects(objects: Path) -> None:
    """UsageError (one line, git's reason) if no object can be written into ``objects``.

    The scratch repository commits into the checkout's object store: a read-only or
    otherwise unwritable one would make every ``git am`` fail, which would read as a
    conflict of the first patch. A probe file is made there and removed at once.
    """
    try:
        fd, probe = tempfile.mkstemp(prefix="tmp_k3_probe_", dir=objects)
    except OSError as err:
        raise UsageError(f"cannot write git objects into {objects}: {err.strerror}") from err
    os.close(fd)
    with contextlib.suppress(OSError):
        os.unlink(probe)


def _remove_stale_scratch(tmp: Path) -> None:
    """Remove scratch repositories (``_WORKTREE_PREFIX`` folders in ``tmp``) whose owner is gone."""
    for parent in sorted(tmp.glob(f"{_WORKTREE_PREFIX}*")):
        with contextlib.suppress(OSError), _owner_gone(parent) as gone:
            if gone and not (parent / "tree" / ".git").is_file():  # a linked worktree: by git's entry
                with deferred():
                    shutil.rmtree(parent, ignore_errors=True)


def _remove_stale_worktrees(repo: Repo) -> None:
    """Remove our temporary worktrees of ``repo`` whose owning process is gone."""
    admin = Path(run(repo, "rev-parse", "--path-format=absolute", "--git-common-dir").strip())
    for gitdir_file in sorted(admin.glob("worktrees/*/gitdir")):
        with contextlib.suppress(OSError):
            tree = _tree_of(gitdir_file)
            parent = tree.parent
            if tree.name != "tree" or not parent.name.startswith(_WORKTREE_PREFIX):
                continue  # not ours
            with _owner_gone(parent) as gone:
                if gone:
                    with deferred():
                        _remove_worktree(repo, parent)


def _tree_of(gitdir_file: Path) -> Path:
    """The linked worktree a ``worktrees/NAME/gitdir`` file names; ``Path()`` if it is not a
    regular file (a link is not followed, a FIFO not waited on)."""
    data = read_regular(gitdir_file)
    return Path(os.fsdecode(data.strip())).parent if data else Path()


@contextlib.contextmanager
def _owner_gone(parent: Path) -> Iterator[bool]:
    """True (and the owner lock, held for the block) if no live process owns ``parent``.

    A folder without ``owner.lock`` was never ours (a run makes the lock before the worktree):
    a user's own worktree at ``…/k3-worktree-x/tree`` is left alone, files and all."""
    try:
        fd = os.open(parent / "owner.lock", os.O_RDWR | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except FileNotFoundError:
        yield not os.path.lexists(parent)  # folder gone (a cleaned /tmp): only git's entry is left
        return
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            yield False
            return
        yield True
    finally:
        os.close(fd)


def _remove_worktree(repo: Repo, parent: Path) -> None:
    """Remove our worktree at ``parent/tree``: git's entry for it, and the folder.

    If ``git worktree remove`` cannot (the folder is half made or already gone),
    the entry is deleted from ``$GIT_COMMON_DIR/worktrees`` by hand, ours only.
    """
    tree = parent / "tree"
    attempt(repo, "worktree", "remove", "--force", "--force", str(tree))
    ok, admin = attempt(repo, "rev-parse", "--path-format=absolute", "--git-common-dir")
    if ok:
        for gitdir_file in Path(admin.strip()).glob("worktrees/*/gitdir"):
            with contextlib.suppress(OSError):
                if _tree_of(gitdir_file) == tree:
                    shutil.rmtree(gitdir_file.parent)
    shutil.rmtree(parent, ignore_errors=True)
