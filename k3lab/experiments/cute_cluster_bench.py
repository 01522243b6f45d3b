"""Experiment (issue 12): our CuTe DSL cluster split-K GEMM vs our Triton kernel vs cuBLAS (GPU).

Answers, in one H200 run, whether ``cute_cluster.py`` (split-K reduced through a
cluster's DSMEM) beats ``swap_ab_gemm.py`` (split-K through a global workspace and a
counter) on the split-K shapes 1536/3072/2112/768 x 7168 at M = 1, 8, 16. Two phases,
each its own process so a kernel that never ends loses only what follows it:

* ``check``: every CuTe config (``cute_configs``: cluster C in 2/4/8 x three pipelines, at
  the weight rows per cluster of ``rows_for``: grids of about 1 and 2 CTAs per SM) is compiled and run
  once per (shape, M) against float64 (``timing.ref64``, ``timing.rel_err`` <= 1e-2).
  A wrong result is recorded with two diagnostics (its error against rank 0's K slice
  alone, and whether it is finite), never timed. Written after every config.
* ``time``: per shape and M, with ``timing.time_us`` (CUDA graph, rotating weights,
  median of 15 replays, µs per call): cuBLAS, our Triton kernel at the SM90 table's ``swap_ab`` config
  for that shape (the row's own config at that M, else the shape's most common one),
  and every CuTe config the check phase passed. The read roof ``bytes / read_bw``
  uses ``timing.read_bandwidth_Bps()`` measured in the same run. Written after every
  shape; one line printed per shape.

Any exception of one config is recorded under that config and the run goes on; past
``--deadline-s`` the remaining work is listed as skipped. Usage (after the bundle's
``env.sh``)::

    python -m k3lab.experiments.cute_cluster_bench --phase check --out check.json --deadline-s 50
    python -m k3lab.experiments.cute_cluster_bench --phase time --checked check.json \\
        --out bench.json --deadline-s 80
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import runpy
import sys
import time
from typing import Callable

from k3lab import paths, shapes, tiles

SM90_TABLE = str(paths.SM90_TABLE)

SHAPES = ((1536, 7168), (3072, 7168), (2112, 7168), (768, 7168))
TOKENS = (1, 8, 16)
CLUSTERS = (2, 4, 8)
# (tile_k, stages): 48-80 KiB of weight in flight per CTA in 16 KiB or 8 KiB steps.
PIPELINES = ((128, 4), (128, 6), (64, 8))
REL_TOL = 1e-2
REPLAYS = 15


def parse_args(argv=None) -> argparse.Namespace:
    """Command line; ``--checked`` is required for ``--phase time``."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--phase", choices=("check", "time"), required=True)
    ap.add_argument("--out", required=True, help="JSON written after every unit")
    ap.add_argument("--checked", help="the check phase's JSON (phase time)")
    ap.add_argument("--deadline-s", type=float, required=True,
                    help="stop starting new work this many seconds after start")
    ap.add_argument("--run-id", default=os.environ.get("K3_RUN_ID", "local"))
    args = ap.parse_args(argv)
    if args.phase == "time" and not args.checked:
        ap.error("--phase time needs --checked (the check phase's JSON)")
    if args.deadline_s <= 0:
        ap.error(f"--deadline-s must be positive, got {args.deadline_s}")
    return args


def cute_configs() -> list[tuple[int, int, int, bool]]:
    """``(cluster, stages, tile_k, pdl)`` of every CuTe config tried, in order."""
    return [(c, s, tk, True) for c in CLUSTERS for tk, s in PIPELINES]


def rows_for(n: int, cluster: int) -> list[int]:
    """Weight rows per cluster (<= 64) that put ``ceil(n / rows) x cluster`` CTAs at about
    1 and 2 per SM (the 64-row tile when it already gives that many), distinct, ascending."""
    out = set()
    for per_sm in (1, 2):
        clusters = max(1, per_sm * tiles.SMS // cluster)
        out.add(min(64, -(-n // clusters)))
    return sorted(out)


def triton_config(rows_by_m: dict, m: int) -> tuple | None:
    """The swap-AB config for M = ``m`` from one shape's SM90 table rows ``{M: (backend, cfg)}``.

    The row's own config when it routes ``swap_ab``; else the shape's most common
    ``swap_ab`` config (ties: the one at the M nearest ``m``); None if the shape has none.
    """
    own = rows_by_m.get(m)
    if own and own[0] == "swap_ab":
        return tuple(own[1])
    ours = {mm: tuple(cfg) for mm, (backend, cfg) in rows_by_m.items() if backend == "swap_ab"}
    if not ours:
        return None
    counts = collections.Counter(ours.values())
    top = max(counts.values())
    return min((abs(mm - m), mm, cfg) for mm, cfg in ours.items() if counts[cfg] == top)[2]


def passed(checked: dict) -> set[tuple]:
    """``(N, K, M, cluster, stages, tile_k, pdl, rows)`` the check phase found correct."""
    return {(r["N"], r["K"], r["M"], r["cluster"], r["stages"], r["tile_k"], r["pdl"], r["rows"])
            for r in checked.get("checks", []) if r.get("status") == "ok"}


def write_json(path: str, data: dict) -> None:
    """Write ``data`` whole (temporary file, then rename): a reader never sees half a file."""
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        json.dump(data, f, indent=1, sort_keys=True)
        f.write("\n")
    os.replace(tmp, path)


def run_units(units: list, work: Callable, res: dict, key: str, out: str,
              deadline: float, clock: Callable[[], float] = time.monotonic) -> None:
    """``res[key] += work(unit)`` for each unit, writing ``out`` after every one.

    A unit that raises is recorded as ``{"unit", "status": "error", "error"}`` and the
    next one runs; units left when ``clock()`` passes ``deadline`` go to ``res["skipped"]``.
    """
    for i, unit in enumerate(units):
        if clock() > deadline:
            res.setdefault("skipped", []).extend(
                {"unit": str(u), "reason": "deadline"} for u in units[i:])
            break
        try:
            res[key].extend(work(unit))
        except Exception as exc:  # one unit's failure is a result, not the end of the run
            res[key].append({"unit": str(unit), "status": "error",
                             "error": f"{type(exc).__name__}: {exc}"[:500]})
        write_json(out, res)
    write_json(out, res)


def _provenance(run_id: str) -> dict:
    import importlib.metadata as md

    from k3lab.bench.decode_gemm import sweep

    p = sweep.provenance(run_id)
    try:
        p["cutlass_dsl"] = md.version("nvidia-cutlass-dsl")
    except md.PackageNotFoundError:
        p["cutlass_dsl"] = "absent"
    p["tool"] = "k3lab/experiments/cute_cluster_bench.py"
    return p


def _check_config(cfg: tuple[int, int, int, bool]) -> list[dict]:
    """Compile one CuTe config and run it once on every (shape, M) against float64."""
    from k3lab import timing
    from k3lab.experiments import cute_cluster as cc
    import torch

    c, stages, tile_k, pdl = cfg
    t = time.time()
    cc.compiled(cc.ClusterConfig(*cfg))  # counted apart from the checks
    compile_s = round(time.time() - t, 2)
    rows = []
    gen = torch.Generator(device="cuda").manual_seed(c * 10 + stages)
    for n, k in SHAPES:
        w = torch.randn(n, k, generator=gen, dtype=torch.bfloat16, device="cuda")
        for m, rows_ in ((m, r) for m in TOKENS for r in rows_for(n, c)):
            row = {"N": n, "K": k, "M": m, "cluster": c, "stages": stages, "tile_k": tile_k,
                   "pdl": pdl, "rows": rows_, "compile_s": compile_s}
            x = torch.randn(m, k, generator=gen, dtype=torch.bfloat16, device="cuda")
            try:
                y = cc.cluster_splitk_gemm(x, w, *cfg, rows=rows_)
                torch.cuda.synchronize()
                err = timing.rel_err(y, timing.ref64(x, w))
                row.update(relerr=err, status="ok" if err <= REL_TOL else "wrong")
                if err > REL_TOL:  # which part went wrong: the reduction, or rank 0's own slice?
                    ks = k // c
                    row["relerr_vs_rank0_slice"] = timing.rel_err(y, timing.ref64(x[:, :ks], w[:, :ks]))
                    row["finite"] = bool(torch.isfinite(y).all())
            except Exception as exc:
                row.update(status="error", error=f"{type(exc).__name__}: {exc}"[:500])
            rows.append(row)
    print(f"[check] {cfg}: compile {compile_s} s, "
          + " ".join(f"{r['N']}x{r['K']}/M{r['M']}:{r['status']}" for r in rows), flush=True)
    return rows


def _time_shape(shape, ok: set, rot, read_bw: float, sm90_rows: dict) -> list[dict]:
    """Every backend at every M of one shape; one printed line."""
    from k3lab import candidates, timing
    from k3lab.experiments import cute_cluster as cc
    import torch

    n, k = shape
    ws = rot.views(n, k)
    rows = []
    for m in TOKENS:
        xs = [torch.randn(m, k, dtype=torch.bfloat16, device="cuda") for _ in range(4)]
        row = {"N": n, "K": k, "M": m, "roof_us": round(shapes.roof_us(n, k, m, read_bw), 3),
               "backends": []}
        tcfg = triton_config(sm90_rows.get((n, k), {}), m)
        # (backend, cfg, make): make() builds the callable inside the try below, so a
        # backend that cannot even load is recorded like any other failure.
        entries = [("cublas", None, lambda: candidates.cublas)]
        if tcfg is not None:
            entries.append(("swap_ab", list(tcfg), lambda t=tcfg: candidates.swap_ab(t)))
        for cfg in cute_configs():
            for r in rows_for(n, cfg[0]):
                if (n, k, m, *cfg, r) in ok:
                    entries.append(("cute_cluster", [*cfg, r], lambda cfg=cfg, r=r: (
                        lambda x, w: cc.cluster_splitk_gemm(x, w, *cfg, rows=r))))
        for backend, cfg, make in entries:
            b = {"backend": backend, "cfg": cfg}
            try:
                fn = make()
                if backend != "cute_cluster":  # the CuTe configs were checked in their own phase
                    err = timing.rel_err(fn(xs[0], ws[0]), timing.ref64(xs[0], ws[0]))
                    b["relerr"] = err
                    if err > REL_TOL:
                        b["status"] = "wrong"
                        row["backends"].append(b)
                        continue
                b["us"] = round(timing.time_us(fn, xs, ws, replays=REPLAYS), 3)
                b["status"] = "ok"
            except Exception as exc:
                b.update(status="error", error=f"{type(exc).__name__}: {exc}"[:500])
            row["backends"].append(b)
        rows.append(row)
    print(summary_line(rows), flush=True)
    return rows


def summary_line(rows: list[dict]) -> str:
    """``NxK  M1: cuBLAS a / swap_ab b / cute c (C, stages) / roof r µs  M8: ...``."""
    parts = []
    for r in rows:
        def best(name):
            ok = [b for b in r["backends"] if b["backend"] == name and b.get("status") == "ok"]
            return min(ok, key=lambda b: b["us"]) if ok else None
        cb, sab, cute = best("cublas"), best("swap_ab"), best("cute_cluster")
        fmt = lambda b: "-" if b is None else f"{b['us']:.2f}"  # noqa: E731
        cute_s = "-" if cute is None else f"{cute['us']:.2f} {tuple(cute['cfg'])}"
        parts.append(f"M{r['M']}: cuBLAS {fmt(cb)} / swap_ab {fmt(sab)} / cute {cute_s}"
                     f" / roof {r['roof_us']:.2f}")
    head = f"{rows[0]['N']}x{rows[0]['K']}" if rows else "?"
    return f"[time] {head} µs  " + "  ".join(parts)


def main(argv=None) -> int:
    args = parse_args(argv)
    start = time.monotonic()
    deadline = start + args.deadline_s
    res = {"provenance": _provenance(args.run_id), "phase": args.phase,
           "method": {"rel_tol": REL_TOL, "timing": "k3lab/timing.py time_us: CUDA graph >= 12"
                      " calls, >= 256 MiB rotating weights, median of 15 replays"},
           "skipped": []}
    write_json(args.out, res)  # on disk before the first kernel runs
    if args.phase == "check":
        res["checks"] = []
        run_units(cute_configs(), _check_config, res, "checks", args.out, deadline)
    else:
        from k3lab import timing

        try:
            with open(args.checked) as f:
                ok = passed(json.load(f))
        except (OSError, ValueError) as exc:  # no check phase result: time the baselines only
            res["checked_error"] = f"{type(exc).__name__}: {exc}"
            ok = set()
        sm90_rows = runpy.run_path(SM90_TABLE)["ROWS"]
        bw = timing.read_bandwidth_Bps()
        res["read_bw_TBps"] = round(bw / 1e12, 4)
        rot = timing.RotatingWeights(max(shapes.weight_bytes(n, k) for n, k in SHAPES))
        res["rows"] = []
        run_units(list(SHAPES), lambda s: _time_shape(s, ok, rot, bw, sm90_rows),
                  res, "rows", args.out, deadline)
    res["wall_s"] = round(time.monotonic() - start, 1)
    write_json(args.out, res)
    return 0


if __name__ == "__main__":
    sys.exit(main())
