# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-k3-overlay project
"""GPU numerics of our one-launch attn-res (``try_attn_res``) on every routed row.

For each M the device's fused table routes for ``attn_res``, and NB in {0, 1, 2, 8, 15}
with the decoder layers' flag combinations (delta or not, block write or not, output norm),
the entry is called once outside capture (it must route), then captured in a CUDA graph;
fresh random bf16 data go into the very buffers and the graph is replayed. The output must
match float64 of the math about as closely as v0.28.0's own kernel
(``vllm.models.kimi_k3.nvidia.ops.attn_res.attn_res``, run on copies of the same inputs)
does, and be close to that kernel's output; the prefix write must be ``bf16(prefix +
delta)`` bit for bit and the block write the new prefix bit for bit. The same for the
launcher's ``loop`` variant at four configs of the bench grid. Also every meta variant
of the launcher once. Skipped, with the reason, without a CUDA GPU or a table row.
"""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("triton")

pytestmark = pytest.mark.gpu
if not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU", allow_module_level=True)

from vllm.models.kimi_k3.nvidia import attn_res as ar  # noqa: E402
from vllm.models.kimi_k3.nvidia import low_latency_fused_dispatch as fd  # noqa: E402

TABLE = fd.device_table()
ROWS = [] if TABLE is None else [(s, m) for op, s, m, _ in TABLE.rows() if op == "attn_res"]
if not ROWS:
    pytest.skip("this GPU's fused table routes no attn_res row", allow_module_level=True)

D, BF = torch.float64, torch.bfloat16
EPS, OUT_EPS = 1e-6, 1e-5
NBS = (0, 1, 2, 8, 15)
# (delta, block write, output norm): pre-attn (with or without the write), post-attn
# (with or without delta), and the final tap's form without the output norm
FLAGS = [(True, True, True), (True, False, True), (False, False, True), (False, True, True),
         (True, False, False)]  # fmt: skip


@pytest.fixture(autouse=True)
def _switch_on(monkeypatch):
    monkeypatch.setattr(fd, "_enabled", True)
    monkeypatch.delenv("VLLM_BATCH_INVARIANT", raising=False)


def _inputs(h, m, nb, flags, gen):
    has_delta, write, out_norm = flags
    rnd = lambda *s: torch.randn(*s, generator=gen, device="cuda").to(BF)  # noqa: E731
    return {
        "prefix": rnd(m, h), "delta": rnd(m, h) if has_delta else None,
        # a [M, R, H] view of a wider buffer, R > NB + 1 (the model's blocks are a slice)
        "buf": rnd(m, nb + 4, h), "nw": 1 + 0.1 * rnd(h), "qw": rnd(h) * 4 / h**0.5,
        "ow": 1 + 0.1 * rnd(h) if out_norm else None, "nb": nb, "widx": nb + 1 if write else -1,
    }  # fmt: skip


def _args(b):
    return (b["prefix"], b["delta"], b["buf"][:, 1:], b["nw"], b["qw"], b["ow"], b["nb"],
            b["widx"], EPS, OUT_EPS)  # fmt: skip


def _reference(prefix, delta, blocks, nw, qw, ow, nb, widx, eps, oeps):
    u = prefix.to(D) if delta is None else (prefix.float() + delta.float()).to(BF).to(D)
    v = torch.stack([blocks[:, s].to(D) for s in range(nb)] + [u], 1)
    logit = (v * (nw.to(D) * qw.to(D))).sum(-1) * torch.rsqrt((v * v).mean(-1) + eps)
    mixed = (logit.softmax(-1)[..., None] * v).sum(1)
    if ow is not None:
        mixed = mixed * torch.rsqrt((mixed * mixed).mean(-1, keepdim=True) + oeps) * ow.to(D)
    return mixed, u.to(BF)


def _stock(args):
    from vllm.models.kimi_k3.nvidia.ops.attn_res import attn_res as stock

    prefix, delta, blocks, nw, qw, ow, nb, widx, eps, oeps = args
    return stock(prefix, delta, blocks, nw, qw, ow, num_blocks=nb, block_write_idx=widx, eps=eps,
                 output_norm_eps=oeps)  # fmt: skip


def _rel(y, ref):
    return float((y.to(D) - ref).norm() / ref.norm())


def _clone(args):
    return tuple(a.clone() if isinstance(a, torch.Tensor) else a for a in args)


FLAG_IDS = ["pre-write", "pre", "post-nodelta", "write-nodelta", "no-outnorm"]


def _replay_fresh_and_check(graph, out, b, nb, flags, gen) -> None:
    """Replay ``graph`` (which wrote ``out``) twice on fresh data (the graph must compute, not
    remember): output vs float64 and v0.28.0's kernel, the prefix and block writes bit for bit,
    every other block slot kept."""
    for _ in range(2):
        for t in (b["prefix"], b["delta"], b["buf"], b["nw"], b["qw"], b["ow"]):
            if t is not None:
                t.copy_(torch.randn(t.shape, generator=gen, device="cuda") * (0.1 if t.dim() == 1 else 1)
                        + (1 if t is b["nw"] or t is b["ow"] else 0))  # fmt: skip
        before = _clone(_args(b))
        out.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        ref, want_prefix = _reference(*before)
        stock_args = _clone(before)
        stock_out = _stock(stock_args)
        assert torch.isfinite(out).all(), "NaN/Inf or unwritten output"
        err, err_stock = _rel(out, ref), _rel(stock_out, ref)
        assert err < 1e-2 and err <= 1.5 * err_stock + 1e-3, (err, err_stock)
        assert _rel(out, stock_out.to(D)) < 1e-2
        assert torch.equal(b["prefix"], want_prefix if flags[0] else before[0]), "prefix write"
        assert torch.equal(b["prefix"], stock_args[0]), "prefix differs from v0.28.0's"
        blocks = b["buf"][:, 1:]
        if flags[1]:
            assert torch.equal(blocks[:, nb + 1], b["prefix"]), "block write is not the new prefix"
        kept = [s for s in range(blocks.shape[1]) if not (flags[1] and s == nb + 1)]
        assert torch.equal(blocks[:, kept], before[2][:, kept]), "another block slot changed"


@pytest.mark.parametrize("flags", FLAGS, ids=FLAG_IDS)
@pytest.mark.parametrize("nb", NBS)
@pytest.mark.parametrize("shape,m", ROWS, ids=[f"H{s[0]}-M{m}" for s, m in ROWS])
def test_every_routed_row_in_a_cuda_graph_matches_float64_and_v0_28(shape, m, nb, flags) -> None:
    gen = torch.Generator(device="cuda").manual_seed(31 * m + nb)
    b = _inputs(shape[0], m, nb, flags, gen)
    assert fd.try_attn_res(*_args(b)) is not None, "a routed row answered None"
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = fd.try_attn_res(*_args(b))
    _replay_fresh_and_check(graph, out, b, nb, flags, gen)


@pytest.mark.parametrize("meta", [dict(num_warps=8), dict(num_warps=16), dict(num_warps=32),
                                  dict(block_s=8), dict(block_s=8, reload=True),
                                  dict(reload=True, num_warps=32), dict(pdl=False)])  # fmt: skip
@pytest.mark.parametrize("nb", (8, 15))
def test_every_meta_variant_matches_float64(meta, nb) -> None:
    gen = torch.Generator(device="cuda").manual_seed(nb)
    b = _inputs(7168, 16, nb, (True, True, True), gen)
    before = _clone(_args(b))
    out = ar.attn_res(*_args(b), **meta)
    ref, want_prefix = _reference(*before)
    assert _rel(out, ref) < 1e-2
    assert torch.equal(b["prefix"], want_prefix)


LOOP_METAS = [dict(chunk=1024, num_warps=8, num_stages=4), dict(chunk=1024, num_warps=16, num_stages=8),
              dict(chunk=2048, num_warps=8, num_stages=3),
              dict(chunk=512, num_warps=4, num_stages=8)]  # fmt: skip


@pytest.mark.parametrize("flags", FLAGS, ids=FLAG_IDS)
@pytest.mark.parametrize("nb", (0, 1, 8, 15))
@pytest.mark.parametrize("m", (1, 16))
@pytest.mark.parametrize("meta", LOOP_METAS, ids=lambda d: "ch{chunk}-w{num_warps}-s{num_stages}".format(**d))
def test_loop_variant_in_a_cuda_graph_matches_float64_and_v0_28(meta, m, nb, flags) -> None:
    """``variant="loop"`` at H = 7168 (PDL on, SM90+): as the routed test, fresh data per
    replay, output vs float64 and v0.28.0's kernel, the prefix and block writes bit for bit."""
    gen = torch.Generator(device="cuda").manual_seed(7 * m + nb)
    b = _inputs(7168, m, nb, flags, gen)
    if ar.loop_smem_bytes(ar.block_s_for(nb), meta["chunk"], meta["num_stages"]) > ar.MAX_SMEM_BYTES:
        with pytest.raises(ValueError, match="shared memory"):  # refused, not a launch failure
            ar.attn_res(*_args(b), variant="loop", **meta)
        return
    ar.attn_res(*_args(b), variant="loop", **meta)  # compile outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = ar.attn_res(*_args(b), variant="loop", **meta)
    _replay_fresh_and_check(graph, out, b, nb, flags, gen)


def test_unrouted_calls_answer_none_on_the_gpu() -> None:
    gen = torch.Generator(device="cuda").manual_seed(0)
    b = _inputs(ROWS[0][0][0], 17, 8, (True, False, True), gen)
    assert fd.try_attn_res(*_args(b)) is None  # M = 17: no row
    b = _inputs(ROWS[0][0][0], 4, 8, (True, False, True), gen)
    args = list(_args(b))
    args[0] = args[0].float()
    assert fd.try_attn_res(*args) is None  # fp32


def _cluster_or_skip():
    if torch.cuda.get_device_capability()[0] < 9:
        pytest.skip("the cluster variant needs SM90+ (thread-block clusters)")
    pytest.importorskip("cutlass.cute", reason="the cluster variant needs nvidia-cutlass-dsl")


@pytest.mark.parametrize("flags", FLAGS, ids=FLAG_IDS)
@pytest.mark.parametrize("nb", (0, 1, 8, 15))
@pytest.mark.parametrize("m", (1, 6, 16))
@pytest.mark.parametrize("cluster", (2, 4, 8))
def test_cluster_variant_in_a_cuda_graph_matches_float64_and_v0_28(cluster, m, nb, flags) -> None:
    """``attn_res_cluster`` (CuTe DSL, PDL on) at H = 7168: as the routed test."""
    _cluster_or_skip()
    gen = torch.Generator(device="cuda").manual_seed(11 * m + nb + cluster)
    b = _inputs(7168, m, nb, flags, gen)
    from vllm.models.kimi_k3.nvidia.attn_res_cluster import attn_res_cluster

    attn_res_cluster(*_args(b), cluster=cluster)  # compile outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = attn_res_cluster(*_args(b), cluster=cluster)
    _replay_fresh_and_check(graph, out, b, nb, flags, gen)


def test_cluster_config_falls_back_to_the_tile_kernel_for_a_build_first_seen_in_a_capture() -> None:
    """A cluster build is compiled on the host at first use; inside a capture the backend
    takes the tile kernel instead (compiled by warm-up), and the numerics hold."""
    _cluster_or_skip()
    from vllm.models.kimi_k3.nvidia import attn_res_cluster as arc
    from vllm.models.kimi_k3.nvidia.gemm_backends.pdl_attn_res import BACKEND, TILE_FALLBACK

    gen = torch.Generator(device="cuda").manual_seed(5)
    b = _inputs(7168, 3, 13, (True, False, True), gen)
    build = arc._build_of(b["prefix"], b["delta"], b["ow"], 13, -1, 8, True)
    arc._COMPILED.pop(build, None)
    BACKEND.launch(TILE_FALLBACK, *_clone(_args(b)))  # the tile build, as compile_for makes it
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = BACKEND.launch(("cluster", 8), *_args(b))
    assert build not in arc._COMPILED, "compiled inside a capture"
    _replay_fresh_and_check(graph, out, b, 13, (True, False, True), gen)
