"""Benchmark: µs per call of cuBLAS vs our SM90 table vs vLLM v0.29.0's SM90 table.

Not a test: it prints figures and asserts nothing. For every (N, K, M) that
either table routes, in one process and one run it times cuBLAS (``torch.mm``),
our routed backend and v0.29.0's (same kernel: v0.28.0's CuTe skinny GEMM; dsv3
rows only if ``dsv3_build.py`` produced the op) with ``timing.time_us`` (CUDA
graph replay over >= 256 MiB of rotating weight copies, median of 15 replays),
plus the HBM roof ``min_bytes_moved / read bandwidth`` with the bandwidth
measured at the start of the same run.

Geo-mean speedups over cuBLAS are reported two ways: over each table's own
routed rows, and over the union of rows (a table that falls back to cuBLAS on a
row scores 1.0 there). Rows a table routes to dsv3 without a built op are
listed as unmeasured and left out of both geo-means.

Usage: ``python -m k3lab.bench.gemm --ours TABLE.py --v029 priors.json [--tune RESULTS.json]
--json OUT.json --md OUT.md``
"""

from __future__ import annotations

import argparse
import json
import math
import os
import runpy
import sys


from k3lab import shapes as shp
from k3lab.provenance import provenance


def load_ours(path: str) -> tuple[dict, dict]:
    """``({(N, K, M): (backend, cfg)}, PROVENANCE)`` from the data module file."""
    ns = runpy.run_path(path)
    rows = {(n, k, m): (b, tuple(c) if c else None)
            for (n, k), per_m in ns["ROWS"].items() for m, (b, c) in per_m.items()}
    return rows, ns.get("PROVENANCE", {})


def load_v029(path: str) -> dict:
    """v0.29.0's SM90 table as ``{(N, K, M): (backend, cfg)}`` (cute wins over dsv3)."""
    tab = json.load(open(path))["v0.29.0"]["KIMI_K3_PROJECTIONS_SM90"]
    out = {}
    for r in tab:
        for m in r["dsv3"]:
            out[(r["N"], r["K"], int(m))] = ("dsv3_fused_a", None)
        for m, c in r["cute"].items():
            out[(r["N"], r["K"], int(m))] = ("cute", tuple(c))
    return out


def geo(xs):
    xs = [x for x in xs if x]
    return round(math.exp(sum(map(math.log, xs)) / len(xs)), 4) if xs else None


def main(argv=None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--ours", required=True)
    ap.add_argument("--v029", required=True, help="priors JSON from the bundle")
    ap.add_argument("--tune", help="tuner results JSON (adds best-of-tried)")
    ap.add_argument("--json", required=True)
    ap.add_argument("--md", required=True)
    ap.add_argument("--replays", type=int, default=15)
    args = ap.parse_args(argv)

    from k3lab import kernels, timing
    import torch

    ours, ours_prov = load_ours(args.ours)
    v029 = load_v029(args.v029)
    best = {}
    if args.tune and os.path.exists(args.tune):
        for r in json.load(open(args.tune))["rows"]:
            if r.get("best_tried"):
                best[(r["N"], r["K"], r["M"])] = r["best_tried"]
    prov = provenance(os.environ.get("K3_RUN_ID", "bench"))
    bw = timing.read_bandwidth_Bps()
    rot = timing.RotatingWeights(max(shp.weight_bytes(n, k) for n, k in shp.SHAPES))
    dsv3 = kernels.dsv3_fn()
    keys = sorted(set(ours) | set(v029))
    rows = []
    fns = {}

    def fn_for(m, choice):
        backend, cfg = choice
        if backend == "dsv3_fused_a":
            return dsv3
        if (m, cfg) not in fns:
            fns[(m, cfg)] = kernels.cute_fn(m, cfg)
        return fns[(m, cfg)]

    for n, k, m in keys:
        gen = torch.Generator(device="cuda").manual_seed(n * 31 + k * 7 + m)
        xs = [torch.randn(m, k, generator=gen, dtype=torch.bfloat16, device="cuda") for _ in range(4)]
        ws = rot.views(n, k)
        ref = timing.ref64(xs[0], ws[0])
        row = {"N": n, "K": k, "M": m, "label": shp.SHAPES.get((n, k), ("?",))[0],
               "roof_us": round(shp.roof_us(n, k, m, bw), 2)}
        row["cublas_us"] = round(timing.time_us(kernels.cublas, xs, ws, replays=args.replays), 2)
        for tag, table in (("ours", ours), ("v029", v029)):
            choice = table.get((n, k, m))
            if choice is None:
                row[tag] = None
                continue
            ent = {"backend": choice[0], "cfg": list(choice[1]) if choice[1] else None}
            fn = fn_for(m, choice)
            if fn is None:
                ent["status"] = "unmeasured (no dsv3 op)"
            else:
                try:
                    ent["relerr"] = timing.rel_err(fn(xs[0], ws[0]), ref)
                    ent["us"] = round(timing.time_us(fn, xs, ws, replays=args.replays), 2)
                    ent["speedup"] = round(row["cublas_us"] / ent["us"], 4)
                    ent["status"] = "ok"
                except Exception as exc:
                    ent["status"] = f"error: {type(exc).__name__}: {exc}"[:200]
            row[tag] = ent
        if (n, k, m) in best:
            row["tuner_best_tried"] = best[(n, k, m)]
        rows.append(row)
        print(f"[bench] {n}x{k} M{m}: cuBLAS {row['cublas_us']} "
              f"ours {(row['ours'] or {}).get('us')} v029 {(row['v029'] or {}).get('us')}", flush=True)

    def sp(row, tag):
        e = row[tag]
        if e is None:
            return 1.0
        return e.get("speedup")  # None when unmeasured

    measurable = [r for r in rows if sp(r, "ours") is not None and sp(r, "v029") is not None]
    summary = {
        "geomean_ours_own_rows": geo([r["ours"]["speedup"] for r in rows
                                      if r["ours"] and r["ours"].get("speedup")]),
        "geomean_v029_own_rows": geo([r["v029"]["speedup"] for r in rows
                                      if r["v029"] and r["v029"].get("speedup")]),
        "geomean_ours_union": geo([sp(r, "ours") for r in measurable]),
        "geomean_v029_union": geo([sp(r, "v029") for r in measurable]),
        "union_rows": len(measurable),
        "unmeasured_rows": [[r["N"], r["K"], r["M"]] for r in rows if r not in measurable],
        "ours_slower_than_cublas": [[r["N"], r["K"], r["M"]] for r in rows
                                    if r["ours"] and (r["ours"].get("speedup") or 0) < 1.0],
        "eh_proj": {m: (next((r["ours"] for r in rows if (r["N"], r["K"], r["M"]) == (*shp.EH_PROJ, m)),
                             None) or {}).get("speedup")
                    for m in (1, 2)},
    }
    res = {"provenance": prov, "table_provenance": ours_prov, "read_bw_TBps": round(bw / 1e12, 3),
           "method": "CUDA-graph replay, >=256 MiB rotating weights, median of %d replays" % args.replays,
           "rows": rows, "summary": summary}
    with open(args.json, "w") as f:
        json.dump(res, f, indent=1, sort_keys=True)
    with open(args.md, "w") as f:
        f.write(markdown(res))
    print(json.dumps(summary, indent=1))
    return 0


def markdown(res: dict) -> str:
    """Markdown report of a bench JSON: header with provenance, one row per (N, K, M)."""
    p, s = res["provenance"], res["summary"]
    out = [
        f"Measured on {p['gpu']} ({p['date']}, torch {p['torch']}, nvidia-cutlass-dsl "
        f"{p['cutlass_dsl']}, run {p['run_id']}); HBM read bandwidth {res['read_bw_TBps']} TB/s "
        f"measured in the same run. {res['method']}. Times in µs per call; x = speedup over cuBLAS.",
        "",
        f"- Geo-mean speedup over cuBLAS, own routed rows: ours **{s['geomean_ours_own_rows']}x**, "
        f"v0.29.0 SM90 table **{s['geomean_v029_own_rows']}x**.",
        f"- Geo-mean over the union of routed rows ({s['union_rows']} rows; fallback = 1.0): ours "
        f"**{s['geomean_ours_union']}x**, v0.29.0 **{s['geomean_v029_union']}x**.",
        f"- eh_proj 7168x14336: M1 {s['eh_proj'].get(1)}x, M2 {s['eh_proj'].get(2)}x.",
        f"- Routed rows slower than cuBLAS: {s['ours_slower_than_cublas'] or 'none'}; "
        f"unmeasured (dsv3 op not built): {len(s['unmeasured_rows'])}.",
        "",
        "| N x K | proj | M | roof | cuBLAS | ours cfg | ours | x | v0.29 cfg | v0.29 | x | best tried x |",
        "|---|---|--:|--:|--:|---|--:|--:|---|--:|--:|--:|",
    ]

    def cell(e):
        if e is None:
            return ["—", "—", "—"]
        cfg = "dsv3" if e["backend"] == "dsv3_fused_a" else ",".join(
            "-" if v is None else str(v) for v in e["cfg"])
        return [cfg, str(e.get("us", "n/a")), f"{e['speedup']:.3f}" if e.get("speedup") else "n/a"]

    for r in res["rows"]:
        bt = r.get("tuner_best_tried")
        out.append("| " + " | ".join(
            [f"{r['N']}x{r['K']}", r["label"], str(r["M"]), str(r["roof_us"]), str(r["cublas_us"])]
            + cell(r["ours"]) + cell(r["v029"]) + [f"{bt['speedup']:.3f}" if bt else "—"]) + " |")
    return "\n".join(out) + "\n"


if __name__ == "__main__":
    sys.exit(main())
