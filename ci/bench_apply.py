#!/usr/bin/env python3
"""Benchmark: apply.py's wall time on the real vLLM tree next to raw ``git am --3way``.

Prints figures (seconds, median of ``--repeats``); asserts nothing. Both sides
run in the same process on the same clone of the release mirror at the pinned
base: "raw" is a fresh worktree plus ``git am --3way`` of the series; "apply"
is the whole job in ``--check`` mode (worktree, classification, am, overlay,
verify, cleanup).

    python ci/bench_apply.py [--repeats 5]
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from k3overlay import git, manifest, progress, series, source  # noqa: E402
from k3overlay.job import Options, run_apply  # noqa: E402
from k3overlay.project import Project  # noqa: E402


def raw_am(repo: git.Repo, sha: str, patches: list[series.Patch]) -> float:
    start = time.perf_counter()
    with git.temporary_worktree(repo, sha) as tree:
        subprocess.run(["git", "am", "--3way", *[str(p.path) for p in patches]],
                       cwd=tree.working_tree_dir, check=True, capture_output=True,
                       env={**os.environ, "GIT_COMMITTER_NAME": "bench", "GIT_COMMITTER_EMAIL": "b@b"})
    return time.perf_counter() - start


def full_apply(project: Project, workdir: Path) -> float:
    start = time.perf_counter()
    report = run_apply(project, Options(workdir=workdir, check=True))
    elapsed = time.perf_counter() - start
    if not report.ok:
        sys.exit(f"apply failed on the base (exit {report.exit_code}): {report.to_json()}")
    return elapsed


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    progress.quiet = True
    project = Project()
    base = manifest.load(project.manifest_path, project.overlay_dir).base
    patches = series.load(project.patches_dir)
    origin = source.locate(None, [base])
    with tempfile.TemporaryDirectory() as tmp:
        workdir = Path(tmp) / "vllm"
        repo = source.clone(origin, workdir)
        sha = git.resolve(repo, base)
        raw = [raw_am(repo, sha, patches) for _ in range(args.repeats)]
        full = [full_apply(project, workdir) for _ in range(args.repeats)]
    r, f = statistics.median(raw), statistics.median(full)
    files = len(manifest.load(project.manifest_path, project.overlay_dir).files)
    print(f"vLLM {base}, {len(patches)} patch(es), {files} overlay file(s), median of {args.repeats}")
    print(f"  raw worktree + git am --3way : {r:6.2f} s  (min {min(raw):.2f}, max {max(raw):.2f})")
    print(f"  apply.py --check (whole job) : {f:6.2f} s  (min {min(full):.2f}, max {max(full):.2f})")
    print(f"  overhead of the job          : {f - r:6.2f} s  ({f / r:.1f}x)")


if __name__ == "__main__":
    main()
