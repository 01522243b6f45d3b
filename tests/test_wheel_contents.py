"""The internal wheel holds exactly the release's files plus ours (issue 18, F).

Each hostile release wheel is the synthetic release (``test_wheel``) with one thing
added or changed, written here with plain ``zipfile`` (RECORD computed here, so only
the named fault is wrong), or with its bytes patched where zipfile cannot write the
fault. Each is refused on the way in, in one line naming the entry, exit 2, before
anything is written; the same faults in a built wheel fail its checks (exit 5).
"""

from __future__ import annotations

import base64
import hashlib
import io
import re
import stat
import struct
import zipfile
from pathlib import Path

import pytest

from k3overlay import cli, errors, source, wheelcheck, wheelentries
from k3overlay.wheel import WheelOptions, build

from .test_wheel import LOCAL, TREE, good, release_files, setup, vupstream  # noqa: F401 (fixtures)
from .wheels import METADATA

INFO = "vllm-0.1.0.dist-info"
REG, EXE = 0o100644, 0o100755


def record_of(entries: list[tuple[str, bytes]]) -> bytes:
    rows = [f"{name},sha256={base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b'=').decode()},"
            f"{len(data)}" for name, data in entries]
    return ("\n".join([*rows, f"{INFO}/RECORD,,"]) + "\n").encode()


def craft(directory: Path, extra: list[tuple[str, bytes, int]] = (), *, drop: tuple[str, ...] = (),
          modes: dict[str, int] | None = None, info: dict[str, bytes] | None = None,
          record: bytes | None = None, comment: bytes = b"", stream: bool = False) -> Path:
    """The synthetic release wheel plus ``extra`` (name, bytes, mode), less ``drop``, with
    ``modes`` changed and ``info`` (dist-info files) added; RECORD right unless given."""
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / "vllm-0.1.0-py3-none-any.whl"
    files = [(n, d.encode() if isinstance(d, str) else d, REG) for n, d in release_files(TREE).items()
             if n not in drop]
    files = [(n, d, (modes or {}).get(n, m)) for n, d, m in files] + list(extra)
    meta = {"METADATA": METADATA.format(version="0.1.0").encode(),
            "WHEEL": b"Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: false\nTag: py3-none-any\n",
            "top_level.txt": b"vllm\n", **(info or {})}
    files += [(f"{INFO}/{n}", d, REG) for n, d in meta.items()]
    rec = record if record is not None else record_of([(n, d) for n, d, _ in files])
    target = io.BytesIO()
    sink = _Unseekable(target) if stream else target
    with zipfile.ZipFile(sink, "w") as archive:
        for name, data, mode in [*files, (f"{INFO}/RECORD", rec, REG)]:
            entry = zipfile.ZipInfo(name, date_time=(2026, 1, 1, 0, 0, 0))
            entry.external_attr = mode << 16
            archive.writestr(entry, data, zipfile.ZIP_DEFLATED)
        archive.comment = comment
    path.write_bytes(target.getvalue())
    return path


class _Unseekable(io.RawIOBase):
    """A stream zipfile cannot seek back in: it writes data descriptors (flag bit 3)."""

    def __init__(self, sink):
        self.sink = sink

    def writable(self):
        return True

    def write(self, data):
        return self.sink.write(data)

    def tell(self):
        return self.sink.tell()

    def flush(self):
        pass


def patched(path: Path, old: bytes, new: bytes) -> Path:
    """``path`` with every ``old`` replaced by ``new`` (same length: names zipfile cannot write)."""
    assert len(old) == len(new)
    data = path.read_bytes()
    assert old in data
    path.write_bytes(data.replace(old, new))
    return path


def _hidden_entry(path: Path) -> Path:
    """A local header and its data slipped in before the central directory, which does not
    list it (a streaming unzipper would extract it; pip would not)."""
    data = path.read_bytes()
    with zipfile.ZipFile(path) as archive:
        cd = archive.start_dir
    one = io.BytesIO()
    with zipfile.ZipFile(one, "w") as archive:
        archive.writestr("vllm/hidden.py", "import os\n")
    with zipfile.ZipFile(one) as archive:
        local = one.getvalue()[:archive.start_dir]
    fixed = bytearray(data[:cd] + local + data[cd:])
    end = fixed.rfind(b"PK\x05\x06")  # the end record: where the central directory starts
    fixed[end + 16:end + 20] = (cd + len(local)).to_bytes(4, "little")
    path.write_bytes(bytes(fixed))
    return path


def zip64_ends(path: Path, *, saturate: bool, gap: bytes = b"", classic_size: int | None = None) -> Path:
    """``path`` with zip64 end records (record and locator) before its end record, as a
    writer adds them past 65,535 entries: the end record's fields kept (Python's zipfile)
    or saturated to 0xFFFF... (``saturate``: Info-ZIP's ``-fz``); ``gap`` slipped in between
    the central directory and the zip64 record; ``classic_size`` a central-directory size
    the end record gives that the zip64 record does not."""
    data = path.read_bytes()
    end = data.rfind(b"PK\x05\x06")
    sig, disk, cd_disk, count_disk, count, cd_size, cd_offset, comment = struct.unpack(
        "<4s4H2LH", data[end:end + 22])
    record_at = end + len(gap)
    record = struct.pack("<4sQ2H2L4Q", b"PK\x06\x06", 44, 45, 45, 0, 0, count_disk, count, cd_size,
                         cd_offset)
    locator = struct.pack("<4sLQL", b"PK\x06\x07", 0, record_at, 1)
    if saturate:
        count_disk, count, cd_size, cd_offset = 0xFFFF, 0xFFFF, 0xFFFFFFFF, 0xFFFFFFFF
    classic = struct.pack("<4s4H2LH", sig, disk, cd_disk, count_disk, count,
                          cd_size if classic_size is None else classic_size, cd_offset, comment)
    path.write_bytes(data[:end] + gap + record + locator + classic + data[end + 22:])
    return path


EVIL_PTH = b"import os; os.system('touch /tmp/pwned')\n"
# name -> (how to make the wheel in a folder, a regex the one-line refusal matches)
def _lying_hash(good: Path, name: str) -> bytes:
    """The RECORD of wheel ``good`` with ``name``'s hash that of other bytes."""
    with zipfile.ZipFile(good) as archive:
        record = archive.read(next(n for n in archive.namelist() if n.endswith("/RECORD")))
    lines = [line if not line.startswith(name.encode() + b",") else
             record_of([(name, b"# not these bytes\n")]).splitlines()[0] for line in record.splitlines()]
    return b"\n".join(lines) + b"\n"


HOSTILE = {
    # round 10: a lie of RECORD's found only when the repack read the entry was exit 6
    "RECORD lies about a module's hash": (lambda d: craft(d, record=_lying_hash(craft(d / "good"), "vllm/a.py")),
                                          r"entry 'vllm/a.py': Hash mismatch for file 'vllm/a.py'"),
    "RECORD lies about a dist-info file's hash": (
        lambda d: craft(d, record=_lying_hash(craft(d / "good"), f"{INFO}/top_level.txt")),
        rf"entry '{INFO}/top_level.txt': Hash mismatch"),
    "symlink": (lambda d: craft(d, [("vllm/evil_link.py", b"/etc/passwd", 0o120777)]),
                r"entry 'vllm/evil_link.py' is a symbolic link \(mode 120777\)"),
    "top-level .pth": (lambda d: craft(d, [("zzz_evil.pth", EVIL_PTH, REG)]),
                       r"entry 'zzz_evil.pth' is a .pth file"),
    "nested .pth": (lambda d: craft(d, [("vllm/conf/x.PTH", EVIL_PTH, REG)]), r"'vllm/conf/x.PTH' is a .pth"),
    "extra module": (lambda d: craft(d, [("vllm/x_extra.py", b"X = 1\n", REG)]),
                     r"entry 'vllm/x_extra.py' is not in the tree at the ref"),
    "outside the package": (lambda d: craft(d, [("evil/__init__.py", b"", REG)]),
                            r"entry 'evil/__init__.py' is outside vllm/ and vllm-0.1.0.dist-info/"),
    "dot-dot": (lambda d: craft(d, [("vllm/../evil.py", b"", REG)]), r"'vllm/../evil.py': a '\.\.'"),
    "dot part": (lambda d: craft(d, [("vllm/./a2.py", b"", REG)]), r"'vllm/./a2.py': a '\.\.', '\.'"),
    "empty part": (lambda d: craft(d, [("vllm//a2.py", b"", REG)]),
                   r"'vllm//a2.py': a '\.\.', '\.' or empty"),
    "absolute": (lambda d: craft(d, [("/etc/evil.py", b"", REG)]), r"'/etc/evil.py': an absolute path"),
    "drive letter": (lambda d: craft(d, [("C:/evil.py", b"", REG)]), r"'C:/evil.py': a ':' in its name"),
    "ntfs stream": (lambda d: craft(d, [("vllm/a.py:evil", b"", REG)]), r"'vllm/a.py:evil': a ':'"),
    "backslash": (lambda d: craft(d, [("vllm\\..\\evil.py", b"", REG)]), r"a backslash in its name"),
    "NUL": (lambda d: patched(craft(d, [("vllm/aXb.py", b"", REG)]), b"vllm/aXb.py", b"vllm/a\0b.py"),
            r"'vllm/a\\x00b.py': a control or invisible character"),
    "escape sequence": (lambda d: craft(d, [("vllm/a\x1b[31m.py", b"", REG)]), r"control or invisible"),
    "right-to-left override": (lambda d: craft(d, [("vllm/\u202eyp.txt", b"", REG)]),
                               r"control or invisible"),
    "the same name twice": (lambda d: craft(d, [("vllm/a.py", b"A = 666\n", REG)]),
                            r"entry 'vllm/a.py' twice"),
    "case collision": (lambda d: craft(d, [("vllm/A.py", b"A = 666\n", REG)]),
                       r"entry 'vllm/A.py' and 'vllm/a.py' \(one file on a case-insensitive"),
    "unicode collision": (lambda d: craft(d, [("vllm/\uff41.py", b"A = 666\n", REG)]),
                          r"entry 'vllm/\uff41.py' and 'vllm/a.py'"),
    "setuid": (lambda d: craft(d, modes={"vllm/a.py": 0o104755}), r"'vllm/a.py' has setuid"),
    "sticky": (lambda d: craft(d, modes={"vllm/a.py": 0o101644}),
               r"'vllm/a.py' has setuid, setgid or sticky"),
    "world-writable": (lambda d: craft(d, modes={"vllm/a.py": 0o100666}), r"'vllm/a.py' is world-writable"),
    "fifo": (lambda d: craft(d, modes={"vllm/a.py": 0o010644}), r"'vllm/a.py' is a FIFO"),
    "device": (lambda d: craft(d, modes={"vllm/a.py": 0o020644}), r"'vllm/a.py' is a device"),
    "folder entry": (lambda d: craft(d, [("vllm/newdir/", b"", 0o040755)]),
                     r"'vllm/newdir/' is a folder entry"),
    "second dist-info": (lambda d: craft(d, [("evil-1.0.dist-info/METADATA", b"Name: evil\n", REG)]),
                         r"'evil-1.0.dist-info/METADATA' is a second dist-info folder"),
    "console script added": (lambda d: craft(d, info={
        "entry_points.txt": b"[console_scripts]\nls = vllm.a:A\n"}),
                             r"entry_points.txt declares console_scripts:ls"),
    "dependency added": (lambda d: craft(d, info={"METADATA": _metadata_with("Requires-Dist: evil-pkg")}),
                         r"METADATA requires 'evil-pkg', a project the tree never names"),
    "dependency from a URL": (lambda d: craft(d, info={"METADATA": _metadata_with(
        "Requires-Dist: numpy @ https://evil.example/numpy-9-py3-none-any.whl")}),
        r"a URL the tree does not name"),
    "stray dist-info file": (lambda d: craft(d, info={"direct_url.json": b"{}"}),
                             r"'vllm-0.1.0.dist-info/direct_url.json': not a file a dist-info folder holds"),
    "RECORD lists a file not in it": (
        lambda d: craft(d, record=record_of([("vllm/ghost.py", b"")]) + b"".join(
            f"{n},,\n".encode() for n in [*release_files(TREE), *(f"{INFO}/{x}" for x in
                                                                  ("METADATA", "WHEEL", "top_level.txt"))])),
        r"RECORD lists 'vllm/ghost.py', which is not in it"),
    "RECORD misses a file": (lambda d: craft(d, record=b"vllm/a.py,,\n"), r"entry '[^']+' is not in RECORD"),
    "archive comment": (lambda d: craft(d, comment=b"PK\x03\x04 a second archive could hide here"),
                        r"has an archive comment"),
    "entry hidden from the central directory": (lambda d: _hidden_entry(craft(d)),
                                                r"belong to no entry"),
    "bytes before the first entry": (lambda d: _around(craft(d), b"#!/bin/sh\necho hi\n", b""),
                                     r"bytes 0-18 belong to no entry"),
    "bytes after the end": (lambda d: _around(craft(d), b"", b"junk"), r"bytes after the end of the archive"),
    "local header names another file": (
        lambda d: _local_name(craft(d, [("vllm/zz1.py", b"Z = 1\n", REG)]), b"vllm/zz1.py", b"vllm/a.py\0\0"),
        r"'vllm/zz1.py': its local header names"),
    "encrypted": (lambda d: _encrypted(craft(d), "vllm/a.py"), r"'vllm/a.py' is encrypted|cannot be read"),
    # round 4: zip64 end records are sound (issue 25, 22); what they could hide is not
    "bytes before the zip64 end record": (
        lambda d: zip64_ends(craft(d), saturate=True, gap=b"PK\x03\x04hidden"),
        r"zip64 end record that is not where its locator says|cannot be read"),
    "an end record disagreeing with its zip64 one": (
        lambda d: zip64_ends(craft(d), saturate=False, classic_size=7),
        r"disagrees with its zip64 end record"),
    # round 3: what the readers of the checks raised on (a traceback, exit 1)
    "entry points without a section": (lambda d: craft(d, info={"entry_points.txt": b"ls = vllm.a:A\n"}),
                                       r"entry_points.txt cannot be read: File contains no section"),
    "entry point named twice": (lambda d: craft(d, info={"entry_points.txt": b"[a]\nx=y\nx=z\n"}),
                                r"entry_points.txt cannot be read: .*'x' in section 'a' already exists"),
    "RECORD field over csv's limit": (lambda d: craft(d, record=b"x" * 200_000 + b",,\n"),
                                      r"RECORD\)?:? (cannot be read: )?field larger than field limit"),
    "RECORD hash without an algorithm": (
        lambda d: craft(d, record=_record_rewritten(craft(d / "good"), b"sha256=", b"")),
        r"RECORD gives '[^']+' the hash '[^']+', not ALGORITHM=DIGEST|\(its RECORD\): not enough values"),
    "RECORD hash of a weak algorithm": (
        lambda d: craft(d, record=_record_rewritten(craft(d / "good"), b"sha256=", b"md5=")),
        r"not ALGORITHM=DIGEST of a strong algorithm|Weak hash algorithm \(md5\)"),
    "RECORD row of four fields": (
        lambda d: craft(d, record=_record_rewritten(craft(d / "good"), b"vllm/a.py,", b"vllm/a.py,,")),
        r"RECORD's row for 'vllm/a.py' has 4 fields, not 3|\(its RECORD\): too many values"),
    "compression zipfile lacks (deflate64)": (
        lambda d: _method(craft(d), 9),
        r"cannot be read as a (zip file|wheel \(it\)): That compression method"),
    # round 7: what every entry declares it unpacks to (repack reads each whole, pip unpacks all)
    "an entry a decompression bomb": (
        lambda d: _declared_size(craft(d, [("vllm/_zz.abi3.so", b"\0" * 4096, REG)]), "vllm/_zz.abi3.so",
                                 (2 << 30) + 1),
        r"entry 'vllm/_zz.abi3.so' unpacks to 2147483649 bytes \(from \d+\), more than any wheel's entry"),
    "a large entry packed like a bomb": (
        lambda d: _declared_size(craft(d, [("vllm/_zz.abi3.so", b"\0" * 4096, REG)]), "vllm/_zz.abi3.so",
                                 (64 << 20) + 1),
        r"entry 'vllm/_zz.abi3.so' unpacks to 67108865 bytes \(from \d+\), more than any wheel's entry"),
    "entries a decompression bomb in all": (
        lambda d: _declared_size(craft(d, [(f"vllm/_k{i}.abi3.so", b"\0" * 4096, REG) for i in range(257)]),
                                 *[f"vllm/_k{i}.abi3.so" for i in range(257)], 64 << 20),
        r"it unpacks to \d+ bytes, more than any wheel"),
    "RECORD a decompression bomb": (
        lambda d: craft(d, record=_record_rewritten(craft(d / "good"), b"", b"") + b"\n" * (65 << 20)),
        r"RECORD is \d+ bytes unpacked|cannot be read"),
}


def _declared_size(path: Path, *names_and_size) -> Path:
    """Each entry in ``names_and_size`` (then the size) declared to unpack to that many bytes, in
    its local header and its central directory entry, as a decompression bomb's entries are
    (its few packed bytes kept: nothing must read that far to refuse it)."""
    *names, size = names_and_size
    data = bytearray(path.read_bytes())
    for sig, at_size, at_name_len, header in ((b"PK\x03\x04", 22, 26, 30), (b"PK\x01\x02", 24, 28, 46)):
        at = 0
        while (at := data.find(sig, at)) >= 0:
            name_len = int.from_bytes(data[at + at_name_len:at + at_name_len + 2], "little")
            if data[at + header:at + header + name_len].decode() in names:
                data[at + at_size:at + at_size + 4] = size.to_bytes(4, "little")
            at += 4
    path.write_bytes(bytes(data))
    return path


def _record_rewritten(good_wheel: Path, old: bytes, new: bytes) -> bytes:
    """The RECORD of ``good_wheel`` with ``old`` replaced by ``new`` (every row's)."""
    with zipfile.ZipFile(good_wheel) as archive:
        return archive.read(f"{INFO}/RECORD").replace(old, new) if old else archive.read(f"{INFO}/RECORD")


def _method(path: Path, method: int) -> Path:
    """Every entry's compression method set to ``method`` (local headers and central directory)."""
    data = bytearray(path.read_bytes())
    for sig, at_method in ((b"PK\x03\x04", 8), (b"PK\x01\x02", 10)):
        at = 0
        while (at := data.find(sig, at)) >= 0:
            data[at + at_method:at + at_method + 2] = method.to_bytes(2, "little")
            at += 4
    path.write_bytes(bytes(data))
    return path


def _metadata_with(line: str) -> bytes:
    return METADATA.format(version="0.1.0").replace("Requires-Dist: numpy\n", f"{line}\n").encode()


def _around(path: Path, before: bytes, after: bytes) -> Path:
    path.write_bytes(before + path.read_bytes() + after)
    return path


def _local_name(path: Path, old: bytes, new: bytes) -> Path:
    """The first (local header) occurrence of ``old`` replaced, the central directory's kept."""
    data = path.read_bytes()
    at = data.index(old)
    path.write_bytes(data[:at] + new[:len(old)] + data[at + len(old):])
    return path


def _encrypted(path: Path, name: str) -> Path:
    """Set the 'encrypted' flag of ``name`` in its local header and central directory entry."""
    data = bytearray(path.read_bytes())
    for sig, flag_at in ((b"PK\x03\x04", 6), (b"PK\x01\x02", 8)):
        at = 0
        while (at := data.find(sig, at)) >= 0:
            name_len = int.from_bytes(data[at + (26 if sig == b"PK\x03\x04" else 28):][:2], "little")
            start = at + (30 if sig == b"PK\x03\x04" else 46)
            if data[start:start + name_len] == name.encode():
                data[at + flag_at] |= 1
            at += 4
    path.write_bytes(bytes(data))
    return path


@pytest.mark.parametrize("fault", list(HOSTILE))
def test_a_hostile_release_wheel_is_refused_naming_the_entry(setup, tmp_path, fault):  # noqa: F811
    make, expect = HOSTILE[fault]
    hostile = make(tmp_path / "hostile")
    project, _, repo, report, tip = setup
    with pytest.raises(errors.OverlayError) as err:
        build(project, repo, report, tip, WheelOptions(tmp_path / "w", release_wheel=hostile),
              source.release_files())
    assert re.search(expect, str(err.value)), str(err.value)
    assert err.value.exit_code == errors.USAGE and "\n" not in str(err.value)
    assert list((tmp_path / "w").iterdir()) == [] if (tmp_path / "w").exists() else True


def test_a_good_release_wheel_with_data_descriptors_is_taken(setup, tmp_path):  # noqa: F811
    """Data descriptors (a zip written as a stream) are sound zip: only what they could hide is
    refused. And a release wheel with entry points its tree declares is taken too."""
    streamed = craft(tmp_path / "s", stream=True)
    with zipfile.ZipFile(streamed) as archive:
        assert all(i.flag_bits & 0x8 for i in archive.infolist())
    project, _, repo, report, tip = setup
    built = build(project, repo, report, tip, WheelOptions(tmp_path / "w", release_wheel=streamed),
                  source.release_files())
    assert built.path.is_file()


@pytest.mark.parametrize("saturate", [False, True], ids=["fields kept", "fields saturated"])
def test_a_good_release_wheel_with_zip64_end_records_is_taken(setup, tmp_path, saturate):  # noqa: F811
    """Issue 25, 22: zip64 end records (pip installs such a wheel) were refused as "bytes
    between the central directory and its end record"."""
    wheel = zip64_ends(craft(tmp_path / "z"), saturate=saturate)
    with zipfile.ZipFile(wheel) as archive:
        assert archive.testzip() is None and len(archive.namelist()) > 3
    project, _, repo, report, tip = setup
    built = build(project, repo, report, tip, WheelOptions(tmp_path / "w", release_wheel=wheel),
                  source.release_files())
    assert built.path.is_file()


def test_a_zip_python_writes_past_65535_entries_has_a_sound_layout(tmp_path):
    """What zipfile itself writes for more entries than the classic end record counts."""
    path = tmp_path / "many.zip"
    with zipfile.ZipFile(path, "w") as archive:
        for n in range(0x10000 + 1):
            archive.writestr(f"vllm/f{n}.py", b"")
    assert path.read_bytes().find(b"PK\x06\x06") > 0
    expected = wheelentries.Expected("vllm", INFO, None)
    layout = [p for p in wheelentries.problems(path, expected) if "belong to no" in p or "record" in p
              or "cannot be read" in p]
    assert not [p for p in layout if "RECORD" not in p], layout[:3]


def test_the_issues_three_wheels_are_one_line_exit_2_from_the_command_line(setup, vupstream,  # noqa: F811
                                                                           tmp_path, monkeypatch, capsys):
    project, _, repo, report, _ = setup
    monkeypatch.setattr(cli, "Project", lambda: project)
    for fault in ("symlink", "top-level .pth", "extra module"):
        hostile = HOSTILE[fault][0](tmp_path / fault.replace(" ", "_"))
        wheels = tmp_path / f"wheels-{fault.replace(' ', '_')}"
        capsys.readouterr()
        code = cli.main(["-q", "--vllm-repo", str(vupstream),
                         "--workdir", str(repo.working_tree_dir), "--build-wheel",
                         "--wheel-dir", str(wheels), "--release-wheel", str(hostile)])
        errs = capsys.readouterr().err.splitlines()
        assert code == errors.USAGE and len(errs) == 1 and errs[0].startswith("apply.py: error: "), errs
        assert list(wheels.iterdir()) == []


def test_requirements_of_a_cuda_build_are_those_its_requirements_files_list(tmp_path):
    files = {"requirements/cuda.txt": b"-r common.txt\ntorch == 2.13.0  # pinned\n",
             "requirements/common.txt": b"numpy\n# a comment\n--extra-index-url x\n"}
    installs = frozenset(wheelentries.requirement_lines(files, "requirements/cuda.txt"))
    assert installs == {"numpy", "torch==2.13.0"}
    expected = wheelentries.Expected("vllm", INFO, None, named_by_tree="numpy torch", installs=installs)
    for line, ok in [("torch==2.13.0", True), ("torch==2.99.0", False), ("numpy", True),
                     ("torch==2.99.0; extra == 'x'", True)]:
        wheel = craft(tmp_path / line.replace(" ", "_").replace(";", "").replace("'", ""),
                      info={"METADATA": _metadata_with(f"Requires-Dist: {line}")})
        found = [p for p in wheelentries.problems(wheel, expected) if "METADATA" in p]
        assert (found == []) == ok, (line, found)


def test_declared_entry_points_are_read_from_the_trees_pyproject():
    text = (b'[project]\nname = "vllm"\n[project.scripts]\nvllm = "vllm.cli:main"\n'
            b'[project.entry-points."vllm.general_plugins"]\nlora = "vllm.plugins:register"\n')
    assert wheelentries.declared_entry_points(text) == {
        "console_scripts": {"vllm": "vllm.cli:main"},
        "vllm.general_plugins": {"lora": "vllm.plugins:register"}}
    assert wheelentries.declared_entry_points(b'[project]\ndynamic = ["scripts"]\n') is None
    assert wheelentries.declared_entry_points(b"[build-system]\n") == {}
    assert wheelentries.parse_entry_points("[console_scripts]\nvllm = vllm.cli:main\n") == {
        "console_scripts": {"vllm": "vllm.cli:main"}}


# -- the built wheel: the same faults fail its checks (exit 5) ------------------------------------


def _with(good_path: Path, dest: Path, add: list[tuple[str, bytes, int]],
          info: dict[str, bytes] | None = None) -> Path:
    """``good_path`` rewritten with ``add`` entries and dist-info files ``info`` replaced,
    RECORD recomputed (so only the named fault is there)."""
    dest.mkdir()
    out = dest / good_path.name
    built_info = "vllm-0.1.0+k3ov.9.9.9.dist-info"
    with zipfile.ZipFile(good_path) as src:
        entries = [(i.filename, src.read(i), i.external_attr >> 16) for i in src.infolist()
                   if not i.filename.endswith("/RECORD")]
    info = info or {}
    entries = [(n, d, m) for n, d, m in entries if n.split("/", 1)[1] not in info] + add
    entries += [(f"{built_info}/{n}", d, REG) for n, d in info.items()]
    rows = record_of([(n, d) for n, d, _ in entries]).decode().splitlines()[:-1]
    with zipfile.ZipFile(out, "w") as archive:
        for name, data, mode in [*entries, (f"{built_info}/RECORD",
                                            ("\n".join(rows + [f"{built_info}/RECORD,,"]) + "\n").encode(),
                                            REG)]:
            entry = zipfile.ZipInfo(name, date_time=(2026, 1, 1, 0, 0, 0))
            entry.external_attr = (mode or REG) << 16
            archive.writestr(entry, data)
    return out


@pytest.mark.parametrize("fault, add, info, expect", [
    (".pth", [("zzz_evil.pth", EVIL_PTH, REG)], {}, "entry 'zzz_evil.pth' is a .pth file"),
    ("link", [("vllm/evil_link.py", b"/etc/passwd", 0o120777)], {}, "'vllm/evil_link.py' is a symbolic link"),
    ("entry point", [], {"entry_points.txt": b"[console_scripts]\nls = vllm.a:A\n"},
     "vllm-0.1.0+k3ov.9.9.9.dist-info/entry_points.txt is not the release's"),
])
def test_the_built_wheels_checks_catch_a_hostile_entry(good, tmp_path, fault, add, info,  # noqa: F811
                                                      expect):
    path, release, put = good
    bad = _with(path, tmp_path / "bad", add, info)
    with pytest.raises(errors.BuildError, match=re.escape(expect)) as err:
        wheelcheck.check(bad, release, LOCAL, put)
    assert err.value.exit_code == errors.VERIFY and "\n" not in str(err.value)


def test_modes_kept_from_the_release_are_plain(good):  # noqa: F811
    path, _, _ = good
    with zipfile.ZipFile(path) as archive:
        modes = {stat.S_IFMT(i.external_attr >> 16) for i in archive.infolist()}
    assert modes == {stat.S_IFREG}
