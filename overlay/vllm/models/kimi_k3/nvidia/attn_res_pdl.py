# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-k3-overlay project
"""Kimi-K3's attention-residual mix at decode, spread over many CTAs, with PDL (Triton).

The op (vLLM v0.28.0 ``ops/attn_res.py``'s ``attn_res``, same arguments and result):
per token row, ``p = bf16(prefix + delta)`` is written back to ``prefix`` (and to
``blocks[:, block_write_idx]`` when that is >= 0); the ``num_blocks`` earlier blocks and
``p`` are the sources; each source ``v`` scores ``sum(v * norm_w * qk_w) * rsqrt(mean(v^2)
+ eps)``; the softmax of the scores mixes the sources; the mix is RMS-normalized by
``output_norm_weight`` (if given). Shapes: ``prefix``/``delta`` ``[M, H]``, ``blocks``
``[M, R, H]``, weights ``[H]``; bf16; returns a new ``[M, H]``.

Why ours: v0.28.0's kernel gives each token row one CTA that walks the sources in
dependent tiles; at decode (M <= 16) that is at most 16 CTAs, latency-bound (8.1-8.6 µs
on the H200 for 9 sources of 7168, against 0.7 µs of bytes: ``results/decode_step``).
Here two launches: (1) one CTA per (row, source) scores its source (the prefix CTA first
adds ``delta`` and writes the prefix back); (2) one CTA per (row, 1024-column chunk)
mixes its chunk and stores its share of ``sum(mix^2)``; the last CTA of a row to arrive
(a per-row counter, reset by it, so the workspace needs no clearing) normalizes the
row. Both trigger the next kernel first and wait (``griddepcontrol.wait``) only before
reading what earlier kernels wrote; the norm weights load before the wait.

Concurrency: the workspace is private to a (device, stream) pair, as in
``swap_ab_gemm``. ``ValueError`` for mismatched shapes or a ``block_write_idx`` that is
one of the sources being read.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import torch

from vllm.triton_utils import tl, triton

CHUNK = 1024  # columns per mixing CTA


@triton.jit(do_not_specialize=["stride_p", "stride_d", "stride_bm", "stride_br", "NB", "write_idx"])
def _score_kernel(prefix_ptr, delta_ptr, blocks_ptr, nw_ptr, qw_ptr, logit_ptr, H, stride_p, stride_d,
                  stride_bm, stride_br, NB, write_idx, eps, BLOCK: tl.constexpr, HAS_DELTA: tl.constexpr,
                  WRITE_BLOCK: tl.constexpr, USE_PDL: tl.constexpr):  # fmt: skip
    row = tl.program_id(0).to(tl.int64)
    src = tl.program_id(1)
    offs = tl.arange(0, BLOCK)
    ok = offs < H
    if USE_PDL:
        tl.extra.cuda.gdc_launch_dependents()
    wq = tl.load(nw_ptr + offs, mask=ok, other=0.0).to(tl.float32) * tl.load(
        qw_ptr + offs, mask=ok, other=0.0).to(tl.float32)  # fmt: skip
    if USE_PDL:
        tl.extra.cuda.gdc_wait()
    if src == NB:  # the prefix source
        v = tl.load(prefix_ptr + row * stride_p + offs, mask=ok, other=0.0).to(tl.float32)
        if HAS_DELTA:
            d = tl.load(delta_ptr + row * stride_d + offs, mask=ok, other=0.0).to(tl.float32)
            pb = (v + d).to(prefix_ptr.dtype.element_ty)
            tl.store(prefix_ptr + row * stride_p + offs, pb, mask=ok)
            v = pb.to(tl.float32)
        if WRITE_BLOCK:
            tl.store(blocks_ptr + row * stride_bm + write_idx * stride_br + offs,
                     v.to(blocks_ptr.dtype.element_ty), mask=ok)  # fmt: skip
    else:
        v = tl.load(blocks_ptr + row * stride_bm + src * stride_br + offs, mask=ok, other=0.0).to(tl.float32)
    rstd = tl.rsqrt(tl.sum(v * v, axis=0) / H + eps)
    logit = tl.sum(v * wq, axis=0) * rstd
    # one lane stores the score (a tensor store: the interpreter refuses scalar masks)
    tl.store(logit_ptr + row * (NB + 1) + src + offs * 0, logit + offs * 0.0, mask=offs == 0)


@triton.jit(do_not_specialize=["stride_p", "stride_bm", "stride_br", "NB", "C"])
def _mix_kernel(prefix_ptr, blocks_ptr, logit_ptr, ow_ptr, out_ptr, mix_ptr, ss_ptr, cnt_ptr, H, stride_p,
                stride_bm, stride_br, NB, C, out_eps, CHUNK_: tl.constexpr, NSRC: tl.constexpr,
                NCHUNK: tl.constexpr, BLOCK_H: tl.constexpr, HAS_NORM: tl.constexpr,
                USE_PDL: tl.constexpr):  # fmt: skip
    row = tl.program_id(0).to(tl.int64)
    c = tl.program_id(1)
    offs = c * CHUNK_ + tl.arange(0, CHUNK_)
    ok = offs < H
    if USE_PDL:
        tl.extra.cuda.gdc_launch_dependents()
        tl.extra.cuda.gdc_wait()
    src = tl.arange(0, NSRC)
    s_ok = src <= NB
    lg = tl.load(logit_ptr + row * (NB + 1) + src, mask=s_ok, other=-float("inf"))
    e = tl.exp(lg - tl.max(lg, axis=0))
    wts = e / tl.sum(e, axis=0)
    b_ptrs = blocks_ptr + row * stride_bm + src[:, None] * stride_br + offs[None, :]
    p_ptrs = prefix_ptr + row * stride_p + src[:, None] * 0 + offs[None, :]
    vals = tl.load(tl.where(src[:, None] == NB, p_ptrs, b_ptrs), mask=s_ok[:, None] & ok[None, :], other=0.0)
    mixed = tl.sum(wts[:, None] * vals.to(tl.float32), axis=0)
    if not HAS_NORM:
        tl.store(out_ptr + row * H + offs, mixed.to(out_ptr.dtype.element_ty), mask=ok)
    else:
        tl.store(mix_ptr + row * H + offs, mixed, mask=ok)
        ch = tl.arange(0, NCHUNK)
        tl.store(ss_ptr + row * NCHUNK + c + ch * 0, tl.sum(mixed * mixed, axis=0) + ch * 0.0, mask=ch == 0)
        tl.debug_barrier()
        arrived = tl.atomic_add(cnt_ptr + row, 1, sem="acq_rel", scope="gpu")
        if arrived == C - 1:  # the row's last chunk: normalize the whole row
            total = tl.sum(tl.load(ss_ptr + row * NCHUNK + ch, mask=ch < C, other=0.0, cache_modifier=".cg"),
                           axis=0)  # fmt: skip
            rstd = tl.rsqrt(total / H + out_eps)
            hs = tl.arange(0, BLOCK_H)
            h_ok = hs < H
            full = tl.load(mix_ptr + row * H + hs, mask=h_ok, other=0.0, cache_modifier=".cg")
            ow = tl.load(ow_ptr + hs, mask=h_ok, other=0.0).to(tl.float32)
            tl.store(out_ptr + row * H + hs, (full * rstd * ow).to(out_ptr.dtype.element_ty), mask=h_ok)
            tl.atomic_xchg(cnt_ptr + row, 0, sem="relaxed", scope="gpu")


class _Workspace(NamedTuple):
    floats: torch.Tensor  # logits, chunk sums of squares, the un-normalized mix
    counters: torch.Tensor  # one per row, zero between launches


_WORKSPACES: dict[tuple[int, int], _Workspace] = {}
_RETIRED: list[_Workspace] = []  # a captured graph keeps using an old buffer's address


def _workspace(device: torch.device, floats: int, rows: int) -> _Workspace:
    if device.type != "cuda":  # Triton's interpreter on the CPU
        return _Workspace(torch.empty(floats), torch.zeros(rows, dtype=torch.int32))
    key = (device.index or 0, torch.cuda.current_stream(device).stream_id)
    ws = _WORKSPACES.get(key)
    if ws is None or ws.floats.numel() < floats or ws.counters.numel() < rows:
        if ws is not None:
            _RETIRED.append(ws)
        ws = _Workspace(torch.empty(max(floats, 1 << 18), dtype=torch.float32, device=device),
                        torch.zeros(max(rows, 256), dtype=torch.int32, device=device))  # fmt: skip
        _WORKSPACES[key] = ws
    return ws


@functools.cache
def _pdl_default(device_index: int) -> bool:
    return torch.cuda.get_device_capability(device_index)[0] >= 9


def attn_res(prefix: torch.Tensor, delta: torch.Tensor | None, blocks: torch.Tensor,
             norm_weight: torch.Tensor, qk_weight: torch.Tensor, output_norm_weight: torch.Tensor | None,
             num_blocks: int, block_write_idx: int, eps: float, output_norm_eps: float, *,
             pdl: bool | None = None) -> torch.Tensor:  # fmt: skip
    """v0.28.0's ``attn_res`` (module docstring): updates ``prefix`` in place, returns the output."""
    m, h = prefix.shape
    if prefix.stride(1) != 1 or (delta is not None and (delta.shape != (m, h) or delta.stride(1) != 1)):
        raise ValueError(f"prefix/delta: expected [{m}, {h}] with unit column stride")
    if blocks.dim() != 3 or blocks.shape[0] != m or blocks.shape[2] != h or blocks.stride(2) != 1:
        raise ValueError(f"blocks: expected [{m}, R, {h}], got {tuple(blocks.shape)}")
    if not 0 <= num_blocks <= blocks.shape[1] or 0 <= block_write_idx < num_blocks:
        raise ValueError(f"num_blocks={num_blocks} / block_write_idx={block_write_idx} for {blocks.shape[1]} "
                         "blocks (a written block may not be a source)")  # fmt: skip
    if block_write_idx >= blocks.shape[1]:
        raise ValueError(f"block_write_idx={block_write_idx} outside {blocks.shape[1]} blocks")
    out = torch.empty((m, h), dtype=prefix.dtype, device=prefix.device)
    if m == 0:
        return out
    if pdl is None:
        pdl = prefix.device.type == "cuda" and _pdl_default(prefix.device.index or 0)
    nsrc, chunks = num_blocks + 1, triton.cdiv(h, CHUNK)
    nchunk = triton.next_power_of_2(chunks)
    ws = _workspace(prefix.device, m * (nsrc + nchunk + h), m)
    at_ss, at_mix = m * nsrc, m * (nsrc + nchunk)
    logits, ss, mix = ws.floats[:at_ss], ws.floats[at_ss:at_mix], ws.floats[at_mix:]
    launch = {"launch_pdl": True} if pdl else {}
    _score_kernel[(m, nsrc)](
        prefix, prefix if delta is None else delta, blocks, norm_weight, qk_weight, logits, h,
        prefix.stride(0), 0 if delta is None else delta.stride(0), blocks.stride(0), blocks.stride(1),
        num_blocks, max(block_write_idx, 0), eps, BLOCK=triton.next_power_of_2(h),
        HAS_DELTA=delta is not None, WRITE_BLOCK=block_write_idx >= 0, USE_PDL=pdl, num_warps=4,
        **launch)  # fmt: skip
    ow = prefix if output_norm_weight is None else output_norm_weight
    _mix_kernel[(m, chunks)](
        prefix, blocks, logits, ow, out, mix, ss, ws.counters, h, prefix.stride(0), blocks.stride(0),
        blocks.stride(1), num_blocks, chunks, output_norm_eps, CHUNK_=CHUNK,
        NSRC=max(triton.next_power_of_2(nsrc), 2), NCHUNK=nchunk, BLOCK_H=triton.next_power_of_2(h),
        HAS_NORM=output_norm_weight is not None, USE_PDL=pdl, num_warps=8, **launch)  # fmt: skip
    return out
