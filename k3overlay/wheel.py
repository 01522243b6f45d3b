"""Internal vLLM wheels from the patched tree (``apply.py --build-wheel``).

Our series and overlay change Python files only, so the compiled extensions of
the matching vLLM release are reused rather than rebuilt (a CUDA build is hours
and a GPU toolchain). Two methods:

- ``repack`` (default): the release wheel of the tree's vLLM version with the
  Python files the series and overlay changed under ``vllm/`` put in (added,
  replaced, deleted); ``vllm/_version.py`` and the dist-info carry the local
  version ``X.Y.Z+k3ov.<VERSION>``; ``WHEEL``'s ``Tag:`` lines agree with the
  file name (vLLM's say ``linux_x86_64`` in a ``manylinux_2_28`` wheel); every
  entry is dated from the patched commit, so one tree gives one wheel, bit for bit.
- ``vllm``: vLLM's own precompiled build (``VLLM_USE_PRECOMPILED=1`` against
  the release wheel) in a disposable ``git archive`` export, never the
  checkout (the build would dirty it and setuptools-scm would add a date
  suffix). It needs the CUDA torch the tree pins, in this Python.

Both add ``vllm/k3_overlay.json``, the provenance record (``provenance``).
Both are refused (UsageError, exit 2) unless reusing the release's compiled
code is sound (``check_sound``, ``check_release``), and every wheel is checked
(``wheelcheck``) before it lands in the wheel folder.
"""

from __future__ import annotations

import ast
import contextlib
import hashlib
import json
import os
import subprocess
import sys
import tarfile
import tomllib
import zipfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from packaging.requirements import InvalidRequirement, Requirement
from packaging.utils import parse_wheel_filename
from packaging.version import InvalidVersion, Version
from wheel.wheelfile import WheelError, WheelFile

from . import git, reaper, releases, source, untar, wheelcheck
from .downloads import ReleaseFiles, file_sha256
from .wheelrelease import PACKAGE, RECORD_PATH, check_release, readable  # noqa: F401  (tests read it here)
from .wheelrelease import opened as _opened
from .wheelrelease import release_wheel as _release_wheel
from .errors import BuildError, OverlayError, SourceError, UsageError
from .files import write_in_tree
from .lock import owned_scratch
from .mirror import release_of
from .progress import ByteBar, step
from .project import Project
from .redact import redact
from .report import Report
from .series import load as load_series

REPACK, VLLM = "repack", "vllm"
METHODS = (REPACK, VLLM)
LABEL = "k3ov"  # the local version label: X.Y.Z+k3ov.<VERSION>
VERSION_PY = "vllm/_version.py"
RECORD_FORMAT = 1
# Paths that feed vLLM's compiled code or its wheel's metadata: a change to any of them
# makes the release wheel's .so files (or its dependency list) wrong for the tree.
BUILD_INPUTS = ("csrc/", "cmake/", "rust/", "requirements/", "CMakeLists.txt", "setup.py",
                "setup.cfg", "pyproject.toml", "build_rust.sh", "rust-toolchain.toml")
# vLLM's build: for CUDA, the compiled code taken from a release wheel rather than built.
VLLM_BUILD_ENV = {"VLLM_TARGET_DEVICE": "cuda", "VLLM_USE_PRECOMPILED": "1"}
PRINT_RECORD = ("python -c \"import importlib.util, pathlib; print(pathlib.Path(importlib.util."
                "find_spec('vllm').origin).with_name('k3_overlay.json').read_text())\"")


@dataclass(frozen=True)
class WheelOptions:
    """What the user asked for: where wheels go, how to build, an optional local release wheel."""

    wheel_dir: Path
    method: str = REPACK
    release_wheel: Path | None = None


@dataclass(frozen=True)
class BuiltWheel:
    path: Path
    size: int  # bytes
    sha256: str
    method: str

    def to_json(self) -> dict:
        return {"name": self.path.name, "path": str(self.path), "size": self.size,
                "sha256": self.sha256, "method": self.method}


def build_for(project: Project, repo: git.Repo, report: Report, result_sha: str,
              opts: WheelOptions) -> dict:
    """``build`` as a report's ``wheel`` entry: the wheel's JSON (name, path, size in bytes,
    sha256, method), or ``error`` and its ``exit_code`` when it was refused or failed."""
    try:
        return build(project, repo, report, result_sha, opts, source.release_files()).to_json()
    except OverlayError as err:
        return {"error": str(err), "exit_code": err.exit_code}


@dataclass(frozen=True)
class Plan:
    """What a wheel will be, every refusal already passed.

    ``put``: wheel path -> new content (None: deleted); the tree's changes under
    ``vllm/`` and ``stamp``. ``stamp``: our ``vllm/_version.py`` and provenance
    record. ``epoch``: the date of every entry (seconds, UTC).
    """

    release_wheel: Path
    version: Version
    put: dict[str, bytes | None]
    stamp: dict[str, bytes]
    epoch: int


def build(project: Project, repo: git.Repo, report: Report, result_sha: str, opts: WheelOptions,
          files: ReleaseFiles) -> BuiltWheel:
    """Build and check the wheel of patched commit ``result_sha`` (on ``report.ref_sha``).

    Raises UsageError (exit 2) when it would not be sound or the build
    environment cannot do it, SourceError (exit 6) when the release wheel
    cannot be fetched, BuildError (exit 5) when the build or a check fails.
    """
    p = plan(project, repo, report, result_sha, opts, files)
    try:
        opts.wheel_dir.mkdir(parents=True, exist_ok=True)
    except OSError as err:
        raise UsageError(f"wheel folder {opts.wheel_dir}: cannot create it ({err.strerror})") from err
    with contextlib.ExitStack() as stack:
        with _writing_in(opts.wheel_dir):  # (a killed build's scratch folder is removed first)
            tmp = stack.enter_context(owned_scratch(opts.wheel_dir, ".k3-wheel-"))
        with _writing_in(opts.wheel_dir):
            if opts.method == VLLM:
                built = _vllm_build(repo, result_sha, p, Path(tmp))
            else:
                built = Path(tmp) / wheel_name(p.release_wheel.name, p.version)
                repack(p.release_wheel, built, p.version, p.put, p.epoch)
        with step(f"checking {built.name}"):
            wheelcheck.check(built, p.release_wheel, p.version, p.put)
        final = opts.wheel_dir / built.name
        with _writing_in(opts.wheel_dir):
            os.replace(built, final)  # only a checked wheel lands in the wheel folder
    return BuiltWheel(final, final.stat().st_size, file_sha256(final), opts.method)


@contextlib.contextmanager
def _writing_in(wheel_dir: Path) -> Iterator[None]:
    """A write error in the wheel folder (a full disk, a read-only mount) as one line naming
    the folder, exit 2 like a report that cannot be written. Errors reading the release
    wheel are not these: ``wheelrelease.opened`` and ``_read`` name that wheel."""
    try:
        yield
    except OSError as err:
        raise UsageError(f"--wheel-dir {wheel_dir}: cannot write the wheel there "
                         f"({err.strerror or err})") from err


def plan(project: Project, repo: git.Repo, report: Report, result_sha: str, opts: WheelOptions,
         files: ReleaseFiles) -> Plan:
    """Check that a wheel of ``result_sha`` can be built soundly, fetch the release wheel
    (or take ``opts.release_wheel``) and say what goes in. Raises as ``build`` does."""
    release = release_version(repo, report.ref, report.ref_sha)
    version = local_version(release, project.version)
    changes = changed_files(repo, report.ref_sha, result_sha)
    check_sound(changes)
    if opts.method == VLLM:
        check_build_env(torch_pin(repo, result_sha), torch_in(sys.executable))
    release_wheel = _release_wheel(opts.release_wheel, files, release)
    check_release(repo, report.ref_sha, release_wheel, release)
    record = provenance(project, repo, report, result_sha, version, opts.method, release_wheel)
    release_py = _member(release_wheel, VERSION_PY).decode()
    # _version.py names what the wheel is built from (the patched commit); the release's own
    # upstream commit id stays in the provenance record.
    recorded = releases.recorded_commit(release_py)
    record["target"]["commit_id"] = recorded and f"g{recorded}"  # as the release's file says it
    stamp = {VERSION_PY: releases.with_commit(versioned(release_py, version), result_sha).encode(),
             RECORD_PATH: record_bytes(record)}
    put = {p: data for p, data in changes.items() if p.startswith(PACKAGE)} | stamp
    epoch = source_date_epoch()
    return Plan(release_wheel, version, put, stamp,
                git.commit_time(repo, result_sha) if epoch is None else epoch)


LAST_ZIP_SECOND = 4354819199  # 2107-12-31 23:59:59 UTC: the last date a zip entry can hold


def source_date_epoch() -> int | None:
    """``$SOURCE_DATE_EPOCH`` (seconds since 1970, UTC): the date of every entry of a wheel
    built, or None when unset or empty (the patched commit's date is used). Raises
    UsageError (one line) unless it is a whole number of seconds a zip can date (0 to the
    end of 2107), as the reproducible-builds spec says (no sign, no fraction, no space):
    read before any work, not after publishing, where it ended in a traceback."""
    value = os.environ.get("SOURCE_DATE_EPOCH", "")
    if not value:
        return None
    if len(value) > 10 or not value.isascii() or not value.isdigit() or int(value) > LAST_ZIP_SECOND:
        raise UsageError(f"SOURCE_DATE_EPOCH={value[:40]!r} is not a whole number of seconds "
                         f"since 1970 that a wheel's zip entries can hold (0 to {LAST_ZIP_SECOND}); "
                         f"give one such as 1700000000, or unset it")
    return int(value)


def release_version(repo: git.Repo, ref: str, ref_sha: str) -> Version:
    """The vLLM release ``ref`` is: ``vllm/_version.py`` in its tree (sdist trees carry
    one), else a ``vX.Y.Z`` ref name. UsageError if neither says, or it is no release."""
    blob = git.blob_at(repo, ref_sha, VERSION_PY)
    found = _assigned(git.read_blob(repo, blob).decode(errors="replace"), "__version__") if blob else None
    named = release_of(ref)
    try:
        version = Version(found) if found else named
    except InvalidVersion:
        version = None
    if version is None:
        raise UsageError(f"cannot tell which vLLM release {ref} is (no {VERSION_PY} and no vX.Y.Z "
                         f"name); build a wheel from a release")
    if named is not None and version != named:
        raise UsageError(f"{ref}'s {VERSION_PY} says vLLM {version}, not {named}")
    if version.local is not None or version.is_devrelease:
        raise UsageError(f"{ref} is vLLM {version}, not a published release: there is no release "
                         f"wheel whose compiled code matches it")
    return version


def local_version(release: Version, overlay_version: str) -> Version:
    """``X.Y.Z+k3ov.<VERSION>`` (PEP 440, normalized). UsageError if VERSION cannot be a label."""
    try:
        return Version(f"{release.public}+{LABEL}.{overlay_version}")
    except InvalidVersion as err:
        raise UsageError(f"VERSION {overlay_version!r} cannot be a PEP 440 local version label") from err


def changed_files(repo: git.Repo, ref_sha: str, result_sha: str) -> dict[str, bytes | None]:
    """``{path: content at result_sha, or None if deleted}`` of every path that differs."""
    changes = {}
    for path in git.changed_paths(repo, ref_sha, result_sha):
        blob = git.blob_at(repo, result_sha, path)
        changes[path] = None if blob is None else git.read_blob(repo, blob)
    return changes


def check_sound(changes: dict[str, bytes | None]) -> None:
    """Refuse (UsageError) unless the release's compiled code still fits the tree: every
    changed path under ``vllm/`` is Python, and no build input (``BUILD_INPUTS``) changed."""
    for path in sorted(changes):
        if path.startswith(PACKAGE) and not path.endswith(".py"):
            raise UsageError(f"cannot reuse the release's compiled code: {path} changed and is not "
                             f"Python (only .py files under vllm/ may change)")
        if any(path == p or (p.endswith("/") and path.startswith(p)) for p in BUILD_INPUTS):
            raise UsageError(f"cannot reuse the release's compiled code: {path} changed, and it "
                             f"feeds vLLM's compiled build or its wheel's metadata")


def _member(wheel: Path, path: str) -> bytes:
    """The bytes of ``path`` in ``wheel``; UsageError if it has none."""
    with _opened(wheel) as archive:
        if path not in archive.namelist():  # (WheelFile.read would blame its RECORD instead)
            raise UsageError(f"{wheel.name} has no {path}")
        return archive.read(path)


def wheel_name(release_name: str, version: Version) -> str:
    """``release_name`` (``vllm-X.Y.Z-<tags>.whl``) with ``version`` (no build tag)."""
    tags = release_name.removesuffix(".whl").split("-")[-3:]
    return "-".join(["vllm", str(version), *tags]) + ".whl"


def versioned(text: str, version: Version) -> str:
    """``vllm/_version.py`` text with its version and version tuple set to ``version``.

    Only the assigned values change; every other byte is the release's. The
    tuple follows setuptools-scm: release numbers, then the local label.
    Raises UsageError if the file assigns no ``__version__``.
    """
    data = text.encode()
    starts = [0]
    for line in data.splitlines(keepends=True):
        starts.append(starts[-1] + len(line))
    new = {"__version__": repr(str(version)), "version": repr(str(version)),
           "__version_tuple__": repr((*version.release, version.local)),
           "version_tuple": repr((*version.release, version.local))}
    edits = []
    for node, names in _assignments(text):
        hits = names & set(new)
        if hits:
            value = node.value
            edits.append((starts[value.lineno - 1] + value.col_offset,
                          starts[value.end_lineno - 1] + value.end_col_offset, new[sorted(hits)[0]]))
    if not any(start for start, _, _ in edits) or _assigned(text, "__version__") is None:
        raise UsageError(f"{VERSION_PY} assigns no __version__; cannot set the local version")
    for start, end, value in sorted(edits, reverse=True):
        data = data[:start] + value.encode() + data[end:]
    return data.decode()


def _assignments(text: str):
    """(node, target names) of each top-level assignment with a value."""
    for node in ast.parse(text).body:
        targets = node.targets if isinstance(node, ast.Assign) else (
            [node.target] if isinstance(node, ast.AnnAssign) and node.value is not None else [])
        names = {t.id for t in targets if isinstance(t, ast.Name)}
        if names:
            yield node, names


def _assigned(text: str, name: str) -> str | None:
    """The string literal assigned to ``name`` at top level, or None."""
    try:
        found = [node.value.value for node, names in _assignments(text) if name in names
                 and isinstance(node.value, ast.Constant) and isinstance(node.value.value, str)]
    except SyntaxError:
        return None
    return found[-1] if found else None


def provenance(project: Project, repo: git.Repo, report: Report, result_sha: str,
               version: Version, method: str, release_wheel: Path) -> dict:
    """The record shipped as ``vllm/k3_overlay.json``: what was built from what, and how.

    Shas are the release mirror's (the same on every machine) and
    ``series_sha256`` is the sha256 of the patch files, concatenated in series order.
    """
    series = load_series(project.patches_dir)
    digest = hashlib.sha256()
    for patch in series:
        digest.update(patch.path.read_bytes())
    return {
        "format": RECORD_FORMAT,
        "overlay_version": project.version,
        "vllm_version": str(version),
        "base": {"ref": report.base_ref, "sha": git.resolve(repo, report.base_ref)},
        "target": {"ref": report.ref, "sha": report.ref_sha},
        "result_sha": result_sha,
        "series_sha256": digest.hexdigest(),
        "patches": [{"name": p.name, "status": p.status} for p in report.patches],
        "overlay": [{"path": f.path, "status": f.status, "blob": git.blob_at(repo, result_sha, f.path)}
                    for f in report.overlay],
        "tool": {"name": "vllm-k3-overlay", "version": project.version,
                 "commit": _commit_of(project.root)},
        "build": {"method": method, "release_wheel": release_wheel.name,
                  "release_wheel_sha256": file_sha256(release_wheel)},
    }


def record_bytes(record: dict) -> bytes:
    return (json.dumps(record, indent=2, sort_keys=True) + "\n").encode()


def _commit_of(root: Path) -> str | None:
    """The commit this tool was run from (``-dirty`` when its checkout has changes), or None."""
    try:
        repo = git.open_repo(root)
    except git.GitError:
        return None
    sha = git.resolve(repo, "HEAD")
    return sha and sha + ("-dirty" if git.is_dirty(repo) else "")


def repack(source: Path, dest: Path, version: Version, put: dict[str, bytes | None],
           epoch: int) -> None:
    """Write wheel ``dest``: ``source``'s entries with ``put`` applied, as vLLM ``version``.

    ``put`` maps a path to its new content, or None to delete it; paths the
    source lacks are added after its own. The dist-info is renamed for
    ``version``, METADATA's ``Version`` set, WHEEL's ``Tag`` lines set to
    ``dest``'s file name, RECORD rewritten (by ``wheel``'s WheelFile).
    Every entry is dated ``epoch`` (seconds, UTC). Raises SourceError if
    ``source`` fails its own RECORD.
    """
    when = _date_time(epoch)
    # the epoch outlives the WheelFile: it dates the RECORD it writes as it closes
    with _source_date_epoch(epoch), _opened(source) as src, WheelFile(dest, "w") as out:
        old_info = src.dist_info_path
        new_info = f"vllm-{version}.dist-info"
        members = [i for i in src.infolist() if not i.is_dir()
                   and not i.filename.startswith(src.record_path)]  # RECORD(.jws/.p7s) is rewritten
        ours = [i for i in members if not i.filename.startswith(old_info + "/")]
        info = [i for i in members if i.filename.startswith(old_info + "/")]
        present = {i.filename for i in members}
        total = sum(i.file_size for i in members) + sum(len(d) for d in put.values() if d)
        with step(f"packing {dest.name}"), ByteBar(total, f"packing {dest.name}") as bar:
            for item in ours:
                if item.filename not in put:
                    data = _read(src, item)
                elif put[item.filename] is None:
                    continue
                else:
                    data = put[item.filename]
                _write(out, item.filename, data, item.external_attr, when)
                bar.update(item.file_size)
            for path in sorted(set(put) - present):
                if put[path] is not None:
                    _write(out, path, put[path], (0o100644 << 16), when)
                    bar.update(len(put[path]))
            for item in info:
                name = new_info + item.filename[len(old_info):]
                data = _read(src, item)
                if name == f"{new_info}/METADATA":
                    data = _set_header(data, "Version", [str(version)])
                elif name == f"{new_info}/WHEEL":
                    _, _, _, tags = parse_wheel_filename(dest.name)
                    data = _set_header(data, "Tag", sorted(str(t) for t in tags))
                _write(out, name, data, item.external_attr, when)
                bar.update(item.file_size)


def _date_time(epoch: int) -> tuple[int, int, int, int, int, int]:
    from time import gmtime

    return tuple(gmtime(max(epoch, 315532800))[:6])  # zip cannot date before 1980


@contextlib.contextmanager
def _source_date_epoch(epoch: int) -> Iterator[None]:
    """WheelFile dates the RECORD it writes on close by ``$SOURCE_DATE_EPOCH``, else by now."""
    before = os.environ.get("SOURCE_DATE_EPOCH")
    os.environ["SOURCE_DATE_EPOCH"] = str(epoch)
    try:
        yield
    finally:
        if before is None:
            del os.environ["SOURCE_DATE_EPOCH"]
        else:
            os.environ["SOURCE_DATE_EPOCH"] = before


def _read(src: WheelFile, item: zipfile.ZipInfo) -> bytes:
    try:
        return src.read(item)  # WheelFile checks the bytes against the source's RECORD
    except (WheelError, zipfile.BadZipFile, EOFError) as err:
        raise SourceError(f"{Path(src.filename).name}: {item.filename}: {err}") from err


def _write(out: WheelFile, name: str, data: bytes, attr: int, when: tuple) -> None:
    entry = zipfile.ZipInfo(name, date_time=when)
    entry.external_attr = attr or (0o100644 << 16)
    entry.compress_type = zipfile.ZIP_DEFLATED
    out.writestr(entry, data)


def _set_header(data: bytes, field: str, values: list[str]) -> bytes:
    """An RFC 822 style file (METADATA, WHEEL) with every ``field:`` header line replaced
    by one per value, at the first one's place; the body is kept byte for byte."""
    head, sep, body = data.partition(b"\n\n")
    lines = head.split(b"\n")
    key = field.encode() + b":"
    at = next((i for i, line in enumerate(lines) if line.startswith(key)), len(lines))
    kept = [line for line in lines if not line.startswith(key)]
    new = [f"{field}: {value}".encode() for value in values]
    lines = kept[:at] + new + kept[at:]
    return b"\n".join(lines) + sep + body


def torch_pin(repo: git.Repo, sha: str) -> str:
    """The torch requirement of the tree's ``[build-system]`` (e.g. ``torch==2.13.0``); empty
    if it names none."""
    blob = git.blob_at(repo, sha, "pyproject.toml")
    if blob is None:
        return ""
    try:
        requires = tomllib.loads(git.read_blob(repo, blob).decode())["build-system"]["requires"]
    except (tomllib.TOMLDecodeError, KeyError, TypeError, UnicodeDecodeError):
        return ""
    for text in requires:
        try:
            req = Requirement(text)
        except InvalidRequirement:
            continue
        if req.name == "torch":
            return str(req)
    return ""


def torch_in(python: str) -> tuple[str, str | None] | None:
    """``(torch.__version__, torch.version.cuda)`` of interpreter ``python``, None without torch."""
    probe = "import json, torch; print(json.dumps([torch.__version__, torch.version.cuda]))"
    try:
        proc = reaper.run([python, "-c", probe], capture_output=True, text=True)
    except OSError:
        return None
    if proc.returncode != 0:
        return None
    try:
        version, cuda = json.loads(proc.stdout.strip().splitlines()[-1])
    except (ValueError, IndexError):
        return None
    return str(version), cuda


def check_build_env(pin: str, torch: tuple[str, str | None] | None) -> None:
    """Refuse (UsageError) a ``--wheel-build vllm`` whose build environment would give a
    wrong wheel: no torch, a torch without CUDA (vLLM would quietly build a ``cpu``
    wheel with another dependency list), or not the torch the tree pins."""
    wanted = pin or "torch (CUDA build)"
    fix = f"install {wanted} from a CUDA index into this Python, or use --wheel-build repack"
    if torch is None:
        raise UsageError(f"--wheel-build vllm needs torch in this Python ({sys.executable}); {fix}")
    version, cuda = torch
    if cuda is None:
        raise UsageError(f"--wheel-build vllm needs a CUDA torch, and this Python's torch {version} "
                         f"has no CUDA (vLLM would build a CPU wheel); {fix}")
    if pin and not Requirement(pin).specifier.contains(version, prereleases=True):
        raise UsageError(f"--wheel-build vllm: the tree pins {pin}, this Python has torch {version}; "
                         f"{fix}")


def _vllm_build(repo: git.Repo, result_sha: str, p: Plan, tmp: Path) -> Path:
    """vLLM's precompiled build of ``result_sha`` in a ``git archive`` export, then
    ``p.stamp`` put in (``repack``); returns the wheel (in ``tmp``). Raises BuildError
    if the build fails or gives another version."""
    export, out, log = tmp / "src", tmp / "out", tmp / "vllm-build.log"
    with step(f"exporting {result_sha[:12]} with git archive"):
        git.archive(repo, result_sha, tmp / "src.tar")
        with tarfile.open(tmp / "src.tar") as archive:
            untar.extract(archive, export)
    env = {**os.environ, **VLLM_BUILD_ENV, "VLLM_PRECOMPILED_WHEEL_LOCATION": str(p.release_wheel),
           "VLLM_VERSION_OVERRIDE": str(p.version), "SOURCE_DATE_EPOCH": str(p.epoch)}
    python_tag, abi, _ = p.release_wheel.name.removesuffix(".whl").split("-")[-3:]
    if abi == "abi3":  # tag the wheel as the release is (cp38-abi3), not for this interpreter
        config = tmp / "dist.cfg"
        config.write_text(f"[bdist_wheel]\npy_limited_api = {python_tag}\n")
        env["DIST_EXTRA_CONFIG"] = str(config)
    command = [sys.executable, "-m", "pip", "wheel", "--no-index", "--no-deps",
               "--no-build-isolation", "--wheel-dir", str(out), str(export)]
    with step("vLLM's precompiled build (pip wheel, VLLM_USE_PRECOMPILED=1)"), open(log, "w") as f:
        # (through the watchdog: a killed tool's build is stopped, not left compiling)
        code = reaper.run(command, env=env, stdout=f, stderr=subprocess.STDOUT).returncode
    built = sorted(out.glob("vllm-*.whl")) if out.is_dir() else []
    if code != 0 or len(built) != 1:
        kept = tmp.parent / "vllm-build.log"  # the wheel folder: tmp goes away
        try:
            # never through a link there, and with no secret a build step printed (a URL's
            # password in a fetch's error line): the log is an output like any report
            text = redact(log.read_bytes().decode("utf-8", "surrogateescape"))
            write_in_tree(tmp.parent, kept.name, text.encode("utf-8", "surrogateescape"))
            where = f"log: {kept}"
        except UsageError as err:
            where = f"log not kept: {err}"
        last = (log.read_text(errors="replace").strip().splitlines() or ["no output"])[-1]
        raise BuildError(f"vLLM's build failed (exit {code}): {last[:200]} ({where})")
    if parse_wheel_filename(built[0].name)[1] != p.version:
        raise BuildError(f"vLLM's build gave {built[0].name}, not version {p.version}")
    stamped = tmp / built[0].name
    repack(built[0], stamped, p.version, p.stamp, p.epoch)
    return stamped
