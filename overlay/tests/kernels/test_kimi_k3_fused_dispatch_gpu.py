# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-k3-overlay project
"""GPU numerics of every routed row of the fused decode ops, through the dispatch's entries.

For each ``(op, shape, M)`` the device's fused table routes (``FusedTable.rows()``), the
public entry (``try_rmsnorm_gemm``, ``try_rms_norm``, ``try_act_mul``, ``try_gate_gemm``)
is called once outside capture (it must route, not answer None), then captured in a CUDA
graph; the inputs are refilled with fresh random bf16 data and the graph replayed. The
output must match float64 of the unfused sequence about as closely as vLLM's unfused bf16
sequence does, a new residual must equal ``bf16(x + residual)`` exactly, and the gate
GEMM's fp32 logits must match float64 to fp32 accuracy. Also: the model's call sites
(``fused_decode``) against the stock modules they wrap. Skipped, with the
reason, without a CUDA GPU or on a GPU without a fused table.
"""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("triton")

pytestmark = pytest.mark.gpu
if not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU", allow_module_level=True)

from vllm.models.kimi_k3.nvidia import low_latency_fused_dispatch as fd  # noqa: E402

TABLE = fd.device_table()
if TABLE is None:
    pytest.skip("this GPU has no fused decode table", allow_module_level=True)

D, BF = torch.float64, torch.bfloat16
EPS = 1e-6
ROWS = list(TABLE.rows())


@pytest.fixture(autouse=True)
def _switch_on(monkeypatch):
    monkeypatch.setattr(fd, "_enabled", True)
    monkeypatch.delenv("VLLM_BATCH_INVARIANT", raising=False)


def _rms(t, g):
    t = t.to(D)
    return t * torch.rsqrt(t.pow(2).mean(-1, keepdim=True) + EPS) * g.to(D)


def _rel(y, ref):
    return float((y.to(D) - ref).norm() / ref.norm())


def _inputs(op, shape, m, gen):
    """Fresh-fillable bf16 inputs of one row (a dict of CUDA tensors)."""
    rnd = lambda *s: torch.randn(*s, generator=gen, device="cuda").to(BF)  # noqa: E731
    if op in ("rmsnorm_gemm", "add_rmsnorm_gemm"):
        n, k = shape
        b = {"x": rnd(m, k), "g": 1 + 0.1 * rnd(k), "w": rnd(n, k) / k**0.5, "add": rnd(m, n)}
        if op == "add_rmsnorm_gemm":
            b["r"] = rnd(m, k)
        return b
    if op == "rmsnorm":
        (k,) = shape
        return {"x": rnd(m, k), "g": 1 + 0.1 * rnd(k), "r": rnd(m, k)}
    if op == "gate_gemm":
        n, k = shape
        return {"x": rnd(m, k), "w": rnd(n, k) / k**0.5}
    (d,) = shape
    return {"gu": rnd(m, 2 * d)}


def _call(op, b, variant):
    """The entry under test; ``variant`` picks the add / epilogue / SITU form."""
    if op == "rmsnorm_gemm":
        return fd.try_rmsnorm_gemm(b["x"], b["g"], EPS, b["w"], add_to=b["add"] if variant else None)
    if op == "add_rmsnorm_gemm":
        return fd.try_rmsnorm_gemm(b["x"], b["g"], EPS, b["w"], b["r"],
                                   add_to=b["add"] if variant else None)  # fmt: skip
    if op == "rmsnorm":
        return fd.try_rms_norm(b["x"], b["g"], EPS, b["r"] if variant else None)
    if op == "gate_gemm":  # Kimi-K3's 384 gate rows; the variant splits inside a tile
        return fd.try_gate_gemm(b["x"], b["w"], _n_fp32(variant))
    return fd.try_act_mul(b["gu"], situ_beta=2.0 if variant else None,
                          situ_linear_beta=3.0 if variant else None)  # fmt: skip


def _n_fp32(variant):
    return 397 if variant else 384


def _reference(op, b, variant):
    """(float64 reference, vLLM-style unfused bf16 result, new residual or None)."""
    if op == "gate_gemm":  # vLLM: the gate in fp32 (cuBLAS bf16 -> fp32), the rest in bf16
        ref = b["x"].to(D) @ b["w"].to(D).t()
        nf = _n_fp32(variant)
        unfused = torch.cat([torch.mm(b["x"].float(), b["w"][:nf].float().t()).to(D),
                             torch.mm(b["x"], b["w"][nf:].t()).to(D)], 1)  # fmt: skip
        return ref, unfused, None
    if op in ("rmsnorm_gemm", "add_rmsnorm_gemm"):
        h = b["x"].to(D) + (b["r"].to(D) if "r" in b else 0)
        add = b["add"].to(D) if variant else 0
        ref = _rms(h, b["g"]) @ b["w"].to(D).t() + add
        hb = (b["x"].float() + b["r"].float()).to(BF) if "r" in b else b["x"]
        unfused = (_rms(hb, b["g"]).to(BF) @ b["w"].t()).to(D) + add
        return ref, unfused, (hb if "r" in b else None)
    if op == "rmsnorm":
        hb = (b["x"].float() + b["r"].float()).to(BF) if variant else b["x"]
        ref = _rms(b["x"].to(D) + (b["r"].to(D) if variant else 0), b["g"])
        return ref, _rms(hb, b["g"]).to(BF).to(D), (hb if variant else None)
    d = b["gu"].shape[1] // 2
    g, u = b["gu"][:, :d].to(D), b["gu"][:, d:].to(D)
    if variant:
        ref = 2.0 * torch.tanh(g / 2.0) * torch.sigmoid(g) * 3.0 * torch.tanh(u / 3.0)
    else:
        ref = g * torch.sigmoid(g) * u
    return ref, ref.to(BF).to(D), None


@pytest.mark.parametrize("variant", [False, True], ids=["plain", "variant"])
@pytest.mark.parametrize("op,shape,m,call", ROWS,
                         ids=[f"{r[0]}-{'x'.join(map(str, r[1]))}-M{r[2]}" for r in ROWS])  # fmt: skip
def test_every_routed_row_in_a_cuda_graph_matches_float64(op, shape, m, call, variant) -> None:
    gen = torch.Generator(device="cuda").manual_seed(7 * m + sum(shape))
    b = _inputs(op, shape, m, gen)
    assert _call(op, b, variant) is not None, "a routed row answered None"
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        got = _call(op, b, variant)
    if op == "gate_gemm":
        (logits, rest), new_residual = got, None
        assert logits.dtype == torch.float32 and rest.dtype == BF
    else:
        out, new_residual = got if isinstance(got, tuple) else (got, None)
    for _ in range(2):  # fresh data each replay: the graph must compute, not remember
        for t in b.values():
            t.copy_(torch.randn(t.shape, generator=gen, device="cuda"))
        if new_residual is not None:
            new_residual.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        ref, unfused, want_residual = _reference(op, b, variant)
        if op == "gate_gemm":
            nf = _n_fp32(variant)
            assert _rel(logits, ref[:, :nf]) < 1e-5, "logits not at fp32 accuracy"
            out = torch.cat([logits.to(D), rest.to(D)], 1)
        assert torch.isfinite(out).all(), "NaN/Inf or unwritten output"
        err, err_unfused = _rel(out, ref), _rel(unfused, ref)
        assert err < 1e-2 and err <= 1.5 * err_unfused + 1e-3, (err, err_unfused)
        if want_residual is not None:
            assert torch.equal(new_residual, want_residual), "new residual differs from bf16(x + r)"


def test_unrouted_calls_answer_none_on_the_gpu() -> None:
    x = torch.randn(17, 7168, device="cuda").to(BF)
    g = torch.ones(7168, device="cuda", dtype=BF)
    assert fd.try_rms_norm(x, g, EPS) is None, "M = 17 routed"
    assert fd.try_rms_norm(x[:4].float(), g, EPS) is None, "fp32 routed"
    assert fd.try_act_mul(torch.zeros(4, 2 * 1000, device="cuda", dtype=BF)) is None


def test_enable_warms_up_every_routed_config() -> None:
    model = torch.nn.Linear(8, 8, bias=False, device="cuda", dtype=BF)
    distinct = {(op, shape, call) for op, shape, _, call in ROWS}
    assert fd.enable_kimi_k3_fused_decode(model, BF) == len(distinct)
