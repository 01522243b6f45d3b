"""Markdown figures of one figures run, against issue 12's targets (pure; no GPU).

``render(results, path) -> str``: a provenance line, the targets table (this run's
routed table against cuBLAS and today's table, both timed in the same run) and one line
per weight shape, every figure read from the JSON (``winners.summary`` and the rows),
so the README's tables can be re-rendered from the committed JSON and checked.

Usage: ``python -m k3lab.bench.decode_gemm.targets RESULTS.json [OUT.md]``.
"""

from __future__ import annotations

import json
import os
import sys

from k3lab.bench.decode_gemm import winners
from k3lab.bench.decode_gemm.winners import LETTER


def _span(xs, fmt: str) -> str:
    xs = [x for x in xs if x is not None]
    if not xs:
        return "-"
    lo, hi = fmt.format(min(xs)), fmt.format(max(xs))
    return lo if lo == hi else f"{lo}-{hi}"


def target_lines(res: dict) -> list[str]:
    """The targets table's lines."""
    s = res["summary"]
    floor = s["trivial_floor_us"]
    slow = s["routed_slower_than_cublas"]
    return [
        "| target (issue 12) | this run's table | before: cuBLAS / today's table (same run) |",
        "|---|--:|--:|",
        f"| weights >= 20 MB at >= 90% of the read roof | {s['ge20MB_at_90pct_roof']} of "
        f"{s['ge20MB_rows']} | {s['before_cublas_ge20MB_at_90pct_roof']} (cuBLAS) |",
        f"| geo-mean vs cuBLAS, all (shape, M) (target 1.5x) | "
        f"{s['geomean_vs_cublas_all_rows']:.3f}x over {s['rows']} | "
        f"{s['before_today_geomean_vs_cublas']:.3f}x (today's table; "
        f"{s['before_today_rows_not_retimed']} rows whose config was not re-timed) |",
        f"| ceiling: geo-mean if every row ran at its roof, no faster than the trivial launch "
        f"| {s['geomean_bound_roof_or_launch']:.3f}x | - |",
        f"| routed rows slower than cuBLAS (target 0) | {len(slow)} | - |",
        f"| weights < 8 MB within 1.2x of a trivial launch ({floor} µs) | "
        f"{s['lt8MB_within_1p2_of_trivial']} of {s['lt8MB_rows']} (worst "
        f"{s['lt8MB_worst_vs_trivial']}x) | - |",
    ]


def per_shape(res: dict) -> list[str]:
    """One line per weight shape, largest first."""
    by: dict = {}
    for r in res["rows"]:
        by.setdefault((r["N"], r["K"]), []).append(r)
    lines = ["| weight N x K | MB | routed (M 1..16) | % of roof, table | % of roof, cuBLAS "
             "| vs cuBLAS | table µs M1 / M16 |", "|---|--:|---|--:|--:|--:|--:|"]
    for (n, k), rows in sorted(by.items(), key=lambda kv: (-kv[0][0] * kv[0][1], kv[0])):
        rows.sort(key=lambda r: r["M"])
        routed = "".join(LETTER.get((r.get("winner") or {}).get("backend"), ".") for r in rows)
        roof = [r["roof_us"] / winners.routed_us(r) * 100 if r.get("roof_us") else None for r in rows]
        cub = [r["roof_us"] / r["cublas_us"][1] * 100 if r.get("roof_us") else None for r in rows]
        sp = [winners.routed_speedup(r) for r in rows]
        ends = f"{winners.routed_us(rows[0]):.2f} / {winners.routed_us(rows[-1]):.2f}"
        lines.append(f"| {n}x{k} | {2 * n * k / 1e6:.1f} | `{routed}` | {_span(roof, '{:.0f}')}% "
                     f"| {_span(cub, '{:.0f}')}% | {_span(sp, '{:.2f}')}x | {ends} |")
    return lines


def render(res: dict, path: str) -> str:
    p = res["provenance"]
    head = (f"Run {p.get('run_id')} ({path}): {p.get('gpu')}, {p.get('date')}, torch "
            f"{p.get('torch')}, Triton {p.get('triton')}, nvidia-cutlass-dsl {p.get('cutlass_dsl')}, "
            f"FlashInfer {p.get('flashinfer')}; read roof {res.get('read_bw_TBps')} TB/s measured "
            f"in the run. Routed: S swap-AB (ours), C CuTe, L ll_bf16, T tinygemm, . cuBLAS.")
    skipped = [f"- skipped `{s['unit']}` ({s.get('phase', '?')}): {s['reason']}"
               for s in res.get("skipped", [])]
    return "\n".join([head, "", *target_lines(res), "", *per_shape(res), "", *skipped]).rstrip() + "\n"


def main(argv: list[str]) -> int:
    res = json.load(open(argv[0]))
    text = render(res, "results/sm90/" + os.path.basename(argv[0]))
    if len(argv) > 1:
        with open(argv[1], "w") as f:
            f.write(text)
    else:
        sys.stdout.write(text)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
