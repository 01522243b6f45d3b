# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-k3-overlay project
"""Our swap-AB decode GEMM with the small op before it fused into its prologue.

``y[M, N] = prologue(inputs)[M, K] @ W[N, K]^T (+ residual[M, N])`` for the decode
token counts M = 1..16: the same swap-AB split-K Triton kernel as
:mod:`swap_ab_gemm` (its :class:`SwapAbConfig`, grid and split-K workspace), except
that the activation tile each CTA loads is first transformed by one of:

===============  =======================================================================
prologue         the op it replaces (Kimi-K3 in vLLM v0.28.0)
===============  =======================================================================
``none``         nothing; ``x`` may be a row-strided view (e.g. the KDA ``f_a`` slice)
``norm``         ``RMSNorm(x) * g`` (input/post-attention/latent-MoE/q_a norms)
``add_norm``     ``h = x + r`` rounded to bf16, then ``RMSNorm(h) * g``; ``h`` (the new
                 residual) is written exactly once, by the CTAs of the first N tile
``act_mul``      ``SiluAndMul`` / ``SituAndMul`` of ``gate_up`` ``[M, 2K]``, read directly
``sigmoid_mul``  ``x * sigmoid(gate)`` (MLA's output gate before ``o_proj``)
``mtp_norm``     ``fused_mtp_input``: ``[enorm(embeds) (0 where position == 0) |
                 hnorm(hidden)]``, two ``[M, K/2]`` inputs, no concatenated copy
===============  =======================================================================

One epilogue besides the plain store (and its ``+ residual``): :func:`gemm_split_dtype`
writes the first ``n_fp32`` output columns of one stacked weight as fp32 into one tensor
and the rest in the weight's dtype into another (two stores with complementary column
masks; a tile across the boundary writes both), so that Kimi-K3's router gate (fp32
logits) streams in one launch with ``routed_expert_down_proj`` and the shared experts'
``gate_up``, which read the same input.

The norm needs each row's ``rstd = rsqrt(mean(x^2) + eps)`` over all of K, which a
split-K CTA never sees. But ``rstd`` is one scalar per row, so
``norm(x) @ W^T = rstd * ((x * g) @ W^T)``: each CTA multiplies by ``g`` as it loads
``x``, accumulates ``sum(x^2)`` of its K slice next to the MMA, and scales at the end.
Without split-K the CTA has the whole row; with split-K each split stores its
partial sum of squares next to its partial tile and the CTA that reduces the tile
sums them. So no CTA reads ``x`` more than the plain GEMM does. Rounding differs from
the unfused sequence in one place: the MMA sees ``bf16(x * g)`` where vLLM feeds it
``bf16(x * rstd * g)``; both are one bf16 rounding of the same product up to a per-row
scale (GPU tests: same relative error against float64).

What a prologue costs (one H200 run, 2026-12-02, ``results/decode_step/``
``prologue_sweep_2026-12-02.json``, M = 16, against our plain swap-AB kernel on the same
weight): every K step pays a serial ~1 µs for the activation tile's math and its trip
through shared memory to the MMA, so prologues want long K steps (``block_k`` 256).
There the norm prologues come within 1.1-2.1 µs of the plain GEMM (routed_up 7168x3584
15.5 µs vs 14.2; q_b 2304x1536 6.5 vs 5.0; 2112x7168 11.3 vs 10.2; add+norm 3584x7168
17.7 vs 15.7): about what the norm kernel they replace costs (1.4-2.2 µs with PDL).
The pointwise prologues stay 6-22 µs behind (SITU-and-mul 7168x768 11.8 vs 4.7,
sigmoid gate 7168x1536 13.9 vs 7.6, MTP input 7168x14336 72 vs 50): there the PDL-aware
kernels of :mod:`pointwise` plus the plain GEMM are faster, and the decode-step replay
(``k3lab/decode_step``) uses those.

PDL (SM90+): as in :mod:`swap_ab_gemm`, the CTA prefetches its first two weight tiles
into L2, lets the next kernel launch, and only then waits (``griddepcontrol.wait``)
before it reads anything a previous kernel wrote (``x``, ``gate_up``, the residual,
the workspace).

Errors: every entry point raises ``ValueError`` (one line, naming the operand) for
M outside 1..16, mismatched shapes, a config :func:`swap_ab_gemm.config_error`
refuses, or (``mtp_norm``) a split-K config, as the two halves need their own rstd.
"""

from __future__ import annotations

import torch

from vllm.models.kimi_k3.nvidia import swap_ab_gemm as sab
from vllm.triton_utils import HAS_TRITON, tl, triton

# Prologue codes (compile-time constants of the kernel; a jitted function reads only
# globals that are tl.constexpr). Without Triton, vLLM's placeholder has no constexpr:
# plain ints then, so that the module (and the backend registry that imports it)
# still imports, and the backends say they are unavailable.
_const = tl.constexpr if HAS_TRITON else int
NONE, NORM, ADD_NORM, ACT_MUL, SIGMOID_MUL, MTP_NORM = (_const(i) for i in range(6))
PROLOGUES = {"none": 0, "norm": 1, "add_norm": 2, "act_mul": 3, "sigmoid_mul": 4, "mtp_norm": 5}
SILU, SITU = _const(0), _const(1)


@triton.jit
def _sigmoid(z):
    return 1.0 / (1.0 + tl.exp(-z))


@triton.jit
def _tanh(z):
    # tanh through the sigmoid: the interpreter and every GPU backend have exp.
    return 2.0 * _sigmoid(2.0 * z) - 1.0


@triton.jit
def _load_in(x_ptr, a_ptr, offs_m, kk, xm, stride_x, stride_a, K, HALF, k, e_ok,
             PROLOGUE: tl.constexpr):  # fmt: skip
    """The raw activation tiles of one K step: (x, second operand or x again)."""
    if PROLOGUE == MTP_NORM:
        in_e = k < HALF
        e_ptrs = x_ptr + offs_m[:, None] * stride_x + kk[None, :]
        h_ptrs = a_ptr + offs_m[:, None] * stride_a + (kk - HALF)[None, :]
        x1 = tl.load(tl.where(in_e, e_ptrs, h_ptrs), mask=xm & (e_ok | (offs_m[:, None] * 0 + k >= HALF)),
                     other=0.0)  # fmt: skip
        x2 = x1
    else:
        x_ptrs = x_ptr + offs_m[:, None] * stride_x + kk[None, :]
        x1 = tl.load(x_ptrs, mask=xm, other=0.0)
        if PROLOGUE == ADD_NORM or PROLOGUE == SIGMOID_MUL:
            x2 = tl.load(a_ptr + offs_m[:, None] * stride_a + kk[None, :], mask=xm, other=0.0)
        elif PROLOGUE == ACT_MUL:
            x2 = tl.load(x_ptrs + K, mask=xm, other=0.0)
        else:
            x2 = x1
    return x1, x2


@triton.jit
def _store_split(y_ptr, y2_ptr, acc, offs_n, offs_m, M, N, n_hi, N_FP32):
    """``acc[n, m]`` to ``y[m, n]`` (fp32, ``[M, N_FP32]``) for rows n < N_FP32 and to
    ``y2[m, n - N_FP32]`` (``[M, N - N_FP32]``, y2's dtype) for the rest: complementary
    masks, so a tile across the boundary writes its rows to both."""
    ok = (offs_m[None, :] < M) & (offs_n[:, None] < n_hi)
    lo = offs_n[:, None] < N_FP32
    # Offsets clamped into each output even where masked off (no out-of-range address).
    n_lo = tl.minimum(offs_n, N_FP32 - 1)
    n_up = tl.maximum(offs_n - N_FP32, 0)
    tl.store(y_ptr + offs_m[None, :] * N_FP32 + n_lo[:, None], acc, mask=ok & lo)
    tl.store(y2_ptr + offs_m[None, :] * (N - N_FP32) + n_up[:, None],
             acc.to(y2_ptr.dtype.element_ty), mask=ok & (offs_n[:, None] >= N_FP32))  # fmt: skip


@triton.jit
def _epilogue(y_ptr, y2_ptr, r_ptr, acc, offs_n, offs_m, M, N, n_hi, N_FP32,
              HAS_RESIDUAL: tl.constexpr, SPLIT_OUT: tl.constexpr):  # fmt: skip
    if SPLIT_OUT:
        _store_split(y_ptr, y2_ptr, acc, offs_n, offs_m, M, N, n_hi, N_FP32)
    else:
        sab._store_tile(y_ptr, r_ptr, acc, offs_n, offs_m, M, N, n_hi, HAS_RESIDUAL)


@triton.jit(do_not_specialize=["M", "tiles_per_split", "split_k", "ROWS", "N_FP32"])
def _fused_kernel(
    x_ptr, a_ptr, g_ptr, g2_ptr, h_ptr, pos_ptr,
    w_ptr, y_ptr, y2_ptr, r_ptr, part_ptr, cnt_ptr,
    M, N, K, stride_x, stride_a, HALF,
    tiles_per_split, split_k, ROWS, ss_off, N_FP32,
    eps, beta, lin_beta,
    BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_M: tl.constexpr,
    EVEN_K: tl.constexpr, HAS_RESIDUAL: tl.constexpr, USE_PDL: tl.constexpr,
    RAGGED: tl.constexpr, PROLOGUE: tl.constexpr, ACT: tl.constexpr, LIN_CLIP: tl.constexpr,
    SPLIT_OUT: tl.constexpr,
):  # fmt: skip
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    offs_n = pid_n * ROWS + tl.arange(0, BLOCK_N)
    n_hi = tl.minimum(pid_n * ROWS + ROWS, N)
    rows = tl.minimum(offs_n, n_hi - 1)
    w_live = (offs_n < n_hi)[:, None] if RAGGED else None
    offs_m = tl.arange(0, BLOCK_M)
    offs_k = tl.arange(0, BLOCK_K)
    k_lo = pid_k * tiles_per_split * BLOCK_K
    k_hi = tl.minimum(k_lo + tiles_per_split * BLOCK_K, K)
    w_ptrs = w_ptr + rows[:, None].to(tl.int64) * K + (k_lo + offs_k)[None, :]
    m_ok = offs_m[:, None] < M

    if USE_PDL:
        # Weights are no kernel's output: start their stream before waiting.
        lines = tl.arange(0, 2 * BLOCK_K // 64)
        cols = tl.minimum(k_lo + lines * 64, K - 1)
        pf = w_ptr + rows[:, None].to(tl.int64) * K + cols[None, :]
        tl.inline_asm_elementwise("prefetch.global.L2 [$1]; // $0", "=r,l", [pf],
                                  dtype=tl.int32, is_pure=False, pack=1)  # fmt: skip
        tl.extra.cuda.gdc_launch_dependents()
        tl.extra.cuda.gdc_wait()

    e_ok = m_ok
    if PROLOGUE == MTP_NORM:
        pos = tl.load(pos_ptr + offs_m, mask=offs_m < M, other=0)
        e_ok = (pos != 0)[:, None]
    acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
    acc2 = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
    # Sums of squares per element, reduced once after the loop (no per-step shuffle).
    sq = tl.zeros((BLOCK_M, BLOCK_K), dtype=tl.float32)
    sq2 = tl.zeros((BLOCK_M, BLOCK_K), dtype=tl.float32)
    for k in range(k_lo, k_hi, BLOCK_K):
        kk = k + offs_k
        k_ok = kk < K
        xm = m_ok & k_ok[None, :]
        if EVEN_K:
            if RAGGED:
                w = tl.load(w_ptrs, mask=w_live, other=0.0)
            else:
                w = tl.load(w_ptrs)
        else:
            w_ok = k_ok[None, :] & w_live if RAGGED else k_ok[None, :]
            w = tl.load(w_ptrs, mask=w_ok, other=0.0)
        x1, x2 = _load_in(x_ptr, a_ptr, offs_m, kk, xm, stride_x, stride_a, K, HALF, k, e_ok, PROLOGUE)
        if PROLOGUE == NONE:
            xv = x1
        elif PROLOGUE == NORM:
            xf = x1.to(tl.float32)
            sq += xf * xf
            g = tl.load(g_ptr + kk, mask=k_ok, other=0.0).to(tl.float32)
            xv = (xf * g[None, :]).to(w.dtype)
        elif PROLOGUE == ADD_NORM:
            hb = (x1.to(tl.float32) + x2.to(tl.float32)).to(h_ptr.dtype.element_ty)
            # The new residual, once: only the first N tile's CTAs write their K slice.
            # (a tensor compare: the interpreter refuses a scalar in a mask)
            first = (offs_m[:, None] * 0 + pid_n) == 0
            tl.store(h_ptr + offs_m[:, None] * K + kk[None, :], hb, mask=xm & first)
            hf = hb.to(tl.float32)
            sq += hf * hf
            g = tl.load(g_ptr + kk, mask=k_ok, other=0.0).to(tl.float32)
            xv = (hf * g[None, :]).to(w.dtype)
        elif PROLOGUE == ACT_MUL:
            gf = x1.to(tl.float32)
            uf = x2.to(tl.float32)
            if ACT == SILU:
                af = gf * _sigmoid(gf)
            else:
                af = beta * _tanh(gf / beta) * _sigmoid(gf)
            if LIN_CLIP:
                uf = lin_beta * _tanh(uf / lin_beta)
            xv = (af * uf).to(w.dtype)
        elif PROLOGUE == SIGMOID_MUL:
            xv = (x1.to(tl.float32) * _sigmoid(x2.to(tl.float32))).to(w.dtype)
        else:  # MTP_NORM: K = 2 * HALF; a K tile lies in one half (HALF % BLOCK_K == 0)
            in_e = k < HALF
            xf = x1.to(tl.float32)
            sq += tl.where(in_e, xf * xf, 0.0)
            sq2 += tl.where(in_e, 0.0, xf * xf)
            g = tl.load(tl.where(in_e, g_ptr + kk, g2_ptr + (kk - HALF)), mask=k_ok, other=0.0)
            xv = (xf * g.to(tl.float32)[None, :]).to(w.dtype)
            zero = tl.zeros_like(xv)
            acc2 = tl.dot(w, tl.trans(tl.where(in_e, zero, xv)), acc2)
            xv = tl.where(in_e, xv, zero)
        acc = tl.dot(w, tl.trans(xv), acc)
        w_ptrs += BLOCK_K

    ss = tl.sum(sq, axis=1)
    ss2 = tl.sum(sq2, axis=1)
    if split_k == 1:
        if PROLOGUE == NORM or PROLOGUE == ADD_NORM:
            acc = acc * tl.rsqrt(ss / K + eps)[None, :]
        if PROLOGUE == MTP_NORM:
            acc = acc * tl.rsqrt(ss / HALF + eps)[None, :] + acc2 * tl.rsqrt(ss2 / HALF + eps)[None, :]
        _epilogue(y_ptr, y2_ptr, r_ptr, acc, offs_n, offs_m, M, N, n_hi, N_FP32, HAS_RESIDUAL, SPLIT_OUT)
    else:
        tile = tl.arange(0, BLOCK_N)[:, None] * BLOCK_M + offs_m[None, :]
        tile_base = part_ptr + pid_n * split_k * (BLOCK_N * BLOCK_M)
        tl.store(tile_base + pid_k * (BLOCK_N * BLOCK_M) + tile, acc)
        ss_base = part_ptr + ss_off + pid_n * split_k * BLOCK_M
        if PROLOGUE == NORM or PROLOGUE == ADD_NORM:
            tl.store(ss_base + pid_k * BLOCK_M + offs_m, ss)
        tl.debug_barrier()
        arrived = tl.atomic_add(cnt_ptr + pid_n, 1, sem="acq_rel", scope="gpu")
        if arrived == split_k - 1:
            total = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
            ss_all = tl.zeros((BLOCK_M,), dtype=tl.float32)
            for s in range(0, split_k):
                total += tl.load(tile_base + s * (BLOCK_N * BLOCK_M) + tile, cache_modifier=".cg")
                if PROLOGUE == NORM or PROLOGUE == ADD_NORM:
                    ss_all += tl.load(ss_base + s * BLOCK_M + offs_m, cache_modifier=".cg")
            tl.atomic_xchg(cnt_ptr + pid_n, 0, sem="relaxed", scope="gpu")
            if PROLOGUE == NORM or PROLOGUE == ADD_NORM:
                total = total * tl.rsqrt(ss_all / K + eps)[None, :]
            _epilogue(y_ptr, y2_ptr, r_ptr, total, offs_n, offs_m, M, N, n_hi, N_FP32, HAS_RESIDUAL,
                      SPLIT_OUT)  # fmt: skip


def _rows_ok(name: str, t: torch.Tensor, m: int, cols: int) -> None:
    """``t`` must be ``[m, >= cols]`` with unit column stride (a row-strided view is fine)."""
    if t.dim() != 2 or t.shape[0] != m or t.shape[1] < cols or t.stride(1) != 1:
        raise ValueError(f"{name}: expected [{m}, {cols}] with unit column stride, "
                         f"got {tuple(t.shape)} strides {t.stride()}")  # fmt: skip


def _run(
    prologue: str,
    x: torch.Tensor,
    weight: torch.Tensor,
    config: sab.SwapAbConfig,
    *,
    a: torch.Tensor | None = None,
    g: torch.Tensor | None = None,
    g2: torch.Tensor | None = None,
    h_out: torch.Tensor | None = None,
    positions: torch.Tensor | None = None,
    residual: torch.Tensor | None = None,
    eps: float = 1e-6,
    act: int = 0,
    beta: float = 1.0,
    linear_beta: float | None = None,
    out_dtype: torch.dtype | None = None,
    n_fp32: int | None = None,
    pdl: bool | None = None,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    code = PROLOGUES[prologue]
    block_m = sab.MAX_TOKENS
    m = x.shape[0]
    n, k = weight.shape
    if not 1 <= m <= sab.MAX_TOKENS:
        raise ValueError(f"M={m} outside 1..{sab.MAX_TOKENS}")
    if not weight.is_contiguous():
        raise ValueError(f"weight {tuple(weight.shape)} is not packed row-major")
    why = sab.config_error(config, n, k)
    if why:
        raise ValueError(f"swap-AB config {tuple(config)} for {n}x{k}: {why}")
    half = k // 2
    if code == PROLOGUES["mtp_norm"]:
        if k % 2 or half % config.block_k or config.split_k != 1:
            raise ValueError(f"mtp_norm needs K/2 a multiple of block_k and split_k=1, got K={k}, "
                             f"{tuple(config)}")  # fmt: skip
        _rows_ok("embeds", x, m, half)
        _rows_ok("hidden", a, m, half)
    else:
        _rows_ok("x", x, m, 2 * k if prologue == "act_mul" else k)
    if prologue in ("add_norm", "sigmoid_mul"):
        _rows_ok("residual in" if prologue == "add_norm" else "gate", a, m, k)
    if prologue == "add_norm" and (h_out is None or h_out.shape != (m, k) or not h_out.is_contiguous()):
        raise ValueError(f"add_norm needs a packed [{m}, {k}] residual output")
    if residual is not None and (residual.shape != (m, n) or not residual.is_contiguous()):
        raise ValueError(f"residual: expected packed [{m}, {n}], got {tuple(residual.shape)}")
    split = n_fp32 is not None
    if split:
        if not 0 < n_fp32 < n:
            raise ValueError(f"n_fp32={n_fp32} outside 1..{n - 1} (weight {n}x{k})")
        if residual is not None:
            raise ValueError("a split-dtype output takes no residual")
        y = torch.empty((m, n_fp32), dtype=torch.float32, device=x.device)
        y2 = torch.empty((m, n - n_fp32), dtype=out_dtype or weight.dtype, device=x.device)
    else:
        y = y2 = torch.empty((m, n), dtype=out_dtype or weight.dtype, device=x.device)

    n_tiles, splits, per_split = sab.grid_of(config, n, k)
    tile_floats = n_tiles * splits * config.block_n * block_m if splits > 1 else 0
    floats = tile_floats + n_tiles * splits * block_m
    if x.device.type == "cuda":
        partials, counters = sab._workspace(x.device, floats, n_tiles)
    else:  # Triton's interpreter on the CPU
        partials, counters = torch.empty(max(floats, 1)), torch.zeros(n_tiles, dtype=torch.int32)
    if pdl is None:
        pdl = x.device.type == "cuda" and sab._use_pdl(x.device.index or 0)
    a = x if a is None else a
    args = (x, a, x if g is None else g, x if g2 is None else g2,
            x if h_out is None else h_out, x if positions is None else positions,
            weight, y, y2, x if residual is None else residual, partials, counters,
            m, n, k, sab.row_stride(x), sab.row_stride(a), half,
            per_split, splits, sab.rows_of(config), tile_floats, n_fp32 or 0,
            eps, beta, 1.0 if linear_beta is None else linear_beta)  # fmt: skip
    kwargs = dict(
        BLOCK_N=config.block_n, BLOCK_K=config.block_k, BLOCK_M=block_m,
        EVEN_K=k % config.block_k == 0, HAS_RESIDUAL=residual is not None, USE_PDL=pdl,
        RAGGED=sab.rows_of(config) < config.block_n, PROLOGUE=code, ACT=act,
        LIN_CLIP=linear_beta is not None, SPLIT_OUT=split,
        num_warps=config.num_warps, num_stages=config.num_stages,
    )  # fmt: skip
    if pdl:
        kwargs["launch_pdl"] = True
    _fused_kernel[(n_tiles, splits)](*args, **kwargs)
    return (y, y2) if split else y


def gemm(x, weight, config, *, residual=None, out_dtype=None, pdl=None) -> torch.Tensor:
    """``x @ weight.T (+ residual)``; ``x`` ``[M, K]`` may be row-strided; ``out_dtype``
    (e.g. float32 for router logits) defaults to the weight's."""
    return _run("none", x, weight, config, residual=residual, out_dtype=out_dtype, pdl=pdl)


def rmsnorm_gemm(x, norm_weight, eps, weight, config, *, residual=None, out_dtype=None,
                 pdl=None) -> torch.Tensor:  # fmt: skip
    """``RMSNorm(x; norm_weight, eps) @ weight.T (+ residual)``; ``x`` ``[M, K]`` bf16,
    may be row-strided (MLA's ``q_c`` slice); ``norm_weight`` ``[K]``."""
    return _run("norm", x, weight, config, g=norm_weight, eps=eps, residual=residual,
                out_dtype=out_dtype, pdl=pdl)  # fmt: skip


def add_rmsnorm_gemm(x, residual_in, residual_out, norm_weight, eps, weight, config, *,
                     residual=None, out_dtype=None, pdl=None) -> torch.Tensor:  # fmt: skip
    """``h = bf16(x + residual_in)`` written to ``residual_out`` (packed ``[M, K]``, not
    ``residual_in``: other CTAs still read that); returns ``RMSNorm(h) @ weight.T``."""
    return _run("add_norm", x, weight, config, a=residual_in, h_out=residual_out,
                g=norm_weight, eps=eps, residual=residual, out_dtype=out_dtype, pdl=pdl)  # fmt: skip


def act_mul_gemm(gate_up, weight, config, *, situ_beta=None, situ_linear_beta=None,
                 residual=None, pdl=None) -> torch.Tensor:  # fmt: skip
    """``act(gate_up[:, :K]) * up @ weight.T (+ residual)`` for ``weight`` ``[N, K]``:
    SiLU, or with ``situ_beta`` vLLM's SITU ``beta*tanh(g/beta)*sigmoid(g)`` (and the
    soft clip ``linear_beta*tanh(u/linear_beta)`` of ``up`` when ``situ_linear_beta``)."""
    act = 0 if situ_beta is None else 1  # SILU / SITU
    return _run("act_mul", gate_up, weight, config, act=act, beta=situ_beta or 1.0,
                linear_beta=situ_linear_beta, residual=residual, pdl=pdl)  # fmt: skip


def sigmoid_mul_gemm(x, gate, weight, config, *, residual=None, pdl=None) -> torch.Tensor:
    """``(x * sigmoid(gate)) @ weight.T (+ residual)``; ``x``, ``gate`` ``[M, K]``."""
    return _run("sigmoid_mul", x, weight, config, a=gate, residual=residual, pdl=pdl)


def mtp_input_gemm(positions, embeds, hidden, enorm_weight, hnorm_weight, eps, weight, config, *,
                   pdl=None) -> torch.Tensor:  # fmt: skip
    """``[enorm(embeds) | hnorm(hidden)] @ weight.T`` (``eh_proj``), with ``embeds`` rows
    zeroed where ``positions == 0``, as v0.28.0's ``fused_mtp_input``; ``weight``
    ``[N, 2H]``, ``embeds``/``hidden`` ``[M, H]``, ``positions`` int ``[M]``."""
    return _run("mtp_norm", embeds, weight, config, a=hidden, g=enorm_weight, g2=hnorm_weight,
                positions=positions, eps=eps, pdl=pdl)  # fmt: skip


def gemm_split_dtype(x, weight, n_fp32, config, *, pdl=None) -> tuple[torch.Tensor, torch.Tensor]:
    """``x @ weight.T`` of one stacked weight, its first ``n_fp32`` output columns in fp32
    and the rest in the weight's dtype: ``(out_fp32 [M, n_fp32], out [M, N - n_fp32])``,
    both new packed tensors.

    For projections of one input whose outputs want different dtypes, e.g. Kimi-K3's MoE
    router gate (fp32 logits, 384 rows) stacked on ``routed_expert_down_proj`` and the
    shared experts' ``gate_up`` (bf16): one weight stream and one launch instead of two.
    The accumulation is fp32 as in :func:`gemm`; the fp32 columns are never rounded to
    bf16 (with split-K, the partials are summed in fp32 before either store), so they are
    what ``gemm(x, weight[:n_fp32], config, out_dtype=torch.float32)`` gives, up to the
    order of the K sum where the two configs split K differently.

    Args:
        x: ``[M, K]``, 1 <= M <= 16, unit column stride (may be row-strided), the
            weight's dtype.
        weight: ``[N, K]`` packed row-major (bf16; fp16 on the CPU interpreter).
        n_fp32: the fp32 columns, 1 <= n_fp32 < N; any value (it need not be a multiple
            of the tile: a CTA whose rows straddle it writes to both outputs).
        config: a :class:`swap_ab_gemm.SwapAbConfig` for ``N x K``.
        pdl: launch with PDL; by default on SM90 and newer.

    Raises:
        ValueError: M outside 1..16, ``x`` not ``[M, K]`` with unit column stride,
            ``n_fp32`` outside 1..N-1, a config :func:`swap_ab_gemm.config_error` refuses.
    """
    return _run("none", x, weight, config, n_fp32=n_fp32, pdl=pdl)
