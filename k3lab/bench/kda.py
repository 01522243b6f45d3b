"""Benchmark of Kimi-K3's KDA decode projections at TP8 on one GPU (prints figures, asserts nothing).

Per token count M, in one process and one run:

* (A) vLLM v0.28.0 as shipped: the packed ``[6288, 7168]`` GEMM, then F_B ``[1536, 128]``
  on the strided F_A slice, both cuBLAS (``torch.mm``);
* (B) our sequential path: the same order, each GEMM through the device's low-latency
  table (``kda_projection._table_gemm``, what the planned linear methods run);
* (C) our overlap: ``kda_projection.run_kda_projection_overlap`` with a second stream of
  the default priority (what vLLM's aux stream is);
* (D) the same with the chain on ``kda_projection.high_priority_aux_stream``;
* F_B alone on the strided F_A three ways (cuBLAS; a packed copy, then the table's
  kernel; the table's kernel on the row-strided view): the figures behind the guard's
  row-stride rule;

each checked against a float64 reference first, then timed with ``timing.time_us``
(CUDA-graph capture of >= 12 calls cycling through layer copies whose weights total
>= 256 MiB, over 4x the H200's 60 MiB L2; median of ``--replays`` replays) in two
passes, the second with fresh activations and the variants in reverse order. Roofs:
``kda_report.bytes_moved`` over the read bandwidth of a reduction measured in the same run.
Conclusions (which overlap, where it pays, against the roof): ``kda_report.derive``. The
JSON and markdown are rewritten after every M, so a run stopped by its deadline keeps
what it measured.

Usage (GPU machine, bundle installed, overlay copied into the tree)::

    python -m k3lab.bench.kda --json OUT.json --md OUT.md [--m 1-16] [--deadline-s 240]
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time

from k3lab.bench import kda_report as rp
from k3lab.provenance import provenance

DEVICE = "cuda"  # a CPU dry run of this script swaps in "cpu" with stand-in timers
F_A_ROWS = slice(rp.QKVG_N, rp.QKVG_N + rp.HEAD_DIM)
BETA_ROWS = slice(rp.QKVG_N + rp.HEAD_DIM, rp.QKVG_N + rp.HEAD_DIM + rp.F_B_N // rp.HEAD_DIM)


def _stream_and_events():
    """The overlap's second stream and its (fork, join) events."""
    import torch

    return torch.cuda.Stream(), (torch.cuda.Event(), torch.cuda.Event())


def _ms(text: str) -> list[int]:
    if "-" in text:
        lo, hi = map(int, text.split("-"))
        return list(range(lo, hi + 1))
    return [int(v) for v in text.split(",")]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", required=True)
    ap.add_argument("--md", required=True)
    ap.add_argument("--m", default="1-16", help="token counts, e.g. 1-16 or 1,2,4")
    ap.add_argument("--replays", type=int, default=15)
    ap.add_argument("--deadline-s", type=float, default=240.0)
    args = ap.parse_args(argv)
    t_end = time.time() + args.deadline_s

    from k3lab import timing
    import torch

    from vllm.models.kimi_k3.nvidia import kda_projection as kp
    from vllm.models.kimi_k3.nvidia import low_latency_gemm_dispatch as llg

    gen = torch.Generator(device=DEVICE).manual_seed(2026)

    def randn(*shape, scale=1.0):
        return (torch.randn(*shape, generator=gen, device=DEVICE) * scale).to(torch.bfloat16)

    # Layer copies: enough packed + F_B weights to exceed the rotation floor.
    copies = max(4, math.ceil(timing.ROTATE_BYTES / rp.weights_bytes()))
    layers = []
    for _ in range(copies):
        packed = randn(rp.PACKED_N, rp.HIDDEN, scale=rp.HIDDEN**-0.5)
        packed[BETA_ROWS.stop :] = 0  # kda.py zeroes the padding rows
        layers.append((packed, randn(rp.F_B_N, rp.HEAD_DIM, scale=rp.HEAD_DIM**-0.5)))
    f_b_copies = [randn(rp.F_B_N, rp.HEAD_DIM, scale=rp.HEAD_DIM**-0.5)
                  for _ in range(timing.ROTATE_BYTES // (rp.BYTES * rp.F_B_N * rp.HEAD_DIM))]
    aux, events = _stream_and_events()
    high = kp.high_priority_aux_stream(torch.device(DEVICE, torch.cuda.current_device()))

    def split(out, f_b_out):
        return out[:, : rp.QKVG_N], f_b_out, out[:, BETA_ROWS]

    def stock(x, w):
        out = torch.mm(x, w[0].t())
        return split(out, torch.mm(out[:, F_A_ROWS], w[1].t()))

    def sequential(x, w):
        out = kp._table_gemm(x, w[0])
        return split(out, kp._table_gemm(out[:, F_A_ROWS], w[1]))

    def overlap(x, w):
        return kp.run_kda_projection_overlap(x, w[0], w[1], aux, events)

    def overlap_high(x, w):
        return kp.run_kda_projection_overlap(x, w[0], w[1], high, events)

    variants = {"A": stock, "B": sequential, "C": overlap, "D": overlap_high}
    f_b_ways = {
        "cublas_strided": lambda a, w: torch.mm(a, w.t()),
        "copy_then_table": lambda a, w: kp._table_gemm(a.contiguous(), w),
        "table_row_strided": lambda a, w: kp._table_gemm(a, w),
    }

    def reference(x, w):
        out = x.double() @ w[0].double().t()
        return split(out, out[:, F_A_ROWS] @ w[1].double().t())

    def rel(out, ref):
        o = out.double()
        if not torch.isfinite(o).all():
            return math.inf
        return float((o - ref).norm() / ref.norm())

    prov = provenance(os.environ.get("K3_RUN_ID", "kda-bench"))
    bw = timing.read_bandwidth_Bps()
    res = {
        "provenance": prov,
        "read_bw_TBps": round(bw / 1e12, 3),
        "method": (f"CUDA-graph replay of >= {timing.MIN_CALLS} calls over {copies} layer copies "
                   f"({copies * rp.weights_bytes() / 2**20:.0f} MiB of weights), median of "
                   f"{args.replays} replays, two passes (fresh activations, reverse order)"),
        "variants": {"A": "vLLM v0.28.0: packed GEMM + F_B on strided F_A, cuBLAS",
                     "B": "ours sequential: same order, each GEMM through the low-latency table",
                     "C": "ours overlap: QKVG | F_A/beta -> F_B on a second stream (default priority)",
                     "D": "ours overlap, the chain on a high-priority stream (priority -1)"},
        "roof_weights_us": round(rp.roof_us(rp.weights_bytes(), bw), 3),
        "rows": [],
    }

    def write():
        rp.derive(res)
        with open(args.json, "w") as f:
            json.dump(res, f, indent=1, sort_keys=True)
        with open(args.md, "w") as f:
            f.write(rp.markdown(res))

    for m in _ms(args.m):
        if time.time() > t_end:
            print(f"[kda-bench] deadline: stopped before M={m}", flush=True)
            break
        xs1 = [randn(m, rp.HIDDEN) for _ in range(4)]
        xs2 = [randn(m, rp.HIDDEN) for _ in range(4)]
        row = {
            "M": m,
            "roof_us": {v: round(rp.roof_us(rp.bytes_moved(v, m), bw), 3) for v in rp.VARIANTS},
            "routes": {f"{n}x{k}": llg.select_kimi_k3_backend(m, n, k) for n, k in
                       ((rp.PACKED_N, rp.HIDDEN), (rp.QKVG_N, rp.HIDDEN), (rp.FAB_N, rp.HIDDEN),
                        (rp.F_B_N, rp.HEAD_DIM))},
            "relerr": {},
            "us": {v: [] for v in rp.VARIANTS},
        }
        ref = reference(xs1[0], layers[0])
        for v, fn in variants.items():
            row["relerr"][v] = round(max(rel(o, r) for o, r in zip(fn(xs1[0], layers[0]), ref)), 6)
        for order, xs in ((rp.VARIANTS, xs1), (rp.VARIANTS[::-1], xs2)):
            for v in order:
                row["us"][v].append(round(timing.time_us(variants[v], xs, layers, replays=args.replays), 3))
        fabs = [randn(m, rp.FAB_N)[:, : rp.HEAD_DIM] for _ in range(4)]
        row["f_b_alone_us"] = {
            name: round(timing.time_us(fn, fabs, f_b_copies, replays=args.replays), 3)
            for name, fn in f_b_ways.items()
        }
        res["rows"].append(row)
        write()
        figs = " ".join(f"{v} {row['us'][v]}" for v in rp.VARIANTS)
        print(f"[kda-bench] M={m}: {figs} us (roof {row['roof_us']['B']}), routes {row['routes']}, "
              f"err {row['relerr']}, F_B alone {row['f_b_alone_us']}", flush=True)
    write()
    print(rp.markdown(res), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
