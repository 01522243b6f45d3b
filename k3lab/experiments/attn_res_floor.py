"""Experiment (issue 28): the floor under attn-res over a thread-block cluster, a benchmark kind.

Lab code: nothing routes to it. It asks what the cluster kernel
(``overlay/.../nvidia/attn_res_cluster.py``) would cost if its sums were free: the same
grid (``C`` CTAs a row, a cluster of ``C``), threads, PDL calls and bytes (the row's
``NB`` blocks, prefix and delta read after ``griddepcontrol.wait``, one bf16 row
written), with the math cut to the sum of the sources and, with ``sync``, one cluster
barrier (arrive, then wait) between the loads and the store where the real kernel
exchanges its sums. Its output is not attn-res: the benchmark records it for the time
only (``k3lab.decode_step.attn_res_bench --kinds floor``).

Built by ``cute.compile`` per (H, NB, C, sync); needs ``nvidia-cutlass-dsl`` and, to
compile without a GPU, ``CUTE_DSL_ARCH=sm_90a``. ``floor(prefix, delta, blocks, ...,
cluster=8, sync=False)`` takes the bench's operands (BF16, rows 16-byte aligned) and
returns a new (M, H) BF16 tensor.
"""

from __future__ import annotations

import functools

VEC = 8  # bf16 columns a thread: one 16-byte load a source, as the real kernel


@functools.cache
def _compiled(h: int, nb: int, cluster: int, sync: bool):
    import cutlass
    import cutlass.cute as cute
    from cutlass.cute.runtime import make_fake_compact_tensor, make_fake_stream, make_fake_tensor

    f32, bf16 = cutlass.Float32, cutlass.BFloat16
    vecs = h // (VEC * cluster)
    threads = -(-vecs // 32) * 32

    def vec_of(t1d, v):
        t = cute.local_tile(t1d, (VEC,), (v,))
        return cute.make_tensor(t.iterator.align(16), t.layout)

    class _K:
        @cute.jit
        def __call__(self, mP, mD, mB, mOut, stream):
            self.kernel(mP, mD, mB, mOut).launch(grid=[cluster, mP.shape[0], 1], block=[threads, 1, 1],
                                                 cluster=[cluster, 1, 1], stream=stream, use_pdl=True)

        @cute.kernel
        def kernel(self, mP, mD, mB, mOut):
            tidx, _, _ = cute.arch.thread_idx()
            _, row, _ = cute.arch.block_idx()
            rank = cute.arch.block_idx_in_cluster()
            if cutlass.const_expr(sync):
                cute.arch.cluster_arrive_relaxed()
            cute.arch.griddepcontrol_launch_dependents()
            cute.arch.griddepcontrol_wait()
            v = rank * vecs + tidx
            acc = cute.make_rmem_tensor(cute.make_layout((VEC,)), f32)
            acc.fill(0.0)
            r = cute.make_rmem_tensor(cute.make_layout((VEC, nb + 2), stride=(1, VEC)), bf16)
            r.fill(0.0)
            if tidx < vecs:
                for s in cutlass.range_constexpr(nb):
                    cute.autovec_copy(vec_of(mB[row, s, None], v), r[None, s])
                cute.autovec_copy(vec_of(mP[row, None], v), r[None, nb])
                cute.autovec_copy(vec_of(mD[row, None], v), r[None, nb + 1])
            for s in cutlass.range_constexpr(nb + 2):
                for i in cutlass.range_constexpr(VEC):
                    acc[i] = acc[i] + r[i, s].to(f32)
            if cutlass.const_expr(sync):
                cute.arch.cluster_wait()
            o = cute.make_rmem_tensor(cute.make_layout((VEC,)), bf16)
            for i in cutlass.range_constexpr(VEC):
                o[i] = acc[i].to(bf16)
            if tidx < vecs:
                cute.autovec_copy(o, vec_of(mOut[row, None], v))

    m, slots = cute.sym_int(), cute.sym_int()
    rp, rd, rbm, rbr = (cute.sym_int(divisibility=VEC) for _ in range(4))
    p = make_fake_tensor(bf16, (m, h), (rp, 1), assumed_align=16)
    d = make_fake_tensor(bf16, (m, h), (rd, 1), assumed_align=16)
    b = make_fake_tensor(bf16, (m, slots, h), (rbm, rbr, 1), assumed_align=16)
    out = make_fake_compact_tensor(bf16, (m, h), stride_order=(1, 0), assumed_align=16)
    return cute.compile(_K(), p, d, b, out, make_fake_stream(), options="--enable-tvm-ffi")


def floor(prefix, delta, blocks, norm_weight, qk_weight, output_norm_weight, num_blocks: int,
          block_write_idx: int, eps: float, output_norm_eps: float, *, cluster: int = 8,
          sync: bool = False):  # fmt: skip
    """The floor kernel on the bench's operands (the weights and epsilons are unused)."""
    import torch
    from cuda.bindings.driver import CUstream

    m, h = prefix.shape
    out = torch.empty_like(prefix)
    _compiled(h, num_blocks, cluster, sync)(prefix, delta, blocks, out,
                                            CUstream(torch.cuda.current_stream().cuda_stream))
    return out
