"""The result of one job on one ref, and its renderings.

``to_json`` is the schema CI parses (README documents it); ``write_human``
is for a person at a terminal; ``junit`` and ``markdown`` are for CI
systems and pull-request comments.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from pathlib import Path

from junit_xml import TestCase, TestSuite, to_xml_report_string
from rich.console import Console
from rich.table import Table
from rich.text import Text

from . import errors
from .files import stream_target, write_atomically
from .manifest import CONFLICT as FILE_CONFLICT
from .manifest import DRIFT, FileResult
from .redact import redact, scrub
from .series import CONFLICT as PATCH_CONFLICT
from .series import PatchResult
from .verify import VerifyResult


@dataclass
class Report:
    """Everything one job found for one ref.

    ``allow_drift``: drift was accepted by the user, so it does not fail the job.
    ``tests``: pass/fail/skip counts of the CPU tier, when the job ran one
    (``env_errors``: failures it could not attribute to the tree; ``env``: the
    environment they ran in; ``env_error``: why there was none).
    ``tables``: ours-vs-upstream diff of the low-latency GEMM tables (``ci/table_diff.py``).
    ``gpu``: counts of the GPU stage's test suites; ``ab``: its ours/upstream/cuBLAS timing.
    ``wheel``: the wheel built from the result (``wheel.build_for``), or why none was.
    ``error``: a one-line reason when the job stopped early (bad input etc.).
    """

    overlay_version: str
    base_ref: str
    ref: str
    ref_sha: str = ""
    branch: str = ""
    workdir: str = ""
    patches: list[PatchResult] = field(default_factory=list)
    overlay: list[FileResult] = field(default_factory=list)
    verify: VerifyResult | None = None
    allow_drift: bool = False
    tests: dict | None = None
    tables: dict | None = None
    gpu: dict | None = None
    ab: dict | None = None
    wheel: dict | None = None
    error: str = ""
    error_code: int = errors.OK
    notes: list[str] = field(default_factory=list)
    published: bool = False  # the work branch in ``workdir`` holds the result

    @property
    def exit_code(self) -> int:
        """0 ok, 2 usage, 3 patch conflict, 4 overlay drift/conflict, 5 verify, 6 source."""
        if self.error_code:
            return self.error_code
        if any(p.status == PATCH_CONFLICT for p in self.patches):
            return errors.CONFLICT
        if any(f.status == FILE_CONFLICT for f in self.overlay):
            return errors.DRIFT
        if not self.allow_drift and any(f.status == DRIFT for f in self.overlay):
            return errors.DRIFT
        if self.verify is not None and not self.verify.ok:
            return errors.VERIFY
        runs = [r for r in (self.tests, self.gpu) if r is not None]
        if any(r.get("failed") or r.get("errors") for r in runs):
            return errors.VERIFY
        if self.wheel is not None and "error" in self.wheel:
            return self.wheel["exit_code"]
        if any(r.get("env_errors") or r.get("env_error") for r in runs):
            return errors.ENVIRONMENT
        return errors.OK

    @property
    def ok(self) -> bool:
        return self.exit_code == errors.OK

    def _why_not_verified(self) -> str:
        if self.error:
            return self.error
        if self.exit_code == errors.CONFLICT:
            return "a patch conflicts"
        return "overlay drift" if self.exit_code == errors.DRIFT else "stopped before verification"

    def to_json(self) -> dict:
        """The report as the JSON object documented in README.md."""
        verify = self.verify or VerifyResult(False, [f"not run: {self._why_not_verified()}"])
        data = {
            "overlay_version": self.overlay_version,
            "base_ref": self.base_ref,
            "ref": self.ref,
            "ref_sha": self.ref_sha,
            "branch": self.branch,
            "workdir": self.workdir,
            "ok": self.ok,
            "patches": [_patch_json(p) for p in self.patches],
            "overlay": [_file_json(f) for f in self.overlay],
            "verify": {"ok": verify.ok, "errors": verify.errors},
        }
        for key in ("tests", "tables", "gpu", "ab", "wheel"):
            if getattr(self, key) is not None:
                data[key] = getattr(self, key)
        if self.error:
            data["error"] = self.error
        return data


def _patch_json(p: PatchResult) -> dict:
    data = {"name": p.name, "status": p.status}
    if p.status == PATCH_CONFLICT:
        data.update(files=p.files, hunks=p.hunks)
    return data


def _file_json(f: FileResult) -> dict:
    data = {"path": f.path, "status": f.status}
    if f.detail:
        data["detail"] = f.detail
    if f.upstream_diff:
        data["upstream_diff"] = f.upstream_diff
    return data


def write_json(reports: list[Report] | Report, path: Path) -> None:
    """Write one report (an object) or several (a list of objects) as JSON.

    Raises UsageError (one line) if the file cannot be written.
    """
    data = reports.to_json() if isinstance(reports, Report) else [r.to_json() for r in reports]
    write_text(path, json.dumps(scrub(data), indent=2) + "\n")


def check_writable(path: Path, option: str) -> None:
    """Make sure a report file can be written, before any work is done (UsageError if not).

    Does what ``write_text`` will do, with an empty text, beside the real file:
    rather than asking ``os.access``, which says yes to root even on a
    read-only mount or /proc. Leaves nothing behind.
    """
    if path.is_dir():
        raise errors.UsageError(f"{option} {path}: cannot write there (it is a folder)")
    if stream_target(path) is not None:
        return  # /dev/stdout, a FIFO, a device: written to in place (``write_atomically``)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
    except OSError as err:
        raise errors.UsageError(f"{option} {path}: cannot write there ({err.strerror})") from err
    probe = path.with_name(f".{path.name[:64]}.k3-probe")
    try:
        write_atomically(probe, b"")
    except errors.UsageError as err:
        reason = str(err).rsplit(": ", 1)[-1]
        raise errors.UsageError(f"{option} {path}: cannot write there ({reason})") from err
    probe.unlink(missing_ok=True)


def write_text(path: Path, text: str) -> None:
    """Write a report file whole or not at all (temporary file, fsync, rename): a full disk
    leaves the previous report as it was. Raises UsageError (one line) on failure.
    The text passes through ``redact`` (no password or token reaches a report)."""
    write_atomically(path, redact(text).encode("utf-8", errors="replace"))


_STYLE = {"applied": "green", "applied-3way": "yellow", "landed-upstream": "cyan",
          "added": "green", "replaced": "green", "merged": "yellow",
          "drift": "red", "conflict": "red"}


def write_human(report: Report, console: Console) -> None:
    """A short summary: ref, each patch and overlay file with its status, verify, verdict.

    Every value is printed as text, never as rich markup: a path or a git
    message holding ``[/x]`` is shown as it is, not parsed (or raised on).
    """
    # Lines are assembled as Text, never as markup built from escaped pieces: escaping
    # each value alone still lets two neighbours ("[/" then "]") form a tag.
    report = scrub(report)  # before rich wraps a long line, which would cut a URL in two
    console.print(Text.assemble((f"vllm-k3-overlay {report.overlay_version}", "bold"),
                                f" on {report.ref} ({report.ref_sha[:12] or '?'}), "
                                f"base {report.base_ref}"))
    table = Table(show_header=True, header_style="bold", box=None, pad_edge=False)
    table.add_column("kind")
    table.add_column("item")
    table.add_column("status")
    for p in report.patches:
        table.add_row("patch", Text(p.name), _styled(p.status))
        for line in p.hunks or p.files:
            table.add_row("", Text(f"  {line}"), "")
    for f in report.overlay:
        table.add_row("overlay", Text(f.path), _styled(f.status))
        if f.detail and f.status not in ("added", "replaced"):
            table.add_row("", Text(f"  {f.detail}"), "")
    if report.patches or report.overlay:
        console.print(table)
    if report.verify is not None:
        console.print(Text.assemble("verify: ", ("ok", "") if report.verify.ok else ("failed", "red")))
        for error in report.verify.errors:
            console.print(Text(f"  {error}"))
    if report.tests is not None:
        console.print(Text(f"tests: {counts_line(report.tests)}"))
    for arch, line in table_lines(report.tables):
        console.print(Text(f"table diff {arch}: {line}"))
    if report.gpu is not None:
        console.print(Text(f"gpu tests: {counts_line(report.gpu)}"))
    if report.ab is not None:
        console.print(Text(f"gpu a/b: {ab_line(report.ab)}"))
    if report.wheel is not None:
        w = report.wheel
        console.print(Text.assemble("wheel: ", ("not built", "red"), f": {w['error']}") if "error" in w
                      else Text(f"wheel: {w['path']} ({w['size']:,} bytes, sha256 {w['sha256']})"))
    for note in report.notes:
        console.print(Text(note))
    if report.ok:
        where = f" -> branch {report.branch} in {report.workdir}" if report.published else ""
        console.print(Text.assemble(("ok", "green"), where))
    else:
        console.print(Text.assemble(("failed", "red"), f" (exit {report.exit_code})"
                                    + (f": {report.error}" if report.error else "")))


def _styled(status: str) -> Text:
    return Text(status, style=_STYLE.get(status, "white"))


COUNTS = ("passed", "failed", "skipped", "errors")


def counts_line(run: dict) -> str:
    """``"3 passed, 0 failed, 1 skipped, 0 errors"`` (+ environment errors, if any)."""
    if run.get("env_error"):
        return f"not run: environment error: {run['env_error']}"
    line = ", ".join(f"{run.get(k, 0)} {k}" for k in COUNTS)
    return line + (f", {run['env_errors']} environment errors" if run.get("env_errors") else "")


def table_lines(tables: dict | None) -> list[tuple[str, str]]:
    """``[(arch, "2 upstream only, 5 ours only, 1 different, 30 same")]``; ("-", error)."""
    if tables is None:
        return []
    if tables.get("error"):
        return [("-", f"not read: {tables['error']}")]
    return [(arch, f"{len(s['upstream_only'])} upstream only, {len(s['ours_only'])} ours only, "
                   f"{len(s['different'])} different, {s['same']} same")
            for arch, s in tables["archs"].items()]


def ab_line(ab: dict) -> str:
    """One line: rows, geo-mean speedups over cuBLAS, who wins how often."""
    if ab.get("error"):
        return f"not run: {ab['error']}"
    s = ab["summary"]
    wins = s["wins"]
    return (f"{ab.get('arch', '?')} {s['measured']}/{s['rows']} rows measured; geo-mean x cuBLAS "
            f"ours {s['geomean_ours']} upstream {s['geomean_upstream']} (ours/upstream "
            f"{s['geomean_ours_over_upstream']}); wins ours {wins['ours']}, upstream "
            f"{wins['upstream']}, tie {wins['tie']}"
            + (f" (partial: {ab['partial']})" if ab.get("partial") else ""))


def junit_xml(reports: list[Report]) -> str:
    """JUnit XML text (junit-xml): one testsuite per ref; one testcase per patch, overlay
    file, verification, CPU test run, table-diff architecture, GPU test run and GPU A/B;
    a failure for each item that needs a human, an error for each that could not run."""
    suites = []
    for report in scrub(reports):
        ref = _xml_text(report.ref)
        classname = f"rebase.{ref.replace('.', '_')}"
        cases = []
        for name, status, failure, error in _junit_cases(report):
            failure, error = failure and _xml_text(failure), error and _xml_text(error)
            case = TestCase(_xml_text(name), classname=classname, stdout=_xml_text(status))
            if failure:
                case.add_failure_info(message=failure[:500], output=failure)
            if error:
                case.add_error_info(message=error[:500], output=error)
            cases.append(case)
        suites.append(TestSuite(f"rebase onto {ref}", cases))
    return to_xml_report_string(suites, encoding="utf-8")


# Characters XML 1.0 cannot hold at all, not even as a reference (junit-xml writes them as
# ``&#N;`` references, which its own XML parser then rejects): control characters, lone
# surrogates (a path that is not UTF-8, read with surrogateescape), U+FFFE/U+FFFF.
_NOT_XML = re.compile("[\x00-\x08\x0b\x0c\x0e-\x1f\ud800-\udfff\ufffe\uffff]")


def _xml_text(text: str) -> str:
    """``text`` with each character XML cannot hold replaced by U+FFFD."""
    return _NOT_XML.sub("\ufffd", text)


def _junit_cases(report: Report) -> list[tuple[str, str, str | None, str | None]]:
    """(name, status, failure or None, error or None) for each item of one report."""
    cases = []
    for p in report.patches:
        failure = "; ".join(p.hunks or p.files) or "conflict" if p.status == PATCH_CONFLICT else None
        cases.append((f"patch {p.name}", p.status, failure, None))
    for f in report.overlay:
        bad = f.status == FILE_CONFLICT or (f.status == DRIFT and not report.allow_drift)
        cases.append((f"overlay {f.path}", f.status, (f.detail or f.status) if bad else None, None))
    if report.verify is not None:
        cases.append(("verify", "ok" if report.verify.ok else "failed",
                      None if report.verify.ok else "; ".join(report.verify.errors), None))
    for name, run in (("cpu tests", report.tests), ("gpu tests", report.gpu)):
        if run is not None:
            cases.append(_run_case(name, run))
    for arch, line in table_lines(report.tables):
        cases.append((f"table diff {arch}", line, None, line if arch == "-" else None))
    if report.ab is not None:
        line = ab_line(report.ab)
        bad = report.ab.get("error") or report.ab.get("summary", {}).get("errors")
        cases.append(("gpu a/b ours vs upstream vs cuBLAS", line, None, line if bad else None))
    if report.wheel is not None:
        w = report.wheel
        cases.append(("wheel", w.get("error") or w.get("name", ""), w.get("error"), None))
    if report.error:
        cases.append(("job", "error", None, report.error))
    return cases


def _run_case(name: str, run: dict) -> tuple[str, str, str | None, str | None]:
    line = counts_line(run)
    failed = bool(run.get("failed") or run.get("errors"))
    env = bool(run.get("env_error") or run.get("env_errors"))
    return (name, line, line if failed else None, line if env and not failed else None)


def markdown(reports: list[Report]) -> str:
    """A short summary for a CI comment: one table row per ref, then per-ref details."""
    lines = ["## vllm-k3-overlay rebase report", "",
             "| ref | verdict | patches | overlay | verify | tests |",
             "|---|---|---|---|---|---|"]
    reports = scrub(reports)
    for r in reports:
        patches = ", ".join(f"{p.name.split('-')[0]} {p.status}" for p in r.patches) or "-"
        overlay = ", ".join(f"`{Path(f.path).name}` {f.status}" for f in r.overlay) or "-"
        verify = "-" if r.verify is None else ("ok" if r.verify.ok else "failed")
        tests = "-" if r.tests is None else counts_line(r.tests)
        verdict = "ok" if r.ok else f"**exit {r.exit_code}**"
        sha = f" `{r.ref_sha[:10]}`" if r.ref_sha else ""
        lines.append(f"| {r.ref}{sha} | {verdict} | {patches} | {overlay} "
                     f"| {verify} | {tests} |")
    for r in reports:
        lines += _markdown_tables(r) + _markdown_gpu(r)
        drifted = [f for f in r.overlay if f.upstream_diff]
        for f in drifted:
            lines += ["", f"<details><summary>{r.ref}: upstream's diff of <code>{f.path}</code> "
                      f"since {r.base_ref} ({f.status})</summary>", "", "```diff",
                      *_clip(f.upstream_diff), "```", "</details>"]
        if r.wheel is not None:
            w = r.wheel
            lines += ["", f"{r.ref}: wheel not built: {w['error']}" if "error" in w else
                      f"{r.ref}: wheel `{w['name']}`, {w['size']:,} bytes, sha256 `{w['sha256']}`"]
        if r.error:
            lines += ["", f"{r.ref}: {r.error}"]
    return "\n".join(lines) + "\n"


def _choice(choice: dict | None) -> str:
    if choice is None:
        return "cuBLAS"
    config = choice.get("config")
    if not config:
        return choice["backend"]
    cfg = ",".join("-" if config.get(k) is None else str(config[k])
                   for k in ("block_size", "outputs_per_block", "k_unroll", "vector_width",
                             "static_k"))
    return f"{choice['backend']} {cfg}"


def _markdown_tables(r: Report) -> list[str]:
    """Per-architecture counts of the table diff, and its rows (clipped) in a details block."""
    if r.tables is None:
        return []
    if r.tables.get("error"):
        return ["", f"**{r.ref}: table diff not read**: {r.tables['error']}"]
    lines = ["", f"### {r.ref}: low-latency GEMM tables, ours vs upstream",
             f"Upstream: `{r.tables['upstream']['module']}`; ours: `{r.tables['ours']['module']}`. "
             f"Rows are (N, K, M); config = block_size, outputs_per_block, k_unroll, "
             f"vector_width, static_k.", "",
             "| arch | upstream only | ours only | different | same |", "|---|--:|--:|--:|--:|"]
    rows = []
    for arch, s in r.tables["archs"].items():
        lines.append(f"| {arch} | {len(s['upstream_only'])} | {len(s['ours_only'])} "
                     f"| {len(s['different'])} | {s['same']} |")
        for kind in ("upstream_only", "ours_only", "different"):
            rows += [f"| {arch} | {kind.replace('_', ' ')} | {d['N']}x{d['K']} M{d['M']}"
                     f"{' +residual' if d['residual'] else ''} | {_choice(d['upstream'])} "
                     f"| {_choice(d['ours'])} |" for d in s[kind]]
    if rows:
        lines += ["", f"<details><summary>{r.ref}: the {len(rows)} rows that differ</summary>",
                  "", "| arch | kind | row | upstream | ours |", "|---|---|---|---|---|",
                  *_clip_rows(rows), "</details>"]
    return lines


def _markdown_gpu(r: Report) -> list[str]:
    """GPU test counts, A/B geo-means and the A/B rows (clipped)."""
    if r.gpu is None and r.ab is None:
        return []
    lines = ["", f"### {r.ref}: GPU stage"]
    if r.gpu is not None:
        env = r.gpu.get("env", {})
        where = ", ".join(f"{k} {v}" for k, v in env.items() if isinstance(v, str))
        lines.append(f"- tests: {counts_line(r.gpu)}" + (f" ({where})" if where else ""))
        for suite, counts in r.gpu.get("suites", {}).items():
            lines.append(f"  - {suite}: {counts_line(counts)}")
    if r.ab is not None:
        lines.append(f"- A/B: {ab_line(r.ab)}")
        if r.ab.get("provenance"):
            p = r.ab["provenance"]
            lines.append(f"  - measured on {p.get('gpu')} {p.get('date')}, torch {p.get('torch')}, "
                         f"nvidia-cutlass-dsl {p.get('cutlass_dsl')}; {r.ab.get('method', '')}")
        # A row the stage never timed (cut at its deadline) has no cuBLAS time: its status.
        rows = [f"| {x['N']}x{x['K']} | {x['M']} | {x.get('cublas_us', x.get('status'))} "
                f"| {_choice(x['upstream'])} "
                f"| {_us(x['upstream'])} | {_choice(x['ours'])} | {_us(x['ours'])} | {x['winner']} |"
                for x in r.ab.get("rows", [])]
        if rows:
            lines += ["", f"<details><summary>{r.ref}: A/B per row (µs per call)</summary>", "",
                      "| N x K | M | cuBLAS | upstream | µs | ours | µs | faster |",
                      "|---|--:|--:|---|--:|---|--:|---|", *_clip_rows(rows), "</details>"]
    return lines


def _us(choice: dict | None) -> str:
    if choice is None:
        return "="
    return str(choice.get("us", choice.get("status", "n/a")))


MARKDOWN_ROWS = 400  # rows of a details table in the CI comment; the JSON has them all


def _clip_rows(rows: list[str]) -> list[str]:
    if len(rows) <= MARKDOWN_ROWS:
        return rows
    return rows[:MARKDOWN_ROWS] + [f"| ... {len(rows) - MARKDOWN_ROWS} more rows in the JSON |"]


MARKDOWN_DIFF_LINES = 150  # a CI comment is capped (64 KiB on GitHub); the JSON has it all


def _clip(diff: str) -> list[str]:
    lines = diff.rstrip().splitlines()
    if len(lines) <= MARKDOWN_DIFF_LINES:
        return lines
    return lines[:MARKDOWN_DIFF_LINES] + [f"... {len(lines) - MARKDOWN_DIFF_LINES} more lines "
                                          f"(the whole diff is in --json's upstream_diff)"]
