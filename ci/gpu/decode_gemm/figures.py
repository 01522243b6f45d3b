"""One H200 run: every SM90 shape x M 1..16 x every decode-GEMM backend (GPU).

Per (shape, M), in one process and one run: cuBLAS; ours (swap-AB; the config picked
per shape in this run from ``tiles.seeded``: the earlier sweep's best three plus the
16-row tiles); vLLM's CuTe skinny GEMM at today's table config where :func:`winners.cute_queue`
ranks it worth re-timing (until ``--cute-budget-s`` of compiling is spent); vLLM's
``ll_bf16`` (+ cast to bf16) at a few pinned configs; FlashInfer's ``tinygemm_bf16``
where installed; the read roof ``min_bytes_moved / read bandwidth`` (a bf16 reduction
over 4 GiB at the start of the run) and the fastest launch of a trivial kernel in a
graph (PDL on and off).

Timing is ``timing.time_us`` (CUDA graph of >= 12 calls over >= 256 MiB of rotating
weight copies, median of the replays). Pass 1: every candidate, 7 replays, after a
float64 check (rel. err <= 1e-2); pass 2: fresh activations, cuBLAS, ours and every
other candidate within ``winners.WIN`` of cuBLAS in pass 1, 15 replays. ``winners.decide``
then picks each row's winner. Then, with ``--render`` and ``--pytest``, the SM90 table
is rendered from this JSON into the installed tree and the GPU numerics tests run in
this same process (so CuTe configs compiled here are not compiled again).

Usage (after ``install.sh``, see ``ci/gpu/README.md``)::

    python ci/gpu/decode_gemm/figures.py --out OUT.json --sweep SWEEP.json \\
        --tune ci/gpu/results/tune_sm90.json --table TABLE.py [--render OUT.py] [--pytest FILE]
"""

from __future__ import annotations

import argparse
import importlib
import importlib.metadata as md
import json
import os
import runpy
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.dirname(HERE))

import candidates  # noqa: E402
import shapes as shp  # noqa: E402
import sweep  # noqa: E402
import tiles  # noqa: E402
import winners  # noqa: E402

REL_TOL = 1e-2
# ll_bf16 variants timed: its split-K kernel is shape-dynamic (one compile each); the
# dot-product kernel compiles per (M, K), so only where the probe saw it win (K = 7168, M <= 2).
LL_SPLITK = ("splitk", 2, 4)
LL_SPLITK_NARROW = ("splitk", 4, 4)  # N <= 1536: the probe's best there
LL_DOTPROD = ("dotprod", 256)


def _ver(dist: str) -> str:
    try:
        return md.version(dist)
    except md.PackageNotFoundError:
        return "absent"


def provenance(run_id: str) -> dict:
    p = sweep.provenance(run_id)
    p.update(cutlass_dsl=_ver("nvidia-cutlass-dsl"), flashinfer=_ver("flashinfer-python"),
             vllm=_ver("vllm"), tool="ci/gpu/decode_gemm/figures.py")
    return p


def ll_configs(n: int, k: int, m: int) -> list:
    """ll_bf16 variants for one row, inside the domain vLLM's own dispatch uses it in.

    Its split-K kernel only where vLLM dispatches it (K >= 2048): with fewer K tiles
    than splits it hung the H200 (K = 128, split_k = 2; run h200-20261130-decode), and
    ``low_latency_gemm`` now refuses such a row.
    """
    cfgs = []
    if k >= 2048:
        cfgs += [LL_SPLITK] + ([LL_SPLITK_NARROW] if n <= 1536 else [])
    if k == 7168 and m <= 2:
        cfgs.append(LL_DOTPROD)
    return cfgs


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--sweep", required=True, help="our earlier sweep JSON (seeds)")
    ap.add_argument("--tune", required=True, help="the CuTe tuner JSON behind today's table")
    ap.add_argument("--table", required=True, help="today's SM90 data module")
    ap.add_argument("--cute-budget-s", type=float, default=40.0)
    ap.add_argument("--deadline-s", type=float, default=330.0)
    ap.add_argument("--render", help="write the SM90 table rendered from this run here")
    ap.add_argument("--pytest", help="then run this GPU test file in this process")
    ap.add_argument("--shape", action="append", default=[])
    ap.add_argument("--run-id", default=os.environ.get("K3_RUN_ID", "local"))
    args = ap.parse_args(argv)
    t_end = time.time() + args.deadline_s

    import kernels
    import timing
    import torch

    sel_shapes = [tuple(map(int, s.lower().split("x"))) for s in args.shape] or list(shp.SHAPES)
    sw = json.load(open(args.sweep))
    seeds = {(s["N"], s["K"]): [c["cfg"] for c in sorted(
        (c for c in s["configs"] if c["M"] == 16 and c["status"] == "ok"),
        key=lambda c: c["us"])][:3] for s in sw["shapes"]}
    today = runpy.run_path(args.table)["ROWS"]
    res = {"provenance": provenance(args.run_id), "rows": [],
           "criteria": {"win_both_passes": winners.WIN, "pass1_replays": 7, "pass2_replays": 15},
           "method": {"timing": "ci/gpu/timing.py time_us: CUDA graph >= 12 calls, >= 256 MiB "
                                "rotating weights, median; pass 1 7 replays, pass 2 15 (fresh x)",
                      "win_both_passes": winners.WIN, "sweep": os.path.basename(args.sweep)}}
    res["available"] = {b: candidates.available(b) for b in ("cute", "ll_bf16", "tinygemm")}
    print(f"[figures] {res['provenance']} available {res['available']}", flush=True)

    # Our configs compile in parallel processes; CuTe's on this CPU in queue order.
    res["compile_s"] = {"swap_ab": round(sweep.precompile({k for _, k in sel_shapes}, 14), 1)}
    cute_ok: dict = {}
    queue = []
    if res["available"]["cute"]:
        queue = winners.cute_queue(today, json.load(open(args.tune)), sw)
        t0 = time.time()
        for n, k, m, cfg, _ in queue:
            if time.time() - t0 > args.cute_budget_s:
                break
            try:
                kernels.cute_compile(m, cfg)
                cute_ok[(n, k, m)] = cfg
            except Exception as exc:
                print(f"[figures] cute {n}x{k} M{m} {cfg}: {exc!r}"[:200], flush=True)
        res["compile_s"]["cute"] = round(time.time() - t0, 1)
    res["cute_queue"] = [list(q) for q in queue]
    res["cute_timed"] = [[n, k, m] for (n, k, m) in cute_ok]
    print(f"[figures] compiled {res['compile_s']}; CuTe rows {len(cute_ok)} of {len(queue)} queued",
          flush=True)

    bw = timing.read_bandwidth_Bps()
    res["read_bw_TBps"] = round(bw / 1e12, 3)
    dummy = torch.randn(1, 64, dtype=torch.bfloat16, device="cuda")
    res["trivial_us"] = {f"pdl={p}": round(timing.time_us(candidates.trivial(p), [dummy],
                                                          [dummy] * 64, replays=15), 3)
                         for p in (False, True)}
    rot = timing.RotatingWeights(max(shp.weight_bytes(n, k) for n, k in sel_shapes))
    print(f"[figures] read bw {res['read_bw_TBps']} TB/s; trivial {res['trivial_us']}", flush=True)

    fns: dict = {}

    def fn_for(backend, cfg, m):
        key = (backend, None if cfg is None else tuple(cfg), m if backend == "cute" else 0)
        if key not in fns:
            if backend == "swap_ab":
                fns[key] = candidates.swap_ab(cfg)
            elif backend == "cute":
                fns[key] = kernels.cute_fn(m, tuple(cfg))
            else:
                fns[key] = candidates.routed(backend, cfg, m)
        return fns[key]

    def measure(fn, xs, ws, ref, replays):
        try:
            err = timing.rel_err(fn(xs[0], ws[0]), ref)
            if not err <= REL_TOL:
                return None, err, "wrong"
            return round(timing.time_us(fn, xs, ws, replays=replays), 3), err, "ok"
        except Exception as exc:
            return None, None, f"error: {type(exc).__name__}: {exc}"[:200]

    for n, k in sel_shapes:
        if time.time() > t_end:
            print(f"[figures] deadline: stopping before {n}x{k}", flush=True)
            break
        t0 = time.time()
        ws = rot.views(n, k)
        gen = torch.Generator(device="cuda").manual_seed(n * 31 + k)
        x16 = [torch.randn(16, k, generator=gen, dtype=torch.bfloat16, device="cuda")]
        ref16 = timing.ref64(x16[0], ws[0])
        pick = []
        # A shape the sweep never saw (added to shapes.py since) gets the whole space.
        ours_space = tiles.seeded(n, k, seeds[(n, k)]) if (n, k) in seeds else tiles.candidates(n, k)
        for cfg in ours_space:
            us, err, st = measure(fn_for("swap_ab", cfg, 0), x16, ws, ref16, 7)
            if us:
                pick.append((us, cfg))
        ours = list(min(pick)[1]) if pick else None
        for m in shp.M_RANGE:
            xs1 = [torch.randn(m, k, generator=gen, dtype=torch.bfloat16, device="cuda")]
            xs2 = [torch.randn(m, k, generator=gen, dtype=torch.bfloat16, device="cuda")
                   for _ in range(4)]
            ref1, ref2 = timing.ref64(xs1[0], ws[0]), timing.ref64(xs2[0], ws[0])
            row = {"N": n, "K": k, "M": m, "label": shp.SHAPES.get((n, k), ("",))[0],
                   "weight_bytes": shp.weight_bytes(n, k),
                   "roof_us": round(shp.min_bytes_moved(n, k, m) / bw * 1e6, 3),
                   "today": list(today.get((n, k), {}).get(m, ("cublas", None))),
                   "candidates": []}
            plan = [("swap_ab", ours)] if ours else []
            if (n, k, m) in cute_ok:
                plan.append(("cute", list(cute_ok[(n, k, m)])))
            if res["available"]["ll_bf16"]:
                plan += [("ll_bf16", list(c)) for c in ll_configs(n, k, m)]
            if res["available"]["tinygemm"]:
                plan.append(("tinygemm", None))
            c1 = round(timing.time_us(candidates.cublas, xs1, ws, replays=7), 3)
            for backend, cfg in plan:
                us, err, st = measure(fn_for(backend, cfg, m), xs1, ws, ref1, 7)
                row["candidates"].append({"backend": backend, "cfg": cfg, "us": [us, None],
                                          "relerr": err, "status": st})
            c2 = round(timing.time_us(candidates.cublas, xs2, ws, replays=15), 3)
            row["cublas_us"] = [c1, c2]
            ranked = sorted((c for c in row["candidates"] if c["us"][0]), key=lambda c: c["us"][0])
            again = [c for c in ranked if c["backend"] == "swap_ab"]
            again += [c for c in ranked if c["backend"] != "swap_ab"
                      and c1 / c["us"][0] >= winners.WIN][:3]
            for c in again:
                us, err, st = measure(fn_for(c["backend"], c["cfg"], m), xs2, ws, ref2, 15)
                c["us"][1] = us
                if st != "ok":
                    c["status"] = f"pass 2: {st}"
            res["rows"].append(row)
        done = [r for r in res["rows"] if (r["N"], r["K"]) == (n, k)]
        best = [min((c["us"][1] or 1e9) for c in r["candidates"]) if r["candidates"] else 1e9
                for r in done]
        print(f"[figures] {n}x{k} ours {ours}: roof/best "
              f"{min(r['roof_us'] / b for r, b in zip(done, best)):.2f}-"
              f"{max(r['roof_us'] / b for r, b in zip(done, best)):.2f} "
              f"({time.time() - t0:.1f} s)", flush=True)
        winners.decide(res)
        with open(args.out, "w") as f:
            json.dump(res, f, indent=1, sort_keys=True)
    winners.decide(res)
    with open(args.out, "w") as f:
        json.dump(res, f, indent=1, sort_keys=True)
    print("[figures] summary " + json.dumps(res["summary"]), flush=True)
    if args.render:
        render_into(res, args.render)
    if args.pytest:
        return run_pytest(args.pytest, os.path.dirname(args.out))
    return 0


def render_into(res: dict, path: str) -> None:
    """Write the SM90 table rendered from ``res`` to ``path`` and reload the overlay."""
    import render_table

    with open(path, "w") as f:
        f.write(render_table.render(res, "ci/gpu/results/decode_gemm_sm90.json"))
    for name in ("vllm.models.kimi_k3.nvidia.low_latency_gemm_sm90",
                 "vllm.models.kimi_k3.nvidia.low_latency_gemm"):
        if name in sys.modules:
            importlib.reload(sys.modules[name])
    print(f"[figures] rendered the table into {path}", flush=True)


def run_pytest(test_file: str, out_dir: str) -> int:
    import pytest

    return pytest.main([test_file, "-p", "no:cacheprovider", "-q", "-rs", "--tb=short",
                        f"--junitxml={os.path.join(out_dir, 'pytest_gpu.xml')}"])


if __name__ == "__main__":
    sys.exit(main())
