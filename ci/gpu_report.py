"""The GPU stage's results (``gpu_stage/run.py``'s JSON) as the report's typed parts.

``gpu_run``: its test suites as a ``TestRun`` (key ``gpu``); ``ab_section``: its
ours/upstream/cuBLAS timing as a ``Section`` (key ``ab``), with the rows collapsed.
Times are µs per call, measured by the stage on the GPU named in ``provenance``.
"""

from __future__ import annotations

from ci.table_diff import choice
from k3overlay.stages import COUNTS, Section, TestRun

DETAIL_ROWS = 40  # A/B rows listed in the report; the JSON report has them all


def gpu_run(gpu: dict) -> TestRun:
    """``{"passed", ..., "suites": {name: counts}, "env": {...}}`` or ``{"env_error"}``."""
    run = _run(gpu, "gpu", "gpu tests")
    run.suites = {name: _run(counts, name, name) for name, counts in gpu.get("suites", {}).items()}
    return run


def _run(counts: dict, key: str, name: str) -> TestRun:
    known = {*COUNTS, "env_errors", "env_error", "note", "env", "suites"}
    return TestRun(key, name, *(int(counts.get(k, 0)) for k in COUNTS),
                   env_errors=int(counts.get("env_errors", 0)), env_error=counts.get("env_error", ""),
                   env={k: v for k, v in counts.get("env", {}).items() if isinstance(v, str)},
                   note=counts.get("note", ""),
                   extra={k: v for k, v in counts.items() if k not in known})


def ab_line(ab: dict) -> str:
    """One line: rows, geo-mean speedups over cuBLAS, who wins how often."""
    if ab.get("error"):
        return f"not run: {ab['error']}"
    s = ab["summary"]
    wins = s["wins"]
    return (f"{ab.get('arch', '?')} {s['measured']}/{s['rows']} rows measured; geo-mean x cuBLAS "
            f"ours {s['geomean_ours']} upstream {s['geomean_upstream']} (ours/upstream "
            f"{s['geomean_ours_over_upstream']}); wins ours {wins['ours']}, upstream "
            f"{wins['upstream']}, tie {wins['tie']}"
            + (f" (partial: {ab['partial']})" if ab.get("partial") else ""))


def ab_section(ab: dict) -> Section:
    """The A/B as a section: its line, its provenance and rows (clipped) as details; an
    error when it did not run or a row errored."""
    line = ab_line(ab)
    bad = ab.get("error") or ab.get("summary", {}).get("errors")
    details = []
    if ab.get("provenance"):
        p = ab["provenance"]
        details += [f"Measured on {p.get('gpu')} {p.get('date')}, torch {p.get('torch')}, "
                    f"nvidia-cutlass-dsl {p.get('cutlass_dsl')}; {ab.get('method', '')}", ""]
    # A row the stage never timed (cut at its deadline) has no cuBLAS time: its status.
    rows = [f"| {x['N']}x{x['K']} | {x['M']} | {x.get('cublas_us', x.get('status'))} "
            f"| {choice(x['upstream'])} | {_us(x['upstream'])} | {choice(x['ours'])} "
            f"| {_us(x['ours'])} | {x['winner']} |" for x in ab.get("rows", [])]
    if rows:
        details += ["| N x K | M | cuBLAS µs | upstream | µs | ours | µs | faster |",
                    "|---|--:|--:|---|--:|---|--:|---|", *rows[:DETAIL_ROWS]]
        if len(rows) > DETAIL_ROWS:
            details.append(f"\n{len(rows) - DETAIL_ROWS} more rows in the JSON report's `ab`.")
    return Section("ab", "gpu a/b ours vs upstream vs cuBLAS", [line], ab, "\n".join(details),
                   error=line if bad else "")


def _us(side: dict | None) -> str:
    if side is None:
        return "="
    return str(side.get("us", side.get("status", "n/a")))
