"""A local git mirror of vLLM's published release sdists.

When no vLLM repository is given, releases are fetched from the package index
as sdists (``downloads``: checked against the index's sha256 on every use)
and committed onto a bare repository under the cache directory, each tagged
``vX.Y.Z``. Each release is a root commit of its own, with a fixed identity,
a fixed message and the sdist's upload time as date: so a release's sha
depends on nothing but the published sdist, and is the same on every machine
whatever else was fetched before it. Tags are never moved or rewritten.

Mirror format 2 (this one) lives at ``mirror-v2.git``. Format 1
(``mirror.git``) gave each release the newest older release already there
as parent, so shas depended on the fetch order; its tags cannot be moved, so
a format-1 mirror is left alone (delete it at will) rather than mixed in.
Nothing relies on ancestry between releases: what landed upstream is judged
from trees, and upstream's diffs are tree-to-tree.
"""

from __future__ import annotations

import lzma
import re
import shutil
import tarfile
import tempfile
import zlib
from collections.abc import Iterable
from datetime import datetime, timezone
from pathlib import Path

from packaging.version import InvalidVersion, Version

from . import git, untar
from .downloads import ReleaseFiles
from .errors import SourceError, UsageError
from .files import CANNOT_WRITE
from .lock import held
from .progress import step
from .regular import own_folder

MIRROR_NAME = "mirror-v2.git"  # the format's folder under the cache directory (see above)
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
    """The bare mirror repository at ``path`` (created on first use), fed from ``files``."""

    def __init__(self, path: Path, files: ReleaseFiles) -> None:
        self.path = path
        self.files = files

    def releases(self) -> list[Version]:
        """Releases already in the mirror, oldest first."""
        if not (self.path / "HEAD").exists():
            return []
        found = (release_of(t) for t in git.tags(git.init_bare(self.path)))
        return sorted(v for v in found if v is not None)

    def ensure(self, versions: Iterable[Version]) -> None:
        """Make sure every release in ``versions`` is in the mirror.

        Raises UsageError if the index has no sdist for a version (or something
        other than a regular file sits at the lock file's path), SourceError
        if the index cannot be reached or the sdist fails its sha256 check.
        """
        with held(self.path.parent / ".mirror.lock"):  # two jobs on one cache must not race on tags
            repo = git.init_bare(own_folder(self.path))
            for version in sorted(set(versions)):
                if git.resolve(repo, tag_of(version)) is None:
                    self._add(repo, version)

    def _add(self, repo: git.Repo, version: Version) -> None:
        pkg = self.files.sdist(version)
        with tempfile.TemporaryDirectory(prefix="k3-sdist-") as tmp:
            tree = Path(tmp) / "tree"

            def unpacked(sdist: Path) -> datetime:
                with step(f"unpacking {sdist.name}"):
                    return unpack(sdist, tree)

            newest_member = self.files.use(pkg, unpacked)
            uploaded = (pkg.upload_time or newest_member).astimezone(timezone.utc)
            with step(f"committing {pkg.filename} as {tag_of(version)}"):
                stamp = uploaded.strftime("%Y-%m-%dT%H:%M:%S+00:00")
                env = git.environ(**_MIRROR_IDENTITY, GIT_AUTHOR_DATE=stamp, GIT_COMMITTER_DATE=stamp)
                message = f"vLLM {tag_of(version)}\n\nRelease sdist {pkg.filename}, as published.\n"
                git.tag(repo, tag_of(version), git.snapshot(repo, tree, message, env=env))

    def latest(self) -> Version:
        """The newest final release with an sdist on the index. Raises SourceError offline."""
        return self.files.latest()


def unpack(sdist: Path, dest: Path) -> datetime:
    """Extract sdist ``sdist`` into ``dest``, dropping its single top-level folder.

    Returns the newest member's modification time (UTC), the release date
    to use when the index gives no upload time. Extracts by tarfile's ``data``
    filter's rules (``untar``): no absolute paths, no link of any kind, no device files,
    and bounded (a decompression bomb, a sparse file or millions of members is refused).
    Raises SourceError on a damaged, truncated or refused archive, leaving no ``dest``.
    """
    try:
        with untar.opened(sdist) as archive:
            members = []
            for member in untar.members(archive):
                head, _, rest = member.name.partition("/")
                if not rest:
                    continue
                if not (member.isreg() or member.isdir()):
                    # No release sdist holds a link (v0.28.0..v0.34.0: none), and tarfile's data
                    # filter lets a chain of deep links write outside the tree (CVE-2025-4517,
                    # Python < 3.11.13): only files and folders are taken.
                    raise untar.UnsafeMember(f"{member.name!r} is a link or special file, which no "
                                             f"release sdist holds")
                member.name = rest
                members.append(member)
            untar.extract(archive, dest, members)
    # EOFError: a truncated gzip; LZMAError: a damaged xz
    except (tarfile.TarError, OSError, EOFError, zlib.error, lzma.LZMAError) as err:
        shutil.rmtree(dest, ignore_errors=True)
        if isinstance(err, OSError) and err.errno in CANNOT_WRITE:  # this disk's, not the sdist's
            raise UsageError(f"cannot unpack {sdist.name} into {dest.parent}: {err.strerror}") from err
        raise SourceError(f"cannot unpack {sdist.name}: {err}") from err
    newest = max((m.mtime for m in members), default=0)
    return datetime.fromtimestamp(newest, timezone.utc)
