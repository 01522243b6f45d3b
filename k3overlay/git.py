"""Git verbs over GitPython, one small function each.

Project agnostic: nothing here knows about vLLM, Kimi-K3 or this repo's
layout. Arguments are built as explicit lists. Every ``GitCommandError`` is
turned into a ``GitError`` here, so a message a user sees is ours: one line
naming the git verb and git's own first line of complaint.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

import git as gitpython
from git.exc import GitCommandError, InvalidGitRepositoryError, NoSuchPathError

from .errors import OverlayError

Repo = gitpython.Repo


# Every git command runs with these: the user's hooks (a DCO check, a post-checkout
# script) must not change what the tool decides, and the tool's commits are not the
# user's to sign (signing would also break reproducible shas).
GIT = ("git", "-c", "core.hooksPath=/dev/null", "-c", "commit.gpgSign=false",
       "-c", "tag.gpgSign=false", "-c", "protocol.ext.allow=never")


class GitError(OverlayError):
    """A git command failed; ``str()`` is one line (verb and git's reason)."""


def first_line(text: str) -> str:
    """The line of git's output that says what went wrong (``fatal:``/``error:`` first)."""
    lines = [_unquote(line.strip().removeprefix("stderr: ")) for line in (text or "").splitlines()]
    lines = [line for line in lines if line and not line.startswith("hint:")]
    for line in lines:
        if line.startswith(("fatal:", "error:")):
            return line
    return lines[0] if lines else "no message"


def _unquote(line: str) -> str:
    """Drop the quote GitPython wraps stderr in, not the quotes inside git's message."""
    line = line.removeprefix("'") if line.startswith("'") and line.count("'") % 2 else line
    return line.strip()


def run(repo: Repo, *args: str, env: dict[str, str] | None = None) -> str:
    """Run ``git ARGS`` in ``repo``; return stdout. Raises GitError on failure."""
    try:
        return repo.git.execute([*GIT, *args], env=env, strip_newline_in_stdout=False)
    except GitCommandError as err:
        raise GitError(f"git {args[0]} failed: {first_line(str(err.stderr))}") from err


def attempt(repo: Repo, *args: str, env: dict[str, str] | None = None) -> tuple[bool, str]:
    """Run ``git ARGS``; return (succeeded, stdout + stderr). Never raises."""
    status, out, err = repo.git.execute(
        [*GIT, *args], env=env, with_extended_output=True, with_exceptions=False,
        strip_newline_in_stdout=False,
    )
    return status == 0, out + err


def open_repo(path: Path) -> Repo:
    """Open the repository whose work tree is ``path``. Raises GitError if it is none."""
    try:
        repo = Repo(path)
    except (InvalidGitRepositoryError, NoSuchPathError) as err:
        raise GitError(f"{path} is not a git repository") from err
    if repo.bare or Path(repo.working_tree_dir).resolve() != path.resolve():
        raise GitError(f"{path} is not the top of a git work tree")
    return repo


def init_bare(path: Path) -> Repo:
    """Open the bare repository at ``path``, creating it if missing."""
    if (path / "HEAD").exists():
        return Repo(path)
    return Repo.init(path, bare=True, mkdir=True)


def clone(source: str, dest: Path) -> Repo:
    """Clone ``source`` (a URL or a path) into ``dest``. Raises GitError on failure."""
    status, _, err = gitpython.Git().execute(
        [*GIT, "clone", "--quiet", "--", source, str(dest)],
        with_extended_output=True, with_exceptions=False)
    if status != 0:
        raise GitError(f"git clone {source} failed: {first_line(err)}")
    return Repo(dest)


def resolve(repo: Repo, ref: str) -> str | None:
    """The commit sha ``ref`` names in ``repo``, or None if it names no commit."""
    ok, out = attempt(repo, "rev-parse", "--verify", "--quiet", f"{ref}^{{commit}}")
    return out.strip() if ok else None


def tags(repo: Repo) -> list[str]:
    """Every tag name in ``repo``."""
    return [t.name for t in repo.tags]


def tag(repo: Repo, name: str, sha: str) -> None:
    """Create lightweight tag ``name`` at ``sha``."""
    run(repo, "tag", name, sha)


def current_branch(repo: Repo) -> str | None:
    """The checked-out branch's short name, or None when HEAD is detached or unborn."""
    ok, out = attempt(repo, "symbolic-ref", "--quiet", "--short", "HEAD")
    return out.strip() if ok else None


def branch_tip(repo: Repo, name: str) -> str | None:
    """The sha branch ``name`` points at, or None if there is no such branch."""
    return resolve(repo, f"refs/heads/{name}")


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


def is_dirty(repo: Repo) -> bool:
    """True if ``repo`` has staged, unstaged or untracked (not ignored) changes."""
    return bool(run(repo, "status", "--porcelain", "--untracked-files=normal").strip())


_WORKTREE_PREFIX = "k3-worktree-"


@contextlib.contextmanager
def temporary_worktree(repo: Repo, sha: str) -> Iterator[Repo]:
    """A detached linked worktree of ``repo`` at ``sha``, removed on exit.

    Only our own worktree entries are ever removed: never ``git worktree
    prune``, which would also drop a user's entries for moved folders.
    Leftovers of a run that was killed are removed first.
    """
    _remove_stale_worktrees(repo)
    parent = Path(tempfile.mkdtemp(prefix=_WORKTREE_PREFIX))
    path = parent / "tree"
    try:
        run(repo, "worktree", "add", "--quiet", "--detach", str(path), sha)
        yield Repo(path)
    finally:
        attempt(repo, "worktree", "remove", "--force", "--force", str(path))
        shutil.rmtree(parent, ignore_errors=True)


def _remove_stale_worktrees(repo: Repo) -> None:
    listing = run(repo, "worktree", "list", "--porcelain")
    for line in listing.splitlines():
        path = line.removeprefix("worktree ")
        if line.startswith("worktree ") and f"/{_WORKTREE_PREFIX}" in path and Path(path).is_dir():
            attempt(repo, "worktree", "remove", "--force", "--force", path)
            shutil.rmtree(Path(path).parent, ignore_errors=True)


def apply_check(repo: Repo, patch: Path, *, reverse: bool = False) -> bool:
    """True if ``patch`` applies (or, with ``reverse``, un-applies) cleanly to the work tree."""
    args = ["apply", "--check", *(["--reverse"] if reverse else []), str(patch)]
    return attempt(repo, *args)[0]


def am(repo: Repo, patch: Path, *, env: dict[str, str]) -> tuple[bool, str]:
    """``git am --3way`` one mailbox patch, committer date = author date.

    Returns (succeeded, git's output). On failure the am is left in progress
    for the caller to inspect and then ``am_abort`` or ``am_skip``.
    """
    return attempt(
        repo, "am", "--3way", "--keep-cr", "--committer-date-is-author-date", str(patch), env=env
    )


def am_abort(repo: Repo) -> None:
    """Abort an in-progress ``git am``, restoring the branch and work tree."""
    attempt(repo, "am", "--abort")


def am_skip(repo: Repo) -> None:
    """Skip the current patch of an in-progress ``git am``."""
    run(repo, "am", "--skip")


def unmerged_paths(repo: Repo) -> list[str]:
    """Paths left with conflict markers by a merge or 3-way am."""
    out = run(repo, "diff", "--name-only", "--diff-filter=U")
    return sorted(set(out.split()))


def stage(repo: Repo, paths: list[str]) -> None:
    """``git add`` these paths."""
    if paths:
        run(repo, "add", "--", *paths)


def staged_changes(repo: Repo) -> bool:
    """True if the index differs from HEAD."""
    return not attempt(repo, "diff", "--cached", "--quiet")[0]


def blob_at(repo: Repo, ref: str, path: str) -> str | None:
    """The blob sha of ``path`` at ``ref``, or None if ``ref`` has no such file."""
    ok, out = attempt(repo, "rev-parse", "--verify", "--quiet", f"{ref}:{path}")
    return out.strip() if ok else None


def read_blob(repo: Repo, sha: str) -> bytes:
    """The bytes of blob ``sha``. Raises GitError if ``repo`` lacks it."""
    try:
        return repo.git.execute([*GIT, "cat-file", "blob", sha], stdout_as_string=False,
                                strip_newline_in_stdout=False)
    except GitCommandError as err:
        raise GitError(f"blob {sha[:8]} is not in {repo.git_dir}") from err


def tree_files(repo: Repo, sha: str, folder: str) -> dict[str, str]:
    """``{path: blob sha}`` of every regular file under ``folder`` at commit ``sha``
    (links and submodules left out)."""
    out = run(repo, "ls-tree", "-r", "-z", "--full-tree", sha, "--", folder)
    files = {}
    for entry in out.split("\0"):
        meta, _, path = entry.partition("\t")
        if path and meta.split(" ")[0] in ("100644", "100755"):
            files[path] = meta.split(" ")[2]
    return files


def blob_hash(data: bytes, *, width: int = 40) -> str:
    """The blob id git gives ``data`` (``width`` 40: SHA-1 repositories, 64: SHA-256 ones)."""
    digest = hashlib.sha1 if width == 40 else hashlib.sha256
    return digest(b"blob %d\0" % len(data) + data).hexdigest()


def commit_time(repo: Repo, sha: str) -> int:
    """Committer date of commit ``sha``, seconds since the epoch."""
    return int(run(repo, "show", "-s", "--format=%ct", sha).strip())


def archive(repo: Repo, sha: str, dest: Path) -> None:
    """Write commit ``sha``'s tree as a tar file ``dest`` (``git archive``)."""
    run(repo, "archive", "--format=tar", "-o", str(dest), sha)


def commit_paths(repo: Repo, sha: str) -> set[str]:
    """Paths commit ``sha`` changes against its first parent."""
    return set(run(repo, "diff-tree", "--no-commit-id", "--name-only", "-r", "--root",
                   "--no-renames", sha).split())


def changed_paths(repo: Repo, old: str, new: str) -> list[str]:
    """Paths that differ between commits ``old`` and ``new``."""
    return sorted(run(repo, "diff", "--name-only", "--no-renames", old, new).split())


def diff(repo: Repo, old: str, new: str, path: str) -> str:
    """Unified diff of ``path`` between commits ``old`` and ``new``."""
    return run(repo, "diff", "--no-color", "--no-renames", old, new, "--", path)


def commit_all(repo: Repo, message: str, *, env: dict[str, str]) -> str:
    """Stage every change in the work tree and commit it; return HEAD's sha after.

    Nothing to commit is not an error: HEAD stays where it was.
    """
    run(repo, "add", "--all")
    if staged_changes(repo):
        run(repo, "commit", "--quiet", "--no-verify", "-m", message, env=env)
    return run(repo, "rev-parse", "HEAD").strip()


def merge_file(ours: Path, base: Path, theirs: Path) -> tuple[bool, bytes]:
    """3-way merge of three files with ``git merge-file``; return (clean, merged bytes)."""
    status, out, _ = gitpython.Git().execute(
        [*GIT, "merge-file", "-p", "-L", "ours", "-L", "base", "-L", "theirs",
         str(ours), str(base), str(theirs)],
        with_extended_output=True, with_exceptions=False, stdout_as_string=False,
        strip_newline_in_stdout=False,
    )
    if status < 0:
        raise GitError(f"git merge-file failed on {ours}")
    return status == 0, out


def set_branch(repo: Repo, name: str, sha: str) -> None:
    """Point branch ``name`` at ``sha`` and check it out (the work tree must be clean)."""
    run(repo, "checkout", "--quiet", "-B", name, sha)


def config_get(repo: Repo, key: str) -> str | None:
    """A local config value, or None."""
    ok, out = attempt(repo, "config", "--local", "--get", key)
    return out.strip() if ok else None


def config_set(repo: Repo, key: str, value: str) -> None:
    """Set a local config value."""
    run(repo, "config", "--local", key, value)


def log_subjects(repo: Repo, rev_range: str) -> list[tuple[str, str]]:
    """(sha, subject) of each commit in ``rev_range``, oldest first."""
    out = run(repo, "log", "--reverse", "--topo-order", "--format=%H %s", rev_range)
    return [tuple(line.split(" ", 1)) for line in out.splitlines() if line]


def format_patch(repo: Repo, sha: str, outdir: Path, number: int = 1) -> Path:
    """Write commit ``sha`` as one mailbox patch, file name prefixed ``NNNN-``.

    Headers that would churn on every export are fixed: the From line's
    commit id is zeroed and no git version signature is added; the Date is
    the commit's author date, which ``git am`` preserves.
    """
    out = run(repo, "format-patch", "-1", "--zero-commit", "--no-signature", "--full-index",
              f"--start-number={number}", "-o", str(outdir), sha)
    return Path(out.strip().splitlines()[-1])


def range_diff(repo: Repo, old: str, new: str) -> str:
    """``git range-diff`` of two commit ranges (``A..B`` strings)."""
    return run(repo, "range-diff", "--no-color", old, new)


def environ(**extra: str) -> dict[str, str]:
    """The current environment plus ``extra`` (for identity and dates on commits)."""
    env = dict(os.environ)
    env.update(extra)
    return env


def snapshot(repo: Repo, directory: Path, message: str, parents: list[str], *,
             env: dict[str, str]) -> str:
    """Commit the whole content of ``directory`` as one new commit; return its sha.

    Works on a bare ``repo`` through a throwaway index; no branch is moved.
    ``env`` carries the identity and dates, so equal input gives an equal sha.
    """
    with tempfile.TemporaryDirectory(prefix="k3-index-") as tmp:
        env = {**env, "GIT_INDEX_FILE": str(Path(tmp) / "index"), "GIT_WORK_TREE": str(directory)}
        run(repo, "add", "--all", "--force", ".", env=env)
        tree = run(repo, "write-tree", env=env).strip()
        args = ["commit-tree", tree, "-m", message]
        for parent in parents:
            args += ["-p", parent]
        return run(repo, *args, env=env).strip()


def patch_id(repo: Repo, diff_text: str) -> str | None:
    """``git patch-id --stable`` of one diff, or None if it holds no change."""
    out = repo.git.execute([*GIT, "patch-id", "--stable"], istream=_stdin(diff_text))
    return out.split()[0] if out.strip() else None


def patch_ids(repo: Repo, rev_range: str, paths: list[str]) -> set[str]:
    """Stable patch-ids of the commits in ``rev_range`` touching ``paths``."""
    log = run(repo, "log", "--no-merges", "-p", "--format=commit %H", rev_range, "--", *paths)
    if not log.strip():
        return set()
    out = repo.git.execute([*GIT, "patch-id", "--stable"], istream=_stdin(log))
    return {line.split()[0] for line in out.splitlines() if line.strip()}


def is_ancestor(repo: Repo, old: str, new: str) -> bool:
    """True if commit ``old`` is an ancestor of (or equal to) ``new``."""
    return attempt(repo, "merge-base", "--is-ancestor", old, new)[0]


def _stdin(text: str):
    stream = tempfile.TemporaryFile()
    stream.write(text.encode())
    stream.seek(0)
    return stream
