"""A/B on the GPU: upstream's table vs ours vs cuBLAS for every row either one routes.

Rows: the union of both tables' rows for the GPU's architecture (``table_dump`` JSON, as
the host read them). A side without a row runs cuBLAS there (its time is cuBLAS's, speedup
1.0). Per row, in one process and back to back under one GPU-wide file lock: cuBLAS
(``torch.mm``/``addmm``), upstream's choice, ours, each by ``k3lab/timing.time_us``
(CUDA-graph replay over >= 256 MiB of rotating weight copies, median of ``replays``),
each output first checked against float64 (relative error <= 1e-2). CuTe configs are
compiled before the lock is taken, so worker processes compile in parallel and only the
timings are serialised. Rows are handed out one at a time and come back as they finish
(``measure``'s ``on_row``), so a stage stopped at its deadline keeps every row timed.
The deadline is the parent's alone: it closes a gate the workers pass to begin a row, so
whether a row began is recorded, never guessed from how long a worker took to start.
Ours' swap_ab rows run our Triton kernel (``k3lab/candidates.py``, compiled
first with its ``warmup``, which launches nothing); its ll_bf16 and tinygemm rows run
through our module's own ``_launch`` (compiled first with one call on zeros, outside the
lock; tinygemm needs FlashInfer). A choice this runner cannot run (dsv3_fused_a without
that op, tinygemm without FlashInfer) leaves the row ``unmeasured``, out of the
head-to-head geo-mean.

``winner`` per row: ``ours`` or ``upstream`` when one side is faster by more than
``TIE`` (2%, above the ~1% spread of a median of 15 replays seen on the H200), else ``tie``.
"""

from __future__ import annotations

import fcntl
import math
import multiprocessing as mp
import os
import queue
import random
import stat
import time

from ci import prefer_overlay

TIE = 0.02
REL_TOL = 1e-2


def arch_of(capability: tuple[int, int]) -> str:
    return f"SM{capability[0]}{capability[1]}"


def union_rows(upstream: dict, ours: dict, arch: str) -> list[dict]:
    """``[{"N", "K", "M", "residual", "upstream", "ours"}]``: every row either side routes.

    ``upstream``/``ours`` are ``table_dump`` outputs; a side's entry is its choice
    ``{"backend", "config"}`` or None (cuBLAS).
    """
    sides = {}
    for name, dump in (("upstream", upstream), ("ours", ours)):
        tables = dump["archs"].get(arch, {})
        for n, k, m, backend, config in tables.get("rows", []):
            sides.setdefault((n, k, m, False), {})[name] = {"backend": backend, "config": config}
        for n, k, m, config in tables.get("residual", []):
            sides.setdefault((n, k, m, True), {})[name] = {"backend": "cute", "config": config}
    return [{"N": n, "K": k, "M": m, "residual": r, "upstream": s.get("upstream"),
             "ours": s.get("ours")}
            for (n, k, m, r), s in sorted(sides.items(), key=lambda i: (i[0][3], i[0][:3]))]


def config_tuple(config: dict) -> tuple:
    """``(block_size, outputs_per_block, k_unroll, vector_width, static_k)`` for kernels.py."""
    return (config["block_size"], config["outputs_per_block"], config["k_unroll"],
            config["vector_width"], config["static_k"])


class GpuLock:
    """One GPU-wide lock across processes (and rebase targets): an flock on a file."""

    def __init__(self, path: str) -> None:
        self.path = path

    def __enter__(self):
        # Its default place is the shared /tmp: a link planted there is not followed (nor
        # written through), a FIFO not waited on. (No k3overlay here: this runs offline.)
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_NONBLOCK
                     | os.O_CLOEXEC, 0o600)
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            os.close(fd)
            raise OSError(f"the GPU lock {self.path} is not a regular file")
        fcntl.flock(fd, fcntl.LOCK_EX)
        self._fd = fd
        return self

    def __exit__(self, *exc):
        os.close(self._fd)  # releases the lock


def _kernel_fn(choice: dict | None, row: dict, kernels):
    """The callable for a side's choice at ``row``; None for cuBLAS; raises LookupError
    where this runner cannot run it. Compiles what it can first, outside the GPU lock."""
    if choice is None:
        return None
    if choice["backend"] == "dsv3_fused_a":
        fn = kernels.dsv3_fn()
        if fn is None:
            raise LookupError("dsv3_fused_a not built here")
        return fn
    if choice["backend"] == "swap_ab":  # ours only: our Triton kernel, as decode_gemm times it
        import torch

        from k3lab import candidates

        mod = candidates.swap_ab_module()
        config = mod.SwapAbConfig(**choice["config"])
        try:  # compiles, launches nothing
            mod.warmup(config, row["N"], row["K"], torch.device("cuda"),
                       has_residual=row["residual"])
        except Exception:
            pass  # the first call compiles instead (and reports what is wrong)
        return candidates.swap_ab(tuple(config))
    if choice["backend"] in OUR_LAUNCH:
        return _our_launch(choice, row)
    if choice["backend"] != "cute":
        raise LookupError(f"the A/B has no handle for backend {choice['backend']}")
    cfg = config_tuple(choice["config"])
    try:
        kernels.cute_compile(row["M"], cfg)  # CPU only, outside the GPU lock
    except Exception:
        pass  # the first call compiles instead (and reports what is wrong)
    return kernels.cute_fn(row["M"], cfg)


OUR_LAUNCH = ("ll_bf16", "tinygemm")  # ours only: through our module's own launch
LLG = "vllm.models.kimi_k3.nvidia.low_latency_gemm_dispatch"
LL_BF16 = "vllm.models.kimi_k3.nvidia.gemm_backends.ll_bf16"  # its config type


def _our_launch(choice: dict, row: dict):
    """``low_latency_gemm_dispatch._launch`` for the row's call, as the model runs it.
    Compiles it first, on zeros (FlashInfer builds tinygemm on its first call)."""
    import importlib

    import torch

    llg = importlib.import_module(LLG)
    if not llg._backend_available(choice["backend"]):
        raise LookupError(f"{choice['backend']} not available here")
    config = importlib.import_module(LL_BF16).LLBf16Config(**choice["config"]) if choice["config"] else None
    call = llg.PlannedCall(choice["backend"], config)
    x = torch.zeros(row["M"], row["K"], dtype=torch.bfloat16, device="cuda")
    llg._launch(call, x, torch.zeros(row["N"], row["K"], dtype=torch.bfloat16, device="cuda"))
    torch.cuda.synchronize()
    return lambda x, w, residual=None: llg._launch(call, x, w)


def _time_row(row: dict, rot, lock: GpuLock, replays: int) -> dict:
    import torch

    from k3lab import kernels, shapes, timing

    n, k, m = row["N"], row["K"], row["M"]
    fns = {}
    for side in ("upstream", "ours"):
        try:
            fns[side] = _kernel_fn(row[side], row, kernels)
        except Exception as exc:  # LookupError: not here; anything else: it failed
            fns[side] = exc
    gen = torch.Generator(device="cuda").manual_seed(n * 31 + k * 7 + m)
    xs = [torch.randn(m, k, generator=gen, dtype=torch.bfloat16, device="cuda") for _ in range(4)]
    ws = rot.views(n, k)
    res = torch.randn(m, n, generator=gen, dtype=torch.bfloat16, device="cuda") \
        if row["residual"] else None
    out = {key: row[key] for key in ("N", "K", "M", "residual")}
    out["label"] = shapes.SHAPES.get((n, k), ("",))[0]  # projection name, for readers only
    with lock:
        ref = timing.ref64(xs[0], ws[0], res)
        cublas = timing.time_us(kernels.cublas, xs, ws, res, replays=replays)
        out["cublas_us"] = round(cublas, 3)
        for side, fn in fns.items():
            entry = dict(row[side] or {"backend": "cublas", "config": None})
            if isinstance(fn, LookupError):
                entry["status"] = f"unmeasured: {fn}"
            elif isinstance(fn, Exception):
                entry["status"] = f"error: {type(fn).__name__}: {fn}"[:300]
            elif fn is None:
                entry.update(us=out["cublas_us"], speedup=1.0, status="no row: cuBLAS")
            else:
                try:
                    err = timing.rel_err(fn(xs[0], ws[0], res) if res is not None
                                         else fn(xs[0], ws[0]), ref)
                    entry["relerr"] = err
                    if not err <= REL_TOL:
                        entry["status"] = f"error: relative error {err:.2e} > {REL_TOL}"
                    else:
                        us = timing.time_us(fn, xs, ws, res, replays=replays)
                        entry.update(us=round(us, 3), speedup=round(cublas / us, 4), status="ok")
                except Exception as exc:  # a kernel that fails is a finding, not a crash
                    entry["status"] = f"error: {type(exc).__name__}: {exc}"[:300]
            out[side] = entry
    out["winner"] = winner(out["upstream"], out["ours"])
    return out


def winner(upstream: dict, ours: dict) -> str:
    """``ours``/``upstream``/``tie``, or ``unmeasured`` when either side has no time."""
    if "us" not in upstream or "us" not in ours:
        return "unmeasured"
    ratio = upstream["us"] / ours["us"]
    if abs(ratio - 1.0) <= TIE:
        return "tie"
    return "ours" if ratio > 1.0 else "upstream"


_STATE: dict = {}  # per worker process: its GPU lock and rotating weights, made once
_GATE = None  # per worker process: measure's gate (see _begin), set by _init_worker

POLL_S = 1.0  # how long measure waits for a row before it looks at its clock again


def _new_gate(rows: int, ctx):
    """One flag per row (1: a worker began it) and a last one (1: the gate is closed)."""
    return ctx.Array("b", rows + 1)


def _init_worker(gate) -> None:
    global _GATE
    _GATE = gate


def _begin(index: int) -> bool:
    """In a worker: whether row ``index`` may begin; if so it is marked begun. The check and
    the mark are one step under the gate's lock, so a row is begun before the gate closes
    or not at all."""
    with _GATE.get_lock():
        flags = _GATE.get_obj()
        if flags[len(flags) - 1]:
            return False
        flags[index] = 1
        return True


def _close(gate) -> list[bool]:
    """In the parent, at the deadline: no row begins after this; which rows had begun."""
    with gate.get_lock():
        flags = gate.get_obj()
        flags[len(flags) - 1] = 1
        return [bool(f) for f in flags[:len(flags) - 1]]


def _gpu_row(row: dict, lock_path: str, biggest: int, replays: int) -> dict:
    """Time one row on this worker's GPU, setting the worker up on its first row."""
    import torch

    from k3lab import timing

    if not _STATE:
        if os.environ.get(prefer_overlay.ENV):  # before anything imports the package
            prefer_overlay.install(os.environ[prefer_overlay.ENV])
        torch.cuda.init()
        _STATE["lock"] = GpuLock(lock_path)
        with _STATE["lock"]:
            _STATE["rot"] = timing.RotatingWeights(biggest, seed=os.getpid())
    return _time_row(row, _STATE["rot"], _STATE["lock"], replays)


def _row_task(args: tuple) -> tuple[int, dict]:
    """One row in a pool worker: ``(index, result)``; a row handed out but not begun before
    the gate closed, or whose set-up, inputs or cuBLAS fail, comes back with a ``status``
    saying so. The deadline is checked before anything is imported or initialised."""
    index, row, lock_path, biggest, replays, run_row = args
    if not _begin(index):
        return index, not_run(row, "not run: deadline")
    try:
        return index, run_row(row, lock_path, biggest, replays)
    except Exception as exc:  # cuBLAS or the inputs failed: the row, not the run
        return index, not_run(row, f"error: {type(exc).__name__}: {exc}"[:300])


def not_run(row: dict, status: str) -> dict:
    """A result row for ``row`` without times: ``winner`` unmeasured, ``status`` why."""
    return {**{k: row[k] for k in ("N", "K", "M", "residual")}, "upstream": row["upstream"],
            "ours": row["ours"], "winner": "unmeasured", "status": status}


def measure(rows: list[dict], *, lock_path: str, workers: int, replays: int,
            deadline_s: float, grace_s: float = 20.0, on_row=None,
            clock=time.monotonic, run_row=_gpu_row) -> list[dict]:
    """Time every row (see the module docstring) with ``workers`` processes; row order kept.

    Rows go to whichever worker is free, one at a time, in a fixed shuffled order. At
    ``deadline_s`` (seconds from now, by ``clock``; only this process reads it) a gate
    closes: a row not begun by then is ``not run: deadline`` at once, whether or not a
    worker was about to reach it (a worker marks a row begun, under the gate's lock,
    before it imports or initialises anything; once the gate is closed it begins none).
    A row begun and still running ``grace_s`` after the deadline is abandoned (the pool
    is terminated) as ``not run: deadline (still running)``: how long workers take to
    start decides neither reason.
    ``on_row(done)``, if given, is called after each row with the finished rows so far
    (row order), so a caller can save them as they come; rows abandoned at the end are
    only in the returned list.
    ``clock`` and ``run_row`` (a module-level function, run in the workers: ``(row,
    lock_path, biggest, replays) -> result``) are there for the tests.
    """
    if not rows:
        return []
    deadline = clock() + deadline_s
    give_up = deadline + grace_s
    biggest = max(2 * r["N"] * r["K"] for r in rows)
    # A fixed shuffle: rows a deadline leaves untimed are a random sample, not the last shapes.
    order = list(range(len(rows)))
    random.Random(0).shuffle(order)
    ctx = mp.get_context("spawn")
    gate = _new_gate(len(rows), ctx)
    arrived: queue.Queue = queue.Queue()  # (index, result), from the pool's result thread
    done: dict[int, dict] = {}
    begun: list[bool] | None = None  # which rows had begun, once the gate is closed
    pool = None

    def finish(index: int, result: dict) -> None:
        if index in done:  # a worker's late "not run" for a row already marked so here
            return
        done[index] = result
        if on_row is not None:
            on_row([done[i] for i in sorted(done)])

    def failed(index: int):  # _row_task catches what a row raises; this is the pool's own
        return lambda exc: arrived.put(
            (index, not_run(rows[index], f"error: {type(exc).__name__}: {exc}"[:300])))

    try:
        while len(done) < len(rows):
            now = clock()
            if begun is None and now >= deadline:
                begun = _close(gate)
                for index in order:  # not begun, handed out or not: settled now
                    if not begun[index]:
                        finish(index, not_run(rows[index], "not run: deadline"))
            while True:  # what has come back, before any giving up
                try:
                    finish(*arrived.get_nowait())
                except queue.Empty:
                    break
            if len(done) == len(rows) or now >= give_up:
                break
            if pool is None:  # every row handed out, in order, before the deadline
                pool = ctx.Pool(max(1, min(workers, len(rows))), initializer=_init_worker,
                                initargs=(gate,))
                for index in order:
                    pool.apply_async(_row_task,
                                     ((index, rows[index], lock_path, biggest, replays, run_row),),
                                     callback=arrived.put, error_callback=failed(index))
            wait = (deadline if begun is None else give_up) - now
            try:
                finish(*arrived.get(timeout=min(POLL_S, max(0.0, wait))))
            except queue.Empty:
                pass
    finally:
        if pool is not None:
            pool.terminate()
    return [done.get(i) or not_run(row, "not run: deadline (still running)" if begun and begun[i]
                                   else "not run: deadline")
            for i, row in enumerate(rows)]


def _geo(values: list[float]) -> float | None:
    values = [v for v in values if v and v > 0]
    return round(math.exp(sum(map(math.log, values)) / len(values)), 4) if values else None


def summarize(results: list[dict]) -> dict:
    """Geo-means over the rows both sides have a time for, win counts, what was not measured."""
    measured = [r for r in results if r["winner"] != "unmeasured"]
    wins = {w: sum(1 for r in measured if r["winner"] == w) for w in ("ours", "upstream", "tie")}
    return {
        "rows": len(results),
        "measured": len(measured),
        "geomean_ours": _geo([r["ours"]["speedup"] for r in measured]),
        "geomean_upstream": _geo([r["upstream"]["speedup"] for r in measured]),
        "geomean_ours_over_upstream": _geo([r["upstream"]["us"] / r["ours"]["us"]
                                            for r in measured]),
        "wins": wins,
        "unmeasured": [[r["N"], r["K"], r["M"], _why(r)] for r in results
                       if r["winner"] == "unmeasured"],
        "errors": sum(1 for r in results for where in (r, r.get("upstream"), r.get("ours"))
                      if str((where or {}).get("status", "")).startswith("error")),
        "ours_slower_than_cublas": [[r["N"], r["K"], r["M"]] for r in measured
                                    if r["ours"]["speedup"] < 1.0],
    }


def _why(row: dict) -> str:
    if row.get("status"):
        return row["status"]
    return "; ".join(f"{side}: {row[side].get('status')}" for side in ("upstream", "ours")
                     if "us" not in (row.get(side) or {}))
