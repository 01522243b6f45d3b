"""Tuner: measure the SM90 (or any GPU's) low-latency GEMM table, resumably.

For every Kimi-K3 decode shape (``shapes.SHAPES``) and M in 1..16 it times
cuBLAS and legal CuTe configs of vLLM v0.28.0's skinny GEMM (and the dsv3
fused-A kernel when ``dsv3_build.py`` produced it), keeps a backend only if it
beats cuBLAS by >= 5% in pass 1 *and* again in an independent pass 2, and
writes a results JSON from which ``render_table.py`` builds the data module.

Search per (shape, M): seeds (every config any upstream table used for this
shape, plus a coarse grid; or, with ``--seed-cache``, the fastest configs an
earlier run measured for this shape and its ``--donor`` shapes) -> hill-climb
one-parameter neighbours of the two best (``--refine-rounds``) -> pass 2 on the
top three. Illegal configs are pruned before anything is compiled
(``space.illegal_reason``). A shape is skipped at M when nothing reached cuBLAS
at M-1 (the CuTe kernel's cost grows with M, cuBLAS's is flat): its own answer,
waited for up to ``--wait-s`` (workers tune consecutive M values as a wavefront),
else a donor's recorded answer. Every measurement goes to a per-(GPU, M)
JSON-lines cache before the next starts, so a call stopped by ``--deadline-s``
(or killed) resumes where it was. Seeds only choose what is timed: every figure
in the results JSON is measured by this run, in this run's cache.

Timing: ``timing.time_us`` (CUDA-graph replay, >= 256 MiB rotating weights,
median; pass 1 7 replays, pass 2 15, fresh inputs). Worker processes (one per
M at a time) compile on the CPU in parallel but time only while holding one
GPU-wide lock (:class:`GpuLock`, lowest M first), so no two timings overlap and
under a deadline the small M, which decide the larger ones, finish first.

Usage (on the GPU machine, after ``install.sh``)::

    python -m k3lab.tune --cache DIR --priors priors.json --out results.json \
        --deadline-s 480 --workers 4 --run-id ID
    # a few shapes, seeded from an earlier run's cache (k3lab/device/kda.sh):
    python -m k3lab.tune --cache NEW_DIR --seed-cache results/tune_cache \
        --shape 6144x7168 --donor 6144x7168=6288x7168 --refine-rounds 1 --wait-s 0 ...
"""

from __future__ import annotations

import argparse
import concurrent.futures as cf
import contextlib
import json
import multiprocessing as mp
import os
import sys
import time


from k3lab import aggregate, space, tune_cache
from k3lab import shapes as shp
from k3lab.provenance import provenance

WIN = 1.05  # keep a backend only if cuBLAS_us / us >= WIN in both passes
REFINE_GATE = 0.95  # hill-climb only shapes whose best seed reaches this speedup
REFINE_ROUNDS = 3
PASS2_TOP = 3
SEED_TOP = 6  # with --seed-cache: configs taken from each seed shape

DEVICE = "cuda"
_lock = None
_state: dict = {}
_opts: dict = {"refine_rounds": REFINE_ROUNDS, "wait_s": 180.0, "seed_cache": None, "donors": {}}


class GpuLock:
    """One GPU-wide timing lock across worker processes, granted to the lowest M waiting.

    ``held(m)`` is a context manager. Compiling happens outside it, so workers still
    compile in parallel; only the timings queue, smallest M first (a larger M is tuned
    only if M-1 reached cuBLAS, and decode runs small M most).
    """

    def __init__(self, ctx, max_m: int = 16):
        self._lock = ctx.Lock()
        self._waiting = ctx.Array("i", max_m + 1)

    @contextlib.contextmanager
    def held(self, m: int):
        with self._waiting.get_lock():
            self._waiting[m] += 1
        while True:
            self._lock.acquire()
            with self._waiting.get_lock():
                mine = not any(self._waiting[j] for j in range(m))
                if mine:
                    self._waiting[m] -= 1
            if mine:
                break
            self._lock.release()  # a smaller M is waiting: let it in
            time.sleep(0.001)
        try:
            yield
        finally:
            self._lock.release()


def _init_worker(lock, opts):
    global _lock
    _lock = lock
    _opts.update(opts)


def _worker_setup(m: int):
    if _state:
        return _state
    import torch

    from k3lab import kernels, timing

    torch.cuda.init()
    max_w = max(shp.weight_bytes(n, k) for n, k in shp.SHAPES)
    with _lock.held(m):
        _state["rot"] = timing.RotatingWeights(max_w, seed=os.getpid())
        torch.cuda.synchronize()
    _state.update(torch=torch, kernels=kernels, timing=timing, dsv3=kernels.dsv3_fn())
    return _state


def _seeds(priors: dict, n: int, k: int, m: int) -> list:
    cfgs = []
    for tables in priors.values():
        for rows in tables.values():
            for r in rows:
                if (r["N"], r["K"]) == (n, k):
                    cfgs += [tuple(c) for c in r["cute"].values()]
                    cfgs += [tuple(c) for c in r["residual"].values()]
    cfgs += space.coarse_grid(n, k, m)
    return [c for c in space.uniq(cfgs) if space.illegal_reason(c, n, k, m) is None]


def _lost(recs: dict, n: int, k: int, m: int) -> bool | None:
    """From one (GPU, M) cache: True if (N, K) was skipped at M or finished pass 1 there
    with nothing reaching cuBLAS, False if something did, None if there is no answer."""
    if (n, k, m, "skip", 1) in recs:
        return True
    done = recs.get((n, k, m, "done", 1))
    return None if done is None else done.get("best_speedup", 0.0) < 1.0


def _prev_lost(cache_dir: str, gpu: str, n: int, k: int, m: int, wait_s: float,
               donors: tuple = (), seed_cache: str | None = None) -> str | None:
    """Why (N, K) is not tuned at M, or None to tune it.

    The CuTe kernel's cost grows with M while cuBLAS's stays flat, so a shape that
    no config could win at M-1 is not timed at M. Waits up to ``wait_s`` for the
    worker tuning M-1 (tasks start in M order, so it is running or finished);
    without its answer, a ``donor`` shape's recorded answer at M-1 (this run's cache,
    then ``seed_cache``) decides; without any, the shape is tuned.
    """
    if m <= 1:
        return None
    t_end = time.time() + wait_s
    while True:
        lost = _lost(tune_cache.read(cache_dir, gpu, m - 1), n, k, m - 1)
        if lost is not None:
            return "nothing reached cuBLAS at M-1" if lost else None
        if time.time() >= t_end:
            break
        time.sleep(0.5)
    for dn, dk in donors:
        for where, label in ((cache_dir, "this run"), (seed_cache, "seed cache")):
            if where is None:
                continue
            lost = _lost(tune_cache.read(where, gpu, m - 1), dn, dk, m - 1)
            if lost is not None:
                return f"nothing reached cuBLAS at M-1 for donor {dn}x{dk} ({label})" if lost else None
    return None


def seeds_from_cache(seed_cache: str, gpu: str, n: int, k: int, m: int,
                     donors: tuple = (), top: int = SEED_TOP) -> list:
    """Seeds for (N, K) at M from an earlier run's cache: for (N, K) itself and each
    donor shape, the ``top`` fastest configs measured in pass 1 at the M nearest to
    ``m`` that has any (the same M first, then the smaller of two equally near), legal
    for (N, K, M), de-duplicated. Empty when the cache holds none of those shapes."""
    out = []
    for sn, sk in ((n, k), *donors):
        by_m = {}
        for mm in shp.M_RANGE:
            recs = tune_cache.read(seed_cache, gpu, mm)
            ok = [r for r in recs.values()
                  if (r["N"], r["K"]) == (sn, sk) and r["pass"] == 1 and isinstance(r["cfg"], list)
                  and r.get("status") == "ok" and r.get("us")]
            if ok:
                by_m[mm] = ok
        if not by_m:
            continue
        near = min(by_m, key=lambda mm: (abs(mm - m), mm))
        out += [tuple(r["cfg"]) for r in sorted(by_m[near], key=lambda r: r["us"])[:top]]
    return [c for c in space.uniq(out) if space.illegal_reason(c, n, k, m) is None]


def tune_m(m: int, cache_dir: str, gpu: str, priors: dict, deadline: float, shapes_sel) -> str:
    """Tune every selected shape at one M; returns a one-line summary."""
    st = _worker_setup(m)
    torch, kernels, timing = st["torch"], st["kernels"], st["timing"]
    seed_cache, donors_of = _opts["seed_cache"], _opts["donors"]
    recs = tune_cache.read(cache_dir, gpu, m)
    w = tune_cache.Writer(cache_dir, gpu, m)
    n_timed = 0

    def put(rec):
        recs[tune_cache.key_of(rec)] = rec
        w.put(rec)

    def out_of_time():
        return time.time() > deadline

    for n, k in shapes_sel:
        if out_of_time():
            break
        base = {"N": n, "K": k, "M": m}
        if (n, k, m, "done2", 2) in recs or (n, k, m, "skip", 1) in recs:
            continue
        donors = donors_of.get((n, k), ())
        if (n, k, m, "done", 1) not in recs:
            why = _prev_lost(cache_dir, gpu, n, k, m,
                             min(_opts["wait_s"], max(0.0, deadline - time.time())),
                             donors, seed_cache)
            if why:
                put({**base, "cfg": "skip", "pass": 1, "reason": why})
                continue
        gen = torch.Generator(device=DEVICE).manual_seed(1000 * m + n + k)
        x = torch.randn(m, k, generator=gen, dtype=torch.bfloat16, device=DEVICE)
        ws = st["rot"].views(n, k)
        ref: dict = {}  # float64 reference, computed lazily under the GPU lock

        def measure(tag, fn, pss, xs, replays):
            nonlocal n_timed
            key = (n, k, m, tag if isinstance(tag, str) else tuple(tag), pss)
            if key in recs and recs[key].get("status") != "pending":
                return recs[key]
            if key in recs:  # a worker died while timing this: never retry it
                rec = {**base, "cfg": recs[key]["cfg"], "pass": pss, "status": "crashed"}
                put(rec)
                return rec
            cfg_field = tag if isinstance(tag, str) else list(tag)
            put({**base, "cfg": cfg_field, "pass": pss, "status": "pending"})
            rec = {**base, "cfg": cfg_field, "pass": pss}
            t0 = time.time()
            try:
                if fn is None:
                    kernels.cute_compile(m, tag)  # CPU only: outside the GPU lock
                    fn = kernels.cute_fn(m, tag)
                rec["compile_s"] = round(time.time() - t0, 2)
                with _lock.held(m):
                    if "ref" not in ref:
                        ref["ref"] = timing.ref64(x, ws[0])
                    out = fn(x, ws[0])
                    rec["relerr"] = timing.rel_err(out, ref["ref"])
                    if not rec["relerr"] <= 1e-2:
                        rec["status"] = "wrong"
                    else:
                        rec["us"] = round(timing.time_us(fn, xs, ws, replays=replays), 3)
                        rec["status"] = "ok"
                        n_timed += 1
            except Exception as exc:  # illegal at runtime / compile failure
                msg = f"{type(exc).__name__}: {exc}"[:300]
                rec.update(status="error", err=msg)
                if "CUDA" in msg and ("illegal" in msg or "launch failure" in msg):
                    put(rec)
                    os._exit(17)  # context is poisoned; the pool restarts us
            put(rec)
            return rec

        def speed(rec, cub):
            return cub["us"] / rec["us"] if rec.get("status") == "ok" and cub.get("us") else 0.0

        # ---- pass 1
        xs1 = [x]
        cub1 = measure("cublas", kernels.cublas, 1, xs1, 7)
        if cub1.get("status") != "ok":
            continue
        results = {}
        if (n, k, m, "done", 1) not in recs:
            cands = []
            if seed_cache:
                cands = seeds_from_cache(seed_cache, gpu, n, k, m, donors)
            cands = cands or _seeds(priors, n, k, m)
            if st["dsv3"] is not None:
                results["dsv3"] = measure("dsv3", st["dsv3"], 1, xs1, 7)
            for c in cands:
                if out_of_time():
                    break
                results[c] = measure(c, None, 1, xs1, 7)
            best = sorted(
                (c for c in results if c != "dsv3"), key=lambda c: -speed(results[c], cub1)
            )
            if best and speed(results[best[0]], cub1) >= REFINE_GATE:
                for _ in range(_opts["refine_rounds"]):
                    improved = False
                    top = best[:2]
                    for c0 in top:
                        for c in space.neighbours(c0, n, k, m):
                            if c in results or out_of_time():
                                continue
                            results[c] = measure(c, None, 1, xs1, 7)
                            if speed(results[c], cub1) > speed(results[best[0]], cub1):
                                improved = True
                    best = sorted(
                        (c for c in results if c != "dsv3"),
                        key=lambda c: -speed(results[c], cub1),
                    )
                    if not improved:
                        break
            if out_of_time():
                break
            bs = max((speed(r, cub1) for r in results.values()), default=0.0)
            put({**base, "cfg": "done", "pass": 1, "best_speedup": round(bs, 4)})
        else:
            for key, rec in recs.items():
                if key[:3] == (n, k, m) and key[4] == 1 and rec.get("status") == "ok":
                    if key[3] not in ("cublas",):
                        results[key[3]] = rec
        # ---- pass 2: fresh activations, more replays, cuBLAS re-timed alongside
        finalists = sorted(results, key=lambda c: -speed(results[c], cub1))[:PASS2_TOP]
        finalists = [c for c in finalists if speed(results[c], cub1) >= WIN]
        if finalists:
            gen2 = torch.Generator(device=DEVICE).manual_seed(7 + 1000 * m + n + k)
            xs2 = [torch.randn(m, k, generator=gen2, dtype=torch.bfloat16, device=DEVICE)
                   for _ in range(4)]
            measure("cublas", kernels.cublas, 2, xs2, 15)  # pass 2 re-times cuBLAS alongside
            for c in finalists:
                if out_of_time():
                    break
                fn = st["dsv3"] if c == "dsv3" else None
                measure(c, fn, 2, xs2, 15)
            if out_of_time():
                break
        put({**base, "cfg": "done2", "pass": 2})
    return f"M={m}: {n_timed} timings"


def _gpu_name() -> str:
    import torch

    return torch.cuda.get_device_name(0)


def _donor(text: str) -> tuple[tuple[int, int], tuple[int, int]]:
    """``"NxK=DxK"`` -> ``((N, K), (D, K))``."""
    view, donor = text.split("=")
    return shp.parse(view), shp.parse(donor)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--cache", required=True, help="cache folder (resumable)")
    ap.add_argument("--priors", required=True, help="upstream tables JSON (bundle)")
    ap.add_argument("--out", required=True, help="results JSON to write")
    ap.add_argument("--deadline-s", type=float, default=480.0)
    ap.add_argument("--workers", type=int, default=8)
    ap.add_argument("--run-id", default=os.environ.get("K3_RUN_ID", "local"))
    ap.add_argument("--m", default="1-16", help="M values, e.g. 1-8 or 1,2,4")
    ap.add_argument("--shape", action="append", default=[], type=shp.parse, help="NxK; repeatable")
    ap.add_argument("--seed-cache", help="an earlier run's cache (read only): seeds from its "
                    "fastest configs instead of the priors and the coarse grid")
    ap.add_argument("--donor", action="append", default=[], type=_donor,
                    help="NxK=DxK: shape DxK (e.g. the packed weight a view is cut from) also "
                         "seeds NxK, and its answer at M-1 decides when NxK's own is unknown")
    ap.add_argument("--refine-rounds", type=int, default=REFINE_ROUNDS)
    ap.add_argument("--wait-s", type=float, default=180.0,
                    help="how long a worker waits for M-1's answer before it tunes anyway")
    args = ap.parse_args(argv)
    t_end = time.time() + args.deadline_s

    if "-" in args.m:
        lo, hi = map(int, args.m.split("-"))
        ms = list(range(lo, hi + 1))
    else:
        ms = [int(v) for v in args.m.split(",")]
    sel = args.shape or list(shp.SHAPES)
    donors: dict = {}
    for view, donor in args.donor:
        donors[view] = (*donors.get(view, ()), donor)
    opts = {"refine_rounds": args.refine_rounds, "wait_s": args.wait_s,
            "seed_cache": args.seed_cache, "donors": donors}
    priors = json.load(open(args.priors))

    from k3lab import timing

    prov = provenance(args.run_id)
    gpu = prov["gpu"]
    bw = timing.read_bandwidth_Bps()
    print(f"[tune] {gpu} read bandwidth {bw / 1e12:.2f} TB/s; {len(sel)} shapes x M {ms}", flush=True)
    ctx = mp.get_context("spawn")
    lock = GpuLock(ctx, max(shp.M_RANGE))
    todo = list(ms)
    for attempt in range(3):
        if not todo or time.time() > t_end:
            break
        failed = []
        with cf.ProcessPoolExecutor(args.workers, mp_context=ctx, initializer=_init_worker,
                                    initargs=(lock, opts)) as pool:
            futs = {pool.submit(tune_m, m, args.cache, gpu, priors, t_end, sel): m for m in todo}
            for fut in cf.as_completed(futs):
                try:
                    print(f"[tune] {fut.result()}", flush=True)
                except Exception as exc:
                    print(f"[tune] M={futs[fut]} failed: {exc!r}", flush=True)
                    failed.append(futs[fut])
        todo = sorted(failed)
    # The run's summary (what git keeps); every timing stays in the cache.
    res = aggregate.summary_of(aggregate.build(list(tune_cache.read_all(args.cache, gpu)), prov, bw,
                                               sel, ms))
    with open(args.out, "w") as f:
        json.dump(res, f, indent=1, sort_keys=True)
    s = res["summary"]
    print(f"[tune] wrote {args.out}: {s}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
