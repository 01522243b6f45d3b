#!/usr/bin/env python3
"""The CI rebase job: re-apply the overlay on new upstream refs and report per ref.

    python -m ci.rebase --onto v0.29.0 --onto v0.33.0 --json reports/rebase.json \\
        [--junit reports/rebase.xml] [--markdown reports/rebase.md] [--vllm-repo URL]
        [--no-tests] [--wheels DIR]
        [--gpu | --gpu-results DIR] [--gpu-export DIR]

For each ref, in a throwaway clone (the user's checkout is never touched):
every patch classified (applied / applied-3way / landed-upstream / conflict),
every drifted overlay file 3-way merged (merged / conflict) with upstream's
own diff, the result verified, and, in an environment built from the target's
own requirements (``ci/target_env.py``): the ours-vs-upstream diff of the
low-latency GEMM tables (``ci/table_diff.py``) and the CPU test tier (vLLM's
skinny-GEMM test file and ours, see ``ci/cpu_tier.py``) on what applied. With
``--wheels DIR``, each ref that applied also gets its internal wheel built
into DIR (``apply.py --build-wheel``'s repack), reported as ``wheel``.
Everything past patching is ``JobStages``, called by ``k3overlay.rebase.run_rebase``
once per ref through the tool's one typed interface (``k3overlay/stages.py``).

GPU stage (``ci/gpu_stage/``): ``--gpu`` runs it on this machine's GPU for each
target; ``--gpu-results DIR`` attaches what an air-gapped GPU runner measured on
the same trees (refused for a tree whose commit differs); ``--gpu-export DIR``
writes each built tree and what the stage needs of it, for the offline bundle.

Exit code: 0 when every ref is clean, else the first failing ref's code
(3 patch conflict, 4 overlay drift/conflict, 5 verify or tests failed,
7 test environment, 2/6 ref or source problems), so CI can gate on it or treat
it as advisory.
"""

from __future__ import annotations

INTERRUPTED = "rebase.py: interrupted; no checkout was touched (the job works in throwaway clones)"


def _ci_importable() -> bool:
    """True if ``import ci`` finds this file's package (run as ``python -m ci.rebase``, or
    with the repository's root on PYTHONPATH); ``python ci/rebase.py`` alone does not."""
    import importlib.util
    import os

    spec = importlib.util.find_spec("ci")
    here = os.path.dirname(os.path.realpath(__file__))
    return bool(spec and spec.origin) and os.path.dirname(os.path.realpath(spec.origin)) == here


try:  # Ctrl-C while starting up (the imports take a while): one line, like anywhere else
    import contextlib
    import os
    import sys

    if __name__ == "__main__" and not globals().get("__package__") and not _ci_importable():
        # ``python ci/rebase.py``, the old layout's habit: the job would die minutes in
        import shlex

        print("rebase.py: error: run it as a module, from the repository's root: python -m ci.rebase "
              + " ".join(map(shlex.quote, sys.argv[1:])), file=sys.stderr)
        sys.exit(2)
    from argparse import RawDescriptionHelpFormatter
    from pathlib import Path
    from types import SimpleNamespace

    from k3overlay import errors, git, progress, scratch, streams
    from k3overlay.cli import INTERNAL, OneLineParser, job_done, report_console, stop_like_ctrl_c, tell
    from k3overlay.files import refuse_one_file_twice, stream_target
    from k3overlay.outputs import refuse_aliases, refuse_unresolvable
    from k3overlay.project import Project
    from k3overlay.rebase import run_rebase
    from k3overlay.redact import excepthook
    from k3overlay.report import (
        check_writable,
        junit_xml,
        markdown,
        refused,
        write_human,
        write_json,
        write_text,
    )
    from k3overlay.source import default_mirror, local_path, release_for_ref
    from k3overlay.stages import StageResults, Target, TestRun
    from k3overlay.wheel import WheelOptions, source_date_epoch
except KeyboardInterrupt:
    print(INTERRUPTED, file=__import__("sys").stderr)
    raise SystemExit(130) from None

LLG_PACKAGE = "vllm/models/kimi_k3/nvidia"
LLG = f"{LLG_PACKAGE}/low_latency_gemm.py"


class JobStages:
    """The job's stages on each target (``k3overlay.stages.Stages``), called once per ref.

    On the released tree: build (or reuse) the target's environment, read upstream's
    tables. On the built tree: the CPU tier (our test files only where the tree holds our
    whole overlay), our tables and the diff, the GPU stage.
    """

    def __init__(self, project: Project, *, tests: bool, gpu: bool,
                 gpu_results: dict[str, dict] | None, gpu_export: Path | None) -> None:
        self.project, self.tests, self.gpu = project, tests, gpu
        self.gpu_results, self.gpu_export = gpu_results, gpu_export

    def __call__(self, target: Target) -> StageResults:
        from ci import target_env
        from ci.cpu_tier import run_cpu_tier

        results = StageResults()
        try:
            env = target_env.ensure(target.released)
        except target_env.EnvError as err:
            if self.tests:
                results.runs.append(TestRun(env_error=str(err)))
            return results
        if self.tests:
            run = run_cpu_tier(target.built, env.python, lacks_overlay="; ".join(target.missing))
            run.env = env.describe()
            results.runs.append(run)
        if (target.released / LLG).is_file():
            self._tables_and_gpu(target, env, results)
        return results

    def _tables_and_gpu(self, target: Target, env, results: StageResults) -> None:
        from ci.gpu_report import ab_section, gpu_run
        from ci.gpu_stage import stage
        from ci.table_diff import TableReadError, as_section, read_tables, section

        # Our module where the job's merge of it conflicted: the built tree holds upstream's.
        prefer = (self.project.overlay_dir / LLG_PACKAGE
                  if any(p.startswith(LLG_PACKAGE + "/") for p in target.overlay_conflicts) else None)
        try:
            upstream = read_tables(target.released, env.python)
        except TableReadError as err:
            results.sections.append(as_section({"error": f"upstream's tables: {err}"}, target.ref))
            return
        try:
            ours = read_tables(target.built, env.python, prefer)
        except TableReadError as err:
            results.sections.append(as_section({"error": f"our tables: {err}"}, target.ref))
            return
        results.sections.append(
            as_section(section(upstream, ours, target.released, target.built, prefer), target.ref))
        tree_sha = git.run(git.Repo(target.built), "rev-parse", "HEAD").strip()
        meta = stage.meta(target, tree_sha, upstream, ours, prefer, env.cute_dsl)
        if self.gpu_export is not None:
            stage.export(target.built, meta, self.gpu_export, target.ref)
        if not self.gpu and self.gpu_results is None:
            return
        got = SimpleNamespace(gpu=None, ab=None)  # what ``stage.attach`` fills
        if self.gpu:
            with scratch.machine_tmpdir():  # its lock, one per GPU machine, is in TMPDIR
                stage.attach(got, stage.run_here(target.built, meta), tree_sha)
        elif target.ref not in self.gpu_results:
            got.gpu = {"env_error": f"no GPU results for {target.ref} in --gpu-results"}
        else:
            stage.attach(got, self.gpu_results[target.ref], tree_sha)
        if got.gpu is not None:
            results.runs.append(gpu_run(got.gpu))
        if got.ab is not None:
            results.sections.append(ab_section(got.ab))


def main(argv: list[str] | None = None) -> int:
    """Run the job; return its exit code. Ctrl-C (or SIGTERM) at any point: one line, 130."""
    sys.excepthook = excepthook  # a bug's traceback is redacted too
    try:
        with streams.quiet_when_reader_gone():
            return _interruptible(argv)
    finally:
        job_done()  # no handler of ours left behind for a caller that goes on (tests call main)


def _interruptible(argv: list[str] | None) -> int:
    try:
        streams.reopen_closed()  # `>&-`: the job and its report files still get done
        stop_like_ctrl_c()
        return _main(argv)
    except (KeyboardInterrupt, BrokenPipeError):
        job_done()  # cleaned up: a reader gone (`--help | true`, `| head -1`) ends it quietly
        streams.end_if_reader_gone()
        print(INTERRUPTED, file=sys.stderr)
        return 130


EXIT_CODES = """exit codes: 0 every ref clean; else the first failing ref's: 2 bad input (a ref, an
option), 3 patch conflict, 4 overlay drift or conflict, 5 verify or tests failed, 6 source
unreachable (repository, package index), 7 test environment, 1 a bug of rebase.py.
Each report asked for is written whatever the outcome. See docs/rebase-job.md."""


def _main(argv: list[str] | None) -> int:
    p = OneLineParser(description=__doc__.splitlines()[0], epilog=EXIT_CODES,
                      formatter_class=RawDescriptionHelpFormatter)
    p.add_argument("--onto", action="append", required=True, metavar="REF",
                   help="upstream ref to rebase onto (repeatable); 'latest' = the newest vLLM "
                        "release on the package index")
    p.add_argument("--vllm-repo", metavar="PATH_OR_URL", help="as for apply.py")
    p.add_argument("--json", type=Path, metavar="FILE",
                   help="write every ref's report as JSON (docs/apply.md: JSON report, one per ref)")
    p.add_argument("--junit", type=Path, metavar="FILE",
                   help="write JUnit XML: one testsuite per ref, a failure per item that needs a human")
    p.add_argument("--markdown", type=Path, metavar="FILE",
                   help="write the maintainer's summary (a PR comment): verdicts, then per ref what "
                        "conflicts and the commands to run next")
    p.add_argument("--no-tests", action="store_true", help="skip the CPU test tier")
    p.add_argument("--wheels", type=Path, metavar="DIR",
                   help="build each applied ref's wheel into DIR (name, size, sha256 reported)")
    gpu = p.add_mutually_exclusive_group()
    gpu.add_argument("--gpu", action="store_true",
                     help="run the GPU stage on this machine's GPU (ci/gpu_stage/)")
    gpu.add_argument("--gpu-results", type=Path, metavar="DIR",
                     help="attach the GPU stage's results measured elsewhere on these trees")
    p.add_argument("--gpu-export", type=Path, metavar="DIR",
                   help="write each built tree and its GPU-stage inputs here (offline bundle)")
    p.add_argument("-q", "--quiet", action="store_true", help="no progress messages (errors still show)")
    args = p.parse_args(argv)
    progress.quiet = args.quiet
    reports_to = [(args.json, "--json"), (args.junit, "--junit"), (args.markdown, "--markdown")]
    folders = [(args.wheels, "--wheels"), (args.gpu_export, "--gpu-export")]
    try:
        # first: every check below resolves these, and a traceback was what met one that cannot be
        refuse_unresolvable(reports_to + folders + _inputs(args))
        git.refuse_unreadable_config()  # a FIFO there: each git of the job waited on it, 30 s a folder
        for path, option in reports_to + folders:
            if path:
                Project().refuse_as_output(path, option)
        refuse_one_file_twice([(path, option) for path, option in reports_to])
        refuse_aliases(reports_to + folders, _inputs(args))
        for path, option in reports_to:
            if path:
                check_writable(path, option)
        if args.wheels:
            source_date_epoch()  # the date of the wheels' entries, read before any work
    except errors.OverlayError as err:  # nowhere safe to write a report: say it only
        tell(f"rebase.py: error: {err}")
        return err.exit_code
    refs = args.onto  # as given, until _targets translates them
    try:
        # every temporary file of the job and of its children (git, pip, the test tiers) in one
        # folder of its own, removed at the end; a killed job's, by the next run (k3overlay.scratch)
        with scratch.per_run():
            refs, notes, refused_refs = _targets(args.onto, args.vllm_repo)
            reports = _run(args, refs, notes, refused_refs)
    except errors.OverlayError as err:  # the job stopped: each ref's report says why
        tell(f"rebase.py: error: {err}")
        reports = _stopped(refs, str(err), err.exit_code)
    except Exception as err:  # a bug of ours: the reports asked for still say so, then the traceback
        _internal_error(args, refs, err)
        raise
    job_done()
    try:
        return _finish(args, reports)
    except Exception as err:  # a bug after the work (rendering, printing): the same
        _internal_error(args, refs, err)
        raise


def _finish(args, reports: list) -> int:
    """Write the report files, print the text report, write the report streams; the exit code."""
    code = next((r.exit_code for r in reports if not r.ok), errors.OK)
    renderers = _renderers(args, reports)
    # Report files before the text, streams after it: a reader of stdout gone early (`| head`,
    # which now ends the job) then costs only the text.
    to_files = [(path, write) for path, write in renderers if path and stream_target(path) is None]
    code = _write_reports(to_files, code)
    console = report_console()
    for report in reports:
        write_human(report, console)
        console.print()
    return _write_reports([(path, write) for path, write in renderers
                           if path and stream_target(path) is not None], code)


def _internal_error(args, refs: list[str], err: Exception) -> None:
    """Write every report asked for, each ref's saying the job hit a bug of ours."""
    reports = _stopped(refs, f"internal error (a bug of rebase.py): {type(err).__name__}: {err}",
                       INTERNAL)
    for path, write in _renderers(args, reports):
        if path:  # one that cannot be written (the bug may be in its renderer) spares the others
            with contextlib.suppress(Exception):
                write(path)


def _inputs(args) -> list[tuple[Path | None, str]]:
    """What the job reads that a report or folder it writes could land in: the source folder
    or bundle (``--vllm-repo`` or ``$VLLM_REPO``) and ``--gpu-results``."""
    source = args.vllm_repo or os.environ.get("VLLM_REPO")
    return [(source and local_path(source), "--vllm-repo"), (args.gpu_results, "--gpu-results")]


def _run(args, refs: list[str], notes: dict, refused_refs: dict) -> list:
    """One report per distinct ref, in order (see ``run_rebase``); a ref ``_targets``
    refused gets its refusal as its report, and the others run."""
    results = None
    if args.gpu_results:
        from ci.gpu_stage.stage import load_results

        results = load_results(args.gpu_results)
    project = Project()
    stages = JobStages(project, tests=not args.no_tests, gpu=args.gpu,
                       gpu_results=results, gpu_export=args.gpu_export)
    refs = list(dict.fromkeys(refs))
    runnable = [ref for ref in refs if ref not in refused_refs]
    ran = iter(run_rebase(project, runnable, vllm_repo=args.vllm_repo, stages=stages,
                          wheels=WheelOptions(args.wheels.resolve()) if args.wheels else None)
               if runnable else [])
    reports = []
    for ref in refs:
        err = refused_refs.get(ref)
        report = refused(project, ref, str(err), err.exit_code) if err else next(ran)
        report.notes[:0] = notes.get(ref, [])
        reports.append(report)
    return reports


def _targets(onto: list[str], vllm_repo: str | None) -> tuple[list[str], dict, dict]:
    """The ``--onto`` refs as the job runs them, with a note per translated one, and the
    refs refused on their own (``{ref: OverlayError}``: that ref's report says why, the
    others still run): ``latest`` is the newest release, and upstream's commit id of a
    release is that release's tag (as ``apply.py --vllm-ref`` takes it), so the target is
    built from its sdist."""
    refs, notes, refused_refs = [], {}, {}
    for ref in onto:
        try:  # only the targets that need the index (latest, an upstream id) fail without it
            if ref == "latest":
                refs.append(f"v{default_mirror().latest()}")
                continue
            found = release_for_ref(ref, vllm_repo, "--onto")
        except errors.OverlayError as err:  # a bad or ambiguous ref, no index: its own report only
            refused_refs[ref] = err
            found = None
        refs.append(found.release.tag if found else ref)
        if found:
            notes.setdefault(found.release.tag, []).append(found.note())
    return refs, notes, refused_refs


def _stopped(refs: list[str], error: str, code: int) -> list:
    """Reports for a job stopped before its refs were done (an unreachable source, a bad
    series, a bug): every report asked for is still written, each ref's saying why."""
    try:
        project = Project()
    except errors.OverlayError:
        project = None
    return [refused(project, ref, error, code) for ref in dict.fromkeys(refs)]


def _renderers(args, reports: list) -> list:
    """(path or None, write) of each report file the job was asked for."""
    return [(args.json, lambda path: write_json(reports, path)),
            (args.junit, lambda path: write_text(path, junit_xml(reports))),
            (args.markdown, lambda path: write_text(path, markdown(reports)))]


def _write_reports(renderers, code: int) -> int:
    """Write each ``(path, write)``; the exit code to end with (``code``, or a write error's)."""
    for path, write in renderers:
        try:  # one report that cannot be written must not cost CI the others
            write(path)
        except errors.OverlayError as err:
            tell(f"rebase.py: error: {err}")
            code = code or err.exit_code
    return code


if __name__ == "__main__":
    try:  # main() catches Ctrl-C itself; this catches one landing on its first instruction
        code = main()
    except KeyboardInterrupt:
        print(INTERRUPTED, file=sys.stderr)
        code = 130
    sys.exit(code)
