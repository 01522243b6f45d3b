# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-k3-overlay project
"""GPU numerics of the fused-prologue GEMM and the PDL-aware norm, through CUDA graphs.

Every prologue at Kimi-K3 TP8 shapes (split-K and not, ragged rows, residual epilogue,
fp32 router logits, a row-strided input; and the split-dtype epilogue: fp32 router
logits and bf16 projections of one stacked weight), M = 1, 7, 16, bf16: each call is captured
in a CUDA graph, the inputs are refilled with fresh random data, the written residual
is poisoned with NaN, and the graph is replayed. The output must match float64 of the
unfused sequence as closely as vLLM's unfused bf16 sequence does, and the new residual
(``add_norm``) must equal ``bf16(x + r)`` exactly. Skipped, with the reason, without
a CUDA GPU.
"""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("triton")

pytestmark = pytest.mark.gpu
if not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU", allow_module_level=True)

from vllm.models.kimi_k3.nvidia import fused_gemm as fg  # noqa: E402
from vllm.models.kimi_k3.nvidia import norm  # noqa: E402
from vllm.models.kimi_k3.nvidia.swap_ab_gemm import SwapAbConfig  # noqa: E402

D, BF = torch.float64, torch.bfloat16
EPS = 1e-6
CASES = [  # (prologue, N, K, config, epilogue residual)
    ("none", 1536, 128, (64, 128, 1, 4, 6), False),  # f_b on the strided f_a view
    ("none_fp32", 384, 7168, (32, 256, 10, 4, 4), False),  # router logits, split-K
    ("norm", 2112, 7168, (64, 128, 4, 4, 6), False),  # split-K
    ("norm", 7168, 3584, (64, 128, 1, 4, 6, 55), True),  # ragged, residual
    ("norm_strided", 2304, 1536, (64, 128, 1, 4, 6), False),  # q_b on q_c inside qkv_lora
    ("add_norm", 1536, 7168, (64, 128, 4, 4, 6, 47), False),
    ("add_norm", 7168, 1536, (64, 128, 1, 4, 6, 55), True),
    ("act_mul", 7168, 768, (64, 128, 1, 4, 6, 55), True),
    ("sigmoid_mul", 7168, 1536, (64, 128, 1, 4, 6, 55), True),
    ("mtp_norm", 7168, 14336, (64, 128, 1, 4, 6, 55), False),
]


def _rms(t, g):
    t = t.to(D)
    return t * torch.rsqrt(t.pow(2).mean(-1, keepdim=True) + EPS) * g.to(D)


def _rel(y, ref):
    return float((y.to(D) - ref).norm() / ref.norm())


def _fill(bufs, gen):
    for t in bufs.values():
        if t.is_floating_point():
            t.copy_(torch.randn(t.shape, generator=gen, device="cuda"))


def _setup(pro, m, n, k, gen):
    """Static inputs, the fused call, the float64 reference and vLLM's unfused bf16 result."""
    w = (torch.randn(n, k, generator=gen, device="cuda") / k**0.5).to(BF)
    g = (1 + 0.1 * torch.randn(k, generator=gen, device="cuda")).to(BF)
    b = {}
    if pro in ("none", "none_fp32", "norm", "add_norm", "sigmoid_mul"):
        b["x"] = torch.empty(m, k, dtype=BF, device="cuda")
    if pro == "none":
        b["wide"] = torch.empty(m, 6288, dtype=BF, device="cuda")
    if pro == "norm_strided":
        b["wide"] = torch.empty(m, 2112, dtype=BF, device="cuda")
    if pro in ("add_norm", "sigmoid_mul"):
        b["a"] = torch.empty(m, k, dtype=BF, device="cuda")
    if pro == "act_mul":
        b["gu"] = torch.empty(m, 2 * k, dtype=BF, device="cuda")
    if pro == "mtp_norm":
        b["e"] = torch.empty(m, k // 2, dtype=BF, device="cuda")
        b["h"] = torch.empty(m, k // 2, dtype=BF, device="cuda")
        b["pos"] = torch.arange(m, device="cuda")  # position 0 on the first row: embeds zeroed
    b["r"] = torch.empty(m, n, dtype=BF, device="cuda")
    b["h_out"] = torch.empty(m, k, dtype=BF, device="cuda")
    _fill(b, gen)
    return w, g, b


def _call(pro, w, g, b, cfg, res):
    r = b["r"] if res else None
    if pro == "none":
        return fg.gemm(b["wide"][:, 6144:6272], w, cfg, residual=r)
    if pro == "none_fp32":
        return fg.gemm(b["x"], w, cfg, out_dtype=torch.float32)
    if pro == "norm":
        return fg.rmsnorm_gemm(b["x"], g, EPS, w, cfg, residual=r)
    if pro == "norm_strided":
        return fg.rmsnorm_gemm(b["wide"][:, :1536], g, EPS, w, cfg, residual=r)
    if pro == "add_norm":
        return fg.add_rmsnorm_gemm(b["x"], b["a"], b["h_out"], g, EPS, w, cfg, residual=r)
    if pro == "act_mul":
        return fg.act_mul_gemm(b["gu"], w, cfg, situ_beta=1.0, residual=r)
    if pro == "sigmoid_mul":
        return fg.sigmoid_mul_gemm(b["x"], b["a"], w, cfg, residual=r)
    h2 = w.shape[1] // 2
    return fg.mtp_input_gemm(b["pos"], b["e"], b["h"], g[:h2], g[h2:], EPS, w, cfg)


def _reference(pro, w, g, b, res):
    """(float64 of the unfused sequence, vLLM's unfused bf16 sequence's output)."""
    f = lambda t: t.to(torch.float32)  # noqa: E731
    if pro == "none":
        x64 = b["wide"][:, 6144:6272].to(D)
        xb = b["wide"][:, 6144:6272]
    elif pro == "none_fp32":
        x64, xb = b["x"].to(D), b["x"]
    elif pro in ("norm", "norm_strided"):
        x = b["x"] if pro == "norm" else b["wide"][:, :1536]
        x64 = _rms(x, g)
        xb = (f(x) * torch.rsqrt(f(x).pow(2).mean(-1, keepdim=True) + EPS) * f(g)).to(BF)
    elif pro == "add_norm":
        hb = (f(b["x"]) + f(b["a"])).to(BF)
        x64 = _rms(b["x"].to(D) + b["a"].to(D), g)
        xb = (f(hb) * torch.rsqrt(f(hb).pow(2).mean(-1, keepdim=True) + EPS) * f(g)).to(BF)
    elif pro == "act_mul":
        k = w.shape[1]
        gt, up = b["gu"][:, :k].to(D), b["gu"][:, k:].to(D)
        x64 = torch.tanh(gt) * torch.sigmoid(gt) * up
        xb = x64.to(BF)
    elif pro == "sigmoid_mul":
        x64 = b["x"].to(D) * torch.sigmoid(b["a"].to(D))
        xb = x64.to(BF)
    else:
        h2 = w.shape[1] // 2
        e = _rms(b["e"], g[:h2])
        e[b["pos"] == 0] = 0
        x64 = torch.cat([e, _rms(b["h"], g[h2:])], 1)
        xb = x64.to(BF)
    ref = x64 @ w.to(D).t() + (b["r"].to(D) if res else 0)
    unfused = torch.mm(xb, w.t()).to(D) + (b["r"].to(D) if res else 0)
    return ref, unfused


@pytest.mark.parametrize("m", [1, 7, 16])
@pytest.mark.parametrize("pro,n,k,cfg,res", CASES, ids=[f"{c[0]}-{c[1]}x{c[2]}" for c in CASES])
def test_fused_gemm_in_a_cuda_graph_matches_float64(pro, n, k, cfg, res, m) -> None:
    gen = torch.Generator(device="cuda").manual_seed(1000 * m + n + k)
    cfg = SwapAbConfig(*cfg)
    w, g, b = _setup(pro, m, n, k, gen)
    _call(pro, w, g, b, cfg, res)  # compile outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        y = _call(pro, w, g, b, cfg, res)
    for _ in range(2):  # fresh data each replay: the graph must compute, not remember
        _fill(b, gen)
        b["h_out"].fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        ref, unfused = _reference(pro, w, g, b, res)
        assert torch.isfinite(y).all(), "NaN/Inf or unwritten output"
        err, err_unfused = _rel(y, ref), _rel(unfused, ref)
        assert err < 1e-2 and err <= 1.5 * err_unfused + 1e-3, (err, err_unfused)
        if pro == "add_norm":
            want = (b["x"].float() + b["a"].float()).to(BF)
            assert torch.equal(b["h_out"], want), "new residual differs from bf16(x + r)"


@pytest.mark.parametrize("m", [1, 16])
@pytest.mark.parametrize("k,add", [(7168, False), (7168, True), (512, False), (3584, False)])
def test_pdl_norm_in_a_cuda_graph_matches_float64(k, add, m) -> None:
    gen = torch.Generator(device="cuda").manual_seed(k + m + add)
    wide = torch.randn(m, k + 64, generator=gen, device="cuda").to(BF)
    x = wide[:, 32:32 + k]  # row-strided, as kv_c inside qkv_lora
    r = torch.randn(m, k, generator=gen, device="cuda").to(BF)
    g = (1 + 0.1 * torch.randn(k, generator=gen, device="cuda")).to(BF)
    call = (lambda: norm.add_rms_norm(x, r, g, EPS)) if add else (lambda: norm.rms_norm(x, g, EPS))
    call()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = call()
    wide.copy_(torch.randn(wide.shape, generator=gen, device="cuda"))
    r.copy_(torch.randn(r.shape, generator=gen, device="cuda"))
    graph.replay()
    torch.cuda.synchronize()
    y, h = (out if add else (out, None))
    h64 = x.to(D) + (r.to(D) if add else 0)
    assert _rel(y, _rms(h64, g)) < 5e-3
    if add:
        assert torch.equal(h, (x.float() + r.float()).to(BF))


@pytest.mark.parametrize("m", [1, 16])
@pytest.mark.parametrize("op", ["situ", "silu", "sigmoid", "mtp_input"])
def test_pdl_pointwise_in_a_cuda_graph_matches_float64(op, m) -> None:
    from vllm.models.kimi_k3.nvidia import pointwise as pw

    gen = torch.Generator(device="cuda").manual_seed(m + len(op))
    a = torch.randn(m, 2 * 7168, generator=gen, device="cuda").to(BF)
    b = torch.randn(m, 7168, generator=gen, device="cuda").to(BF)
    g = (1 + 0.1 * torch.randn(7168, generator=gen, device="cuda")).to(BF)
    pos = torch.arange(m, device="cuda")  # row 0 at position 0: its embeds half is zero
    calls = {
        "situ": lambda: pw.act_mul(a[:, :1536], situ_beta=1.0),
        "silu": lambda: pw.act_mul(a[:, :1536]),
        "sigmoid": lambda: pw.sigmoid_mul(a[:, :7168], b),
        "mtp_input": lambda: pw.mtp_input(pos, a[:, :7168], b, g, g, EPS),
    }
    calls[op]()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        y = calls[op]()
    a.copy_(torch.randn(a.shape, generator=gen, device="cuda"))
    b.copy_(torch.randn(b.shape, generator=gen, device="cuda"))
    graph.replay()
    torch.cuda.synchronize()
    gt, up = a[:, :768].to(D), a[:, 768:1536].to(D)
    if op == "situ":
        ref = torch.tanh(gt) * torch.sigmoid(gt) * up
    elif op == "silu":
        ref = gt * torch.sigmoid(gt) * up
    elif op == "sigmoid":
        ref = a[:, :7168].to(D) * torch.sigmoid(b.to(D))
    else:
        e = _rms(a[:, :7168], g)
        e[pos == 0] = 0
        ref = torch.cat([e, _rms(b, g)], 1)
    assert torch.isfinite(y).all()
    assert _rel(y, ref) < 5e-3


@pytest.mark.parametrize("m", [1, 7, 16])
@pytest.mark.parametrize("cfg", [(64, 128, 1, 4, 6, 43), (64, 128, 2, 4, 6, 47), (64, 256, 4, 4, 4)],
                         ids=["no-split", "split2-ragged", "split4-tile-edge"])  # fmt: skip
def test_split_dtype_gemm_in_a_cuda_graph_matches_float64(cfg, m) -> None:
    """Router gate (384 rows, fp32 logits) stacked on routed_down + the shared gate_up
    (5120 rows, bf16): 5504x7168, the boundary inside a tile (rows 43, 47) and on one (64)."""
    n, k, nf = 5504, 7168, 384
    gen = torch.Generator(device="cuda").manual_seed(77 + m + cfg[2])
    w = (torch.randn(n, k, generator=gen, device="cuda") / k**0.5).to(BF)
    x = torch.randn(m, k, generator=gen, device="cuda").to(BF)
    call = lambda: fg.gemm_split_dtype(x, w, nf, SwapAbConfig(*cfg))  # noqa: E731
    call()  # compile outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        lo, hi = call()
    assert lo.dtype == torch.float32 and hi.dtype == BF
    assert lo.shape == (m, nf) and hi.shape == (m, n - nf)
    for _ in range(2):  # fresh data, poisoned outputs: the graph must compute and write all
        x.copy_(torch.randn(x.shape, generator=gen, device="cuda"))
        lo.fill_(float("nan"))
        hi.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        assert torch.isfinite(lo).all() and torch.isfinite(hi).all(), "unwritten output"
        ref = x.to(D) @ w.to(D).t()
        # bf16 products are exact in fp32: only the fp32 sum's rounding remains
        assert _rel(lo, ref[:, :nf]) < 1e-5
        # the gate alone through the fp32-out GEMM at the replay's gate config
        sep = fg.gemm(x, w[:nf], SwapAbConfig(64, 256, 14, 4, 4), out_dtype=torch.float32)
        assert float((lo - sep).abs().max() / sep.abs().max()) < 1e-5
        unfused = torch.mm(x, w[nf:].t()).to(D)
        err, err_unfused = _rel(hi, ref[:, nf:]), _rel(unfused, ref[:, nf:])
        assert err < 1e-2 and err <= 1.5 * err_unfused + 1e-3, (err, err_unfused)
