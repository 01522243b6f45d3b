# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-k3-overlay project
"""PDL-aware pointwise ops of the Kimi-K3 decode step (Triton): act-and-mul, sigmoid gate, MTP input,
embedding rows.

Where folding a small op into the next GEMM's prologue costs more than the op itself
(one H200 run, ``results/decode_step/prologue_sweep_2026-12-02.json``: the SiLU/SITU-
and-mul, sigmoid-gate and MTP-input prologues of ``fused_gemm.py`` added 6-22 µs to
their GEMM, as each K step pays a serial ~1 µs for the elementwise math on the
activation tile), the op runs as its own kernel, but one that knows PDL: it lets the
next kernel launch first (``griddepcontrol.launch_dependents``), loads what no kernel
writes (the norm weights), and waits (``griddepcontrol.wait``) only before it reads
its input. The next GEMM of ours meanwhile prefetches its weights.

* :func:`act_mul`: ``act(gate_up[:, :D]) * gate_up[:, D:]``, SiLU or vLLM's SITU
  ``beta*tanh(g/beta)*sigmoid(g)`` (optionally soft-clipping ``up`` by ``linear_beta``);
* :func:`sigmoid_mul`: ``x * sigmoid(gate)`` (MLA's output gate);
* :func:`mtp_input`: ``[enorm(embeds) | hnorm(hidden)]`` with ``embeds`` rows zeroed
  where ``positions == 0``, as v0.28.0's ``fused_mtp_input``;
* :func:`embed_rows`: one rank's part of a vocab-parallel embedding lookup in one launch
  (the rows of the ids in its shard, zeros for the others), where v0.28.0 runs three
  kernels (a compiled shard mask, the gather, ``masked_fill_``) before the all-reduce.

bf16 in and out, fp32 math, one rounding. ``ValueError`` for mismatched shapes.
"""

from __future__ import annotations

import functools

import torch

from vllm.triton_utils import tl, triton

_BLOCK = 1024


@triton.jit
def _sig(z):
    return 1.0 / (1.0 + tl.exp(-z))


@triton.jit(do_not_specialize=["stride_x"])
def _act_mul_kernel(x_ptr, y_ptr, D, stride_x, beta, lin_beta, BLOCK: tl.constexpr, SITU: tl.constexpr,
                    LIN_CLIP: tl.constexpr, USE_PDL: tl.constexpr):  # fmt: skip
    row = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    ok = offs < D
    if USE_PDL:
        tl.extra.cuda.gdc_launch_dependents()
        tl.extra.cuda.gdc_wait()
    g = tl.load(x_ptr + row * stride_x + offs, mask=ok, other=0.0).to(tl.float32)
    u = tl.load(x_ptr + row * stride_x + D + offs, mask=ok, other=0.0).to(tl.float32)
    if SITU:
        a = beta * (2.0 * _sig(2.0 * g / beta) - 1.0) * _sig(g)
    else:
        a = g * _sig(g)
    if LIN_CLIP:
        u = lin_beta * (2.0 * _sig(2.0 * u / lin_beta) - 1.0)
    tl.store(y_ptr + row * D + offs, (a * u).to(y_ptr.dtype.element_ty), mask=ok)


@triton.jit(do_not_specialize=["stride_x", "stride_g"])
def _sigmoid_mul_kernel(x_ptr, g_ptr, y_ptr, D, stride_x, stride_g, BLOCK: tl.constexpr,
                        USE_PDL: tl.constexpr):  # fmt: skip
    row = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    ok = offs < D
    if USE_PDL:
        tl.extra.cuda.gdc_launch_dependents()
        tl.extra.cuda.gdc_wait()
    x = tl.load(x_ptr + row * stride_x + offs, mask=ok, other=0.0).to(tl.float32)
    g = tl.load(g_ptr + row * stride_g + offs, mask=ok, other=0.0).to(tl.float32)
    tl.store(y_ptr + row * D + offs, (x * _sig(g)).to(y_ptr.dtype.element_ty), mask=ok)


@triton.jit(do_not_specialize=["stride_e", "stride_h"])
def _mtp_input_kernel(pos_ptr, e_ptr, h_ptr, ge_ptr, gh_ptr, y_ptr, H, stride_e, stride_h, eps,
                      BLOCK: tl.constexpr, USE_PDL: tl.constexpr):  # fmt: skip
    row = tl.program_id(0).to(tl.int64)
    half = tl.program_id(1)
    offs = tl.arange(0, BLOCK)
    ok = offs < H
    if USE_PDL:
        tl.extra.cuda.gdc_launch_dependents()
    if half == 0:
        w = tl.load(ge_ptr + offs, mask=ok, other=0.0).to(tl.float32)
    else:
        w = tl.load(gh_ptr + offs, mask=ok, other=0.0).to(tl.float32)
    if USE_PDL:
        tl.extra.cuda.gdc_wait()
    if half == 0:
        live = tl.load(pos_ptr + row + offs * 0) != 0  # a tensor: the interpreter refuses scalar masks
        x = tl.load(e_ptr + row * stride_e + offs, mask=ok & live, other=0.0).to(tl.float32)
    else:
        x = tl.load(h_ptr + row * stride_h + offs, mask=ok, other=0.0).to(tl.float32)
    rstd = tl.rsqrt(tl.sum(x * x, axis=0) / H + eps)
    tl.store(y_ptr + row * 2 * H + half * H + offs, (x * rstd * w).to(y_ptr.dtype.element_ty), mask=ok)


@triton.jit(do_not_specialize=["start", "end", "stride_w"])
def _embed_rows_kernel(ids_ptr, w_ptr, y_ptr, H, start, end, stride_w, BLOCK: tl.constexpr,
                       USE_PDL: tl.constexpr):  # fmt: skip
    row = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    ok = offs < H
    if USE_PDL:  # the ids are the previous kernel's output: nothing to load before the wait
        tl.extra.cuda.gdc_launch_dependents()
        tl.extra.cuda.gdc_wait()
    tok = tl.load(ids_ptr + row + offs * 0).to(tl.int64)  # a tensor: the interpreter refuses scalar masks
    inside = (tok >= start) & (tok < end)
    local = tl.where(inside, tok - start, 0)
    x = tl.load(w_ptr + local * stride_w + offs, mask=ok & inside, other=0.0)
    tl.store(y_ptr + row * H + offs, x, mask=ok)


@functools.cache
def _pdl_default(device_index: int) -> bool:
    return torch.cuda.get_device_capability(device_index)[0] >= 9


def _kw(x: torch.Tensor, pdl: bool | None, **constexprs) -> dict:
    if pdl is None:
        pdl = x.device.type == "cuda" and _pdl_default(x.device.index or 0)
    kw = dict(USE_PDL=pdl, num_warps=4, **constexprs)
    if pdl:
        kw["launch_pdl"] = True
    return kw


def _rows(name: str, t: torch.Tensor, m: int, cols: int) -> None:
    if t.dim() != 2 or t.shape != (m, cols) or t.stride(1) != 1:
        raise ValueError(f"{name}: expected [{m}, {cols}] with unit column stride, got {tuple(t.shape)}")


def act_mul(gate_up: torch.Tensor, *, situ_beta: float | None = None, situ_linear_beta: float | None = None,
            pdl: bool | None = None) -> torch.Tensor:  # fmt: skip
    """``[M, 2D]`` (row-strided allowed) -> packed ``[M, D]``; SiLU unless ``situ_beta``."""
    m, d = gate_up.shape[0], gate_up.shape[1] // 2
    _rows("gate_up", gate_up, m, 2 * d)
    y = torch.empty((m, d), dtype=gate_up.dtype, device=gate_up.device)
    kw = _kw(gate_up, pdl, BLOCK=_BLOCK, SITU=situ_beta is not None, LIN_CLIP=situ_linear_beta is not None)
    _act_mul_kernel[(m, triton.cdiv(d, _BLOCK))](gate_up, y, d, gate_up.stride(0), situ_beta or 1.0,
                                                 situ_linear_beta or 1.0, **kw)  # fmt: skip
    return y


def sigmoid_mul(x: torch.Tensor, gate: torch.Tensor, *, pdl: bool | None = None) -> torch.Tensor:
    """``x * sigmoid(gate)``, both ``[M, D]`` (row-strided allowed) -> packed ``[M, D]``."""
    m, d = x.shape
    _rows("x", x, m, d)
    _rows("gate", gate, m, d)
    y = torch.empty((m, d), dtype=x.dtype, device=x.device)
    _sigmoid_mul_kernel[(m, triton.cdiv(d, _BLOCK))](x, gate, y, d, x.stride(0), gate.stride(0),
                                                     **_kw(x, pdl, BLOCK=_BLOCK))  # fmt: skip
    return y


def mtp_input(positions: torch.Tensor, embeds: torch.Tensor, hidden: torch.Tensor,
              enorm_weight: torch.Tensor, hnorm_weight: torch.Tensor, eps: float, *,
              pdl: bool | None = None) -> torch.Tensor:  # fmt: skip
    """``[enorm(embeds) | hnorm(hidden)]`` ``[M, 2H]``; ``embeds`` rows where ``positions == 0`` are 0."""
    m, h = embeds.shape
    _rows("embeds", embeds, m, h)
    _rows("hidden", hidden, m, h)
    if positions.shape != (m,) or enorm_weight.shape != (h,) or hnorm_weight.shape != (h,):
        raise ValueError(f"positions {tuple(positions.shape)} / norm weights must be [{m}] / [{h}]")
    y = torch.empty((m, 2 * h), dtype=embeds.dtype, device=embeds.device)
    kw = _kw(embeds, pdl, BLOCK=triton.next_power_of_2(h))
    _mtp_input_kernel[(m, 2)](positions, embeds, hidden, enorm_weight, hnorm_weight, y, h,
                              embeds.stride(0), hidden.stride(0), eps, **kw)  # fmt: skip
    return y


def embed_rows(ids: torch.Tensor, weight: torch.Tensor, start: int, end: int, *,
               pdl: bool | None = None) -> torch.Tensor:  # fmt: skip
    """A new packed ``[M, H]``: ``weight[ids[i] - start]`` where ``start <= ids[i] < end``, else 0.

    ``ids``: contiguous ``(M,)`` int32/int64 token ids over the whole vocabulary;
    ``weight``: ``(rows, H)`` with unit column stride, this rank's shard (``end - start <=
    rows``). What v0.28.0's ``VocabParallelEmbedding.forward`` computes before its
    all-reduce when the shard has no added vocabulary. ``ValueError`` for other shapes."""
    if ids.dim() != 1 or ids.stride(0) != 1 or weight.dim() != 2 or weight.stride(1) != 1:
        raise ValueError(f"ids {tuple(ids.shape)} must be contiguous (M,), "
                         f"weight {tuple(weight.shape)} (rows, H)")  # fmt: skip
    if not 0 <= end - start <= weight.shape[0]:
        raise ValueError(f"shard [{start}, {end}) does not fit the weight's {weight.shape[0]} rows")
    m, h = ids.shape[0], weight.shape[1]
    y = torch.empty((m, h), dtype=weight.dtype, device=weight.device)
    if m == 0:
        return y
    _embed_rows_kernel[(m, triton.cdiv(h, _BLOCK))](ids, weight, y, h, start, end, weight.stride(0),
                                                    **_kw(weight, pdl, BLOCK=_BLOCK))  # fmt: skip
    return y
