"""Turn tuner cache records into the run's results JSON (pure; no GPU needed).

Per (shape, M) the winner is the backend whose speedup over cuBLAS
(``cublas_us / us``, both timed in the same pass) is >= ``WIN`` in pass 1 and
again in pass 2, with the smallest mean normalised time ``us / cublas_us`` over
the two passes. ``best_tried`` is the fastest pass-1 measurement of anything
(so ``winner_vs_best`` checks the ">= 0.98x of the best tried" target).

``tune.py`` calls :func:`build` at the end of a run and writes the whole JSON, every
timing included (the raw run). What git keeps of it (``results/sm90/tune_*.json``) is
:func:`summary_of` that JSON, which this command re-creates from the run's cache on any
machine (the provenance is another JSON of the same run, e.g. the benchmark's; the read
bandwidth is the tuner's logged figure; ``--measurements`` keeps the timings)::

    python -m k3lab.aggregate CACHE_DIR --provenance-of SAME_RUN.json --bw-tbps 4.21 \
        --shape 6144x7168 --shape 144x7168 --out results.json
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from collections import defaultdict

from k3lab import tune_cache
from k3lab import shapes as shp

WIN = 1.05
TAGS = ("cublas", "done", "done2", "skip")


def _geo(xs):
    xs = [x for x in xs if x and x > 0]
    return math.exp(sum(map(math.log, xs)) / len(xs)) if xs else None


def build(records: list[dict], prov: dict, bw_Bps: float, sel, ms) -> dict:
    """Results dict: ``provenance``, ``read_bw_TBps``, ``rows``, ``summary``, ``measurements``."""
    by = defaultdict(dict)
    for r in records:
        cfg = r["cfg"]
        key = tuple(cfg) if isinstance(cfg, list) else cfg
        by[(r["N"], r["K"], r["M"])][(key, r["pass"])] = r
    rows = []
    for n, k in sel:
        label, layout = shp.SHAPES.get((n, k), ("", ""))
        for m in ms:
            recs = by.get((n, k, m), {})
            row = {
                "N": n, "K": k, "M": m, "label": label, "layout": layout,
                "roof_us": round(shp.roof_us(n, k, m, bw_Bps), 3),
            }
            c1, c2 = recs.get(("cublas", 1), {}), recs.get(("cublas", 2), {})
            row["cublas_us"] = [c1.get("us"), c2.get("us")]
            ok1 = {c: r for (c, p), r in recs.items()
                   if p == 1 and c not in TAGS and r.get("status") == "ok"}
            row["tried"] = sum(1 for (c, p) in recs if p == 1 and c not in TAGS)
            row["errors"] = sum(1 for (c, p), r in recs.items()
                                if p == 1 and c not in TAGS and r.get("status") != "ok")
            if ok1 and c1.get("us"):
                bc = min(ok1, key=lambda c: ok1[c]["us"])
                best_us = min(ok1[bc]["us"], c1["us"])
                row["best_tried"] = {
                    "backend": "cublas" if c1["us"] <= ok1[bc]["us"] else _backend(bc),
                    "cfg": _cfg(bc) if c1["us"] > ok1[bc]["us"] else None,
                    "us": best_us,
                    "speedup": round(c1["us"] / best_us, 4),
                }
            winner = None
            if c1.get("us") and c2.get("us"):
                cands = []
                for c, r1 in ok1.items():
                    r2 = recs.get((c, 2), {})
                    if r2.get("status") != "ok":
                        continue
                    s1, s2 = c1["us"] / r1["us"], c2["us"] / r2["us"]
                    if s1 >= WIN and s2 >= WIN:
                        cands.append(((1 / s1 + 1 / s2) / 2, c, r1, r2, s1, s2))
                if cands:
                    _, c, r1, r2, s1, s2 = min(cands, key=lambda t: (t[0], str(t[1])))
                    winner = {
                        "backend": _backend(c), "cfg": _cfg(c),
                        "us": [r1["us"], r2["us"]],
                        "speedup": [round(s1, 4), round(s2, 4)],
                        "relerr": r1.get("relerr"),
                    }
                    bt = row.get("best_tried")
                    if bt:
                        row["winner_vs_best"] = round(bt["us"] / r1["us"], 4)
            row["winner"] = winner
            if ("skip", 1) in recs:
                row["status"] = "skipped"
                row["reason"] = recs[("skip", 1)].get("reason")
            elif ("done2", 2) not in recs:
                row["status"] = "incomplete"
            else:
                row["status"] = "routed" if winner else "cublas"
            rows.append(row)
    routed = [r for r in rows if r["status"] == "routed"]
    counts = defaultdict(int)
    for r in rows:
        counts[r["status"]] += 1
    eh = {r["M"]: r["winner"]["speedup"] if r["winner"] else None
          for r in rows if (r["N"], r["K"]) == shp.EH_PROJ and r["M"] in (1, 2)}
    summary = {
        "rows": len(rows),
        "status_counts": dict(sorted(counts.items())),
        "geomean_speedup_routed_pass2": _round(_geo([r["winner"]["speedup"][1] for r in routed])),
        "timings": sum(1 for r in records if r.get("status") == "ok"),
        "eh_proj_speedup": eh,
    }
    meas = sorted(
        ([r["N"], r["K"], r["M"], r["cfg"], r["pass"], r.get("us"), r.get("relerr"),
          r.get("status")] for r in records if r["cfg"] not in TAGS[1:]),
        key=lambda v: json.dumps(v),
    )
    return {
        "provenance": prov,
        "read_bw_TBps": round(bw_Bps / 1e12, 3),
        "criteria": {"win_both_passes": WIN, "pass1_replays": 7, "pass2_replays": 15,
                     "rotate_bytes": 256 << 20},
        "rows": rows,
        "summary": summary,
        "measurements_columns": ["N", "K", "M", "cfg", "pass", "us", "relerr", "status"],
        "measurements": meas,
    }


def summary_of(res: dict) -> dict:
    """``res`` without its ``measurements``: what git keeps of a tuner run (its rows,
    summary, criteria and provenance); the timings stay in the run's cache."""
    return {k: v for k, v in res.items() if k not in ("measurements", "measurements_columns")}


def _round(x):
    return None if x is None else round(x, 4)


def _backend(c):
    return "dsv3_fused_a" if c == "dsv3" else "cute"


def _cfg(c):
    return None if c == "dsv3" else list(c)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description="Rebuild a tuner run's results JSON from its cache.")
    ap.add_argument("cache", help="the run's cache folder (tune.py --cache)")
    ap.add_argument("--provenance-of", required=True,
                    help="a JSON of the same run whose 'provenance' to take (GPU, date, versions)")
    ap.add_argument("--bw-tbps", type=float, required=True, help="the run's read bandwidth, TB/s")
    ap.add_argument("--shape", action="append", required=True, type=shp.parse, help="NxK")
    ap.add_argument("--m", default="1-16")
    ap.add_argument("--out", required=True)
    ap.add_argument("--measurements", action="store_true",
                    help="keep every timing (the raw run); without it, the summary git keeps")
    args = ap.parse_args(argv)
    lo, hi = map(int, args.m.split("-"))
    with open(args.provenance_of) as f:
        prov = dict(json.load(f)["provenance"])
    prov["rebuilt"] = (f"results JSON rebuilt from the run's cache by python -m k3lab.aggregate "
                       f"(read bandwidth {args.bw_tbps} TB/s as the tuner logged it)")
    records = list(tune_cache.read_all(args.cache, prov["gpu"]))
    res = build(records, prov, args.bw_tbps * 1e12, args.shape, list(range(lo, hi + 1)))
    if not args.measurements:
        res = summary_of(res)
    with open(args.out, "w") as f:
        json.dump(res, f, indent=1, sort_keys=True)
    print(f"wrote {args.out}: {res['summary']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
