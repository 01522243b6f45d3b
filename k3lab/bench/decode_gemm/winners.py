"""Pick each (shape, M)'s backend from a figures run (pure; no GPU).

A row's candidates are every backend timed in both passes of that run; a candidate
wins only if it beat cuBLAS (timed alongside, in the same pass and process: the row's
``cublas_us``, or the candidate's own where a later phase of the run timed it, see
``phases.merge``) by >= ``WIN`` in pass 1 *and* pass 2, and among those the smallest
mean ``us / cublas_us`` wins, the same rule as the CuTe tuner (``k3lab/aggregate.py``),
except that a backend which is not PDL-aware is charged ``chain_penalty_us`` on top of
its time alone: in a decode step it sits between PDL-aware kernels, and there it costs
more than alone (:data:`CHAIN_PENALTY_US`).
The output rows have the tuner's shape (``status``, ``winner.backend/cfg/us/speedup``),
so ``render_table.py`` renders either.

Also here: the order in which a figures run re-times today's CuTe rows
(:func:`cute_queue`), ranked from earlier runs' figures, most promising against ours first.
"""

from __future__ import annotations

import math

WIN = 1.05

#: The letter each backend is marked with in the figures' text (``targets``) and plots
#: (``plot``): one map, so a figure and its table never disagree.
LETTER = {"swap_ab": "S", "cute": "C", "ll_bf16": "L", "tinygemm": "T", "dsv3_fused_a": "D",
          "skinny_pdl": "G", "gemv_pdl": "V"}

#: Backends whose kernels launch with PDL and start their weight stream before
#: ``griddepcontrol.wait`` (our swap-AB prefetches it into L2; our GEMV-style
#: ``skinny_pdl`` loads its first chunk and ``gemv_pdl`` its CTA's weight slice, issue 28);
#: the others (vLLM's CuTe skinny GEMM, FlashInfer's tinygemm, ll_bf16, dsv3) end the
#: overlap of the chain they sit in.
PDL_AWARE = frozenset({"swap_ab", "skinny_pdl", "gemv_pdl"})

#: µs charged to a non-PDL-aware candidate when rows are decided. Source: the decode-step
#: replays of 2026-12-02 on the H200 (results/decode_step/decode_step_2026-12-02_{alone,
#: chain}.json): the patched model's step with the table decided alone ran up to 18.7 µs
#: slower (MTP, M = 3) than with CuTe and tinygemm rows whose lead alone was under 3 µs
#: given to swap-AB, and never more than 0.5 µs faster; the eh_proj row left on CuTe at
#: M = 1 (3.49 µs ahead alone) still cost the MTP step 12 µs against swap-AB. 4 µs moves
#: every row of a decoder layer's shapes and keeps CuTe only where it leads by more.
CHAIN_PENALTY_US = 4.0


def _geo(xs):
    xs = [x for x in xs if x and x > 0]
    return math.exp(sum(map(math.log, xs)) / len(xs)) if xs else None


def winner(row: dict, chain_penalty_us: float = CHAIN_PENALTY_US) -> dict | None:
    """The row's winner ``{backend, cfg, us, speedup, relerr}``, or None (cuBLAS); a
    backend outside :data:`PDL_AWARE` is ranked at its µs + ``chain_penalty_us``."""
    best = None
    for cand in row["candidates"]:
        c1, c2 = cand.get("cublas_us") or row["cublas_us"]
        u1, u2 = cand["us"]
        if not (u1 and u2 and c1 and c2) or cand.get("status") != "ok":
            continue
        s1, s2 = c1 / u1, c2 / u2
        if s1 < WIN or s2 < WIN:
            continue
        extra = 0.0 if cand["backend"] in PDL_AWARE else chain_penalty_us
        key = (((u1 + extra) / c1 + (u2 + extra) / c2) / 2, cand["backend"], str(cand["cfg"]))
        if best is None or key < best[0]:
            best = (key, cand, s1, s2)
    if best is None:
        return None
    _, cand, s1, s2 = best
    return {
        "backend": cand["backend"], "cfg": cand["cfg"], "us": list(cand["us"]),
        "speedup": [round(s1, 4), round(s2, 4)], "relerr": cand.get("relerr"),
    }


def decide(results: dict, chain_penalty_us: float = CHAIN_PENALTY_US) -> dict:
    """``results`` with ``status``/``winner`` set on every row and a ``summary``; the
    penalty used is recorded in ``criteria.chain_penalty_us``."""
    results.setdefault("criteria", {})["chain_penalty_us"] = chain_penalty_us
    for row in results["rows"]:
        row["winner"] = winner(row, chain_penalty_us)
        row["status"] = "routed" if row["winner"] else "cublas"
    results["summary"] = summary(results)
    return results


def fastest(row: dict, backend: str, pass_: int = 1) -> float | None:
    """Fastest time of ``backend`` in pass ``pass_`` (1 or 2) on this row, µs."""
    ts = [c["us"][pass_ - 1] for c in row["candidates"]
          if c["backend"] == backend and c.get("status") == "ok" and c["us"][pass_ - 1]]
    return min(ts) if ts else None


def routed_us(row: dict) -> float:
    """µs of what the table runs on this row in pass 2 (cuBLAS when nothing won)."""
    w = row.get("winner")
    return w["us"][1] if w else row["cublas_us"][1]


def routed_speedup(row: dict) -> float:
    """Pass-2 speedup over cuBLAS of what the table runs on this row (1.0: cuBLAS)."""
    w = row.get("winner")
    return w["speedup"][1] if w else 1.0


def today_speedup(row: dict) -> float | None:
    """Speedup over cuBLAS of today's table on this row in this run (1.0: cuBLAS row).

    A routed row counts only where its very backend and config were re-timed here (pass 2,
    else pass 1, each against the cuBLAS of its own pass); None where they were not.
    """
    backend, cfg = row.get("today") or ("cublas", None)
    if backend == "cublas":
        return 1.0
    for cand in row["candidates"]:
        if cand["backend"] == backend and cand["cfg"] == cfg and cand.get("status") == "ok":
            cub = cand.get("cublas_us") or row["cublas_us"]
            for p in (1, 0):
                if cand["us"][p] and cub[p]:
                    return cub[p] / cand["us"][p]
    return None


def summary(results: dict) -> dict:
    """Targets of issue 12 over the run's rows, each from this run's figures alone."""
    rows = [r for r in results["rows"] if all(r["cublas_us"])]
    big = [r for r in rows if r["weight_bytes"] >= 20e6 and r.get("roof_us")]
    small = [r for r in rows if r["weight_bytes"] < 8e6]
    floor = min(results["trivial_us"].values()) if results.get("trivial_us") else None
    frac = {id(r): r["roof_us"] / routed_us(r) for r in big}
    backends = sorted({c["backend"] for r in rows for c in r["candidates"]})
    return {
        "rows": len(rows),
        "timed_by_backend": {b: sum(1 for r in rows if fastest(r, b, 1)) for b in backends},
        "routed_by_backend": {b: sum(1 for r in rows if (r["winner"] or {}).get("backend") == b)
                              for b in backends},
        "geomean_vs_cublas_all_rows": _round(_geo([routed_speedup(r) for r in rows])),
        "geomean_vs_cublas_swap_ab_all_rows": _round(_geo(
            [r["cublas_us"][1] / fastest(r, "swap_ab", 2) for r in rows if fastest(r, "swap_ab", 2)])),
        "before_cublas_ge20MB_at_90pct_roof": sum(
            1 for r in big if r["roof_us"] / r["cublas_us"][1] >= 0.9),
        "before_today_geomean_vs_cublas": _round(_geo(
            [today_speedup(r) for r in rows if today_speedup(r)])),
        "before_today_rows_not_retimed": sum(1 for r in rows if today_speedup(r) is None),
        # What the geo-mean would be if every row ran at its read roof, but no faster than
        # the trivial launch: the ceiling the 1.5x target is measured against.
        "geomean_bound_roof_or_launch": floor and _round(_geo(
            [r["cublas_us"][1] / max(r["roof_us"], floor) for r in rows if r.get("roof_us")])),
        "ge20MB_rows": len(big),
        "ge20MB_at_90pct_roof": sum(1 for r in big if frac[id(r)] >= 0.9),
        "ge20MB_below_90pct": [[r["N"], r["K"], r["M"], round(frac[id(r)], 3)]
                               for r in big if frac[id(r)] < 0.9],
        "routed_slower_than_cublas": [[r["N"], r["K"], r["M"]] for r in rows
                                      if r["winner"] and min(r["winner"]["speedup"]) < 1.0],
        "trivial_floor_us": floor,
        "lt8MB_rows": len(small),
        "lt8MB_within_1p2_of_trivial": floor and sum(1 for r in small
                                                     if routed_us(r) <= 1.2 * floor),
        "lt8MB_worst_vs_trivial": floor and _round(max((routed_us(r) / floor for r in small),
                                                       default=None)),
    }


def _round(x):
    return None if x is None else round(x, 4)


def cute_queue(table_rows: dict, tune: dict, sweep: dict) -> list:
    """Every CuTe row of today's table, most promising against ours first.

    ``table_rows``: today's SM90 ``ROWS``; ``tune``: the tuner JSON(s') rows that
    measured them; ``sweep``: our sweep JSON. A row's ratio is its CuTe time (tuner pass
    2, scaled by the ratio of the two runs' cuBLAS times) over ours (sweep); a row our
    sweep lacks (a shape added since) is ranked as if ours ran at cuBLAS's time (ratio =
    1 / the tuner's speedup), one no tuner JSON given has ratio None and comes last. Returns
    ``[(N, K, M, cfg, ratio)]``: the order a run's compile budget spends itself in,
    never a measurement of its own.
    """
    ours, cub_s = {}, {}
    for s in sweep["shapes"]:
        for p in s["per_m"]:
            ours[(s["N"], s["K"], p["M"])] = p.get("us")
            cub_s[(s["N"], s["K"], p["M"])] = p["cublas_us"]
    tuned = {(r["N"], r["K"], r["M"]): r for r in tune["rows"]}
    out = []
    for (n, k), per_m in table_rows.items():
        for m, (backend, cfg) in per_m.items():
            if backend != "cute":
                continue
            r, key = tuned.get((n, k, m)), (n, k, m)
            ratio = None
            if r and r.get("winner") and ours.get(key):
                ratio = round(r["winner"]["us"][1] * cub_s[key] / r["cublas_us"][1] / ours[key], 4)
            elif r and r.get("winner"):
                ratio = round(r["winner"]["us"][1] / r["cublas_us"][1], 4)
            out.append((n, k, m, tuple(cfg), ratio))
    return sorted(out, key=lambda t: (t[4] is None, t[4] or 0.0, t[:3]))


def main(argv: list[str] | None = None) -> int:
    """``python -m k3lab.bench.decode_gemm.winners RUN.json [--chain-penalty-us P]``:
    decide a figures run's rows again (its timings untouched) and write it back."""
    import argparse
    import json
    import pathlib

    ap = argparse.ArgumentParser(prog="python -m k3lab.bench.decode_gemm.winners",
                                 description="Decide every row of a figures run again; "
                                 "RUN.json is rewritten in place.")
    ap.add_argument("run", type=pathlib.Path)
    ap.add_argument("--chain-penalty-us", type=float, default=CHAIN_PENALTY_US)
    args = ap.parse_args(argv)
    run = decide(json.loads(args.run.read_text()), args.chain_penalty_us)
    # Compact, keys sorted: the form results/ keeps runs in (its 2 MB budget).
    args.run.write_text(json.dumps(run, separators=(",", ":"), sort_keys=True) + "\n")
    print(json.dumps(run["summary"]["routed_by_backend"]))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
