"""Getting a vLLM checkout that holds a given ref.

The source is a git repository (URL or path: ``--vllm-repo`` or
``$VLLM_REPO``) or, when none is given, the local release mirror built from
vLLM's published sdists (see ``mirror``).
"""

from __future__ import annotations

import os
from pathlib import Path

from . import git
from .errors import UsageError
from .mirror import ReleaseMirror, release_of
from .progress import step
from .project import cache_dir


def default_mirror() -> ReleaseMirror:
    """The release mirror under the cache directory (index from ``$PIP_INDEX_URL`` if set)."""
    root = cache_dir()
    return ReleaseMirror(root / "mirror.git", root / "sdists", os.environ.get("PIP_INDEX_URL"))


def locate(vllm_repo: str | None, refs: list[str]) -> str:
    """The URL or path to fetch ``refs`` from.

    Without ``vllm_repo`` (or ``$VLLM_REPO``), every release tag among
    ``refs`` is first materialized in the release mirror, whose path is returned.
    """
    chosen = vllm_repo or os.environ.get("VLLM_REPO")
    if chosen:
        return chosen
    mirror = default_mirror()
    mirror.ensure(v for v in map(release_of, refs) if v is not None)
    return str(mirror.path)


def open_existing(workdir: Path) -> git.Repo | None:
    """The checkout at ``workdir``, or None if the folder is missing or empty.

    Raises UsageError if it is a non-empty folder that is not the top of a git work tree.
    """
    if not (workdir.exists() and any(workdir.iterdir())):
        return None
    try:
        return git.open_repo(workdir)
    except git.GitError as err:
        raise UsageError(f"--workdir {workdir} exists and is not a git checkout") from err


def clone(origin: str, workdir: Path) -> git.Repo:
    """Clone ``origin`` into ``workdir``."""
    workdir.parent.mkdir(parents=True, exist_ok=True)
    with step(f"cloning {origin} into {workdir}"):
        return git.clone(origin, workdir)


def ensure_ref(repo: git.Repo, source: str, ref: str) -> str:
    """The commit sha of ``ref`` in ``repo``, fetching it from ``source`` if missing.

    A release tag is fetched as that tag only, never ``--tags``: a user's own
    vLLM clone has its own tags of the same names, which must not be touched.
    Raises UsageError if ``source`` has no such ref.
    """
    sha = git.resolve(repo, ref)
    if sha is not None:
        return sha
    spec = f"refs/tags/{ref}:refs/tags/{ref}" if release_of(ref) else ref
    ok, output = git.attempt(repo, "fetch", "--quiet", "--no-tags", source, spec)
    sha = git.resolve(repo, ref) or (git.resolve(repo, "FETCH_HEAD") if ok else None)
    if sha is None:
        raise UsageError(f"ref {ref!r} not found in {source}")
    return sha
