"""What CI and a person read: the JSON, JUnit XML, markdown and terminal renderings of
hand-built reports, compared with hand-written expectations."""

from __future__ import annotations

import contextlib
import io
import json
import os
import stat
import subprocess
import sys
import threading
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest
from rich.console import Console

from k3overlay import errors
from k3overlay.manifest import FileResult
from k3overlay.report import Report, junit_xml, markdown, next_commands, write_human, write_json
from k3overlay.series import PatchResult
from k3overlay.stages import Problem, Section, TestRun
from k3overlay.verify import VerifyResult

from .test_concurrency import ROOT, RUNNER

DIFF = "diff --git a/m.py b/m.py\n-old\n+new\n"


def clean() -> Report:
    return Report("1.0.0", "v1", "v2", ref_sha="a" * 40, branch="k3/1", workdir="/w",
                  patches=[PatchResult("0001-a.patch", "applied"),
                           PatchResult("0002-b.patch", "landed-upstream")],
                  overlay=[FileResult("m.py", "replaced")], verify=VerifyResult(), published=True)


def broken() -> Report:
    return Report(
        "1.0.0", "v1", "v3", ref_sha="b" * 40,
        patches=[PatchResult("0001-a.patch", "applied-3way"),
                 PatchResult("0002-b.patch", "conflict", ["x.py"], ["x.py:4-8", "CONFLICT (content)"])],
        overlay=[FileResult("m.py", "drift", "upstream blob 1234abcd differs", DIFF),
                 FileResult("n.py", "conflict", "3-way merge: 1 conflicting region(s)", DIFF)],
        verify=VerifyResult(False, ["x.py:1: does not compile: invalid syntax"]),
        runs=[TestRun(passed=2, failed=1, skipped=3, errors=4,
                      problems=[Problem("tests/t.py::test_a", "AssertionError: 1 != 2")])])


def test_exit_codes_by_kind():
    assert clean().exit_code == errors.OK and clean().ok
    assert broken().exit_code == errors.CONFLICT
    drift = clean()
    drift.overlay = [FileResult("m.py", "drift")]
    assert drift.exit_code == errors.DRIFT
    drift.allow_drift = True
    assert drift.exit_code == errors.OK
    merge = clean()
    merge.overlay = [FileResult("m.py", "conflict")]
    merge.allow_drift = True
    assert merge.exit_code == errors.DRIFT
    bad = clean()
    bad.verify = VerifyResult(False, ["e"])
    assert bad.exit_code == errors.VERIFY
    for counts in ({"failed": 1}, {"errors": 1}):
        tested = clean()
        tested.runs = [TestRun(passed=1, **counts)]
        assert tested.exit_code == errors.VERIFY
    stopped = Report("1.0.0", "v1", "v9", error="ref 'v9' not found", error_code=errors.USAGE)
    assert stopped.exit_code == errors.USAGE


def test_json_as_documented(tmp_path):
    data = broken().to_json()
    assert data == {
        "overlay_version": "1.0.0", "base_ref": "v1", "ref": "v3", "ref_sha": "b" * 40,
        "branch": "", "workdir": "", "ok": False,
        "patches": [{"name": "0001-a.patch", "status": "applied-3way"},
                    {"name": "0002-b.patch", "status": "conflict", "files": ["x.py"],
                     "hunks": ["x.py:4-8", "CONFLICT (content)"]}],
        "overlay": [{"path": "m.py", "status": "drift", "detail": "upstream blob 1234abcd differs",
                     "upstream_diff": DIFF},
                    {"path": "n.py", "status": "conflict",
                     "detail": "3-way merge: 1 conflicting region(s)", "upstream_diff": DIFF}],
        "verify": {"ok": False, "status": "failed",
                   "errors": ["x.py:1: does not compile: invalid syntax"]},
        "tests": {"passed": 2, "failed": 1, "skipped": 3, "errors": 4,
                  "problems": [{"test": "tests/t.py::test_a", "kind": "failed",
                                "first_line": "AssertionError: 1 != 2"}]},
    }
    assert clean().to_json()["overlay"] == [{"path": "m.py", "status": "replaced"}]
    unverified = Report("1.0.0", "v1", "v3", patches=[PatchResult("p", "conflict", ["x"], [])])
    assert unverified.to_json()["verify"] == {"ok": False, "status": "not run", "errors": [],
                                              "not_run": "patch p conflicts"}
    unverified.patches, unverified.overlay = [], [FileResult("m.py", "drift")]
    assert unverified.to_json()["verify"]["not_run"] == "overlay m.py drifts"
    unverified.overlay = []
    assert unverified.to_json()["verify"]["not_run"] == "stopped before verification"
    stopped = Report("1.0.0", "v1", "v9", error="ref 'v9' not found", error_code=errors.USAGE)
    assert stopped.to_json()["error"] == "ref 'v9' not found"
    assert stopped.to_json()["verify"]["not_run"] == "ref 'v9' not found"
    out = tmp_path / "r.json"
    write_json([clean(), broken()], out)
    assert json.loads(out.read_text()) == [clean().to_json(), broken().to_json()]
    write_json(clean(), out)
    assert json.loads(out.read_text()) == clean().to_json()


def test_junit_one_suite_per_ref_one_case_per_item():
    root = ET.fromstring(junit_xml([clean(), broken()]))
    assert root.tag == "testsuites" and (root.get("tests"), root.get("failures")) == ("10", "5")
    got = [(s.get("name"), s.get("tests"), s.get("failures"),
            [(c.get("classname"), c.get("name"), c.findtext("system-out"),
              None if c.find("failure") is None else c.find("failure").get("message"))
             for c in s]) for s in root]
    assert got == [
        ("rebase onto v2", "4", "0", [
            ("rebase.v2", "patch 0001-a.patch", "applied", None),
            ("rebase.v2", "patch 0002-b.patch", "landed-upstream", None),
            ("rebase.v2", "overlay m.py", "replaced", None),
            ("rebase.v2", "verify", "ok", None)]),
        ("rebase onto v3", "6", "5", [
            ("rebase.v3", "patch 0001-a.patch", "applied-3way", None),
            ("rebase.v3", "patch 0002-b.patch", "conflict", "x.py:4-8; CONFLICT (content)"),
            ("rebase.v3", "overlay m.py", "drift", "upstream blob 1234abcd differs"),
            ("rebase.v3", "overlay n.py", "conflict", "3-way merge: 1 conflicting region(s)"),
            ("rebase.v3", "verify", "failed: 1 error(s)", "x.py:1: does not compile: invalid syntax"),
            ("rebase.v3", "cpu tests", "2 passed, 1 failed, 3 skipped, 4 errors",
             "2 passed, 1 failed, 3 skipped, 4 errors tests/t.py::test_a: AssertionError: 1 != 2")]),
    ]
    case = root[1][1]
    assert [child.tag for child in case] == ["failure", "system-out"]  # JUnit's schema order
    assert case.find("failure").text == "x.py:4-8; CONFLICT (content)"
    stopped = Report("1.0.0", "v1", "v9", error="ref 'v9' not found", error_code=errors.USAGE)
    [suite] = ET.fromstring(junit_xml([stopped]))
    assert [(c.get("name"), c.find("error").get("message")) for c in suite] == \
        [("job", "ref 'v9' not found")]  # a job that stopped is an error, not a failure


def test_markdown_first_screen_answers_the_maintainer():
    text = markdown([clean(), broken()])
    first = text.split("\n---\n")[0]
    assert first == (
        "## vllm-k3-overlay rebase report\n\n"
        "Overlay 1.0.0 (base v1) onto v2: **clean**, v3: **needs a maintainer** (exit 3).\n\n"
        f"### v2 `{'a' * 10}`: clean: applies, verifies and passes; rebase and export to record "
        "what moved\n\n"
        "- went in: patches applied: 0001; patches landed-upstream: 0002; overlay replaced: 1\n"
        "- verify: ok\n\n"
        "```bash\npython apply.py --rebase-to v2\npython apply.py --export\n```\n\n"
        f"### v3 `{'b' * 10}`: needs a maintainer: 1 patch and 1 overlay file conflict (exit 3)\n\n"
        "- patch `0002-b.patch` **conflicts**: `x.py:4-8`\n"
        "- overlay `m.py` drifted: upstream blob 1234abcd differs\n"
        "- overlay `n.py` **conflicts**: 3-way merge: 1 conflicting region(s)\n"
        "- went in: patches applied-3way: 0001\n"
        "- verify: failed: 1 error(s)\n"
        "  - x.py:1: does not compile: invalid syntax\n"
        "- cpu tests: 2 passed, 1 failed, 3 skipped, 4 errors\n"
        "  - `tests/t.py::test_a`: AssertionError: 1 != 2\n\n"
        "```bash\n"
        "python apply.py --rebase-to v3\n"
        "# stops at 0002-b.patch: resolve x.py, then\n"
        "git -C work/vllm add -- x.py && git -C work/vllm am --continue && python apply.py --rebase-to v3\n"
        "# resolve the conflict markers in n.py\n"
        "# fix what verify found (above) on the work branch\n"
        "git -C work/vllm add -- n.py && git -C work/vllm commit -a && python apply.py --export\n```\n")
    assert "<details><summary>v3: upstream's diff of <code>n.py</code> since v1 (conflict)" in text
    stopped = Report("1.0.0", "v1", "v9", error="ref 'v9' not found", error_code=errors.USAGE)
    assert markdown([stopped]).splitlines()[-1] == \
        "### v9: not run: ref 'v9' not found (exit 2)"


def test_markdown_names_each_overlay_conflict_region_and_the_source():
    report = broken()
    report.vllm_repo = "/src/vllm repo"
    merged = b"a\n<<<<<<< ours\nb\n=======\nc\n>>>>>>> theirs\nd\n<<<<<<< ours\n=======\n>>>>>>> t\n"
    report.overlay = [FileResult("n.py", "conflict", "3-way merge: 2", DIFF, merged)]
    text = markdown([report])
    assert "- overlay `n.py` **conflicts** in 2 regions: `n.py:2-6`, `n.py:8-10`" in text
    assert "python apply.py --rebase-to v3 --vllm-repo '/src/vllm repo'" in text
    assert report.to_json()["overlay"][0]["regions"] == ["n.py:2-6", "n.py:8-10"]


def test_markdown_clips_long_diffs():
    report = broken()
    report.overlay = [FileResult("m.py", "drift", "d", "".join(f"+{i}\n" for i in range(200)))]
    lines = markdown([report]).splitlines()
    assert "+59" in lines and "+60" not in lines
    assert "... 140 more lines (the whole diff is in --json's upstream_diff)" in lines


def test_terminal_summary():
    out = io.StringIO()
    write_human(broken(), Console(file=out, width=120, highlight=False, color_system=None))
    lines = [line.rstrip() for line in out.getvalue().splitlines()]
    assert lines[0] == f"vllm-k3-overlay 1.0.0 on v3 ({'b' * 12}), base v1"
    assert lines[1].split() == ["kind", "item", "status"]
    assert [line.split() for line in lines[2:10]] == [
        ["patch", "0001-a.patch", "applied-3way"],
        ["patch", "0002-b.patch", "conflict"],
        ["x.py:4-8"], ["CONFLICT", "(content)"],
        ["overlay", "m.py", "drift"], ["upstream", "blob", "1234abcd", "differs"],
        ["overlay", "n.py", "conflict"], ["3-way", "merge:", "1", "conflicting", "region(s)"]]
    assert lines[10:15] == ["verify: failed: 1 error(s)", "  x.py:1: does not compile: invalid syntax",
                            "cpu tests: 2 passed, 1 failed, 3 skipped, 4 errors",
                            "  tests/t.py::test_a: AssertionError: 1 != 2", "failed (exit 3)"]
    # nothing was published (--check): what to run next follows the verdict, as in the markdown
    assert lines[15:] == [f"  next: {command}" for command in next_commands(broken())]
    assert lines[15] == "  next: python apply.py --rebase-to v3"
    out = io.StringIO()
    write_human(clean(), Console(file=out, width=120, highlight=False, color_system=None))
    assert out.getvalue().rstrip().splitlines()[-2:] == ["verify: ok", "ok -> branch k3/1 in /w"]


def test_a_test_run_in_every_rendering():
    report = clean()
    report.runs = [TestRun(passed=1, not_run=["tests/ours.py: the tree lacks our overlay "
                                              "(patch 0002 conflicts)"])]
    report.published = False
    out = io.StringIO()
    write_human(report, Console(file=out, width=200, highlight=False, color_system=None))
    line = "1 passed, 0 failed, 0 skipped, 0 errors; 1 file(s) not run"
    assert out.getvalue().rstrip().splitlines()[-3:] == [
        f"cpu tests: {line}",
        "  not run: tests/ours.py: the tree lacks our overlay (patch 0002 conflicts)",
        "ok"]  # not published: no branch named
    assert f"- cpu tests: {line}" in markdown([report])
    assert ("  - not run: `ours.py`: the tree lacks our overlay (patch 0002 conflicts)"
            in markdown([report]))
    [suite] = ET.fromstring(junit_xml([report]))
    assert suite[-1].findtext("system-out") == line


def test_junit_failure_of_a_conflict_without_files_or_hunks():
    report = clean()
    report.patches = [PatchResult("0001-a.patch", "conflict")]
    [suite] = ET.fromstring(junit_xml([report]))
    assert suite[0].find("failure").get("message") == "conflict"


def test_json_file_is_indented_for_people_too(tmp_path):
    out = tmp_path / "r.json"
    write_json(clean(), out)
    assert out.read_text() == json.dumps(clean().to_json(), indent=2) + "\n"


def test_errors_alone_fail_and_each_is_explained():
    report = clean()
    report.runs = [TestRun(errors=2, problems=[
        Problem("tests/kernels/test_ours.py", "AttributeError: module 'm' has no attribute "
                "'BACKENDS'", "error")])]
    out = io.StringIO()
    write_human(report, Console(file=out, width=200, highlight=False, color_system=None))
    assert ("  tests/kernels/test_ours.py: AttributeError: module 'm' has no attribute 'BACKENDS'"
            in out.getvalue().splitlines())
    [suite] = ET.fromstring(junit_xml([report]))
    assert suite[-1].find("failure").text.splitlines() == [
        "0 passed, 0 failed, 0 skipped, 2 errors",
        "tests/kernels/test_ours.py: AttributeError: module 'm' has no attribute 'BACKENDS'"]
    assert "BACKENDS" in markdown([report]) and report.exit_code == errors.VERIFY
    assert report.to_json()["tests"]["problems"][0]["kind"] == "error"


def test_wheel_lines():
    built, failed = clean(), clean()
    built.wheel = {"path": "/w/vllm.whl", "name": "vllm.whl", "size": 1234567, "sha256": "ab" * 32}
    failed.wheel = {"error": "no release wheel", "exit_code": errors.USAGE}
    out = io.StringIO()
    write_human(built, Console(file=out, width=200, highlight=False, color_system=None))
    assert f"wheel: /w/vllm.whl (1,234,567 bytes, sha256 {'ab' * 32})" in out.getvalue().splitlines()
    text = markdown([built, failed])
    assert f"- wheel `vllm.whl`, 1,234,567 bytes, sha256 `{'ab' * 32}`" in text.splitlines()
    assert "- wheel not built: no release wheel" in text.splitlines()
    assert failed.exit_code == errors.USAGE and failed.to_json()["wheel"] == failed.wheel


def test_sections_are_rendered_as_given():
    report = clean()
    report.sections = [Section("tables", "table diff", ["SM90 1 upstream only", "SM100 same"],
                               {"archs": {}}, "| a | b |"),
                       Section("ab", "gpu a/b", ["not run: no CUDA"], {"error": "no CUDA"},
                               error="not run: no CUDA", exit_code=errors.ENVIRONMENT)]
    out = io.StringIO()
    write_human(report, Console(file=out, width=200, highlight=False, color_system=None))
    assert ["table diff: SM90 1 upstream only", "table diff: SM100 same",
            "gpu a/b: not run: no CUDA"] == out.getvalue().splitlines()[-4:-1]
    assert report.to_json()["tables"] == {"archs": {}} and report.exit_code == errors.ENVIRONMENT
    text = markdown([report]).splitlines()
    assert "- table diff: SM90 1 upstream only" in text and "| a | b |" in text
    assert text.index("<details><summary>v2: table diff</summary>") > text.index("---")
    cases = {c.get("name"): c for c in ET.fromstring(junit_xml([report]))[0]}
    assert cases["table diff"].find("error") is None
    assert cases["gpu a/b"].find("error").get("message") == "not run: no CUDA"


def test_wheel_cases_in_junit():
    built, failed = clean(), clean()
    built.wheel = {"path": "/w/vllm.whl", "name": "vllm.whl", "size": 1, "sha256": "ab" * 32}
    failed.wheel = {"error": "no release wheel", "exit_code": errors.USAGE}
    suites = ET.fromstring(junit_xml([built, failed]))
    ok, bad = ([c for c in suite if c.get("name") == "wheel"][0] for suite in suites)
    assert ok.findtext("system-out") == "vllm.whl" and ok.find("failure") is None
    assert bad.findtext("system-out") == "no release wheel"
    assert bad.find("failure").get("message") == "no release wheel"


def test_json_to_a_fifo_is_written_in_place_whole(tmp_path):
    """(In this process: test_report.py also runs the same through apply.py.)"""
    fifo = tmp_path / "report.fifo"
    os.mkfifo(fifo)
    report = clean()
    report.error = "x" * 200_000  # more than a pipe holds: written in several pieces
    got = []
    reader = threading.Thread(target=lambda: got.append(fifo.read_bytes()))
    reader.start()
    write_json(report, fifo)
    reader.join(30)
    data = json.loads(got[0])
    assert data["ref"] == "v2" and data["error"] == "x" * 200_000
    assert stat.S_ISFIFO(os.lstat(fifo).st_mode)  # not replaced by a file


@pytest.mark.parametrize("form", ["/dev/fd/{fd}", "/proc/self/fd/{fd}", "/proc/{pid}/fd/{fd}"])
def test_json_to_an_open_descriptor_of_ours_is_written_to_it(form):
    read, write = os.pipe()
    try:
        write_json(clean(), Path(form.format(fd=write, pid=os.getpid())))
        os.close(write)
        with os.fdopen(read, "rb") as pipe:
            assert json.loads(pipe.read())["ref"] == "v2"
    finally:
        with contextlib.suppress(OSError):
            os.close(write)


def test_a_new_report_file_gets_0o666_less_the_umask(tmp_path):
    umask = os.umask(0o022)
    os.umask(umask)
    write_json(clean(), tmp_path / "r.json")
    assert stat.S_IMODE(os.stat(tmp_path / "r.json").st_mode) == 0o666 & ~umask


def test_added_and_replaced_files_show_no_detail_line_other_statuses_do():
    report = clean()
    report.overlay = [FileResult("a.py", "added", "note a"), FileResult("r.py", "replaced", "note r"),
                      FileResult("m.py", "merged", "note m")]
    out = io.StringIO()
    write_human(report, Console(file=out, width=120, highlight=False, color_system=None))
    notes = [line.split() for line in out.getvalue().splitlines() if "note" in line]
    assert notes == [["note", "m"]]


# -- Found by the adversarial pass: report targets that are streams, not files.
#
# ``--json /dev/stdout > out.txt`` lost the human report (a file was renamed over the
# shell's), ``--json >(jq .)`` was refused as missing, and a FIFO or a device named as the
# report was replaced by a regular file (as root, ``--json /dev/full`` replaced the device
# node). Each is now written to in place; a regular file is still replaced whole.


def run_cli(project, upstream, tmp_path, json_target, **kwargs):
    return subprocess.run([sys.executable, "-c", RUNNER, str(project.root), "-q", "--vllm-repo",
                           str(upstream), "--workdir", str(tmp_path / "wd"), "--json", json_target],
                          cwd=ROOT, env={**os.environ, "XDG_CACHE_HOME": str(tmp_path / "cache")},
                          **kwargs)


def test_json_to_dev_stdout_redirected_to_a_file_keeps_the_human_report(project, upstream, tmp_path):
    out = tmp_path / "out.txt"
    with out.open("wb") as stdout:
        done = run_cli(project, upstream, tmp_path, "/dev/stdout", stdout=stdout, stderr=subprocess.PIPE)
    assert done.returncode == 0, done.stderr
    text = out.read_text()
    human, _, rest = text.partition("{\n")
    assert "ok -> branch k3-overlay/9.9.9" in human  # printed first, still there
    assert json.loads("{\n" + rest)["ok"] is True


def test_json_to_an_inherited_descriptor_like_process_substitution(project, upstream, tmp_path):
    read_end, write_end = os.pipe()
    chunks = []
    reader = threading.Thread(target=lambda: chunks.append(os.read(read_end, 1 << 20)))
    reader.start()
    done = run_cli(project, upstream, tmp_path, f"/dev/fd/{write_end}", pass_fds=(write_end,),
                   capture_output=True, text=True)
    os.close(write_end)
    reader.join(30)
    os.close(read_end)
    assert done.returncode == 0 and done.stderr == "", done.stderr
    assert json.loads(chunks[0])["ok"] is True


def test_json_to_a_fifo_writes_into_it_and_leaves_it_a_fifo(project, upstream, tmp_path):
    fifo = tmp_path / "report.fifo"
    os.mkfifo(fifo)
    got = []

    def read():
        with open(fifo, "rb") as f:
            got.append(f.read())

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    done = run_cli(project, upstream, tmp_path, str(fifo), capture_output=True, text=True)
    if reader.is_alive():  # the tool never opened the FIFO: let the reader go
        with open(fifo, "wb"):
            pass
    reader.join(30)
    assert done.returncode == 0, done.stderr
    assert stat.S_ISFIFO(os.lstat(fifo).st_mode)
    assert got and json.loads(got[0])["ok"] is True
    assert sorted(os.listdir(tmp_path)) == sorted(["cache", "project", "report.fifo", "wd"])


def test_junit_holds_a_path_that_is_not_utf8_and_control_characters():
    # Hypothesis found it (test_properties); this is the case by hand: a path git gave back
    # with surrogateescape, and a control character in a message.
    from xml.etree import ElementTree

    from k3overlay.report import Report, junit_xml

    r = Report("0.1.0", "v1.0.0", "v1.\udcff", error="bad \x01 name pkg/\udcffx.py")
    root = ElementTree.fromstring(junit_xml([r]))
    error = root.find(".//error")
    assert error is not None and error.get("message") == "bad \ufffd name pkg/\ufffdx.py"


def test_human_report_prints_values_that_together_look_like_markup():
    """Each value escaped alone still let "[/" (the ref) and "]" (the sha) form a closing
    tag across the two; rich raised MarkupError. Found by the report property test."""
    from io import StringIO

    from rich.console import Console

    from k3overlay import report
    from k3overlay.verify import VerifyResult

    r = report.Report("0.1.0", "v1.0.0", "[/", ref_sha="]", error="[/red] x [bold]", error_code=2,
                      runs=[TestRun(passed=1)],
                      notes=["[/ (]"])
    r.verify = VerifyResult(ok=False, errors=["pkg/[x].py:1: does not compile"])
    out = StringIO()
    report.write_human(r, Console(file=out, width=200, color_system=None))
    text = out.getvalue()
    assert "on [/ (]" in text
    assert "[/red] x [bold]" in text and "pkg/[x].py:1" in text and "[/ (]" in text
