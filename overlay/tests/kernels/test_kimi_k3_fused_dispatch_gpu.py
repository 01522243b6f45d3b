# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-k3-overlay project
"""GPU numerics of every routed row of the fused decode ops, through the dispatch's entries.

For each ``(op, shape, M)`` the device's fused table routes (``FusedTable.rows()``), the
public entry (``try_rmsnorm_gemm``, ``try_rms_norm``, ``try_act_mul``,
``try_sigmoid_mul``, ``try_mtp_input``) is called once outside capture (it must route,
not answer None), then captured in a CUDA graph; the inputs are refilled with fresh
random bf16 data (positions with fresh 0/1 values) and the graph replayed. The output
must match float64 of the unfused sequence about as closely as vLLM's unfused bf16
sequence does, and a new residual must equal ``bf16(x + residual)`` exactly. Also
patch 0006's MLA front end (``fused_decode.mla_q_and_kv_c``: ``q_b_proj`` with
``q_a_layernorm`` in its prologue and ``kv_a_layernorm`` on views of one
``fused_qkv_a_proj`` output, TP8 shapes) at every M = 1..16, captured and replayed the
same way. Skipped, with the reason, without a CUDA GPU or on a GPU without a fused table.
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
# attn_res (its own operands and references) is tested in test_kimi_k3_attn_res_gpu.py,
# embed_rows (a copy: exact, integer ids) below
ALL_ROWS = list(TABLE.rows())
ROWS = [row for row in ALL_ROWS if row[0] not in ("attn_res", "embed_rows")]
EMBED_ROWS = [row for row in ALL_ROWS if row[0] == "embed_rows"]


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
    if op == "sigmoid_mul":
        (d,) = shape
        # the variant's gate is a row-strided view (the column half of a wider tensor)
        return {"x": rnd(m, d), "gate": rnd(m, d), "wide": rnd(m, 2 * d)}
    if op == "mtp_input":
        (h,) = shape
        positions = torch.randint(0, 2, (m,), generator=gen, device="cuda")
        return {"pos": positions, "e": rnd(m, h), "h": rnd(m, h), "ge": 1 + 0.1 * rnd(h),
                "gh": 1 + 0.1 * rnd(h)}  # fmt: skip
    if op == "gate_gemm":
        n, k = shape
        return {"x": rnd(m, k), "w": rnd(n, k) / k**0.5}
    (d,) = shape
    return {"gu": rnd(m, 2 * d)}


def _refill(b, gen) -> None:
    """Fresh data into every input, in place (the graph reads these very buffers)."""
    for t in b.values():
        if t.dtype.is_floating_point:
            t.copy_(torch.randn(t.shape, generator=gen, device="cuda"))
        else:  # positions: 0 (embedding half zeroed) or not
            t.copy_(torch.randint(0, 2, t.shape, generator=gen, device="cuda"))


def _call(op, b, variant):
    """The entry under test; ``variant`` picks the add / epilogue / SITU form."""
    if op == "rmsnorm_gemm":
        return fd.try_rmsnorm_gemm(b["x"], b["g"], EPS, b["w"], add_to=b["add"] if variant else None)
    if op == "add_rmsnorm_gemm":
        return fd.try_rmsnorm_gemm(b["x"], b["g"], EPS, b["w"], b["r"],
                                   add_to=b["add"] if variant else None)  # fmt: skip
    if op == "rmsnorm":
        return fd.try_rms_norm(b["x"], b["g"], EPS, b["r"] if variant else None)
    if op == "sigmoid_mul":
        d = b["x"].shape[1]
        return fd.try_sigmoid_mul(b["x"], b["wide"][:, d:] if variant else b["gate"])
    if op == "mtp_input":
        positions = b["pos"].int() if variant else b["pos"]  # int32 positions are taken too
        return fd.try_mtp_input(positions, b["e"], b["h"], b["ge"], b["gh"], EPS)
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
    if op == "sigmoid_mul":
        d = b["x"].shape[1]
        gate = b["wide"][:, d:] if variant else b["gate"]
        ref = b["x"].to(D) * torch.sigmoid(gate.to(D))
        return ref, ref.to(BF).to(D), None  # Inductor's kernel: fp32 math, one rounding
    if op == "mtp_input":
        live = (b["pos"] != 0).to(D)[:, None]
        ref = torch.cat([_rms(b["e"], b["ge"]) * live, _rms(b["h"], b["gh"])], 1)
        return ref, ref.to(BF).to(D), None  # v0.28.0's kernel: fp32 math, one rounding
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
        _refill(b, gen)
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
        if op == "mtp_input":
            h = b["e"].shape[1]
            assert (out[b["pos"] == 0, :h] == 0).all(), "an embedding half at position 0 is not 0"


def test_unrouted_calls_answer_none_on_the_gpu() -> None:
    x = torch.randn(17, 7168, device="cuda").to(BF)
    g = torch.ones(7168, device="cuda", dtype=BF)
    assert fd.try_rms_norm(x, g, EPS) is None, "M = 17 routed"
    assert fd.try_rms_norm(x[:4].float(), g, EPS) is None, "fp32 routed"
    assert fd.try_act_mul(torch.zeros(4, 2 * 1000, device="cuda", dtype=BF)) is None
    gate = torch.zeros(17, 1536, device="cuda", dtype=BF)
    assert fd.try_sigmoid_mul(gate, gate) is None, "M = 17 routed"
    e = torch.zeros(4, 1000, device="cuda", dtype=BF)
    pos = torch.ones(4, device="cuda", dtype=torch.int64)
    assert fd.try_mtp_input(pos, e, e, e[0], e[0], EPS) is None, "H = 1000 routed"


def _q_b_row():
    """The routed ``rmsnorm_gemm`` row of MLA's ``q_b_proj`` and the ``rmsnorm`` row of
    ``kv_a_layernorm`` at TP8 (12 local heads x 192, q_lora 1536, kv_lora 512)."""
    ms = [m for op, shape, m, _ in ROWS if op == "rmsnorm_gemm" and shape == (2304, 1536)]
    kv = {m for op, shape, m, _ in ROWS if op == "rmsnorm" and shape == (512,)}
    return [m for m in ms if m in kv]


@pytest.mark.parametrize("m", _q_b_row() or [pytest.param(0, marks=pytest.mark.skip(
    reason="this GPU's table routes no q_b_proj / kv_a_layernorm row"))])  # fmt: skip
def test_mla_front_end_of_patch_0006_in_a_cuda_graph_matches_float64(m) -> None:
    from types import SimpleNamespace

    from torch import nn

    from vllm.model_executor.layers.layernorm import RMSNorm
    from vllm.model_executor.layers.linear import ColumnParallelLinear, UnquantizedLinearMethod
    from vllm.models.kimi_k3.nvidia import fused_decode

    def bare(cls, **attrs):
        module = cls.__new__(cls)
        nn.Module.__init__(module)
        for name, value in attrs.items():
            setattr(module, name, value)
        return module

    gen = torch.Generator(device="cuda").manual_seed(100 + m)
    rnd = lambda *s: torch.randn(*s, generator=gen, device="cuda").to(BF)  # noqa: E731
    norm = lambda n: bare(RMSNorm, weight=nn.Parameter(1 + 0.1 * rnd(n)), variance_epsilon=EPS,  # noqa: E731
                          has_weight=True, variance_size_override=None)  # fmt: skip
    q_b = bare(ColumnParallelLinear, quant_method=UnquantizedLinearMethod(), bias=None,
               gather_output=False, weight=nn.Parameter(rnd(2304, 1536) / 1536**0.5))  # fmt: skip
    attn = SimpleNamespace(q_a_layernorm=norm(1536), kv_a_layernorm=norm(512), q_b_proj=q_b,
                           rms_norm_eps=EPS, num_local_heads=12, qk_head_dim=192)  # fmt: skip
    qkv = rnd(m, 1536 + 512 + 64)  # fused_qkv_a_proj's output: q_c and kv_c are views of it
    q_c, kv_c, _ = qkv.split([1536, 512, 64], dim=-1)
    assert fused_decode.mla_q_and_kv_c(attn, q_c, kv_c) is not None, "a routed row answered None"
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        q, kv_c_normed = fused_decode.mla_q_and_kv_c(attn, q_c, kv_c)
    for _ in range(2):
        qkv.copy_(torch.randn(qkv.shape, generator=gen, device="cuda"))
        graph.replay()
        torch.cuda.synchronize()
        assert q.shape == (m, 12, 192) and kv_c_normed.shape == (m, 512)
        ref_q = _rms(q_c, attn.q_a_layernorm.weight) @ q_b.weight.to(D).t()
        unfused_q = (_rms(q_c, attn.q_a_layernorm.weight).to(BF) @ q_b.weight.t()).to(D)
        err, err_unfused = _rel(q.reshape(m, -1), ref_q), _rel(unfused_q, ref_q)
        assert err < 1e-2 and err <= 1.5 * err_unfused + 1e-3, (err, err_unfused)
        ref_kv = _rms(kv_c, attn.kv_a_layernorm.weight)
        assert _rel(kv_c_normed, ref_kv) <= 1.5 * _rel(ref_kv.to(BF), ref_kv) + 1e-3


def test_enable_warms_up_every_routed_config(monkeypatch) -> None:
    """One launch per distinct Triton (op, shape, config); one CuTe DSL build per
    (M, config), with and without the addend (M is a compile-time constant there)."""
    from vllm.models.kimi_k3.nvidia import gemv_pdl as gv

    monkeypatch.setattr(gv, "_COMPILED", {})  # builds of earlier tests count as not compiled
    model = torch.nn.Linear(8, 8, bias=False, device="cuda", dtype=BF)
    triton = {(op, shape, call) for op, shape, _, call in ALL_ROWS if call.backend != "gemv_rmsnorm"}
    cute = {(m, call.config) for _, _, m, call in ALL_ROWS if call.backend == "gemv_rmsnorm"}
    assert fd.enable_kimi_k3_fused_decode(model, BF) == len(triton) + 2 * len(cute)
    pdl = gv.use_pdl(0)
    assert {gv.Build(m, cfg, pdl, True, add) for m, cfg in cute for add in (False, True)} <= set(gv._COMPILED)


def _tail_rows():
    return [m for op, shape, m, _ in ROWS if op == "rmsnorm_gemm" and shape == (7168, 3584)]


@pytest.mark.parametrize("m", _tail_rows() or [pytest.param(0, marks=pytest.mark.skip(
    reason="this GPU's table routes no routed_expert_up_proj row"))])  # fmt: skip
def test_fused_moe_tail_of_patch_0009_matches_the_stock_sequence(monkeypatch, m) -> None:
    """``fused_decode.latent_moe_tail`` (FusedMoE branch, breakable capture) at TP8 shapes,
    the all-reduces stood in by copies (one GPU): v0.28.0's tail computes
    ``up_proj(norm(AR(latent))) + AR(shared)``; ours must match float64 of that as closely
    as the unfused bf16 sequence does."""
    from types import SimpleNamespace

    from torch import nn

    import vllm.distributed as dist
    from vllm.model_executor.layers.layernorm import RMSNorm
    from vllm.model_executor.layers.linear import UnquantizedLinearMethod
    from vllm.compilation.breakable_cudagraph import BreakableCUDAGraphCapture
    from vllm.models.kimi_k3.nvidia import fused_decode

    # the capture the tail was measured in
    monkeypatch.setattr(BreakableCUDAGraphCapture._tls, "active", object(), raising=False)
    monkeypatch.setattr(dist, "tensor_model_parallel_all_reduce", lambda t: t.clone())
    gen = torch.Generator(device="cuda").manual_seed(200 + m)
    rnd = lambda *s: torch.randn(*s, generator=gen, device="cuda").to(BF)  # noqa: E731
    norm = RMSNorm.__new__(RMSNorm)
    nn.Module.__init__(norm)
    norm.weight, norm.variance_epsilon = nn.Parameter(1 + 0.1 * rnd(3584)), EPS
    norm.has_weight, norm.variance_size_override = True, None
    up = SimpleNamespace(quant_method=UnquantizedLinearMethod(), bias=None, weight=rnd(7168, 3584) / 3584**0.5)
    runner = SimpleNamespace(routed_output_transform=SimpleNamespace(norm=norm, up_proj=up))
    latent, shared = rnd(m, 3584), rnd(m, 7168)
    out = fused_decode.latent_moe_tail(runner, latent, shared)
    assert out is not None, "a routed row answered None"
    ref = _rms(latent, norm.weight) @ up.weight.to(D).t() + shared.to(D)
    unfused = (_rms(latent, norm.weight).to(BF) @ up.weight.t()).add_(shared).to(D)
    err, err_unfused = _rel(out, ref), _rel(unfused, ref)
    assert err < 1e-2 and err <= 1.5 * err_unfused + 1e-3, (err, err_unfused)


@pytest.mark.parametrize("ids_dtype", [torch.int64, torch.int32])
@pytest.mark.parametrize("op,shape,m,call", EMBED_ROWS,
                         ids=[f"{r[0]}-{r[1][0]}-M{r[2]}" for r in EMBED_ROWS])  # fmt: skip
def test_every_embed_rows_row_in_a_cuda_graph_is_exact(op, shape, m, call, ids_dtype) -> None:
    """Rank 1 of 4 of a 4000-token vocabulary: ids everywhere in it, the shard's rows copied
    bit for bit, zeros for the others, fresh ids at each replay."""
    (h,) = shape
    gen = torch.Generator(device="cuda").manual_seed(m + h)
    start, end = 1000, 2000
    weight = torch.randn(end - start + 8, h, generator=gen, device="cuda").to(BF)  # padded shard
    ids = torch.randint(0, 4000, (m,), generator=gen, device="cuda").to(ids_dtype)
    assert fd.try_embed_rows(ids, weight, start, end) is not None, "a routed row answered None"
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = fd.try_embed_rows(ids, weight, start, end)
    for i in range(3):
        fresh = torch.randint(0, 4000, (m,), generator=gen, device="cuda")
        fresh[0] = (start, end - 1, end)[i]  # both edges of the shard and the first id past it
        ids.copy_(fresh)
        graph.replay()
        torch.cuda.synchronize()
        inside = (fresh >= start) & (fresh < end)
        want = torch.zeros(m, h, dtype=BF, device="cuda")
        want[inside] = weight[(fresh - start)[inside]]
        assert out.shape == (m, h) and torch.equal(out, want), f"ids {fresh.tolist()}"

