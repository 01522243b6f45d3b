"""Experiment: a CuTe DSL swap-AB decode GEMM whose split-K is reduced through a cluster's DSMEM.

``y[M, N] = x[M, K] @ W[N, K]^T``, bf16 in and out, fp32 accumulation, M = 1..16.
This is an experiment for issue 12, not overlay code: it exists to answer, with one
H200 measurement (``cute_cluster_bench.py``), whether reducing split-K partials through
a thread-block cluster's distributed shared memory removes the ~1.7 µs split-K tail of
our Triton kernel (``overlay/.../swap_ab_gemm.py``: partial store to a global workspace,
release, counter atomic, re-read by the last CTA). Nothing routes to it.

The kernel, written here from scratch:

* **swap-AB**: 64 weight rows per CTA are the MMA's M side (``mma.sync`` m16n8k16,
  4 warps x 16 rows), the tokens its N side (two n8 tiles cover 16 tokens). Rows of
  ``x`` past M are never loaded (predicated ``cp.async``), so padding costs no
  bandwidth; the stale shared memory they leave only reaches output columns (tokens)
  that are not stored, since an MMA's columns are independent.
* **split-K over a cluster**: grid ``(C, ceil(N / rows))`` with cluster ``(C, 1, 1)``;
  cluster rank ``r`` owns the contiguous K slice ``[r K / C, (r + 1) K / C)``.
* **ragged rows**: a cluster owns ``rows`` <= 64 weight rows (a run-time value), so N
  spreads over as many clusters as fill the SMs; the tile's rows past them are
  predicated off (no bandwidth), their outputs not stored.
* **loads**: 16-byte ``cp.async`` of the weight and ``x`` tiles (``tile_k`` = 128 K
  per stage: 16 KiB of weight), ``stages`` deep (multi-stage ring, one commit group per
  stage); fragments reach registers by ``ldmatrix`` from a swizzled layout.
* **reduction**: after its K slice each rank parks its fp32 64 x 16 partial in its own
  shared memory; every rank ``r > 0`` pushes it into rank 0's shared memory with
  ``st.async`` (4-byte stores whose completion counts bytes on rank 0's mbarrier,
  ``mbarrier::complete_tx``); rank 0 arms that mbarrier with ``(C - 1) x 4096`` bytes,
  waits on it, sums the partials in rank order 0..C-1 (deterministic) and writes bf16
  ``y``. One cluster barrier, armed at kernel start and waited on only before the push,
  makes rank 0's mbarrier initialisation visible to its peers; no global round trip.
* **PDL**: launched with programmatic dependent launch; the weight tiles of the
  prologue are issued before ``griddepcontrol.wait`` (the weight is no kernel's
  output), ``x`` after it.

Limits (acceptable for the experiment, checked by :func:`config_error`): K a multiple
of ``C x tile_k`` with at least ``stages - 1`` K tiles per rank; packed row-major bf16
tensors, 16-byte aligned. Compiled for sm_90a (cluster launch and ``st.async`` need
SM90+); ``cute.compile`` runs without a GPU (``tests/test_cute_cluster.py``).
"""

from __future__ import annotations

from typing import NamedTuple

import cutlass
import cutlass.cute as cute
from cutlass.cute.runtime import make_fake_compact_tensor
from cutlass.runtime import make_fake_stream

ROWS = 64  # weight rows per CTA: the MMA's M side, 4 warps x 16
TOKENS = 16  # MMA N side: the token count is padded to this
THREADS = 128
MMA_SHAPE = (16, 8, 16)
PARTIAL_BYTES = ROWS * TOKENS * 4  # one rank's fp32 partial tile
PER_THREAD = ROWS * TOKENS // THREADS  # partial floats each thread pushes / sums (8)


class ClusterConfig(NamedTuple):
    """Compile-time configuration.

    Attributes:
        cluster: CTAs per cluster = K splits (2, 4 or 8; the portable cluster limit is 8).
        stages: ``cp.async`` ring depth (2..16).
        tile_k: K elements per stage (64 or 128).
        pdl: launch with programmatic dependent launch.
    """

    cluster: int
    stages: int
    tile_k: int = 128
    pdl: bool = True


def config_error(cfg: ClusterConfig, n: int, k: int, m: int = 1, rows: int = 64) -> str | None:
    """Why ``cfg`` cannot run ``[m, k] x [n, k]^T`` with ``rows`` weight rows per cluster; None if it can."""
    c, stages, tile_k, _ = cfg
    if c not in (2, 4, 8):
        return f"cluster={c} not in (2, 4, 8)"
    if tile_k not in (64, 128):
        return f"tile_k={tile_k} not in (64, 128)"
    if not 2 <= stages <= 16:
        return f"stages={stages} outside 2..16"
    if not 1 <= m <= TOKENS:
        return f"M={m} outside 1..{TOKENS}"
    if not 1 <= rows <= ROWS:
        return f"rows={rows} outside 1..{ROWS}"
    if n < 1:
        return f"N={n} is empty"
    if k % (c * tile_k):
        return f"K={k} is not a multiple of cluster x tile_k = {c * tile_k}"
    if k // (c * tile_k) < stages - 1:
        return f"K={k} gives {k // (c * tile_k)} K tiles per rank, fewer than stages - 1 = {stages - 1}"
    return None


def _swizzled(rows: int, tile_k: int, stages: int):
    # 16-byte chunks of each 128-byte smem row are permuted by the row index
    # (Swizzle<3,3,3>), so the 8 rows one ldmatrix reads land on 8 different bank groups.
    atom = cute.make_composed_layout(
        cute.make_swizzle(3, 3, 3), 0, cute.make_layout((8, 64), stride=(64, 1))
    )
    return cute.tile_to_shape(atom, (rows, tile_k, stages), (0, 1, 2))


@cute.jit
def _row_predicate(t_smem: cute.Tensor, t_coord: cute.Tensor, limit: cutlass.Int32):
    """One predicate per 16-byte copy of a tile partition (``t_smem``: CPY x rows x K x
    stages): its row (from the identity partition ``t_coord``) < ``limit``, the same
    for every K tile and stage."""
    pred = cute.make_rmem_tensor(
        cute.make_layout(
            (t_smem.shape[0][1], cute.size(t_smem, mode=[1]), cute.size(t_smem, mode=[2])),
            stride=(cute.size(t_smem, mode=[1]), 1, 0),
        ),
        cutlass.Boolean,
    )
    for v in cutlass.range_constexpr(pred.shape[0]):
        for r in cutlass.range_constexpr(pred.shape[1]):
            pred[v, r, 0] = t_coord[(0, v), r, 0, 0][0] < limit
    return pred


class _Kernel:
    """The jit host function and kernel for one :class:`ClusterConfig`."""

    def __init__(self, cfg: ClusterConfig):
        self.c, self.stages, self.tile_k, self.pdl = cfg

    @cute.jit
    def __call__(self, mX: cute.Tensor, mW: cute.Tensor, mY: cute.Tensor, rows: cutlass.Int32, stream):
        sw_layout = _swizzled(ROWS, self.tile_k, self.stages)
        sx_layout = _swizzled(TOKENS, self.tile_k, self.stages)
        g2s = cute.make_copy_atom(
            cute.nvgpu.cpasync.CopyG2SOp(cache_mode=cute.nvgpu.cpasync.LoadCacheMode.GLOBAL),
            cutlass.BFloat16,
            num_bits_per_copy=128,
        )
        # Threads tile a stage row-major, 8 bf16 (16 bytes) each: one 128-element row
        # is 16 consecutive threads, so a warp reads 2 whole 256-byte weight rows.
        per_row = self.tile_k // 8
        thr = cute.make_layout((THREADS // per_row, per_row), stride=(per_row, 1))
        copy_g2s = cute.make_tiled_copy_tv(g2s, thr, cute.make_layout((1, 8)))
        mma = cute.make_tiled_mma(
            cute.nvgpu.warp.MmaF16BF16Op(cutlass.BFloat16, cutlass.Float32, MMA_SHAPE),
            cute.make_layout((4, 1, 1)),
            permutation_mnk=(ROWS, TOKENS, 16),
        )
        self.kernel(mX, mW, mY, rows, sw_layout, sx_layout, copy_g2s, mma).launch(
            grid=[self.c, (mW.shape[0] + rows - 1) // rows, 1],
            block=[THREADS, 1, 1],
            cluster=[self.c, 1, 1],
            stream=stream,
            use_pdl=self.pdl,
        )

    @cute.kernel
    def kernel(
        self,
        mX: cute.Tensor,
        mW: cute.Tensor,
        mY: cute.Tensor,
        rows: cutlass.Int32,
        sw_layout: cute.ComposedLayout,
        sx_layout: cute.ComposedLayout,
        copy_g2s: cute.TiledCopy,
        mma: cute.TiledMma,
    ):
        c, stages, tile_k = self.c, self.stages, self.tile_k
        tidx, _, _ = cute.arch.thread_idx()
        _, tile_n, _ = cute.arch.block_idx()
        rank = cute.arch.block_idx_in_cluster()
        m_tokens = mX.shape[0]
        k_tiles = mX.shape[1] // (c * tile_k)  # K tiles this rank owns
        k0 = rank * k_tiles

        smem = cutlass.utils.SmemAllocator()
        sW = smem.allocate_tensor(cutlass.BFloat16, sw_layout, 16)
        sX = smem.allocate_tensor(cutlass.BFloat16, sx_layout, 16)
        # This rank's partial, rows fastest: element e is row e % 64 of token e // 64.
        sAcc = smem.allocate_tensor(
            cutlass.Float32, cute.make_layout((ROWS, TOKENS), stride=(1, ROWS)), 16
        )
        # Rank 0 only: the partials of ranks 1..C-1, one flat 1024-float slab each.
        sRed = smem.allocate_tensor(
            cutlass.Float32,
            cute.make_layout((ROWS * TOKENS, c - 1), stride=(1, ROWS * TOKENS)),
            16,
        )
        mbar = smem.allocate_array(cutlass.Int64, 1)

        if tidx == 0:
            cute.arch.mbarrier_init(mbar, 1)
            cute.arch.mbarrier_init_fence()
        # Arrive now, wait just before the push: the barrier's latency hides behind the loop.
        cute.arch.cluster_arrive_relaxed()
        if cutlass.const_expr(self.pdl):
            # The next kernel may launch; its griddepcontrol.wait still waits for all of this grid.
            cute.arch.griddepcontrol_launch_dependents()

        # This cluster's weight rows: [row0, row_end), at most 64 (ragged: fewer rows per
        # cluster spread N over more clusters). Rows past row_end are not loaded.
        row0 = tile_n * rows
        row_end = cutlass.min(row0 + rows, mW.shape[0])
        mWr = cute.domain_offset((row0, 0), mW)
        gW = cute.local_tile(mWr, (ROWS, tile_k), (0, None))  # (64, tile_k, K tiles)
        gW = cute.make_tensor(gW.iterator.align(16), gW.layout)  # row0 x K x 2 bytes: 16-byte aligned
        cW = cute.local_tile(
            cute.domain_offset((row0, 0), cute.make_identity_tensor(mW.shape)), (ROWS, tile_k), (0, None)
        )
        gX = cute.local_tile(mX, (TOKENS, tile_k), (0, None))  # (16, tile_k, K tiles)
        cX = cute.local_tile(cute.make_identity_tensor(mX.shape), (TOKENS, tile_k), (0, None))
        thr_copy = copy_g2s.get_slice(tidx)
        tWg = thr_copy.partition_S(gW)
        tWc = thr_copy.partition_S(cW)
        tWs = thr_copy.partition_D(sW)
        tXg = thr_copy.partition_S(gX)
        tXs = thr_copy.partition_D(sX)
        tXc = thr_copy.partition_S(cX)
        # x rows past M and weight rows past the cluster's are not loaded.
        tXp = _row_predicate(tXs, tXc, m_tokens)
        tWp = _row_predicate(tWs, tWc, row_end)

        # Prologue: the weight of stages-1 K tiles before griddepcontrol.wait, x after it.
        for s in cutlass.range_constexpr(stages - 1):
            cute.copy(copy_g2s, tWg[None, None, None, k0 + s], tWs[None, None, None, s], pred=tWp)
        if cutlass.const_expr(self.pdl):
            cute.arch.griddepcontrol_wait()
        for s in cutlass.range_constexpr(stages - 1):
            cute.copy(copy_g2s, tXg[None, None, None, k0 + s], tXs[None, None, None, s], pred=tXp)
            cute.arch.cp_async_commit_group()  # group 0 also holds every prologue weight tile

        thr_mma = mma.get_slice(tidx)
        tCsW = thr_mma.partition_A(sW)
        tCsX = thr_mma.partition_B(sX)
        rW = mma.make_fragment_A(tCsW[None, None, None, 0])
        rX = mma.make_fragment_B(tCsX[None, None, None, 0])
        acc = mma.make_fragment_C(thr_mma.partition_C(sAcc))
        acc.fill(0.0)
        ldm = cute.make_copy_atom(cute.nvgpu.warp.LdMatrix8x8x16bOp(False, 4), cutlass.BFloat16)
        s2r_w = cute.make_tiled_copy_A(ldm, mma).get_slice(tidx)
        s2r_x = cute.make_tiled_copy_B(ldm, mma).get_slice(tidx)
        tLsW = s2r_w.partition_S(sW)
        tLrW = s2r_w.retile(rW)
        tLsX = s2r_x.partition_S(sX)
        tLrX = s2r_x.retile(rX)
        k_blocks = cute.size(rW, mode=[2])
        s2r_w_copy = cute.make_tiled_copy_A(ldm, mma)
        s2r_x_copy = cute.make_tiled_copy_B(ldm, mma)

        for i in cutlass.range(k_tiles, unroll=1):
            # Tile i has landed once at most stages-2 newer groups are pending.
            cute.arch.cp_async_wait_group(stages - 2)
            cute.arch.sync_threads()  # ...for every thread, and slot (i-1) % stages is free
            nxt = i + stages - 1
            if nxt < k_tiles:
                slot_n = nxt % stages
                cute.copy(
                    copy_g2s, tWg[None, None, None, k0 + nxt], tWs[None, None, None, slot_n], pred=tWp
                )
                cute.copy(
                    copy_g2s, tXg[None, None, None, k0 + nxt], tXs[None, None, None, slot_n], pred=tXp
                )
            cute.arch.cp_async_commit_group()  # empty near the end: keeps the group count
            slot = i % stages
            for kb in cutlass.range_constexpr(k_blocks):
                cute.copy(s2r_w_copy, tLsW[None, None, kb, slot], tLrW[None, None, kb])
                cute.copy(s2r_x_copy, tLsX[None, None, kb, slot], tLrX[None, None, kb])
            for kb in cutlass.range_constexpr(k_blocks):
                cute.gemm(mma, acc, rW[None, None, kb], rX[None, None, kb], acc)
        cute.arch.cp_async_wait_group(0)

        # Park this rank's partial in its own shared memory, in the flat order above.
        tCsAcc = thr_mma.partition_C(sAcc)
        for j in cutlass.range_constexpr(cute.size(acc)):
            tCsAcc[j] = acc[j]
        cute.arch.sync_threads()
        cute.arch.cluster_wait()  # rank 0's mbarrier is initialised (and fenced) by now

        e0 = tidx * PER_THREAD  # this thread's 8 consecutive partial floats
        if rank == 0:
            if tidx == 0:
                cute.arch.mbarrier_arrive_and_expect_tx(mbar, (c - 1) * PARTIAL_BYTES)
            cute.arch.mbarrier_wait(mbar, 0)
            tok = e0 // ROWS
            if tok < m_tokens:
                for j in cutlass.range_constexpr(PER_THREAD):
                    r = (e0 + j) % ROWS
                    if row0 + r < row_end:  # a ragged cluster stores only its own rows
                        total = sAcc[r, tok]
                        for peer in cutlass.range_constexpr(c - 1):  # fixed order: ranks 1..C-1
                            total = total + sRed[e0 + j, peer]
                        mY[tok, row0 + r] = total.to(cutlass.BFloat16)
        else:
            # Same flat index, in rank 0's slab for this rank; the bytes complete rank 0's mbarrier.
            flat = cute.make_tensor(
                cute.recast_ptr(sAcc.iterator, dtype=cutlass.Int32),
                cute.make_layout((ROWS * TOKENS,)),
            )
            # (The DSL's v2/v4 forms of st.async do not compile in 4.6.2: one b32 store each.)
            for j in cutlass.range_constexpr(PER_THREAD):
                dst = cute.domain_offset((e0 + j, rank - 1), sRed).iterator
                cute.arch.store_async_dsmem(dst, flat[e0 + j], mbar, 0)


_FAKE_ALIGN = 16


def compile_kernel(cfg: ClusterConfig, stream=None, options: str = "--enable-tvm-ffi"):
    """``cute.compile`` the kernel for ``cfg`` with dynamic M, N, K; no GPU needed.

    ``stream``: a placeholder (default ``make_fake_stream()``); the compiled callable
    takes ``(x, w, y, rows, CUstream)``. Set ``CUTE_DSL_ARCH=sm_90a`` to compile without a GPU.
    """
    m, n, k = cute.sym_int(), cute.sym_int(), cute.sym_int(divisibility=8)
    x = make_fake_compact_tensor(cutlass.BFloat16, (m, k), stride_order=(1, 0), assumed_align=_FAKE_ALIGN)
    w = make_fake_compact_tensor(cutlass.BFloat16, (n, k), stride_order=(1, 0), assumed_align=_FAKE_ALIGN)
    y = make_fake_compact_tensor(cutlass.BFloat16, (m, n), stride_order=(1, 0), assumed_align=_FAKE_ALIGN)
    return cute.compile(_Kernel(cfg), x, w, y, cutlass.Int32(ROWS), stream or make_fake_stream(),
                        options=options)


_COMPILED: dict[ClusterConfig, object] = {}


def compiled(cfg: ClusterConfig):
    """The compiled kernel for ``cfg`` (bf16), compiled on first use and cached."""
    if cfg not in _COMPILED:
        _COMPILED[cfg] = compile_kernel(cfg)
    return _COMPILED[cfg]


def cluster_splitk_gemm(x, w, cluster: int = 4, stages: int = 4, tile_k: int = 128, pdl: bool = True,
                        rows: int = ROWS):
    """``x @ w.T`` as a new bf16 ``[M, N]`` tensor on the current torch stream.

    Args:
        x: ``[M, K]`` bf16 CUDA tensor, packed row-major, 1 <= M <= 16.
        w: ``[N, K]`` bf16, packed row-major, on ``x``'s device.
        cluster, stages, tile_k, pdl: see :class:`ClusterConfig`; compiled once per config.
        rows: weight rows per cluster, 1..64 (a run-time value): ``ceil(N / rows)`` clusters.

    Raises:
        ValueError: wrong dtype, layout or a shape :func:`config_error` refuses.
    """
    import torch
    from cuda.bindings.driver import CUstream

    cfg = ClusterConfig(cluster, stages, tile_k, pdl)
    if x.dtype != torch.bfloat16 or w.dtype != torch.bfloat16:
        raise ValueError(f"need bf16 x and w, got {x.dtype} and {w.dtype}")
    if x.dim() != 2 or w.dim() != 2 or x.shape[1] != w.shape[1]:
        raise ValueError(f"x {tuple(x.shape)} and w {tuple(w.shape)} are not [M, K] and [N, K]")
    if not (x.is_contiguous() and w.is_contiguous()):
        raise ValueError("x and w must be packed row-major")
    why = config_error(cfg, w.shape[0], w.shape[1], x.shape[0], rows)
    if why:
        raise ValueError(f"cluster split-K config {tuple(cfg)}: {why}")
    y = torch.empty((x.shape[0], w.shape[0]), dtype=x.dtype, device=x.device)
    compiled(cfg)(x, w, y, rows, CUstream(torch.cuda.current_stream(x.device).cuda_stream))
    return y
