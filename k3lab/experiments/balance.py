"""Ragged swap-AB tiles against the plain ones, and the read floor, per SM90 shape (GPU).

For every shape, in one run, with ``timing.time_us`` (CUDA graph of >= 12 calls over
>= 256 MiB of rotating weight copies, median):

* cuBLAS and our kernel at the sweep's best config (``--sweep``) at M = 1, 8 and 16;
* every ``tiles.ragged`` config at M = 16 (7 replays, after a float64 check), then the
  best three again at M = 1, 8 and 16 (15 replays, fresh activations);
* the **read floor**: the fastest streaming read of exactly the weight's bytes (each
  CTA sums a contiguous slice with 16-byte loads from several streams at once; grids
  of 1-4 CTAs per SM), timed the same way. No GEMM that reads the weight once from HBM
  can beat it in this harness: it pays the same launch, DRAM latency and tail.

Writes ``--out`` JSON after every shape (provenance, read bandwidth, trivial-launch
floor, every timing). Usage:
``python -m k3lab.experiments.balance --sweep SWEEP.json --out OUT.json [--shape NxK]``.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

from k3lab import candidates, tiles
from k3lab import shapes as shp

REL_TOL = 1e-2
# (streams, elements per stream per step, warps): 16 KB per CTA per step at 4 warps.
READ_TILES = ((8, 1024, 4), (16, 512, 4), (4, 2048, 8))
READ_WAVES = (1, 2, 3, 4)
# (block_k, num_stages, num_warps) tried on the best ragged (block_n, split_k, rows) of
# pass 1: deeper pipelines put more of a CTA's slice in flight before its first MMA;
# shallower ones (<= ~100 KB of shared memory) let the next GEMM's CTAs, launched early
# by PDL, sit on an SM next to this one's and prefetch while it drains.
PIPELINES = ((128, 8, 4), (128, 10, 4), (128, 8, 8), (128, 10, 8), (64, 12, 4), (64, 16, 4),
             (64, 12, 8), (256, 5, 4), (256, 6, 4), (256, 5, 8),
             (128, 3, 4), (128, 4, 4), (128, 5, 4), (64, 6, 4), (64, 8, 4), (256, 2, 4))
SMEM_BYTES = 227 * 1024  # an SM90 CTA's shared-memory limit


def pipeline_variants(cfg) -> list[tuple]:
    """``cfg``'s (block_n, split_k, rows) at every ``PIPELINES`` entry that fits in shared memory."""
    bn, _, split, _, _, rows = cfg
    out = []
    for bk, stages, warps in PIPELINES:
        if stages * (bn + 16) * bk * 2 <= SMEM_BYTES - 8192:
            out.append((bn, bk, split, warps, stages, rows))
    return out
_read = {}


def read_kernel():
    """The streaming-read Triton kernel (built on first use: Triton is GPU-side only)."""
    if "k" in _read:
        return _read["k"]
    import triton
    import triton.language as tl

    @triton.jit(do_not_specialize=["per_cta"])
    def _sum_slices(w_ptr, out_ptr, numel, per_cta, STREAMS: tl.constexpr, BLOCK: tl.constexpr):
        # CTA i sums w[i * per_cta : (i + 1) * per_cta] as STREAMS interleaved sub-slices,
        # so every step has STREAMS * BLOCK * 2 bytes of independent loads in flight.
        pid = tl.program_id(0)
        lo = pid.to(tl.int64) * per_cta
        hi = tl.minimum(lo + per_cta, numel)
        sub = tl.cdiv(per_cta, STREAMS)
        offs = lo + tl.arange(0, STREAMS)[:, None] * sub + tl.arange(0, BLOCK)[None, :]
        end = tl.minimum(lo + (tl.arange(0, STREAMS)[:, None] + 1) * sub, hi)
        acc = tl.zeros((STREAMS, BLOCK), dtype=tl.float32)
        for _ in range(0, sub, BLOCK):
            acc += tl.load(w_ptr + offs, mask=offs < end, other=0.0).to(tl.float32)
            offs += BLOCK
        tl.store(out_ptr + pid, tl.sum(acc))

    _read["k"] = _sum_slices
    return _sum_slices


def read_fn(ctas: int, streams: int, block: int, warps: int):
    """``f(x, w)``: the streaming read of ``w`` over ``ctas`` CTAs (x is ignored)."""
    import torch

    kern = read_kernel()

    def f(x, w, residual=None):
        out = torch.empty(ctas, dtype=torch.float32, device=w.device)
        per = -(-w.numel() // ctas)
        per = -(-per // (streams * 8)) * (streams * 8)  # 16-byte aligned sub-slices
        kern[(ctas,)](w, out, w.numel(), per, STREAMS=streams, BLOCK=block, num_warps=warps,
                      num_stages=3)
        return out

    return f


def precompile(sel, workers: int) -> float:
    """``sweep.precompile`` of the shapes' K plus the ``PIPELINES`` tiles (ragged, PDL)."""
    from k3lab.bench.decode_gemm import sweep

    extra = set()
    for n, k in sel:
        for cfg in tiles.ragged(n, k):
            for bn, bk, _, warps, stages, _ in pipeline_variants(cfg):
                even_k = 4 * bk if k % bk == 0 else 4 * bk + 64
                extra.add((bn, bk, warps, stages, even_k, True, False, bn - 1))
    return sweep.precompile({k for _, k in sel}, workers, extra)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--sweep", required=True, help="sweep JSON: the plain config per shape")
    ap.add_argument("--shape", action="append", default=[])
    ap.add_argument("--workers", type=int, default=14)
    ap.add_argument("--deadline-s", type=float, default=420.0)
    ap.add_argument("--run-id", default=os.environ.get("K3_RUN_ID", "local"))
    args = ap.parse_args(argv)
    t_start = time.time()

    from k3lab import timing
    from k3lab.bench.decode_gemm import sweep
    import torch

    plain = {(s["N"], s["K"]): s["best"] for s in json.load(open(args.sweep))["shapes"]}
    sel = [tuple(map(int, s.lower().split("x"))) for s in args.shape] or list(shp.SHAPES)
    res = {"provenance": {**sweep.provenance(args.run_id), "tool": "k3lab/experiments/balance.py"},
           "method": {"timing": "k3lab/timing.py time_us: CUDA graph >= 12 calls, >= 256 MiB "
                                "rotating weights, median; pass 1 7 replays (M=16), pass 2 15",
                      "read_tiles": READ_TILES, "read_waves": READ_WAVES}}
    res["compile_s"] = round(precompile(sel, args.workers), 1)
    bw = timing.read_bandwidth_Bps()
    res["read_bw_TBps"] = round(bw / 1e12, 3)
    rot = timing.RotatingWeights(max(shp.weight_bytes(n, k) for n, k in sel))
    dummy = torch.randn(1, 64, dtype=torch.bfloat16, device="cuda")
    res["trivial_us"] = round(timing.time_us(candidates.trivial(True), [dummy], [dummy] * 64,
                                             replays=15), 3)
    print(f"[balance] compiled {res['compile_s']} s, bw {res['read_bw_TBps']} TB/s, "
          f"trivial {res['trivial_us']} µs", flush=True)
    res["shapes"] = []
    for n, k in sel:
        if time.time() - t_start > args.deadline_s:
            res.setdefault("cut", []).append([n, k])
            continue
        t0 = time.time()
        ws = rot.views(n, k)
        gen = torch.Generator(device="cuda").manual_seed(n * 13 + k)
        xs = {m: [torch.randn(m, k, generator=gen, dtype=torch.bfloat16, device="cuda")
                  for _ in range(4)] for m in (1, 8, 16)}
        refs = {m: timing.ref64(xs[m][0], ws[0]) for m in xs}

        def timed(f, m, replays):
            err = timing.rel_err(f(xs[m][0], ws[0]), refs[m])
            if not err <= REL_TOL:
                return None, err
            return round(timing.time_us(f, xs[m], ws, replays=replays), 3), err

        rec = {"N": n, "K": k, "MB": round(shp.weight_bytes(n, k) / 1e6, 2),
               "roof_us": {m: round(shp.roof_us(n, k, m, bw), 3) for m in xs}}
        rec["cublas_us"] = {m: timed(candidates.cublas, m, 15)[0] for m in xs}
        cfg = plain.get((n, k))
        rec["plain"] = {"cfg": cfg, "us": {m: timed(candidates.swap_ab(cfg), m, 15)[0]
                                           for m in xs} if cfg else None}
        p1 = []
        for c in tiles.ragged(n, k):
            try:
                us, err = timed(candidates.swap_ab(c), 16, 7)
            except Exception as exc:  # a config that cannot compile is a result
                us, err = None, f"{type(exc).__name__}: {exc}"[:200]
            p1.append({"cfg": list(c), "us16": us, "relerr": err})
        lead = sorted((r for r in p1 if r["us16"]), key=lambda r: r["us16"])[:2]
        seen = {tuple(r["cfg"]) for r in p1}
        for c in [v for r in lead for v in pipeline_variants(r["cfg"])]:
            if c in seen:
                continue
            seen.add(c)
            try:
                us, err = timed(candidates.swap_ab(c), 16, 7)
            except Exception as exc:
                us, err = None, f"{type(exc).__name__}: {exc}"[:200]
            p1.append({"cfg": list(c), "us16": us, "relerr": err, "deep": True})
        rec["ragged_pass1"] = p1
        top = sorted((r for r in p1 if r["us16"]), key=lambda r: r["us16"])[:3]
        rec["ragged_best"] = [{"cfg": r["cfg"], "us": {m: timed(candidates.swap_ab(r["cfg"]), m, 15)[0]
                                                        for m in xs}} for r in top]
        floor = []
        for streams, block, warps in READ_TILES:
            for waves in READ_WAVES:
                ctas = waves * tiles.SMS
                us = timing.time_us(read_fn(ctas, streams, block, warps), xs[1], ws, replays=15)
                floor.append({"ctas": ctas, "streams": streams, "block": block, "warps": warps,
                              "us": round(us, 3)})
        # The reduction that defines the roof (timing.read_bandwidth_Bps), on these bytes.
        floor.append({"torch_sum": True, "us": round(timing.time_us(
            lambda x, w: w.sum(dtype=torch.float32), xs[1], ws, replays=15), 3)})
        rec["read"] = floor
        rec["read_floor_us"] = min(r["us"] for r in floor)
        rec["seconds"] = round(time.time() - t0, 1)
        res["shapes"].append(rec)
        best_r = min((min(v for v in r["us"].values() if v) for r in rec["ragged_best"]),
                     default=None)
        print(f"[balance] {n}x{k} {rec['MB']} MB roof {rec['roof_us'][16]} floor "
              f"{rec['read_floor_us']} cuBLAS {rec['cublas_us']} plain "
              f"{rec['plain']['us']} ragged-best {best_r} ({rec['seconds']} s)", flush=True)
        with open(args.out, "w") as f:
            json.dump(res, f, indent=1, sort_keys=True)
    with open(args.out, "w") as f:
        json.dump(res, f, indent=1, sort_keys=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
