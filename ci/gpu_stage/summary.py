"""Print what the GPU stage measured, one block per target: ``summary.py RESULT.json...``.

Per suite: counts, how long it ran, whether it was cut at its deadline (and how far it
got), its slowest tests; the A/B: rows measured, geo-means, wins. For the runner's log
and the device call's output tail; the JSON files hold everything.
"""

from __future__ import annotations

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


def main(argv: list[str]) -> int:
    for path in argv:
        try:
            print("\n".join(lines(json.loads(Path(path).read_text()))))
        except (OSError, ValueError) as exc:
            print(f"{path}: unreadable ({exc})")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
