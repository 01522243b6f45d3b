# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-k3-overlay project
"""Kimi-K3's attention residual (attn-res) mix in one launch, for decode (Triton).

Per token row ``m`` (hidden ``H``, BF16 in and out, fp32 math):

- ``u = bf16(prefix[m] + delta[m])``, written back into ``prefix[m]`` (with ``delta``;
  without it ``u = prefix[m]``, and ``prefix`` is not written);
- with ``block_write_idx >= 0``: ``blocks[m, block_write_idx] = u``;
- the sources are ``v_0 .. v_{NB-1} = blocks[m, :NB]`` and ``v_NB = u``;
- ``logit_s = <v_s, norm_w * qk_w> * rsqrt(mean(v_s^2) + eps)``, ``p = softmax(logit)``,
  ``mixed = sum_s p_s v_s``;
- ``out[m] = mixed * rsqrt(mean(mixed^2) + out_eps) * out_w`` with an output-norm weight,
  else ``mixed``; ``NB = 0`` gives ``mixed = u``.

Why a kernel of our own: v0.28.0's walks the sources in tiles of four with an online
softmax (a chain of dependent loads and block reductions) and waits on the previous
kernel before it loads anything; it costs 7.6-8.2 µs per call on the H200 at decode,
twice per decoder layer, against well under a microsecond of bytes. This one is a single
CTA per row that loads every source of the row in one round trip (the blocks as one or
two ``[BLOCK_S, BLOCK_D]`` tiles, ``u`` from the prefix and delta beside them), reduces
the sums of squares and the dots of all blocks in one two-operand block reduction (and
u's in another, independent one), mixes from the tiles still in registers (or, with
``reload=True``, from a second read that hits L1: fewer live registers), then one more
block reduction for the output norm.

PDL (SM90+, ``pdl`` defaults to on there): the kernel lets the next kernel launch at once
(``griddepcontrol.launch_dependents``: the next kernel's own ``griddepcontrol.wait``
still waits for this grid to finish), loads the three weight vectors (parameters, no
kernel writes them) and only then waits (``griddepcontrol.wait``) before it reads
``prefix``, ``delta`` and ``blocks``, which the previous kernels may just have written.

``NB`` is a compile-time constant (one build per value, as v0.28.0's); so are the flags.
"""

from __future__ import annotations

import functools

import torch

from vllm.triton_utils import tl, triton

#: Most sources (NB + 1) one row may mix: two tiles of at most 16 (v0.28.0's models
#: have far fewer blocks; a larger NB is a ValueError, and the dispatch keeps the stock
#: kernel).
MAX_SOURCES = 16

#: ``"tile"``: :func:`_attn_res_kernel` (the row's sources in registers at once);
#: ``"loop"``: :func:`_attn_res_loop_kernel` (the row in pipelined column chunks). The row
#: over a thread-block cluster is :mod:`attn_res_cluster` (CuTe DSL), a launcher of its own.
VARIANTS = ("tile", "loop")


@triton.jit
def _add_pair(a0, a1, b0, b1):
    return a0 + b0, a1 + b1


@triton.jit
def _block_tile(blocks_ptr, row, stride_bm, stride_br, s, d, d_ok, NB: tl.constexpr,
                AGAIN: tl.constexpr = False):  # fmt: skip
    """``[BLOCK_S, BLOCK_D]`` fp32 tile of block sources ``s`` (zeros for s >= NB and past
    H). ``AGAIN``: the re-read of the mix, spelled with an explicit ``.ca`` (cache at all
    levels: it hits L1) so that the compiler does not merge it with the first read and
    keep that tile live across the reductions instead."""
    ptrs = blocks_ptr + row * stride_bm + s[:, None].to(tl.int64) * stride_br + d[None, :]
    mask = (s[:, None] < NB) & d_ok[None, :]
    if AGAIN:
        return tl.load(ptrs, mask=mask, other=0.0, cache_modifier=".ca").to(tl.float32)
    return tl.load(ptrs, mask=mask, other=0.0).to(tl.float32)


@triton.jit
def _tile_logits(vals, s, qk, inv_h, eps, NB: tl.constexpr):
    """Logits of one tile (-inf past the last block): the sums of squares and the dots
    in one (two-operand) block reduction."""
    ss, dot = tl.reduce((vals * vals, vals * qk[None, :]), 1, _add_pair)
    return tl.where(s < NB, dot * tl.rsqrt(ss * inv_h + eps), -float("inf"))


# Strides specialized (see _attn_res_loop_kernel): unspecialized, every access of the
# row in the sm_90 PTX was a scalar 16-bit one (160 ld.global.b16 at NB = 8; only the
# weights loaded as 16-byte vectors); specialized, 26 ld.global.v4 and no scalar one.
@triton.jit(do_not_specialize=["write_idx"])
def _attn_res_kernel(prefix_ptr, delta_ptr, blocks_ptr, norm_w_ptr, qk_w_ptr, out_w_ptr, out_ptr,
                     H, stride_p, stride_d, stride_bm, stride_br, write_idx, eps, out_eps,
                     NB: tl.constexpr, BLOCK_S: tl.constexpr, BLOCK_D: tl.constexpr,
                     HAS_DELTA: tl.constexpr, WRITE_BLOCK: tl.constexpr,
                     OUT_NORM: tl.constexpr, RELOAD: tl.constexpr, USE_PDL: tl.constexpr):  # fmt: skip
    row = tl.program_id(0).to(tl.int64)
    d = tl.arange(0, BLOCK_D)
    d_ok = d < H
    inv_h = 1.0 / H
    if USE_PDL:
        tl.extra.cuda.gdc_launch_dependents()
    # Weights first: no kernel of the step writes them, so they need not wait.
    if NB > 0:
        qk = tl.load(norm_w_ptr + d, mask=d_ok, other=0.0).to(tl.float32) * tl.load(
            qk_w_ptr + d, mask=d_ok, other=0.0
        ).to(tl.float32)
    if OUT_NORM:
        out_w = tl.load(out_w_ptr + d, mask=d_ok, other=0.0).to(tl.float32)
    if USE_PDL:
        tl.extra.cuda.gdc_wait()

    # The blocks' loads go out first, with the prefix's: one round trip for the row.
    if NB > 0:
        s0 = tl.arange(0, BLOCK_S)
        t0 = _block_tile(blocks_ptr, row, stride_bm, stride_br, s0, d, d_ok, NB)
        if NB > BLOCK_S:
            s1 = BLOCK_S + tl.arange(0, BLOCK_S)
            t1 = _block_tile(blocks_ptr, row, stride_bm, stride_br, s1, d, d_ok, NB)
    u = tl.load(prefix_ptr + row * stride_p + d, mask=d_ok, other=0.0)
    if HAS_DELTA:
        # The BF16 sum is the new prefix and the source, as the stock kernel rounds it.
        delta = tl.load(delta_ptr + row * stride_d + d, mask=d_ok, other=0.0)
        u = (u.to(tl.float32) + delta.to(tl.float32)).to(prefix_ptr.dtype.element_ty)
        tl.store(prefix_ptr + row * stride_p + d, u, mask=d_ok)
    if WRITE_BLOCK:
        tl.store(blocks_ptr + row * stride_bm + write_idx.to(tl.int64) * stride_br + d, u, mask=d_ok)
    u = u.to(tl.float32)

    if NB == 0:
        mixed = u
    else:
        # u (the last source) apart from the tiles: a tile of exactly the blocks (8 rows
        # for NB = 8, not 16) keeps the registers for the blocks.
        u_ss, u_dot = tl.reduce((u * u, u * qk), 0, _add_pair)
        u_logit = u_dot * tl.rsqrt(u_ss * inv_h + eps)
        l0 = _tile_logits(t0, s0, qk, inv_h, eps, NB)
        top = tl.maximum(tl.max(l0, axis=0), u_logit)
        if NB > BLOCK_S:
            l1 = _tile_logits(t1, s1, qk, inv_h, eps, NB)
            top = tl.maximum(top, tl.max(l1, axis=0))
        e0 = tl.exp(l0 - top)
        e_u = tl.exp(u_logit - top)
        denom = tl.sum(e0, axis=0) + e_u
        if NB > BLOCK_S:
            e1 = tl.exp(l1 - top)
            denom += tl.sum(e1, axis=0)
        if RELOAD:
            t0 = _block_tile(blocks_ptr, row, stride_bm, stride_br, s0, d, d_ok, NB, True)
        # Sources sit in each thread's registers along S: this sum needs no other thread.
        mixed = tl.sum(e0[:, None] * t0, axis=0) + e_u * u
        if NB > BLOCK_S:
            if RELOAD:
                t1 = _block_tile(blocks_ptr, row, stride_bm, stride_br, s1, d, d_ok, NB, True)
            mixed += tl.sum(e1[:, None] * t1, axis=0)
        mixed = mixed / denom

    if OUT_NORM:
        ms = tl.sum(mixed * mixed, axis=0) * inv_h
        mixed = mixed * tl.rsqrt(ms + out_eps) * out_w
    tl.store(out_ptr + row * H + d, mixed.to(out_ptr.dtype.element_ty), mask=d_ok)


# The strides ARE specialized (Triton's divisible-by-16 key, two builds at most): with
# them unspecialized the row offsets have no known alignment and every load and store
# is a scalar 16-bit one (seen in the sm_90 PTX), not 16-byte vectors.
@triton.jit(do_not_specialize=["write_idx"])
def _attn_res_loop_kernel(prefix_ptr, delta_ptr, blocks_ptr, norm_w_ptr, qk_w_ptr, out_w_ptr, out_ptr,
                          H, stride_p, stride_d, stride_bm, stride_br, write_idx, eps, out_eps,
                          NB: tl.constexpr, BLOCK_S: tl.constexpr,
                          CH: tl.constexpr, NCH: tl.constexpr, STAGES: tl.constexpr,
                          HAS_DELTA: tl.constexpr, WRITE_BLOCK: tl.constexpr,
                          OUT_NORM: tl.constexpr, USE_PDL: tl.constexpr):  # fmt: skip
    """The ``loop`` variant: the row in ``NCH`` chunks of ``CH`` columns, small registers.

    Pass 1 (a loop the software pipeliner stages: ``tl.range(num_stages=STAGES)``, which
    Triton needs to pipeline loads that feed no dot; ``STAGES`` is the launcher's
    ``num_stages``; the later passes likewise): u's chunk (the
    prefix write and block write), the ``[BLOCK_S, CH]`` tile of blocks, into ELEMENTWISE
    fp32 accumulators; the cross-thread reductions once after the loop. Pass 2 re-reads
    the chunks (L1/L2 hits) and mixes; with the output norm it only accumulates
    sum(mixed^2) and pass 3 recomputes the mix and stores it normed (one rounding)."""
    row = tl.program_id(0).to(tl.int64)
    c0 = tl.arange(0, CH)
    inv_h = 1.0 / H
    if USE_PDL:
        tl.extra.cuda.gdc_launch_dependents()
        # nothing loads before the wait: the weights come chunk by chunk with the rows
        tl.extra.cuda.gdc_wait()
    p_row = prefix_ptr + row * stride_p
    o_row = out_ptr + row * H
    s = tl.arange(0, BLOCK_S)
    s_ok = s < NB
    b_rows = blocks_ptr + row * stride_bm + s[:, None].to(tl.int64) * stride_br

    # ---- pass 1: u (written back), sums of squares and dots, elementwise
    u_ss = tl.zeros([CH], tl.float32)
    u_dot = tl.zeros([CH], tl.float32)
    acc_ss = tl.zeros([BLOCK_S, CH], tl.float32)
    acc_dot = tl.zeros([BLOCK_S, CH], tl.float32)
    for c in tl.range(0, NCH, num_stages=STAGES):
        d = c * CH + c0
        d_ok = d < H
        if NB > 0:
            b = tl.load(b_rows + d[None, :], mask=s_ok[:, None] & d_ok[None, :], other=0.0).to(tl.float32)
            qk = tl.load(norm_w_ptr + d, mask=d_ok, other=0.0).to(tl.float32) * tl.load(
                qk_w_ptr + d, mask=d_ok, other=0.0
            ).to(tl.float32)
        u = tl.load(p_row + d, mask=d_ok, other=0.0)
        if HAS_DELTA:
            delta = tl.load(delta_ptr + row * stride_d + d, mask=d_ok, other=0.0)
            u = (u.to(tl.float32) + delta.to(tl.float32)).to(prefix_ptr.dtype.element_ty)
            tl.store(p_row + d, u, mask=d_ok)
        if WRITE_BLOCK:
            tl.store(blocks_ptr + row * stride_bm + write_idx.to(tl.int64) * stride_br + d, u, mask=d_ok)
        uf = u.to(tl.float32)
        if NB > 0:
            acc_ss += b * b
            acc_dot += b * qk[None, :]
            u_dot += uf * qk
            u_ss += uf * uf
        elif OUT_NORM:
            u_ss += uf * uf  # NB = 0: mixed = u, its norm
        else:
            tl.store(o_row + d, u, mask=d_ok)  # NB = 0, no norm: out = u, done

    if NB > 0:
        ss = tl.sum(acc_ss, axis=1)
        dot = tl.sum(acc_dot, axis=1)
        logit = tl.where(s_ok, dot * tl.rsqrt(ss * inv_h + eps), -float("inf"))
        u_logit = tl.sum(u_dot, axis=0) * tl.rsqrt(tl.sum(u_ss, axis=0) * inv_h + eps)
        top = tl.maximum(tl.max(logit, axis=0), u_logit)
        e = tl.exp(logit - top)
        e_u = tl.exp(u_logit - top)
        inv_den = 1.0 / (tl.sum(e, axis=0) + e_u)
        p = e * inv_den
        p_u = e_u * inv_den
    if NB > 0 or OUT_NORM:
        # pass 1's prefix stores, read back by other threads of the CTA below
        tl.debug_barrier()
    if NB > 0:
        # ---- pass 2: the mix (stored, or its sum of squares for the norm)
        m_ss = tl.zeros([CH], tl.float32)
        for c in tl.range(0, NCH, num_stages=STAGES):
            d = c * CH + c0
            d_ok = d < H
            b = tl.load(b_rows + d[None, :], mask=s_ok[:, None] & d_ok[None, :], other=0.0).to(tl.float32)
            u = tl.load(p_row + d, mask=d_ok, other=0.0).to(tl.float32)
            mixed = tl.sum(p[:, None] * b, axis=0) + p_u * u
            if OUT_NORM:
                m_ss += mixed * mixed
            else:
                tl.store(o_row + d, mixed.to(out_ptr.dtype.element_ty), mask=d_ok)
    else:
        m_ss = u_ss
    if OUT_NORM:
        r = tl.rsqrt(tl.sum(m_ss, axis=0) * inv_h + out_eps)
        # ---- pass 3: the same mix again, normed, one rounding
        for c in tl.range(0, NCH, num_stages=STAGES):
            d = c * CH + c0
            d_ok = d < H
            u = tl.load(p_row + d, mask=d_ok, other=0.0).to(tl.float32)
            if NB > 0:
                b = tl.load(b_rows + d[None, :], mask=s_ok[:, None] & d_ok[None, :], other=0.0).to(tl.float32)
                mixed = tl.sum(p[:, None] * b, axis=0) + p_u * u
            else:
                mixed = u
            ow = tl.load(out_w_ptr + d, mask=d_ok, other=0.0).to(tl.float32)
            tl.store(o_row + d, (mixed * r * ow).to(out_ptr.dtype.element_ty), mask=d_ok)


@functools.cache
def _pdl_default(device_index: int) -> bool:
    return torch.cuda.get_device_capability(device_index)[0] >= 9


def _check_rows(name: str, t: torch.Tensor, m: int, h: int) -> None:
    if t.dim() != 2 or tuple(t.shape) != (m, h) or (h > 1 and t.stride(1) != 1):
        raise ValueError(f"{name}: expected [{m}, {h}] with unit column stride, got "
                         f"{tuple(t.shape)} strides {t.stride()}")  # fmt: skip


def _check_vector(name: str, t: torch.Tensor, h: int) -> None:
    if t.dim() != 1 or t.shape[0] != h or (h > 1 and t.stride(0) != 1):
        raise ValueError(f"{name}: expected a contiguous ({h},), got {tuple(t.shape)}")


def check_operands(prefix, delta, blocks, norm_weight, qk_weight, output_norm_weight,
                   num_blocks: int, block_write_idx: int) -> None:  # fmt: skip
    """Raise ``ValueError`` where :func:`attn_res` would (its docstring); else nothing."""
    if not isinstance(prefix, torch.Tensor) or prefix.dim() != 2:
        raise ValueError("prefix: expected a [M, H] tensor")
    m, h = prefix.shape
    _check_rows("prefix", prefix, m, h)
    if prefix.dtype not in (torch.bfloat16, torch.float16):
        raise ValueError(f"prefix: expected bf16 (or fp16), got {prefix.dtype}")
    if delta is not None:
        _check_rows("delta", delta, m, h)
    if not isinstance(num_blocks, int) or not 0 <= num_blocks < MAX_SOURCES:
        raise ValueError(f"num_blocks={num_blocks!r}: expected an int in 0..{MAX_SOURCES - 1}")
    uses_blocks = num_blocks > 0 or block_write_idx >= 0
    if uses_blocks:
        if blocks.dim() != 3 or blocks.shape[0] != m or blocks.shape[2] != h or blocks.stride(2) != 1:
            raise ValueError(f"blocks: expected [{m}, R, {h}] with unit last stride, got "
                             f"{tuple(blocks.shape)} strides {blocks.stride()}")  # fmt: skip
        if blocks.shape[1] < num_blocks:
            raise ValueError(f"blocks has {blocks.shape[1]} slots, num_blocks={num_blocks}")
    if block_write_idx >= 0 and not num_blocks <= block_write_idx < blocks.shape[1]:
        # A slot among the sources would be read by other threads while it is written.
        raise ValueError(f"block_write_idx={block_write_idx}: expected -1 or "
                         f"{num_blocks}..{blocks.shape[1] - 1}")  # fmt: skip
    vectors = [("norm_weight", norm_weight), ("qk_weight", qk_weight)]
    if output_norm_weight is not None:
        vectors.append(("output_norm_weight", output_norm_weight))
    for name, t in vectors:
        _check_vector(name, t, h)
    activations = [prefix, delta] + ([blocks] if uses_blocks else [])
    for t in activations:
        if t is not None and t.dtype != prefix.dtype:
            raise ValueError(f"dtype {t.dtype} does not match prefix's {prefix.dtype}")
    for name, t in vectors:
        if t.dtype not in (torch.bfloat16, torch.float16, torch.float32):
            raise ValueError(f"{name}: unsupported dtype {t.dtype}")
    for t in activations + [w for _, w in vectors]:
        if t is not None and t.device != prefix.device:
            raise ValueError(f"operands on {t.device} and {prefix.device}")


def _pow2_at_least(n: int) -> int:
    # host arithmetic: vLLM's Triton placeholder (no usable Triton) has no helpers
    return 1 << max(n - 1, 0).bit_length()


def block_s_for(num_blocks: int, block_s: int | None = None) -> int:
    """Blocks per tile (``u``, the last source, is kept apart): ``block_s`` if given
    (raises ``ValueError`` unless a power of two with two tiles enough for
    ``num_blocks``), else the smallest power of two holding every block in one tile."""
    if block_s is None:
        return _pow2_at_least(max(num_blocks, 1))
    if block_s < 1 or block_s & (block_s - 1) or 2 * block_s < num_blocks:
        raise ValueError(f"block_s={block_s}: a power of two with 2 * block_s >= {num_blocks}")
    return block_s


#: Shared memory one CTA may take on SM90 (227 KB, the opt-in maximum per block).
MAX_SMEM_BYTES = 232448


def loop_smem_bytes(block_s: int, chunk: int, num_stages: int) -> int:
    """An upper bound of the ``loop`` variant's shared memory: ``num_stages`` pipelined copies
    of a bf16 chunk of every source row plus the prefix's and delta's (bytes)."""
    return num_stages * chunk * 2 * (block_s + 2)


def attn_res(
    prefix: torch.Tensor,
    delta: torch.Tensor | None,
    blocks: torch.Tensor,
    norm_weight: torch.Tensor,
    qk_weight: torch.Tensor,
    output_norm_weight: torch.Tensor | None,
    num_blocks: int,
    block_write_idx: int,
    eps: float,
    output_norm_eps: float,
    *,
    num_warps: int = 16,
    block_s: int | None = None,
    reload: bool = True,
    pdl: bool | None = None,
    variant: str = "tile",
    chunk: int = 1024,
    num_stages: int = 4,
) -> torch.Tensor:
    """The attn-res mix of every row (module docstring), in one launch; v0.28.0's
    ``ops.attn_res`` contract (positional arguments), plus meta-parameters.

    Args:
        prefix: (M, H) BF16 (or fp16), unit column stride, any row stride; updated in
            place to ``bf16(prefix + delta)`` when ``delta`` is given.
        delta: None or (M, H) of prefix's dtype, unit column stride.
        blocks: (M, R, H) of prefix's dtype, unit last stride, any other strides
            (e.g. a slice of a wider buffer); read at ``[:, :num_blocks]``, written at
            ``[:, block_write_idx]``. Unused (any tensor) when ``num_blocks == 0`` and
            ``block_write_idx < 0``.
        norm_weight, qk_weight: contiguous (H,) (BF16 or fp32): the source norm's weight
            and the projection to the logit (v0.28.0's ``res_proj.weight.squeeze(0)``).
        output_norm_weight: None or a contiguous (H,): the output RMSNorm's weight.
        num_blocks: NB, 0..15 (a compile-time constant).
        block_write_idx: -1, or a slot in ``num_blocks .. R - 1`` (not one of the
            sources: they are read while it is written).
        eps, output_norm_eps: the two norms' epsilons.
        num_warps: warps of the row's CTA (8, 16 or 32 are sensible).
        block_s: blocks per tile (power of two, two tiles at most); None: one tile.
        reload: mix from a second read of the sources (hits L1/L2) instead of
            keeping the tiles live in registers (the default until the H200 bench says
            otherwise: ptxas for sm_90a spills with the tile of NB = 8 kept live).
        pdl: launch with programmatic dependent launch; None: on for SM90+ CUDA.
        variant: ``"tile"`` (the whole row in registers, ``block_s``/``reload`` apply)
            or ``"loop"`` (:func:`_attn_res_loop_kernel`: the row in chunks of ``chunk``
            columns, a power of two, over ``num_stages`` pipelined loads; ``block_s`` and
            ``reload`` do not apply: one tile of all blocks).

    Returns:
        A new packed (M, H) tensor of prefix's dtype.

    Raises:
        ValueError: a shape, stride, dtype or device that does not fit the above, NB
            outside 0..15, a bad ``block_write_idx`` or ``block_s``, ``variant``,
            ``chunk`` or ``num_stages``.
    """
    check_operands(prefix, delta, blocks, norm_weight, qk_weight, output_norm_weight,
                   num_blocks, block_write_idx)  # fmt: skip
    m, h = prefix.shape
    if variant not in VARIANTS:
        raise ValueError(f"variant={variant!r}: expected one of {VARIANTS}")
    if variant == "loop":
        if chunk < 16 or chunk & (chunk - 1):
            raise ValueError(f"chunk={chunk}: a power of two >= 16")
        if not isinstance(num_stages, int) or num_stages < 1:
            raise ValueError(f"num_stages={num_stages!r}: an int >= 1")
    bs = block_s_for(num_blocks, block_s if variant == "tile" else None)
    if variant == "loop" and loop_smem_bytes(bs, chunk, num_stages) > MAX_SMEM_BYTES:
        # The pipeliner stages every source's chunk: at 8 stages a 16-source tile of 1024
        # columns wanted 280 KB on the H200 (2026-12-04) and Triton refused to launch.
        raise ValueError(f"loop variant: {num_stages} stages of {bs} x {chunk} sources need about "
                         f"{loop_smem_bytes(bs, chunk, num_stages)} bytes of shared memory, over "
                         f"{MAX_SMEM_BYTES}")
    out = torch.empty((m, h), dtype=prefix.dtype, device=prefix.device)
    if m == 0:
        return out
    if pdl is None:
        pdl = prefix.device.type == "cuda" and _pdl_default(prefix.device.index or 0)
    uses_blocks = num_blocks > 0 or block_write_idx >= 0
    stride_bm, stride_br = (blocks.stride(0), blocks.stride(1)) if uses_blocks else (0, 0)
    kw = dict(NB=num_blocks, BLOCK_S=bs, HAS_DELTA=delta is not None,
              WRITE_BLOCK=block_write_idx >= 0, OUT_NORM=output_norm_weight is not None,
              USE_PDL=bool(pdl), num_warps=num_warps)  # fmt: skip
    if variant == "loop":
        kern = _attn_res_loop_kernel
        kw.update(CH=chunk, NCH=-(-h // chunk), STAGES=num_stages, num_stages=num_stages)
    else:
        kern = _attn_res_kernel
        kw.update(BLOCK_D=_pow2_at_least(h), RELOAD=bool(reload))
    if pdl:
        kw["launch_pdl"] = True
    kern[(m,)](
        prefix, prefix if delta is None else delta, blocks if uses_blocks else prefix,
        norm_weight, qk_weight, norm_weight if output_norm_weight is None else output_norm_weight,
        out, h, prefix.stride(0), 0 if delta is None else delta.stride(0), stride_bm, stride_br,
        max(block_write_idx, 0), float(eps), float(output_norm_eps), **kw,
    )  # fmt: skip
    return out
