#!/usr/bin/env python3
"""The CI rebase job: re-apply the overlay on new upstream refs and report per ref.

    python ci/rebase.py --onto v0.29.0 --onto v0.33.0 --json out.json \\
        [--junit out.xml] [--markdown out.md] [--vllm-repo URL] [--no-tests] [--wheels DIR]

For each ref, in a throwaway clone (the user's checkout is never touched):
every patch classified (applied / applied-3way / landed-upstream / conflict),
every drifted overlay file 3-way merged (merged / conflict) with upstream's
own diff, the result verified, and the CPU test tier (vLLM's skinny-GEMM
test file and ours, see ``ci/cpu_tier.py``) run on what applied. With
``--wheels DIR``, each ref that applied also gets its internal wheel built
into DIR (``apply.py --build-wheel``'s repack), reported as ``wheel``.

Exit code: 0 when every ref is clean, else the first failing ref's code
(3 patch conflict, 4 overlay drift/conflict, 5 verify or tests failed,
2/6 ref or source problems), so CI can gate on it or treat it as advisory.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))
sys.path.insert(0, str(HERE))

from k3overlay import errors, progress  # noqa: E402
from k3overlay.cli import report_console, stop_like_ctrl_c  # noqa: E402
from k3overlay.project import Project  # noqa: E402
from k3overlay.rebase import run_rebase  # noqa: E402
from k3overlay.report import (  # noqa: E402
    check_writable,
    junit_xml,
    markdown,
    write_human,
    write_json,
    write_text,
)
from k3overlay.source import default_mirror  # noqa: E402
from k3overlay.wheel import WheelOptions  # noqa: E402


def cpu_tier(tree: Path) -> dict:
    from cpu_tier import run_cpu_tier

    return run_cpu_tier(tree)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--onto", action="append", required=True, metavar="REF",
                   help="upstream ref to rebase onto (repeatable); 'latest' = the newest vLLM "
                        "release on the package index")
    p.add_argument("--vllm-repo", metavar="PATH_OR_URL", help="as for apply.py")
    p.add_argument("--json", type=Path, metavar="FILE")
    p.add_argument("--junit", type=Path, metavar="FILE")
    p.add_argument("--markdown", type=Path, metavar="FILE")
    p.add_argument("--no-tests", action="store_true", help="skip the CPU test tier")
    p.add_argument("--wheels", type=Path, metavar="DIR",
                   help="build each applied ref's wheel into DIR (name, size, sha256 reported)")
    p.add_argument("-q", "--quiet", action="store_true")
    args = p.parse_args(argv)
    progress.quiet = args.quiet
    stop_like_ctrl_c()
    outputs = [(args.json, "--json"), (args.junit, "--junit"), (args.markdown, "--markdown")]
    try:
        for path, option in outputs:
            if path:
                check_writable(path, option)
        refs = [f"v{default_mirror().latest()}" if ref == "latest" else ref for ref in args.onto]
        reports = run_rebase(Project(), list(dict.fromkeys(refs)), vllm_repo=args.vllm_repo,
                             tests=None if args.no_tests else cpu_tier,
                             wheels=WheelOptions(args.wheels.resolve()) if args.wheels else None)
    except errors.OverlayError as err:
        print(f"rebase.py: error: {err}", file=sys.stderr)
        return err.exit_code
    except KeyboardInterrupt:
        print("rebase.py: interrupted", file=sys.stderr)
        return 130
    console = report_console()
    for report in reports:
        write_human(report, console)
        console.print()
    code = next((r.exit_code for r in reports if not r.ok), errors.OK)
    renderers = [(args.json, lambda path: write_json(reports, path)),
                 (args.junit, lambda path: write_text(path, junit_xml(reports))),
                 (args.markdown, lambda path: write_text(path, markdown(reports)))]
    for path, write in renderers:
        if path:
            try:  # one report that cannot be written must not cost CI the others
                write(path)
            except errors.OverlayError as err:
                print(f"rebase.py: error: {err}", file=sys.stderr)
                code = code or err.exit_code
    return code


if __name__ == "__main__":
    sys.exit(main())
