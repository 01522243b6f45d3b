"""One phase of the all-backend decode-GEMM figures run on the GPU (``runner.py`` starts it).

Phases (``phases.py``): ``core`` times cuBLAS, ours (swap-AB; the config picked per
shape in this run from ``tiles.seeded``, the earlier sweep's best three plus the 16-row
tiles, and ``tiles.ragged``, tiles whose CTAs own fewer rows so the grid fills the SMs)
and today's CuTe rows (``winners.cute_queue`` order, until ``--cute-budget-s`` of
compiling is spent), the read roof ``min_bytes_moved / read bandwidth`` (a bf16
reduction over 4 GiB) and the fastest launch of a trivial kernel in a graph (PDL on and
off); ``ll_bf16`` times vLLM's ``ll_bf16`` (+ cast) at ``phases.ll_configs``;
``tinygemm`` FlashInfer's ``tinygemm_bf16``; each next to cuBLAS timed in the same pass.

Timing is ``timing.time_us`` (CUDA graph of >= 12 calls over >= 256 MiB of rotating
weight copies, median of the replays). Pass 1: every candidate, 7 replays, after a
float64 check (rel. err <= 1e-2); pass 2: fresh activations, cuBLAS, ours and every
other candidate within ``winners.WIN`` of cuBLAS in pass 1 (best three), 15 replays.

Work is cut into units (compiles, baselines, one unit per weight shape with all its M).
Before each unit the progress file names it with the seconds it may take; after it the
part JSON is rewritten whole, so a phase killed at any point keeps every finished unit,
and one started again with ``--skip UNIT`` (the unit that hung) resumes after it.
Compiles are done before any timing, each counted in ``compile_s`` and stopped at their
budget (what was not compiled is listed under ``skipped`` with the reason).

Usage (after ``install.sh``, normally through ``runner.py``)::

    python -m k3lab.bench.decode_gemm.figures --phase core --part P.json --progress P.progress \\
        --sweep SWEEP.json --tune TUNE.json [--tune MORE.json] --table TABLE.py
"""

from __future__ import annotations

import argparse
import importlib.metadata as md
import json
import os
import runpy
import sys
import threading
import time

from k3lab import tiles
from k3lab import shapes as shp
from k3lab.bench.decode_gemm import phases, winners

REL_TOL = 1e-2
SHAPE_LIMIT_S = 45.0  # one shape, every M: ~1-3 s measured; the rest is slack for a lazy compile
BASELINE_LIMIT_S = 60.0
COMPILE_LIMIT_S = 120.0  # one compile unit (a JIT build of tinygemm took 10 s)
PER_PROCESS = ("startup", "compile:")


def _ver(dist: str) -> str:
    try:
        return md.version(dist)
    except md.PackageNotFoundError:
        return "absent"


def provenance(run_id: str) -> dict:
    from k3lab.bench.decode_gemm import sweep

    p = sweep.provenance(run_id)
    p.update(cutlass_dsl=_ver("nvidia-cutlass-dsl"), flashinfer=_ver("flashinfer-python"),
             vllm=_ver("vllm"), tool="k3lab/bench/decode_gemm/figures.py")
    return p


class Part:
    """A phase's part JSON and progress file, both rewritten whole (write, then rename).

    Resumes from ``path`` when it exists (a restarted phase keeps what it finished).
    """

    def __init__(self, path: str, progress: str, phase: str, skip: list):
        self.path, self.progress, self.skip_units = path, progress, set(skip)
        self.data = {"phase": phase, "rows": [], "done": [], "skipped": [], "compile_s": {}}
        if os.path.exists(path):
            with open(path) as f:
                self.data = json.load(f)
            # Compiles live in the process that made them: a new attempt makes its own.
            self.data["done"] = [u for u in self.data["done"] if not u.startswith(PER_PROCESS)]
            self.data["skipped"] = [s for s in self.data["skipped"]
                                    if not s["unit"].startswith(PER_PROCESS)]
            self.data["attempts"] = self.data.get("attempts", 1) + 1
            for key in ("compiled", "cute_timed"):
                self.data.pop(key, None)
        self.t0 = time.time()

    def _write(self, path: str, obj) -> None:
        with open(path + ".tmp", "w") as f:
            json.dump(obj, f, indent=1, sort_keys=True)
        os.replace(path + ".tmp", path)

    def start(self, unit: str, limit_s: float) -> bool:
        """Announce ``unit``; False (nothing to do) if it is done or to be skipped."""
        if unit in self.data["done"] or any(s["unit"] == unit for s in self.data["skipped"]):
            return False
        if unit in self.skip_units:  # the runner has recorded why
            print(f"[figures] not starting {unit} again: killed in an earlier attempt", flush=True)
            return False
        self._write(self.progress, {"unit": unit, "since": time.time(), "limit_s": limit_s,
                                    "pid": os.getpid()})
        return True

    def finish(self, unit: str) -> None:
        self.data["done"].append(unit)
        self.save()
        self._write(self.progress, {"unit": None, "since": time.time(), "pid": os.getpid()})

    def skip(self, unit: str, reason: str, **extra) -> None:
        self.data["skipped"].append({"unit": unit, "reason": reason, **extra})
        print(f"[figures] skip {unit}: {reason}", flush=True)
        self.save()

    def save(self) -> None:
        self.data["wall_s"] = round(self.data.get("wall_s", 0) + time.time() - self.t0, 1)
        self.t0 = time.time()
        self._write(self.path, self.data)


def measure(timing, fn, xs, ws, ref, replays):
    """``(µs or None, rel. err, status)`` of ``fn``: float64 check first, then timed."""
    try:
        err = timing.rel_err(fn(xs[0], ws[0]), ref)
        if not err <= REL_TOL:
            return None, err, "wrong"
        return round(timing.time_us(fn, xs, ws, replays=replays), 3), err, "ok"
    except Exception as exc:
        return None, None, f"error: {type(exc).__name__}: {exc}"[:200]


def time_row(ctx, n: int, k: int, m: int, plan: list, ws, gen) -> dict:
    """cuBLAS and every ``(backend, cfg)`` of ``plan`` on one (shape, M), both passes."""
    from k3lab import candidates
    import torch

    timing = ctx["timing"]
    xs1 = [torch.randn(m, k, generator=gen, dtype=torch.bfloat16, device="cuda")]
    xs2 = [torch.randn(m, k, generator=gen, dtype=torch.bfloat16, device="cuda")
           for _ in range(4)]
    ref1, ref2 = timing.ref64(xs1[0], ws[0]), timing.ref64(xs2[0], ws[0])
    row = {"N": n, "K": k, "M": m, "candidates": []}
    c1 = round(timing.time_us(candidates.cublas, xs1, ws, replays=7), 3)
    for backend, cfg in plan:
        us, err, st = measure(timing, ctx["fn_for"](backend, cfg, m), xs1, ws, ref1, 7)
        row["candidates"].append({"backend": backend, "cfg": cfg, "us": [us, None],
                                  "relerr": err, "status": st})
    c2 = round(timing.time_us(candidates.cublas, xs2, ws, replays=15), 3)
    row["cublas_us"] = [c1, c2]
    ranked = sorted((c for c in row["candidates"] if c["us"][0]), key=lambda c: c["us"][0])
    again = [c for c in ranked if c["backend"] == "swap_ab"]
    again += [c for c in ranked if c["backend"] != "swap_ab" and c1 / c["us"][0] >= winners.WIN][:3]
    for c in again:
        us, err, st = measure(timing, ctx["fn_for"](c["backend"], c["cfg"], m), xs2, ws, ref2, 15)
        c["us"][1] = us
        if st != "ok":
            c["status"] = f"pass 2: {st}"
    return row


def setup_core(args, part: Part, ctx: dict) -> None:
    """Compile ours (parallel processes) while CuTe compiles here; then roof and floor."""
    from k3lab import candidates, kernels, timing
    from k3lab.bench.decode_gemm import sweep
    import torch

    sw = json.load(open(args.sweep))
    ctx["seeds"] = {(s["N"], s["K"]): [c["cfg"] for c in sorted(
        (c for c in s["configs"] if c["M"] == 16 and c["status"] == "ok"),
        key=lambda c: c["us"])][:3] for s in sw["shapes"]}
    today = runpy.run_path(args.table)["ROWS"]
    ctx["today"] = today
    tuned = {"rows": [r for path in args.tune for r in json.load(open(path))["rows"]]}
    if part.start("compile:core", args.cute_budget_s + COMPILE_LIMIT_S):
        pre: dict = {}

        def precompile():
            try:
                pre["s"] = round(sweep.precompile({k for _, k in ctx["shapes"]}, 14), 1)
            except Exception as exc:  # ours then compiles on first use, inside its shape
                pre["error"] = f"{type(exc).__name__}: {exc}"[:200]

        th = threading.Thread(target=precompile)
        th.start()
        cute_ok, queue, t0 = [], [], time.time()
        if part.data["available"]["cute"]:
            # A resumed phase compiles only for the shapes it has still to time.
            queue = [q for q in winners.cute_queue(today, tuned, sw)
                     if phases.shape_unit(*q[:2]) not in part.data["done"]]
            for i, (n, k, m, cfg, _) in enumerate(queue):
                if time.time() - t0 > args.cute_budget_s:
                    part.skip("compile:cute", f"compile budget {args.cute_budget_s:.0f} s spent",
                              rows=[list(q[:3]) for q in queue[i:]])
                    break
                try:
                    kernels.cute_compile(m, cfg)
                    cute_ok.append([n, k, m, list(cfg)])
                except Exception as exc:
                    print(f"[figures] cute {n}x{k} M{m} {cfg}: {exc!r}"[:200], flush=True)
        part.data["compile_s"]["cute"] = round(time.time() - t0, 1)
        th.join()
        part.data["compile_s"]["swap_ab"] = pre.get("s")
        if "error" in pre:
            part.data["swap_ab_precompile_error"] = pre["error"]
        part.data.setdefault("cute_queue", [list(q) for q in queue])
        part.data["cute_timed"] = cute_ok
        print(f"[figures] compiled {part.data['compile_s']}; CuTe rows {len(cute_ok)} of "
              f"{len(queue)}", flush=True)
        part.finish("compile:core")
    ctx["cute_ok"] = {tuple(r[:3]): tuple(r[3]) for r in part.data.get("cute_timed", [])}
    if part.start("baselines", BASELINE_LIMIT_S):
        part.data["read_bw_TBps"] = round(timing.read_bandwidth_Bps() / 1e12, 3)
        dummy = torch.randn(1, 64, dtype=torch.bfloat16, device="cuda")
        part.data["trivial_us"] = {f"pdl={p}": round(timing.time_us(
            candidates.trivial(p), [dummy], [dummy] * 64, replays=15), 3) for p in (False, True)}
        print(f"[figures] read bw {part.data['read_bw_TBps']} TB/s; trivial "
              f"{part.data['trivial_us']}", flush=True)
        part.finish("baselines")


def setup_compiled(args, part: Part, ctx: dict, backend: str) -> None:
    """Compile every ll_bf16 / tinygemm variant the phase will time, within the budget."""
    from k3lab import candidates

    keys = []
    for n, k in ctx["shapes"]:
        for m in shp.M_RANGE:
            cfgs = phases.ll_configs(n, k, m) if backend == "ll_bf16" else [None]
            for cfg in cfgs:
                # split-K is shape-dynamic, the dot-product kernel compiles per (M, K).
                key = (cfg, m, k) if cfg and cfg[0] == "dotprod" else (cfg, 0, 0)
                if key not in keys:
                    keys.append(key)
    spent = 0.0
    for cfg, m, k in keys:
        unit = f"compile:{backend}:{cfg}:M{m}:K{k}"
        if spent > args.compile_budget_s:
            part.skip(unit, f"compile budget {args.compile_budget_s:.0f} s spent")
            continue
        # A compile past what is left of the budget (+ slack) is killed and skipped.
        if not part.start(unit, min(COMPILE_LIMIT_S, args.compile_budget_s - spent + 15.0)):
            continue
        t = time.time()
        try:
            candidates.warm(backend, cfg, max(m, 1), k or 2048)
            part.data.setdefault("compiled", []).append(_compiled_key(cfg, m, k))
        except Exception as exc:
            part.data["skipped"].append({"unit": unit, "reason": f"compile failed: {exc!r}"[:200]})
        spent += time.time() - t
        part.data["compile_s"][backend] = round(spent, 1)
        print(f"[figures] {unit}: {time.time() - t:.1f} s", flush=True)
        part.finish(unit)
    ctx["compiled"] = {tuple(c) for c in part.data.get("compiled", [])}


def _compiled_key(cfg, m: int, k: int) -> list:
    """JSON-able name of one compiled variant (split-K is shape-dynamic: M = K = 0)."""
    if cfg and cfg[0] == "dotprod":
        return [json.dumps(list(cfg)), m, k]
    return [json.dumps(None if cfg is None else list(cfg)), 0, 0]


def plan_for(phase: str, ctx: dict, n: int, k: int, m: int, ours) -> list:
    """``[(backend, cfg)]`` this phase times on one (shape, M)."""
    if phase == "core":
        plan = [("swap_ab", ours)] if ours else []
        if (n, k, m) in ctx["cute_ok"]:
            plan.append(("cute", list(ctx["cute_ok"][(n, k, m)])))
        return plan
    cfgs = [None] if phase == "tinygemm" else phases.ll_configs(n, k, m)
    return [(phase, None if cfg is None else list(cfg)) for cfg in cfgs
            if tuple(_compiled_key(cfg, m, k)) in ctx["compiled"]]


def pick_ours(ctx, n, k, ws, gen) -> tuple[list | None, list]:
    """Our config for ``n x k``, the fastest at M = 16 of the seeded space (pass 1), and
    ``[[cfg, µs or None], ...]`` of every config timed for the pick."""
    import torch

    timing = ctx["timing"]
    x16 = [torch.randn(16, k, generator=gen, dtype=torch.bfloat16, device="cuda")]
    ref16 = timing.ref64(x16[0], ws[0])
    seeds = ctx["seeds"]
    # A shape the sweep never saw (added to shapes.py since) gets the whole space.
    space = tiles.seeded(n, k, seeds[(n, k)]) if (n, k) in seeds else tiles.candidates(n, k)
    space += tiles.ragged(n, k)  # balance.py: faster on 19 of 24 shapes, by 2-25% (run balance2)
    pick, tried = [], []
    for cfg in space:
        us, _, _ = measure(timing, ctx["fn_for"]("swap_ab", cfg, 0), x16, ws, ref16, 7)
        tried.append([list(cfg), us])
        if us:
            pick.append((us, cfg))
    return (list(min(pick)[1]) if pick else None), tried


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--phase", required=True, choices=[p.name for p in phases.PHASES])
    ap.add_argument("--part", required=True, help="this phase's part JSON (resumed if present)")
    ap.add_argument("--progress", required=True, help="progress file the runner watches")
    ap.add_argument("--skip", action="append", default=[], help="a unit not to start")
    ap.add_argument("--sweep", required=True, help="our earlier sweep JSON (seeds)")
    ap.add_argument("--tune", action="append", required=True,
                    help="tuner JSON(s) behind today's table (CuTe rows' earlier times)")
    ap.add_argument("--table", required=True, help="today's SM90 data module")
    ap.add_argument("--cute-budget-s", type=float, default=60.0)
    ap.add_argument("--compile-budget-s", type=float, default=60.0,
                    help="ll_bf16 / tinygemm compiles, all together")
    ap.add_argument("--deadline-s", type=float, default=300.0)
    ap.add_argument("--shape", action="append", default=[])
    ap.add_argument("--run-id", default=os.environ.get("K3_RUN_ID", "local"))
    args = ap.parse_args(argv)
    t_end = time.time() + args.deadline_s
    part = Part(args.part, args.progress, args.phase, args.skip)
    part.start("startup", phases.STARTUP_LIMIT_S)

    from k3lab import candidates, timing
    import torch

    sel = [tuple(map(int, s.lower().split("x"))) for s in args.shape] or list(shp.SHAPES)
    ctx: dict = {"timing": timing, "shapes": phases.shape_order(args.phase, sel)}
    backends = next(p.backends for p in phases.PHASES if p.name == args.phase)
    if "provenance" not in part.data:
        part.data["provenance"] = provenance(args.run_id)
        part.data["available"] = {b: candidates.available(b) for b in backends}
        part.data["criteria"] = {"win_both_passes": winners.WIN, "pass1_replays": 7,
                                 "pass2_replays": 15}
        part.data["method"] = {
            "timing": "k3lab/timing.py time_us: CUDA graph >= 12 calls, >= 256 MiB rotating "
                      "weights, median; pass 1 7 replays, pass 2 15 (fresh x); each phase "
                      "times cuBLAS next to its own candidates", "win_both_passes": winners.WIN,
            "sweep": os.path.basename(args.sweep)}
    print(f"[figures] {args.phase}: {part.data['provenance']} available "
          f"{part.data['available']}", flush=True)
    part.finish("startup")
    fns: dict = {}

    def fn_for(backend, cfg, m):
        key = (backend, None if cfg is None else tuple(cfg), m if backend in ("cute", "ll_bf16") else 0)
        if key not in fns:
            if backend == "swap_ab":
                fns[key] = candidates.swap_ab(cfg)
            elif backend == "cute":
                from k3lab import kernels

                fns[key] = kernels.cute_fn(m, tuple(cfg))
            else:
                fns[key] = candidates.routed(backend, cfg, m)
        return fns[key]

    ctx["fn_for"] = fn_for
    if not any(part.data["available"].values()):
        part.skip(f"phase:{args.phase}", f"{'/'.join(backends)} not available here")
        return 0
    if args.phase == "core":
        setup_core(args, part, ctx)
    else:
        setup_compiled(args, part, ctx, backends[0])
    bw = part.data.get("read_bw_TBps")  # None only if the baselines unit was killed
    rot = timing.RotatingWeights(max(shp.weight_bytes(n, k) for n, k in ctx["shapes"]))
    longest = 3.0
    for n, k in ctx["shapes"]:
        unit = phases.shape_unit(n, k)
        if time.time() + 1.5 * longest > t_end and unit not in part.data["done"]:
            part.skip(unit, f"phase deadline ({args.deadline_s:.0f} s) reached")
            continue
        if not part.start(unit, SHAPE_LIMIT_S):
            continue
        t0 = time.time()
        ws = rot.views(n, k)
        gen = torch.Generator(device="cuda").manual_seed(n * 31 + k)
        ours = None
        if args.phase == "core":
            ours, tried = pick_ours(ctx, n, k, ws, gen)
            part.data.setdefault("ours_pick_m16_us", {})[f"{n}x{k}"] = tried
        for m in shp.M_RANGE:
            plan = plan_for(args.phase, ctx, n, k, m, ours)
            if not plan:
                continue
            row = time_row(ctx, n, k, m, plan, ws, gen)
            if args.phase == "core":
                row.update(label=shp.SHAPES.get((n, k), ("",))[0],
                           weight_bytes=shp.weight_bytes(n, k),
                           roof_us=bw and round(shp.roof_us(n, k, m, bw * 1e12), 3),
                           today=list(ctx["today"].get((n, k), {}).get(m, ("cublas", None))))
            part.data["rows"].append(row)
        longest = max(longest, time.time() - t0)
        done = [r for r in part.data["rows"] if (r["N"], r["K"]) == (n, k)]
        best = [min([c["us"][1] or c["us"][0] or 1e9 for c in r["candidates"]]) for r in done]
        print(f"[figures] {args.phase} {n}x{k}: {len(done)} rows, best vs cuBLAS "
              f"{min((r['cublas_us'][1] / b for r, b in zip(done, best)), default=0):.2f}-"
              f"{max((r['cublas_us'][1] / b for r, b in zip(done, best)), default=0):.2f}x "
              f"({time.time() - t0:.1f} s)", flush=True)
        part.finish(unit)
    return 0


if __name__ == "__main__":
    sys.exit(main())
