# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-k3-overlay project
"""GPU numerics of the Kimi-K3 low-latency GEMM routing (vllm-k3-overlay).

For every (N, K, M) that the current device's table routes to a fast backend
(``low_latency_gemm.routed_rows()``), on fresh random bf16 inputs (never zeros):

* the routed output is within ``REL_TOL`` (1e-2) of a float64 reference,
  relative error ‖out−ref‖/‖ref‖, and at most ``VS_CUBLAS`` (2x) cuBLAS's own
  error on the same inputs; no NaN/Inf; every element written (the caching
  allocator's block is poisoned with NaN first and must be the one reused);
* the fused ``+ residual`` epilogue of the row's CuTe config is right, and
  ``try_low_latency_gemm(..., residual)`` routes or returns None exactly as the
  table's residual rows say;
* the same call captured in a CUDA graph, over two weight copies, and replayed on
  rotating new inputs is right every time (for the swap-AB kernel this also shows
  its split-K counters reset themselves between launches);
* every swap-AB config the table uses is right with its fused ``+ residual``, and
  under PDL when one launch's output is the next one's input inside a graph;
* ``enable_kimi_k3_low_latency_gemm`` on a small module tree installs a plan on
  the routed layer only, launches the planned backend at a routed M and falls back
  to the layer's normal GEMM at an M the table leaves to cuBLAS.

Speed is not asserted here (see ``k3lab/bench/gemm.py``). Without a CUDA GPU, the
CuTe DSL, an importable vLLM tree carrying the overlay, or a table for this
GPU, the whole module is skipped with the reason.
"""

from __future__ import annotations

import os

import pytest

torch = pytest.importorskip("torch")

REL_TOL = 1e-2  # bf16 operands, fp32 accumulation: expect ~2e-3
VS_CUBLAS = 2.0  # our error may be at most this multiple of cuBLAS's


def _why_skip() -> str | None:
    if not torch.cuda.is_available():
        return "needs a CUDA GPU; none is visible"
    # A GPU runner without vLLM's compiled _C may supply a standalone dsv3 build
    # (k3lab/device/dsv3_build.py); load it before the module caches "not built".
    if os.environ.get("K3_DSV3_LIB"):
        torch.ops.load_library(os.environ["K3_DSV3_LIB"])
    try:
        import cutlass  # noqa: F401
        import cutlass.cute  # noqa: F401
    except Exception as exc:  # ImportError or a broken install
        return f"needs the CuTe DSL (nvidia-cutlass-dsl): {exc!r}"
    try:
        from vllm.models.kimi_k3.nvidia import low_latency_gemm_dispatch as llg
        from vllm.platforms import current_platform
    except Exception as exc:
        return f"needs a vLLM tree with the k3 overlay importable: {exc!r}"
    if current_platform.get_device_capability() is None:
        return "vLLM detected no CUDA platform (is the vllm dist-info installed?)"
    if llg.device_table() is None:
        cap = torch.cuda.get_device_capability()
        return f"no low-latency table for this GPU (capability {cap})"
    return None


SKIP_REASON = _why_skip()
pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(SKIP_REASON is not None, reason=SKIP_REASON or ""),
]

if SKIP_REASON is None:
    from vllm.model_executor.kernels.linear.cute_dsl import skinny_gemm as sg
    from vllm.models.kimi_k3.nvidia import low_latency_gemm_dispatch as llg

    ROWS = [r for r in llg.routed_rows() if not r.has_residual]
    RESIDUAL_ROWS = [r for r in llg.routed_rows() if r.has_residual]
else:
    ROWS, RESIDUAL_ROWS = [], []


def _id(row) -> str:
    return f"{row.n}x{row.k}-M{row.num_tokens}-{row.backend}"


def _inputs(m: int, n: int, k: int, seed: int):
    """Random normal bf16 ``x`` [M, K] and ``w`` [N, K] (scaled to unit-ish outputs)."""
    g = torch.Generator(device="cuda").manual_seed(seed)
    x = torch.randn(m, k, generator=g, device="cuda", dtype=torch.bfloat16)
    w = (torch.randn(n, k, generator=g, device="cuda") / k**0.5).to(torch.bfloat16)
    return x, w


def _rel(out: torch.Tensor, ref: torch.Tensor) -> float:
    return float((out.double() - ref).norm() / ref.norm())


def _ref(x, w, residual=None):
    r = x.double() @ w.double().t()
    return r if residual is None else r + residual.double()


def _available(row) -> bool:
    return llg._backend_available(row.backend)


def _check_close(out, x, w, residual=None, what=""):
    """Assert finite, ≤ REL_TOL and ≤ VS_CUBLAS x cuBLAS's error vs float64."""
    assert out is not None, f"{what}: routed row fell back (None)"
    assert out.shape == (x.shape[0], w.shape[0]) and out.dtype == torch.bfloat16
    assert torch.isfinite(out).all(), f"{what}: NaN/Inf or unwritten elements"
    ref = _ref(x, w, residual)
    cub = torch.mm(x, w.t()) if residual is None else torch.addmm(residual, x, w.t())
    err, cub_err = _rel(out, ref), _rel(cub, ref)
    assert err <= REL_TOL, f"{what}: rel err {err:.2e} > {REL_TOL}"
    assert err <= VS_CUBLAS * cub_err, f"{what}: rel err {err:.2e} > 2x cuBLAS's {cub_err:.2e}"
    return err, cub_err


def test_platform_and_table_agree():
    """vLLM sees the same capability as torch, and the table routes something."""
    from vllm.platforms import current_platform

    cap = current_platform.get_device_capability()
    assert (cap.major, cap.minor) == torch.cuda.get_device_capability()
    assert ROWS, "the device's table routes no (N, K, M) at all"
    for r in ROWS:
        assert llg.select_kimi_k3_backend(r.num_tokens, r.n, r.k) == r.backend


@pytest.mark.parametrize("row", ROWS, ids=_id)
def test_routed_row_matches_reference(row):
    x, w = _inputs(row.num_tokens, row.n, row.k, seed=row.n + row.k + row.num_tokens)
    if not _available(row):
        assert llg.try_low_latency_gemm(x, w) is None, "unbuilt backend must fall back"
        pytest.skip(f"{row.backend} not built here; fell back as designed")
    out = llg.try_low_latency_gemm(x, w)  # compiles
    assert out is not None, "routed row fell back"
    _check_close(out, x, w, what=_id(row))
    # Fresh inputs into memory that held NaN: the caching allocator often hands the freed,
    # poisoned block back, and an element the kernel skipped then shows as NaN. Reuse is
    # not guaranteed (a split-K workspace may take the block first; seen on the H200 for
    # 3 of 999 rows), so it is not asserted here: the graph test below poisons its static
    # outputs directly and proves every element is written on every row.
    for attempt in range(2):
        out.fill_(float("nan"))
        x2, _ = _inputs(row.num_tokens, row.n, row.k, seed=99 + row.n + attempt)
        del out
        out = llg.try_low_latency_gemm(x2, w)
        _check_close(out, x2, w, what=f"{_id(row)} fresh inputs {attempt}")


@pytest.mark.parametrize("row", [r for r in ROWS if r.backend == "cute"], ids=_id)
def test_residual_epilogue_and_residual_routing(row):
    m, n, k = row.num_tokens, row.n, row.k
    x, w = _inputs(m, n, k, seed=7 * n + k + m)
    residual = torch.randn(m, n, device="cuda", dtype=torch.bfloat16)
    # The row's own config with the fused epilogue (what a residual row would run).
    out = sg.shape_dynamic_skinny_gemm(x, w, row.config, residual)
    _check_close(out, x, w, residual, what=f"{_id(row)} residual epilogue")
    routed = llg.try_low_latency_gemm(x, w, residual)
    if llg.select_kimi_k3_backend(m, n, k, has_residual=True) == "cute":
        _check_close(routed, x, w, residual, what=f"{_id(row)} residual route")
    else:
        assert routed is None, "table has no residual row here: must fall back"


@pytest.mark.parametrize("row", RESIDUAL_ROWS, ids=_id)
def test_residual_rows(row):
    m, n, k = row.num_tokens, row.n, row.k
    x, w = _inputs(m, n, k, seed=3 * n + k + m)
    residual = torch.randn(m, n, device="cuda", dtype=torch.bfloat16)
    _check_close(llg.try_low_latency_gemm(x, w, residual), x, w, residual, what=_id(row))


@pytest.mark.parametrize("row", ROWS, ids=_id)
def test_cuda_graph_capture_and_replay(row):
    if not _available(row):
        pytest.skip(f"{row.backend} not built here")
    m, n, k = row.num_tokens, row.n, row.k
    x, w = _inputs(m, n, k, seed=11 * n + k + m)
    _, w2 = _inputs(m, n, k, seed=13 * n + k + m)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        llg.try_low_latency_gemm(x, w)  # compile before capture
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        outs = [llg.try_low_latency_gemm(x, w), llg.try_low_latency_gemm(x, w2)]
    assert None not in outs
    for i in range(3):  # rotating inputs: every replay reads a fresh x
        fresh, _ = _inputs(m, n, k, seed=1000 + i)
        x.copy_(fresh)
        for out in outs:
            out.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        _check_close(outs[0], x, w, what=f"{_id(row)} graph replay {i}")
        _check_close(outs[1], x, w2, what=f"{_id(row)} graph replay {i}, 2nd weight")


SWAP_AB_CONFIGS = sorted({(r.config, r.n, r.k) for r in ROWS if r.backend == "swap_ab"})


@pytest.mark.parametrize("config,n,k", SWAP_AB_CONFIGS, ids=lambda v: str(v))
def test_swap_ab_residual_and_pdl_chain(config, n, k):
    from vllm.models.kimi_k3.nvidia import swap_ab_gemm as sab

    for m in (1, 7, 16):
        x, w = _inputs(m, n, k, seed=5 * n + k + m)
        residual = torch.randn(m, n, device="cuda", dtype=torch.bfloat16)
        out = sab.swap_ab_gemm(x, w, config, residual)
        _check_close(out, x, w, residual, what=f"{config} residual M={m}")
    # Under PDL the second launch may start before the first ends; it must still read
    # the first one's output (griddepcontrol.wait before its first read of x).
    m = 8
    x, w = _inputs(m, n, k, seed=17)
    _, w_next = _inputs(m, k, n, seed=19)  # (k, n): maps the first output back to K
    nxt = config if sab.config_error(config, k, n) is None else sab.SwapAbConfig(64, 64, 1, 4, 3)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        sab.swap_ab_gemm(sab.swap_ab_gemm(x, w, config), w_next, nxt)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = sab.swap_ab_gemm(sab.swap_ab_gemm(x, w, config), w_next, nxt)
    for i in range(3):
        x.copy_(_inputs(m, n, k, seed=2000 + i)[0])
        out.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        mid = (x.double() @ w.double().t()).to(torch.bfloat16)
        _check_close(out, mid, w_next, what=f"{config} PDL chain replay {i}")


F_B_ROWS = sorted({(r.n, r.k) for r in ROWS if r.k == 128 and r.backend == "swap_ab"})


@pytest.mark.parametrize("n,k", F_B_ROWS, ids=lambda v: str(v))
def test_f_b_rows_take_the_strided_f_a_slice_in_a_cuda_graph(n, k):
    """f_b_proj reads F_A, a ``[M, 128]`` slice of the packed KDA projection's ``[M, 6288]``
    output: the dispatch routes it to swap-AB, whose warm-up (packed stride K) already
    compiled the kernel the strided call runs, so it captures and replays correctly."""
    for m in (1, 7, 16):
        packed, w = _inputs(m, n, k, seed=23 * n + m)
        proj = torch.randn(m, 6288, device="cuda", dtype=torch.bfloat16)
        f_a = proj[:, 6144:6144 + k]
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            _check_close(llg.try_low_latency_gemm(packed, w), packed, w, what="packed warm-up")
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = llg.try_low_latency_gemm(f_a, w)
        assert out is not None, "the strided F_A slice fell back"
        for i in range(2):
            proj.copy_(torch.randn_like(proj))
            out.fill_(float("nan"))
            graph.replay()
            torch.cuda.synchronize()
            _check_close(out, f_a, w, what=f"F_B {n}x{k} M={m} strided, replay {i}")


def test_enable_routes_and_falls_back(monkeypatch):
    from vllm.model_executor.layers.linear import ReplicatedLinear, UnquantizedLinearMethod

    routed_ms: dict = {}
    for r in ROWS:
        routed_ms.setdefault((r.n, r.k), set()).add(r.num_tokens)
    # Smallest weight whose shape has both a routed M and an M left to cuBLAS.
    mixed = [r for r in ROWS if _available(r) and len(routed_ms[(r.n, r.k)]) < 16]
    assert mixed, "no shape with both a routed row and a cuBLAS M to exercise"
    row = min(mixed, key=lambda r: (r.n * r.k, r.num_tokens))
    unrouted_m = max(m for m in range(1, 17) if m not in routed_ms[(row.n, row.k)])
    assert llg.select_kimi_k3_backend(unrouted_m, row.n, row.k) is None

    # Weight parameters read the TP rank at creation; a replicated layer in a single
    # process has rank 0 of 1, without initialising torch.distributed for it.
    import vllm.model_executor.parameter as vparam

    monkeypatch.setattr(vparam, "get_tensor_model_parallel_rank", lambda: 0, raising=False)
    monkeypatch.setattr(vparam, "get_tensor_model_parallel_world_size", lambda: 1, raising=False)

    class Tree(torch.nn.Module):
        def __init__(self):
            super().__init__()
            kw = dict(bias=False, params_dtype=torch.bfloat16, disable_tp=True, return_bias=False)
            self.routed = ReplicatedLinear(row.k, row.n, **kw)
            self.inner = torch.nn.Sequential(ReplicatedLinear(256, 64, **kw))  # no row

    tree = Tree().cuda()
    with torch.no_grad():
        for p in tree.parameters():
            p.copy_(torch.randn_like(p, dtype=torch.float32).to(p.dtype) / p.shape[1] ** 0.5)
    assert llg.enable_kimi_k3_low_latency_gemm(tree, torch.float16) == 0
    assert llg.enable_kimi_k3_low_latency_gemm(tree, torch.bfloat16) == 1
    assert isinstance(tree.routed.quant_method, llg.KimiK3LowLatencyLinearMethod)
    assert type(tree.inner[0].quant_method) is UnquantizedLinearMethod

    calls = []
    real_launch = llg._launch

    def spy(call, x, weight):
        calls.append(call)
        return real_launch(call, x, weight)

    monkeypatch.setattr(llg, "_launch", spy)
    w = tree.routed.weight
    for m, expect_routed in ((row.num_tokens, True), (unrouted_m, False)):
        calls.clear()
        x, _ = _inputs(m, row.n, row.k, seed=m)
        out = tree.routed(x)
        assert len(calls) == (1 if expect_routed else 0), f"M={m}: planned calls {calls}"
        if expect_routed:
            assert calls[0] == (row.backend, row.config)
        _check_close(out, x, w, what=f"module M={m}")
    calls.clear()
    x = torch.randn(row.num_tokens, 256, device="cuda", dtype=torch.bfloat16)
    out = tree.inner(x)
    assert not calls
    _check_close(out, x, tree.inner[0].weight, what="unrouted layer")
