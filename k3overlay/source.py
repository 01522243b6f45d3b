"""Getting a vLLM checkout that holds a given ref.

The source is a git repository (URL or path: ``--vllm-repo`` or
``$VLLM_REPO``) or, when none is given, the local release mirror built from
vLLM's published sdists (see ``mirror``).
"""

from __future__ import annotations

import os
import re
import shutil
import tempfile
from pathlib import Path

from . import git, journal
from .downloads import ReleaseFiles
from .errors import SourceError, UsageError
from .interrupts import deferred
from .mirror import MIRROR_NAME, ReleaseMirror, release_of
from .progress import step
from .project import cache_dir
from .releases import unknown_ref_hint

_FULL_SHA = re.compile(r"^[0-9a-f]{40}$")
# What git says when the remote answered but has no such ref (bad input, not a network fault).
_NOT_FOUND = ("couldn't find remote ref", "not our ref", "no such ref", "invalid refspec",
              "does not appear to be a git repository", "does not exist", "not allowed")


def check_ref(ref: str) -> None:
    """Refuse a ref git could read as an option or a refspec (UsageError).

    A leading ``-`` would be an option (``--upload-pack=…`` runs a command),
    and ``:`` makes a refspec that writes a local branch.
    """
    if (not ref or ref.startswith("-") or any(c in ref for c in ": \t\n\\")
            or ".." in ref or "@{" in ref or not ref.isprintable()):
        raise UsageError(f"bad ref {ref!r}: give a tag, branch or commit sha")


def release_files() -> ReleaseFiles:
    """vLLM's release files, cached under the cache directory (index: ``$PIP_INDEX_URL`` if set)."""
    return ReleaseFiles(cache_dir(), os.environ.get("PIP_INDEX_URL"))


def default_mirror() -> ReleaseMirror:
    """The release mirror under the cache directory, fed from ``release_files()``."""
    return ReleaseMirror(cache_dir() / MIRROR_NAME, release_files())


def locate(vllm_repo: str | None, refs: list[str]) -> str:
    """The URL or path to fetch ``refs`` from.

    Without ``vllm_repo`` (or ``$VLLM_REPO``), every release tag among
    ``refs`` is first materialized in the release mirror, whose path is returned.
    A relative path is made absolute from the current folder.
    """
    for ref in refs:
        check_ref(ref)
    chosen = vllm_repo or os.environ.get("VLLM_REPO")
    if chosen and chosen.startswith("-"):
        raise UsageError(f"bad vLLM repository {chosen!r}: give a URL or a path")
    if chosen:
        return _absolute(chosen)
    mirror = default_mirror()
    mirror.ensure(v for v in map(release_of, refs) if v is not None)
    return str(mirror.path)


def _absolute(source: str) -> str:
    """``source`` as git will be given it: a path made absolute from the current folder (git
    runs elsewhere: beside the work directory, in the checkout); a URL (``scheme://``) or an
    scp-like ``host:path`` as it is."""
    if "://" in source or ":" in source.split("/", 1)[0]:
        return source
    return os.path.abspath(source)


def open_existing(workdir: Path) -> git.Repo | None:
    """The checkout at ``workdir``, or None if the folder is missing or empty.

    Raises UsageError if it is a file, or a non-empty folder that is not the
    top of a git work tree.
    """
    if not workdir.exists():
        return None
    if not workdir.is_dir():
        raise UsageError(f"--workdir {workdir} is a file, not a folder")
    if not any(workdir.iterdir()):
        return None
    try:
        return git.open_repo(workdir)
    except git.GitError as err:
        raise UsageError(f"--workdir {workdir} exists and is not a git checkout") from err


def clone(origin: str, workdir: Path) -> git.Repo:
    """Clone ``origin`` into ``workdir`` (missing, or an empty folder).

    The clone is made in a temporary folder beside ``workdir`` and renamed into
    place when complete, so an interrupted or failed clone leaves no half-made
    checkout (the temporary folder is removed, after git has stopped).
    Raises UsageError if ``workdir`` cannot be made or ``origin`` is no
    repository, SourceError if ``origin`` cannot be reached.
    """
    try:
        workdir.parent.mkdir(parents=True, exist_ok=True)
        scratch = Path(tempfile.mkdtemp(prefix=f".{workdir.name}.k3-clone-", dir=workdir.parent))
    except OSError as err:
        raise UsageError(f"cannot create --workdir {workdir}: {err.strerror}") from err
    try:
        with journal.step("clone", scratch=str(scratch), prefix=f".{workdir.name}.k3-clone-"):
            try:
                with step(f"cloning {origin} into {workdir}"):
                    try:
                        git.clone(origin, scratch / "vllm")
                    except git.GitError as err:
                        raise _classify(str(err)) from err
                journal.point("clone.cloned")
                try:
                    os.replace(scratch / "vllm", workdir)  # an empty folder there is replaced too
                except OSError as err:
                    raise UsageError(f"cannot put the clone at --workdir {workdir}: "
                                     f"{err.strerror}") from err
            finally:
                with deferred():
                    shutil.rmtree(scratch, ignore_errors=True)
    finally:
        with deferred():
            shutil.rmtree(scratch, ignore_errors=True)  # (the journal could not be written)
    return git.open_repo(workdir)


def resolves_locally(repo: git.Repo, ref: str) -> bool:
    """True if ``repo`` already knows ``ref``."""
    return git.resolve(repo, ref) is not None


def ensure_ref(repo: git.Repo, source: str, ref: str) -> str:
    """The commit sha of ``ref``, fetched fresh from ``source`` unless it cannot move.

    A full sha, or a release tag ``repo`` already has, is used as is. Anything
    else (a branch, a tag not yet here) is fetched first, so a branch is never
    read from a stale local copy; a release tag is fetched as that tag only,
    never ``--tags``, so a user's own tags of the same names are left alone.
    A name only ``repo`` knows (a local branch) is used when ``source`` lacks it.
    Raises UsageError for a bad or unknown ref, SourceError when ``source``
    cannot be reached.
    """
    check_ref(ref)
    local = git.resolve(repo, ref)
    if local and (_FULL_SHA.match(ref) or (release_of(ref) and git.resolve(repo, f"refs/tags/{ref}"))):
        return local
    if local is None:
        _refuse_non_commit(repo, ref, ref)
    spec = f"refs/tags/{ref}:refs/tags/{ref}" if release_of(ref) else ref
    ok, output = git.attempt(repo, "fetch", "--quiet", "--no-tags", "--", source, spec)
    if ok:
        fetched = f"refs/tags/{ref}" if release_of(ref) else "FETCH_HEAD"
        _refuse_non_commit(repo, fetched, ref)
        return git.resolve(repo, fetched)
    if local:
        return local
    if Path(source) == default_mirror().path:  # the user's sha is likely upstream's: say what works
        raise _classify(output, what=unknown_ref_hint(ref))
    raise _classify(output, what=f"ref {ref!r} not found in {source}")


def _refuse_non_commit(repo: git.Repo, name: str, ref: str) -> None:
    """Raise UsageError if ``name`` in ``repo`` names something other than a commit
    (a tree, a blob, or a tag of one); nothing at all is left to the caller."""
    kind = git.object_type(repo, name)
    if kind is not None and git.resolve(repo, name) is None:
        if kind == "tag":
            kind = f"tag of a {git.object_type(repo, f'{name}^{{}}') or 'non-commit'}"
        raise UsageError(f"ref {ref!r} names a {kind}, not a commit: give a tag, branch or "
                         f"commit sha")


def _classify(git_output: str, what: str | None = None) -> UsageError | SourceError:
    """A git failure as bad input (the remote has no such thing) or an unreachable source."""
    reason = git.first_line(git_output)
    if any(marker in git_output for marker in _NOT_FOUND):
        return UsageError(what or reason)
    return SourceError(f"cannot reach the vLLM source: {reason}")
