"""The result of one job on one ref, and its renderings.

``to_json`` is the schema CI parses (README documents it); ``write_human``
is for a person at a terminal; ``junit_xml`` is for CI systems (the markdown
summary is module ``markdown``). What the rebase job's stages found comes in
typed (``stages``) and is rendered as given.
"""

from __future__ import annotations

import json
import re
import shlex
from dataclasses import dataclass, field
from pathlib import Path

from junit_xml import TestCase, TestSuite, to_xml_report_string
from rich.console import Console
from rich.table import Table
from rich.text import Text

from . import errors
from . import mdsafe as md
from .files import stream_target, write_atomically
from .gitproc import user_has_identity
from .manifest import CONFLICT as FILE_CONFLICT
from .manifest import DRIFT, FileResult
from .project import MAINTAINER
from .redact import for_terminal, scrub
from .series import CONFLICT as PATCH_CONFLICT
from .series import PatchResult, conflict_regions
from .stages import Section, TestRun
from .verify import VerifyResult


@dataclass
class Report:
    """Everything one job found for one ref.

    ``allow_drift``: drift was accepted by the user, so it does not fail the job.
    ``runs``/``sections``: what the rebase job's stages returned (``stages``), in order.
    ``wheel``: the wheel built from the result (``wheel.build_for``), or why none was.
    ``vllm_repo``: the source the job was given (the next commands name it again).
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
    runs: list[TestRun] = field(default_factory=list)
    sections: list[Section] = field(default_factory=list)
    wheel: dict | None = None
    vllm_repo: str = ""
    workdir_arg: str = ""  # --workdir as given, absolute (the next commands repeat it); "" for the default
    branch_arg: str = ""  # --branch as given; "" for the default
    error: str = ""
    error_code: int = errors.OK
    notes: list[str] = field(default_factory=list)
    wheel_hint: str = ""  # said right after the wheel line (how to read its record where installed)
    published: bool = False  # the work branch in ``workdir`` holds the result

    def run(self, key: str) -> TestRun | None:
        """The test run whose JSON key is ``key`` (``tests``: the CPU tier), if one ran."""
        return next((r for r in self.runs if r.key == key), None)

    @property
    def exit_code(self) -> int:
        """0 ok, 2 usage, 3 patch conflict, 4 overlay drift/conflict, 5 verify or tests,
        6 source, 7 environment (README's table)."""
        if self.error_code:
            return self.error_code
        if self.conflicting_patches:
            return errors.CONFLICT
        if any(f.status == FILE_CONFLICT for f in self.overlay):
            return errors.DRIFT
        if not self.allow_drift and any(f.status == DRIFT for f in self.overlay):
            return errors.DRIFT
        if self.verify is not None and not self.verify.ok:
            return errors.VERIFY
        codes = [r.exit_code for r in self.runs] + [s.exit_code for s in self.sections]
        if errors.VERIFY in codes:
            return errors.VERIFY
        if self.wheel is not None and "error" in self.wheel:
            return self.wheel["exit_code"]
        return max(codes, default=errors.OK)

    @property
    def ok(self) -> bool:
        return self.exit_code == errors.OK

    @property
    def conflicting_patches(self) -> list[PatchResult]:
        return [p for p in self.patches if p.status == PATCH_CONFLICT]

    @property
    def missing(self) -> list[str]:
        """What of ours the tree the job built lacks, by kind: ``patches 0002, 0003
        conflict``, ``overlay PATH conflicts`` (``drifts``, when drift was not accepted)."""
        out = []
        patches = [short_name(p.name) for p in self.conflicting_patches]
        if patches:
            out.append(f"patch {patches[0]} conflicts" if len(patches) == 1
                       else f"patches {', '.join(patches)} conflict")
        for status, verb in ((FILE_CONFLICT, "conflict"), (DRIFT, "drift")):
            files = [f.path for f in self.overlay if f.status == status
                     and (status == FILE_CONFLICT or not self.allow_drift)]
            if files:
                out.append(f"overlay {', '.join(files)} {verb}{'s' if len(files) == 1 else ''}")
        return out

    @property
    def verification(self) -> VerifyResult:
        """``verify`` as every rendering shows it: the result, or why it was not run."""
        return self.verify or VerifyResult.skipped(self._why_not_verified())

    def _why_not_verified(self) -> str:
        return self.error or "; ".join(self.missing) or "stopped before verification"

    def to_json(self) -> dict:
        """The report as the JSON object documented in README.md."""
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
            "verify": self.verification.to_json(),
        }
        for run in self.runs:
            data[run.key] = run.to_json()
        for section in self.sections:
            data[section.key] = section.data
        if self.wheel is not None:
            data["wheel"] = self.wheel
        if self.error:
            data["error"] = self.error
        return data


def short_name(patch: str) -> str:
    """``0002`` for ``0002-some-subject.patch`` (the series' numbers are unique), else the name."""
    return patch[:4] if re.match(r"\d{4}-", patch) else patch


def _patch_json(p: PatchResult) -> dict:
    data = {"name": p.name, "status": p.status}
    if p.upstream_commit:
        data["upstream_commit"] = p.upstream_commit
    if p.status == PATCH_CONFLICT:
        data.update(files=p.files, hunks=p.hunks)
    return data


def _file_json(f: FileResult) -> dict:
    data = {"path": f.path, "status": f.status}
    if f.detail:
        data["detail"] = f.detail
    if f.status == FILE_CONFLICT and f.merged:
        data["regions"] = conflict_regions(f.path, f.merged)
    if f.upstream_diff:
        data["upstream_diff"] = f.upstream_diff
    return data


def write_json(reports: list[Report] | Report, path: Path) -> None:
    """Write one report (an object) or several (a list of objects) as JSON.

    Raises UsageError (one line) if the file cannot be written.
    """
    data = reports.to_json() if isinstance(reports, Report) else [r.to_json() for r in reports]
    write_text(path, json.dumps(scrub(data), indent=2) + "\n")  # values redacted, not the text


def refused(project, ref: str | None, error: str, code: int) -> Report:
    """The report of a run refused or stopped before it applied anything: the pinned base
    (``project``'s overlay.json) and the ref the run was for (the base itself when none was
    given), so no field that can be known is left empty. ``project``: a
    :class:`~k3overlay.project.Project`, or None when the project itself failed to load."""
    from . import manifest

    version = base = ""
    if project is not None:
        version = project.version
        try:
            base = manifest.load(project.manifest_path, project.overlay_dir).base
        except Exception:  # the refusal may be about overlay.json itself; the report still goes out
            pass
    return Report(version, base, ref or base, error=error, error_code=code)


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
    ``text`` is rendered from values that went through ``scrub`` (every renderer here does
    that): redacting the rendered text again would mask across JSON's or XML's escapes
    (``Bearer \\"x\\"`` lost its backslash, and the JSON its validity)."""
    write_atomically(path, text.encode("utf-8", errors="replace"))


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
    # before rich wraps a long line, which would cut a URL in two; upstream's paths and
    # messages may hold ESC sequences, which a terminal would act on
    report = for_terminal(report)
    console.print(Text.assemble((f"vllm-k3-overlay {report.overlay_version}", "bold"),
                                f" on {report.ref} ({report.ref_sha[:12] or '?'}), "
                                f"base {report.base_ref}"))
    table = Table(show_header=True, header_style="bold", box=None, pad_edge=False)
    table.add_column("kind")
    table.add_column("item")
    table.add_column("status")
    for p in report.patches:
        table.add_row("patch", Text(p.name), _styled(p.status))
        if p.upstream_commit:
            table.add_row("", Text(f"  as upstream's {p.upstream_commit[:12]}"), "")
        for line in p.hunks or p.files:
            table.add_row("", Text(f"  {line}"), "")
    for f in report.overlay:
        table.add_row("overlay", Text(f.path), _styled(f.status))
        if f.detail and f.status not in ("added", "replaced"):
            table.add_row("", Text(f"  {f.detail}"), "")
    if report.patches or report.overlay:
        console.print(table)
    if report.verify is not None or not report.error:
        verify = report.verification
        console.print(Text.assemble("verify: ", (verify.line(), "" if verify.ok else "red")))
        for error in verify.errors:
            console.print(Text(f"  {error}"))
    for run in report.runs:
        console.print(Text(f"{run.name}: {run.line()}"))
        for problem in run.problems:
            console.print(Text(f"  {problem.test}: {problem.first_line}"))
        for left_out in run.not_run:
            console.print(Text(f"  not run: {left_out}"))
    for section in report.sections:
        for line in section.lines:
            console.print(Text(f"{section.title}: {line}"))
    for note in report.notes:  # (before the wheel: each says what happened before it was built)
        console.print(Text(note))
    if report.wheel is not None:
        w = report.wheel
        console.print(Text.assemble("wheel: ", ("not built", "red"), f": {w['error']}") if "error" in w
                      else Text(f"wheel: {w['path']} ({w['size']:,} bytes, sha256 {w['sha256']})"))
        if "error" not in w and report.wheel_hint:
            console.print(Text(report.wheel_hint))
    if report.ok:
        where = f" -> branch {report.branch} in {report.workdir}" if report.published else ""
        console.print(Text.assemble(("ok", "green"), where))
    else:
        console.print(Text.assemble(("failed", "red"), f" (exit {report.exit_code})"
                                    + (f": {report.error}" if report.error else "")))
        if not report.published:  # --check, or a run that wrote nothing: say what to run next
            for command in next_commands(report):
                console.print(Text(f"  next: {command}"))


def _styled(status: str) -> Text:
    return Text(status, style=_STYLE.get(status, "white"))


def junit_xml(reports: list[Report]) -> str:
    """JUnit XML text (junit-xml): one testsuite per ref; one testcase per patch, overlay
    file, verification, test run and section; a failure for each item that needs a human,
    an error for each that could not run for reasons outside the tree, a skip for each
    that did not run because of another (verify on a tree that lacks a patch)."""
    suites = []
    for report in scrub(reports):
        ref = _xml_text(report.ref)
        classname = f"rebase.{ref.replace('.', '_')}"
        cases = []
        for item in _junit_cases(report):
            case = TestCase(_xml_text(item.name), classname=classname, stdout=_xml_text(item.status))
            if item.failure:
                failure = _xml_text(item.failure)
                case.add_failure_info(message=failure[:500], output=failure)
            if item.error:
                error = _xml_text(item.error)
                case.add_error_info(message=error[:500], output=error)
            if item.skipped:
                case.add_skipped_info(message=_xml_text(item.skipped))
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


@dataclass(frozen=True)
class _Case:
    name: str
    status: str
    failure: str | None = None
    error: str | None = None
    skipped: str | None = None


def _junit_cases(report: Report) -> list[_Case]:
    """One case for each item of one report."""
    cases = []
    for p in report.patches:
        failure = "; ".join(p.hunks or p.files) or "conflict" if p.status == PATCH_CONFLICT else None
        cases.append(_Case(f"patch {p.name}", p.status, failure))
    for f in report.overlay:
        bad = f.status == FILE_CONFLICT or (f.status == DRIFT and not report.allow_drift)
        cases.append(_Case(f"overlay {f.path}", f.status, (f.detail or f.status) if bad else None))
    if report.verify is not None or not report.error:
        verify = report.verification
        cases.append(_Case("verify", verify.line(), "; ".join(verify.errors) or None,
                           skipped=verify.not_run or None))
    for run in report.runs:
        cases.append(_run_case(run))
    for section in report.sections:
        cases.append(_Case(section.title, "; ".join(section.lines), error=section.error or None))
    if report.wheel is not None:
        w = report.wheel
        cases.append(_Case("wheel", w.get("error") or w.get("name", ""), w.get("error")))
    if report.error:
        cases.append(_Case("job", "error", error=report.error))
    return cases


def _run_case(run: TestRun) -> _Case:
    """A failure for tests that failed (each explained), an error when only the environment did."""
    why = "\n".join([run.line()] + [f"{p.test}: {p.first_line}" for p in run.problems])
    code = run.exit_code
    return _Case(run.name, run.line(), why if code == errors.VERIFY else None,
                 why if code == errors.ENVIRONMENT else None)


# The markdown summary: GitHub shows it as the job summary (1 MiB at most) and in comments
# (64 KiB); the first screen must answer the maintainer, the rest is collapsed and clipped.
MARKDOWN_DIFF_LINES = 60  # of upstream's diff of a drifted file; the JSON has it whole
_REGION = re.compile(r"^\S.*:\d+-\d+$")


def markdown(reports: list[Report]) -> str:
    """The rebase job's summary for a person, in GitHub markdown.

    First, per ref: the verdict in words; each conflict with its regions
    (``path:first-last``); verify and each test run, every problem with its first
    line; each section's summary lines; the exact commands to run next. Then,
    collapsed: each section's details and upstream's diff of each drifted file
    (clipped to ``MARKDOWN_DIFF_LINES``; the JSON report has everything).
    """
    reports = scrub(reports)
    lines = ["## vllm-k3-overlay rebase report", ""]
    if reports:
        r0 = reports[0]
        lines.append(f"Overlay {md.text(r0.overlay_version)} (base {md.text(r0.base_ref)}) onto "
                     + ", ".join(f"{md.text(r.ref)}: **{md.text(verdict(r).split(':')[0])}**"
                                 + ("" if r.ok else f" (exit {r.exit_code})") for r in reports)
                     + ".")
    for r in reports:
        lines += ["", *_first_screen(r)]
    details = [line for r in reports for line in _details(r)]
    if details:
        lines += ["", "---", "", *details]
    return "\n".join(lines) + "\n"


def verdict(r: Report) -> str:
    """What a ref's outcome means, in words (``clean``, ``needs a maintainer: …``)."""
    if r.error:
        return f"not run: {r.error}"
    blocked = [b for b in (_count(r.conflicting_patches, "patch", "patches"),
                           _count([f for f in r.overlay if f.status == FILE_CONFLICT],
                                  "overlay file", "overlay files")) if b]
    if blocked:
        many = len(blocked) > 1 or not blocked[0].startswith("1 ")
        return f"needs a maintainer: {' and '.join(blocked)} conflict{'' if many else 's'}"
    drift = [f.path for f in r.overlay if f.status == DRIFT and not r.allow_drift]
    if drift:
        return f"needs a maintainer: upstream changed {', '.join(drift)} (drift)"
    if r.verify is not None and not r.verify.ok:
        return "needs a maintainer: the patched tree fails verification"
    code = r.exit_code
    failed = [run.name for run in r.runs if run.exit_code == errors.VERIFY]
    if failed:
        return f"needs a maintainer: {' and '.join(failed)} failed"
    if r.wheel is not None and "error" in r.wheel:
        return "the wheel could not be built"
    if code == errors.ENVIRONMENT:
        return "applies and verifies; the tests could not run here (the environment, not the tree)"
    if code:
        return f"failed ({', '.join(s.title for s in r.sections if s.exit_code) or 'see below'})"
    moved = [p for p in r.patches if p.status != "applied"] or [
        f for f in r.overlay if f.status == "merged"]
    return "clean: applies, verifies and passes" + (
        "; rebase and export to record what moved" if moved else "")


def _count(items: list, one: str, many: str) -> str:
    return f"{len(items)} {one if len(items) == 1 else many}" if items else ""


def _first_screen(r: Report) -> list[str]:
    sha = f" `{r.ref_sha[:10]}`" if r.ref_sha else ""
    code = "" if r.ok else f" (exit {r.exit_code})"
    lines = [f"### {md.text(r.ref)}{sha}: {md.text(verdict(r))}{code}", ""]
    if r.error:
        return lines[:-1]
    for p in r.conflicting_patches:
        regions = [h for h in p.hunks if _REGION.match(h)]
        where = regions or p.hunks[:3] or p.files
        lines.append(f"- patch {md.code(p.name)} **conflicts**: " + ", ".join(md.code(w) for w in where))
    for f in r.overlay:
        if f.status == FILE_CONFLICT:
            regions = conflict_regions(f.path, f.merged or b"")
            where = (f" in {_count(regions, 'region', 'regions')}: "
                     + ", ".join(md.code(x) for x in regions)) if regions else f": {md.text(f.detail)}"
            lines.append(f"- overlay {md.code(f.path)} **conflicts**{where}")
        elif f.status == DRIFT:
            lines.append(f"- overlay {md.code(f.path)} drifted: {md.text(f.detail)}")
    lines += _went_in(r)
    lines.append(f"- verify: {md.text(r.verification.line())}")
    lines += [f"  - {md.text(error)}" for error in r.verification.errors]
    for run in r.runs:
        lines.append(f"- {md.text(run.name)}: {md.text(run.line())}")
        lines += [f"  - {md.code(p.test)}: {md.text(p.first_line)}" for p in run.problems]
        lines += _not_run(run.not_run)
    for section in r.sections:
        lines += [f"- {md.text(section.title)}: {md.text(line)}" for line in section.lines]
    if r.wheel is not None:
        w = r.wheel
        lines.append(f"- wheel not built: {md.text(w['error'])}" if "error" in w else
                     f"- wheel {md.code(w['name'])}, {w['size']:,} bytes, sha256 `{w['sha256']}`")
    commands = next_commands(r)
    if commands:
        lines += ["", *md.fenced([md.one_line(c) for c in commands], "bash")]
    return lines


def _went_in(r: Report) -> list[str]:
    """One line for what went in: patches by status, overlay files by status."""
    parts: dict[str, list[str]] = {}
    for p in r.patches:
        if p.status != PATCH_CONFLICT:
            label = md.text(short_name(p.name)) + (f" (as {p.upstream_commit[:12]})"
                                                   if p.upstream_commit else "")
            parts.setdefault(f"patches {p.status}", []).append(label)
    files: dict[str, list[str]] = {}
    for f in r.overlay:
        if f.status not in (FILE_CONFLICT, DRIFT):
            files.setdefault(f.status, []).append(md.code(Path(f.path).name))
    items = [f"{k}: {', '.join(v)}" for k, v in parts.items()]
    items += [f"overlay {k}: {', '.join(v) if k == 'merged' else len(v)}" for k, v in files.items()]
    return [f"- went in: {'; '.join(items)}"] if items else []


def _not_run(not_run: list[str]) -> list[str]:
    """Files left out, grouped by why (one reason usually covers all of ours)."""
    why: dict[str, list[str]] = {}
    for item in not_run:
        name, _, reason = item.partition(": ")
        why.setdefault(reason, []).append(md.code(Path(name).name))
    return [f"  - not run: {', '.join(names)}: {md.text(reason)}" for reason, names in why.items()]


def next_commands(r: Report, has_identity: bool | None = None) -> list[str]:
    """The commands a maintainer runs next for this ref, exact (comments say the manual steps).
    ``has_identity``: whether git knows who commits (None: ask git, ``user_has_identity``)."""
    if r.error or r.exit_code == errors.ENVIRONMENT:
        return []
    source = f" --vllm-repo {shlex.quote(r.vllm_repo)}" if r.vllm_repo else ""
    # the checkout and branch the run was given, so that each line acts on that one
    # (NAME=VALUE: a value that starts with "-" is never read as an option)
    where = (f" --workdir={shlex.quote(r.workdir_arg)}" if r.workdir_arg else "") + (
        f" --branch={shlex.quote(r.branch_arg)}" if r.branch_arg else "")
    rebase = f"python apply.py --rebase-to {shlex.quote(r.ref)}{source}{where}"
    where_export = f" --workdir={shlex.quote(r.workdir_arg)}" if r.workdir_arg else ""
    git = f"git -C {shlex.quote(r.workdir_arg) if r.workdir_arg else 'work/vllm'}"
    # git commits only with an identity: where it knows none (CI, a fresh machine) name one,
    # the maintainer's and never the tool's: a commit with the tool's identity would pass for
    # the tool's own, and a plain run would take the branch back (safety.foreign_commits)
    committing = git if (has_identity if has_identity is not None else user_has_identity()) else (
        f"{git} -c user.name={shlex.quote(MAINTAINER['name'])} -c user.email={MAINTAINER['email']}")
    lines = [rebase]
    for p in r.conflicting_patches:
        add = f"{git} add -- {' '.join(map(shlex.quote, p.files))} && " if p.files else ""
        lines += [f"# stops at {p.name}: resolve {', '.join(p.files) or 'it'}, then",
                  f"{add}{committing} am --continue && {rebase}"]
    conflicted = [f for f in r.overlay if f.status == FILE_CONFLICT]
    for f in conflicted:
        regions = conflict_regions(f.path, f.merged or b"")
        lines.append(f"# resolve the conflict markers in {f.path}"
                     + (f" ({_count(regions, 'region', 'regions')})" if regions else ""))
    # Tests of a tree that lacks part of the series say little: resolve first, then see.
    problems = [run.name for run in r.runs if run.exit_code == errors.VERIFY and not r.missing]
    if (r.verify is not None and not r.verify.ok) or problems:
        found = ["verify"] * bool(r.verify and not r.verify.ok) + problems
        lines.append(f"# fix what {' and '.join(found)} found (above) on the work branch")
    if len(lines) > 1 and not lines[-1].startswith(git):
        add = f"{git} add -- {' '.join(shlex.quote(f.path) for f in conflicted)} && " if conflicted else ""
        return lines + [f"{add}{committing} commit -a && python apply.py --export{where_export}"]
    return lines + [f"python apply.py --export{where_export}"]


def _details(r: Report) -> list[str]:
    """The collapsed part of one ref: sections' details, then upstream's diffs."""
    lines = []
    for section in r.sections:
        if section.details:
            lines += [f"<details><summary>{md.text(r.ref)}: {md.text(section.title)}</summary>", "",
                      md.block(section.details.rstrip()), "", "</details>", ""]
    for f in r.overlay:
        if f.upstream_diff:
            lines += [f"<details><summary>{md.text(r.ref)}: upstream's diff of <code>"
                      f"{md.text(f.path)}</code> since {md.text(r.base_ref)} ({f.status})</summary>",
                      "", *md.fenced(_clip(f.upstream_diff), "diff"), "</details>", ""]
    return lines


def _clip(diff: str) -> list[str]:
    lines = diff.rstrip().splitlines()
    if len(lines) <= MARKDOWN_DIFF_LINES:
        return lines
    return lines[:MARKDOWN_DIFF_LINES] + [f"... {len(lines) - MARKDOWN_DIFF_LINES} more lines "
                                          f"(the whole diff is in --json's upstream_diff)"]
