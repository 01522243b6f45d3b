# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-k3-overlay project
"""PDL-aware skinny BF16 decode GEMM (GEMV style) in the CuTe DSL, SM90+ (vllm-k3-overlay).

``y[M, N] = x[M, K] @ W[N, K]^T`` for the smallest decode token counts (M = 1..16, meant
for M <= 4), bf16 in and out, fp32 accumulation, no tensor cores.

Operands: ``x`` (M, K) bf16 with unit column stride, its row stride a multiple of 8 and its
pointer 16-byte aligned (a strided view such as KDA's F_A slice is fine); ``W`` (N, K)
packed row-major bf16, 16-byte aligned; one CUDA device of SM90 or newer. K must be a
multiple of ``threads * 8`` and N of ``rows`` (:func:`config_error`). Errors:
:class:`ValueError` for operands or a config :func:`operands_error` / :func:`config_error`
refuse. Times: µs; sizes: elements unless said bytes.

Why (issue 28, item 1): the SM90 table chose at M <= 4 between vLLM's CuTe skinny GEMM,
fast alone but triggering its dependents only after its stores (so the next kernel of
the step starts its own prologue only once this one is done) and PDL-aware kernels with
a higher fixed cost (swap-AB about 1.8 µs; our Triton GEMV, whose per-token block
reductions lose at M >= 2). This kernel is meant to be both:

* **trigger first**: ``griddepcontrol.launch_dependents`` is the kernel's first
  instruction, so the next kernel of the step may launch as soon as this one's last CTA
  is resident, and run its own weight loads under this one;
* **weights before the wait**: each CTA owns ``rows`` whole weight rows; its threads
  split K into 16-byte vectors (``threads * 8`` columns a K tile). The first
  ``prefetch`` K tiles (K holds at least that many) of the CTA's rows are loaded into
  registers before ``griddepcontrol.wait`` (the weight is a parameter, written by no kernel); with
  ``prefetch * threads * 8 >= K`` that is the CTA's whole weight slice, so the weight
  stream overlaps the previous kernel's tail. Tiles past the prefetch stream after the
  wait, one at a time.
* **one reduction per output**: each thread keeps M x ``rows`` fp32 partial sums over its
  K vectors; a warp-shuffle reduction of each, one shared-memory slot per warp, then
  thread ``j`` < M x ``rows`` adds the warps' slots of output ``j`` (in warp order: the
  result does not depend on timing) and stores it.

The design is the GEMV of TensorRT-LLM's tinygemm2 and of vLLM's CuTe skinny GEMM (read,
not copied); what is ours is the order above. Built by ``cute.compile`` per (M, config,
PDL): N and K are runtime values, so one build serves every shape whose K is a multiple of
the tile and holds the prefetch.
Needs ``nvidia-cutlass-dsl`` (a vLLM v0.28.0 dependency on CUDA) and, to compile without
a GPU, ``CUTE_DSL_ARCH=sm_90a``.
"""

import functools
from typing import NamedTuple

VEC = 8  # bf16 columns per thread and load: 16 bytes
MAX_TOKENS = 16
#: CTA sizes the lab sweeps: whole warps whose K tile (threads x 8) divides the K of the
#: tables' shapes (7168 = 7 x 1024, 3584 = 7 x 512, 3072, 1536 = 3 x 512, 768).
SWEEP_THREADS = (64, 96, 128, 192, 224, 256, 448)
MAX_THREADS = 1024
ROWS = (1, 2, 4, 8)
#: Registers a thread may hold weights in before the wait: rows x prefetch x 4 (32-bit).
MAX_PREFETCH_REGS = 128


class GemvPdlConfig(NamedTuple):
    """Table data ``(threads, rows, prefetch)``.

    Attributes:
        threads: threads per CTA (a multiple of 32); a K tile is ``threads * 8`` columns.
        rows: weight rows (outputs) per CTA; the grid is N / rows CTAs.
        prefetch: K tiles of the CTA's rows loaded before ``griddepcontrol.wait``.
    """

    threads: int
    rows: int
    prefetch: int


class Build(NamedTuple):
    """What one compiled kernel is specialized for."""

    m: int
    config: GemvPdlConfig
    pdl: bool


def config_error(config: GemvPdlConfig, n: int, k: int) -> str | None:
    """Why ``config`` cannot run (N, K); None if it can."""
    threads, rows, prefetch = config
    if threads % 32 or not 32 <= threads <= MAX_THREADS:
        return f"threads={threads} is not a whole number of warps up to {MAX_THREADS}"
    if rows not in ROWS:
        return f"rows={rows} not in {ROWS}"
    if not 1 <= prefetch or rows * prefetch * 4 > MAX_PREFETCH_REGS:
        return f"rows x prefetch x 4 = {rows * prefetch * 4} registers > {MAX_PREFETCH_REGS}"
    if k % (threads * VEC):
        return f"K={k} not a multiple of threads x 8 = {threads * VEC}"
    if k < prefetch * threads * VEC:
        return f"K={k} has fewer than prefetch={prefetch} tiles of {threads * VEC}"
    if n % rows:
        return f"N={n} not a multiple of rows={rows}"
    return None


def sweep_configs(n: int, k: int) -> list[GemvPdlConfig]:
    """The configs the kernel lab times on (N, K): each CTA size of :data:`SWEEP_THREADS`
    whose K tile divides K in 3 to 8 tiles (else the one with the fewest tiles), with 1, 2
    or 4 rows a CTA while that leaves at least 66 CTAs (half the H200's SMs), prefetching
    the whole slice where the register budget allows."""
    fits = [t for t in SWEEP_THREADS if k % (t * VEC) == 0 and k // (t * VEC) <= 8]
    sizes = [t for t in fits if k // (t * VEC) >= 3] or fits[:1]
    out = []
    for threads in sizes:
        tiles = k // (threads * VEC)
        for rows in ROWS[:3]:
            cfg = GemvPdlConfig(threads, rows, min(tiles, MAX_PREFETCH_REGS // (4 * rows)))
            if n // rows >= 66 and config_error(cfg, n, k) is None:
                out.append(cfg)
    return out


def _make_kernel(b: Build):
    import cutlass
    import cutlass.cute as cute

    f32, bf16 = cutlass.Float32, cutlass.BFloat16
    threads, rows, prefetch = b.config
    m = b.m
    warps = threads // 32
    outs = m * rows  # outputs of one CTA
    span = threads * VEC  # columns of one K tile

    def vec_of(t1d, v):
        """The 16-byte-aligned 8 columns ``v`` of a 1-D row view."""
        t = cute.local_tile(t1d, (VEC,), (v,))
        return cute.make_tensor(t.iterator.align(16), t.layout)

    class _K:
        @cute.jit
        def __call__(self, mX, mW, mOut, stream):
            self.kernel(mX, mW, mOut).launch(
                grid=[mW.shape[0] // rows, 1, 1], block=[threads, 1, 1], stream=stream,
                use_pdl=b.pdl)  # fmt: skip

        @cute.kernel
        def kernel(self, mX, mW, mOut):
            tidx, _, _ = cute.arch.thread_idx()
            cta, _, _ = cute.arch.block_idx()
            warp = tidx // 32
            lane = tidx % 32
            if cutlass.const_expr(b.pdl):
                cute.arch.griddepcontrol_launch_dependents()

            smem = cutlass.utils.SmemAllocator()
            s_part = smem.allocate_tensor(f32, cute.make_layout((warps, outs), stride=(outs, 1)), 16)
            tiles = mX.shape[1] // span
            n0 = cta * rows

            # The CTA's weight rows, first `prefetch` K tiles: written by no kernel, so
            # loaded before the wait.
            r_w = cute.make_rmem_tensor(
                cute.make_layout((VEC, rows, prefetch), stride=(1, VEC, VEC * rows)), bf16)  # fmt: skip
            for t in cutlass.range_constexpr(prefetch):
                for r in cutlass.range_constexpr(rows):
                    cute.autovec_copy(vec_of(mW[n0 + r, None], t * threads + tidx), r_w[None, r, t])
            if cutlass.const_expr(b.pdl):
                cute.arch.griddepcontrol_wait()

            acc = cute.make_rmem_tensor(cute.make_layout((outs,)), f32)
            acc.fill(0.0)
            r_x = cute.make_rmem_tensor(cute.make_layout((VEC, m), stride=(1, VEC)), bf16)
            for t in cutlass.range_constexpr(prefetch):
                for i in cutlass.range_constexpr(m):
                    cute.autovec_copy(vec_of(mX[i, None], t * threads + tidx), r_x[None, i])
                for j in cutlass.range_constexpr(VEC):
                    for i in cutlass.range_constexpr(m):
                        xi = r_x[j, i].to(f32)
                        for r in cutlass.range_constexpr(rows):
                            acc[i * rows + r] = acc[i * rows + r] + xi * r_w[j, r, t].to(f32)
            # K tiles past the prefetch (a K wider than the register budget), streamed.
            r_ws = cute.make_rmem_tensor(cute.make_layout((VEC, rows), stride=(1, VEC)), bf16)
            for t in cutlass.range(prefetch, tiles, 1):
                for r in cutlass.range_constexpr(rows):
                    cute.autovec_copy(vec_of(mW[n0 + r, None], t * threads + tidx), r_ws[None, r])
                for i in cutlass.range_constexpr(m):
                    cute.autovec_copy(vec_of(mX[i, None], t * threads + tidx), r_x[None, i])
                for j in cutlass.range_constexpr(VEC):
                    for i in cutlass.range_constexpr(m):
                        xi = r_x[j, i].to(f32)
                        for r in cutlass.range_constexpr(rows):
                            acc[i * rows + r] = acc[i * rows + r] + xi * r_ws[j, r].to(f32)

            for o in cutlass.range_constexpr(outs):
                acc[o] = cute.arch.warp_reduction_sum(acc[o])
            if lane == 0:
                for o in cutlass.range_constexpr(outs):
                    s_part[warp, o] = acc[o]
            cute.arch.sync_threads()
            if tidx < outs:
                tot = s_part[0, tidx]
                for w in cutlass.range_constexpr(1, warps):
                    tot = tot + s_part[w, tidx]
                mOut[tidx // rows, n0 + tidx % rows] = tot.to(bf16)

    return _K()


def compile_build(b: Build, options: str = "--enable-tvm-ffi"):
    """``cute.compile`` the kernel for ``b`` with N, K and the strides dynamic; no GPU
    needed with ``CUTE_DSL_ARCH=sm_90a``. The callable takes ``(x, weight, out, stream)``."""
    import cutlass
    import cutlass.cute as cute
    from cutlass.cute.runtime import make_fake_compact_tensor, make_fake_stream, make_fake_tensor

    bf16 = cutlass.BFloat16
    n = cute.sym_int(divisibility=b.config.rows)
    k = cute.sym_int(divisibility=b.config.threads * VEC)
    x = make_fake_tensor(bf16, (b.m, k), (cute.sym_int(divisibility=VEC), 1), assumed_align=16)
    w = make_fake_tensor(bf16, (n, k), (cute.sym_int(divisibility=VEC), 1), assumed_align=16)
    out = make_fake_compact_tensor(bf16, (b.m, n), stride_order=(1, 0))
    return cute.compile(_make_kernel(b), x, w, out, make_fake_stream(), options=options)


_COMPILED: dict = {}


@functools.cache
def _has_cute_dsl() -> bool:
    import importlib.util

    return importlib.util.find_spec("cutlass") is not None


@functools.cache
def _sm90_or_newer(device_index: int) -> bool:
    import torch

    return torch.cuda.get_device_capability(device_index)[0] >= 9


def use_pdl(device_index: int) -> bool:
    """PDL launches on SM90 or newer (the only GPUs this kernel runs on)."""
    return _sm90_or_newer(device_index)


def operands_error(config: GemvPdlConfig, x, weight) -> str | None:
    """Why :func:`gemv_pdl` would not take ``x`` and ``weight``; None if it takes them:
    a CUDA device of SM90 or newer, the CuTe DSL importable, bf16, M in 1..16, equal K,
    :func:`config_error`, 16-byte rows (row strides multiples of 8, pointers of 16),
    ``weight`` packed, and the build compiled already when the stream is capturing a CUDA
    graph (compiling is host work a capture must not wait on)."""
    import torch

    if x.device.type != "cuda" or weight.device != x.device or not _sm90_or_newer(x.device.index or 0):
        return "needs x and weight on one CUDA GPU of SM90 or newer"
    if not _has_cute_dsl():
        return "nvidia-cutlass-dsl is not installed"
    if x.dtype != torch.bfloat16 or weight.dtype != torch.bfloat16:
        return "x and weight must be BF16"
    if x.dim() != 2 or weight.dim() != 2 or x.shape[1] != weight.shape[1]:
        return "x (M, K) and weight (N, K) must share K"
    if not 1 <= x.shape[0] <= MAX_TOKENS:
        return f"M={x.shape[0]} outside 1..{MAX_TOKENS}"
    why = config_error(config, weight.shape[0], weight.shape[1])
    if why:
        return why
    if x.stride(1) != 1 or weight.stride(1) != 1 or weight.stride(0) != weight.shape[1]:
        return "x needs unit column stride and weight must be packed row-major"
    if x.stride(0) % VEC or x.data_ptr() % 16 or weight.data_ptr() % 16:
        return "rows must start 16-byte aligned"
    b = Build(x.shape[0], config, use_pdl(x.device.index or 0))
    if b not in _COMPILED and torch.cuda.is_current_stream_capturing():
        return f"{b} is not compiled and the stream is capturing"
    return None


def gemv_pdl(x, weight, config: GemvPdlConfig):
    """``x @ weight.T`` (bf16 (M, N)) by this kernel; compiles its build on first use
    (about 1 s on a CPU).

    Raises:
        ValueError: operands or a config :func:`operands_error` refuses.
    """
    why = operands_error(config, x, weight)
    if why:
        raise ValueError(f"gemv_pdl: {why}")
    return launch(config, x, weight)


def launch(config: GemvPdlConfig, x, weight):
    """:func:`gemv_pdl` on operands :func:`operands_error` already passed."""
    import torch
    from cuda.bindings.driver import CUstream  # the CuTe DSL's dependency

    b = Build(x.shape[0], config, use_pdl(x.device.index or 0))
    if b not in _COMPILED:
        _COMPILED[b] = compile_build(b)
    out = torch.empty((x.shape[0], weight.shape[0]), dtype=x.dtype, device=x.device)
    _COMPILED[b](x, weight, out, CUstream(torch.cuda.current_stream(x.device).cuda_stream))
    return out


def warmup(config: GemvPdlConfig, num_tokens: int, device_index: int = 0) -> bool:
    """Compile the build of (M, config) now (before any graph capture); False if it
    exists already."""
    b = Build(num_tokens, config, use_pdl(device_index))
    if b in _COMPILED:
        return False
    _COMPILED[b] = compile_build(b)
    return True
