#!/usr/bin/env python3
"""Mutation testing with mutmut on the fast tier, and the score it gives.

    python ci/mutation.py [--sample N] [--jobs 2] [--json FILE]            # k3overlay/
    python ci/mutation.py --overlay [--sample N] [--jobs 2] [--json FILE]  # the overlay module

``k3overlay/`` is mutated as ``[tool.mutmut]`` in pyproject.toml says and each
mutant run against ``tests/`` without the e2e tier. ``--overlay`` mutates
``low_latency_gemm.py`` inside a fresh patched tree (``work/mutation/vllm``)
against its CPU tests there (needs vLLM's requirements in the venv, as
``ci/test.sh`` installs them). ``--sample N`` runs N mutants drawn at random
(seed 0) instead of all: a full run of k3overlay/'s ~5700 mutants takes hours
on 2 cores. ``--again`` re-runs only the survivors of the last run (after
tests were added to kill them). Prints the score (killed / all tried; a mutant
no test reaches counts as a survivor) and lists the survivors.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PYTHON = sys.executable
OVERLAY_CFG = """
[mutmut]
source_paths=vllm/
only_mutate=vllm/models/kimi_k3/nvidia/low_latency_gemm.py
also_copy=csrc/
pytest_add_cli_args=-p
    pytest_no_accelerator
    -p
    no:cacheprovider
    -q
pytest_add_cli_args_test_selection=tests/kernels/test_kimi_k3_low_latency_gemm.py
process_isolation=forkserver
"""
KILLED = {"killed", "timeout", "caught by type check"}


def mutmut(where: Path, *args: str, capture: bool = False, quiet: bool = False) -> str:
    env = {**os.environ, "PYTHONPATH": str(ROOT / "ci")}  # the no-accelerator pytest plugin
    proc = subprocess.run([PYTHON, "-m", "mutmut", *args], cwd=where, env=env, text=True,
                          stdout=subprocess.PIPE if capture else subprocess.DEVNULL,
                          stderr=subprocess.DEVNULL if quiet else None)
    return proc.stdout or ""


def results(where: Path) -> dict[str, str]:
    """{mutant name: status} of every mutant mutmut generated."""
    out = mutmut(where, "results", "--all", "true", capture=True)
    return {name.strip(): status.strip() for name, _, status in
            (line.rpartition(": ") for line in out.splitlines() if ": " in line)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--overlay", action="store_true", help="the overlay module, not k3overlay/")
    parser.add_argument("--sample", type=int, default=0, metavar="N", help="N random mutants (0: all)")
    parser.add_argument("--jobs", type=int, default=2)
    parser.add_argument("--again", action="store_true", help="re-run the last run's survivors only")
    parser.add_argument("--json", type=Path, metavar="FILE", help="also write the score here")
    args = parser.parse_args()
    where = ROOT / "work" / "mutation" / "vllm" if args.overlay else ROOT
    jobs = ["--max-children", str(args.jobs)]
    tried = where / "mutants" / "k3-tried.json"  # the names the last run tried
    if args.again:
        chosen = json.loads(tried.read_text())
        retry = [name for name, status in results(where).items()
                 if name in chosen and status not in KILLED]
        forget(where, retry)
        mutmut(where, "run", *jobs, *retry)
        report(args, where, chosen)
        return
    if args.overlay:
        shutil.rmtree(where, ignore_errors=True)
        subprocess.run([PYTHON, str(ROOT / "apply.py"), "-q", "--workdir", str(where)], check=True,
                       stdout=subprocess.DEVNULL)
        with open(where / "setup.cfg", "a") as cfg:
            cfg.write(OVERLAY_CFG)
    shutil.rmtree(where / "mutants", ignore_errors=True)
    # Generates the mutants and the test stats, then stops: no mutant has that name.
    mutmut(where, "run", *jobs, "no-such-mutant", quiet=True)
    names = sorted(results(where))
    chosen = sorted(random.Random(0).sample(names, args.sample)) if 0 < args.sample < len(names) \
        else names
    tried.write_text(json.dumps(chosen))
    mutmut(where, "run", *jobs, *chosen)
    report(args, where, chosen)


def forget(where: Path, names: list[str]) -> None:
    """Drop mutmut's verdicts on ``names``, so that its next run tries them again."""
    for meta in (where / "mutants").rglob("*.meta"):
        data = json.loads(meta.read_text())
        codes = data["exit_code_by_key"]
        if any(name in codes for name in names):
            codes.update({name: None for name in names if name in codes})
            meta.write_text(json.dumps(data))


def report(args: argparse.Namespace, where: Path, chosen: list[str]) -> None:
    everything = results(where)
    statuses = {name: status for name, status in everything.items() if name in set(chosen)}
    survivors = sorted(name for name, status in statuses.items() if status not in KILLED)
    killed = len(statuses) - len(survivors)
    score = killed / len(statuses) if statuses else 0.0
    what = "the overlay module" if args.overlay else "k3overlay/"
    sample = (f" (a random sample of the {len(everything)} mutants)"
              if len(statuses) < len(everything) else "")
    print(f"mutation score over {what}: {killed}/{len(statuses)} = {score:.1%}{sample}")
    for name in survivors:
        print(f"  {statuses[name]:10s} {name}")
    if args.json:
        args.json.write_text(json.dumps({"target": what, "sample": len(chosen), "tried": len(statuses),
                                         "killed": killed, "score": score,
                                         "survivors": {n: statuses[n] for n in survivors}},
                                        indent=2) + "\n")


if __name__ == "__main__":
    main()
