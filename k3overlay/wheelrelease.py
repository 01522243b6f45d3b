"""The release wheel a build reuses: fetched (or given), opened, and proven to be the release.

``release_wheel`` takes ``--release-wheel`` or the package index's file (cached,
checked against the index's sha256); ``check_release`` refuses (UsageError, exit 2,
one line) a wheel that is not the release the tree came from: another name or
version, a file under ``vllm/`` missing or not byte for byte the tree's, or any entry
``wheelentries`` refuses (links, odd names, ``.pth`` files, files the tree and its
build do not account for, a RECORD or entry points that do not match).
"""

from __future__ import annotations

import contextlib
import csv
import lzma
import zipfile
import zlib
from collections.abc import Iterator
from pathlib import Path

from packaging.utils import InvalidWheelFilename, parse_wheel_filename
from packaging.version import Version
from wheel.wheelfile import WheelError, WheelFile

from . import git, wheelentries
from .downloads import ReleaseFiles
from .errors import SourceError, UsageError

PACKAGE = "vllm/"
RECORD_PATH = "vllm/k3_overlay.json"


def release_wheel(local: Path | None, files: ReleaseFiles, release: Version) -> Path:
    """The release wheel: ``local`` (``--release-wheel``) or the index's, cached and verified."""
    if local is None:
        try:
            return files.use(files.wheel(release), readable)
        except SourceError as err:
            raise SourceError(f"{err} (offline, give the release wheel with --release-wheel)") from err
    if not local.is_file():
        raise UsageError(f"--release-wheel {local}: no such file")
    try:
        return readable(local)
    except SourceError as err:
        raise UsageError(f"--release-wheel {local}: {err}") from err


def check_release(repo: git.Repo, ref_sha: str, wheel: Path, release: Version) -> None:
    """Refuse (UsageError) unless ``wheel`` is vLLM ``release``, holds every file under
    ``vllm/`` at ``ref_sha`` byte for byte (the proof it is the release the tree came
    from) and nothing ``wheelentries`` refuses (every other file is a build output)."""
    try:
        name, version, _, _ = parse_wheel_filename(wheel.name)
    except InvalidWheelFilename as err:
        raise UsageError(f"{wheel.name} is not a wheel file name") from err
    if name != "vllm" or version != release:
        raise UsageError(f"{wheel.name} is not vLLM {release}'s wheel")
    expected = git.tree_files(repo, ref_sha, PACKAGE)
    width = len(ref_sha)
    names = wheelentries.names(wheel)
    if RECORD_PATH in names:
        raise UsageError(f"{wheel.name} already holds {RECORD_PATH}")
    if any(p.startswith(f"{'-'.join(wheel.name.split('-')[:2])}.data/") for p in names):
        raise UsageError(f"{wheel.name} has a .data folder; repacking handles wheels without one")
    # with plain zipfile first, whose every read is guarded: WheelFile parses RECORD as it
    # opens, and raised on a crafted one (a csv field over its limit, a hash without '=')
    wheelentries.check(wheel, expected_entries(repo, ref_sha, release, expected), UsageError)
    with opened(wheel) as archive:
        members = {i.filename: i for i in archive.infolist()}
        for info in members.values():
            _hash_checked(archive, info, wheel)
        bad = [f"{p} is not in it" if p not in members else f"{p} differs"
               for p, blob in sorted(expected.items())
               if p not in members or git.blob_id(archive.read(members[p]), width=width) != blob]
    if bad:
        more = f" (and {len(bad) - 1} more)" if len(bad) > 1 else ""
        raise UsageError(f"{wheel.name} is not the vLLM {release} the tree came from: {bad[0]}{more}")


def _hash_checked(archive: WheelFile, info: zipfile.ZipInfo, wheel: Path) -> None:
    """Read entry ``info`` whole, streamed; UsageError if its bytes do not match the hash its
    RECORD gives (WheelFile checks at the end). Every entry here, before the repack reads
    it: a lie found there was blamed on the package index, exit 6, for a file the user gave."""
    if info.is_dir():
        return
    try:
        with archive.open(info) as entry:
            while entry.read(1 << 20):
                pass
    except WheelError as err:
        raise UsageError(f"{wheel.name}: entry {info.filename!r}: {err}") from err


def expected_entries(repo: git.Repo, ref_sha: str, release: Version,
                     tree: dict[str, str]) -> wheelentries.Expected:
    """What vLLM ``release``'s wheel may hold, from the tree at ``ref_sha``: its files under
    ``vllm/`` (``tree``), the build outputs its ``.gitignore`` files name, the entry points
    its ``pyproject.toml`` declares, the dependencies its requirements files and setup.py name."""
    ignores = [".gitignore", *(p for p in tree if p.endswith("/.gitignore"))]
    requirements = [p for p in git.tree_files(repo, ref_sha, "requirements/") if p.endswith(".txt")]
    files = git.read_files(repo, ref_sha, ["pyproject.toml", "setup.py", *ignores, *requirements])
    naming = b"\n".join(files.get(p, b"") for p in ["pyproject.toml", "setup.py", *requirements])
    cuda = "requirements/cuda.txt"
    return wheelentries.Expected(
        package=PACKAGE.rstrip("/"), dist_info=f"vllm-{release}.dist-info",
        entry_points=wheelentries.declared_entry_points(files.get("pyproject.toml")),
        tree=frozenset(tree),
        build_outputs=wheelentries.ignore_specs({p: files[p] for p in ignores if p in files}),
        named_by_tree=naming.decode(errors="replace"),
        installs=frozenset(wheelentries.requirement_lines(files, cuda)) if cuda in files else None)


def readable(path: Path) -> Path:
    """``path`` if it opens as a wheel with a RECORD; SourceError if not."""
    with opened(path):
        return path


@contextlib.contextmanager
def opened(path: Path) -> Iterator[WheelFile]:
    """``path`` opened as a wheel. SourceError if it cannot be opened or read as one; an
    error of the block's own (writing another file, say) is passed on as it is, never
    blamed on this wheel."""
    try:
        archive = WheelFile(path)
    except (WheelError, zipfile.BadZipFile, OSError, EOFError, csv.Error, ValueError,
            NotImplementedError, RuntimeError, zlib.error, lzma.LZMAError) as err:
        # (its RECORD parsed as it opens: a row of other than 3 fields, a hash without '=',
        # a field over csv's limit, a compression method zipfile lacks)
        reason = (str(err).splitlines() or [type(err).__name__])[0]
        what = "its RECORD" if isinstance(err, (csv.Error, ValueError)) else "it"
        raise SourceError(f"{path.name} cannot be read as a wheel ({what}): {reason}") from err
    with archive:
        try:
            yield archive
        except (WheelError, zipfile.BadZipFile, EOFError) as err:
            raise SourceError(f"{path.name} cannot be read as a wheel: {err}") from err
