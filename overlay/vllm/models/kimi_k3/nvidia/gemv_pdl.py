# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-k3-overlay project
"""PDL-aware skinny BF16 decode GEMM (GEMV style) in the CuTe DSL, SM90+ (vllm-k3-overlay).

``y[M, N] = x[M, K] @ W[N, K]^T`` for the smallest decode token counts (M = 1..16, meant
for M <= 4), bf16 in and out, fp32 accumulation, no tensor cores; and, in the same launch,
``RMSNorm(x; g, eps) @ W^T (+ add_to)`` (:func:`rmsnorm_gemv_pdl`).

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
    """What one compiled kernel is specialized for: M, the config, PDL, and the fusions:
    ``norm`` (RMSNorm of ``x`` in the prologue) and ``add`` (``+ add_to`` in the epilogue)."""

    m: int
    config: GemvPdlConfig
    pdl: bool
    norm: bool = False
    add: bool = False


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
    slots = outs + (m if b.norm else 0)  # + each token's sum of squares
    span = threads * VEC  # columns of one K tile

    def vec_of(t1d, v):
        """The 16-byte-aligned 8 columns ``v`` of a 1-D row view."""
        t = cute.local_tile(t1d, (VEC,), (v,))
        return cute.make_tensor(t.iterator.align(16), t.layout)

    def tile_fma(acc, r_x, mX, v, w_tile, g_tile):
        """One K tile: the M tokens' vectors ``v`` of x into ``r_x``, then each output's
        dot products with ``w_tile`` (VEC, rows) (and, with the norm, the sums of squares
        and x * g). Plain Python, so its loops unroll as the kernel is traced."""
        for i in range(m):
            cute.autovec_copy(vec_of(mX[i, None], v), r_x[None, i])
        for j in range(VEC):
            for i in range(m):
                xi = r_x[j, i].to(f32)
                if b.norm:
                    acc[outs + i] = acc[outs + i] + xi * xi
                    xi = xi * g_tile[j].to(f32)
                for r in range(rows):
                    acc[i * rows + r] = acc[i * rows + r] + xi * w_tile[j, r].to(f32)

    class _K:
        # One host entry per fusion, so no optional operand crosses the host boundary.
        @cute.jit
        def plain(self, mX, mW, mOut, stream):
            self.kernel(mX, mW, mOut, None, None, f32(0.0)).launch(
                grid=[mW.shape[0] // rows, 1, 1], block=[threads, 1, 1], stream=stream, use_pdl=b.pdl)  # fmt: skip

        @cute.jit
        def norm(self, mX, mG, mW, mOut, eps: cutlass.Float32, stream):
            self.kernel(mX, mW, mOut, mG, None, eps).launch(
                grid=[mW.shape[0] // rows, 1, 1], block=[threads, 1, 1], stream=stream, use_pdl=b.pdl)  # fmt: skip

        @cute.jit
        def norm_add(self, mX, mG, mW, mAdd, mOut, eps: cutlass.Float32, stream):
            self.kernel(mX, mW, mOut, mG, mAdd, eps).launch(
                grid=[mW.shape[0] // rows, 1, 1], block=[threads, 1, 1], stream=stream, use_pdl=b.pdl)  # fmt: skip

        @cute.kernel
        def kernel(self, mX, mW, mOut, mG, mAdd, eps: cutlass.Float32):
            tidx, _, _ = cute.arch.thread_idx()
            cta, _, _ = cute.arch.block_idx()
            warp = tidx // 32
            lane = tidx % 32
            if cutlass.const_expr(b.pdl):
                cute.arch.griddepcontrol_launch_dependents()

            smem = cutlass.utils.SmemAllocator()
            s_part = smem.allocate_tensor(f32, cute.make_layout((warps, slots), stride=(slots, 1)), 16)
            tiles = mX.shape[1] // span
            n0 = cta * rows

            # The CTA's weight rows (and the norm's weight), first `prefetch` K tiles:
            # parameters, written by no kernel, so loaded before the wait.
            r_w = cute.make_rmem_tensor(
                cute.make_layout((VEC, rows, prefetch), stride=(1, VEC, VEC * rows)), bf16)  # fmt: skip
            r_g = cute.make_rmem_tensor(cute.make_layout((VEC, prefetch), stride=(1, VEC)), bf16)
            for t in cutlass.range_constexpr(prefetch):
                for r in cutlass.range_constexpr(rows):
                    cute.autovec_copy(vec_of(mW[n0 + r, None], t * threads + tidx), r_w[None, r, t])
                if cutlass.const_expr(b.norm):
                    cute.autovec_copy(vec_of(mG, t * threads + tidx), r_g[None, t])
            if cutlass.const_expr(b.pdl):
                cute.arch.griddepcontrol_wait()

            acc = cute.make_rmem_tensor(cute.make_layout((slots,)), f32)
            acc.fill(0.0)
            r_x = cute.make_rmem_tensor(cute.make_layout((VEC, m), stride=(1, VEC)), bf16)
            for t in cutlass.range_constexpr(prefetch):
                tile_fma(acc, r_x, mX, t * threads + tidx, r_w[None, None, t], r_g[None, t])
            # K tiles past the prefetch (a K wider than the register budget), streamed.
            r_ws = cute.make_rmem_tensor(cute.make_layout((VEC, rows), stride=(1, VEC)), bf16)
            r_gs = cute.make_rmem_tensor(cute.make_layout((VEC,)), bf16)
            for t in cutlass.range(prefetch, tiles, 1):
                for r in cutlass.range_constexpr(rows):
                    cute.autovec_copy(vec_of(mW[n0 + r, None], t * threads + tidx), r_ws[None, r])
                if cutlass.const_expr(b.norm):
                    cute.autovec_copy(vec_of(mG, t * threads + tidx), r_gs)
                tile_fma(acc, r_x, mX, t * threads + tidx, r_ws, r_gs)

            for o in cutlass.range_constexpr(slots):
                acc[o] = cute.arch.warp_reduction_sum(acc[o])
            if lane == 0:
                for o in cutlass.range_constexpr(slots):
                    s_part[warp, o] = acc[o]
            cute.arch.sync_threads()
            if tidx < outs:
                tot = s_part[0, tidx]
                for w in cutlass.range_constexpr(1, warps):
                    tot = tot + s_part[w, tidx]
                i = tidx // rows
                if cutlass.const_expr(b.norm):
                    # RMSNorm is linear in x after its scale: sum(x*g*w) * rsqrt(mean(x^2) + eps).
                    ss = s_part[0, outs + i]
                    for w in cutlass.range_constexpr(1, warps):
                        ss = ss + s_part[w, outs + i]
                    tot = tot * cute.math.rsqrt(ss / mX.shape[1].to(f32) + eps)
                if cutlass.const_expr(b.add):
                    tot = tot + mAdd[i, n0 + tidx % rows].to(f32)
                mOut[i, n0 + tidx % rows] = tot.to(bf16)

    return _K()


def compile_build(b: Build, options: str = "--enable-tvm-ffi"):
    """``cute.compile`` the kernel for ``b`` with N, K and the strides dynamic; no GPU
    needed with ``CUTE_DSL_ARCH=sm_90a``. The callable takes ``(x, weight, out, stream)``;
    with ``norm``, ``(x, g, weight, out, eps, stream)``; with ``norm`` and ``add``,
    ``(x, g, weight, add_to, out, eps, stream)``.

    Raises:
        ValueError: ``add`` without ``norm`` (no site needs it).
    """
    import cutlass
    import cutlass.cute as cute
    from cutlass.cute.runtime import make_fake_compact_tensor, make_fake_stream, make_fake_tensor

    if b.add and not b.norm:
        raise ValueError(f"{b}: the addend epilogue is built only with the norm prologue")
    bf16 = cutlass.BFloat16
    n = cute.sym_int(divisibility=b.config.rows)
    k = cute.sym_int(divisibility=b.config.threads * VEC)
    x = make_fake_tensor(bf16, (b.m, k), (cute.sym_int(divisibility=VEC), 1), assumed_align=16)
    w = make_fake_tensor(bf16, (n, k), (cute.sym_int(divisibility=VEC), 1), assumed_align=16)
    out = make_fake_compact_tensor(bf16, (b.m, n), stride_order=(1, 0))
    kern, stream = _make_kernel(b), make_fake_stream()
    if not b.norm:
        return cute.compile(kern.plain, x, w, out, stream, options=options)
    g = make_fake_tensor(bf16, (k,), (1,), assumed_align=16)
    eps = cutlass.Float32(1e-6)
    if not b.add:
        return cute.compile(kern.norm, x, g, w, out, eps, stream, options=options)
    add = make_fake_compact_tensor(bf16, (b.m, n), stride_order=(1, 0))
    return cute.compile(kern.norm_add, x, g, w, add, out, eps, stream, options=options)


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


def operands_error(config: GemvPdlConfig, x, weight, norm_weight=None, add_to=None) -> str | None:
    """Why :func:`gemv_pdl` (or, with ``norm_weight``, :func:`rmsnorm_gemv_pdl`) would not
    take these operands; None if it takes them: a CUDA device of SM90 or newer, the CuTe
    DSL importable, bf16, M in 1..16, equal K, :func:`config_error`, 16-byte rows (row
    strides multiples of 8, pointers of 16), ``weight`` packed, ``norm_weight`` a
    contiguous (K,), ``add_to`` a packed (M, N) and only with ``norm_weight``, and the
    build compiled already when the stream is capturing a CUDA graph (compiling is host
    work a capture must not wait on)."""
    import torch

    if x.device.type != "cuda" or weight.device != x.device or not _sm90_or_newer(x.device.index or 0):
        return "needs x and weight on one CUDA GPU of SM90 or newer"
    if not _has_cute_dsl():
        return "nvidia-cutlass-dsl is not installed"
    extra = [t for t in (norm_weight, add_to) if t is not None]
    if any(t.dtype != torch.bfloat16 for t in (x, weight, *extra)):
        return "every operand must be BF16"
    if any(t.device != x.device for t in extra):
        return "every operand must be on x's device"
    if x.dim() != 2 or weight.dim() != 2 or x.shape[1] != weight.shape[1]:
        return "x (M, K) and weight (N, K) must share K"
    m, (n, k) = x.shape[0], weight.shape
    if not 1 <= m <= MAX_TOKENS:
        return f"M={m} outside 1..{MAX_TOKENS}"
    why = config_error(config, n, k)
    if why:
        return why
    if x.stride(1) != 1 or weight.stride(1) != 1 or weight.stride(0) != k:
        return "x needs unit column stride and weight must be packed row-major"
    if x.stride(0) % VEC or x.data_ptr() % 16 or weight.data_ptr() % 16:
        return "rows must start 16-byte aligned"
    if norm_weight is not None and (norm_weight.shape != (k,) or norm_weight.stride() != (1,)
                                    or norm_weight.data_ptr() % 16):  # fmt: skip
        return "norm_weight must be a contiguous, 16-byte aligned (K,)"
    if add_to is not None and (norm_weight is None or add_to.shape != (m, n) or add_to.stride() != (n, 1)):
        return "add_to must be a packed (M, N), with norm_weight"
    b = _build(x, config, norm_weight, add_to)
    if b not in _COMPILED and torch.cuda.is_current_stream_capturing():
        return f"{b} is not compiled and the stream is capturing"
    return None


def _build(x, config: GemvPdlConfig, norm_weight=None, add_to=None) -> Build:
    return Build(x.shape[0], config, use_pdl(x.device.index or 0), norm_weight is not None, add_to is not None)


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


def rmsnorm_gemv_pdl(x, norm_weight, eps: float, weight, config: GemvPdlConfig, add_to=None):
    """``RMSNorm(x; norm_weight, eps) @ weight.T (+ add_to)``, bf16 (M, N), in one launch:
    each thread keeps its tokens' sums of squares beside the dot products (``x * g`` in
    fp32), reduced with them; the output is scaled by ``rsqrt(mean(x^2) + eps)`` before
    the addend. ``norm_weight`` is a parameter, so it is loaded before the wait.

    Raises:
        ValueError: operands or a config :func:`operands_error` refuses.
    """
    why = operands_error(config, x, weight, norm_weight, add_to)
    if why:
        raise ValueError(f"gemv_pdl: {why}")
    return launch(config, x, weight, norm_weight, eps, add_to)


def _compiled(b: Build):
    if b not in _COMPILED:
        _COMPILED[b] = compile_build(b)
    return _COMPILED[b]


def launch(config: GemvPdlConfig, x, weight, norm_weight=None, eps: float = 0.0, add_to=None):
    """:func:`gemv_pdl` / :func:`rmsnorm_gemv_pdl` on operands :func:`operands_error`
    already passed."""
    import torch
    from cuda.bindings.driver import CUstream  # the CuTe DSL's dependency

    fn = _compiled(_build(x, config, norm_weight, add_to))
    out = torch.empty((x.shape[0], weight.shape[0]), dtype=x.dtype, device=x.device)
    stream = CUstream(torch.cuda.current_stream(x.device).cuda_stream)
    if norm_weight is None:
        fn(x, weight, out, stream)
    elif add_to is None:
        fn(x, norm_weight, weight, out, eps, stream)
    else:
        fn(x, norm_weight, weight, add_to, out, eps, stream)
    return out


def warmup(config: GemvPdlConfig, num_tokens: int, device_index: int = 0, *, norm: bool = False,
           add: bool = False) -> bool:  # fmt: skip
    """Compile the build of (M, config, fusions) now (before any graph capture); False if
    it exists already."""
    b = Build(num_tokens, config, use_pdl(device_index), norm, add)
    if b in _COMPILED:
        return False
    _compiled(b)
    return True
