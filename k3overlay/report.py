"""The result of one job on one ref, and its renderings.

``to_json`` is the schema CI parses (README documents it); ``write_human``
is for a person at a terminal; ``junit`` and ``markdown`` are for CI
systems and pull-request comments.
"""

from __future__ import annotations

import json
import xml.etree.ElementTree as ET
from dataclasses import dataclass, field
from pathlib import Path

from rich.console import Console
from rich.markup import escape
from rich.table import Table
from rich.text import Text

from . import errors
from .files import write_atomically
from .manifest import CONFLICT as FILE_CONFLICT
from .manifest import DRIFT, FileResult
from .series import CONFLICT as PATCH_CONFLICT
from .series import PatchResult
from .verify import VerifyResult


@dataclass
class Report:
    """Everything one job found for one ref.

    ``allow_drift``: drift was accepted by the user, so it does not fail the job.
    ``tests``: pass/fail/skip counts of a test run, when the job ran one.
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
        if self.tests is not None and (self.tests.get("failed") or self.tests.get("errors")):
            return errors.VERIFY
        if self.wheel is not None and "error" in self.wheel:
            return self.wheel["exit_code"]
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
        if self.tests is not None:
            data["tests"] = self.tests
        if self.wheel is not None:
            data["wheel"] = self.wheel
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
    write_text(path, json.dumps(data, indent=2) + "\n")


def check_writable(path: Path, option: str) -> None:
    """Make sure a report file can be written, before any work is done (UsageError if not).

    Does what ``write_text`` will do, with an empty text, beside the real file:
    rather than asking ``os.access``, which says yes to root even on a
    read-only mount or /proc. Leaves nothing behind.
    """
    if path.is_dir():
        raise errors.UsageError(f"{option} {path}: cannot write there (it is a folder)")
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
    leaves the previous report as it was. Raises UsageError (one line) on failure."""
    write_atomically(path, text.encode("utf-8", errors="replace"))


_STYLE = {"applied": "green", "applied-3way": "yellow", "landed-upstream": "cyan",
          "added": "green", "replaced": "green", "merged": "yellow",
          "drift": "red", "conflict": "red"}


def write_human(report: Report, console: Console) -> None:
    """A short summary: ref, each patch and overlay file with its status, verify, verdict.

    Every value is printed as text, never as rich markup: a path or a git
    message holding ``[/x]`` is shown as it is, not parsed (or raised on).
    """
    e = escape
    console.print(f"[bold]vllm-k3-overlay {e(report.overlay_version)}[/bold] on "
                  f"{e(report.ref)} ({e(report.ref_sha[:12]) or '?'}), base {e(report.base_ref)}")
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
        console.print("verify: " + ("ok" if report.verify.ok else "[red]failed[/red]"))
        for error in report.verify.errors:
            console.print(Text(f"  {error}"))
    if report.tests is not None:
        t = report.tests
        console.print(f"tests: {t.get('passed', 0)} passed, {t.get('failed', 0)} failed, "
                      f"{t.get('skipped', 0)} skipped, {t.get('errors', 0)} errors")
    if report.wheel is not None:
        w = report.wheel
        console.print(f"wheel: [red]not built[/red]: {w['error']}" if "error" in w else
                      f"wheel: {w['path']} ({w['size']:,} bytes, sha256 {w['sha256']})")
    for note in report.notes:
        console.print(Text(note))
    if report.ok:
        where = f" -> branch {e(report.branch)} in {e(report.workdir)}" if report.published else ""
        console.print(f"[green]ok[/green]{where}")
    else:
        console.print(f"[red]failed[/red] (exit {report.exit_code})"
                      + (f": {e(report.error)}" if report.error else ""))


def _styled(status: str) -> Text:
    return Text(status, style=_STYLE.get(status, "white"))


def junit_xml(reports: list[Report]) -> str:
    """JUnit XML text: one testsuite per ref; one testcase per patch, overlay file,
    verification and test run; a failure element for each item that needs a human."""
    suites = ET.Element("testsuites", name="vllm-k3-overlay")
    for report in reports:
        suite = ET.SubElement(suites, "testsuite", name=f"rebase onto {report.ref}")
        cases = _junit_cases(report)
        for name, status, failure in cases:
            case = ET.SubElement(suite, "testcase", name=name,
                                 classname=f"rebase.{report.ref.replace('.', '_')}")
            if failure:  # JUnit's schema wants failure before system-out
                ET.SubElement(case, "failure", message=failure[:500]).text = failure
            ET.SubElement(case, "system-out").text = status
        suite.set("tests", str(len(cases)))
        suite.set("failures", str(sum(1 for _, _, failure in cases if failure)))
    ET.indent(suites)
    return '<?xml version="1.0" encoding="UTF-8"?>\n' + ET.tostring(suites, encoding="unicode") + "\n"


def _junit_cases(report: Report) -> list[tuple[str, str, str | None]]:
    """(name, status, failure message or None) for each item of one report."""
    cases = []
    for p in report.patches:
        failure = "; ".join(p.hunks or p.files) or "conflict" if p.status == PATCH_CONFLICT else None
        cases.append((f"patch {p.name}", p.status, failure))
    for f in report.overlay:
        bad = f.status == FILE_CONFLICT or (f.status == DRIFT and not report.allow_drift)
        cases.append((f"overlay {f.path}", f.status, (f.detail or f.status) if bad else None))
    if report.verify is not None:
        cases.append(("verify", "ok" if report.verify.ok else "failed",
                      None if report.verify.ok else "; ".join(report.verify.errors)))
    if report.tests is not None:
        t = report.tests
        summary = ", ".join(f"{t.get(k, 0)} {k}" for k in ("passed", "failed", "skipped", "errors"))
        cases.append(("cpu tests", summary, summary if t.get("failed") or t.get("errors") else None))
    if report.error:
        cases.append(("job", "error", report.error))
    return cases


def markdown(reports: list[Report]) -> str:
    """A short summary for a CI comment: one table row per ref, then per-item details."""
    lines = ["## vllm-k3-overlay rebase report", "",
             "| ref | verdict | patches | overlay | verify | tests |",
             "|---|---|---|---|---|---|"]
    for r in reports:
        patches = ", ".join(f"{p.name.split('-')[0]} {p.status}" for p in r.patches) or "-"
        overlay = ", ".join(f"`{Path(f.path).name}` {f.status}" for f in r.overlay) or "-"
        verify = "-" if r.verify is None else ("ok" if r.verify.ok else "failed")
        tests = "-" if r.tests is None else (
            f"{r.tests.get('passed', 0)} passed, {r.tests.get('failed', 0)} failed, "
            f"{r.tests.get('skipped', 0)} skipped, {r.tests.get('errors', 0)} errors")
        verdict = "ok" if r.ok else f"**exit {r.exit_code}**"
        sha = f" `{r.ref_sha[:10]}`" if r.ref_sha else ""
        lines.append(f"| {r.ref}{sha} | {verdict} | {patches} | {overlay} "
                     f"| {verify} | {tests} |")
    for r in reports:
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


MARKDOWN_DIFF_LINES = 150  # a CI comment is capped (64 KiB on GitHub); the JSON has it all


def _clip(diff: str) -> list[str]:
    lines = diff.rstrip().splitlines()
    if len(lines) <= MARKDOWN_DIFF_LINES:
        return lines
    return lines[:MARKDOWN_DIFF_LINES] + [f"... {len(lines) - MARKDOWN_DIFF_LINES} more lines "
                                          f"(the whole diff is in --json's upstream_diff)"]
