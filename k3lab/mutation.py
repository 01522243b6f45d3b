#!/usr/bin/env python3
"""Mutation testing with mutmut on the fast tier, and the score it gives.

    python -m k3lab.mutation [--sample N] [--jobs 2] [--json FILE]            # k3overlay/
    python -m k3lab.mutation --overlay [--sample N] [--jobs 2] [--json FILE]  # the overlay module

``k3overlay/`` is mutated as ``[tool.mutmut]`` in pyproject.toml says and each
mutant run against ``tests/`` without the e2e tier. ``--overlay`` mutates
the dispatch module (``low_latency_gemm_dispatch.py``) inside a fresh patched tree (``work/mutation/vllm``)
against its CPU tests there (needs vLLM's requirements in the venv, as
``ci/test.sh`` installs them). ``--sample N`` runs N mutants drawn at random
(``--seed``, default 0) instead of all: a full run of k3overlay/'s ~5700 mutants takes hours
on 2 cores. ``--again`` re-runs only the survivors of the last run (after
tests were added to kill them). Prints the score and lists the survivors.

A mutant that no test can kill because it changes nothing a user sees (a
temporary folder's prefix, a help text) is listed with the reason in
``k3lab/mutation_equivalent.json``, each with a line it changes: a listed
mutant counts as equivalent only while it survives and mutmut still shows that
line for it (numbers shift when a function changes; a stale entry is said and
counts as a survivor). Score: killed / (tried - equivalent); the raw score,
killed / tried, is printed and written next to it. A mutant no test reaches
counts as a survivor.
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
only_mutate=vllm/models/kimi_k3/nvidia/low_latency_gemm_dispatch.py
also_copy=csrc/
pytest_add_cli_args=-p
    pytest_no_accelerator
    -p
    no:cacheprovider
    -q
pytest_add_cli_args_test_selection=tests/kernels/test_kimi_k3_low_latency_gemm.py
    tests/kernels/test_kimi_k3_gemm_tables.py
    tests/kernels/test_kimi_k3_gemm_guards.py
process_isolation=forkserver
"""
KILLED = {"killed", "timeout", "caught by type check"}
EQUIVALENT = ROOT / "k3lab" / "mutation_equivalent.json"


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
    parser.add_argument("--seed", type=int, default=0,
                        help="the sample's seed (another seed: a sample no test was written against)")
    parser.add_argument("--jobs", type=int, default=2)
    parser.add_argument("--again", action="store_true", help="re-run the last run's survivors only")
    parser.add_argument("--json", type=Path, metavar="FILE", help="also write the score here")
    args = parser.parse_args()
    where = ROOT / "work" / "mutation" / "vllm" if args.overlay else ROOT
    what = "the overlay module" if args.overlay else "k3overlay/"  # also the key in EQUIVALENT
    jobs = ["--max-children", str(args.jobs)]
    tried = where / "mutants" / "k3-tried.json"  # the names the last run tried
    if args.again:
        chosen = json.loads(tried.read_text())
        retry = [name for name, status in results(where).items()
                 if name in chosen and status not in KILLED]
        retry = [name for name in retry if name not in equivalents(where, what, retry)[0]]
        if retry:  # (mutmut run with no names would run every mutant)
            forget(where, retry)
            mutmut(where, "run", *jobs, *retry)
        report(args, where, what, chosen)
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
    chosen = sorted(random.Random(args.seed).sample(names, args.sample)) if 0 < args.sample < len(names) \
        else names
    tried.write_text(json.dumps(chosen))
    mutmut(where, "run", *jobs, *chosen)
    report(args, where, what, chosen)


def forget(where: Path, names: list[str]) -> None:
    """Drop mutmut's verdicts on ``names``, so that its next run tries them again."""
    for meta in (where / "mutants").rglob("*.meta"):
        data = json.loads(meta.read_text())
        codes = data["exit_code_by_key"]
        if any(name in codes for name in names):
            codes.update({name: None for name in names if name in codes})
            meta.write_text(json.dumps(data))


def equivalents(where: Path, what: str, survivors: list[str]) -> tuple[dict[str, str], list[str]]:
    """({survivor: why it is equivalent}, [stale entries]) from ``k3lab/mutation_equivalent.json``:
    an entry holds while mutmut's diff of that mutant still has its ``change`` line (``+``
    and the line it adds, or ``-`` and the line it removes, stripped)."""
    listed = {e["mutant"]: e for e in json.loads(EQUIVALENT.read_text()).get(what, [])}
    names = [name for name in survivors if name in listed]
    found, stale = {}, []
    for name, diff in zip(names, diffs(where, names)):
        changed = {line[0] + line[1:].strip() for line in diff.splitlines()
                   if line[:1] in "+-" and not line.startswith(("+++", "---"))}
        if listed[name]["change"] in changed:
            found[name] = listed[name]["why"]
        else:
            stale.append(name)
    return found, stale


# mutmut's own diff of each named mutant (what `mutmut show` prints), in one process: a
# `mutmut show` per mutant re-reads every mutated module, tens of seconds each on 2 cores.
_DIFFS = """
import json, sys
from mutmut.__main__ import SourceFileMutationData
from mutmut.mutation.diff_apply import get_diff_for_mutant, walk_mutatable_files
path_of = {}
for path in walk_mutatable_files():
    data = SourceFileMutationData(path=path)
    data.load()
    path_of.update(dict.fromkeys(data.exit_code_by_key, path))
print(json.dumps([get_diff_for_mutant(n, path=path_of[n]) if n in path_of else ""
                  for n in json.load(sys.stdin)]))
"""


def diffs(where: Path, names: list[str]) -> list[str]:
    if not names:
        return []
    out = subprocess.run([PYTHON, "-c", _DIFFS], cwd=where, input=json.dumps(names), text=True,
                         capture_output=True, check=True).stdout
    return json.loads(out.splitlines()[-1])


def report(args: argparse.Namespace, where: Path, what: str, chosen: list[str]) -> None:
    everything = results(where)
    statuses = {name: status for name, status in everything.items() if name in set(chosen)}
    survivors = sorted(name for name, status in statuses.items() if status not in KILLED)
    equivalent, stale = equivalents(where, what, survivors)
    survivors = [name for name in survivors if name not in equivalent]
    tried = len(statuses)
    killed = tried - len(survivors) - len(equivalent)
    score = killed / (tried - len(equivalent)) if tried > len(equivalent) else 0.0
    raw = killed / tried if tried else 0.0
    sample = (f" (a random sample of the {len(everything)} mutants)"
              if len(statuses) < len(everything) else "")
    print(f"mutation score over {what}: {killed}/{tried - len(equivalent)} = {score:.1%} "
          f"({len(equivalent)} equivalent left out; raw {killed}/{tried} = {raw:.1%}){sample}")
    for name in survivors:
        print(f"  {statuses[name]:10s} {name}" + ("  (stale equivalent entry)" if name in stale else ""))
    if args.json:
        args.json.write_text(json.dumps({"target": what, "sample": len(chosen), "seed": args.seed,
                                         "again": args.again, "tried": tried,
                                         "killed": killed, "equivalent": len(equivalent),
                                         "score": score, "raw_score": raw,
                                         "survivors": {n: statuses[n] for n in survivors},
                                         "equivalents": equivalent},
                                        indent=2, ensure_ascii=False) + "\n")

if __name__ == "__main__":
    main()
