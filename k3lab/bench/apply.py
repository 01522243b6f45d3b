#!/usr/bin/env python3
"""Benchmark: apply.py's wall time next to raw ``git am --3way`` of the same series.

Prints figures (seconds, median of ``--repeats``); asserts nothing. Both sides
run in the same process on the same clone of the release mirror at the pinned
base: "raw" is a fresh worktree plus one ``git am --3way`` of the series;
"apply" is the whole job in ``--check`` mode (read the series, worktree, am
with verdicts, overlay, verify, cleanup), with the time of each phase.

    python -m k3lab.bench.apply [--repeats 5]                 # our real series
    python -m k3lab.bench.apply --synthetic 300 [--json F]    # 300 one-line patches

``--synthetic N`` makes N one-line patches on the pinned base, each appending a
comment to a different ``.py`` file of vLLM (so every one applies as is), and
lays them with our overlay.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import functools
import itertools
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections import defaultdict
from pathlib import Path


from k3overlay import git, job, manifest, progress, series, source
from k3overlay.job import Options, run_apply
from k3overlay.project import COMMITTER, Project

# Phases of the job, timed by wrapping the function that does each.
PHASES = {"read series (git mailinfo)": (job.series_mod, "load"),
          "git am + verdicts": (job, "apply_patches"),
          "overlay check": (job, "classify_overlay"),
          "verify": (job, "verify_change")}


def raw_am(repo: git.Repo, sha: str, patches: list[Path]) -> float:
    start = time.perf_counter()
    with git.temporary_worktree(repo, sha) as tree:
        proc = subprocess.run(["git", "am", "--3way", *map(str, patches)], cwd=tree.working_tree_dir,
                              capture_output=True, text=True, env=git.environ(**COMMITTER))
    if proc.returncode:
        sys.exit(f"raw git am failed: {git.first_line(proc.stderr)}")
    return time.perf_counter() - start


def full_apply(project: Project, workdir: Path, phases: dict[str, float]) -> float:
    start = time.perf_counter()
    with timed(phases):
        report = run_apply(project, Options(workdir=workdir, check=True))
    elapsed = time.perf_counter() - start
    if not report.ok:
        sys.exit(f"apply failed on the base (exit {report.exit_code}): {report.to_json()}")
    return elapsed


@contextlib.contextmanager
def timed(phases: dict[str, float]):
    """Add each phase's seconds to ``phases`` while the block runs."""
    originals = {name: getattr(module, attr) for name, (module, attr) in PHASES.items()}

    def wrap(name, function):
        @functools.wraps(function)
        def timed_call(*args, **kwargs):
            start = time.perf_counter()
            try:
                return function(*args, **kwargs)
            finally:
                phases[name] += time.perf_counter() - start
        return timed_call

    for name, (module, attr) in PHASES.items():
        setattr(module, attr, wrap(name, originals[name]))
    try:
        yield
    finally:
        for name, (module, attr) in PHASES.items():
            setattr(module, attr, originals[name])


def synthetic_project(repo: git.Repo, base: str, count: int, root: Path) -> Project:
    """A project with ``count`` one-line patches on ``base`` and this repository's overlay."""
    real = Project()
    listing = git.run(repo, "ls-tree", "-r", "-z", "--name-only", base, "--", "vllm")
    # Files with CRLF lines are left out: plain git am (no --keep-cr) cannot apply to them.
    files = list(itertools.islice((p for p in listing.split("\0") if p.endswith(".py")
                                   and b"\r" not in git.read_blob(repo, git.blob_at(repo, base, p))),
                                  count))
    if len(files) < count:
        sys.exit(f"{base} has only {len(files)} .py files under vllm/")
    env = git.environ(GIT_AUTHOR_NAME="bench", GIT_AUTHOR_EMAIL="bench@localhost",
                      GIT_AUTHOR_DATE="2026-01-01T00:00:00Z", **COMMITTER)
    (root / "patches").mkdir(parents=True)
    with git.temporary_worktree(repo, git.resolve(repo, base)) as tree:
        top = Path(tree.working_tree_dir)
        for number, path in enumerate(files, 1):
            with open(top / path, "a") as f:
                f.write(f"# k3 synthetic patch {number}\n")
            git.run(tree, "commit", "-q", "-a", "-m",
                    f"[Bench] synthetic patch {number}\n\nUpstream-Status: Inappropriate [benchmark]",
                    env=env)
        git.run(tree, "format-patch", "-q", "--zero-commit", "--no-signature", "--full-index",
                "-o", str(root / "patches"), f"HEAD~{count}")
    names = sorted(p.name for p in (root / "patches").glob("*.patch"))
    (root / "patches" / "series").write_text("".join(f"{n}\n" for n in names))
    shutil.copytree(real.overlay_dir, root / "overlay")
    shutil.copyfile(real.manifest_path, root / "overlay.json")
    shutil.copyfile(real.root / "VERSION", root / "VERSION")
    return Project(root)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--synthetic", type=int, metavar="N",
                        help="a synthetic series of N one-line patches instead of ours")
    parser.add_argument("--json", type=Path, metavar="FILE", help="also write the figures here")
    args = parser.parse_args()
    progress.quiet = True
    base = manifest.load(Project().manifest_path, Project().overlay_dir).base
    origin = source.locate(None, [base])
    with tempfile.TemporaryDirectory() as tmp:
        workdir = Path(tmp) / "vllm"
        repo = source.clone(origin, workdir)
        sha = git.resolve(repo, base)
        project = synthetic_project(repo, base, args.synthetic, Path(tmp) / "project") \
            if args.synthetic else Project()
        patches = [p.path for p in series.load(project.patches_dir)]
        raw = [raw_am(repo, sha, patches) for _ in range(args.repeats)]
        phases: dict[str, float] = defaultdict(float)
        full = [full_apply(project, workdir, phases) for _ in range(args.repeats)]
    r, f = statistics.median(raw), statistics.median(full)
    kind = f"synthetic series of {len(patches)} one-line patches" if args.synthetic else "our series"
    print(f"vLLM {base}, {kind}, {len(patches)} patch(es), median of {args.repeats}")
    print(f"  raw worktree + git am --3way : {r:6.2f} s  (min {min(raw):.2f}, max {max(raw):.2f})")
    print(f"  apply.py --check (whole job) : {f:6.2f} s  (min {min(full):.2f}, max {max(full):.2f})")
    print(f"  ratio                        : {f / r:6.2f}x")
    print("  where the job's time goes (mean per run):")
    per_run = {name: seconds / args.repeats for name, seconds in phases.items()}
    for name, seconds in sorted(per_run.items(), key=lambda item: -item[1]):
        print(f"    {name:28s} {seconds:6.2f} s")
    print(f"    {'the rest (clone, worktree…)':28s} {f - sum(per_run.values()):6.2f} s")
    if args.json:
        git_version = subprocess.run(["git", "--version"], capture_output=True, text=True).stdout.strip()
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps({
            "date": datetime.date.today().isoformat(), "machine": platform.node() or "?",
            "cpus": len(os.sched_getaffinity(0)), "git": git_version,
            "python": platform.python_version(), "base": base, "series": kind,
            "patches": len(patches), "repeats": args.repeats,
            "raw_git_am_s": {"median": r, "min": min(raw), "max": max(raw)},
            "apply_check_s": {"median": f, "min": min(full), "max": max(full)},
            "ratio": f / r, "phases_mean_s": per_run}, indent=2) + "\n")


if __name__ == "__main__":
    main()
