# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-k3-overlay project
"""Kimi-K3's attn-res mix for decode, one thread-block cluster per row (CuTe DSL, SM90+).

The math is :mod:`attn_res`'s (its module docstring): per token row, ``u = bf16(prefix +
delta)`` written back, an optional block write, the softmax over the sources' scaled
dots with ``norm_w * qk_w``, the mix, the output RMSNorm.

Why a cluster: the one-CTA-per-row kernel (:mod:`attn_res`, 5.6-6.1 µs on the H200,
2026-12-04) pulls a row's ~160 KB through one SM. Here the row's H columns are split over
the ``C`` CTAs of one cluster (``C`` = 2, 4 or 8, the portable cluster sizes), each CTA
holding ``H / C`` columns of every source in registers, 8 columns (one 16-byte load per
source) per thread. The row needs two sums over all of its columns, the scores' (per
source, the sum of squares and the dot) and the output norm's; each CTA reduces its part
(warp shuffles, then shared memory) and pushes it into every CTA of the cluster with
``st.async`` into distributed shared memory, whose bytes complete an ``mbarrier`` there
(``complete_tx``): one one-way trip through the cluster, no global memory, no spin on a
counter. Every CTA adds the C parts in rank order, so all of them compute the same
softmax bit for bit. The launch needs a cluster of ``C`` co-resident CTAs per row, which
the hardware schedules as a unit: no grid-wide co-residency assumption.

PDL: the next kernel may launch at once; the three weight vectors (written by no kernel)
load before ``griddepcontrol.wait``, ``prefix``, ``delta`` and ``blocks`` after it.

Built by ``cute.compile`` per (H, NB, C, the three flags, PDL): NB and the flags are
compile-time, as in :mod:`attn_res`. Needs ``nvidia-cutlass-dsl`` (a vLLM v0.28.0
dependency on CUDA) and, to compile without a GPU, ``CUTE_DSL_ARCH=sm_90a``.
"""

import functools
from typing import NamedTuple

#: Cluster sizes: the portable ones (a cluster of 16 needs a non-portable opt-in).
CLUSTERS = (2, 4, 8)
VEC = 8  # bf16 columns per thread: one 16-byte load per source
MAX_THREADS = 1024


class Build(NamedTuple):
    """What one compiled kernel is specialized for."""

    h: int
    num_blocks: int
    cluster: int
    has_delta: bool
    write_block: bool
    out_norm: bool
    pdl: bool


def shape_error(h: int, cluster: int) -> str | None:
    """Why a row of ``h`` columns cannot be split over ``cluster`` CTAs; None if it can."""
    if cluster not in CLUSTERS:
        return f"cluster={cluster!r} not in {CLUSTERS}"
    if h % (VEC * cluster):
        return f"H={h} is not a multiple of {VEC} x cluster = {VEC * cluster}"
    if h // (VEC * cluster) > MAX_THREADS:
        return f"H={h} needs {h // (VEC * cluster)} threads a CTA at cluster={cluster}"
    return None


def threads_of(h: int, cluster: int) -> int:
    """Threads a CTA: one per 8 columns of its ``h / cluster``, rounded up to a warp."""
    return -(-(h // (VEC * cluster)) // 32) * 32


def _make_kernel(b: Build):
    import cutlass
    import cutlass.cute as cute

    f32, bf16, i32 = cutlass.Float32, cutlass.BFloat16, cutlass.Int32
    nsrc = b.num_blocks + 1  # the blocks, then u
    nsum = 2 * nsrc  # per source: sum of squares, dot with norm_w * qk_w
    cols = b.h // b.cluster  # columns of one CTA
    vecs = cols // VEC  # active threads
    threads = threads_of(b.h, b.cluster)
    warps = threads // 32
    inv_h = 1.0 / b.h
    c = b.cluster

    def vec_of(t1d, v):
        """The 16-byte-aligned 8 columns ``v`` of a 1-D row view."""
        t = cute.local_tile(t1d, (VEC,), (v,))
        return cute.make_tensor(t.iterator.align(16), t.layout)

    class _K:
        @cute.jit
        def __call__(self, mP, mD, mB, mNW, mQW, mOW, mOut, write_idx: i32, eps: f32,
                     out_eps: f32, stream):  # fmt: skip
            self.kernel(mP, mD, mB, mNW, mQW, mOW, mOut, write_idx, eps, out_eps).launch(
                grid=[c, mP.shape[0], 1], block=[threads, 1, 1], cluster=[c, 1, 1],
                stream=stream, use_pdl=b.pdl)  # fmt: skip

        @cute.kernel
        def kernel(self, mP, mD, mB, mNW, mQW, mOW, mOut, write_idx: i32, eps: f32, out_eps: f32):
            tidx, _, _ = cute.arch.thread_idx()
            _, row, _ = cute.arch.block_idx()
            rank = cute.arch.block_idx_in_cluster()
            warp = tidx // 32
            lane = tidx % 32

            smem = cutlass.utils.SmemAllocator()
            s_warp = smem.allocate_tensor(f32, cute.make_layout((warps, nsum + 1), stride=(nsum + 1, 1)), 16)
            s_own = smem.allocate_tensor(f32, cute.make_layout((nsum + c,)), 16)  # pushed values
            s_recv = smem.allocate_tensor(f32, cute.make_layout((c, nsum), stride=(nsum, 1)), 16)
            s_recv_q = smem.allocate_tensor(f32, cute.make_layout((c,)), 16)
            s_tot = smem.allocate_tensor(f32, cute.make_layout((nsum,)), 16)
            mbar = smem.allocate_array(cutlass.Int64, 2)
            own_bits = cute.make_tensor(cute.recast_ptr(s_own.iterator, dtype=i32), s_own.layout)

            if tidx == 0:
                cute.arch.mbarrier_init(mbar, 1)
                cute.arch.mbarrier_init(mbar + 1, 1)
                cute.arch.mbarrier_init_fence()
            # Arrived now, waited on just before the first push: its latency hides behind the loads.
            cute.arch.cluster_arrive_relaxed()
            if cutlass.const_expr(b.pdl):
                cute.arch.griddepcontrol_launch_dependents()

            active = tidx < vecs
            v = rank * vecs + tidx  # this thread's 8 columns: [8 v, 8 v + 8)
            r_nw = cute.make_rmem_tensor(cute.make_layout((VEC,)), bf16)
            r_qw = cute.make_rmem_tensor(cute.make_layout((VEC,)), bf16)
            r_ow = cute.make_rmem_tensor(cute.make_layout((VEC,)), bf16)
            r_p = cute.make_rmem_tensor(cute.make_layout((VEC,)), bf16)
            r_d = cute.make_rmem_tensor(cute.make_layout((VEC,)), bf16)
            r_b = cute.make_rmem_tensor(cute.make_layout((VEC, max(b.num_blocks, 1)), stride=(1, VEC)), bf16)
            r_nw.fill(0.0)
            r_qw.fill(0.0)
            r_ow.fill(0.0)
            r_p.fill(0.0)
            r_d.fill(0.0)
            r_b.fill(0.0)
            # Weights first: no kernel of the step writes them.
            if active:
                cute.autovec_copy(vec_of(mNW, v), r_nw)
                cute.autovec_copy(vec_of(mQW, v), r_qw)
                if cutlass.const_expr(b.out_norm):
                    cute.autovec_copy(vec_of(mOW, v), r_ow)
            if cutlass.const_expr(b.pdl):
                cute.arch.griddepcontrol_wait()
            # Every source's 16 bytes in flight at once: one round trip for the CTA's part.
            if active:
                for s in cutlass.range_constexpr(b.num_blocks):
                    cute.autovec_copy(vec_of(mB[row, s, None], v), r_b[None, s])
                cute.autovec_copy(vec_of(mP[row, None], v), r_p)
                if cutlass.const_expr(b.has_delta):
                    cute.autovec_copy(vec_of(mD[row, None], v), r_d)

            # u = bf16(prefix + delta), the new prefix (and the written block), as the stock
            # kernel rounds it.
            r_u = cute.make_rmem_tensor(cute.make_layout((VEC,)), bf16)
            for i in cutlass.range_constexpr(VEC):
                if cutlass.const_expr(b.has_delta):
                    r_u[i] = (r_p[i].to(f32) + r_d[i].to(f32)).to(bf16)
                else:
                    r_u[i] = r_p[i]
            if active:
                if cutlass.const_expr(b.has_delta):
                    cute.autovec_copy(r_u, vec_of(mP[row, None], v))
                if cutlass.const_expr(b.write_block):
                    cute.autovec_copy(r_u, vec_of(mB[row, write_idx, None], v))

            # This thread's part of every source's sum of squares and dot (zeros when idle).
            part = cute.make_rmem_tensor(cute.make_layout((nsum,)), f32)
            for s in cutlass.range_constexpr(nsrc):
                ss = f32(0.0)
                dt = f32(0.0)
                for i in cutlass.range_constexpr(VEC):
                    x = r_u[i].to(f32) if s == b.num_blocks else r_b[i, s].to(f32)
                    ss = ss + x * x
                    dt = dt + x * (r_nw[i].to(f32) * r_qw[i].to(f32))
                part[2 * s] = cute.arch.warp_reduction_sum(ss)
                part[2 * s + 1] = cute.arch.warp_reduction_sum(dt)
            if lane == 0:
                for j in cutlass.range_constexpr(nsum):
                    s_warp[warp, j] = part[j]
            cute.arch.sync_threads()
            cute.arch.cluster_wait()  # every CTA's mbarriers are initialised by now

            # The CTA's sums (warps in order), pushed into slot `rank` of every CTA.
            if tidx < nsum:
                tot = s_warp[0, tidx]
                for w in cutlass.range_constexpr(1, warps):
                    tot = tot + s_warp[w, tidx]
                s_own[tidx] = tot
                for dst in cutlass.range_constexpr(c):
                    cute.arch.store_async_dsmem(
                        cute.domain_offset((rank, tidx), s_recv).iterator, own_bits[tidx], mbar, dst)
            if tidx == 0:
                cute.arch.mbarrier_arrive_and_expect_tx(mbar, c * nsum * 4)
            cute.arch.mbarrier_wait(mbar, 0)
            if tidx < nsum:
                tot = s_recv[0, tidx]
                for r in cutlass.range_constexpr(1, c):  # rank order: the same sum in every CTA
                    tot = tot + s_recv[r, tidx]
                s_tot[tidx] = tot
            cute.arch.sync_threads()

            # Softmax over the sources' logits, then the mix of this thread's columns.
            logit = cute.make_rmem_tensor(cute.make_layout((nsrc,)), f32)
            top = f32(-3.0e38)
            for s in cutlass.range_constexpr(nsrc):
                logit[s] = s_tot[2 * s + 1] * cute.math.rsqrt(s_tot[2 * s] * inv_h + eps)
                top = cute.math.max(top, logit[s]) if s > 0 else logit[s]
            den = f32(0.0)
            for s in cutlass.range_constexpr(nsrc):
                logit[s] = cute.math.exp(logit[s] - top)
                den = den + logit[s]
            inv_den = 1.0 / den
            mixed = cute.make_rmem_tensor(cute.make_layout((VEC,)), f32)
            q = f32(0.0)
            for i in cutlass.range_constexpr(VEC):
                acc = logit[b.num_blocks] * r_u[i].to(f32)
                for s in cutlass.range_constexpr(b.num_blocks):
                    acc = acc + logit[s] * r_b[i, s].to(f32)
                mixed[i] = acc * inv_den
                q = q + mixed[i] * mixed[i]

            scale = f32(1.0)
            if cutlass.const_expr(b.out_norm):
                # The output norm's sum of squares: the same push, one float a CTA.
                q = cute.arch.warp_reduction_sum(q)
                if lane == 0:
                    s_warp[warp, nsum] = q
                cute.arch.sync_threads()
                if tidx < c:
                    qc = s_warp[0, nsum]
                    for w in cutlass.range_constexpr(1, warps):
                        qc = qc + s_warp[w, nsum]
                    s_own[nsum + tidx] = qc
                    cute.arch.store_async_dsmem(
                        cute.domain_offset((rank,), s_recv_q).iterator, own_bits[nsum + tidx],
                        mbar + 1, tidx)  # fmt: skip
                if tidx == 0:
                    cute.arch.mbarrier_arrive_and_expect_tx(mbar + 1, c * 4)
                cute.arch.mbarrier_wait(mbar + 1, 0)
                qt = s_recv_q[0]
                for r in cutlass.range_constexpr(1, c):
                    qt = qt + s_recv_q[r]
                scale = cute.math.rsqrt(qt * inv_h + out_eps)

            r_o = cute.make_rmem_tensor(cute.make_layout((VEC,)), bf16)
            for i in cutlass.range_constexpr(VEC):
                if cutlass.const_expr(b.out_norm):
                    r_o[i] = (mixed[i] * scale * r_ow[i].to(f32)).to(bf16)
                else:
                    r_o[i] = mixed[i].to(bf16)
            if active:
                cute.autovec_copy(r_o, vec_of(mOut[row, None], v))

    return _K()


def compile_build(b: Build, options: str = "--enable-tvm-ffi"):
    """``cute.compile`` the kernel for ``b`` with a dynamic token count and strides; no GPU
    needed with ``CUTE_DSL_ARCH=sm_90a``. The callable takes ``(prefix, delta, blocks,
    norm_w, qk_w, out_w, out, write_idx, eps, out_eps, stream)``."""
    import cutlass
    import cutlass.cute as cute
    from cutlass.cute.runtime import make_fake_compact_tensor, make_fake_stream, make_fake_tensor

    bf16 = cutlass.BFloat16
    m = cute.sym_int()
    row_p, row_d, row_bm, row_br = (cute.sym_int(divisibility=VEC) for _ in range(4))
    slots = cute.sym_int()
    p = make_fake_tensor(bf16, (m, b.h), (row_p, 1), assumed_align=16)
    d = make_fake_tensor(bf16, (m, b.h), (row_d, 1), assumed_align=16)
    blocks = make_fake_tensor(bf16, (m, slots, b.h), (row_bm, row_br, 1), assumed_align=16)
    w = [make_fake_compact_tensor(bf16, (b.h,), assumed_align=16) for _ in range(3)]
    out = make_fake_compact_tensor(bf16, (m, b.h), stride_order=(1, 0), assumed_align=16)
    return cute.compile(_make_kernel(b), p, d, blocks, *w, out, cutlass.Int32(0),
                        cutlass.Float32(1e-6), cutlass.Float32(1e-6), make_fake_stream(),
                        options=options)  # fmt: skip


_COMPILED: dict = {}


def _build_of(prefix, delta, output_norm_weight, num_blocks: int, block_write_idx: int,
              cluster: int, pdl: bool) -> Build:  # fmt: skip
    return Build(prefix.shape[1], num_blocks, cluster, delta is not None, block_write_idx >= 0,
                 output_norm_weight is not None, bool(pdl))  # fmt: skip


@functools.cache
def _has_cute_dsl() -> bool:
    import importlib.util

    return importlib.util.find_spec("cutlass") is not None


@functools.cache
def _has_clusters(device_index: int) -> bool:
    import torch

    return torch.cuda.get_device_capability(device_index)[0] >= 9


def operands_error(prefix, delta, blocks, norm_weight, qk_weight, output_norm_weight,
                   num_blocks: int, block_write_idx: int, cluster: int, pdl: bool) -> str | None:  # fmt: skip
    """Why :func:`attn_res_cluster` would not take operands that :func:`attn_res.check_operands`
    passed; None if it takes them. Beyond those: a CUDA device of SM90 or newer, the CuTe
    DSL importable, everything BF16, H split evenly (:func:`shape_error`), every row
    start 16-byte aligned (row strides multiples of 8, pointers of 16), and the build
    compiled already when the stream is capturing a CUDA graph (compiling is host work a
    capture must not wait on; the caller takes another kernel then)."""
    import torch

    if prefix.device.type != "cuda" or not _has_clusters(prefix.device.index or 0):
        return "needs a CUDA GPU of SM90 or newer (thread-block clusters)"
    if not _has_cute_dsl():
        return "nvidia-cutlass-dsl is not installed"
    uses_blocks = num_blocks > 0 or block_write_idx >= 0
    tensors = [prefix, delta, norm_weight, qk_weight, output_norm_weight] + ([blocks] if uses_blocks else [])
    if any(t is not None and t.dtype != torch.bfloat16 for t in tensors):
        return "every operand must be BF16"
    why = shape_error(prefix.shape[1], cluster)
    if why:
        return why
    strides = [prefix.stride(0)] + ([delta.stride(0)] if delta is not None else [])
    if uses_blocks:
        strides += [blocks.stride(0), blocks.stride(1)]
    if any(s % VEC for s in strides) or any(t is not None and t.data_ptr() % 16 for t in tensors):
        return "rows must start 16-byte aligned"
    b = _build_of(prefix, delta, output_norm_weight, num_blocks, block_write_idx, cluster, pdl)
    if b not in _COMPILED and torch.cuda.is_current_stream_capturing():
        return f"{b} is not compiled and the stream is capturing"
    return None


def attn_res_cluster(prefix, delta, blocks, norm_weight, qk_weight, output_norm_weight,
                     num_blocks: int, block_write_idx: int, eps: float, output_norm_eps: float,
                     *, cluster: int = 8, pdl: bool = True):  # fmt: skip
    """The attn-res mix (:func:`attn_res.attn_res`'s contract and operands), one cluster of
    ``cluster`` CTAs per row; compiles its build on first use (1-4 s on a CPU).

    Returns:
        A new packed BF16 (M, H); ``prefix`` (and ``blocks[:, block_write_idx]``) updated.

    Raises:
        ValueError: operands :func:`attn_res.check_operands` or :func:`operands_error` refuses.
    """
    from vllm.models.kimi_k3.nvidia.attn_res import check_operands

    check_operands(prefix, delta, blocks, norm_weight, qk_weight, output_norm_weight,
                   num_blocks, block_write_idx)  # fmt: skip
    why = operands_error(prefix, delta, blocks, norm_weight, qk_weight, output_norm_weight,
                         num_blocks, block_write_idx, cluster, pdl)  # fmt: skip
    if why:
        raise ValueError(f"attn_res cluster variant: {why}")
    return launch(prefix, delta, blocks, norm_weight, qk_weight, output_norm_weight, num_blocks,
                  block_write_idx, eps, output_norm_eps, cluster=cluster, pdl=pdl)  # fmt: skip


def launch(prefix, delta, blocks, norm_weight, qk_weight, output_norm_weight, num_blocks: int,
           block_write_idx: int, eps: float, output_norm_eps: float, *, cluster: int, pdl: bool):  # fmt: skip
    """:func:`attn_res_cluster` on operands both checks already passed (the backend's path:
    its ``operands_ok`` ran ``check_operands``, its ``launch`` :func:`operands_error`)."""
    import torch
    from cuda.bindings.driver import CUstream  # the CuTe DSL's dependency, as compile_build's

    m, h = prefix.shape
    out = torch.empty((m, h), dtype=prefix.dtype, device=prefix.device)
    if m == 0:
        return out
    b = _build_of(prefix, delta, output_norm_weight, num_blocks, block_write_idx, cluster, pdl)
    if b not in _COMPILED:
        _COMPILED[b] = compile_build(b)
    uses_blocks = num_blocks > 0 or block_write_idx >= 0
    _COMPILED[b](prefix, prefix if delta is None else delta,
                 blocks if uses_blocks else prefix.unsqueeze(1), norm_weight, qk_weight,
                 norm_weight if output_norm_weight is None else output_norm_weight, out,
                 max(block_write_idx, 0), float(eps), float(output_norm_eps),
                 CUstream(torch.cuda.current_stream(prefix.device).cuda_stream))  # fmt: skip
    return out
