# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-k3-overlay project
"""CPU tests of the fused-prologue swap-AB GEMM and the PDL-aware norm (vllm-k3-overlay).

The kernels run on Triton's interpreter (``TRITON_INTERPRET=1``, in a subprocess as
Triton reads it on first import), every program of the grid on the CPU: each prologue
(norm, add+norm with its residual write, SiLU/SITU-and-mul, sigmoid gate, the MTP
two-norm input), with and without split-K, with the residual epilogue and a row-strided
``x``, against float64 of the unfused sequence; and the split-dtype epilogue (fp32
columns, then 16-bit ones, the boundary anywhere in a tile). fp16 operands: the interpreter has no
bf16 dot (numpy has no bf16); the GPU tests cover bf16 under CUDA graphs.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("triton")

from vllm.models.kimi_k3.nvidia import fused_gemm as fg  # noqa: E402
from vllm.models.kimi_k3.nvidia import pointwise as pw  # noqa: E402
from vllm.models.kimi_k3.nvidia import swap_ab_gemm as sab  # noqa: E402

# (prologue, M, N, K, config, epilogue residual): no split / split-K with an uneven
# last split / ragged rows, one and sixteen tokens.
CASES = [
    ("none", 3, 40, 320, (16, 64, 3, 4, 2), True),
    ("norm", 1, 48, 256, (16, 64, 1, 4, 2), False),
    ("norm", 16, 40, 320, (16, 64, 3, 4, 2), True),
    ("add_norm", 5, 48, 256, (16, 128, 1, 4, 2), False),
    ("add_norm", 7, 40, 320, (32, 64, 3, 4, 2, 23), True),
    ("act_mul", 4, 48, 192, (16, 64, 2, 4, 2), False),
    ("act_mul_situ", 9, 40, 128, (16, 64, 1, 4, 2), True),
    ("sigmoid_mul", 2, 48, 256, (16, 64, 4, 4, 2), True),
    ("mtp_norm", 6, 40, 256, (16, 64, 1, 4, 2), False),
]

_SCRIPT = textwrap.dedent(
    """
    import json, sys, torch
    from vllm.models.kimi_k3.nvidia import fused_gemm as fg, norm, pointwise as pw
    from vllm.models.kimi_k3.nvidia.swap_ab_gemm import SwapAbConfig
    D = torch.float64
    def rms(t, g, eps=1e-6):
        t = t.to(D); return t * torch.rsqrt(t.pow(2).mean(-1, keepdim=True) + eps) * g.to(D)
    def err(y, ref):
        return float((y.to(D) - ref).norm() / ref.norm())
    out = []
    for pro, m, n, k, cfg, res, seed in json.loads(sys.argv[1]):
        g = torch.Generator().manual_seed(seed)
        rnd = lambda *s: torch.randn(*s, generator=g).half()
        cfg = SwapAbConfig(*cfg)
        w = (torch.randn(n, k, generator=g) / k ** 0.5).half()
        r = rnd(m, n) if res else None
        gw = (1 + 0.1 * torch.randn(k, generator=g)).half()
        rec = {}
        if pro == "none":
            xs = rnd(m, k + 24)[:, 8:8 + k]  # row-strided view
            y = fg.gemm(xs, w, cfg, residual=r, pdl=False); x_ref = xs.to(D)
        elif pro == "norm":
            x = rnd(m, k); y = fg.rmsnorm_gemm(x, gw, 1e-6, w, cfg, residual=r, pdl=False)
            x_ref = rms(x, gw)
        elif pro == "add_norm":
            x, ri = rnd(m, k), rnd(m, k); ro = torch.full((m, k), float("nan")).half()
            y = fg.add_rmsnorm_gemm(x, ri, ro, gw, 1e-6, w, cfg, residual=r, pdl=False)
            h = x.to(D) + ri.to(D); x_ref = rms(h, gw)
            rec["h_err"] = err(ro, h); rec["h_finite"] = bool(torch.isfinite(ro).all())
        elif pro.startswith("act_mul"):
            gu = rnd(m, 2 * k)
            gt, up = gu[:, :k].to(D), gu[:, k:].to(D)
            if pro == "act_mul":
                y = fg.act_mul_gemm(gu, w, cfg, residual=r, pdl=False)
                x_ref = gt * torch.sigmoid(gt) * up
            else:
                y = fg.act_mul_gemm(gu, w, cfg, situ_beta=2.0, situ_linear_beta=3.0, residual=r, pdl=False)
                x_ref = 2.0 * torch.tanh(gt / 2.0) * torch.sigmoid(gt) * (3.0 * torch.tanh(up / 3.0))
        elif pro == "sigmoid_mul":
            x, gt = rnd(m, k), rnd(m, k)
            y = fg.sigmoid_mul_gemm(x, gt, w, cfg, residual=r, pdl=False)
            x_ref = x.to(D) * torch.sigmoid(gt.to(D))
        else:
            h2 = k // 2; e, hd = rnd(m, h2), rnd(m, h2); ge, gh = gw[:h2], gw[h2:]
            pos = torch.arange(m); pos[1] = 0
            y = fg.mtp_input_gemm(pos, e, hd, ge, gh, 1e-6, w, cfg, pdl=False)
            er = rms(e, ge); er[pos == 0] = 0
            x_ref = torch.cat([er, rms(hd, gh)], 1)
        ref = x_ref @ w.to(D).t() + (r.to(D) if res else 0)
        rec.update(finite=bool(torch.isfinite(y).all()), shape=list(y.shape), err=err(y, ref))
        out.append(rec)
    # the PDL-aware norm kernel, plain and with the residual add, on a row-strided x
    g = torch.Generator().manual_seed(99)
    xs = torch.randn(5, 300, generator=g).half()[:, 20:276]; ri = torch.randn(5, 256, generator=g).half()
    gw = (1 + 0.1 * torch.randn(256, generator=g)).half()
    y = norm.rms_norm(xs, gw, 1e-6, pdl=False)
    y2, h = norm.add_rms_norm(xs, ri, gw, 1e-6, pdl=False)
    hr = xs.to(D) + ri.to(D)
    rec = {"norm_err": err(y, rms(xs, gw)), "add_norm_err": err(y2, rms(hr, gw)), "h_err": err(h, hr)}
    # the PDL-aware pointwise ops: SITU-and-mul on a strided gate_up, sigmoid gate, MTP input
    gu = torch.randn(3, 2 * 300, generator=g).half()[:, :512]
    gt, up = gu[:, :256].to(D), gu[:, 256:].to(D)
    rec["situ_err"] = err(pw.act_mul(gu, situ_beta=2.0, pdl=False),
                          2.0 * torch.tanh(gt / 2.0) * torch.sigmoid(gt) * up)
    rec["silu_err"] = err(pw.act_mul(gu, pdl=False), gt * torch.sigmoid(gt) * up)
    rec["sigmoid_err"] = err(pw.sigmoid_mul(xs, ri, pdl=False), xs.to(D) * torch.sigmoid(ri.to(D)))
    pos = torch.tensor([3, 0, 1, 2, 5]); e, hd = ri, torch.randn(5, 256, generator=g).half()
    er = rms(e, gw); er[1] = 0
    rec["mtp_err"] = err(pw.mtp_input(pos, e, hd, gw, gw, 1e-6, pdl=False), torch.cat([er, rms(hd, gw)], 1))
    # one rank's embedding rows: ids in [40, 60) read row id - 40 of a row-strided shard,
    # the others (both edges included) are zeros; int32 ids as well as int64
    table = torch.randn(24, 300, generator=g).half()[:, :256]
    ids = torch.tensor([40, 59, 39, 60, 45, 0, 1000])
    want = torch.zeros(7, 256).half(); want[[0, 1, 4]] = table[[0, 19, 5]]
    rec["embed_exact"] = float((pw.embed_rows(ids, table, 40, 60, pdl=False) != want).sum())
    rec["embed_exact_i32"] = float((pw.embed_rows(ids.int(), table, 40, 60, pdl=False) != want).sum())
    out.append(rec)
    print(json.dumps(out))
    """
)


# gemm_split_dtype: (M, N, K, n_fp32, config): the boundary n_fp32 inside a tile, without
# split-K, with an uneven last split, with ragged rows, and in the last tile.
SPLIT_CASES = [
    (3, 88, 320, 21, (16, 64, 1, 4, 2)),
    (16, 72, 320, 37, (16, 64, 3, 4, 2)),
    (1, 80, 256, 5, (32, 64, 2, 4, 2, 23)),
    (7, 60, 192, 59, (16, 64, 1, 4, 2)),
    (12, 96, 256, 48, (32, 128, 2, 4, 2)),  # on a tile edge
]

_SPLIT_SCRIPT = textwrap.dedent(
    """
    import json, sys, torch
    from vllm.models.kimi_k3.nvidia import fused_gemm as fg
    from vllm.models.kimi_k3.nvidia.swap_ab_gemm import SwapAbConfig
    D = torch.float64
    out = []
    for m, n, k, nf, cfg, seed in json.loads(sys.argv[1]):
        g = torch.Generator().manual_seed(seed)
        w = (torch.randn(n, k, generator=g) / k ** 0.5).half()
        xs = torch.randn(m, k + 16, generator=g).half()[:, 8:8 + k]  # row-strided view
        lo, hi = fg.gemm_split_dtype(xs, w, nf, SwapAbConfig(*cfg), pdl=False)
        ref = xs.to(D) @ w.to(D).t()
        sep = fg.gemm(xs, w[:nf].contiguous(), SwapAbConfig(16, 64, 1, 4, 2), out_dtype=torch.float32,
                      pdl=False)
        out.append({"dtypes": [str(lo.dtype), str(hi.dtype)], "shapes": [list(lo.shape), list(hi.shape)],
                    "finite": bool(torch.isfinite(lo).all() and torch.isfinite(hi).all()),
                    "packed": lo.is_contiguous() and hi.is_contiguous(),
                    "lo_err": float((lo.to(D) - ref[:, :nf]).norm() / ref[:, :nf].norm()),
                    "hi_err": float((hi.to(D) - ref[:, nf:]).norm() / ref[:, nf:].norm()),
                    "vs_separate": float((lo - sep).abs().max() / sep.abs().max())})
    print(json.dumps(out))
    """
)


def _interpret(cases, script: str = _SCRIPT) -> list[dict]:
    env = dict(os.environ, TRITON_INTERPRET="1", CUDA_VISIBLE_DEVICES="")
    proc = subprocess.run(
        [sys.executable, "-c", script, json.dumps(cases)],
        capture_output=True, text=True, env=env, timeout=900,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_interpreted_prologues_match_float64() -> None:
    cases = [[p, m, n, k, list(c), r, i] for i, (p, m, n, k, c, r) in enumerate(CASES)]
    got = _interpret(cases)
    for (pro, m, n, k, cfg, _), rec in zip(CASES, got):
        what = f"{pro} {cfg} M={m} {n}x{k}"
        assert rec["finite"], f"{what}: NaN/Inf or unwritten output"
        assert rec["shape"] == [m, n]
        # fp16 operands, fp32 accumulation: ~5e-4 expected; a wrong index or scale is O(1).
        assert rec["err"] < 3e-3, f"{what}: rel err {rec['err']:.2e}"
        if pro == "add_norm":
            assert rec["h_finite"], f"{what}: new residual not written everywhere"
            assert rec["h_err"] < 1e-3, f"{what}: new residual rel err {rec['h_err']:.2e}"
    small = got[-1]
    assert all(v < 2e-3 for v in small.values()), small
    assert small["embed_exact"] == 0 and small["embed_exact_i32"] == 0, "a copy: every element exact"


def test_interpreted_split_dtype_gemm_matches_float64() -> None:
    got = _interpret([[*c[:4], list(c[4]), i] for i, c in enumerate(SPLIT_CASES)], _SPLIT_SCRIPT)
    for (m, n, k, nf, cfg), rec in zip(SPLIT_CASES, got):
        what = f"{cfg} M={m} {n}x{k} n_fp32={nf}"
        assert rec["dtypes"] == ["torch.float32", "torch.float16"], what
        assert rec["shapes"] == [[m, nf], [m, n - nf]], what
        assert rec["finite"] and rec["packed"], f"{what}: NaN/Inf, unwritten or strided output"
        # fp32 columns: fp16 products summed in fp32, never rounded to 16 bits (that
        # alone would be ~3e-4); the fp16 columns carry one fp16 rounding.
        assert rec["lo_err"] < 2e-5, f"{what}: fp32 logits rel err {rec['lo_err']:.2e}"
        assert rec["hi_err"] < 1e-3, f"{what}: fp16 part rel err {rec['hi_err']:.2e}"
        # what a separate fp32-out GEMM of the first n_fp32 rows gives, up to the K order
        assert rec["vs_separate"] < 1e-5, f"{what}: differs from gemm(out_dtype=fp32)"


def test_embed_rows_refuses_a_shard_past_its_weight_and_strided_ids() -> None:
    w = torch.empty(8, 16, dtype=torch.float16)
    with pytest.raises(ValueError, match="does not fit the weight's 8 rows"):
        pw.embed_rows(torch.zeros(2, dtype=torch.int64), w, 0, 9)
    with pytest.raises(ValueError, match="must be contiguous"):
        pw.embed_rows(torch.zeros(4, dtype=torch.int64)[::2], w, 0, 8)
    assert pw.embed_rows(torch.zeros(0, dtype=torch.int64), w, 0, 8).shape == (0, 16)


def test_bad_operands_are_refused_with_the_operand_named() -> None:
    cfg = sab.SwapAbConfig(16, 64, 1, 4, 2)
    w = torch.empty(32, 128, dtype=torch.float16)
    with pytest.raises(ValueError, match="outside 1..16"):
        fg.gemm(torch.empty(17, 128, dtype=torch.float16), w, cfg)
    with pytest.raises(ValueError, match="x: expected"):
        fg.gemm(torch.empty(2, 64, dtype=torch.float16), w, cfg)
    with pytest.raises(ValueError, match="x: expected"):  # act_mul reads [M, 2K]
        fg.act_mul_gemm(torch.empty(2, 128, dtype=torch.float16), w, cfg)
    with pytest.raises(ValueError, match="residual output"):
        x = torch.empty(2, 128, dtype=torch.float16)
        fg.add_rmsnorm_gemm(x, x, None, torch.empty(128), 1e-6, w, cfg)
    with pytest.raises(ValueError, match="split_k=1"):
        e = torch.empty(2, 64, dtype=torch.float16)
        fg.mtp_input_gemm(torch.zeros(2), e, e, e[0], e[0], 1e-6, w,
                          sab.SwapAbConfig(16, 64, 2, 4, 2))  # fmt: skip
    for nf in (0, 32):
        with pytest.raises(ValueError, match=f"n_fp32={nf} outside 1..31"):
            fg.gemm_split_dtype(torch.empty(2, 128, dtype=torch.float16), w, nf, cfg)
    with pytest.raises(ValueError, match="split_k=9"):
        fg.gemm(torch.empty(2, 128, dtype=torch.float16), w, sab.SwapAbConfig(16, 64, 9, 4, 2))
