# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-k3-overlay project
"""PDL-aware skinny BF16 decode GEMM (GEMV style) for Kimi-K3 (vllm-k3-overlay), in Triton.

``y[M, N] = x[M, K] @ W[N, K]^T (+ residual[M, N])`` for the smallest decode token counts,
M = 1..16 (meant for M <= 4, where it is timed), bf16 in and out, fp32 accumulation.

Operands: ``x`` (M, K) and ``W`` (N, K) packed row-major bf16 (row stride K, unit column
stride) on one CUDA device, K a multiple of 8 (16-byte rows); ``residual``, when given,
(M, N) packed bf16 on that device. Errors: :class:`ValueError` for M outside 1..16, a K
mismatch or a config :func:`config_error` rejects (the backend checks these before it
calls, so the dispatch never sees them). Times: µs; sizes: elements unless said bytes.

Why this kernel (issue 28, item 1). The SM90 table had to choose, at M <= 4, between
vLLM's CuTe skinny GEMM (fast alone: 768x7168 in 4.18 µs at M = 1, but it does not use
programmatic dependent launch, so in a decode step it ends the overlap of the PDL-aware
kernels around it) and our swap-AB GEMM (PDL-aware, but a fixed cost of about 1.8 µs,
3.5 µs with its split-K reduction: 768x7168 in 6.19 µs). The winners' chain penalty
(``k3lab/bench/decode_gemm/winners.py``) traded M = 1 away to keep PDL. This kernel is
meant to be both, so that the table decides on one measure:

* **no tensor cores**: at M <= 4 a ``tl.dot`` pads the tokens to 16 and pays a shared
  memory staging and an MMA pipeline for 1/16 of useful work. Here each CTA owns
  ``block_n`` whole weight rows and all M tokens and computes dot products: fp32 FMAs
  of a 16-byte vector of W against the same K slice of each token, then one reduction
  over K per token at the end of each chunk (``tl.sum``). The idea is that of the CuTe
  skinny GEMM and of TensorRT-LLM's tinygemm2 (read, not copied).
* **the weight stream does not wait**: the kernel triggers its dependents first
  (``griddepcontrol.launch_dependents``), then issues the loads of its first weight chunk
  (the weight is a parameter: no kernel writes it) and only then waits
  (``griddepcontrol.wait``) before reading ``x``, the residual and the split-K workspace,
  which the previous kernel may write. With ``block_k >= K`` that first chunk is the
  CTA's whole weight slice, held in registers while the previous kernel drains: the
  whole stream overlaps the wait. ``tests/kernels/test_kimi_k3_fused_ptx.py`` checks
  that order in the sm_90a PTX.
* **fill the chip with rows, not with a second launch**: N / ``block_n`` CTAs (768 rows
  in 1-4 row blocks are 192-768 CTAs on 132 SMs, several resident per SM). A shape with
  too few rows for that (144x7168) may split K over ``split_k`` CTAs; their partials are
  reduced inside the same launch: fp32 atomics into a zeroed per-stream workspace and a
  per-tile counter, the last CTA to arrive swaps the sums out (leaving zeros for the next
  launch), adds the residual and stores bf16. That sum's order is the arrival order, so
  split-K results may differ in the last bits from run to run; ``split_k = 1`` is
  deterministic.
* **two chunks in flight**: where K takes several chunks, each next chunk's loads are
  issued before the current chunk's FMAs (a register double buffer).
* **16-byte loads**: K is contiguous in W and x; Triton vectorises a chunk's loads to
  16 bytes where K is a multiple of 16 (it specialises on that) and the pointers are
  16-byte aligned (the backend checks). Rows past N are clamped onto row N - 1 (a
  re-read, not a masked lane), K past the end is masked (no bytes read).

Meta-parameters (:class:`SkinnyPdlConfig`): ``block_n`` rows per CTA, ``block_k``
elements of K per chunk (a power of two; ``block_k >= K`` preloads the whole slice),
``split_k``, ``num_warps``, ``num_stages``. Measured (H200, 2026-12-03, run h200-20261203,
``k3lab/bench/skinny_pdl_sweep.py``: ``git show a6fa211:results/sm90/skinny_pdl_sweep_sm90.json``,
removed when the gemv_pdl sweep of 2026-12-04 re-timed its rows): faster
alone than every other backend only where K or N x K is small (K = 128: 0.85-1.30 µs against
CuTe's 1.60-1.97; q_b_proj 1152x1536 at M = 1, 2: 2.02 / 2.92 µs against swap-AB's 4.10) and
on 768x7168 at M = 1 (5.82 against swap-AB's 6.25; CuTe 4.15 but not PDL-aware); slower than
CuTe on the large-K shapes at every M, and by far at M >= 2 (one block reduction per token
per chunk).

Concurrency: the split-K workspace is private to a (device, stream) pair, as in
``swap_ab_gemm``; calls on one stream are ordered by the stream (with PDL, by the wait).
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import torch

from vllm.triton_utils import tl, triton

#: Largest M the kernel takes (its token loop is unrolled to the next power of two of M).
MAX_TOKENS = 16
BLOCK_N_CHOICES = (1, 2, 4, 8, 16)
MAX_BLOCK_K = 16384


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def _next_pow2(a: int) -> int:
    # Host arithmetic of our own: config checks run where vLLM's Triton is a placeholder.
    return 1 << max(a - 1, 0).bit_length()


class SkinnyPdlConfig(NamedTuple):
    """Compile-time tile of the skinny PDL kernel plus the run-time K split.

    Attributes:
        block_n: weight rows per CTA: 1, 2, 4, 8 or 16.
        block_k: K elements per chunk, a power of two 64..16384; a chunk >= K is the
            CTA's whole slice, loaded before the wait.
        split_k: CTAs sharing one row block along K (1 = none), each with a whole
            number of chunks, none empty.
        num_warps: warps per CTA, 1, 2, 4 or 8.
        num_stages: Triton's software-pipeline depth for the chunk loop (1..8).
    """

    block_n: int
    block_k: int
    split_k: int = 1
    num_warps: int = 4
    num_stages: int = 1


def config_error(config: SkinnyPdlConfig, n: int, k: int) -> str | None:
    """Why ``config`` cannot run a ``[M, k] x [n, k]^T`` GEMM; None if it can."""
    if len(config) != 5:
        return f"a skinny_pdl config has 5 fields, got {len(config)}"
    bn, bk, split, warps, stages = config
    if n < 1 or k < 1:
        return f"empty weight {n}x{k}"
    if k % 8:
        return f"K={k} is not a multiple of 8 (16-byte rows)"
    if bn not in BLOCK_N_CHOICES:
        return f"block_n={bn} not in {BLOCK_N_CHOICES}"
    if not 64 <= bk <= MAX_BLOCK_K or bk & (bk - 1):
        return f"block_k={bk} is not a power of two in 64..{MAX_BLOCK_K}"
    if warps not in (1, 2, 4, 8) or not 1 <= stages <= 8:
        return f"num_warps={warps} / num_stages={stages} out of range"
    chunks = _cdiv(k, bk)
    if not 1 <= split <= chunks:
        return f"split_k={split} outside 1..{chunks} (K chunks of {bk})"
    if _cdiv(chunks, _cdiv(chunks, split)) != split:
        return f"split_k={split} leaves a split without K chunks"
    return None


def grid_of(config: SkinnyPdlConfig, n: int, k: int) -> tuple[int, int, int]:
    """``(row blocks, splits, K elements per split)`` of one launch."""
    chunks = _cdiv(k, config.block_k)
    per_split = _cdiv(chunks, config.split_k)
    splits = _cdiv(chunks, per_split)
    return _cdiv(n, config.block_n), splits, per_split * config.block_k


#: Bytes of weight one thread may hold per chunk (64 registers): the cap the sweep's
#: grid keeps to, choosing 8 warps over 4 where a chunk needs it.
SWEEP_BYTES_PER_THREAD = 256
#: CTAs below which the sweep also tries split-K: two per SM of the H200's 132.
SWEEP_MIN_CTAS = 264


def sweep_configs(n: int, k: int) -> list[SkinnyPdlConfig]:
    """The configs the H200 sweep times for an (N, K) weight (and the GPU tests check).

    ``block_n`` 1, 2, 4, 8; ``block_k`` either the whole K (the next power of two: the
    slice is loaded before the wait) or 2048-element chunks; 4 warps, or 8 where a chunk
    would hold more than :data:`SWEEP_BYTES_PER_THREAD` bytes of W per thread at 4 (and
    none where 8 would too), plus one-row blocks of the whole slice at 8 warps, and for
    K <= 512 fewer warps and 16-row blocks; split-K added only where the rows alone give
    fewer than :data:`SWEEP_MIN_CTAS` CTAs. Every N and K of the Kimi-K3 table is a
    multiple of 16, so a config is one Triton build per power of two of M whatever the
    shape (126 builds at M 1..4): the grid is kept small because each build costs about
    a second of compile.
    """
    out: list[SkinnyPdlConfig] = []
    whole = _next_pow2(k)
    for bn in (1, 2, 4, 8):
        for bk in sorted({min(whole, MAX_BLOCK_K), min(whole, 2048)}):
            if bk < 64 or bk * _cdiv(k, bk) < k:
                continue
            warps = next((w for w in (4, 8) if bn * bk * 2 <= SWEEP_BYTES_PER_THREAD * 32 * w),
                         None)  # fmt: skip
            if warps is None:
                continue
            splits = [1]
            chunks, blocks = _cdiv(k, bk), _cdiv(n, bn)
            if blocks < SWEEP_MIN_CTAS and chunks > 1:
                want = min(chunks, _cdiv(SWEEP_MIN_CTAS, blocks))
                splits.append(_cdiv(chunks, _cdiv(chunks, want)))
            for split in dict.fromkeys(splits):
                cfg = SkinnyPdlConfig(bn, bk, split, warps, 1)
                if config_error(cfg, n, k) is None:
                    out.append(cfg)
    # One row per CTA, the whole slice, twice the threads: half the bytes per thread in
    # flight, for shapes with few rows per SM (144 or 768 rows on 132 SMs).
    one_row = SkinnyPdlConfig(1, min(whole, MAX_BLOCK_K), 1, 8, 1)
    if whole >= 1024 and one_row not in out and config_error(one_row, n, k) is None:
        out.append(one_row)
    # Short rows (K <= 512): as few warps as give every thread a 16-byte vector (4 warps
    # would leave most idle), and 16-row blocks.
    if whole <= 512:
        for bn in (1, 2, 4, 8, 16):
            warps = max(1, min(4, bn * whole // (8 * 32)))
            cfg = SkinnyPdlConfig(bn, whole, 1, warps, 1)
            if cfg not in out and config_error(cfg, n, k) is None:
                out.append(cfg)
    return out


@triton.jit
def _fma_chunk(acc, w, x_ptr, offs_k, k_ok, M, K, BLOCK_M: tl.constexpr):
    """``acc[m, :] += sum_k w[:, k] * x[m, k]`` for the tokens m < M of one K chunk."""
    wf = w.to(tl.float32)
    offs_m = tl.arange(0, BLOCK_M)
    for m in tl.static_range(BLOCK_M):
        # A tensor mask (the interpreter refuses a scalar one); rows past M read nothing.
        xm = tl.load(x_ptr + m * K + offs_k, mask=k_ok & (offs_k * 0 + m < M), other=0.0)
        part = tl.sum(wf * xm.to(tl.float32)[None, :], axis=1)
        acc = tl.where(offs_m[:, None] == m, acc + part[None, :], acc)
    return acc


# M and the split are run-time values: one build serves every M of one power of two.
@triton.jit(do_not_specialize=["M", "chunks_per_split"])
def _skinny_pdl_kernel(
    x_ptr,
    w_ptr,
    y_ptr,
    r_ptr,
    acc_ptr,
    cnt_ptr,
    M,
    N,
    K,
    chunks_per_split,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    BLOCK_M: tl.constexpr,
    SPLIT: tl.constexpr,
    HAS_RESIDUAL: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    if USE_PDL:
        # Nothing of the next kernel depends on this one before its own wait: let it launch.
        tl.extra.cuda.gdc_launch_dependents()
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rows = tl.minimum(offs_n, N - 1)  # clamped: the last block re-reads row N - 1
    offs_k = tl.arange(0, BLOCK_K)
    # A product of BLOCK_K: Triton knows k_lo is a multiple of 8 (16-byte aligned rows).
    k_lo = pid_k * chunks_per_split * BLOCK_K
    k_hi = tl.minimum(k_lo + chunks_per_split * BLOCK_K, K)
    w_rows = w_ptr + rows[:, None].to(tl.int64) * K
    # The first chunk of W before the wait: no kernel writes the weight. A split holds
    # whole chunks, so only K itself bounds a chunk: a mask whose 8-element groups
    # Triton can prove uniform (K is specialised as a multiple of 16), hence 16-byte loads.
    kk = k_lo + offs_k
    k_ok = kk < K
    w = tl.load(w_rows + kk[None, :], mask=k_ok[None, :], other=0.0)
    if USE_PDL:
        # x, the residual and the workspace may be the previous kernel's output.
        tl.extra.cuda.gdc_wait()
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    # Two chunks in flight: the next chunk's loads are issued before this one's FMAs and
    # reductions, so its HBM latency hides behind them (registers, not shared memory).
    for k in range(k_lo + BLOCK_K, k_hi, BLOCK_K):
        kk_next = k + offs_k
        w_next = tl.load(w_rows + kk_next[None, :], mask=(kk_next < K)[None, :], other=0.0)
        acc = _fma_chunk(acc, w, x_ptr, kk, k_ok, M, K, BLOCK_M)
        w, kk, k_ok = w_next, kk_next, kk_next < K
    acc = _fma_chunk(acc, w, x_ptr, kk, k_ok, M, K, BLOCK_M)

    offs_m = tl.arange(0, BLOCK_M)
    out = offs_m[:, None] * N + offs_n[None, :]
    ok = (offs_m[:, None] < M) & (offs_n[None, :] < N)
    if SPLIT:
        tile = acc_ptr + pid_n * (BLOCK_M * BLOCK_N)
        cell = offs_m[:, None] * BLOCK_N + tl.arange(0, BLOCK_N)[None, :]
        tl.atomic_add(tile + cell, acc, sem="relaxed", scope="gpu")
        # Every thread's adds are issued before one thread publishes the arrival.
        tl.debug_barrier()
        arrived = tl.atomic_add(cnt_ptr + pid_n, 1, sem="acq_rel", scope="gpu")
        if arrived == tl.num_programs(1) - 1:
            # Read the sums from L2 (every other CTA's adds came before its arrival) and
            # leave zeros: the workspace is never cleared between launches. The next
            # launch's adds come after its own wait, hence after this grid has finished.
            total = tl.load(tile + cell, cache_modifier=".cg")
            tl.store(tile + cell, tl.zeros_like(acc), cache_modifier=".cg")
            tl.atomic_xchg(cnt_ptr + pid_n, 0, sem="relaxed", scope="gpu")
            if HAS_RESIDUAL:
                total += tl.load(r_ptr + out, mask=ok, other=0.0).to(tl.float32)
            tl.store(y_ptr + out, total.to(y_ptr.dtype.element_ty), mask=ok)
    else:
        if HAS_RESIDUAL:
            acc += tl.load(r_ptr + out, mask=ok, other=0.0).to(tl.float32)
        tl.store(y_ptr + out, acc.to(y_ptr.dtype.element_ty), mask=ok)


class _Workspace(NamedTuple):
    sums: torch.Tensor  # fp32, one BLOCK_M x BLOCK_N tile per row block, zero between launches
    counters: torch.Tensor  # int32, one per row block, zero between launches


# (device index, stream id) -> workspace. Never freed: a captured graph keeps its address.
_WORKSPACES: dict[tuple[int, int], _Workspace] = {}
_RETIRED: list[_Workspace] = []


def _workspace(device: torch.device, floats: int, tiles: int) -> _Workspace:
    """Zeroed split-K workspace of at least ``floats`` fp32 and ``tiles`` counters."""
    stream = torch.cuda.current_stream(device)
    key = (device.index or 0, stream.stream_id)
    ws = _WORKSPACES.get(key)
    if ws is None or ws.sums.numel() < floats or ws.counters.numel() < tiles:
        if ws is not None:
            _RETIRED.append(ws)
        old_f = 0 if ws is None else ws.sums.numel()
        old_t = 0 if ws is None else ws.counters.numel()
        ws = _Workspace(
            torch.zeros(max(floats, old_f, 1 << 14), dtype=torch.float32, device=device),
            torch.zeros(max(tiles, old_t, 1024), dtype=torch.int32, device=device),
        )
        _WORKSPACES[key] = ws
    return ws


@functools.cache
def _use_pdl(device_index: int) -> bool:
    # griddepcontrol exists from SM90 on; without the launch attribute the wait is a no-op.
    return torch.cuda.get_device_capability(device_index)[0] >= 9


def block_m_of(m: int) -> int:
    """The token loop's length for M = ``m``: the next power of two (one build per)."""
    return _next_pow2(m)


def _launch(x, weight, y, residual, mnk, config: SkinnyPdlConfig, pdl, warmup: bool) -> None:
    m, n, k = mnk
    blocks, splits, per_split = grid_of(config, n, k)
    block_m = block_m_of(m)
    floats = blocks * block_m * config.block_n if splits > 1 else 0
    if x.device.type == "cuda":
        sums, counters = _workspace(x.device, floats, blocks)
    else:  # Triton's interpreter (TRITON_INTERPRET=1) on the CPU
        sums = torch.zeros(max(floats, 1))
        counters = torch.zeros(blocks, dtype=torch.int32)
    if pdl is None:
        pdl = x.device.type == "cuda" and _use_pdl(x.device.index or 0)
    args = (x, weight, y, x if residual is None else residual, sums, counters, m, n, k,
            per_split // config.block_k)
    kwargs = dict(
        BLOCK_N=config.block_n,
        BLOCK_K=config.block_k,
        BLOCK_M=block_m,
        SPLIT=splits > 1,
        HAS_RESIDUAL=residual is not None,
        USE_PDL=pdl,
        num_warps=config.num_warps,
        num_stages=config.num_stages,
    )
    if pdl:
        kwargs["launch_pdl"] = True
    if warmup:
        _skinny_pdl_kernel.warmup(*args, grid=(blocks, splits), **kwargs)
    else:
        _skinny_pdl_kernel[(blocks, splits)](*args, **kwargs)


def _check(m: int, n: int, k: int, config: SkinnyPdlConfig) -> None:
    if not 1 <= m <= MAX_TOKENS:
        raise ValueError(f"M={m} outside 1..{MAX_TOKENS}")
    why = config_error(config, n, k)
    if why:
        raise ValueError(f"skinny_pdl config {tuple(config)} for {n}x{k}: {why}")


def skinny_pdl_gemm(
    x: torch.Tensor,
    weight: torch.Tensor,
    config: SkinnyPdlConfig,
    residual: torch.Tensor | None = None,
    *,
    pdl: bool | None = None,
) -> torch.Tensor:
    """``x @ weight.T (+ residual)`` as a new bf16 ``[M, N]`` tensor.

    Args:
        x: activation ``[M, K]``, bf16, packed row-major, 1 <= M <= 16.
        weight: ``[N, K]``, bf16, packed row-major, on ``x``'s device.
        config: the tile and split (see :func:`config_error`).
        residual: optional bf16 ``[M, N]`` packed tensor added before rounding.
        pdl: launch with PDL; by default on SM90 and newer.

    Raises:
        ValueError: M outside 1..16, mismatched K, or a config that cannot run.
    """
    m, k = x.shape
    if weight.shape[1] != k:
        raise ValueError(f"x has K={k}, weight {tuple(weight.shape)}")
    _check(m, weight.shape[0], k, config)
    y = torch.empty((m, weight.shape[0]), dtype=x.dtype, device=x.device)
    _launch(x, weight, y, residual, (m, weight.shape[0], k), config, pdl, warmup=False)
    return y


def warmup(
    config: SkinnyPdlConfig,
    n: int,
    k: int,
    device: torch.device,
    *,
    num_tokens: int = 1,
    has_residual: bool = False,
) -> None:
    """Compile what an ``[num_tokens, k] x [n, k]^T`` call at ``config`` needs, launching nothing.

    Call before CUDA-graph capture. A build depends on ``config``, the power of two of
    M, whether the call splits K, the divisibility of ``n`` and ``k`` by 16, the residual
    and PDL.

    Raises:
        ValueError: for a config that cannot run ``n x k`` or M outside 1..16.
    """
    _check(num_tokens, n, k, config)
    # Stand-ins of the right dtype and alignment; only their types reach the compiler.
    x = torch.empty(8, dtype=torch.bfloat16, device=device)
    _launch(x, x, x, x if has_residual else None, (num_tokens, n, k), config, None, warmup=True)
