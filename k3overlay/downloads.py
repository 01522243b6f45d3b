"""vLLM's published release files (sdists, wheels), cached and checked on every use.

Files come from the package indexes pip's configuration names (``pipconfig``: pip.conf,
``$PIP_CONFIG_FILE``, ``PIP_*``; its ``cert`` or the system trust store) through
pypi-simple, which reads the same Simple API pip reads. Each is kept under the
cache directory (``sdists/``, ``wheels/``) and, every time it is used, not only
when it was downloaded, checked against the sha256 the index publishes: a
cached file that was truncated, tampered with or half-written is deleted and
fetched again. If the fresh copy does not match either, or the archive cannot
be read even after one fresh fetch, the job stops with a SourceError (exit 6),
one line, and nothing unverified is ever used. The cache's files (the lock,
cached and partial downloads) are opened without following a link or waiting
on a FIFO: anything but a regular file there is refused, one line, exit 2.
"""

from __future__ import annotations

import hashlib
import os
import urllib.parse
import urllib.request
from collections.abc import Callable
from pathlib import Path
from typing import BinaryIO, TypeVar

import requests
from packaging.tags import sys_tags
from packaging.utils import InvalidWheelFilename, parse_wheel_filename
from packaging.version import InvalidVersion, Version
from pypi_simple import DigestMismatchError, DistributionPackage, NoDigestsError, NoSuchProjectError, PyPISimple

from .errors import SourceError, UsageError
from .files import open_regular
from .lock import held
from .pipconfig import PYPI, IndexSettings
from .progress import ByteBar, megabytes, say, step
from .regular import own_folder

PROJECT = "vllm"
T = TypeVar("T")


class ReleaseFiles:
    """vLLM's release files on the package indexes of ``settings`` (default: PyPI, no pip
    configuration), cached under ``cache`` (``cache/sdists``, ``cache/wheels``)."""

    def __init__(self, cache: Path, settings: IndexSettings | None = None) -> None:
        self.cache = cache
        self.settings = settings or IndexSettings()
        self._page: list[DistributionPackage] | None = None

    def packages(self) -> list[DistributionPackage]:
        """Every file the indexes list for vLLM, pip's index-url first (read once per
        instance). An extra index that cannot be read is passed over with a note, as pip
        does; SourceError when none can be read (offline, a certificate refused)."""
        if self._page is None:
            page, failures = [], []
            for url in self.settings.indexes:
                if _local_without_vllm(url):
                    continue  # a file:// index (requests cannot read one) that has no vLLM anyway
                try:
                    with self._index(url) as index:
                        page += index.get_project_page(PROJECT).packages
                except NoSuchProjectError:
                    continue
                except requests.RequestException as err:
                    failures.append(_reason(err))
            if failures and (len(failures) == len(self.settings.indexes) or not page):
                raise SourceError(f"cannot reach the package index: {failures[0]}")
            for reason in failures:
                say(f"a package index pip names cannot be read; passed over: {reason}")
            self._page = page
        return self._page

    def sdist(self, version: Version) -> DistributionPackage:
        """The release sdist of ``version``. UsageError if the index has none."""
        found = [p for p in self.packages() if p.package_type == "sdist" and _version(p) == version]
        if not found:
            raise UsageError(f"vLLM {version} has no release sdist on the package index "
                             f"(python apply.py --list-releases lists the known ones)")
        return found[0]

    def wheel(self, version: Version) -> DistributionPackage:
        """The release wheel of ``version`` that best fits this interpreter and platform.

        UsageError if the index has none that installs here (then give
        ``--release-wheel``).
        """
        tags: dict[str, DistributionPackage] = {}
        for pkg in self.packages():
            if pkg.package_type == "wheel" and _version(pkg) == version and not pkg.is_yanked:
                try:
                    _, _, _, file_tags = parse_wheel_filename(pkg.filename)
                except InvalidWheelFilename:
                    continue
                for tag in file_tags:
                    tags.setdefault(str(tag), pkg)
        for tag in sys_tags():  # most specific first, as pip ranks them
            if str(tag) in tags:
                return tags[str(tag)]
        raise UsageError(f"vLLM {version} has no release wheel for this platform on the package "
                         f"index; give one with --release-wheel")

    def latest(self) -> Version:
        """The newest final release with an sdist on the index. SourceError offline."""
        found = {_version(p) for p in self.packages() if p.package_type == "sdist" and not p.is_yanked}
        finals = [v for v in found if v is not None and not v.is_prerelease and not v.is_devrelease]
        if not finals:
            raise SourceError("the package index lists no vLLM release sdist")
        return max(finals)

    def use(self, pkg: DistributionPackage, read: Callable[[Path], T]) -> T:
        """``read(path)`` of ``pkg``'s file, verified against the index's sha256 first.

        A cached file that does not match is deleted and downloaded again; an
        archive ``read`` cannot open (it raises SourceError) is deleted and
        fetched again once. Raises SourceError (exit 6) when the second copy
        fails too, or the index cannot be reached.
        """
        for attempt in (1, 2):
            path = self.fetch(pkg)
            try:
                return read(path)
            except SourceError as err:
                path.unlink(missing_ok=True)
                if attempt == 2:
                    raise SourceError(f"{pkg.filename} from the package index matches its sha256 "
                                      f"but cannot be read, even fetched again: {err}") from err
                say(f"{pkg.filename} cannot be read ({err}); fetching it again")
        raise AssertionError("unreachable")

    def fetch(self, pkg: DistributionPackage) -> Path:
        """The path of ``pkg``'s file, downloaded unless a cached copy matches the index's sha256.

        Raises SourceError if the index publishes no sha256 for it, the download
        does not match, or the index cannot be reached; UsageError if something
        other than a regular file sits where the cache keeps its files.
        """
        expected = pkg.digests.get("sha256")
        if not expected:
            raise SourceError(f"the package index publishes no sha256 for {pkg.filename}; "
                              f"refusing to use it unchecked")
        target = self._path(pkg)
        with held(target.parent / ".lock"):  # two jobs on one cache must not write one file
            try:
                fd = open_regular(target, os.O_RDONLY)
            except FileNotFoundError:
                pass
            else:
                with open(fd, "rb") as cached:
                    if _sha256(cached) == expected:
                        return target
                say(f"cached {target.name} does not match the index's sha256; fetching it again")
                target.unlink()
            self._download(pkg, target)
        return target

    def _download(self, pkg: DistributionPackage, target: Path) -> None:
        """Download ``pkg`` to ``target``, verified; only a complete, matching file lands there."""
        partial = target.with_name(target.name + ".part")
        # pypi-simple opens it by name, following a link: be sure it is a plain file first
        os.close(open_regular(partial, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644))
        try:
            size = f" ({megabytes(pkg.size)})" if pkg.size else ""
            with step(f"downloading {pkg.filename}{size}"), self._index(None) as index:
                index.download_package(pkg, partial, verify=True,
                                       progress=lambda total: ByteBar(total, pkg.filename))
        except BaseException as err:
            partial.unlink(missing_ok=True)
            if isinstance(err, requests.RequestException):
                raise SourceError(f"cannot download {pkg.filename}: {_reason(err)}") from err
            if isinstance(err, (DigestMismatchError, NoDigestsError)):
                raise SourceError(f"{pkg.filename} from the package index does not match its "
                                  f"sha256") from err
            if isinstance(err, OSError):  # writing: the cache's disk full, a quota, read-only
                raise UsageError(f"cannot download {pkg.filename} into {target.parent}: "
                                 f"{err.strerror or err}") from err
            raise
        os.replace(partial, target)

    def _path(self, pkg: DistributionPackage) -> Path:
        name = pkg.filename
        if Path(name).name != name or name.startswith("."):  # the index names the file we write
            raise SourceError(f"the package index names a file {name!r}; refusing to write it")
        return own_folder(self.cache / ("sdists" if pkg.package_type == "sdist" else "wheels")) / name

    def _index(self, url: str | None) -> PyPISimple:
        """A client of index ``url`` (None: only to download a listed file's own URL)."""
        return PyPISimple(endpoint=url or PYPI, session=self.settings.session())


def _local_without_vllm(url: str) -> bool:
    """True for a ``file://`` index with no ``vllm/`` project folder (this machine's own pip
    configuration has two): nothing there to miss, so nothing to say."""
    parts = urllib.parse.urlsplit(url)
    if parts.scheme != "file":
        return False
    return not (Path(urllib.request.url2pathname(parts.path)) / PROJECT).exists()


def file_sha256(path: Path) -> str:
    """Hex sha256 of the file at ``path``, read in 1 MiB blocks."""
    with open(path, "rb") as f:
        return _sha256(f)


def _sha256(stream: BinaryIO) -> str:
    digest = hashlib.sha256()
    for block in iter(lambda: stream.read(1 << 20), b""):
        digest.update(block)
    return digest.hexdigest()


def _version(pkg: DistributionPackage) -> Version | None:
    try:
        return Version(pkg.version) if pkg.version else None
    except InvalidVersion:
        return None


def _reason(err: requests.RequestException) -> str:
    """The first line of a requests error (they can run to a page of urllib3 detail)."""
    return (str(err).splitlines() or [type(err).__name__])[0]
