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
from k3overlay.report import Report, junit_xml, markdown, write_human, write_json
from k3overlay.series import PatchResult
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
        tests={"passed": 2, "failed": 1, "skipped": 3, "errors": 4})


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
        tested.tests = {"passed": 1, "failed": 0, "skipped": 0, "errors": 0, **counts}
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
        "verify": {"ok": False, "errors": ["x.py:1: does not compile: invalid syntax"]},
        "tests": {"passed": 2, "failed": 1, "skipped": 3, "errors": 4},
    }
    assert clean().to_json()["overlay"] == [{"path": "m.py", "status": "replaced"}]
    unverified = Report("1.0.0", "v1", "v3", patches=[PatchResult("p", "conflict", ["x"], [])])
    assert unverified.to_json()["verify"] == {"ok": False, "errors": ["not run: a patch conflicts"]}
    unverified.patches, unverified.overlay = [], [FileResult("m.py", "drift")]
    assert unverified.to_json()["verify"]["errors"] == ["not run: overlay drift"]
    unverified.overlay = []
    assert unverified.to_json()["verify"]["errors"] == ["not run: stopped before verification"]
    stopped = Report("1.0.0", "v1", "v9", error="ref 'v9' not found", error_code=errors.USAGE)
    assert stopped.to_json()["error"] == "ref 'v9' not found"
    assert stopped.to_json()["verify"]["errors"] == ["not run: ref 'v9' not found"]
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
            ("rebase.v3", "verify", "failed", "x.py:1: does not compile: invalid syntax"),
            ("rebase.v3", "cpu tests", "2 passed, 1 failed, 3 skipped, 4 errors",
             "2 passed, 1 failed, 3 skipped, 4 errors")]),
    ]
    case = root[1][1]
    assert [child.tag for child in case] == ["failure", "system-out"]  # JUnit's schema order
    assert case.find("failure").text == "x.py:4-8; CONFLICT (content)"
    stopped = Report("1.0.0", "v1", "v9", error="ref 'v9' not found", error_code=errors.USAGE)
    [suite] = ET.fromstring(junit_xml([stopped]))
    assert [(c.get("name"), c.find("error").get("message")) for c in suite] == \
        [("job", "ref 'v9' not found")]  # a job that stopped is an error, not a failure


def test_markdown_comment():
    text = markdown([clean(), broken()])
    assert text == (
        "## vllm-k3-overlay rebase report\n\n"
        "| ref | verdict | patches | overlay | verify | tests |\n"
        "|---|---|---|---|---|---|\n"
        f"| v2 `{'a' * 10}` | ok | 0001 applied, 0002 landed-upstream | `m.py` replaced | ok | - |\n"
        f"| v3 `{'b' * 10}` | **exit 3** | 0001 applied-3way, 0002 conflict "
        "| `m.py` drift, `n.py` conflict | failed | 2 passed, 1 failed, 3 skipped, 4 errors |\n"
        "\n<details><summary>v3: upstream's diff of <code>m.py</code> since v1 (drift)</summary>\n\n"
        f"```diff\n{DIFF}```\n</details>\n"
        "\n<details><summary>v3: upstream's diff of <code>n.py</code> since v1 (conflict)</summary>\n\n"
        f"```diff\n{DIFF}```\n</details>\n"
    )
    stopped = Report("1.0.0", "v1", "v9", error="ref 'v9' not found", error_code=errors.USAGE)
    assert markdown([stopped]).splitlines()[-3:] == ["| v9 | **exit 2** | - | - | - | - |", "",
                                                     "v9: ref 'v9' not found"]


def test_markdown_clips_long_diffs():
    report = broken()
    report.overlay = [FileResult("m.py", "drift", "d", "".join(f"+{i}\n" for i in range(200)))]
    lines = markdown([report]).splitlines()
    assert "+149" in lines and "+150" not in lines
    assert "... 50 more lines (the whole diff is in --json's upstream_diff)" in lines


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
    assert lines[10:] == ["verify: failed", "  x.py:1: does not compile: invalid syntax",
                          "tests: 2 passed, 1 failed, 3 skipped, 4 errors", "failed (exit 3)"]
    out = io.StringIO()
    write_human(clean(), Console(file=out, width=120, highlight=False, color_system=None))
    assert out.getvalue().rstrip().splitlines()[-2:] == ["verify: ok", "ok -> branch k3/1 in /w"]


def test_counts_a_test_tier_left_out_read_as_zero():
    report = clean()
    report.tests = {"passed": 1}
    report.published = False
    out = io.StringIO()
    write_human(report, Console(file=out, width=120, highlight=False, color_system=None))
    assert out.getvalue().rstrip().splitlines()[-2:] == [
        "tests: 1 passed, 0 failed, 0 skipped, 0 errors", "ok"]  # not published: no branch named
    assert "| 1 passed, 0 failed, 0 skipped, 0 errors |" in markdown([report])
    [suite] = ET.fromstring(junit_xml([report]))
    assert suite[-1].findtext("system-out") == "1 passed, 0 failed, 0 skipped, 0 errors"


def test_junit_failure_of_a_conflict_without_files_or_hunks():
    report = clean()
    report.patches = [PatchResult("0001-a.patch", "conflict")]
    [suite] = ET.fromstring(junit_xml([report]))
    assert suite[0].find("failure").get("message") == "conflict"


def test_json_file_is_indented_for_people_too(tmp_path):
    out = tmp_path / "r.json"
    write_json(clean(), out)
    assert out.read_text() == json.dumps(clean().to_json(), indent=2) + "\n"


def test_counts_missing_from_a_test_tier_and_errors_alone_fail():
    report = clean()
    report.tests = {"errors": 2}
    out = io.StringIO()
    write_human(report, Console(file=out, width=120, highlight=False, color_system=None))
    assert "tests: 0 passed, 0 failed, 0 skipped, 2 errors" in out.getvalue().splitlines()
    [suite] = ET.fromstring(junit_xml([report]))
    assert all(case.tag == "testcase" for case in suite)
    assert suite[-1].find("failure").get("message") == "0 passed, 0 failed, 0 skipped, 2 errors"


def test_wheel_lines():
    built, failed = clean(), clean()
    built.wheel = {"path": "/w/vllm.whl", "name": "vllm.whl", "size": 1234567, "sha256": "ab" * 32}
    failed.wheel = {"error": "no release wheel", "exit_code": errors.USAGE}
    out = io.StringIO()
    write_human(built, Console(file=out, width=200, highlight=False, color_system=None))
    assert f"wheel: /w/vllm.whl (1,234,567 bytes, sha256 {'ab' * 32})" in out.getvalue().splitlines()
    text = markdown([built, failed])
    assert f"v2: wheel `vllm.whl`, 1,234,567 bytes, sha256 `{'ab' * 32}`" in text.splitlines()
    assert "v2: wheel not built: no release wheel" in text.splitlines()
    assert failed.exit_code == errors.USAGE and failed.to_json()["wheel"] == failed.wheel


# -- the GPU stage and the table diff, as the rebase job hands them over (ci/rebase.py) -------
CUTE = {"backend": "cute", "config": {"block_size": 32, "outputs_per_block": 2, "k_unroll": 1,
                                      "vector_width": 8, "static_k": None}}


def with_gpu_stage() -> Report:
    report = clean()
    report.tables = {"upstream": {"module": "up_tables.py"}, "ours": {"module": "our_tables.py"},
                     "archs": {"SM90": {
                         "upstream_only": [{"N": 64, "K": 256, "M": 1, "residual": False,
                                            "upstream": CUTE, "ours": None}],
                         "ours_only": [], "same": 30,
                         "different": [{"N": 64, "K": 512, "M": 2, "residual": True,
                                        "upstream": {"backend": "dsv3_fused_a", "config": None},
                                        "ours": CUTE}]}}}
    report.gpu = {"passed": 5, "failed": 0, "skipped": 1, "errors": 0,
                  "env": {"gpu": "NVIDIA H200", "torch": "2.13.0", "count": 1},
                  "suites": {"kernels": {"passed": 5, "skipped": 1}}}
    report.ab = {"arch": "SM90", "method": "CUDA graphs, median of 50",
                 "summary": {"measured": 2, "rows": 3, "geomean_ours": 1.31, "geomean_upstream": 1.12,
                             "geomean_ours_over_upstream": 1.17, "errors": 0,
                             "wins": {"ours": 2, "upstream": 0, "tie": 1}},
                 "provenance": {"gpu": "NVIDIA H200", "date": "2026-11-30", "torch": "2.13.0",
                                "cutlass_dsl": "4.3.0"},
                 "rows": [{"N": 64, "K": 256, "M": 1, "cublas_us": 6.5, "upstream": None,
                           "ours": {**CUTE, "us": 4.25}, "winner": "ours"},
                          {"N": 64, "K": 256, "M": 2, "cublas_us": 7.0, "winner": "cuBLAS",
                           "upstream": {"backend": "dsv3_fused_a", "config": None, "status": "failed"},
                           "ours": {"backend": "dsv3_fused_a", "config": None}}]}
    return report


def test_gpu_stage_and_table_diff_in_every_rendering():
    report = with_gpu_stage()
    ab = ("SM90 2/3 rows measured; geo-mean x cuBLAS ours 1.31 upstream 1.12 (ours/upstream 1.17); "
          "wins ours 2, upstream 0, tie 1")
    out = io.StringIO()
    write_human(report, Console(file=out, width=300, highlight=False, color_system=None))
    lines = out.getvalue().splitlines()
    assert "table diff SM90: 1 upstream only, 0 ours only, 1 different, 30 same" in lines
    assert "gpu tests: 5 passed, 0 failed, 1 skipped, 0 errors" in lines
    assert f"gpu a/b: {ab}" in lines
    text = markdown([report]).splitlines()
    start = text.index("### v2: low-latency GEMM tables, ours vs upstream")
    assert text[start + 1:start + 5] == [
        "Upstream: `up_tables.py`; ours: `our_tables.py`. Rows are (N, K, M); config = block_size, "
        "outputs_per_block, k_unroll, vector_width, static_k.", "",
        "| arch | upstream only | ours only | different | same |", "|---|--:|--:|--:|--:|"]
    assert "| SM90 | 1 | 0 | 1 | 30 |" in text
    assert "<details><summary>v2: the 2 rows that differ</summary>" in text
    assert "| SM90 | upstream only | 64x256 M1 | cute 32,2,1,8,- | cuBLAS |" in text
    assert "| SM90 | different | 64x512 M2 +residual | dsv3_fused_a | cute 32,2,1,8,- |" in text
    start = text.index("### v2: GPU stage")
    assert text[start + 1:start + 5] == [
        "- tests: 5 passed, 0 failed, 1 skipped, 0 errors (gpu NVIDIA H200, torch 2.13.0)",
        "  - kernels: 5 passed, 0 failed, 1 skipped, 0 errors",
        f"- A/B: {ab}",
        "  - measured on NVIDIA H200 2026-11-30, torch 2.13.0, nvidia-cutlass-dsl 4.3.0; "
        "CUDA graphs, median of 50"]
    start = text.index("<details><summary>v2: A/B per row (µs per call)</summary>")
    assert text[start + 1:start + 7] == [
        "", "| N x K | M | cuBLAS | upstream | µs | ours | µs | faster |",
        "|---|--:|--:|---|--:|---|--:|---|",
        "| 64x256 | 1 | 6.5 | cuBLAS | = | cute 32,2,1,8,- | 4.25 | ours |",
        "| 64x256 | 2 | 7.0 | dsv3_fused_a | failed | dsv3_fused_a | n/a | cuBLAS |", "</details>"]
    [suite] = ET.fromstring(junit_xml([report]))
    assert {c.get("classname") for c in suite} == {"rebase.v2"}
    cases = {c.get("name"): c for c in suite}
    assert cases["table diff SM90"].findtext("system-out") == \
        "1 upstream only, 0 ours only, 1 different, 30 same"
    assert cases["gpu tests"].findtext("system-out") == "5 passed, 0 failed, 1 skipped, 0 errors"
    assert cases["gpu a/b ours vs upstream vs cuBLAS"].findtext("system-out") == ab
    assert not any(c.find("failure") is not None or c.find("error") is not None for c in suite)


def test_gpu_stage_that_could_not_run_is_an_error_not_a_pass():
    report = clean()
    report.tables = {"error": "upstream's tables: no such module"}
    report.gpu = {"env_error": "no GPU results for v2 in --gpu-results"}
    report.ab = {"error": "no A/B results"}
    report.ref = "v0.28.0"  # dots would be package separators in a JUnit class name
    [suite] = ET.fromstring(junit_xml([report]))
    errors_by_case = {c.get("name"): c.find("error").get("message") for c in suite
                      if c.find("error") is not None}
    assert {c.get("classname") for c in suite} == {"rebase.v0_28_0"}
    assert errors_by_case == {
        "table diff -": "not read: upstream's tables: no such module",
        "gpu tests": "not run: environment error: no GPU results for v2 in --gpu-results",
        "gpu a/b ours vs upstream vs cuBLAS": "not run: no A/B results"}
    text = markdown([report]).splitlines()
    assert "**v0.28.0: table diff not read**: upstream's tables: no such module" in text
    assert "- A/B: not run: no A/B results" in text


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
    """(In this process: tests/test_breaker_reports.py runs the same through apply.py.)"""
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


def test_an_ab_summary_without_an_architecture_says_so():
    report = with_gpu_stage()
    del report.ab["arch"]
    out = io.StringIO()
    write_human(report, Console(file=out, width=300, highlight=False, color_system=None))
    assert "gpu a/b: ? 2/3 rows measured; geo-mean x cuBLAS ours 1.31 upstream 1.12 (ours/upstream " \
           "1.17); wins ours 2, upstream 0, tie 1" in out.getvalue().splitlines()


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
                      tests={"passed": 1, "failed": 0, "skipped": 0, "errors": 0},
                      notes=["[/ (]"])
    r.verify = VerifyResult(ok=False, errors=["pkg/[x].py:1: does not compile"])
    out = StringIO()
    report.write_human(r, Console(file=out, width=200, color_system=None))
    text = out.getvalue()
    assert "on [/ (]" in text
    assert "[/red] x [bold]" in text and "pkg/[x].py:1" in text and "[/ (]" in text
