"""Command line of ``apply.py``: parse, run the job, print the report, exit with its code."""

from __future__ import annotations

import argparse
import contextlib
import os
import signal
import sys
from dataclasses import replace
from pathlib import Path

from rich.console import Console

from . import errors, git, progress, releases, scratch, source, streams
from .export import export
from .files import refuse_one_file_twice, stream_target
from .interrupts import deferred
from .job import Options, run_apply
from .outputs import inside, refuse_aliases, refuse_unresolvable, same
from .printable import printable
from .project import Project
from .rebase import rebase_to
from .redact import Stream, excepthook, redact
from .report import Report, check_writable, refused, write_human, write_json
from .source import check_ref
from .source import local_path as source_local_path
from .wheel import METHODS, PRINT_RECORD, REPACK, WheelOptions, build_for, source_date_epoch

INTERNAL = 1  # what Python exits with on a traceback; the JSON report of one says so too
EPILOG = """exit codes: 0 ok, 2 bad input or unsafe checkout (or a wheel that cannot be built
soundly), 3 patch conflict, 4 overlay drift, 5 verification failed (or the wheel's checks),
6 vLLM source unreachable or not matching the index's sha256"""


class OneLineParser(argparse.ArgumentParser):
    """argparse, but a usage error is the one line every other bad input gets (no usage
    block above it): ``PROG: error: MESSAGE``, exit 2 (``errors.USAGE``)."""

    def error(self, message: str):
        self.exit(errors.USAGE, redact(f"{self.prog}: error: {message} (see --help)\n"))


def parser(project: Project) -> argparse.ArgumentParser:
    p = OneLineParser(
        prog="apply.py", epilog=EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter,
        description="Apply the Kimi-K3 patch series and overlay onto a vLLM checkout.")
    p.add_argument("--vllm-ref", metavar="REF",
                   help="vLLM ref to patch: a release tag, upstream's commit id of a release (full or "
                        "abbreviated; see --list-releases), or a tag, branch or sha of --vllm-repo "
                        "(default: the pinned base in overlay.json)")
    p.add_argument("--vllm-repo", metavar="PATH_OR_URL",
                   help="vLLM git repository (default: $VLLM_REPO, else a local mirror of "
                        "release sdists under ~/.cache/vllm-k3-overlay)")
    p.add_argument("--workdir", type=Path, metavar="DIR",
                   help=f"patched checkout (default: {project.default_workdir.relative_to(project.root)})")
    p.add_argument("--branch", metavar="NAME",
                   help=f"work branch (default: {project.default_branch})")
    p.add_argument("--json", type=Path, metavar="FILE", help="also write the report as JSON")
    p.add_argument("--allow-drift", action="store_true",
                   help="lay overlay files even where upstream changed the file since the base")
    mode = p.add_mutually_exclusive_group()
    mode.add_argument("--check", action="store_true",
                      help="do everything in a temporary worktree; leave the checkout as it was")
    mode.add_argument("--rebase-to", metavar="REF",
                      help="maintainers: rebuild the work branch on REF in the checkout, dropping "
                           "landed patches, 3-way merging drifted overlay files, stopping at conflicts")
    mode.add_argument("--export", action="store_true",
                      help="maintainers: regenerate patches/ and overlay.json from the work branch")
    mode.add_argument("--list-releases", action="store_true",
                      help="list the vLLM releases whose upstream commit id this tool records "
                           "(releases.json) and those already in the release mirror, with the mirror's "
                           "sha (offline); any other vX.Y.Z with an sdist on the package index works "
                           "as --vllm-ref too")
    p.add_argument("-q", "--quiet", action="store_true", help="no progress messages")
    wheel = p.add_argument_group("internal wheels (docs/apply.md: Internal vLLM wheels)")
    wheel.add_argument("--build-wheel", action="store_true",
                       help="after applying, build vllm-X.Y.Z+k3ov.<VERSION> from the work branch, "
                            "reusing the release's compiled code; it is checked before it is kept")
    default_dir = project.default_wheel_dir.relative_to(project.root)
    wheel.add_argument("--wheel-dir", type=Path, metavar="DIR",
                       help=f"where wheels go (default: {default_dir})")
    wheel.add_argument("--release-wheel", type=Path, metavar="PATH",
                       help="the vLLM release wheel to reuse, for air-gapped use (default: the "
                            "package index's, cached and checked against its sha256)")
    wheel.add_argument("--wheel-build", choices=METHODS,
                       help="repack (default): the release wheel with our Python files put in; "
                            "vllm: vLLM's own precompiled build (needs the CUDA torch the tree pins)")
    return p


def main(argv: list[str] | None = None) -> int:
    """Run ``apply.py``; return its exit code. Ctrl-C anywhere ends in one line, exit 130; a
    reader gone (``--help | true``, ``| head -1``) ends it quietly, killed by SIGPIPE."""
    sys.excepthook = excepthook  # a bug's traceback is redacted too
    try:
        with streams.quiet_when_reader_gone():
            return _main(argv)
    finally:
        job_done()  # no handler of ours left behind for a caller that goes on (tests call main)


def _main(argv: list[str] | None) -> int:
    args = None
    try:
        streams.reopen_closed()  # `apply.py >&-`: the work and its report files still get done
        line_by_line()
        stop_like_ctrl_c()
        project = Project()
        args = parser(project).parse_args(argv)
        progress.quiet = args.quiet
        return _run(project, args)
    except errors.OverlayError as err:  # this repository's own data unreadable (VERSION)
        tell(f"apply.py: error: {err}")
        return err.exit_code
    except (KeyboardInterrupt, BrokenPipeError):
        job_done()  # cleaned up: a reader gone (`--help | true`, `| head -1`) ends it quietly
        streams.end_if_reader_gone()
        tell(f"apply.py: interrupted; {_left_as_it_was(args)}")
        return errors.INTERRUPTED


def _left_as_it_was(args: argparse.Namespace | None) -> str:
    """What an interrupt left unchanged, for the mode that was running (all true statements:
    each mode's last writing step is finished before an interrupt is acted on)."""
    if args is not None and args.rebase_to:
        return ("--rebase-to may have stopped part-way in the checkout: see `git status` there, "
                "then run it again")
    if args is not None and args.export:
        return "patches/, overlay/ and overlay.json were left as they were"
    if args is None or args.check:
        return "the checkout was left as it was"
    return "the checkout's branches, HEAD and files were left as they were"


def _run(project: Project, args: argparse.Namespace) -> int:
    json_to = None  # where an error report may go: not before --json is known not to be our data
    report = None  # the job's report, once it has one: a bug after publishing still reports it
    temporary = contextlib.ExitStack()  # the run's folder for temporary files, however it ends
    try:
        refuse_unresolvable(_paths_given(project, args))  # first: every check below resolves them
        if args.json:
            project.refuse_as_output(args.json, "--json")
            refuse_one_file_twice([(args.release_wheel, "--release-wheel"), (args.json, "--json")])
        _refuse_outputs_over_inputs(project, args)
        json_to = args.json
        # every temporary file of the run and of its children (git, pip) in one folder of its
        # own, removed at the end; a killed run's, by the next run (``scratch``)
        temporary.enter_context(scratch.per_run())
        if args.export and (args.json or args.branch or args.vllm_ref or args.vllm_repo
                            or args.allow_drift):
            raise errors.UsageError("--export takes only --workdir (it reads the checked-out "
                                    "work branch)")
        if args.rebase_to and (args.vllm_ref or args.allow_drift):
            # Both name the ref to build on (and --rebase-to 3-way merges drift): one of the
            # two would be dropped without a word.
            given = "--vllm-ref" if args.vllm_ref else "--allow-drift"
            raise errors.UsageError(f"--rebase-to REF takes no {given}: REF is the ref the work "
                                    f"branch is rebuilt on, and drifted files are 3-way merged")
        if args.list_releases:
            return _list_releases(args)
        git.refuse_unreadable_config()  # a FIFO there: each git of the run waited on it, 30 s a folder
        _refuse_workdir_holding_project(project, args.workdir)
        for ref in (args.vllm_ref, args.rebase_to):
            if ref is not None:  # before any work; an empty one is refused, never read as "no ref"
                check_ref(ref)
        wheel_opts = _wheel_options(args, project)
        if args.json:
            check_writable(args.json, "--json")
        if args.export:
            return _export(project, args.workdir or project.default_workdir)
        upstream = source.release_for_ref(args.rebase_to or args.vllm_ref, args.vllm_repo,
                                           "--rebase-to" if args.rebase_to else "--vllm-ref")
        ref = upstream.release.tag if upstream else args.vllm_ref
        opts = Options(ref=ref, vllm_repo=args.vllm_repo, workdir=args.workdir,
                       branch=args.branch, check=args.check, allow_drift=args.allow_drift)
        if args.rebase_to is not None:
            report = rebase_to(project, replace(opts, ref=ref if upstream else args.rebase_to))
        else:
            report = run_apply(project, opts)
        if upstream:
            report.notes.insert(0, upstream.note())
        if report.error_code == errors.INTERRUPTED:  # while switching: finished, then stopped
            return _interrupted(report, report.error + (", no wheel was written" if wheel_opts else ""),
                                json_to)
        if wheel_opts and report.ok:
            try:
                report.wheel = _build_wheel(project, report, wheel_opts)
            except KeyboardInterrupt:  # after publishing: say so (the wheel lands only when whole)
                return _interrupted(report, f"interrupted; branch {report.branch} was published, no "
                                            f"wheel was written", json_to)
        job_done()
        return _finish(report, args)
    except errors.OverlayError as err:
        tell(f"apply.py: error: {err}")
        if json_to:  # (after publishing, the report of what was done, saying what stopped it)
            report = report or refused(project, args.rebase_to or args.vllm_ref, "", err.exit_code)
            report.error, report.error_code = str(err), err.exit_code
            with contextlib.suppress(errors.OverlayError):  # the error above is the one to see
                write_json(report, json_to)
        return err.exit_code
    except Exception as err:  # a bug of ours: the report asked for still says so, then the traceback
        # (after publishing, with what the job did: the wheel build, the reports)
        _stopped_report(report, project, args, json_to,
                        f"internal error (a bug of apply.py): {type(err).__name__}: {err}", INTERNAL)
        raise
    except KeyboardInterrupt:  # (one line by _main) a report file asked for is this run's, not the last's
        _stopped_report(report, project, args, json_to, f"interrupted; {_left_as_it_was(args)}",
                        errors.INTERRUPTED)
        raise
    finally:
        # The run is over (its report said): a signal now waits for the temporary folders to go,
        # and is said as what it is, never as "interrupted; … left as it was".
        try:
            with deferred(then_raise=False) as late:
                temporary.close()
        except KeyboardInterrupt:  # (held by a removal's own ``deferred``, raised once it was done)
            late = [True]
        if late:
            streams.end_if_reader_gone()  # (SIGPIPE: the reader gone ends it quietly, as anywhere)
            tell("apply.py: interrupted as the run ended: its temporary files were removed first")


def _stopped_report(report: Report | None, project: Project, args: argparse.Namespace,
                    json_to: Path | None, error: str, code: int) -> None:
    """Write ``--json`` (where asked) for a run something stopped before its end: what it did
    (``report``, or a refusal's), ``error`` and ``code``; a write error is not raised over
    what stopped it."""
    if not json_to:
        return
    report = report or refused(project, args.rebase_to or args.vllm_ref, "", code)
    report.error, report.error_code = error, code
    with contextlib.suppress(Exception):
        write_json(report, json_to)


def _interrupted(report: Report, said: str, json_to: Path | None) -> int:
    """End a run stopped by a signal after it published: one line, the JSON report of what was
    done all the same, exit 130."""
    job_done()
    report.error, report.error_code = said, errors.INTERRUPTED
    if json_to:
        _json_report(report, json_to)
    tell(f"apply.py: {said}")
    return errors.INTERRUPTED


def _finish(report: Report, args: argparse.Namespace) -> int:
    """Print the report and write ``--json``; the exit code to end with."""
    # A report file is written before the text: a reader of stdout gone early (`| head -1`,
    # which now ends the tool) then costs only the text. A stream gets it after the text.
    to_stream = args.json is not None and stream_target(args.json) is not None
    code = _json_report(report, args.json) if args.json and not to_stream else report.exit_code
    write_human(report, report_console())
    return _json_report(report, args.json) if to_stream else code


def _json_report(report: Report, path: Path) -> int:
    """Write the JSON report; the exit code to end with (a write error is said on stderr)."""
    try:
        write_json(report, path)
    except errors.OverlayError as err:  # the disk filled up since the check, say
        tell(f"apply.py: error: {err}")
        return report.exit_code or err.exit_code
    return report.exit_code


def _list_releases(args: argparse.Namespace) -> int:
    given = [name for name in ("vllm_ref", "vllm_repo", "workdir", "branch", "json", "build_wheel",
                               "wheel_dir", "release_wheel", "wheel_build", "allow_drift")
             if getattr(args, name)]
    if given:
        raise errors.UsageError(f"--list-releases takes no other option (got --"
                                f"{given[0].replace('_', '-')})")
    for line in releases.listing(source.default_mirror()):
        print(line)
    return errors.OK


def _paths_given(project: Project, args: argparse.Namespace) -> list[tuple[Path | None, str]]:
    """Every path the run was given (and the checkout and wheel folder it uses when none is),
    with the option naming it: what ``refuse_unresolvable`` checks before any other check."""
    named = [(args.workdir, "--workdir"), (args.json, "--json"), (args.wheel_dir, "--wheel-dir"),
             (args.release_wheel, "--release-wheel"),
             (args.vllm_repo and source_local_path(args.vllm_repo), "--vllm-repo")]
    if args.list_releases:  # which takes no path (it says so itself) and reads none of these
        return named
    source = None if args.vllm_repo else os.environ.get("VLLM_REPO")
    named += [(source and source_local_path(source), "$VLLM_REPO"),
              (None if args.workdir else project.default_workdir, "the checkout")]
    if args.build_wheel and not args.wheel_dir:
        named.append((project.default_wheel_dir, "the wheel folder"))
    return named


def _refuse_outputs_over_inputs(project: Project, args: argparse.Namespace) -> None:
    """UsageError (``outputs.refuse_aliases``) if a path this run writes (``--json``, the
    wheel folder) is, or is inside, one it reads (the source folder or bundle,
    ``--release-wheel``, the checkout), or two of them are one path. (What ``--export``
    writes is this repository's data: ``_refuse_workdir_holding_project``. The checkout
    may be its own source: a rerun on it fetches nothing.)"""
    source = args.vllm_repo or os.environ.get("VLLM_REPO")
    outputs = [(args.json, "--json")]
    if args.build_wheel:
        outputs.append((args.wheel_dir or project.default_wheel_dir, "--wheel-dir"))
    checkout = (args.workdir, "--workdir") if args.workdir else (project.default_workdir, "the checkout")
    refuse_aliases(outputs, [(source and source_local_path(source), "--vllm-repo"),
                             (args.release_wheel, "--release-wheel"), checkout])


def _refuse_workdir_holding_project(project: Project, workdir: Path | None) -> None:
    """UsageError if ``--workdir`` is this repository's own checkout or a folder holding it, by
    any name (a bind mount of it: the run also waited on its own lock, for ever)
    (publishing there would switch the tool's own files out for vLLM's), or lies inside
    its data or a ``.git`` folder (``Project.refuse_as_output``)."""
    if workdir is None:
        return
    project.refuse_as_output(workdir, "--workdir")
    root = project.root.resolve()
    if same(workdir, root) or inside(root, workdir):
        raise errors.UsageError(f"--workdir {workdir} holds this repository ({root}); give a "
                                f"folder of its own (default: work/vllm)")


def _wheel_options(args: argparse.Namespace, project: Project) -> WheelOptions | None:
    """The wheel build asked for, checked before any work is done (UsageError if unusable)."""
    if not args.build_wheel:
        if args.wheel_dir or args.release_wheel or args.wheel_build:
            raise errors.UsageError("--wheel-dir, --release-wheel and --wheel-build go with --build-wheel")
        return None
    if args.check or args.rebase_to or args.export:
        raise errors.UsageError("--build-wheel builds from the work branch apply.py publishes; "
                                "it does not go with --check, --rebase-to or --export")
    source_date_epoch()  # the date of its entries, read now: not a traceback after publishing
    if args.release_wheel and not args.release_wheel.is_file():
        raise errors.UsageError(f"--release-wheel {args.release_wheel}: no such file")
    if args.wheel_dir:  # the wheel and, if vLLM's build fails, vllm-build.log go there
        project.refuse_as_output(args.wheel_dir, "--wheel-dir")
    wheel_dir = (args.wheel_dir or project.default_wheel_dir).resolve()
    try:
        wheel_dir.mkdir(parents=True, exist_ok=True)
    except OSError as err:
        raise errors.UsageError(f"--wheel-dir {wheel_dir}: cannot create it ({err.strerror})") from err
    return WheelOptions(wheel_dir, args.wheel_build or REPACK,
                        args.release_wheel and args.release_wheel.resolve())


def _build_wheel(project: Project, report: Report, opts: WheelOptions) -> dict:
    """Build the wheel of the work branch just published; an error is also said on stderr."""
    repo = git.open_repo(Path(report.workdir))
    result = build_for(project, repo, report, git.branch_tip(repo, report.branch), opts)
    if "error" in result:
        tell(f"apply.py: error: {result['error']}")
    else:
        report.wheel_hint = f"its provenance record, where it is installed: {PRINT_RECORD}"
    return result


def line_by_line() -> None:
    """stdout written line by line even into a pipe, as stderr is: with both going into one
    log (``2>&1 | tee``), lines come in the order they were printed."""
    if not sys.stdout.isatty() and hasattr(sys.stdout, "reconfigure"):
        sys.stdout.reconfigure(line_buffering=True)


def stop_like_ctrl_c() -> None:
    """A cancelled CI job (SIGTERM), a closed terminal (SIGHUP) and a reader gone mid-run
    (SIGPIPE: ``apply.py 2>&1 | head -1``, progress then written to a closed pipe) clean
    up like Ctrl-C: no scratch clone, worktree or half-packed wheel is left behind. See
    ``job_done`` for after."""
    signal.signal(signal.SIGTERM, _interrupt)
    signal.signal(signal.SIGHUP, _interrupt)  # the terminal or ssh session closed mid-run
    signal.signal(signal.SIGPIPE, _interrupt)


def job_done() -> None:
    """Nothing is left to clean up: from now on a closed pipe ends the tool quietly
    (``apply.py | head -1``: the report is cut short, nothing else is)."""
    signal.signal(signal.SIGPIPE, signal.SIG_DFL)


def tell(text: str, *, to=None) -> None:
    """Print one message (stderr unless ``to``), through ``redact`` and ``printable`` (git's
    messages quote upstream's paths): the one way the command lines say anything outside a
    report (errors, notes, the export's summary)."""
    print(printable(redact(text)), file=to or sys.stderr)


def report_console() -> Console:
    """stdout for reports, through ``redact`` (``Stream``). Piped (a CI log, ``| grep``), no
    line is ever wrapped: a sha256, a path or a command stays whole on its line, and the
    status table has one line per patch or file, as wide as its longest entry."""
    if sys.stdout.isatty():
        return Console(file=Stream(lambda: sys.stdout), highlight=False)
    return Console(file=Stream(lambda: sys.stdout), highlight=False, width=PIPE_WIDTH,
                   soft_wrap=True)


PIPE_WIDTH = 100_000  # columns when piped: wider than any line the reports make


def _interrupt(_signum: int, _frame: object) -> None:
    raise KeyboardInterrupt


def _export(project: Project, workdir: Path) -> int:
    result = export(project, workdir.resolve())
    tell(f"exported {len(result.patches)} patch(es) on base {result.base}:", to=sys.stdout)
    for name in result.patches:
        tell(f"  {name}", to=sys.stdout)
    for name in result.dropped:
        tell(f"  dropped {name} (no commit with its subject on the work branch: landed "
              f"upstream, dropped or reworded)", to=sys.stdout)
    tell("overlay.json re-recorded at " + result.base, to=sys.stdout)
    if result.range_diff:
        tell("\ngit range-diff, old series vs new:\n" + result.range_diff.rstrip(), to=sys.stdout)
    if result.interrupted:
        tell("apply.py: interrupted while writing the export: it was finished first")
        return errors.INTERRUPTED
    return errors.OK
