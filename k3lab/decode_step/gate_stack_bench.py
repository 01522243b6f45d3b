"""The MoE router gate stacked on ``routed_down`` + the shared ``gate_up``: configs and gain (a benchmark).

``python -m k3lab.decode_step.gate_stack_bench [--out DIR] [--apply-best]`` on a CUDA GPU.
Kimi-K3's latent MoE (TP8) runs three projections of the same normalized ``x``: the router
gate 384x7168 (fp32 logits), ``routed_expert_down_proj`` 3584x7168 and the shared
experts' ``gate_up`` 1536x7168 (bf16). The decode-step replay's "ours" ran the gate alone
(``fused_gemm.gemm``, fp32 out) and the other two as one stacked 5120x7168 weight; this
times, at M = 1, 8, 16 in one run:

* ``stacked``: all three as one 5504x7168 weight through ``fused_gemm.gemm_split_dtype``
  (one launch; fp32 logits, bf16 rest), for each candidate config of :data:`CANDIDATES`;
* ``separate``: the gate at its ``configs.json`` config, then the 5120x7168 stack at its
  config (our plain swap-AB kernel), back to back in one graph (with PDL between them, as
  the replay runs them), and each alone;
* ``plain_5504``: our plain swap-AB kernel (bf16 out everywhere) on the 5504x7168 weight at
  the best stacked config: what the split-dtype epilogue costs over the plain store.

CUDA graph over 8 weight copies (8 x 79 MB, > 4x the 60 MiB L2), median of 9 replays, µs
per call; the roof is the 5504x7168 weight's bytes over the read bandwidth of a reduction
measured in the same run. Writes ``gate_stack_bench.json``; with ``--apply-best`` also
writes the config fastest summed over M = 1, 8, 16 into ``configs.json`` (a device copy of
the tree, so that a replay after it runs that config). Exit 2 without a GPU.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import sys

from k3lab import provenance, timing
from k3lab.decode_step import imports

HERE = pathlib.Path(__file__).resolve().parent
NE, REST, K = 384, 5120, 7168  # gate rows; routed_down (3584) + shared gate_up (1536)
MS = (1, 8, 16)

# 5504 rows: 43 per CTA = 128 CTAs, 42 = 132 (one per SM); the 5120 stack's and the
# 3584 routed_down's configs (64x128 tiles, 6 stages); a deeper pipeline; K steps of 256;
# a 2-way split with 4 stages (two CTAs per SM fit) or 86 full tiles; 32-row tiles. Few:
# each build compiles once, and the run that measured them had about a minute.
CANDIDATES = [
    (64, 128, 1, 4, 6, 43),
    (64, 128, 1, 4, 6, 42),
    (64, 128, 1, 4, 8, 42),
    (64, 256, 1, 4, 4, 42),
    (64, 128, 2, 4, 4, 42),
    (64, 128, 2, 4, 6, 0),
    (32, 128, 1, 4, 6, 0),
]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m k3lab.decode_step.gate_stack_bench")
    ap.add_argument("--out", type=pathlib.Path, default=pathlib.Path(os.environ.get("OUT", ".")))
    ap.add_argument("--apply-best", action="store_true")
    args = ap.parse_args(argv)
    import torch

    if not torch.cuda.is_available():
        print("error: no CUDA GPU", file=sys.stderr)
        return 2
    sab, fg = imports.overlay("swap_ab_gemm"), imports.overlay("fused_gemm")
    cfgs = json.loads((HERE / "configs.json").read_text())
    gate_cfg = sab.SwapAbConfig(*cfgs["configs"][f"{NE}x{K}"])
    rest_cfg = sab.SwapAbConfig(*cfgs["configs"][f"{REST}x{K}"])
    bw = timing.read_bandwidth_Bps(replays=12)
    gen = torch.Generator(device="cuda").manual_seed(21)
    ws = [(torch.randn(NE + REST, K, generator=gen, device="cuda") / K**0.5).to(torch.bfloat16)
          for _ in range(8)]  # fmt: skip
    gates = [w[:NE] for w in ws]  # row slices of a packed weight: packed, same bytes
    rests = [w[NE:] for w in ws]
    doc = {**provenance.environment(), "read_bw_TBps": round(bw / 1e12, 4),
           "roof_us": round(2 * (NE + REST) * K / bw * 1e6, 2),
           "gate_config": list(gate_cfg), "rest_config": list(rest_cfg),
           "method": "CUDA graph over 8 weight copies, median of 9 replays, us per call (per pair "
                     "for separate)", "rows": []}  # fmt: skip

    def us(fn, per=len(ws)):
        try:
            return round(timing.graph_replay_us(fn, fn, per, 9), 2)
        except Exception as ex:  # out of shared memory etc.: a finding, not a crash
            return f"{type(ex).__name__}: {str(ex)[:160]}"

    for m in MS:
        x = torch.randn(m, K, generator=gen, device="cuda").to(torch.bfloat16)
        # numerics once per M: the stacked call against the two separate ones
        lo, hi = fg.gemm_split_dtype(x, ws[0], NE, sab.SwapAbConfig(*CANDIDATES[0]))
        ref_lo = fg.gemm(x, gates[0], gate_cfg, out_dtype=torch.float32)
        ref_hi = sab.swap_ab_gemm(x, rests[0], rest_cfg)
        rec = {"M": m,
               "max_rel_diff_logits": float((lo - ref_lo).abs().max() / ref_lo.abs().max()),
               "max_rel_diff_rest": float((hi.float() - ref_hi.float()).abs().max()
                                          / ref_hi.float().abs().max()),
               "gate_us": us(lambda: [fg.gemm(x, g, gate_cfg, out_dtype=torch.float32) for g in gates]),
               "rest_us": us(lambda: [sab.swap_ab_gemm(x, r, rest_cfg) for r in rests]),
               "separate_us": us(lambda: [(fg.gemm(x, g, gate_cfg, out_dtype=torch.float32),
                                           sab.swap_ab_gemm(x, r, rest_cfg))
                                          for g, r in zip(gates, rests)]),
               "stacked_us": {}}  # fmt: skip
        for c in CANDIDATES:
            cfg = sab.SwapAbConfig(*c)
            rec["stacked_us"]["-".join(map(str, c))] = us(
                lambda cfg=cfg: [fg.gemm_split_dtype(x, w, NE, cfg) for w in ws]
            )
        print(json.dumps(rec), flush=True)
        doc["rows"].append(rec)

    def total(key):
        vals = [r["stacked_us"][key] for r in doc["rows"]]
        return sum(vals) if all(isinstance(v, float) for v in vals) else float("inf")

    best = min(doc["rows"][0]["stacked_us"], key=total)
    doc["best_config"] = [int(v) for v in best.split("-")]
    best_cfg = sab.SwapAbConfig(*doc["best_config"])
    for rec in doc["rows"]:
        m = rec["M"]
        x = torch.randn(m, K, generator=gen, device="cuda").to(torch.bfloat16)
        rec["plain_5504_us"] = us(lambda: [sab.swap_ab_gemm(x, w, best_cfg) for w in ws])
        rec["best_stacked_us"] = rec["stacked_us"][best]
    print(json.dumps({"best": doc["best_config"], "plain": [r["plain_5504_us"] for r in doc["rows"]]}))
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "gate_stack_bench.json").write_text(json.dumps(doc, indent=1))
    if args.apply_best:
        cfgs["configs"][f"{NE + REST}x{K}"] = doc["best_config"]
        (HERE / "configs.json").write_text(json.dumps(cfgs, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
