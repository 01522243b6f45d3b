"""A local git mirror of vLLM's published release sdists.

When no vLLM repository is given, releases are fetched from the package index
as sdists and committed, one commit per release, onto a bare repository under
the cache directory, each tagged ``vX.Y.Z``. A release's parent is the newest
release below it already in the mirror, so the pinned base is an ancestor of
later releases fetched after it. Tags are never moved or rewritten, and
commits carry a fixed identity and the sdist's upload time, so a release's
sha is the same on every machine whose mirror was built in the same order.

Why not ``pip download``: for vLLM it prepares metadata by running vLLM's own
build (it wants a CUDA torch, or torch plus build-env overrides), i.e. it
executes upstream code just to fetch a tarball. pypi-simple reads the same
Simple API pip reads (``$PIP_INDEX_URL`` is honoured) and checks the sha256
the index publishes, without running anything.
"""

from __future__ import annotations

import fcntl
import re
import shutil
import tarfile
import tempfile
from collections.abc import Iterable
from datetime import datetime, timezone
from pathlib import Path

import requests
from packaging.version import InvalidVersion, Version
from pypi_simple import DigestMismatchError, NoDigestsError, PyPISimple

from . import git
from .errors import SourceError, UsageError
from .progress import DownloadBar, step

PROJECT = "vllm"
_TAG = re.compile(r"^v(\d+\.\d+\.\d+)$")
_MIRROR_IDENTITY = {
    "GIT_AUTHOR_NAME": "vLLM release mirror",
    "GIT_AUTHOR_EMAIL": "release-mirror@vllm-k3-overlay.invalid",
    "GIT_COMMITTER_NAME": "vLLM release mirror",
    "GIT_COMMITTER_EMAIL": "release-mirror@vllm-k3-overlay.invalid",
}


def release_of(ref: str) -> Version | None:
    """The release version a ``vX.Y.Z`` ref names, or None for any other ref."""
    match = _TAG.match(ref)
    try:
        return Version(match.group(1)) if match else None
    except InvalidVersion:
        return None


def tag_of(version: Version) -> str:
    return f"v{version}"


class ReleaseMirror:
    """The bare mirror repository at ``path`` (created on first use)."""

    def __init__(self, path: Path, sdist_dir: Path, index_url: str | None = None) -> None:
        self.path = path
        self.sdist_dir = sdist_dir
        self.index_url = index_url

    def releases(self) -> list[Version]:
        """Releases already in the mirror, oldest first."""
        if not (self.path / "HEAD").exists():
            return []
        found = (release_of(t) for t in git.tags(git.init_bare(self.path)))
        return sorted(v for v in found if v is not None)

    def ensure(self, versions: Iterable[Version]) -> None:
        """Make sure every release in ``versions`` is in the mirror (oldest added first).

        Raises UsageError if the index has no sdist for a version, SourceError
        if the index cannot be reached or the download is corrupt.
        """
        self.path.parent.mkdir(parents=True, exist_ok=True)
        with open(self.path.parent / ".mirror.lock", "w") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)  # two jobs on one cache must not race on tags
            repo = git.init_bare(self.path)
            for version in sorted(set(versions)):
                if git.resolve(repo, tag_of(version)) is None:
                    self._add(repo, version)

    def _add(self, repo: git.Repo, version: Version) -> None:
        sdist, uploaded = self._download(version)
        parents = [tag_of(v) for v in self.releases() if v < version][-1:]
        with tempfile.TemporaryDirectory(prefix="k3-sdist-") as tmp:
            with step(f"unpacking {sdist.name} and committing it as {tag_of(version)}"):
                tree = Path(tmp)
                unpack(sdist, tree)
                stamp = uploaded.strftime("%Y-%m-%dT%H:%M:%S+00:00")
                env = git.environ(**_MIRROR_IDENTITY, GIT_AUTHOR_DATE=stamp, GIT_COMMITTER_DATE=stamp)
                message = f"vLLM {tag_of(version)}\n\nRelease sdist {sdist.name}, as published.\n"
                sha = git.snapshot(repo, tree, message, [git.resolve(repo, p) for p in parents], env=env)
                git.tag(repo, tag_of(version), sha)

    def latest(self) -> Version:
        """The newest final release with an sdist on the index. Raises SourceError offline."""
        try:
            with self._index() as index:
                page = index.get_project_page(PROJECT)
        except requests.RequestException as err:
            raise SourceError(f"cannot reach the package index: {err}") from err
        found = {Version(p.version) for p in page.packages
                 if p.package_type == "sdist" and p.version and not p.is_yanked}
        finals = [v for v in found if not v.is_prerelease and not v.is_devrelease]
        if not finals:
            raise SourceError("the package index lists no vLLM release sdist")
        return max(finals)

    def _index(self) -> PyPISimple:
        return PyPISimple(**({"endpoint": self.index_url} if self.index_url else {}))

    def _download(self, version: Version) -> tuple[Path, datetime]:
        """The sdist of ``version`` (cached) and its upload time (UTC)."""
        try:
            with self._index() as index:
                page = index.get_project_page(PROJECT)
                sdists = [p for p in page.packages
                          if p.package_type == "sdist" and p.version == str(version)]
                if not sdists:
                    raise UsageError(f"vLLM {version} has no release sdist on the package index")
                pkg = sdists[0]
                target = self.sdist_dir / pkg.filename
                if not target.exists():
                    self.sdist_dir.mkdir(parents=True, exist_ok=True)
                    with step(f"downloading {pkg.filename}"):
                        index.download_package(
                            pkg, target, verify=True,
                            progress=lambda total: DownloadBar(total, pkg.filename),
                        )
        except requests.RequestException as err:
            raise SourceError(f"cannot reach the package index for vLLM {version}: {err}") from err
        except (DigestMismatchError, NoDigestsError) as err:
            raise SourceError(f"download of vLLM {version} sdist is corrupt: {err}") from err
        uploaded = pkg.upload_time or datetime.fromtimestamp(target.stat().st_mtime)
        return target, uploaded.astimezone(timezone.utc)


def unpack(sdist: Path, dest: Path) -> None:
    """Extract sdist ``sdist`` into ``dest``, dropping its single top-level folder.

    Uses tarfile's ``data`` filter: no absolute paths, links out of the tree,
    or device files. Raises SourceError on a damaged archive.
    """
    try:
        with tarfile.open(sdist) as archive:
            members = []
            for member in archive.getmembers():
                head, _, rest = member.name.partition("/")
                if not rest:
                    continue
                member.name = rest
                if member.islnk():
                    member.linkname = member.linkname.partition("/")[2]
                members.append(member)
            archive.extractall(dest, members=members, filter="data")
    except (tarfile.TarError, OSError) as err:
        shutil.rmtree(dest, ignore_errors=True)
        raise SourceError(f"cannot unpack {sdist.name}: {err}") from err
