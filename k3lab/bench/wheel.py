#!/usr/bin/env python3
"""Benchmark: what ``apply.py --build-wheel`` (repack) costs on the pinned base, step by step.

Prints seconds per step and writes them as JSON; asserts nothing. Steps, each
timed once on the real v0.28.0 tree (applied into a temporary checkout):

- download: the release wheel from the package index into an empty cache
  (``--no-download`` skips it and uses the release cache);
- verify: the sha256 check every later use of the cached wheel pays;
- plan: the soundness checks, the byte-for-byte check of the base's ``vllm/``
  files against the wheel, the provenance record;
- pack: the repack (read the release wheel, write the new one; no unpack to disk);
- check: ``wheelcheck`` (both wheels read against RECORD, file set, contents,
  ``pip install --no-deps --target``).

    python -m k3lab.bench.wheel [--no-download] [--json results/tool/bench_wheel.json]
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import sys
import tempfile
import time
from importlib.metadata import version as installed
from pathlib import Path


from k3overlay import git, progress, source, wheel, wheelcheck
from k3overlay.downloads import ReleaseFiles, file_sha256
from k3overlay.job import Options, run_apply
from k3overlay.project import Project


def timed(figures: dict, name: str, work):
    start = time.perf_counter()
    result = work()
    figures[name] = round(time.perf_counter() - start, 1)
    print(f"{name:>8}: {figures[name]:6.1f} s", flush=True)
    return result


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--no-download", action="store_true", help="use the cached release wheel")
    p.add_argument("--json", type=Path, metavar="FILE", help="also write the figures here")
    args = p.parse_args()
    progress.quiet = True
    project, figures = Project(), {}
    with tempfile.TemporaryDirectory(prefix="k3-bench-wheel-") as tmp:
        tmp = Path(tmp)
        report = run_apply(project, Options(workdir=tmp / "vllm"))
        repo = git.open_repo(tmp / "vllm")
        tip = git.branch_tip(repo, report.branch)
        files = source.release_files()
        if not args.no_download:
            fresh = ReleaseFiles(tmp / "cache", files.settings)
            pkg = fresh.wheel(wheel.release_version(repo, report.ref, report.ref_sha))
            timed(figures, "download", lambda: fresh.fetch(pkg))
            files = fresh
        else:
            pkg = files.wheel(wheel.release_version(repo, report.ref, report.ref_sha))
        cached = files.fetch(pkg)
        timed(figures, "verify", lambda: file_sha256(cached))
        opts = wheel.WheelOptions(tmp / "wheels")
        plan = timed(figures, "plan", lambda: wheel.plan(project, repo, report, tip, opts, files))
        built = tmp / wheel.wheel_name(plan.release_wheel.name, plan.version)
        timed(figures, "pack", lambda: wheel.repack(plan.release_wheel, built, plan.version,
                                                    plan.put, plan.epoch))
        timed(figures, "check", lambda: wheelcheck.check(built, plan.release_wheel, plan.version,
                                                         plan.put))
        result = {
            "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "machine": f"{platform.machine()}, {os.cpu_count()} cores",
            "python": platform.python_version(), "wheel": installed("wheel"),
            "release_wheel": {"name": pkg.filename, "bytes": cached.stat().st_size},
            "built_wheel": {"name": built.name, "bytes": built.stat().st_size,
                            "sha256": file_sha256(built)},
            "seconds": figures,
        }
    print(json.dumps(result, indent=2))
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(result, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
