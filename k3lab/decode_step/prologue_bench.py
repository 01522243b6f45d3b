"""Which build of the fused-prologue GEMM keeps the weight stream going (a benchmark).

``python -m k3lab.decode_step.prologue_bench [--out DIR]`` on a CUDA GPU: each
prologue of ``fused_gemm.py`` at a Kimi-K3 TP8 shape, M = 1 and 16, for each kernel
variant ``(SWAP, XPF, BLOCK_M)`` (tokens as the MMA's A operand from registers /
activation tiles loaded one K step ahead by hand / token rows per tile), next to our
plain swap-AB kernel on the same weight (the time a prologue should add nothing to).
CUDA graph over 8 weight copies, median of 9 replays, µs per call; read roof of the
weight. Writes ``prologue_bench.json``. Exit 2 without a GPU.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import sys

from k3lab.decode_step import imports, replay

# (prologue, N, K, config)
CASES = [
    ("norm", 7168, 3584, (64, 128, 1, 4, 6, 55)),
    ("norm", 2304, 1536, (64, 128, 1, 4, 6)),
    ("norm", 2112, 7168, (64, 128, 4, 4, 6)),
    ("act_mul", 7168, 768, (64, 128, 1, 4, 6, 55)),
    ("sigmoid_mul", 7168, 1536, (64, 128, 1, 4, 6, 55)),
    ("add_norm", 3584, 7168, (64, 128, 2, 4, 6, 55)),
    ("mtp_norm", 7168, 14336, (64, 128, 1, 4, 6, 55)),
    ("none", 7168, 3584, (64, 128, 1, 4, 6, 55)),
]
VARIANTS = [(False, False, 16), (False, True, 16), (True, False, 16), (True, True, 16), (True, False, 64),
            (True, True, 64)]  # fmt: skip
# --sweep: the prologue's fixed cost per K step (~1 µs, serial) calls for fewer, longer steps
SWEEP_VARIANTS = [(False, False, 16), (True, True, 16)]


def sweep_configs(sab, n: int, k: int, base: tuple) -> list[tuple]:
    """Longer K steps (256, 512) at 2-4 stages, the base split and twice it, all runnable."""
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
    ap.add_argument("--sweep", action="store_true", help="configs x 2 variants at M = 16 instead")
    args = ap.parse_args(argv)
    import torch

    if not torch.cuda.is_available():
        print("error: no CUDA GPU", file=sys.stderr)
        return 2
    sab, fg = imports.overlay("swap_ab_gemm"), imports.overlay("fused_gemm")
    bw = replay.read_bw(torch)
    gen = torch.Generator(device="cuda").manual_seed(5)
    rows = []
    for pro, n, k, c in CASES:
        cfg = sab.SwapAbConfig(*c)
        ws = [(torch.randn(n, k, generator=gen, device="cuda") / k**0.5).to(torch.bfloat16) for _ in range(8)]
        g = torch.ones(k, dtype=torch.bfloat16, device="cuda")
        if args.sweep and pro == "none":
            continue
        for m in ((16,) if args.sweep else (1, 16)):
            cfg = sab.SwapAbConfig(*c)
            def rnd(*s):
                return torch.randn(*s, generator=gen, device="cuda").to(torch.bfloat16)

            x, a, h = rnd(m, k), rnd(m, k), torch.empty(m, k, dtype=torch.bfloat16, device="cuda")
            gu, half = rnd(m, 2 * k), k // 2
            e, hd, pos = rnd(m, half), rnd(m, half), torch.arange(1, m + 1, device="cuda")

            def call(w, v):
                fg.VARIANT = v
                if pro == "norm":
                    return fg.rmsnorm_gemm(x, g, 1e-6, w, cfg)
                if pro == "act_mul":
                    return fg.act_mul_gemm(gu, w, cfg, situ_beta=1.0)
                if pro == "sigmoid_mul":
                    return fg.sigmoid_mul_gemm(x, a, w, cfg)
                if pro == "add_norm":
                    return fg.add_rmsnorm_gemm(x, a, h, g, 1e-6, w, cfg)
                if pro == "mtp_norm":
                    return fg.mtp_input_gemm(pos, e, hd, g[:half], g[half:], 1e-6, w, cfg)
                return fg.gemm(x, w, cfg)

            xin = torch.empty(m, k, dtype=torch.bfloat16, device="cuda").normal_()
            plain = replay.graph_us(torch, lambda: [sab.swap_ab_gemm(xin, w, cfg) for w in ws], 8, 9)
            rec = {"prologue": pro, "N": n, "K": k, "M": m, "config": list(c), "plain_swap_ab_us": round(plain, 2),
                   "roof_us": round(2 * n * k / bw * 1e6, 2)}  # fmt: skip
            todo = [(v, sc) for v in SWEEP_VARIANTS for sc in sweep_configs(sab, n, k, c)] if args.sweep \
                else [(v, c) for v in VARIANTS]
            for v, cc in todo:
                key = "swap{:d}_xpf{:d}_m{}".format(*v) + ("_" + "-".join(map(str, cc)) if args.sweep else "")
                cfg = sab.SwapAbConfig(*cc)
                try:
                    rec[key] = round(replay.graph_us(torch, lambda v=v: [call(w, v) for w in ws], 8, 9), 2)
                except Exception as ex:  # a variant that does not compile is a finding, not a stop
                    rec[key] = f"{type(ex).__name__}: {str(ex)[:160]}"
            print(json.dumps(rec), flush=True)
            rows.append(rec)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / ("prologue_sweep.json" if args.sweep else "prologue_bench.json")).write_text(json.dumps({"read_bw_TBps": bw / 1e12, "rows": rows}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
