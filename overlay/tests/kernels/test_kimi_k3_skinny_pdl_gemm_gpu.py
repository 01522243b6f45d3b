# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-k3-overlay project
"""GPU numerics of the PDL-aware skinny decode GEMM (vllm-k3-overlay), bf16.

Every shape of the SM90 table at M = 1..4, for every config the H200 sweep may pick
(``skinny_pdl_gemm.sweep_configs``): the output must be finite, of shape (M, N), and
as close to float64 as cuBLAS (``torch.mm``) is on the same inputs (twice its error, or
2e-3). Then PDL where it matters: a chain of dependent calls (each one's x the previous
one's output, split-K and not) captured in one CUDA graph, replayed on fresh inputs
with the outputs poisoned; and the residual epilogue. Skipped, with the reason,
without a CUDA GPU.
"""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("triton")

pytestmark = pytest.mark.gpu
if not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU", allow_module_level=True)

from vllm.models.kimi_k3.nvidia import low_latency_gemm_dispatch as llg  # noqa: E402
from vllm.models.kimi_k3.nvidia import skinny_pdl_gemm as sk  # noqa: E402

D, BF = torch.float64, torch.bfloat16
SM90_SHAPES = sorted(llg.table_for_capability((9, 0)))


def _rel(y, ref):
    return float((y.to(D) - ref).norm() / ref.norm())


@pytest.mark.parametrize("shape", SM90_SHAPES, ids=lambda s: f"{s[0]}x{s[1]}")
def test_every_sweep_config_matches_float64_as_cublas_does(shape) -> None:
    n, k = shape
    gen = torch.Generator(device="cuda").manual_seed(n * 31 + k)
    w = (torch.randn(n, k, generator=gen, device="cuda") / k**0.5).to(BF)
    bad = []
    for m in (1, 2, 3, 4):
        x = torch.randn(m, k, generator=gen, device="cuda").to(BF)
        ref = x.to(D) @ w.to(D).t()
        floor = max(2 * _rel(torch.mm(x, w.t()), ref), 2e-3)
        for cfg in sk.sweep_configs(n, k):
            y = sk.skinny_pdl_gemm(x, w, cfg)
            err = _rel(y, ref) if torch.isfinite(y).all() else float("inf")
            if y.shape != (m, n) or y.dtype != BF or not err <= floor:
                bad.append((m, tuple(cfg), err, floor))
    assert not bad, bad[:8]


@pytest.mark.parametrize("cfgs", [
    ((2, 8192, 1, 4, 1), (1, 1024, 1, 4, 1)),
    ((8, 2048, 4, 4, 1), (4, 1024, 1, 4, 1)),
], ids=["whole-slice", "split-k"])  # fmt: skip
@pytest.mark.parametrize("m", [1, 3, 4])
def test_a_dependent_chain_under_pdl_in_a_cuda_graph(cfgs, m) -> None:
    """x of each call is the previous call's output: the wait must hold x's loads (and
    the split-K workspace) back until the previous kernel has finished."""
    gen = torch.Generator(device="cuda").manual_seed(m)
    w1 = (torch.randn(768, 7168, generator=gen, device="cuda") / 7168**0.5).to(BF)
    w2 = (torch.randn(7168, 768, generator=gen, device="cuda") / 768**0.5).to(BF)
    c1, c2 = sk.SkinnyPdlConfig(*cfgs[0]), sk.SkinnyPdlConfig(*cfgs[1])
    if c1.block_n == 8:  # the split-K case: a 144-row weight, as the sweep splits it
        w1 = w1[:144].contiguous()
        w2 = w2[:, :144].contiguous()
    x = torch.randn(m, 7168, generator=gen, device="cuda").to(BF)
    outs = {}

    def body():
        h = x
        for i in range(3):  # three rounds: the workspace is reused across calls
            h1 = sk.skinny_pdl_gemm(h, w1, c1)
            h = sk.skinny_pdl_gemm(h1, w2, c2, residual=h)
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
            h = (h1 @ w2.to(D).t() + h).to(BF).to(D)
        assert torch.isfinite(outs["y"]).all()
        assert _rel(outs["y"], h) < 2e-2, _rel(outs["y"], h)


def test_residual_epilogue_adds_before_rounding() -> None:
    gen = torch.Generator(device="cuda").manual_seed(7)
    w = (torch.randn(2112, 7168, generator=gen, device="cuda") / 7168**0.5).to(BF)
    for m in (1, 2, 3, 4):
        x = torch.randn(m, 7168, generator=gen, device="cuda").to(BF)
        r = torch.randn(m, 2112, generator=gen, device="cuda").to(BF)
        ref = x.to(D) @ w.to(D).t() + r.to(D)
        for cfg in sk.sweep_configs(2112, 7168)[:3]:
            y = sk.skinny_pdl_gemm(x, w, cfg, residual=r)
            assert _rel(y, ref) <= max(2 * _rel(torch.addmm(r, x, w.t()), ref), 2e-3)


def test_the_backend_runs_through_the_dispatch_launch() -> None:
    call = llg.PlannedCall("skinny_pdl", sk.SkinnyPdlConfig(2, 8192))
    w = torch.randn(768, 7168, device="cuda").to(BF)
    x = torch.randn(2, 7168, device="cuda").to(BF)
    assert llg._operands_ok(call, x, w)
    y = llg._launch(call, x, w)
    assert _rel(y, x.to(D) @ w.to(D).t()) < 2e-2
