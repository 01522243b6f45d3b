# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-k3-overlay project
"""GPU numerics of the PDL-aware CuTe DSL GEMV (vllm-k3-overlay), bf16.

Every shape of the SM90 table at M = 1, 2, 4 (and 16 on two shapes), for every config
the H200 sweep may pick (``gemv_pdl.sweep_configs``): finite, (M, N), and as close to
float64 as cuBLAS is on the same inputs (twice its error, or 2e-3). A K wider than the
prefetch (the streamed tiles), a strided ``x``. Then PDL where it matters: a chain of
dependent calls (each one's ``x`` the previous one's output) in one CUDA graph, replayed
on fresh inputs with the outputs poisoned. Skipped, with the reason, without an SM90+
GPU or the CuTe DSL.
"""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("cutlass.cute", reason="the GEMV is a CuTe DSL kernel (nvidia-cutlass-dsl)")

pytestmark = pytest.mark.gpu
if not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU", allow_module_level=True)
if torch.cuda.get_device_capability()[0] < 9:
    pytest.skip("gemv_pdl needs SM90 or newer", allow_module_level=True)

from vllm.models.kimi_k3.nvidia import gemv_pdl as gv  # noqa: E402
from vllm.models.kimi_k3.nvidia import low_latency_gemm_dispatch as llg  # noqa: E402

D, BF = torch.float64, torch.bfloat16
SM90_SHAPES = sorted(s for s in llg.table_for_capability((9, 0)) if gv.sweep_configs(*s))


def _rel(y, ref):
    return float((y.to(D) - ref).norm() / ref.norm())


def _check(x, w, cfg, bad):
    ref = x.to(D) @ w.to(D).t()
    floor = max(2 * _rel(torch.mm(x, w.t()), ref), 2e-3)
    y = gv.gemv_pdl(x, w, cfg)
    err = _rel(y, ref) if torch.isfinite(y).all() else float("inf")
    if y.shape != (x.shape[0], w.shape[0]) or y.dtype != BF or not err <= floor:
        bad.append((x.shape[0], tuple(cfg), err, floor))


@pytest.mark.parametrize("shape", SM90_SHAPES, ids=lambda s: f"{s[0]}x{s[1]}")
def test_every_sweep_config_matches_float64_as_cublas_does(shape) -> None:
    n, k = shape
    gen = torch.Generator(device="cuda").manual_seed(n * 31 + k)
    w = (torch.randn(n, k, generator=gen, device="cuda") / k**0.5).to(BF)
    bad: list = []
    for m in (1, 2, 4) + ((16,) if shape in ((768, 7168), (7168, 1536)) else ()):
        x = torch.randn(m, k, generator=gen, device="cuda").to(BF)
        for cfg in gv.sweep_configs(n, k):
            _check(x, w, cfg, bad)
    assert not bad, bad[:8]


def test_tiles_past_the_prefetch_and_a_strided_x() -> None:
    gen = torch.Generator(device="cuda").manual_seed(3)
    w = (torch.randn(512, 7168, generator=gen, device="cuda") / 7168**0.5).to(BF)
    wide = torch.randn(4, 7168 + 64, generator=gen, device="cuda").to(BF)
    bad: list = []
    for cfg in (gv.GemvPdlConfig(128, 2, 1), gv.GemvPdlConfig(128, 1, 3),
                gv.GemvPdlConfig(64, 4, 8)):  # fmt: skip
        _check(wide[:, :7168], w, cfg, bad)  # row stride 7232: 16-byte rows, not packed
        _check(wide[:1, :7168].contiguous(), w, cfg, bad)
    assert not bad, bad


@pytest.mark.parametrize("m", [1, 3, 4])
def test_a_dependent_chain_under_pdl_in_a_cuda_graph(m) -> None:
    """x of each call is the previous call's output: the wait must hold x's loads back
    until the previous kernel has finished, although the weights load before it."""
    gen = torch.Generator(device="cuda").manual_seed(m)
    w1 = (torch.randn(1536, 7168, generator=gen, device="cuda") / 7168**0.5).to(BF)
    w2 = (torch.randn(7168, 1536, generator=gen, device="cuda") / 1536**0.5).to(BF)
    c1, c2 = gv.GemvPdlConfig(128, 2, 7), gv.GemvPdlConfig(64, 4, 3)
    x = torch.randn(m, 7168, generator=gen, device="cuda").to(BF)
    outs = {}

    def body():
        h = x
        for _ in range(3):
            h1 = gv.gemv_pdl(h, w1, c1)
            h = gv.gemv_pdl(h1, w2, c2)
        outs["y"], outs["h1"] = h, h1

    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        body()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        body()
    for _ in range(3):
        x.copy_(torch.randn(m, 7168, generator=gen, device="cuda"))
        outs["y"].fill_(float("nan"))
        outs["h1"].fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        h = x.to(D)
        for _ in range(3):  # the bf16 sequence, each step from bf16 inputs in float64
            h1 = (h @ w1.to(D).t()).to(BF).to(D)
            h = (h1 @ w2.to(D).t()).to(BF).to(D)
        assert torch.isfinite(outs["y"]).all()
        assert _rel(outs["y"], h) < 2e-2, _rel(outs["y"], h)


def test_the_backend_runs_through_the_dispatch_launch() -> None:
    call = llg.PlannedCall("gemv_pdl", gv.GemvPdlConfig(128, 2, 7))
    w = torch.randn(768, 7168, device="cuda").to(BF)
    x = torch.randn(2, 7168, device="cuda").to(BF)
    assert llg._operands_ok(call, x, w)
    y = llg._launch(call, x, w)
    assert _rel(y, x.to(D) @ w.to(D).t()) < 2e-2


def test_an_uncompiled_build_is_refused_during_capture() -> None:
    cfg = gv.GemvPdlConfig(256, 8, 1)  # compiled by no other test
    w = torch.randn(512, 2048, device="cuda").to(BF)
    x = torch.randn(5, 2048, device="cuda").to(BF)
    graph = torch.cuda.CUDAGraph()
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream), torch.cuda.graph(graph, stream=stream):
        why = gv.operands_error(cfg, x, w)
    assert why is not None and "capturing" in why


def _rmsnorm64(x, g, eps):
    x = x.to(D)
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * g.to(D)


@pytest.mark.parametrize("add", [False, True], ids=["norm", "norm+add"])
@pytest.mark.parametrize("shape, cfg", [
    ((2304, 1536), (64, 2, 3)), ((2304, 1536), (64, 4, 3)), ((7168, 3584), (64, 4, 7)),
    ((7168, 3584), (64, 2, 7)), ((512, 7168), (128, 1, 3)),  # the last streams 4 of 7 tiles
])  # fmt: skip
def test_the_norm_prologue_and_the_addend_match_float64(shape, cfg, add) -> None:
    """As close to float64 as vLLM's order (normed x rounded to bf16, then cuBLAS) is."""
    n, k = shape
    gen = torch.Generator(device="cuda").manual_seed(n + k + add)
    w = (torch.randn(n, k, generator=gen, device="cuda") / k**0.5).to(BF)
    g = (1 + 0.3 * torch.randn(k, generator=gen, device="cuda")).to(BF)
    wide = (3 * torch.randn(4, k + 64, generator=gen, device="cuda")).to(BF)
    bad = []
    for m in (1, 2, 3, 4):
        for x in (wide[:m, :k], wide[:m, :k].contiguous()):  # strided (MLA's q_c) and packed
            add_to = torch.randn(m, n, generator=gen, device="cuda").to(BF) if add else None
            ref = _rmsnorm64(x, g, 1e-6) @ w.to(D).t() + (add_to.to(D) if add else 0)
            stock = torch.mm(_rmsnorm64(x, g, 1e-6).to(BF), w.t()).to(D) + (add_to.to(D) if add else 0)
            floor = max(2 * _rel(stock, ref), 2e-3)
            y = gv.rmsnorm_gemv_pdl(x, g, 1e-6, w, gv.GemvPdlConfig(*cfg), add_to=add_to)
            err = _rel(y, ref) if torch.isfinite(y).all() else float("inf")
            if y.shape != (m, n) or not err <= floor:
                bad.append((m, x.is_contiguous(), err, floor))
    assert not bad, bad


def test_an_addend_without_the_norm_and_a_bad_norm_weight_are_refused() -> None:
    cfg = gv.GemvPdlConfig(64, 2, 3)
    w = torch.randn(2304, 1536, device="cuda").to(BF)
    x = torch.randn(2, 1536, device="cuda").to(BF)
    assert "with norm_weight" in gv.operands_error(cfg, x, w, None, torch.zeros(2, 2304, device="cuda", dtype=BF))
    assert "(K,)" in gv.operands_error(cfg, x, w, torch.ones(1535, device="cuda", dtype=BF))
    with pytest.raises(ValueError, match="BF16"):
        gv.rmsnorm_gemv_pdl(x, torch.ones(1536, device="cuda"), 1e-6, w, cfg)


def test_the_fused_tables_gemv_rows_route_and_match_under_capture() -> None:
    """Every rmsnorm_gemm row of the SM90 fused table that names gemv_rmsnorm, through
    try_rmsnorm_gemm after the switch's warm-up, captured in a CUDA graph (so each M's
    build must have been compiled by the warm-up) and replayed."""
    from vllm.models.kimi_k3.nvidia import low_latency_fused_dispatch as fd

    rows = [(shape, m) for op, shape, m, call in fd.FUSED_SM90.rows()
            if op == "rmsnorm_gemm" and call.backend == "gemv_rmsnorm"]  # fmt: skip
    if not rows:
        pytest.skip("the SM90 fused table routes no rmsnorm_gemm row to gemv_rmsnorm")
    fd.enable_kimi_k3_fused_decode(torch.nn.Linear(1, 1, device="cuda"), BF)
    try:
        for (n, k), m in rows:
            w = (torch.randn(n, k, device="cuda") / k**0.5).to(BF)
            g = torch.rand(k, device="cuda").to(BF) + 0.5
            x = torch.randn(m, k, device="cuda").to(BF)
            add_to = torch.randn(m, n, device="cuda").to(BF)
            out = {}
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                out["y"] = fd.try_rmsnorm_gemm(x, g, 1e-6, w, add_to=add_to)
            assert out["y"] is not None, ((n, k), m, "not routed under capture")
            graph.replay()
            torch.cuda.synchronize()
            ref = _rmsnorm64(x, g, 1e-6) @ w.to(D).t() + add_to.to(D)
            assert _rel(out["y"][0], ref) < 1e-2, ((n, k), m)
    finally:
        fd.disable_kimi_k3_fused_decode()
