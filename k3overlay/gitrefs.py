"""Refs, branches and the config entries the tool records: one small git verb each."""

from __future__ import annotations

import tempfile

from .gitproc import Repo, _cwd, _execute, attempt, run


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


def is_branch_name(name: str) -> bool:
    """True if git takes ``name`` as a new branch's name (``git check-ref-format --branch``,
    run outside any repository, so ``@{-1}`` and the like expand to nothing)."""
    with tempfile.TemporaryDirectory(prefix="k3-refname-") as tmp:
        return _execute(["check-ref-format", "--branch", name], cwd=tmp)[0] == 0


def is_ref_name(name: str) -> bool:
    """True if ``name`` is a well-formed ref name (``git check-ref-format --allow-onelevel``)."""
    with tempfile.TemporaryDirectory(prefix="k3-refname-") as tmp:
        return _execute(["check-ref-format", "--allow-onelevel", name], cwd=tmp)[0] == 0


def current_branch(repo: Repo) -> str | None:
    """The checked-out branch's name (``refs/heads/`` taken off), or None when HEAD is detached
    or unborn. Not ``--short``: that gives ``heads/NAME`` for a branch a tag or a remote-tracking
    ref shares its name with (``--branch v1.0.0``), and no run took the branch for its own."""
    ok, out = attempt(repo, "symbolic-ref", "--quiet", "HEAD")
    ref = out.strip()
    return ref.removeprefix("refs/heads/") if ok and ref.startswith("refs/heads/") else None


def branch_tip(repo: Repo, name: str) -> str | None:
    """The sha branch ``name`` points at, or None if there is no such branch."""
    return resolve(repo, f"refs/heads/{name}")


def object_type(repo: Repo, ref: str) -> str | None:
    """What ``ref`` names: ``commit``, ``tree``, ``blob`` or ``tag``; None if nothing."""
    ok, sha = attempt(repo, "rev-parse", "--verify", "--quiet", "--end-of-options", ref)
    ok, out = attempt(repo, "cat-file", "-t", sha.strip()) if ok else (False, "")
    return out.strip() if ok else None


def reachable_from_refs(repo: Repo, sha: str) -> bool:
    """True if some branch, tag or other ref (not HEAD, not a reflog) holds commit ``sha``."""
    return bool(run(repo, "for-each-ref", "--count=1", "--format=%(refname)", f"--contains={sha}")
                .strip())


def config_get(repo: Repo, key: str) -> str | None:
    """A local config value, or None."""
    ok, out = attempt(repo, "config", "--local", "--get", key)
    return out.strip() if ok else None


def config_set(repo: Repo, key: str, value: str) -> None:
    """Set a local config value."""
    run(repo, "config", "--local", key, value)


def set_branch(repo: Repo, name: str, sha: str) -> None:
    """Point branch ``name`` at ``sha`` and check it out (the work tree must be clean).

    An ignored file where ``sha`` has a file is never overwritten (git's default would):
    GitError naming it, and nothing changes."""
    run(repo, "checkout", "--quiet", "--no-overwrite-ignore", "-B", name, sha)


def log_subjects(repo: Repo, rev_range: str) -> list[tuple[str, str]]:
    """(sha, subject) of each commit in ``rev_range``, oldest first."""
    out = run(repo, "log", "-z", "--reverse", "--topo-order", "--format=%H %s", rev_range)
    return [tuple(entry.split(" ", 1)) for entry in out.split("\0") if entry]


def commit_time(repo: Repo, sha: str) -> int:
    """Committer date of commit ``sha``, seconds since the epoch."""
    return int(run(repo, "show", "-s", "--format=%ct", sha).strip())


def commit_trees(repo: Repo, rev_range: str) -> list[tuple[str, str]]:
    """(commit sha, tree sha) of each commit in ``rev_range``, oldest first."""
    out = run(repo, "log", "-z", "--reverse", "--topo-order", "--format=%H %T", rev_range)
    return [tuple(entry.split(" ")) for entry in out.split("\0") if entry]


def tree_of(repo: Repo, rev: str) -> str:
    """The tree sha of commit ``rev``."""
    return run(repo, "rev-parse", f"{rev}^{{tree}}").strip()


def is_ancestor(repo: Repo, old: str, new: str) -> bool:
    """True if commit ``old`` is in ``new``'s history."""
    return _execute(["merge-base", "--is-ancestor", old, new], cwd=_cwd(repo))[0] == 0
