"""Issue 28, item 1: the PDL-aware skinny GEMMs on every SM90 shape at M <= 4, alone and in a chain.

Two families of ours are swept (``--families``): ``skinny_pdl`` (Triton) and ``gemv_pdl``
(CuTe DSL, weight slice loaded before the wait); what is said of "skinny" below holds for
each family.

One GPU run (about 4 minutes on an H200 with the lab's bundle installed and the overlay
copied over it: ``k3lab/device/run.sh skinny``) that answers the issue's two targets:

* **alone**: for every SM90 table shape at each M of ``--m`` (1, 2, 3, 4 by default),
  ``skinny_pdl`` at every config of ``skinny_pdl_gemm.sweep_configs`` (pass 1), the
  table's current pick through the public dispatch ``try_low_latency_gemm`` (cuBLAS where
  it routes nothing), vLLM's CuTe skinny GEMM at the best config an earlier figures run
  timed for that (shape, M) (``--figures``; compiled until ``--cute-budget-s`` is spent,
  M = 1 first) and ``torch.mm``; then pass 2 on fresh activations re-times cuBLAS, the
  best skinny config, the table's pick and CuTe. Timing is ``k3lab.timing.time_us``
  (a CUDA graph of >= 12 calls over >= 256 MiB of weight copies, median of replays),
  every output first checked against float64 (rel. err <= 1e-2). The read roof of the
  same run: ``k3lab.timing.read_bandwidth_Bps``.
* **chain**: the table's shapes of <= ``--chain-max-mb`` MB (23 on the H200), each once,
  back to back in one CUDA graph (``k3lab.timing.graph_replay_us``, ``--chain-passes``
  chains per graph, about 0.7 GB each so L2 keeps nothing between them), at each M, as
  (a) ``table``: the dispatch as shipped; (a') ``alone``: the table with CuTe wherever
  CuTe was faster alone in this run (the decision without the chain penalty);
  (b) ``skinny_where_faster``: the table with ``skinny_pdl`` (its best config) wherever it
  was faster alone than the table's pick; (b') ``skinny_everywhere``; (c) ``cublas``. The
  approach of ``reference/h200/scripts/decode_chain_bench.py``, with this lab's timing.

Output: ``$OUT/skinny_pdl_sweep_sm90.json`` (``--out``), a figures-run JSON: ``rows`` in
the form ``k3lab/bench/decode_gemm/winners.py`` decides and ``k3lab/render_table.py``
renders (``--add FILE``: the run says ``"covers": "rows"``, so only its (shape, M) replace
the table's, the other M of a shape stay), already decided with the default chain penalty
(``skinny_pdl`` is PDL-aware, so it pays none); ``chain`` with the figures above; and
``provenance``. The JSON is rewritten after every shape, so a run cut short keeps what it
did. A short table is printed last.

Usage (on the GPU machine, the bundle's env sourced)::

    python -m k3lab.bench.skinny_pdl_sweep --out $OUT --figures results/sm90/decode_gemm_sm90.json
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import statistics
import sys
import time

from k3lab import shapes as shp

SK_MODULE = "vllm.models.kimi_k3.nvidia.skinny_pdl_gemm"
GV_MODULE = "vllm.models.kimi_k3.nvidia.gemv_pdl"
FAMILIES = ("skinny_pdl", "gemv_pdl")
LLG_MODULE = "vllm.models.kimi_k3.nvidia.low_latency_gemm_dispatch"
REL_TOL = 1e-2
SM90 = (9, 0)
OUT_NAME = "skinny_pdl_sweep_sm90.json"


def cute_configs(figures: dict | None) -> dict:
    """``{(N, K, M): cfg}``: the fastest CuTe config each (shape, M) had in a figures run,
    by pass 1 (every candidate has one; pass 2 re-timed only some). An M it lacks takes
    that of the nearest M of the shape (:func:`nearest_cute`)."""
    best: dict = {}
    for row in (figures or {}).get("rows", []):
        for c in row["candidates"]:
            if c["backend"] != "cute" or c.get("status") != "ok":
                continue
            us = c["us"][0]
            key = (row["N"], row["K"], row["M"])
            if us and (key not in best or us < best[key][0]):
                best[key] = (us, c["cfg"])
    return {key: cfg for key, (_, cfg) in best.items()}


def nearest_cute(cute: dict, n: int, k: int, m: int):
    """The CuTe config of (N, K) at M, or at the nearest M that has one (the smaller on a
    tie); None if none. CuTe's table data holds no token count: ``cute_skinny`` adds it."""
    ms = sorted((abs(mm - m), mm) for (nn, kk, mm) in cute if (nn, kk) == (n, k))
    return cute[(n, k, ms[0][1])] if ms else None


def _mm(x, w):
    import torch

    return torch.mm(x, w.t())


def _timed(timing, fn, xs, ws, ref, replays) -> tuple:
    """``(µs or None, rel. err, status)``: float64 check first, then CUDA-graph timing."""
    try:
        err = timing.rel_err(fn(xs[0], ws[0]), ref)
        if not err <= REL_TOL:
            return None, err, "wrong"
        return round(timing.time_us(fn, xs, ws, replays=replays), 3), err, "ok"
    except Exception as exc:  # a candidate that fails is a finding, not the run's end
        return None, None, f"error: {type(exc).__name__}: {exc}"[:200]


class Lab:
    """The run's GPU handles: modules, rotating weights, the callables of each candidate."""

    def __init__(self, args):
        import torch

        from k3lab import candidates, timing

        self.torch, self.timing, self.candidates = torch, timing, candidates
        self.sk = importlib.import_module(SK_MODULE)
        self.gv = importlib.import_module(GV_MODULE)
        self.families = args.families
        self.llg = importlib.import_module(LLG_MODULE)
        self.table = self.llg.table_for_capability(SM90)
        self.args = args

    def dispatch(self, x, w):
        """The public entry as a caller uses it: the table's pick, else cuBLAS."""
        y = self.llg.try_low_latency_gemm(x, w)
        return self.torch.mm(x, w.t()) if y is None else y

    def skinny(self, cfg):
        config = self.sk.SkinnyPdlConfig(*cfg)
        return lambda x, w: self.sk.skinny_pdl_gemm(x, w, config)

    def gemv(self, cfg):
        config = self.gv.GemvPdlConfig(*cfg)
        return lambda x, w: self.gv.gemv_pdl(x, w, config)

    def family(self, backend: str, cfg):
        """The callable of one config of a family of ours."""
        return self.skinny(cfg) if backend == "skinny_pdl" else self.gemv(cfg)

    def configs(self, backend: str, n: int, k: int) -> list:
        if backend not in self.families:
            return []
        mod = self.sk if backend == "skinny_pdl" else self.gv
        return [list(c) for c in mod.sweep_configs(n, k)]

    def cute(self, cfg, m):
        return self.candidates.routed("cute", cfg, m)

    def pick(self, n: int, k: int, m: int) -> tuple:
        """``(backend, cfg)`` of the table at (N, K, M), ``("cublas", None)`` if none."""
        spec = self.table.get((n, k)) if hasattr(self.table, "get") else None
        call = spec.winner(m) if spec is not None else None
        if call is None:
            return "cublas", None
        cfg = call.config
        return call.backend, list(cfg) if isinstance(cfg, tuple) else _cfg_data(cfg)


def _cfg_data(cfg):
    """A backend config object -> JSON (CuTe's SkinnyGemmConfig: its table data tuple)."""
    fields = ("block_size", "outputs_per_block", "k_unroll", "vector_width", "static_k")
    if all(hasattr(cfg, f) for f in fields):
        return [getattr(cfg, f) for f in fields]
    return None if cfg is None else repr(cfg)


def _compile_worker(jobs: list) -> int:
    """Child process: build ``jobs`` (``(cfg, n, k, m)``) into Triton's on-disk cache."""
    import torch

    sk = importlib.import_module(SK_MODULE)
    dev = torch.device("cuda")
    for cfg, n, k, m in jobs:
        sk.warmup(sk.SkinnyPdlConfig(*cfg), n, k, dev, num_tokens=m)
    return len(jobs)


def _builds(sk, shapes: list, ms: list) -> list:
    """One ``(cfg, n, k, m)`` per distinct Triton build the rows need."""
    seen: dict = {}
    for n, k in shapes:
        for m in ms:
            for cfg in sk.sweep_configs(n, k):
                key = (tuple(cfg), sk.block_m_of(m), n % 16 == 0, k % 16 == 0, cfg.split_k > 1)
                seen.setdefault(key, (tuple(cfg), n, k, m))
    return list(seen.values())


def compile_all(lab: Lab, shapes: list, ms: list, cute: dict, budget_cute_s: float,
                workers: int) -> dict:
    """Build every skinny config (one per power of two of M) and the CuTe configs, before
    any timing (a compile inside a graph capture would fail). Returns what was compiled.

    The Triton builds (about 90, a second or more each) are first made by ``workers``
    child processes into Triton's on-disk cache, so that this process's own warm-up only
    loads them; if the pool fails, this process compiles them itself."""
    torch, sk = lab.torch, lab.sk
    dev = torch.device("cuda")
    builds = _builds(sk, shapes, ms) if "skinny_pdl" in lab.families else []
    t0, pool_note = time.time(), None
    if workers > 1 and len(builds) > 1:
        import concurrent.futures as cf
        import multiprocessing as mp

        parts = [builds[i::workers] for i in range(workers)]
        try:
            with cf.ProcessPoolExecutor(workers, mp_context=mp.get_context("spawn")) as ex:
                list(ex.map(_compile_worker, [p for p in parts if p]))
        except Exception as exc:  # the serial warm-up below compiles what is missing
            pool_note = f"pool failed: {type(exc).__name__}: {exc}"[:200]
            print(f"[skinny] {pool_note}", flush=True)
    pool_s = time.time() - t0
    for cfg, n, k, m in builds:
        sk.warmup(sk.SkinnyPdlConfig(*cfg), n, k, dev, num_tokens=m)
    skinny_s = time.time() - t0
    t_gv, gv_builds = time.time(), {(m, tuple(cfg)) for n, k in shapes for m in ms
                                    for cfg in lab.configs("gemv_pdl", n, k)}  # fmt: skip
    for m, cfg in sorted(gv_builds):
        lab.gv.warmup(lab.gv.GemvPdlConfig(*cfg), m)
    gemv_s = time.time() - t_gv
    t1, cute_ok, cute_skipped = time.time(), set(), []
    order = sorted(((m, shp.weight_bytes(n, k), n, k) for n, k in shapes for m in ms))
    for m, _, n, k in order:
        cfg = nearest_cute(cute, n, k, m)
        if cfg is None:
            continue
        if time.time() - t1 > budget_cute_s:
            cute_skipped.append([n, k, m])
            continue
        try:
            lab.candidates.warm("cute", cfg, m, k)
            cute_ok.add((n, k, m))
        except Exception as exc:
            cute_skipped.append([n, k, m, f"{type(exc).__name__}: {exc}"[:120]])
    # The table's own picks compile in their first (un-captured) call of each row.
    return {"skinny_builds": len(builds), "skinny_s": round(skinny_s, 1),
            "skinny_pool_s": round(pool_s, 1), "skinny_pool_workers": workers,
            "gemv_builds": len(gv_builds), "gemv_s": round(gemv_s, 1),
            **({"skinny_pool_note": pool_note} if pool_note else {}),
            "cute_compiled": len(cute_ok), "cute_s": round(time.time() - t1, 1),
            "cute_skipped": cute_skipped, "cute_ok": cute_ok}


def time_row(lab: Lab, n, k, m, ws, gen, cute_cfg) -> dict:
    """cuBLAS, the table's pick, CuTe and every config of each family on one (shape, M),
    2 passes (the second: cuBLAS, each backend's best of pass 1)."""
    torch, timing = lab.torch, lab.timing
    reps = lab.args.replays
    xs1 = [torch.randn(m, k, generator=gen, dtype=torch.bfloat16, device="cuda")]
    xs2 = [torch.randn(m, k, generator=gen, dtype=torch.bfloat16, device="cuda") for _ in range(4)]
    ref1, ref2 = timing.ref64(xs1[0], ws[0]), timing.ref64(xs2[0], ws[0])
    today = lab.pick(n, k, m)
    row = {"N": n, "K": k, "M": m, "label": shp.SHAPES.get((n, k), ("", ""))[0],
           "today": list(today), "candidates": []}  # fmt: skip
    plan = [(fam, cfg, lab.family(fam, cfg)) for fam in FAMILIES for cfg in lab.configs(fam, n, k)]
    if today[0] != "cublas":
        plan.append((today[0], today[1], lab.dispatch))
    if cute_cfg is not None and today != ("cute", cute_cfg):
        plan.append(("cute", list(cute_cfg), lab.cute(cute_cfg, m)))
    c1 = round(timing.time_us(_mm, xs1, ws, replays=reps), 3)
    fns = {}
    for backend, cfg, fn in plan:
        us, err, st = _timed(timing, fn, xs1, ws, ref1, reps)
        row["candidates"].append({"backend": backend, "cfg": cfg, "us": [us, None],
                                  "relerr": err, "status": st,
                                  **({"via": "dispatch"} if fn is lab.dispatch else {})})
        fns[id(row["candidates"][-1])] = fn
    c2 = round(timing.time_us(_mm, xs2, ws, replays=2 * reps), 3)
    row["cublas_us"] = [c1, c2]
    ok = [c for c in row["candidates"] if c["us"][0]]
    best = [min((c for c in ok if c["backend"] == fam), key=lambda c: c["us"][0], default=None)
            for fam in FAMILIES]  # fmt: skip
    for c in [b for b in best if b] + [c for c in ok if c["backend"] not in FAMILIES]:
        us, err, st = _timed(timing, fns[id(c)], xs2, ws, ref2, 2 * reps)
        c["us"][1] = us
        if st != "ok":
            c["status"] = f"pass 2: {st}"
    return row


def _alone_us(c) -> float | None:
    us = [u for u in c["us"] if u]
    return statistics.mean(us) if len(us) == 2 else None


def chain_plans(lab: Lab, rows: list, shapes: list, m: int) -> dict:
    """``{variant: [(shape, fn)]}`` for the chain at M; ``fn(x, w)``. Variants: ``table``
    (as shipped), ``alone`` (CuTe where it was faster alone), ``best_alone`` (the fastest
    candidate alone, whichever backend), per family ``<family>_where_faster`` (its best
    config where faster alone than the table's pick) and ``<family>_everywhere``, and
    ``cublas``."""
    by = {(r["N"], r["K"]): r for r in rows if r["M"] == m}
    fams = [f for f in FAMILIES if f in lab.families]
    variants = ["table", "alone", "best_alone"] + [
        f"{f}_{how}" for f in fams for how in ("where_faster", "everywhere")] + ["cublas"]
    out: dict = {v: [] for v in variants}
    for shape in shapes:
        row = by.get(shape)
        out["table"].append((shape, lab.dispatch))
        out["cublas"].append((shape, _mm))
        if row is None:  # not timed alone (budget): every variant runs the table's pick
            for v in variants[1:-1]:
                out[v].append((shape, lab.dispatch))
            continue
        cands = {c["backend"]: c for c in sorted(
            (c for c in row["candidates"] if _alone_us(c)), key=_alone_us, reverse=True)}
        today_us = _alone_us(cands[row["today"][0]]) if row["today"][0] in cands else (
            statistics.mean(row["cublas_us"]))
        cute = cands.get("cute")
        use_cute = cute is not None and row["today"][0] != "cute" and _alone_us(cute) < today_us
        out["alone"].append((shape, lab.cute(cute["cfg"], m) if use_cute else lab.dispatch))
        top = min(cands.values(), key=_alone_us, default=None)
        out["best_alone"].append((shape, _fn_of(lab, top, m) if top and _alone_us(top) < today_us
                                  else lab.dispatch))  # fmt: skip
        for f in fams:
            c = cands.get(f)
            faster = c is not None and _alone_us(c) < today_us
            out[f"{f}_where_faster"].append((shape, lab.family(f, c["cfg"]) if faster else lab.dispatch))
            out[f"{f}_everywhere"].append((shape, lab.family(f, c["cfg"]) if c else lab.dispatch))
    return out


def _fn_of(lab: Lab, cand: dict, m: int):
    """The callable of a timed candidate: a family's config, CuTe's, else the dispatch
    (the table's own pick, timed through it)."""
    if cand["backend"] in FAMILIES:
        return lab.family(cand["backend"], cand["cfg"])
    if cand["backend"] == "cute" and cand.get("via") != "dispatch":
        return lab.cute(cand["cfg"], m)
    return lab.dispatch


def time_chains(lab: Lab, rows: list, shapes: list, ms: list, read_bps: float) -> list:
    torch, timing = lab.torch, lab.timing
    gen = torch.Generator(device="cuda").manual_seed(28)
    ws = {s: torch.randn(*s, generator=gen, device="cuda").mul_(0.02).to(torch.bfloat16)
          for s in shapes}  # fmt: skip
    out = []
    for m in ms:
        xs = {s: torch.randn(m, s[1], generator=gen, device="cuda").to(torch.bfloat16)
              for s in shapes}  # fmt: skip
        roof = sum(shp.min_bytes_moved(n, k, m) for n, k in shapes) / read_bps * 1e6
        rec = {"M": m, "n_gemms": len(shapes), "roof_us": round(roof, 2)}
        for variant, plan in chain_plans(lab, rows, shapes, m).items():
            def one(plan=plan):
                for shape, fn in plan:
                    fn(xs[shape], ws[shape])

            def body(one=one):
                for _ in range(lab.args.chain_passes):
                    one()

            try:
                us = timing.graph_replay_us(one, body, lab.args.chain_passes, 2 * lab.args.replays)
                rec[variant + "_us"] = round(us, 2)
                rec["frac_" + variant] = round(roof / us, 3)
            except Exception as exc:
                rec[variant + "_error"] = f"{type(exc).__name__}: {exc}"[:200]
        out.append(rec)
        print("[chain]", json.dumps(rec), flush=True)
    return out


def provenance(run_id: str) -> dict:
    from k3lab import provenance as prov

    p = {**prov.provenance(run_id, kernel="skinny_pdl_gemm.py (Triton), gemv_pdl.py (CuTe DSL)"),
         **prov.environment()}
    p["tool"] = "k3lab/bench/skinny_pdl_sweep.py"
    p["vllm"] = prov.version_of("vllm")
    return p


def summary_table(run: dict) -> str:
    """The short table printed last: per (shape, M) the table's pick, CuTe and the best
    config of each family alone (pass 2, µs), then the chain."""
    lines = [f"{'shape':>12} M  {'table':>16} {'cute':>7} {'skinny':>7} {'gemv':>7} {'cuBLAS':>7}"
             "  best skinny / gemv"]
    for r in run["rows"]:
        def us(backend):
            ts = [c["us"][1] for c in r["candidates"] if c["backend"] == backend and c["us"][1]]
            return min(ts) if ts else None
        sk, gv = (min((c for c in r["candidates"] if c["backend"] == fam and c["us"][1]),
                      key=lambda c: c["us"][1], default=None) for fam in FAMILIES)
        today = r["today"][0]
        t_us = r["cublas_us"][1] if today == "cublas" else us(today)
        f = lambda v: f"{v:7.2f}" if v else "      -"  # noqa: E731
        lines.append(f"{r['N']:>5}x{r['K']:<6} {r['M']} {today[:8]:>8} {f(t_us)} {f(us('cute'))} "
                     f"{f(sk and sk['us'][1])} {f(gv and gv['us'][1])} {f(r['cublas_us'][1])}  "
                     f"{sk and sk['cfg']} / {gv and gv['cfg']}")
    for c in run.get("chain", []):
        names = [k[:-3] for k in c if k.endswith("_us") and k != "roof_us"]
        lines.append("chain M=%d roof %.1f: " % (c["M"], c["roof_us"]) + ", ".join(
            f"{v} {c.get(v + '_us', '-')}" for v in ["table", "alone"] + [
                v for v in names if v not in ("table", "alone")]))
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m k3lab.bench.skinny_pdl_sweep")
    ap.add_argument("--out", default=os.environ.get("OUT", "."), help="folder of the JSON")
    ap.add_argument("--figures", help="an earlier figures run (CuTe's best configs)")
    ap.add_argument("--m", default="1,2,3,4", help="token counts, e.g. 1,2,3,4,8")
    ap.add_argument("--shapes", type=lambda s: [shp.parse(t) for t in s.split(",")],
                    help="NxK,... (default: every SM90 table shape)")
    ap.add_argument("--replays", type=int, default=7)
    ap.add_argument("--budget-s", type=float, default=210.0,
                    help="stop timing new shapes (alone) after this; the chain still runs")
    ap.add_argument("--cute-budget-s", type=float, default=45.0)
    ap.add_argument("--families", type=lambda s: s.split(","), default=list(FAMILIES),
                    help="our PDL-aware families to sweep: skinny_pdl,gemv_pdl")
    ap.add_argument("--compile-workers", type=int, default=min(12, os.cpu_count() or 1),
                    help="child processes that build the Triton kernels first (1: none)")
    ap.add_argument("--chain-max-mb", type=float, default=100.0)
    ap.add_argument("--chain-passes", type=int, default=6)
    ap.add_argument("--run-id", default=os.environ.get("K3_RUN_ID", "skinny-pdl"))
    args = ap.parse_args(argv)
    t0 = time.time()
    lab = Lab(args)
    torch, timing = lab.torch, lab.timing
    ms = [int(t) for t in args.m.split(",")]
    table_shapes = sorted(lab.table)
    shapes = args.shapes or table_shapes
    chain_shapes = [s for s in table_shapes if shp.weight_bytes(*s) / 1e6 <= args.chain_max_mb]
    figures = json.load(open(args.figures)) if args.figures else None
    cute = cute_configs(figures)
    read_bps = timing.read_bandwidth_Bps()
    compiled = compile_all(lab, shapes, ms, cute, args.cute_budget_s, args.compile_workers)
    cute_ok = compiled.pop("cute_ok")
    print(f"[skinny] read roof {read_bps / 1e12:.3f} TB/s; compiled {compiled} "
          f"in {time.time() - t0:.0f}s", flush=True)
    run = {"provenance": provenance(args.run_id), "covers": "rows",
           "read_bw_TBps": round(read_bps / 1e12, 4), "compile": compiled, "skipped": [],
           "method": "k3lab.timing.time_us: CUDA graph of >= 12 calls over >= 256 MiB of "
                     "weight copies, median of replays; pass 1 every candidate, pass 2 fresh "
                     "activations, cuBLAS and the best of each backend",
           "rows": []}  # fmt: skip
    path = os.path.join(args.out, OUT_NAME)
    os.makedirs(args.out, exist_ok=True)
    rot = timing.RotatingWeights(max(shp.weight_bytes(n, k) for n, k in shapes))
    gen = torch.Generator(device="cuda").manual_seed(0)
    from k3lab.bench.decode_gemm import winners

    for n, k in shapes:
        if time.time() - t0 > args.budget_s:
            run["skipped"].append([n, k, "time budget"])
            continue
        ws = rot.views(n, k)
        for m in ms:
            cfg = nearest_cute(cute, n, k, m) if (n, k, m) in cute_ok else None
            row = time_row(lab, n, k, m, ws, gen, cfg)
            row["weight_bytes"] = shp.weight_bytes(n, k)
            row["roof_us"] = round(shp.roof_us(n, k, m, read_bps), 3)
            run["rows"].append(row)
        del ws
        winners.decide(run)
        with open(path, "w") as f:
            json.dump(run, f, separators=(",", ":"), sort_keys=True)
        print(f"[skinny] {n}x{k} done at {time.time() - t0:.0f}s", flush=True)
    del rot
    torch.cuda.empty_cache()
    run["chain_shapes"] = [list(s) for s in chain_shapes]
    run["chain"] = time_chains(lab, run["rows"], chain_shapes, ms, read_bps)
    winners.decide(run)
    run["wall_s"] = round(time.time() - t0, 1)
    with open(path, "w") as f:
        json.dump(run, f, separators=(",", ":"), sort_keys=True)
    print(summary_table(run))
    print(f"[skinny] wrote {path} in {run['wall_s']}s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
