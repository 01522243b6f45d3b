"""Experiment (issue 21): Kimi-K3's decode attn-res as three Triton kernels of ours, none faster.

This is lab code, not overlay code: nothing routes to it. It exists to answer, with
H200 measurements (``k3lab/decode_step/attn_res_bench.py``, figures in
``results/decode_step/README.md``), whether loading every source of a row in one round
trip beats v0.28.0's one-program-per-row kernel (~7.5-8 µs). It does not: the best,
``spin``, runs 6.5-7.2 µs at M <= 8 and 8.4-8.7 at M = 16; its cross-program exchange
(counter, spin, partials re-read through L2) costs ~2.9 µs and the Gram's dependent MMA
chain ~1.2 µs of that. ``replay.py --attn-res KIND`` runs one in the decode step.

What it computes (the decode case of the model's attn-res: ``delta`` given, output norm
applied, no block write). For each token row ``m`` (hidden ``H``, bf16 in and out, fp32
math), with ``NB`` earlier blocks ``blocks[m, :NB]`` and the running prefix:

* ``u = bf16(prefix[m] + delta[m])``, written back into ``prefix[m]`` (in place);
* sources ``v_0 .. v_{NB-1} = blocks[m, :NB]``, ``v_NB = u`` (``NB + 1 <= 16``);
* ``logit_s = <v_s, norm_w * qk_w> * rsqrt(mean(v_s^2) + eps)``, ``p = softmax(logit)``;
* ``mixed = sum_s p_s v_s``; ``out[m] = mixed * rsqrt(mean(mixed^2) + out_eps) * out_w``.

The output norm needs ``mean(mixed^2)`` before any column of ``out`` is written;
``sum(mixed^2) = p^T G p`` with ``G`` the sources' Gram matrix, so every kernel here
gathers, in the same pass that reads the sources for the scores, per-source sums of
squares, dots with ``norm_w * qk_w`` and ``G`` (one ``tl.dot`` of the bf16 source
tile with itself; fp32 accumulation of exact bf16 products). Then the mix is one more
pass with ``p`` and the output scale known.

* :func:`attn_res_split_last` (``kind="last"``): grid ``(M, C)`` column chunks. Each
  program loads its chunk of all sources at once (one round trip), writes its partial
  sums to a scratch row and counts itself in on a per-row counter (``acq_rel``); the
  program that arrives last reduces the partials and mixes the whole row (the sources
  again, from L2), then resets the counter to 0, so a CUDA graph can replay it. No
  program waits on another: it runs under the Triton interpreter too.
* :func:`attn_res_row` (``kind="row"``): one program per row; pass 1 over the row's
  column chunks (partials, prefix write), pass 2 mixes.
* :func:`attn_res_split_spin` (``kind="spin"``): grid ``(M, C)``, ``M * C <= 132``
  (one wave on an H200: every program is resident, so spinning cannot deadlock); after
  writing its partials each program waits on a per-row barrier (a counter and a
  generation word, the last arrival resets the counter and bumps the generation), then
  reduces the partials and mixes the chunk it still holds in registers. GPU only: the
  interpreter runs programs one after another, so the first would spin for ever.

With PDL (SM90+) each kernel lets the next kernel launch at once, loads the weight
chunks it needs (written by no kernel) and only then waits for the previous kernel.

Shapes: ``prefix`` ``[M, H]`` bf16 (row stride free, unit column stride), ``delta``
``[M, H]``, ``blocks`` ``[M, R, H]`` with ``R >= num_blocks`` (row and block strides
free), the three weights ``[H]``; returns a new packed ``[M, H]`` in ``prefix``'s dtype.
The per-row counters and the fp32 scratch (``M * C * 288`` floats) live in a
:class:`Workspace` per device, allocated on first use (outside graph capture).
``ValueError`` for shapes, strides or ``num_blocks`` outside ``1..15``;
``RuntimeError`` for a first call (a new workspace) inside CUDA-graph capture.
Calls that share a workspace must not run concurrently (one stream).
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

_S = 16  # source rows of a tile: NB + 1 <= 16 (tl.dot needs 16)
_REC = 2 * _S + _S * _S  # fp32 partials per (row, chunk): sumsq[S], dot[S], Gram[S, S]
S = tl.constexpr(_S)
REC = tl.constexpr(_REC)
MAX_SPIN_PROGRAMS = 132  # the H200's SMs: one resident wave


@triton.jit
def _chunk(prefix_ptr, delta_ptr, blocks_ptr, row, cols, cmask, srow, sp_m, sd_m, sb_m, sb_r,
           NB: tl.constexpr, WRITE: tl.constexpr, CG: tl.constexpr):  # fmt: skip
    """bf16 tile [S, CH] of the sources' columns ``cols``: blocks in rows < NB, the updated
    prefix in row NB (formed and written back when WRITE, read back from ``prefix`` if not)."""
    bmask = (srow < NB)[:, None] & cmask[None, :]
    bptr = blocks_ptr + row * sb_m + srow[:, None] * sb_r + cols[None, :]
    if CG:  # re-read after other programs wrote: L2 only, never a stale L1 line
        blk = tl.load(bptr, mask=bmask, other=0.0, cache_modifier=".cg")
    else:
        blk = tl.load(bptr, mask=bmask, other=0.0)
    if WRITE:
        pre = tl.load(prefix_ptr + row * sp_m + cols, mask=cmask, other=0.0).to(tl.float32)
        dl = tl.load(delta_ptr + row * sd_m + cols, mask=cmask, other=0.0).to(tl.float32)
        upd = (pre + dl).to(prefix_ptr.dtype.element_ty)
        tl.store(prefix_ptr + row * sp_m + cols, upd, mask=cmask)
    else:
        upd = tl.load(prefix_ptr + row * sp_m + cols, mask=cmask, other=0.0, cache_modifier=".cg")
    return tl.where((srow == NB)[:, None], upd[None, :].to(blk.dtype), blk)


@triton.jit
def _partials(tile, wqk, CH: tl.constexpr, GSPLIT: tl.constexpr):
    """(sumsq[S], dot[S], Gram[S, S]) of a bf16 source tile [S, CH], fp32. GSPLIT > 1 forms
    the Gram as GSPLIT independent MMA chains over column groups (a batched dot) instead of
    one chain of CH / 16 dependent MMAs."""
    tf = tile.to(tl.float32)
    ss = tl.sum(tf * tf, axis=1)
    dt = tl.sum(tf * wqk[None, :], axis=1)
    if GSPLIT == 1:
        g = tl.dot(tile, tl.trans(tile), out_dtype=tl.float32)
    else:
        t3 = tl.permute(tl.reshape(tile, (S, GSPLIT, CH // GSPLIT)), (1, 0, 2))
        g = tl.sum(tl.dot(t3, tl.permute(t3, (0, 2, 1)), out_dtype=tl.float32), axis=0)
    return ss, dt, g


@triton.jit
def _weights(ss, dt, g, srow, H: tl.constexpr, NB: tl.constexpr, eps, out_eps):
    """Softmax weights p[S] (0 beyond the NB + 1 sources) and the output norm's rsqrt."""
    logit = dt * tl.rsqrt(ss / H + eps)
    logit = tl.where(srow <= NB, logit, -float("inf"))
    e = tl.exp(logit - tl.max(logit, axis=0))
    p = e / tl.sum(e, axis=0)
    msq = tl.sum(tl.sum(p[:, None] * g * p[None, :], axis=1), axis=0)
    return p, tl.rsqrt(msq / H + out_eps)


@triton.jit
def _reduce_scratch(ws_ptr, row, C: tl.constexpr, CP: tl.constexpr, srow):
    """Sum the C partial records of ``row`` (L2 reads)."""
    ci = tl.arange(0, CP)
    cm = (ci < C)[:, None]
    base = ws_ptr + row * (C * REC) + ci[:, None] * REC
    ss = tl.sum(tl.load(base + srow[None, :], mask=cm, other=0.0, cache_modifier=".cg"), axis=0)
    dt = tl.sum(tl.load(base + S + srow[None, :], mask=cm, other=0.0, cache_modifier=".cg"), axis=0)
    gi = tl.arange(0, S * S)
    g = tl.sum(tl.load(base + 2 * S + gi[None, :], mask=cm, other=0.0, cache_modifier=".cg"), axis=0)
    return ss, dt, tl.reshape(g, (S, S))


@triton.jit
def _store_partials(ws_ptr, row, c, C: tl.constexpr, srow, ss, dt, g):
    base = ws_ptr + (row * C + c) * REC
    tl.store(base + srow, ss)
    tl.store(base + S + srow, dt)
    tl.store(base + 2 * S + srow[:, None] * S + srow[None, :], g)


@triton.jit
def _wqk(nw_ptr, qw_ptr, cols, cmask):
    """The input norm's weight times the query weight on ``cols`` (fp32)."""
    return tl.load(nw_ptr + cols, mask=cmask, other=0.0).to(tl.float32) * tl.load(
        qw_ptr + cols, mask=cmask, other=0.0).to(tl.float32)  # fmt: skip


@triton.jit
def _chunk_partials(prefix_ptr, delta_ptr, blocks_ptr, nw_ptr, qw_ptr, row, c, srow, sp_m, sd_m,
                    sb_m, sb_r, H: tl.constexpr, NB: tl.constexpr, CH: tl.constexpr,
                    GSPLIT: tl.constexpr):  # fmt: skip
    """Chunk ``c``'s partial sums of one row (loads, then :func:`_partials`)."""
    cols = c * CH + tl.arange(0, CH)
    cmask = cols < H
    tile = _chunk(prefix_ptr, delta_ptr, blocks_ptr, row, cols, cmask, srow, sp_m, sd_m, sb_m, sb_r,
                  NB, True, False)  # fmt: skip
    return _partials(tile, _wqk(nw_ptr, qw_ptr, cols, cmask), CH, GSPLIT)


@triton.jit(do_not_specialize=["sp_m", "sd_m", "sb_m", "sb_r"])
def _split_last_kernel(prefix_ptr, delta_ptr, blocks_ptr, nw_ptr, qw_ptr, ow_ptr, out_ptr, ws_ptr,
                       cnt_ptr, sp_m, sd_m, sb_m, sb_r, eps, out_eps, H: tl.constexpr,
                       NB: tl.constexpr, CH: tl.constexpr, C: tl.constexpr, CP: tl.constexpr,
                       GSPLIT: tl.constexpr, USE_PDL: tl.constexpr):  # fmt: skip
    row = tl.program_id(0).to(tl.int64)
    c = tl.program_id(1)
    srow = tl.arange(0, S)
    cols = c * CH + tl.arange(0, CH)
    cmask = cols < H
    if USE_PDL:
        tl.extra.cuda.gdc_launch_dependents()
    wqk = _wqk(nw_ptr, qw_ptr, cols, cmask)
    if USE_PDL:
        tl.extra.cuda.gdc_wait()
    tile = _chunk(prefix_ptr, delta_ptr, blocks_ptr, row, cols, cmask, srow, sp_m, sd_m, sb_m, sb_r,
                  NB, True, False)  # fmt: skip
    ss, dt, g = _partials(tile, wqk, CH, GSPLIT)
    _store_partials(ws_ptr, row, c, C, srow, ss, dt, g)
    # every thread's partials and prefix columns are written before the release below
    tl.debug_barrier()
    arrived = tl.atomic_add(cnt_ptr + row, 1, sem="acq_rel", scope="gpu")
    if arrived == C - 1:  # the last program of this row: all partials are visible
        tl.debug_barrier()
        ss, dt, g = _reduce_scratch(ws_ptr, row, C, CP, srow)
        p, rstd = _weights(ss, dt, g, srow, H, NB, eps, out_eps)
        for cc in range(C):
            cols2 = cc * CH + tl.arange(0, CH)
            cm2 = cols2 < H
            t2 = _chunk(prefix_ptr, delta_ptr, blocks_ptr, row, cols2, cm2, srow, sp_m, sd_m,
                        sb_m, sb_r, NB, False, True).to(tl.float32)  # fmt: skip
            mixed = tl.sum(p[:, None] * t2, axis=0)
            ow = tl.load(ow_ptr + cols2, mask=cm2, other=0.0).to(tl.float32)
            tl.store(out_ptr + row * H + cols2, (mixed * rstd * ow).to(out_ptr.dtype.element_ty),
                     mask=cm2)  # fmt: skip
        tl.atomic_xchg(cnt_ptr + row, 0, sem="relaxed", scope="gpu")  # ready for the next call


@triton.jit(do_not_specialize=["sp_m", "sd_m", "sb_m", "sb_r"])
def _split_spin_kernel(prefix_ptr, delta_ptr, blocks_ptr, nw_ptr, qw_ptr, ow_ptr, out_ptr, ws_ptr,
                       cnt_ptr, gen_ptr, sp_m, sd_m, sb_m, sb_r, eps, out_eps, H: tl.constexpr,
                       NB: tl.constexpr, CH: tl.constexpr, C: tl.constexpr, CP: tl.constexpr,
                       GSPLIT: tl.constexpr, USE_PDL: tl.constexpr,
                       ABLATE: tl.constexpr = 0):  # fmt: skip
    row = tl.program_id(0).to(tl.int64)
    c = tl.program_id(1)
    srow = tl.arange(0, S)
    cols = c * CH + tl.arange(0, CH)
    cmask = cols < H
    if USE_PDL:
        tl.extra.cuda.gdc_launch_dependents()
    wqk = _wqk(nw_ptr, qw_ptr, cols, cmask)
    ow = tl.load(ow_ptr + cols, mask=cmask, other=0.0).to(tl.float32)
    if USE_PDL:
        tl.extra.cuda.gdc_wait()
    # the generation before this program arrives: the last arrival bumps it
    gen0 = tl.atomic_add(gen_ptr + row, 0, sem="acquire", scope="gpu")
    tile = _chunk(prefix_ptr, delta_ptr, blocks_ptr, row, cols, cmask, srow, sp_m, sd_m, sb_m, sb_r,
                  NB, True, False)  # fmt: skip
    if ABLATE & 2:  # measurement only: no Gram (wrong output norm)
        tf = tile.to(tl.float32)
        ss = tl.sum(tf * tf, axis=1)
        dt = tl.sum(tf * wqk[None, :], axis=1)
        g = tl.zeros((S, S), tl.float32)
    else:
        ss, dt, g = _partials(tile, wqk, CH, GSPLIT)
    if not (ABLATE & 1):  # ABLATE & 1, measurement only: no barrier, own partials (wrong output)
        _store_partials(ws_ptr, row, c, C, srow, ss, dt, g)
        tl.debug_barrier()
        arrived = tl.atomic_add(cnt_ptr + row, 1, sem="acq_rel", scope="gpu")
        if arrived == C - 1:
            tl.atomic_xchg(cnt_ptr + row, 0, sem="relaxed", scope="gpu")
            tl.atomic_add(gen_ptr + row, 1, sem="release", scope="gpu")
        else:
            cur = tl.atomic_add(gen_ptr + row, 0, sem="acquire", scope="gpu")
            while cur == gen0:
                cur = tl.atomic_add(gen_ptr + row, 0, sem="acquire", scope="gpu")
        tl.debug_barrier()
        ss, dt, g = _reduce_scratch(ws_ptr, row, C, CP, srow)
    p, rstd = _weights(ss, dt, g, srow, H, NB, eps, out_eps)
    mixed = tl.sum(p[:, None] * tile.to(tl.float32), axis=0)
    tl.store(out_ptr + row * H + cols, (mixed * rstd * ow).to(out_ptr.dtype.element_ty), mask=cmask)


@triton.jit(do_not_specialize=["sp_m", "sd_m", "sb_m", "sb_r"])
def _row_kernel(prefix_ptr, delta_ptr, blocks_ptr, nw_ptr, qw_ptr, ow_ptr, out_ptr, sp_m, sd_m,
                sb_m, sb_r, eps, out_eps, H: tl.constexpr, NB: tl.constexpr, CH: tl.constexpr,
                C: tl.constexpr, UNROLL: tl.constexpr, GSPLIT: tl.constexpr,
                USE_PDL: tl.constexpr):  # fmt: skip
    row = tl.program_id(0).to(tl.int64)
    srow = tl.arange(0, S)
    if USE_PDL:
        tl.extra.cuda.gdc_launch_dependents()
        tl.extra.cuda.gdc_wait()
    ss = tl.zeros((S,), tl.float32)
    dt = tl.zeros((S,), tl.float32)
    g = tl.zeros((S, S), tl.float32)
    if UNROLL:  # every chunk's loads may be issued before the first chunk's math
        for c in tl.static_range(C):
            a, b, d = _chunk_partials(prefix_ptr, delta_ptr, blocks_ptr, nw_ptr, qw_ptr, row, c, srow,
                                      sp_m, sd_m, sb_m, sb_r, H, NB, CH, GSPLIT)  # fmt: skip
            ss += a
            dt += b
            g += d
    else:
        for c in range(C):
            a, b, d = _chunk_partials(prefix_ptr, delta_ptr, blocks_ptr, nw_ptr, qw_ptr, row, c, srow,
                                      sp_m, sd_m, sb_m, sb_r, H, NB, CH, GSPLIT)  # fmt: skip
            ss += a
            dt += b
            g += d
    p, rstd = _weights(ss, dt, g, srow, H, NB, eps, out_eps)
    # the prefix columns this program wrote are read back below by other threads
    tl.debug_barrier()
    for c in range(C):
        cols = c * CH + tl.arange(0, CH)
        cmask = cols < H
        t2 = _chunk(prefix_ptr, delta_ptr, blocks_ptr, row, cols, cmask, srow, sp_m, sd_m, sb_m,
                    sb_r, NB, False, True).to(tl.float32)  # fmt: skip
        mixed = tl.sum(p[:, None] * t2, axis=0)
        ow = tl.load(ow_ptr + cols, mask=cmask, other=0.0).to(tl.float32)
        tl.store(out_ptr + row * H + cols, (mixed * rstd * ow).to(out_ptr.dtype.element_ty),
                 mask=cmask)  # fmt: skip


class Workspace:
    """Per-row counters (int32, zero between calls) and fp32 partials for ``rows`` rows of
    up to ``chunks`` column chunks, on ``device``."""

    def __init__(self, device, rows: int = 16, chunks: int = 64):
        self.rows, self.chunks = rows, chunks
        self.counters = torch.zeros(2, rows, dtype=torch.int32, device=device)
        self.scratch = torch.empty(rows * chunks * _REC, dtype=torch.float32, device=device)


_WORKSPACES: dict[tuple[str, int | None], Workspace] = {}


def workspace(device: torch.device, rows: int, chunks: int) -> Workspace:
    """The device's workspace, (re)allocated when too small; RuntimeError inside graph capture."""
    key = (device.type, device.index)
    ws = _WORKSPACES.get(key)
    if ws is None or ws.rows < rows or ws.chunks < chunks:
        if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            raise RuntimeError("attn_res_split: first call with this size inside CUDA-graph capture")
        ws = Workspace(device, max(rows, 16), max(chunks, 64))
        _WORKSPACES[key] = ws
    return ws


@functools.cache
def _pdl_default(device_index: int) -> bool:
    return torch.cuda.get_device_capability(device_index)[0] >= 9


def _check(prefix, delta, blocks, norm_weight, qk_weight, output_norm_weight, num_blocks) -> None:
    if prefix.dim() != 2 or prefix.stride(1) != 1:
        raise ValueError(f"prefix: expected [M, H] with unit column stride, got {tuple(prefix.shape)}")
    m, h = prefix.shape
    if delta.shape != (m, h) or delta.stride(1) != 1:
        raise ValueError(f"delta {tuple(delta.shape)} does not match prefix {(m, h)}")
    if blocks.dim() != 3 or blocks.shape[0] != m or blocks.shape[2] != h or blocks.stride(2) != 1:
        raise ValueError(f"blocks: expected [{m}, R, {h}] with unit column stride, got {tuple(blocks.shape)}")
    if not 1 <= num_blocks <= min(_S - 1, blocks.shape[1]):
        raise ValueError(f"num_blocks {num_blocks} outside 1..{min(_S - 1, blocks.shape[1])}")
    for name, w in (("norm_weight", norm_weight), ("qk_weight", qk_weight),
                    ("output_norm_weight", output_norm_weight)):  # fmt: skip
        if w.shape != (h,) or w.stride(0) != 1:
            raise ValueError(f"{name} {tuple(w.shape)} does not match H={h}")


def _common(prefix, delta, blocks, pdl):
    if pdl is None:
        pdl = prefix.device.type == "cuda" and _pdl_default(prefix.device.index or 0)
    out = torch.empty(prefix.shape, dtype=prefix.dtype, device=prefix.device)
    strides = (prefix.stride(0), delta.stride(0), blocks.stride(0), blocks.stride(1))
    kw = {"launch_pdl": True} if pdl else {}
    return pdl, out, strides, kw


def attn_res_split_last(prefix, delta, blocks, norm_weight, qk_weight, output_norm_weight,
                        num_blocks: int, eps: float, output_norm_eps: float, *, chunk: int = 512,
                        num_warps: int = 4, gsplit: int = 1,
                        pdl: bool | None = None) -> torch.Tensor:  # fmt: skip
    """Grid (M, cdiv(H, chunk)), the row's last program mixes it. ``chunk`` a power of 2."""
    _check(prefix, delta, blocks, norm_weight, qk_weight, output_norm_weight, num_blocks)
    m, h = prefix.shape
    c = triton.cdiv(h, chunk)
    ws = workspace(prefix.device, m, c)
    pdl, out, st, kw = _common(prefix, delta, blocks, pdl)
    _split_last_kernel[(m, c)](prefix, delta, blocks, norm_weight, qk_weight, output_norm_weight, out,
                               ws.scratch, ws.counters[0], *st, eps, output_norm_eps, H=h,
                               NB=num_blocks, CH=chunk, C=c, CP=triton.next_power_of_2(c),
                               GSPLIT=gsplit, USE_PDL=pdl, num_warps=num_warps, **kw)  # fmt: skip
    return out


def attn_res_split_spin(prefix, delta, blocks, norm_weight, qk_weight, output_norm_weight,
                        num_blocks: int, eps: float, output_norm_eps: float, *, chunk: int = 1024,
                        num_warps: int = 4, gsplit: int = 1, pdl: bool | None = None,
                        ablate: int = 0) -> torch.Tensor:  # fmt: skip
    """Grid (M, cdiv(H, chunk)) with a per-row spin barrier; ValueError when M * C > 132 or
    on a CPU tensor (the interpreter cannot run it). ``ablate`` (measurement only, wrong
    output when set): 1 leaves out the barrier and the partials' exchange, 2 the Gram."""
    _check(prefix, delta, blocks, norm_weight, qk_weight, output_norm_weight, num_blocks)
    m, h = prefix.shape
    c = triton.cdiv(h, chunk)
    if m * c > MAX_SPIN_PROGRAMS or prefix.device.type != "cuda":
        raise ValueError(f"spin barrier needs a GPU and M*C <= {MAX_SPIN_PROGRAMS}, got {m}*{c}")
    ws = workspace(prefix.device, m, c)
    pdl, out, st, kw = _common(prefix, delta, blocks, pdl)
    _split_spin_kernel[(m, c)](prefix, delta, blocks, norm_weight, qk_weight, output_norm_weight, out,
                               ws.scratch, ws.counters[0], ws.counters[1], *st, eps,
                               output_norm_eps, H=h, NB=num_blocks, CH=chunk, C=c,
                               CP=triton.next_power_of_2(c), GSPLIT=gsplit, USE_PDL=pdl, ABLATE=ablate,
                               num_warps=num_warps,
                               **kw)  # fmt: skip
    return out


def attn_res_row(prefix, delta, blocks, norm_weight, qk_weight, output_norm_weight,
                 num_blocks: int, eps: float, output_norm_eps: float, *, chunk: int = 1024,
                 num_warps: int = 8, unroll: bool = False, gsplit: int = 1,
                 pdl: bool | None = None) -> torch.Tensor:  # fmt: skip
    """One program per row, two passes over its column chunks (no workspace)."""
    _check(prefix, delta, blocks, norm_weight, qk_weight, output_norm_weight, num_blocks)
    m, h = prefix.shape
    pdl, out, st, kw = _common(prefix, delta, blocks, pdl)
    _row_kernel[(m,)](prefix, delta, blocks, norm_weight, qk_weight, output_norm_weight, out, *st,
                      eps, output_norm_eps, H=h, NB=num_blocks, CH=chunk, C=triton.cdiv(h, chunk),
                      UNROLL=unroll, GSPLIT=gsplit, USE_PDL=pdl, num_warps=num_warps, **kw)  # fmt: skip
    return out


KINDS = {"last": attn_res_split_last, "spin": attn_res_split_spin, "row": attn_res_row}
