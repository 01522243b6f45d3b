"""Print what the GPU stage measured, one block per target: ``summary.py RESULT.json...``.

Per suite: counts, how long it ran, whether it was cut at its deadline (and how far it
got), its slowest tests; the A/B: rows measured, geo-means, wins. For the runner's log
and the device call's output tail; the JSON files hold everything.

``--compact OUT.json RESULT.json...`` writes the run's summary that git keeps
(``results/gpu_stage/``): per target its tree, the suites' counts and environment, the
A/B's provenance, method and summary, and the rows where ours lost to cuBLAS or upstream
or could not be measured; the per-row timings and per-test records stay with the raw run
(CI artifacts, or ``~/.cache/vllm-k3-overlay/lab/``).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

COUNTS = ("passed", "failed", "skipped", "errors", "env_errors")


def suite_line(name: str, suite: dict) -> str:
    counts = " ".join(f"{suite.get(k, 0)} {k}" for k in COUNTS if suite.get(k) or k == "passed")
    where = f"{suite.get('ran', '?')}" + (f"/{suite['collected']}" if "collected" in suite else "")
    where += " ran"
    if "wall_s" in suite:
        where += (f", {suite['wall_s']} s wall, {suite.get('timing', {}).get('test_s')} s in "
                  f"tests, {suite.get('shards')} shards")
    extra = f"; {suite['note']}" if suite.get("note") else ""
    return f"  {name}: {counts} ({where}){extra}"


def ab_line(ab: dict) -> str:
    if ab.get("error"):
        return f"  a/b: not run: {ab['error']}"
    s = ab.get("summary", {})
    partial = f" (partial: {ab['partial']})" if ab.get("partial") else ""
    return (f"  a/b: {s.get('measured')}/{s.get('rows')} rows measured; geo-mean x cuBLAS ours "
            f"{s.get('geomean_ours')} upstream {s.get('geomean_upstream')} ours/upstream "
            f"{s.get('geomean_ours_over_upstream')}; wins {s.get('wins')}; "
            f"errors {s.get('errors')}{partial}")


def lines(result: dict) -> list[str]:
    gpu, out = result.get("gpu", {}), [f"{result.get('ref')} ({str(result.get('tree_sha'))[:12]})"]
    if gpu.get("env"):
        out.append(f"  env: {gpu['env']}")
    for name, suite in gpu.get("suites", {}).items():
        out.append(suite_line(name, suite))
        for file, counts in suite.get("files", {}).items():
            out.append(suite_line(f"  {Path(file).name}", counts))
        for nodeid, seconds in suite.get("timing", {}).get("slowest", [])[:3]:
            out.append(f"    slow: {seconds} s {nodeid}")
    if "ab" in result:
        out.append(ab_line(result["ab"]))
    return out


SUITE_KEYS = COUNTS + ("collected", "ran", "shards", "wall_s", "note")


def compact(result: dict) -> dict:
    """One target's ``run.py`` result without what only a raw run needs (see the module)."""
    gpu = dict(result.get("gpu", {}))
    gpu["suites"] = {name: {k: v for k, v in suite.items() if k in SUITE_KEYS}
                     for name, suite in gpu.get("suites", {}).items()}
    ab = {k: v for k, v in result.get("ab", {}).items() if k != "rows"}
    notable = [row for row in result.get("ab", {}).get("rows", [])
               if row.get("winner") not in ("ours", "tie")
               or (row.get("ours", {}).get("speedup") or 1.0) < 1.0
               or row.get("ours", {}).get("status") != "ok"]
    if notable:
        ab["notable_rows"] = notable
    return {"ref": result.get("ref"), "tree_sha": result.get("tree_sha"), "gpu": gpu, "ab": ab}


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("results", nargs="+", type=Path)
    parser.add_argument("--compact", type=Path, help="write the summary git keeps here")
    args = parser.parse_args(argv)
    if args.compact:
        targets = [compact(json.loads(p.read_text())) for p in args.results]
        args.compact.write_text(json.dumps({"targets": targets}, indent=1, sort_keys=True) + "\n")
        return 0
    for path in args.results:
        try:
            print("\n".join(lines(json.loads(path.read_text()))))
        except (OSError, ValueError) as exc:
            print(f"{path}: unreadable ({exc})")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
