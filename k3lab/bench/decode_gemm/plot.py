"""Fraction of the read roof per (shape, M), before and after, from run JSON (matplotlib).

Each panel is a grid: one line per SM90 weight shape (largest weight first), one
column per M = 1..16, the colour the fraction ``roof_us / us`` (1.0 = the time a
read of every byte at the bandwidth measured in that run would take; > 1 is faster
than the reduction that defines the roof). Panels come from the JSON given:

* a sweep JSON (``sweep.py``): cuBLAS and ours, same run;
* optionally ``--today``, a JSON with today's SM90 table timed against cuBLAS
  (``shared/reference/h200/sm90_table_vs_roof_*.json``: another run, so its panel
  is labelled with that run and never mixed into the others); cells the table
  routes to CuTe are marked with a dot;
* or a figures JSON (``runner.py``): cuBLAS, today's table (its CuTe rows as re-timed in
  that run; ``x`` where one was not) and the table rendered from that run, its routed
  backend marked per cell by a letter.

Usage: ``python -m k3lab.bench.decode_gemm.plot RUN.json OUT.png [--today TODAY.json]``.
"""

from __future__ import annotations

import argparse
import json

import matplotlib

from k3lab.bench.decode_gemm import winners

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402

MS = list(range(1, 17))


def _order(shapes):
    return sorted(shapes, key=lambda s: (-s[0] * s[1], s))


def panels_from_sweep(run: dict) -> tuple[list, list]:
    """``(shapes, [(title, grid, marks)])`` for cuBLAS and ours of a sweep run."""
    per = {(s["N"], s["K"]): {p["M"]: p for p in s["per_m"]} for s in run["shapes"]}
    shapes = _order(per)
    rid = run["provenance"]["run_id"]

    def grid(key):
        return np.array([[per[s][m]["roof_us"] / per[s][m][key] if per[s][m].get(key) else np.nan
                          for m in MS] for s in shapes])

    return shapes, [(f"cuBLAS (run {rid})", grid("cublas_us"), None),
                    (f"ours, swap-AB Triton (run {rid})", grid("us"), None)]


def _fill(shapes: list, per: dict, cell) -> tuple:
    """``(grid, marks)``: ``cell(row) -> (fraction, mark or None)`` for every (shape, M)."""
    grid = np.full((len(shapes), len(MS)), np.nan)
    marks = []
    for i, s in enumerate(shapes):
        for j, m in enumerate(MS):
            r = per.get((*s, m))
            if r is not None:
                grid[i, j], mark = cell(r)
                if mark:
                    marks.append((i, j, mark))
    return grid, marks


def panel_today(today: dict, shapes: list) -> tuple:
    """Today's table (best of its CuTe row and cuBLAS) from another run's JSON."""
    per = {(r["N"], r["K"], r["M"]): r for r in today["rows"]}

    def cell(r):
        us = min(r["cublas_us"], r.get("ours_us") or r["cublas_us"])
        return r["roof_us"] / us, "." if r.get("ours_us") else None

    return ("today's table, CuTe rows dotted (reference run, not this one)", *_fill(shapes, per, cell))


def panels_from_figures(run: dict) -> tuple[list, list]:
    """cuBLAS, today's table and the table rendered from one figures run (all that run)."""
    per = {(r["N"], r["K"], r["M"]): r for r in run["rows"] if r.get("roof_us")}
    shapes = _order({k[:2] for k in per})
    rid = run["provenance"]["run_id"]
    cub, _ = _fill(shapes, per, lambda r: (r["roof_us"] / r["cublas_us"][1], None))

    def today(r):
        sp = winners.today_speedup(r)
        if sp is None:  # a CuTe row of today's table this run did not re-time
            return np.nan, "x"
        return r["roof_us"] * sp / r["cublas_us"][1], "C" if r["today"][0] == "cute" else None

    before, before_marks = _fill(shapes, per, today)

    def routed(r):
        w = r.get("winner")
        us = w["us"][1] if w else r["cublas_us"][1]
        return r["roof_us"] / us, winners.LETTER.get(w["backend"], "?") if w else None

    new, marks = _fill(shapes, per, routed)
    return shapes, [(f"before: cuBLAS\n(run {rid})", cub, None),
                    (f"before: today's table, C its CuTe rows\n(x: not re-timed; run {rid})",
                     before, before_marks),
                    (f"after: table rendered from run {rid}\n(S swap-AB, C CuTe, L ll_bf16, "
                     "T tinygemm)", new, marks)]


def draw(shapes: list, panels: list, out: str, note: str) -> None:
    fig, axes = plt.subplots(1, len(panels), figsize=(5.2 * len(panels), 0.32 * len(shapes) + 2.2),
                             sharey=True, squeeze=False)
    labels = [f"{n}x{k} ({2 * n * k / 1e6:.0f} MB)" for n, k in shapes]
    for ax, (title, grid, marks) in zip(axes[0], panels):
        im = ax.imshow(grid, vmin=0.2, vmax=1.1, cmap="viridis", aspect="auto")
        ax.set_title(title, fontsize=8)
        ax.set_xticks(range(len(MS)), MS, fontsize=7)
        ax.set_xlabel("M (tokens)")
        for i, j, ch in marks or ():
            # "x" sits on an empty (white) cell.
            ax.text(j, i, ch, ha="center", va="center", color="black" if ch == "x" else "white",
                    fontsize=6)
        big = [i for i, (n, k) in enumerate(shapes) if 2 * n * k >= 20e6]
        if big:
            ax.axhline(max(big) + 0.5, color="red", lw=0.8)
    axes[0][0].set_yticks(range(len(shapes)), labels, fontsize=7)
    fig.colorbar(im, ax=axes[0].tolist(), shrink=0.8, label="fraction of read roof (roof_us / us)")
    fig.suptitle(note, fontsize=8)
    fig.savefig(out, dpi=110, bbox_inches="tight")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("run")
    ap.add_argument("out")
    ap.add_argument("--today", help="today's table timed in another run (reference JSON)")
    args = ap.parse_args(argv)
    run = json.load(open(args.run))
    if "shapes" in run:
        shapes, panels = panels_from_sweep(run)
        if args.today:
            panels.insert(1, panel_today(json.load(open(args.today)), shapes))
    else:
        shapes, panels = panels_from_figures(run)
    p = run["provenance"]
    note = (f"{p['gpu']}, {p['date']}, torch {p['torch']}, triton {p.get('triton')}; read roof "
            f"{run['read_bw_TBps']} TB/s measured in the run; red line: weights >= 20 MB above it")
    draw(shapes, panels, args.out, note)
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
