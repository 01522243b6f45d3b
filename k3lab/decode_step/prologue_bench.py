"""What a fused prologue costs its GEMM, per config (a benchmark).

``python -m k3lab.decode_step.prologue_bench [--out DIR]`` on a CUDA GPU: each prologue
of ``fused_gemm.py`` at a Kimi-K3 TP8 shape and M = 16, at the plain kernel's config
and at longer K steps (256, 512; 2-4 stages; the split and twice it), next to our
plain swap-AB kernel on the same weight at its config (the time a free prologue would
take). CUDA graph over 8 weight copies, median of 9 replays, µs per call; the weight's
read roof. Writes ``prologue_sweep.json``; ``configs.json``'s ``fused`` entries come
from it. Exit 2 without a GPU.

Finding (H200, 2026-12-02, ``results/decode_step/prologue_sweep_2026-12-02.json``):
every K step of a prologue pays a serial ~1 µs (the activation tile's math and its trip
through shared memory to the MMA), so fewer, longer K steps win: the norm prologues at
K steps of 256 come within 1.1-2.1 µs of the plain GEMM, the pointwise ones stay 6-22 µs
behind. Two other builds were measured and dropped (``prologue_variants_2026-12-02.json``,
kernel of commit 4471cdd): tokens as the MMA's A operand from registers (mma.sync at
16 rows, or wgmma with tokens padded to 64) and activation tiles loaded a step ahead by
hand; none beat the plain build on the norm prologues.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import sys

from k3lab import timing
from k3lab.decode_step import imports

# (prologue, N, K, the plain kernel's config for this weight)
CASES = [
    ("norm", 7168, 3584, (64, 128, 1, 4, 6, 55)),
    ("norm", 2304, 1536, (64, 128, 1, 4, 6)),
    ("norm", 2112, 7168, (64, 128, 4, 4, 6)),
    ("act_mul", 7168, 768, (64, 128, 1, 4, 6, 55)),
    ("sigmoid_mul", 7168, 1536, (64, 128, 1, 4, 6, 55)),
    ("add_norm", 3584, 7168, (64, 128, 2, 4, 6, 55)),
    ("mtp_norm", 7168, 14336, (64, 128, 1, 4, 6, 55)),
]


def sweep_configs(sab, n: int, k: int, base: tuple) -> list[tuple]:
    """The base config, then K steps of 256 / 512 at 2-4 stages, the base split and twice it."""
    bn, _, split, warps, _, *rows = base
    out = [tuple(base)]
    for bk, stage_opts in ((256, (3, 4)), (512, (2, 3))):
        for stages in stage_opts:
            for sp in sorted({split, 2 * split}):
                c = (bn, bk, sp, warps, stages, *rows)
                if sab.config_error(sab.SwapAbConfig(*c), n, k) is None:
                    out.append(c)
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m k3lab.decode_step.prologue_bench")
    ap.add_argument("--out", type=pathlib.Path, default=pathlib.Path(os.environ.get("OUT", ".")))
    args = ap.parse_args(argv)
    import torch

    if not torch.cuda.is_available():
        print("error: no CUDA GPU", file=sys.stderr)
        return 2
    sab, fg = imports.overlay("swap_ab_gemm"), imports.overlay("fused_gemm")
    bw = timing.read_bandwidth_Bps(replays=12)
    gen = torch.Generator(device="cuda").manual_seed(5)

    def rnd(*s):
        return torch.randn(*s, generator=gen, device="cuda").to(torch.bfloat16)

    rows, m = [], 16
    for pro, n, k, base in CASES:
        ws = [rnd(n, k) / k**0.5 for _ in range(8)]
        g = torch.ones(k, dtype=torch.bfloat16, device="cuda")
        x, a, h, gu = rnd(m, k), rnd(m, k), rnd(m, k), rnd(m, 2 * k)
        e, hd, pos = rnd(m, k // 2), rnd(m, k // 2), torch.arange(1, m + 1, device="cuda")

        def call(w, cfg):
            if pro == "norm":
                return fg.rmsnorm_gemm(x, g, 1e-6, w, cfg)
            if pro == "act_mul":
                return fg.act_mul_gemm(gu, w, cfg, situ_beta=1.0)
            if pro == "sigmoid_mul":
                return fg.sigmoid_mul_gemm(x, a, w, cfg)
            if pro == "add_norm":
                return fg.add_rmsnorm_gemm(x, a, h, g, 1e-6, w, cfg)
            return fg.mtp_input_gemm(pos, e, hd, g[: k // 2], g[k // 2 :], 1e-6, w, cfg)

        plain_cfg = sab.SwapAbConfig(*base)

        def plain_gemms():
            return [sab.swap_ab_gemm(x, w, plain_cfg) for w in ws]

        plain = timing.graph_replay_us(plain_gemms, plain_gemms, 8, 9)
        rec = {"prologue": pro, "N": n, "K": k, "M": m, "config": list(base),
               "plain_swap_ab_us": round(plain, 2), "roof_us": round(2 * n * k / bw * 1e6, 2),
               "fused_us": {}}  # fmt: skip
        for c in sweep_configs(sab, n, k, base):
            cfg = sab.SwapAbConfig(*c)

            def fused(cfg=cfg):
                return [call(w, cfg) for w in ws]

            try:
                us = round(timing.graph_replay_us(fused, fused, 8, 9), 2)
            except Exception as ex:  # refused (mtp_norm: split-K) or out of shared memory: a finding
                us = f"{type(ex).__name__}: {str(ex)[:160]}"
            rec["fused_us"]["-".join(map(str, c))] = us
        print(json.dumps(rec), flush=True)
        rows.append(rec)
    args.out.mkdir(parents=True, exist_ok=True)
    doc = {"read_bw_TBps": round(bw / 1e12, 4), "gpu": torch.cuda.get_device_name(), "rows": rows}
    (args.out / "prologue_sweep.json").write_text(json.dumps(doc, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
