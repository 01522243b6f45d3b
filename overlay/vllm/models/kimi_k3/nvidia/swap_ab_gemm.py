# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-k3-overlay project
"""Swap-AB split-K BF16 decode GEMM for Kimi-K3 (vllm-k3-overlay), written in Triton.

``y[M, N] = x[M, K] @ W[N, K]^T (+ residual[M, N])`` for the decode token counts
M = 1..16, bf16 in and out, fp32 accumulation. At these M every Kimi-K3 projection is
bound by streaming ``W`` from HBM (16 FLOP per weight byte at M = 16, far below the
H200's ridge), so the kernel is built to keep enough weight bytes in flight on every SM
and to spend nothing else:

* **swap-AB**: the weight tile is the MMA's M side (``BLOCK_N`` rows of ``W``), the
  tokens its N side (padded to 16, the smallest ``tl.dot`` width; padded rows of ``x``
  are masked loads, so they cost no bandwidth). Triton lowers the dot to ``wgmma`` on
  Hopper and to the tensor-core MMA of whatever GPU it compiles for, Blackwell included:
  nothing here is SM90-specific except where PDL is switched on (below).
* **split-K**: shapes whose ``N / BLOCK_N`` tiles would leave SMs idle (132 on the
  H200) also split K over ``split_k`` CTAs. Each writes its fp32 partial tile to a
  workspace and bumps a per-tile counter; the last CTA to arrive loads the partials
  four at a time and sums them in a fixed order (deterministic), adds the residual,
  writes bf16 and resets the counter to zero, so the workspace never needs clearing
  and the whole GEMM is one launch.
* **ragged rows**: a CTA may own fewer weight rows than its tile (``rows``), so that
  N spreads evenly over the SMs (7168 rows are 112 CTAs of 64 on 132 SMs, or 131 of
  55); the dead rows are masked loads and cost no bandwidth.
* **wide loads, deep pipeline**: 16-byte coalesced weight loads staged through shared
  memory ``num_stages`` deep by Triton's software pipeliner.
* **PDL** (programmatic dependent launch, SM90+): the kernel lets the next kernel
  launch at once and waits (``griddepcontrol.wait``) only before it first reads
  anything a previous kernel may write (``x``, the workspace, ``y``). Before that wait
  it prefetches its first two weight tiles into L2, so the weight stream starts
  while the previous kernel drains.

Why Triton and not the CuTe DSL (issue 12 asks for the CuTe DSL unless a measurement
shows another route vLLM already depends on is better): vLLM depends on Triton; Triton
compiles at run time from this file, so the overlay stays a set of Python files that
needs no bundle to reach the GPU; Triton compiles it for sm_90a on a machine without a
GPU (the PTX shows ``wgmma``, 16-byte ``cp.async`` and ``griddepcontrol.wait`` ahead
of every load of ``x``), and its interpreter runs this very kernel on a CPU, so CI
checks its numerics without a GPU. The measurement, and its limit: one H200 run
(``results/sm90/decode_gemm_sm90.json``, run h200-20261130-figures3, torch 2.11.0,
Triton 3.6.0, read roof 4.196 TB/s) timed this kernel next to cuBLAS, vLLM's CuTe
skinny GEMM (the previous table's 129 CuTe rows, at their tuned configs), ``ll_bf16``
and FlashInfer's ``tinygemm_bf16`` on every SM90 shape x M 1..16: against cuBLAS it is
1.26x geo-mean over the 496 (shape, M), and the SM90 table rendered from that run
routed it on 326 of its 446 rows (401 of 458 on 2026-12-04, the GEMV sweep's and the
F_B shapes' rows since). Where both ran, CuTe was faster on 75 of the 129 rows
(69 of them at M <= 5; up to 108% of the roof), so the table keeps CuTe there. Over
that run's timings of this kernel (every shape under 130 MB, M = 1, 8, 16) its time
fits ``1.8 µs + bytes / 4.34 TB/s`` without split-K and ``3.5 µs + bytes / 4.38 TB/s``
with it: the fixed part, not the stream, keeps 22-61 MB weights under 90% of the roof.
The CuTe DSL kernel of ours that would remove split-K's part of it, a swap-AB
``mma.sync`` kernel whose split-K is reduced through a thread-block cluster's
distributed shared memory (``k3lab/experiments/cute_cluster.py``, an experiment, not
routed), was timed next to this kernel at the SM90 table's configs in the same H200
runs (``results/cute_cluster/``, runs h200-20261130-cute2 and -cute3, every
output checked against float64) on the four split-K shapes 1536/2112/3072/768x7168 at
M = 1, 8, 16: at its best it matched this kernel on 3072x7168 (13.4-13.9 µs against
13.5-13.9) and was slower on the other three (1536x7168 8.5-8.8 µs against 8.2-8.6,
2112x7168 11.6-11.9 against 9.9-10.2, 768x7168 7.2-7.5 against 6.2-6.3). So the route
stays Triton, which vLLM already depends on, on that measurement and for the reasons
above.

Concurrency: the split-K workspace is private to a (device, stream) pair, so GEMMs on
different streams (or different branches of a captured graph) never share counters;
calls on one stream are ordered by the stream itself (with PDL, by the wait above).
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import torch

from vllm.triton_utils import tl, triton

# Token counts the kernel serves; the dot's N side is padded to this (tl.dot needs >= 16).
MAX_TOKENS = 16


class SwapAbConfig(NamedTuple):
    """Compile-time tile of the swap-AB kernel plus the run-time K split.

    Attributes:
        block_n: weight rows per CTA (the MMA's M side): 16, 32, 64 or 128.
        block_k: K elements per pipeline stage (multiple of 64).
        split_k: CTAs sharing one ``block_n`` tile along K (1 = no split-K).
        num_warps: warps per CTA.
        num_stages: software-pipeline depth (shared-memory stages).
        rows: weight rows each CTA owns, 1..``block_n`` (0 = ``block_n``). Fewer rows
            than the tile spread N over more CTAs, so a grid that would leave SMs idle
            (N = 7168 in 64-row tiles is 112 CTAs on 132 SMs) fills them evenly; the
            tile's rows past ``rows`` are masked, so they cost no bandwidth.
    """

    block_n: int
    block_k: int
    split_k: int
    num_warps: int
    num_stages: int
    rows: int = 0


def config_error(config: SwapAbConfig, n: int, k: int) -> str | None:
    """Why ``config`` cannot run a ``[M, k] x [n, k]^T`` GEMM; None if it can.

    ``k`` must be a multiple of 8 (16-byte rows); ``block_n`` one of 16, 32, 64, 128;
    ``block_k`` a power of two >= 64; ``split_k`` at least 1 and at most the number of
    ``block_k`` tiles of ``k``, so that no split is left without work; ``rows`` 0 or
    1..``block_n``.
    """
    bn, bk, split, warps, stages, rows = config
    if n < 1 or k < 1:
        return f"empty weight {n}x{k}"
    if k % 8:
        return f"K={k} is not a multiple of 8 (16-byte rows)"
    if bn not in (16, 32, 64, 128):
        return f"block_n={bn} not in (16, 32, 64, 128)"
    if bk < 64 or bk & (bk - 1):
        return f"block_k={bk} is not a power of two >= 64"
    if warps not in (1, 2, 4, 8) or stages < 1:
        return f"num_warps={warps} / num_stages={stages} out of range"
    if not 0 <= rows <= bn:
        return f"rows={rows} outside 0..{bn} (block_n)"
    tiles = triton.cdiv(k, bk)
    if not 1 <= split <= tiles:
        return f"split_k={split} outside 1..{tiles} (K tiles of {bk})"
    if triton.cdiv(tiles, triton.cdiv(tiles, split)) != split:
        return f"split_k={split} leaves a split without K tiles"
    return None


# M, the split and the rows per CTA are run-time values: one compiled kernel serves them all.
@triton.jit(do_not_specialize=["M", "tiles_per_split", "split_k", "ROWS"])
def _swap_ab_kernel(
    x_ptr,
    w_ptr,
    y_ptr,
    r_ptr,
    part_ptr,
    cnt_ptr,
    M,
    N,
    K,
    stride_xm,
    tiles_per_split,
    split_k,
    ROWS,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    BLOCK_M: tl.constexpr,
    EVEN_K: tl.constexpr,
    HAS_RESIDUAL: tl.constexpr,
    USE_PDL: tl.constexpr,
    RAGGED: tl.constexpr,
):
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    offs_n = pid_n * ROWS + tl.arange(0, BLOCK_N)
    # This CTA's rows end here (the store's bound): the next CTA's start, or N.
    n_hi = tl.minimum(pid_n * ROWS + ROWS, N)
    # Clamped rows: the last tile re-reads a live row instead of masking every weight
    # load (N is not always a multiple of BLOCK_N: 3216, 6288, 12448). A ragged tile
    # (ROWS < BLOCK_N) masks its dead rows instead: clamping would re-read a row there.
    rows = tl.minimum(offs_n, n_hi - 1)
    w_live = (offs_n < n_hi)[:, None] if RAGGED else None
    offs_m = tl.arange(0, BLOCK_M)
    offs_k = tl.arange(0, BLOCK_K)
    k_lo = pid_k * tiles_per_split * BLOCK_K
    k_hi = tl.minimum(k_lo + tiles_per_split * BLOCK_K, K)
    w_ptrs = w_ptr + rows[:, None].to(tl.int64) * K + (k_lo + offs_k)[None, :]
    x_ptrs = x_ptr + offs_m[:, None] * stride_xm + (k_lo + offs_k)[None, :]
    m_ok = offs_m[:, None] < M

    if USE_PDL:
        # The weight is no other kernel's output: pull this CTA's first two K tiles
        # into L2 (one address per 128-byte line) before waiting for the previous
        # kernel. Addresses past the slice are clamped onto its last element.
        lines = tl.arange(0, 2 * BLOCK_K // 64)
        cols = tl.minimum(k_lo + lines * 64, K - 1)
        pf = w_ptr + rows[:, None].to(tl.int64) * K + cols[None, :]
        tl.inline_asm_elementwise(
            "prefetch.global.L2 [$1]; // $0",
            "=r,l",
            [pf],
            dtype=tl.int32,
            is_pure=False,
            pack=1,
        )
        tl.extra.cuda.gdc_launch_dependents()
        tl.extra.cuda.gdc_wait()

    acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
    for k in range(k_lo, k_hi, BLOCK_K):
        if EVEN_K:
            if RAGGED:
                w = tl.load(w_ptrs, mask=w_live, other=0.0)
            else:
                w = tl.load(w_ptrs)
            x = tl.load(x_ptrs, mask=m_ok, other=0.0)
        else:
            k_ok = (k + offs_k) < K
            w_ok = k_ok[None, :] & w_live if RAGGED else k_ok[None, :]
            w = tl.load(w_ptrs, mask=w_ok, other=0.0)
            x = tl.load(x_ptrs, mask=m_ok & k_ok[None, :], other=0.0)
        acc = tl.dot(w, tl.trans(x), acc)
        w_ptrs += BLOCK_K
        x_ptrs += BLOCK_K

    if split_k == 1:
        _store_tile(y_ptr, r_ptr, acc, offs_n, offs_m, M, N, n_hi, HAS_RESIDUAL)
    else:
        tile = tl.arange(0, BLOCK_N)[:, None] * BLOCK_M + offs_m[None, :]
        tile_base = part_ptr + pid_n * split_k * (BLOCK_N * BLOCK_M)
        tl.store(tile_base + pid_k * (BLOCK_N * BLOCK_M) + tile, acc)
        # Every thread's partial is stored before one thread publishes the arrival.
        tl.debug_barrier()
        arrived = tl.atomic_add(cnt_ptr + pid_n, 1, sem="acq_rel", scope="gpu")
        if arrived == split_k - 1:
            # Four partials per round, all in flight at once: one load per split, each
            # waiting on the last one's add, cost one L2 round trip per split (measured
            # on the H200: 5.08 -> 4.62 µs at 14 splits, no change at 2-8).
            total = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
            for s0 in range(0, split_k, 4):
                at = tile * 0 + s0  # a tensor mask below: the interpreter refuses a scalar one
                p = tile_base + s0 * (BLOCK_N * BLOCK_M) + tile
                p0 = tl.load(p, cache_modifier=".cg")
                p1 = tl.load(p + BLOCK_N * BLOCK_M, mask=at + 1 < split_k, other=0.0,
                             cache_modifier=".cg")
                p2 = tl.load(p + 2 * BLOCK_N * BLOCK_M, mask=at + 2 < split_k, other=0.0,
                             cache_modifier=".cg")
                p3 = tl.load(p + 3 * BLOCK_N * BLOCK_M, mask=at + 3 < split_k, other=0.0,
                             cache_modifier=".cg")
                total += (p0 + p1) + (p2 + p3)
            # Ready for the next launch on this stream: the workspace is never cleared.
            tl.atomic_xchg(cnt_ptr + pid_n, 0, sem="relaxed", scope="gpu")
            _store_tile(y_ptr, r_ptr, total, offs_n, offs_m, M, N, n_hi, HAS_RESIDUAL)


@triton.jit
def _store_tile(y_ptr, r_ptr, acc, offs_n, offs_m, M, N, n_hi, HAS_RESIDUAL: tl.constexpr):
    """``y[m, n] = acc[n, m] (+ r[m, n])`` for the tile's rows n < n_hi and tokens m < M."""
    ptrs = offs_m[None, :] * N + offs_n[:, None]
    ok = (offs_m[None, :] < M) & (offs_n[:, None] < n_hi)
    if HAS_RESIDUAL:
        acc += tl.load(r_ptr + ptrs, mask=ok, other=0.0).to(tl.float32)
    tl.store(y_ptr + ptrs, acc.to(y_ptr.dtype.element_ty), mask=ok)


class _Workspace(NamedTuple):
    partials: torch.Tensor  # fp32, one BLOCK_N x 16 tile per (N tile, split)
    counters: torch.Tensor  # int32, one per N tile, zero between launches


# (device index, stream id) -> workspace. Buffers are never freed: a CUDA graph that
# captured one keeps using its address after a larger one replaced it here.
_WORKSPACES: dict[tuple[int, int], _Workspace] = {}
_RETIRED: list[_Workspace] = []


def _workspace(device: torch.device, floats: int, tiles: int) -> _Workspace:
    """Split-K workspace of at least ``floats`` fp32 and ``tiles`` counters."""
    stream = torch.cuda.current_stream(device)
    key = (device.index or 0, stream.stream_id)
    ws = _WORKSPACES.get(key)
    if ws is None or ws.partials.numel() < floats or ws.counters.numel() < tiles:
        if ws is not None:
            _RETIRED.append(ws)
        old_f = 0 if ws is None else ws.partials.numel()
        old_t = 0 if ws is None else ws.counters.numel()
        ws = _Workspace(
            torch.empty(max(floats, old_f, 1 << 16), dtype=torch.float32, device=device),
            torch.zeros(max(tiles, old_t, 1024), dtype=torch.int32, device=device),
        )
        _WORKSPACES[key] = ws
    return ws


@functools.cache
def _use_pdl(device_index: int) -> bool:
    # griddepcontrol exists from SM90 on; Triton launches with the PDL attribute only
    # when asked, and the kernel's wait is a no-op without it.
    return torch.cuda.get_device_capability(device_index)[0] >= 9


def grid_of(config: SwapAbConfig, n: int, k: int) -> tuple[int, int, int]:
    """``(N tiles, splits, K tiles per split)`` of one launch; a tile is ``rows_of`` rows."""
    tiles = triton.cdiv(k, config.block_k)
    per_split = triton.cdiv(tiles, config.split_k)
    return triton.cdiv(n, rows_of(config)), triton.cdiv(tiles, per_split), per_split


def rows_of(config: SwapAbConfig) -> int:
    """Weight rows one CTA owns: ``config.rows``, or ``block_n`` when that is 0."""
    return config.rows or config.block_n


def _launch(
    x: torch.Tensor,
    weight: torch.Tensor,
    y: torch.Tensor,
    residual: torch.Tensor | None,
    mnk: tuple[int, int, int],
    config: SwapAbConfig,
    pdl: bool | None,
    warmup: bool,
) -> None:
    """Launch (or, with ``warmup``, only compile) the kernel for ``y = x @ weight.T``."""
    m, n, k = mnk
    n_tiles, splits, per_split = grid_of(config, n, k)
    floats = n_tiles * splits * config.block_n * MAX_TOKENS if splits > 1 else 0
    if x.device.type == "cuda":
        # Typed buffers even when unused: the kernel is compiled once for every split.
        partials, counters = _workspace(x.device, floats, n_tiles)
    else:  # Triton's interpreter (TRITON_INTERPRET=1) on the CPU
        partials = torch.empty(max(floats, 1))
        counters = torch.zeros(n_tiles, dtype=torch.int32)
    if pdl is None:
        pdl = x.device.type == "cuda" and _use_pdl(x.device.index or 0)
    args = (x, weight, y, x if residual is None else residual, partials, counters)
    args += (m, n, k, row_stride(x), per_split, splits, rows_of(config))
    kwargs = dict(
        BLOCK_N=config.block_n,
        BLOCK_K=config.block_k,
        BLOCK_M=MAX_TOKENS,
        EVEN_K=k % config.block_k == 0,
        HAS_RESIDUAL=residual is not None,
        USE_PDL=pdl,
        RAGGED=rows_of(config) < config.block_n,
        num_warps=config.num_warps,
        num_stages=config.num_stages,
    )
    if pdl:
        kwargs["launch_pdl"] = True
    if warmup:
        _swap_ab_kernel.warmup(*args, grid=(n_tiles, splits), **kwargs)
    else:
        _swap_ab_kernel[(n_tiles, splits)](*args, **kwargs)


def row_stride(t: torch.Tensor) -> int:
    """The row stride a kernel of this family is launched with: ``t``'s own, or its width for
    one row, whose stride is never used (so a one-row view keys the kernel as a packed
    tensor of its shape would: Triton specializes an int on the value 1 and on divisibility
    by 16)."""
    return t.stride(0) if t.shape[0] > 1 else t.shape[1]


def x_error(x: torch.Tensor) -> str | None:
    """Why the kernel would not read ``x`` (``[M, K]``); None if it would: unit column
    stride and a row stride of at least K, a multiple of 16 elements exactly when K is
    (Triton specializes on that divisibility, and the warm-up compiles with the stride K),
    e.g. KDA's F_A, the ``[M, 128]`` slice of the packed projection's ``[M, 6288]`` output."""
    if x.dim() != 2:
        return f"x must be 2-D, got {x.dim()}-D"
    if x.stride(1) != 1:
        return "x needs unit column stride"
    rows, k = x.shape
    if rows > 1 and (x.stride(0) < k or (x.stride(0) % 16 == 0) != (k % 16 == 0)):
        return f"x's row stride {x.stride(0)} is below K={k} or not a multiple of 16 as K is"
    if rows > 1 and x.stride(0) * (rows - 1) + k >= 2**31:  # 32-bit offsets, one compiled type
        return f"x's row stride {x.stride(0)} spans 2^31 elements or more"
    return None


def _check(m: int, n: int, k: int, config: SwapAbConfig) -> None:
    if not 1 <= m <= MAX_TOKENS:
        raise ValueError(f"M={m} outside 1..{MAX_TOKENS}")
    why = config_error(config, n, k)
    if why:
        raise ValueError(f"swap-AB config {tuple(config)} for {n}x{k}: {why}")


def swap_ab_gemm(
    x: torch.Tensor,
    weight: torch.Tensor,
    config: SwapAbConfig,
    residual: torch.Tensor | None = None,
    *,
    pdl: bool | None = None,
) -> torch.Tensor:
    """``x @ weight.T (+ residual)`` as a new bf16 ``[M, N]`` tensor.

    Args:
        x: activation ``[M, K]``, bf16, 1 <= M <= 16, rows as :func:`x_error` takes them
            (packed, or a row-strided slice).
        weight: ``[N, K]``, bf16, packed row-major, on ``x``'s device.
        config: the tile and split (see :func:`config_error`).
        residual: optional bf16 ``[M, N]`` packed tensor added before rounding.
        pdl: launch with PDL; by default on SM90 and newer.

    Raises:
        ValueError: M outside 1..16, mismatched K, an ``x`` :func:`x_error` refuses, or
            a config that cannot run.
    """
    m, k = x.shape
    if weight.shape[1] != k:
        raise ValueError(f"x has K={k}, weight {tuple(weight.shape)}")
    why = x_error(x)
    if why:
        raise ValueError(why)
    _check(m, weight.shape[0], k, config)
    y = torch.empty((m, weight.shape[0]), dtype=x.dtype, device=x.device)
    _launch(x, weight, y, residual, (m, weight.shape[0], k), config, pdl, warmup=False)
    return y


def warmup(
    config: SwapAbConfig,
    n: int,
    k: int,
    device: torch.device,
    *,
    has_residual: bool = False,
) -> None:
    """Compile the kernel an ``[M, k] x [n, k]^T`` call at ``config`` needs, launching nothing.

    Call before CUDA-graph capture: Triton compiles on a kernel's first launch, and
    what it compiles depends only on ``config``, whether K is a multiple of
    ``block_k``, the divisibility of ``n`` and ``k`` by 16, the residual and PDL (x's
    row stride is compiled as K's: :func:`x_error` admits only strides keyed alike).

    Raises:
        ValueError: for a config that cannot run ``n x k``.
    """
    _check(1, n, k, config)
    # Stand-ins of the right dtype and alignment; only their types reach the compiler.
    x = torch.empty(8, dtype=torch.bfloat16, device=device)
    _launch(x, x, x, x if has_residual else None, (1, n, k), config, None, warmup=True)
