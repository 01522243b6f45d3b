"""Property-based tests: no input makes the series and manifest readers or the report
writers raise anything but the tool's own error (``OverlayError``), and what they
accept or write keeps its invariants."""

from __future__ import annotations

import io
import json
import os
import tempfile
from pathlib import Path

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from rich.console import Console

from k3overlay import errors, git, manifest, report, series
from k3overlay.manifest import FileResult
from k3overlay.series import PatchResult
from k3overlay.stages import Problem, TestRun
from k3overlay.verify import VerifyResult

SETTINGS = settings(max_examples=60, deadline=None, derandomize=True,
                    suppress_health_check=[HealthCheck.too_slow])

# Text as git output decoded with surrogateescape may be: any code point, lone surrogates
# too, with the characters markup, XML, JSON and terminals care about made likely.
ANY_TEXT = st.lists(st.sampled_from(list("[]/\\<>&\"':\n\r\t\0\x1b") + ["[/x]", "[bold]", "\udcff", "]]>"])
                   | st.characters(exclude_categories=()), max_size=16).map("".join)
# Path-ish text: the characters that make paths interesting.
PATHISH = st.text(st.sampled_from(list("ab/.\\\0\n git~1GIT:[]*?") + ["é", "\udcff"]), max_size=20)
JSON = st.recursive(st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | ANY_TEXT,
                    lambda inner: st.lists(inner, max_size=4)
                    | st.dictionaries(ANY_TEXT, inner, max_size=4), max_leaves=12)
EXISTING = ["pkg/mod.py", "pkg/new.py", "tool.sh"]


def _overlay(root: Path) -> Path:
    """An overlay folder with three real files, a link to one and a link to a folder."""
    overlay = root / "overlay"
    for rel in EXISTING:
        (overlay / rel).parent.mkdir(parents=True, exist_ok=True)
        (overlay / rel).write_text("x = 1\n")
    (overlay / "link.py").symlink_to("pkg/mod.py")
    (overlay / "linkdir").symlink_to("pkg")
    return overlay


def _manifest_entry():
    path = st.sampled_from(EXISTING + ["link.py", "linkdir/mod.py", "pkg", ".git/x"]) | PATHISH | JSON
    blob = st.sampled_from(["new", "0" * 40, "A" * 40, "0" * 39]) | JSON
    return st.fixed_dictionaries({"path": path, "base_blob": blob}) | JSON


MANIFESTS = (st.binary(max_size=200)
             | JSON.map(lambda v: json.dumps(v).encode())
             | st.fixed_dictionaries({"base": st.just("v1.0.0") | JSON,
                                      "files": st.lists(_manifest_entry(), max_size=5) | JSON})
             .map(lambda v: json.dumps(v).encode()))


@SETTINGS
@given(content=MANIFESTS)
def test_manifest_reader_raises_only_usage_errors(content):
    with tempfile.TemporaryDirectory() as tmp:
        overlay = _overlay(Path(tmp))
        path = Path(tmp) / "overlay.json"
        path.write_bytes(content)
        try:
            loaded = manifest.load(path, overlay)
        except errors.OverlayError as err:
            assert "\n" not in str(err).strip()
            return
        for f in loaded.files:  # what it accepts stays inside overlay/ and is a real file there
            parts = f.path.split("/")
            assert ".." not in parts and ".git" not in parts and not f.path.startswith("/")
            assert (overlay / f.path).is_file() and not (overlay / f.path).is_symlink()


VALID_PATCH = (b"From 0000000000000000000000000000000000000000 Mon Sep 17 00:00:00 2001\n"
               b"From: A <a@b.c>\nSubject: [PATCH] x: y\n\nWhy.\n\nUpstream-Status: Pending\n---\n"
               b"diff --git a/x b/x\n--- a/x\n+++ b/x\n@@ -1 +1 @@\n-a\n+b\n")
EXTRA_NAMES = st.sampled_from(["../x.patch", "sub/c.patch", "/etc/passwd", "# comment", "", ".",
                               "..", "series", "nul\0.patch", "0001-a.patch", "sub"]) | PATHISH
# A series lists both patches of the folder (else it is refused early) plus whatever else.
SERIES_NAMES = st.lists(EXTRA_NAMES, max_size=3).flatmap(
    lambda extra: st.permutations(["0001-a.patch", "0002-b.patch", *extra]))
PATCH_BODIES = (st.just(VALID_PATCH)
                | st.binary(max_size=300)
                | st.builds(lambda head, subject, body: head + b"Subject: " + subject
                            + b"\n\nWhy.\n\nUpstream-Status: Pending\n---\n" + body
                            + b"\ndiff --git a/x b/x\n--- a/x\n+++ b/x\n",
                            st.binary(max_size=60), st.binary(max_size=80), st.binary(max_size=80)))


@SETTINGS
@given(names=SERIES_NAMES, raw_series=st.none() | st.binary(max_size=100),
       bodies=st.lists(PATCH_BODIES, min_size=2, max_size=2))
def test_series_reader_raises_only_usage_errors(names, raw_series, bodies):
    with tempfile.TemporaryDirectory() as tmp:
        patches = Path(tmp) / "patches"
        patches.mkdir()
        (Path(tmp) / "x.patch").write_bytes(VALID_PATCH)  # outside patches/: never to be read
        for name, body in zip(["0001-a.patch", "0002-b.patch"], bodies):
            (patches / name).write_bytes(body)
        (patches / "sub").mkdir()
        (patches / "sub" / "c.patch").write_bytes(VALID_PATCH)
        text = raw_series if raw_series is not None else "\n".join(names).encode(errors="surrogateescape")
        (patches / "series").write_bytes(text)
        try:
            loaded = series.load(patches)
        except errors.OverlayError as err:
            assert "\n" not in str(err).strip()
            return
        for patch in loaded:  # what it accepts is a patch file directly in patches/
            assert patch.path.parent == patches and patch.path.is_file()
            assert patch.upstream_status.startswith(("Pending", "Submitted", "Backport", "Inappropriate"))


@SETTINGS
@given(body=PATCH_BODIES)
def test_patch_reader_raises_only_usage_errors(body):
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "0001-x.patch"
        path.write_bytes(body)
        try:
            patch = series.read_patch(path)
        except errors.OverlayError:
            return
        assert isinstance(patch.subject, str) and git.mailinfo(path)[2]  # a diff follows


STATUS = st.sampled_from(["applied", "applied-3way", "landed-upstream", "conflict", "added",
                          "replaced", "drift", "merged"]) | ANY_TEXT
REPORTS = st.builds(
    report.Report, overlay_version=ANY_TEXT, base_ref=ANY_TEXT, ref=ANY_TEXT, ref_sha=ANY_TEXT,
    branch=ANY_TEXT, workdir=ANY_TEXT,
    patches=st.lists(st.builds(PatchResult, ANY_TEXT, STATUS, st.lists(ANY_TEXT, max_size=2),
                               st.lists(ANY_TEXT, max_size=2)), max_size=3),
    overlay=st.lists(st.builds(FileResult, ANY_TEXT, STATUS, ANY_TEXT, ANY_TEXT), max_size=3),
    verify=st.none() | st.builds(VerifyResult, st.booleans(), st.lists(ANY_TEXT, max_size=2)),
    allow_drift=st.booleans(),
    runs=st.lists(st.builds(TestRun, name=ANY_TEXT, passed=st.integers(0, 5),
                            failed=st.integers(0, 5), errors=st.integers(0, 5),
                            problems=st.lists(st.builds(Problem, ANY_TEXT, ANY_TEXT), max_size=2),
                            not_run=st.lists(ANY_TEXT, max_size=2)), max_size=2),
    error=ANY_TEXT, error_code=st.sampled_from([0, 2, 3, 4, 5, 6]),
    notes=st.lists(ANY_TEXT, max_size=2), published=st.booleans())


@settings(SETTINGS, suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
@given(reports=st.lists(REPORTS, min_size=1, max_size=3))
def test_report_writers_raise_only_overlay_errors_and_json_round_trips(reports, tmp_path):
    out = tmp_path / "r.json"
    report.write_json(reports, out)
    # (through dumps on the right too: JSON cannot tell a lone surrogate pair from the code point)
    assert json.loads(out.read_text()) == json.loads(json.dumps([r.to_json() for r in reports]))
    report.write_json(reports[0], out)
    assert json.loads(out.read_text()) == json.loads(json.dumps(reports[0].to_json()))
    for text in (report.markdown(reports), report.junit_xml(reports)):
        report.write_text(tmp_path / "r.txt", text)
        assert (tmp_path / "r.txt").read_bytes().decode("utf-8")  # always valid UTF-8
    for r in reports:
        console = Console(file=io.StringIO(), width=1000, emoji=False)
        report.write_human(r, console)
        assert r.ref in console.file.getvalue() or not r.ref.isprintable()
    assert sorted(os.listdir(tmp_path)) == ["r.json", "r.txt"]  # no temporary file left


@settings(SETTINGS, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(reports=st.lists(REPORTS, min_size=1, max_size=2))
def test_report_writer_into_a_bad_place_is_a_usage_error(reports, tmp_path):
    for bad in (tmp_path, tmp_path / "missing" / "r.json", Path("/proc/version")):
        try:
            report.write_json(reports, bad)
        except errors.UsageError as err:
            assert "\n" not in str(err)
        else:
            raise AssertionError(f"wrote {bad}")
