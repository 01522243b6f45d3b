"""Checks of a built wheel against the release wheel it came from and the patched tree.

Kept apart from the builder (``wheel``), sharing none of its code, so a mistake
in how a wheel is written shows up here. Checked, in one pass over both wheels:

- nothing ``wheelentries`` refuses: every entry a regular file with a safe name, under
  ``vllm/`` or the dist-info, no ``.pth`` file, no link, RECORD listing exactly the entries;
- the dist-info's other files (entry points, licenses) are the release's, byte for byte;
- every entry of both matches its RECORD hash (``wheel``'s WheelFile checks
  it as an entry is read), and RECORD lists exactly the entries;
- one dist-info, ``vllm-<version>.dist-info``; the file name's name and version,
  METADATA's (validated by ``packaging.metadata``), and WHEEL's ``Tag:`` lines
  agree with it;
- the files are the release's, plus those added, less those deleted;
- a file put in (changed or added) holds exactly the bytes given for it, every
  other one (the ``.so`` files among them) the release's bytes;
- ``vllm/_version.py`` says ``__version__ = '<version>'``;
- ``pip install --no-deps --target`` into a temporary folder succeeds.
"""

from __future__ import annotations

import ast
import csv
import hashlib
import io
import sys
import tempfile
import zipfile
from email.parser import BytesParser
from pathlib import Path

from packaging.metadata import InvalidMetadata, Metadata
from packaging.utils import InvalidWheelFilename, parse_wheel_filename
from packaging.version import Version
from wheel.wheelfile import WheelError, WheelFile

from . import reaper, wheelentries
from .errors import BuildError
from .progress import ByteBar

VERSION_PY = "vllm/_version.py"


def check(built: Path, release: Path, version: Version, put: dict[str, bytes | None]) -> None:
    """Raise BuildError (one line: the first problem, and how many more) unless ``built``
    is ``release`` with ``put`` applied (content, or None for deleted) as vLLM ``version``."""
    problems = _problems(built, release, version, put)
    if not problems:
        problems = _install(built)
    if problems:
        more = f" (and {len(problems) - 1} more)" if len(problems) > 1 else ""
        raise BuildError(f"{built.name} failed its checks: {problems[0]}{more}")


def _problems(built: Path, release: Path, version: Version, put: dict[str, bytes | None]) -> list[str]:
    try:
        name, file_version, _, tags = parse_wheel_filename(built.name)
    except InvalidWheelFilename as err:
        return [f"bad file name: {err}"]
    problems = []
    if name != "vllm" or file_version != version:
        problems.append(f"file name says {name} {file_version}, not vllm {version}")
    new, new_info = _digests(built, problems)
    old, _ = _digests(release, problems)
    if problems:
        return problems
    want_info = f"vllm-{version}.dist-info"
    if new_info != [want_info]:
        return [f"dist-info folders {new_info}, not [{want_info!r}]"]
    problems += wheelentries.problems(built, wheelentries.Expected("vllm", want_info, None))
    problems += _metadata(built, want_info, version, {str(t) for t in tags})
    problems += _info_files(new, old, want_info)
    payload = {p: d for p, d in new.items() if not p.startswith(want_info + "/")}
    released = {p: d for p, d in old.items() if ".dist-info/" not in p}
    expected = (set(released) | {p for p, d in put.items() if d is not None}) - \
        {p for p, d in put.items() if d is None}
    problems += [f"{p} is missing" for p in sorted(expected - set(payload))]
    problems += [f"{p} should not be there" for p in sorted(set(payload) - expected)]
    for path in sorted(expected & set(payload)):
        want = hashlib.sha256(put[path]).hexdigest() if path in put else released[path]
        if payload[path] != want:
            source = "the patched tree's" if path in put else "the release's"
            problems.append(f"{path} is not {source}")
    problems += _version_py(built, version)
    return problems


def _info_files(new: dict[str, str], old: dict[str, str], info: str) -> list[str]:
    """The dist-info's other files (entry_points.txt, top_level.txt, licenses) are the
    release's, byte for byte: none added, none dropped, none changed."""
    rewritten = {"METADATA", "WHEEL", "RECORD"}
    ours = {p.split("/", 1)[1]: d for p, d in new.items() if p.startswith(info + "/")}
    theirs = {p.split("/", 1)[1]: d for p, d in old.items()
              if p.split("/")[0].endswith(".dist-info") and "/" in p}
    names = (set(ours) | set(theirs)) - rewritten - {"RECORD.jws", "RECORD.p7s"}
    return [f"{info}/{name} is not the release's" for name in sorted(names)
            if ours.get(name) != theirs.get(name)]


def _digests(path: Path, problems: list[str]) -> tuple[dict[str, str], list[str]]:
    """``{entry: sha256}`` of every file entry, read (and so RECORD-checked) in full, and the
    wheel's top-level dist-info folders; appends to ``problems`` what does not hold."""
    digests: dict[str, str] = {}
    try:
        with WheelFile(path) as wheel:
            entries = [i for i in wheel.infolist() if not i.is_dir()]
            with ByteBar(sum(i.file_size for i in entries), f"checking {path.name}") as bar:
                for info in entries:
                    digest = hashlib.sha256()
                    with wheel.open(info) as stream:
                        for block in iter(lambda: stream.read(1 << 20), b""):
                            digest.update(block)
                    digests[info.filename] = digest.hexdigest()
                    bar.update(info.file_size)
            listed = _record_paths(wheel)
    except (WheelError, zipfile.BadZipFile, OSError, EOFError) as err:
        problems.append(f"{path.name}: {err}")
        return {}, []
    # An entry RECORD does not list, WheelFile already refused above.
    problems += [f"{path.name}: RECORD lists {p}, which is not there"
                 for p in sorted(listed - set(digests))]
    infos = sorted({p.split("/")[0] for p in digests if p.split("/")[0].endswith(".dist-info")})
    return digests, infos


def _record_paths(wheel: WheelFile) -> set[str]:
    rows = csv.reader(io.StringIO(wheel.read(wheel.record_path).decode()))
    return {row[0] for row in rows if row and row[0] != wheel.record_path}


def _metadata(built: Path, info: str, version: Version, tags: set[str]) -> list[str]:
    with zipfile.ZipFile(built) as wheel:
        metadata, wheel_file = wheel.read(f"{info}/METADATA"), wheel.read(f"{info}/WHEEL")
    problems = []
    try:
        meta = Metadata.from_email(metadata, validate=True)
        if meta.name != "vllm" or meta.version != version:
            problems.append(f"METADATA says {meta.name} {meta.version}, not vllm {version}")
    except (InvalidMetadata, ExceptionGroup) as err:
        problems.append(f"METADATA does not validate: {err}")
    said = set(BytesParser().parsebytes(wheel_file).get_all("Tag") or [])
    if said != tags:
        problems.append(f"WHEEL's Tag lines {sorted(said)} disagree with the file name's {sorted(tags)}")
    return problems


def _version_py(built: Path, version: Version) -> list[str]:
    with zipfile.ZipFile(built) as wheel:
        try:
            text = wheel.read(VERSION_PY).decode()
        except KeyError:
            return [f"no {VERSION_PY}"]
    values = [node.value.value for node in ast.parse(text).body if isinstance(node, ast.Assign)
              and any(isinstance(t, ast.Name) and t.id == "__version__" for t in node.targets)
              and isinstance(node.value, ast.Constant)]
    if values != [str(version)]:
        return [f"{VERSION_PY} sets __version__ to {values}, not {str(version)!r}"]
    return []


def _install(built: Path) -> list[str]:
    """``pip install --no-deps --target`` into a temporary folder; [] if it worked. Pip runs
    through the watchdog (``reaper.run``): a killed tool's pip is stopped, not left installing."""
    with tempfile.TemporaryDirectory(prefix="k3-wheel-install-") as target:
        proc = reaper.run(
            [sys.executable, "-m", "pip", "install", "--isolated", "--no-deps", "--no-index",
             "--no-compile", "--disable-pip-version-check", "--quiet", "--target", target, str(built)],
            capture_output=True, text=True)
        if proc.returncode != 0:
            lines = [line for line in proc.stderr.splitlines() if line.strip()] or ["no output"]
            return [f"pip install --target failed: {lines[-1].strip()}"]
        if not (Path(target) / VERSION_PY).is_file():
            return [f"pip install --target left no {VERSION_PY}"]
    return []
