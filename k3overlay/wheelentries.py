"""What a vLLM wheel may hold: the release's files and ours, each a plain file, nothing else.

Checked on the release wheel as it comes in (``check``: a crafted ``--release-wheel``
is refused, UsageError, exit 2, one line naming the entry) and on the built wheel
before it is kept (``problems``, part of ``wheelcheck``: exit 5). Refused:

- a zip whose entries do not tile the file: bytes before, between or after them that
  no central-directory entry accounts for (where another unzipper, one that reads local
  headers as it streams, would find entries pip does not see), a local header whose name
  is not the central directory's, an archive comment, an encrypted entry; zip64 end
  records (past 65,535 entries or 4 GiB) are sound, unless they are not where their
  locator says or disagree with the classic end record;
- an entry that is not a regular file: a link (mode 0o120000), a folder, a device, a
  FIFO, a socket; setuid, setgid or sticky bits; a world-writable file;
- a name with a backslash, a ``:`` (a drive letter, an NTFS stream), a ``..``, ``.`` or
  empty part, a leading ``/``, a control or invisible (format) character;
- two names that are one file somewhere: the same name twice, or names equal after
  case folding and Unicode (NFKC) normalisation;
- a ``.pth`` file anywhere (``site`` runs its import lines at every Python start);
- an entry declaring more than 2 GiB unpacked, or more than 64 MiB packed tighter than
  64:1, or entries more than 16 GiB in all (a decompression bomb: each entry is read
  whole, and pip unpacks them all);
- anything outside ``vllm/`` and the one dist-info folder ``vllm-<version>.dist-info``
  (a ``.data`` folder: scripts, headers; a second dist-info); in the dist-info, a file
  other than METADATA, WHEEL, RECORD, top_level.txt, entry_points.txt, licenses/, sboms/;
- entry points (console scripts, plugins) other than those the tree's own
  ``pyproject.toml`` declares;
- a dependency (``Requires-Dist``) the tree does not ask for: one a CUDA build installs
  that ``requirements/cuda.txt`` (with its ``-r`` files) does not list as written, an
  extra's on a project the tree never names, a URL the tree does not hold;
- a RECORD that lists a file the zip lacks, lists one twice, or misses one (its hashes
  are checked as each entry is read: ``wheel``'s WheelFile);
- in a release wheel, a file under ``vllm/`` that the tree at the ref lacks, unless it
  is compiled code (``.so``) or the tree's own ``.gitignore`` names it as a build output
  (vLLM 0.28.0's names each of its wheel's 1,986 such files: ``vllm/vllm-rs``,
  ``vllm/third_party/deep_gemm/``, ``vllm/vllm_flash_attn/*``, …). A file added to a
  folder so named (``vllm/vllm_flash_attn/x.py``) is not caught here: only the index's
  sha256 (a wheel from the package index) proves those.
"""

from __future__ import annotations

import configparser
import contextlib
import csv
import email
import hashlib
import io
import lzma
import re
import stat
import struct
import tomllib
import unicodedata
import zipfile
import zlib
from dataclasses import dataclass, field
from pathlib import Path

import pathspec
from packaging.requirements import InvalidRequirement, Requirement
from packaging.utils import canonicalize_name

INFO_FILES = {"METADATA", "WHEEL", "RECORD", "top_level.txt", "entry_points.txt"}
INFO_FOLDERS = ("licenses/", "sboms/")  # PEP 639 licence files, PEP 770 SBOMs
COMPILED = (".so", ".pyd")  # extension modules: what reusing the release's build is for
_LOCAL = struct.Struct("<4s5H3L2H")  # a zip local file header (30 bytes)
_END = struct.Struct("<4s4H2LH")  # end of central directory record (22 bytes)
_END64 = struct.Struct("<4sQ2H2L4Q")  # zip64 end of central directory record (56 bytes)
_LOCATOR = struct.Struct("<4sLQL")  # zip64 end of central directory locator (20 bytes)
_KINDS = {stat.S_IFLNK: "a symbolic link", stat.S_IFDIR: "a folder", stat.S_IFCHR: "a device",
          stat.S_IFBLK: "a device", stat.S_IFIFO: "a FIFO", stat.S_IFSOCK: "a socket"}


@dataclass(frozen=True)
class Expected:
    """What the wheel should be: its package folder, dist-info folder and entry points
    (``{group: {name: value}}``); for a release wheel also the tree's files under the
    package (``tree``) and its ignore rules (``build_outputs``)."""

    package: str  # "vllm"
    dist_info: str  # "vllm-0.28.0.dist-info"
    entry_points: dict[str, dict[str, str]] | None  # None: the tree does not say (dynamic)
    tree: frozenset[str] | None = None
    build_outputs: list[tuple[str, pathspec.GitIgnoreSpec]] = field(default_factory=list)
    # the tree's text naming dependencies (requirements/*.txt, setup.py, pyproject.toml), and
    # the requirements a CUDA build installs (requirements/cuda.txt with its -r files)
    named_by_tree: str | None = None
    installs: frozenset[str] | None = None


def check(wheel: Path, expected: Expected, error: type[Exception]) -> None:
    """Raise ``error`` (one line: the wheel, the first bad entry, and how many more) unless
    ``wheel`` holds only what ``expected`` allows."""
    found = problems(wheel, expected)
    if found:
        more = f" (and {len(found) - 1} more)" if len(found) > 1 else ""
        raise error(f"{wheel.name}: {found[0]}{more}")


def names(wheel: Path) -> list[str]:
    """The entry names of ``wheel``'s central directory; none if it is no zip file (``check``
    says why)."""
    try:
        with zipfile.ZipFile(wheel) as archive:
            return archive.namelist()
    except (zipfile.BadZipFile, OSError, EOFError, ValueError):
        return []


def problems(wheel: Path, expected: Expected) -> list[str]:
    """Every reason ``wheel`` holds something it should not (see the module), as text."""
    try:
        with zipfile.ZipFile(wheel) as archive:
            infos = archive.infolist()
            found = _layout(wheel, archive, infos)
            found += [p for info in infos for p in _entry(info)]
            found += _unpacked_size(infos)
            found += _collisions([i.orig_filename for i in infos])
            found += _placement([i.filename for i in infos], expected)
            names = {i.filename for i in infos}
            found += _record(archive, names, expected.dist_info)
            found += _entry_points(archive, names, expected)
            found += _requirements(archive, names, expected)
    except (zipfile.BadZipFile, OSError, EOFError, UnicodeDecodeError, NotImplementedError,
            RuntimeError, ValueError, zlib.error, lzma.LZMAError) as err:
        # a compression method zipfile lacks (deflate64), an encrypted or corrupt stream
        reason = (str(err).splitlines() or [type(err).__name__])[0]
        return [f"cannot be read as a zip file: {reason}"]
    return found


# Largest dist-info file read whole (bytes, as the entry declares it; zipfile reads no
# more): vLLM 0.28.0's RECORD is about 300 kB; a decompression bomb is refused unread.
_MAX_INFO_BYTES = 64 << 20


def _read_info(archive: zipfile.ZipFile, name: str) -> bytes:
    """A dist-info file's bytes. Raises ValueError for one larger than ``_MAX_INFO_BYTES``."""
    size = archive.getinfo(name).file_size
    if size > _MAX_INFO_BYTES:
        raise ValueError(f"{name} is {size} bytes unpacked, more than any wheel's")
    return archive.read(name)


def _layout(path: Path, archive: zipfile.ZipFile, infos: list[zipfile.ZipInfo]) -> list[str]:
    """The entries, in file order, must tile the file from byte 0 to the central directory,
    each local header naming its central-directory entry; nothing after the end record."""
    found = []
    if archive.comment:
        found.append("has an archive comment (a place to hide a second archive)")
    pos = 0
    with open(path, "rb") as f:
        for info in sorted(infos, key=lambda i: i.header_offset):
            if info.header_offset != pos:
                return found + [f"bytes {pos}-{info.header_offset} belong to no entry (before "
                                f"{info.filename!r}): an entry hidden from the central directory?"]
            f.seek(pos)
            head = f.read(_LOCAL.size)
            if len(head) < _LOCAL.size:
                return found + [f"{info.filename!r}: its local header is cut short"]
            sig, _, flags, _, _, _, _, _, _, name_len, extra_len = _LOCAL.unpack(head)
            raw = f.read(name_len)
            extra = f.read(extra_len)
            wanted = info.orig_filename.encode("utf-8" if info.flag_bits & 0x800 else "cp437")
            if sig != b"PK\x03\x04" or raw != wanted:
                return found + [f"{info.filename!r}: its local header names {raw!r}, not the "
                                f"central directory's name"]
            if flags & 0x1:
                found.append(f"{info.filename!r} is encrypted")
            pos += _LOCAL.size + name_len + extra_len + info.compress_size
            if flags & 0x8:  # a data descriptor follows: [signature] crc, sizes (8 bytes with zip64)
                f.seek(pos)
                pos += (4 if f.read(4) == b"PK\x07\x08" else 0) + 4 + (16 if _zip64(extra) else 8)
        if pos != archive.start_dir:
            found.append(f"bytes {pos}-{archive.start_dir} after the last entry belong to no entry")
        found += _end_records(f)
    return found


def _end_records(f) -> list[str]:
    """The end record must close the file, and the central directory it declares must end
    where the end records begin: the zip64 record and its locator when there are any (what
    a writer adds for more than 65,535 entries or offsets past 4 GiB), each field of the
    classic record equal to the zip64 one or saturated (0xFFFF...: "see zip64")."""
    size = f.seek(0, 2)
    f.seek(size - _END.size)
    end = _END.unpack(f.read(_END.size))
    if end[0] != b"PK\x05\x06":
        return ["bytes after the end of the archive"]
    declared, records_at = (end[6], end[5]), size - _END.size
    f.seek(max(records_at - _LOCATOR.size, 0))
    locator = f.read(_LOCATOR.size)
    if len(locator) == _LOCATOR.size and locator[:4] == b"PK\x06\x07":
        records_at = _LOCATOR.unpack(locator)[2]
        f.seek(records_at)
        record = f.read(_END64.size)
        if (len(record) < _END64.size or record[:4] != b"PK\x06\x06"
                or records_at + _END64.size != size - _END.size - _LOCATOR.size):
            return ["a zip64 end record that is not where its locator says, or is followed by "
                    "bytes that belong to no record"]
        _, _, _, _, _, _, count_disk, count, cd_size, cd_offset = _END64.unpack(record)
        classic = (end[3], end[4], end[5], end[6])
        for value, wide, full in zip(classic, (count_disk, count, cd_size, cd_offset),
                                     (0xFFFF, 0xFFFF, 0xFFFFFFFF, 0xFFFFFFFF)):
            if value not in (wide, full):
                return ["an end record that disagrees with its zip64 end record (two readers "
                        "would see two central directories)"]
        declared = (cd_size, cd_offset)
    if declared[1] + declared[0] != records_at:
        return ["bytes between the central directory and its end record"]
    return []


def _zip64(extra: bytes) -> bool:
    while len(extra) >= 4:
        kind, length = struct.unpack("<2H", extra[:4])
        if kind == 0x0001:
            return True
        extra = extra[4 + length:]
    return False


# What the wheel may unpack to, as its entries declare it (zipfile reads no more): the
# build reads each entry whole (repack, the byte-for-byte proof) and pip installs them all
# into a temporary folder, so a decompression bomb (GiBs of zeros from a few MiB: a 2 MB
# wheel took 4 GB of memory) would take the memory or the disk. vLLM 0.28.0's largest entry
# is 308 MB packed 2.4:1, the whole 758 MB; no entry over 64 MiB packs more than 4:1.
_MAX_ENTRY_BYTES = 2 << 30
_MAX_WHEEL_BYTES = 16 << 30
_LARGE_ENTRY_BYTES, _MAX_LARGE_RATIO = 64 << 20, 64


def _unpacked_size(infos: list[zipfile.ZipInfo]) -> list[str]:
    """An entry declaring more unpacked bytes than any vLLM wheel's, or a large one packed
    far tighter than compiled code packs; or the whole wheel more than any vLLM wheel."""
    found = [f"entry {i.orig_filename!r} unpacks to {i.file_size} bytes (from {i.compress_size}), "
             f"more than any wheel's entry (a decompression bomb?)" for i in infos
             if i.file_size > _MAX_ENTRY_BYTES or (i.file_size > _LARGE_ENTRY_BYTES
                                                   and i.file_size > _MAX_LARGE_RATIO * i.compress_size)]
    total = sum(i.file_size for i in infos)
    if total > _MAX_WHEEL_BYTES:
        found.append(f"it unpacks to {total} bytes, more than any wheel (a decompression bomb?)")
    return found


def _entry(info: zipfile.ZipInfo) -> list[str]:
    name, found = info.orig_filename, []  # (zipfile cuts filename at a NUL)
    reason = name_problem(name)
    if reason:
        found.append(f"entry {name!r}: {reason}")
    mode = info.external_attr >> 16  # what pip reads, whatever create_system says
    kind = stat.S_IFMT(mode)
    if name.endswith("/") or info.is_dir():
        found.append(f"entry {name!r} is a folder entry")
    elif kind and kind != stat.S_IFREG:
        found.append(f"entry {name!r} is {_KINDS.get(kind, 'not a regular file')} (mode {mode:o})")
    if mode & (stat.S_ISUID | stat.S_ISGID | stat.S_ISVTX):
        found.append(f"entry {name!r} has setuid, setgid or sticky bits (mode {mode:o})")
    if mode & stat.S_IWOTH:
        found.append(f"entry {name!r} is world-writable (mode {mode:o})")
    return found


def name_problem(name: str) -> str | None:
    """Why ``name`` is no safe path inside an install folder on any system, or None."""
    if any(unicodedata.category(c) in ("Cc", "Cf", "Cs", "Co", "Cn") for c in name):
        return "a control or invisible character in its name"
    if "\\" in name:
        return "a backslash in its name"
    if ":" in name:
        return "a ':' in its name (a drive letter or an NTFS stream)"
    if name.startswith("/"):
        return "an absolute path"
    if any(part in ("", ".", "..") for part in name.rstrip("/").split("/")):
        return "a '..', '.' or empty part in its name"
    return None


def _collisions(names: list[str]) -> list[str]:
    seen: dict[str, str] = {}
    found = []
    for name in names:
        key = unicodedata.normalize("NFKC", name).casefold()
        if key in seen:
            same = "twice" if seen[key] == name else f"and {seen[key]!r} (one file on a " \
                                                     f"case-insensitive or normalising file system)"
            found.append(f"entry {name!r} {same}")
        seen.setdefault(key, name)
    return found


def _placement(names: list[str], expected: Expected) -> list[str]:
    found = []
    for name in names:
        top, _, rest = name.partition("/")
        if name.casefold().endswith(".pth"):
            found.append(f"entry {name!r} is a .pth file (site runs its import lines at every "
                         f"Python start)")
        elif top == expected.dist_info:
            if rest not in INFO_FILES and not rest.startswith(INFO_FOLDERS) and \
                    rest not in ("RECORD.jws", "RECORD.p7s"):
                found.append(f"entry {name!r}: not a file a dist-info folder holds here")
        elif top != expected.package:
            what = "a .data folder (scripts, headers)" if top.endswith(".data") else \
                "a second dist-info folder" if top.endswith(".dist-info") else \
                f"outside {expected.package}/ and {expected.dist_info}/"
            found.append(f"entry {name!r} is {what}")
        elif expected.tree is not None and name not in expected.tree and \
                not name.endswith(COMPILED) and not _built(name, expected):
            found.append(f"entry {name!r} is not in the tree at the ref, nor compiled code, nor a "
                         f"build output its .gitignore names")
    return found


def _built(name: str, expected: Expected) -> bool:
    """True if the tree's ``.gitignore`` files name ``name`` (last match wins, as in git)."""
    ignored = False
    for folder, spec in expected.build_outputs:  # outermost first
        if folder and not name.startswith(folder + "/"):
            continue
        result = spec.check_file(name[len(folder) + 1:] if folder else name)
        if result.include is not None:
            ignored = result.include
    return ignored


def _record(archive: zipfile.ZipFile, names: set[str], dist_info: str) -> list[str]:
    record = f"{dist_info}/RECORD"
    if record not in names:
        return [f"no {record}"]
    try:
        table = [row for row in csv.reader(io.StringIO(_read_info(archive, record).decode())) if row]
    except csv.Error as err:  # a field over csv's limit, ...
        return [f"RECORD cannot be read: {err}"]
    rows = [row[0] for row in table]
    found = [f"RECORD lists {p!r} twice" for p in sorted({p for p in rows if rows.count(p) > 1})]
    found += [f"RECORD lists {p!r}, which is not in it" for p in sorted(set(rows) - names)]
    found += [f"entry {p!r} is not in RECORD" for p in sorted(names - set(rows))
              if p not in (f"{dist_info}/RECORD.jws", f"{dist_info}/RECORD.p7s")]
    return found + [problem for row in table for problem in [_record_row(row, record)] if problem]


# What RECORD may give as a file's hash: ``ALGORITHM=DIGEST`` (urlsafe base64, unpadded)
# of a strong algorithm every Python has (what pip and ``wheel`` read; md5, sha1 refused).
_HASH = re.compile(r"(?P<algorithm>[a-z0-9_]+)=[A-Za-z0-9_\-]+")
_STRONG = frozenset(hashlib.algorithms_guaranteed) - {"md5", "sha1"}


def _record_row(row: list[str], record: str) -> str | None:
    """Why a RECORD row is not ``path,ALGORITHM=DIGEST,size`` (the signature files and
    RECORD itself: no hash), or None."""
    path = row[0]
    if len(row) != 3:
        return f"RECORD's row for {path!r} has {len(row)} fields, not 3"
    if path in (record, f"{record}.jws", f"{record}.p7s"):
        return None
    digest = _HASH.fullmatch(row[1])
    if digest is None or digest["algorithm"] not in _STRONG:
        return (f"RECORD gives {path!r} the hash {row[1][:40]!r}, not ALGORITHM=DIGEST of a "
                f"strong algorithm")
    return None


def _entry_points(archive: zipfile.ZipFile, names: set[str], expected: Expected) -> list[str]:
    if expected.entry_points is None:
        return []
    path = f"{expected.dist_info}/entry_points.txt"
    try:
        found = parse_entry_points(_read_info(archive, path).decode()) if path in names else {}
    except configparser.Error as err:  # no section, a section or name twice, a bad line
        return [f"entry_points.txt cannot be read: {str(err).splitlines()[0]}"]
    if found == expected.entry_points:
        return []
    extra = sorted(f"{g}:{n}" for g, items in found.items() for n in items
                   if expected.entry_points.get(g, {}).get(n) != items[n])
    return [f"entry_points.txt declares {extra[0] if extra else 'fewer entry points'} "
            f"(not as the tree's pyproject.toml declares)"]


def _requirements(archive: zipfile.ZipFile, names: set[str], expected: Expected) -> list[str]:
    """Every ``Requires-Dist`` of METADATA is the tree's: one a CUDA build installs, as the
    tree's requirements files write it; or (an extra's) a project the tree names."""
    path = f"{expected.dist_info}/METADATA"
    if expected.named_by_tree is None or path not in names:
        return []
    message = email.message_from_bytes(_read_info(archive, path))
    found = []
    for text in message.get_all("Requires-Dist") or []:
        try:
            req = Requirement(text)
        except InvalidRequirement:
            found.append(f"METADATA requires {text!r}, which is no requirement")
            continue
        extra = req.marker is not None and "extra" in str(req.marker)
        plain = str(Requirement(str(req).split(";")[0]))
        if req.url and req.url not in expected.named_by_tree:
            found.append(f"METADATA requires {text!r}: a URL the tree does not name")
        elif not extra and expected.installs is not None and plain not in expected.installs:
            found.append(f"METADATA requires {plain!r}, which the tree's requirements do not")
        elif not _named(req.name, expected.named_by_tree):
            found.append(f"METADATA requires {req.name!r}, a project the tree never names")
    return found


def _named(name: str, text: str) -> bool:
    words = {canonicalize_name(w) for w in re.findall(r"[A-Za-z0-9][A-Za-z0-9._-]*", text)}
    return canonicalize_name(name) in words


def requirement_lines(files: dict[str, bytes], path: str, seen: set[str] | None = None) -> set[str]:
    """The requirements ``path`` (``requirements/cuda.txt``) installs, with its ``-r`` files,
    normalised by ``packaging``; options and comments left out."""
    seen = seen if seen is not None else set()
    if path in seen or path not in files:
        return set()
    seen.add(path)
    found = set()
    for line in files[path].decode(errors="replace").splitlines():
        line = line.split(" #")[0].strip()
        if line.startswith("-r "):
            found |= requirement_lines(files, f"{path.rpartition('/')[0]}/{line[3:].strip()}", seen)
        elif line and not line.startswith(("#", "-")):
            with contextlib.suppress(InvalidRequirement):
                found.add(str(Requirement(line.split(";")[0])))
    return found


def parse_entry_points(text: str) -> dict[str, dict[str, str]]:
    """``entry_points.txt`` as ``{group: {name: value}}``, read as importlib.metadata reads it."""
    parser = configparser.ConfigParser(delimiters="=", interpolation=None)
    parser.optionxform = str  # names keep their case
    parser.read_string(text)
    return {group: dict(parser[group]) for group in parser.sections() if parser[group]}


def declared_entry_points(pyproject: bytes | None) -> dict[str, dict[str, str]] | None:
    """The entry points ``pyproject.toml`` declares (``[project.scripts]`` as ``console_scripts``,
    ``gui-scripts``, ``entry-points``); None if they are ``dynamic`` (set by the build)."""
    try:
        project = tomllib.loads((pyproject or b"").decode()).get("project", {})
    except (tomllib.TOMLDecodeError, UnicodeDecodeError):
        return {}
    if {"scripts", "gui-scripts", "entry-points"} & set(project.get("dynamic", [])):
        return None
    declared = {"console_scripts": project.get("scripts", {}),
                "gui_scripts": project.get("gui-scripts", {}),
                **project.get("entry-points", {})}
    return {group: {str(k): str(v) for k, v in items.items()}
            for group, items in declared.items() if isinstance(items, dict) and items}


def ignore_specs(files: dict[str, bytes]) -> list[tuple[str, pathspec.GitIgnoreSpec]]:
    """``(folder, rules)`` of each ``.gitignore`` in ``files`` (path -> bytes), outermost first."""
    specs = []
    for path in sorted(files, key=lambda p: p.count("/")):
        folder = path.rpartition("/")[0]
        lines = files[path].decode(errors="replace").splitlines()
        specs.append((folder, pathspec.GitIgnoreSpec.from_lines(lines)))
    return specs

