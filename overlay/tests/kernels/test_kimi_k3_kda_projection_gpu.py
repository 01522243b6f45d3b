# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-k3-overlay project
"""GPU numerics of the KDA decode projections and of the guards (vllm-k3-overlay).

On fresh random bf16 inputs (never zeros), at TP8 shapes (packed ``[6288, 7168]`` with
zero padding rows, F_B ``[1536, 128]``):

* ``run_kda_projection_overlap`` on a real aux stream, captured in a CUDA graph and
  replayed on new inputs (outputs poisoned with NaN first), gives QKVG, F_B and beta
  within ``REL_TOL`` of a float64 reference and within 2x the sequential path's own
  error (the packed GEMM and F_B on the strided F_A, as v0.28.0 runs them), M 1..16,
  and on the high-priority aux stream at M 1, 2, 9, 16;
* the returned views have the strides ``kda.py`` and the fused KDA decode kernel check;
* F_B on the strided F_A slice takes swap-AB, which reads it in place, at every routed M;
* ``try_low_latency_gemm`` and the planned apply fed views at misaligned addresses
  (element offsets 1, 2, 4, 8 of x, 1 and 8 of the weight) fall back or compute the
  right product, and never raise.

Skipped, with the reason, without a CUDA GPU, the CuTe DSL, an importable vLLM tree
carrying the overlay, or a table for this GPU.
"""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

REL_TOL = 1e-2
VS_SEQUENTIAL = 2.0
M_RANGE = range(1, 17)


def _why_skip() -> str | None:
    if not torch.cuda.is_available():
        return "needs a CUDA GPU; none is visible"
    try:
        import cutlass  # noqa: F401
        import cutlass.cute  # noqa: F401
    except Exception as exc:
        return f"needs the CuTe DSL (nvidia-cutlass-dsl): {exc!r}"
    try:
        from vllm.models.kimi_k3.nvidia import kda_projection  # noqa: F401
        from vllm.models.kimi_k3.nvidia import low_latency_gemm_dispatch as llg
    except Exception as exc:
        return f"needs a vLLM tree with the k3 overlay importable: {exc!r}"
    if llg.device_table() is None:
        return f"no low-latency table for this GPU (capability {torch.cuda.get_device_capability()})"
    return None


SKIP_REASON = _why_skip()
pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(SKIP_REASON is not None, reason=SKIP_REASON or ""),
]

if SKIP_REASON is None:
    from einops import rearrange

    from vllm.models.kimi_k3.nvidia import kda_projection as kp
    from vllm.models.kimi_k3.nvidia import low_latency_gemm_dispatch as llg

PACKED_N, HIDDEN = 6288, 7168
PROJ, HEAD_DIM, HEADS, PAD = 1536, 128, 12, 4
QKVG = 4 * PROJ


def _weights(seed: int):
    g = torch.Generator(device="cuda").manual_seed(seed)
    packed = (torch.randn(PACKED_N, HIDDEN, generator=g, device="cuda") / HIDDEN**0.5).to(torch.bfloat16)
    packed[-PAD:] = 0  # kda.py zeroes the padding rows
    f_b = (torch.randn(PROJ, HEAD_DIM, generator=g, device="cuda") / HEAD_DIM**0.5).to(torch.bfloat16)
    return packed, f_b


def _x(m: int, seed: int, k: int = HIDDEN):
    g = torch.Generator(device="cuda").manual_seed(seed)
    return torch.randn(m, k, generator=g, device="cuda").to(torch.bfloat16)


def _reference(x, packed, f_b):
    """float64 QKVG, F_B and beta."""
    out = x.double() @ packed.double().t()
    f_a = out[:, QKVG : QKVG + HEAD_DIM]
    return out[:, :QKVG], f_a @ f_b.double().t(), out[:, QKVG + HEAD_DIM : QKVG + HEAD_DIM + HEADS]


def _sequential(x, packed, f_b):
    """v0.28.0's order through our table: packed GEMM, then F_B on the strided F_A."""
    out = llg.try_low_latency_gemm(x, packed)
    out = torch.mm(x, packed.t()) if out is None else out
    f_a = out[:, QKVG : QKVG + HEAD_DIM]
    f_b_out = llg.try_low_latency_gemm(f_a, f_b)
    f_b_out = torch.mm(f_a, f_b.t()) if f_b_out is None else f_b_out
    return out[:, :QKVG], f_b_out, out[:, QKVG + HEAD_DIM : QKVG + HEAD_DIM + HEADS]


def _rel(out, ref) -> float:
    return float((out.double() - ref).norm() / ref.norm())


@pytest.fixture(scope="module")
def weights():
    return _weights(0)


@pytest.mark.parametrize("m", M_RANGE)
def test_overlap_under_graph_replay_matches_reference_and_sequential(weights, m):
    _check_overlap_under_graph_replay(weights, m, torch.cuda.Stream())


@pytest.mark.parametrize("m", [1, 2, 9, 16])
def test_overlap_on_the_high_priority_stream_matches_too(weights, m):
    aux = kp.high_priority_aux_stream(torch.device("cuda", torch.cuda.current_device()))
    assert aux.priority < torch.cuda.Stream().priority
    _check_overlap_under_graph_replay(weights, m, aux)


def _check_overlap_under_graph_replay(weights, m, aux):
    packed, f_b = weights
    events = (torch.cuda.Event(), torch.cuda.Event())
    x = _x(m, seed=m)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # compile outside the capture
        kp.run_kda_projection_overlap(x, packed, f_b, aux, events)
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        outs = kp.run_kda_projection_overlap(x, packed, f_b, aux, events)
    for replay in range(2):
        x.copy_(_x(m, seed=100 * m + replay))
        for t in outs:
            t.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        refs = _reference(x, packed, f_b)
        seq = _sequential(x, packed, f_b)
        for name, got, s, ref in zip(("qkvg", "f_b", "beta"), outs, seq, refs):
            assert torch.isfinite(got).all(), f"M={m} {name}: NaN/Inf or unwritten"
            err, seq_err = _rel(got, ref), _rel(s, ref)
            assert err <= REL_TOL, f"M={m} {name}: rel err {err:.2e}"
            assert err <= VS_SEQUENTIAL * seq_err + 1e-3, f"M={m} {name}: {err:.2e} vs {seq_err:.2e}"


@pytest.mark.parametrize("m", [1, 2, 8, 16])
def test_returned_views_have_the_strides_kda_expects(weights, m):
    packed, f_b = weights
    qkvg, f_b_out, beta = kp.run_kda_projection_overlap(_x(m, 1), packed, f_b, None, (None, None))
    assert qkvg.shape == (m, QKVG) and qkvg.stride() == (QKVG, 1)
    assert f_b_out.shape == (m, PROJ) and f_b_out.is_contiguous()
    assert beta.shape == (m, HEADS) and beta.stride(1) == 1
    # kda.py's split and rearranges, then fused_kda_decode's own stride checks.
    mixed_qkv, g_proj = qkvg.split([3 * PROJ, PROJ], dim=-1)
    assert mixed_qkv.stride(1) == 1  # x: contiguous channels
    raw_g = rearrange(f_b_out, "n (h d) -> 1 n h d", d=HEAD_DIM)
    assert raw_g.is_contiguous()  # raw_g must be contiguous
    assert beta.unsqueeze(0).stride(2) == 1  # raw_beta: contiguous heads
    gate = rearrange(g_proj, "... (h d) -> ... h d", d=HEAD_DIM)
    assert gate.stride(-1) == 1 and gate.stride(-2) == HEAD_DIM  # output_gate rows


def _routed_tokens(n: int, k: int) -> list[int]:
    return sorted(r.num_tokens for r in llg.routed_rows() if (r.n, r.k) == (n, k) and not r.has_residual)


def test_strided_f_a_takes_the_swap_ab_kernel(weights, monkeypatch):
    """F_A is a row-strided slice of the packed projection's output; swap-AB reads it as it
    is (no copy, no cuBLAS fallback) at every M the table routes."""
    packed, f_b = weights
    routed = _routed_tokens(PROJ, HEAD_DIM)
    if not routed:
        pytest.skip("the table routes no F_B row on this GPU")
    from vllm.models.kimi_k3.nvidia import swap_ab_gemm as sab

    launched = []
    real = sab.swap_ab_gemm
    monkeypatch.setattr(sab, "swap_ab_gemm",
                        lambda x, *a, **k: launched.append(x.stride(0)) or real(x, *a, **k))
    for m in routed:
        fab = _x(m, seed=7 * m, k=HEAD_DIM + HEADS + PAD)
        f_a = fab[:, :HEAD_DIM]
        out = llg.try_low_latency_gemm(f_a, f_b)
        assert out is not None, f"M={m}: strided F_A fell back"
        assert _rel(out, f_a.double() @ f_b.double().t()) <= REL_TOL
    assert launched == [HEAD_DIM + HEADS + PAD] * len(routed), "every call on swap-AB, x as strided"


# Views at element offsets: (x offset, weight offset); bf16, so offset 4 = 8 bytes, 8 = 16.
OFFSETS = [(xo, wo) for xo in (0, 1, 2, 4, 8) for wo in (0, 1, 8)]


# The KDA shapes, and those of the 75 views that raised on v0.28.0's kernel (reference/h200).
PROBE_SHAPES = {(6144, 7168), (144, 7168), (6288, 7168), (1536, 128), (7168, 14336), (1536, 7168), (768, 128)}


def _rows_to_probe():
    """For each routed shape of PROBE_SHAPES, its smallest and largest routed M."""
    by_shape: dict = {}
    for r in llg.routed_rows() if SKIP_REASON is None else ():
        if not r.has_residual and (r.n, r.k) in PROBE_SHAPES:
            by_shape.setdefault((r.n, r.k), []).append(r)
    picked = []
    for rows in by_shape.values():
        rows.sort(key=lambda r: r.num_tokens)
        picked += [rows[0]] if len(rows) == 1 else [rows[0], rows[-1]]
    return picked


def _view(shape, offset: int, seed: int):
    n, k = shape
    g = torch.Generator(device="cuda").manual_seed(seed)
    flat = (torch.randn(n * k + offset, generator=g, device="cuda") / k**0.5).to(torch.bfloat16)
    return flat[offset:].view(n, k)


@pytest.mark.parametrize("row", _rows_to_probe(), ids=lambda r: f"{r.n}x{r.k}-M{r.num_tokens}")
def test_misaligned_views_fall_back_never_raise(row):
    n, k, m = row.n, row.k, row.num_tokens
    method = llg.KimiK3LowLatencyLinearMethod({m: llg.PlannedCall(row.backend, row.config)})
    routed = 0
    for xo, wo in OFFSETS:
        x, w = _view((m, k), xo, seed=xo), _view((n, k), wo, seed=100 + wo)
        ref = x.double() @ w.double().t()
        out = llg.try_low_latency_gemm(x, w)  # must not raise
        if out is not None:
            routed += 1
            assert _rel(out, ref) <= REL_TOL, f"offsets {xo},{wo}"
        planned = method.apply(type("L", (), {"weight": w})(), x)  # falls back to F.linear
        assert _rel(planned, ref) <= REL_TOL, f"planned apply at offsets {xo},{wo}"
        aligned = xo * 2 % 16 == 0 and wo * 2 % 16 == 0
        if aligned:
            assert out is not None, f"16-byte aligned views at {xo},{wo} should route"
    assert routed >= 4  # at least the four 16-byte aligned pairs
