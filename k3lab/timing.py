"""Timing harness shared by the tuner and the benchmark.

Method (METHOD.md, reference/h200/README.md): capture a CUDA graph of many
calls, each on a different copy of the weight so the copies together exceed
4x the L2 (the H200's is 60 MiB; we rotate >= 256 MiB), replay it several times
and report the median replay time divided by the calls per replay, in µs per
call. Inputs are random normal bf16, never zeros.
"""

from __future__ import annotations

import math
import statistics
from typing import Callable, Optional

import torch

ROTATE_BYTES = 256 << 20  # > 4 x 60 MiB L2
MIN_CALLS = 12


class RotatingWeights:
    """Random bf16 weight copies carved out of one flat buffer.

    ``views(n, k)`` returns ``copies`` distinct ``[N, K]`` contiguous tensors
    with ``copies * 2*N*K >= ROTATE_BYTES`` (and at least 2). The buffer is sized
    for the largest shape asked for up front (``max_weight_bytes``, bytes).
    """

    def __init__(self, max_weight_bytes: int, device="cuda", seed: int = 0):
        copies = max(2, math.ceil(ROTATE_BYTES / max_weight_bytes))
        numel = (copies * max_weight_bytes) // 2 + 4096
        numel = max(numel, ROTATE_BYTES // 2 + 4096)
        gen = torch.Generator(device=device).manual_seed(seed)
        self.buf = torch.randn(numel, generator=gen, dtype=torch.bfloat16, device=device)

    def views(self, n: int, k: int) -> list[torch.Tensor]:
        size = n * k
        copies = max(2, math.ceil(ROTATE_BYTES / (2 * size)))
        copies = min(copies, self.buf.numel() // size)
        if copies < 2:
            raise ValueError(f"rotation buffer too small for {n}x{k}")
        return [self.buf[i * size : (i + 1) * size].view(n, k) for i in range(copies)]


def time_us(
    fn: Callable,
    xs: list[torch.Tensor],
    ws: list[torch.Tensor],
    residual: Optional[torch.Tensor] = None,
    replays: int = 7,
) -> float:
    """Median µs per call of ``fn(x, w[, residual])`` under CUDA-graph replay.

    One graph holds ``max(len(ws), MIN_CALLS)`` calls cycling through the weight
    copies (and activations ``xs``). Raises whatever ``fn`` raises.
    """
    calls = max(len(ws), MIN_CALLS)
    args = [(xs[i % len(xs)], ws[i % len(ws)]) for i in range(calls)]

    def run(pairs):
        for x, w in pairs:
            fn(x, w, residual) if residual is not None else fn(x, w)

    # warm-up: compile, cuBLAS handle, workspace
    return graph_replay_us(lambda: run(args[:3]), lambda: run(args), calls, replays)


def graph_replay_us(warm: Callable[[], object], body: Callable[[], object], per: int,
                    replays: int) -> float:
    """Median µs of one replay of ``body`` captured in a CUDA graph, divided by ``per`` (the
    calls ``body`` makes). ``warm`` runs first on a side stream (compiles, handles), and the
    first replay (which uploads the graph) is not timed. Raises whatever they raise."""
    return segments_replay_us(warm, [body], per, replays)


def segments_replay_us(warm: Callable[[], object], segments: list[Callable[[], object]], per: int,
                       replays: int) -> float:
    """As :func:`graph_replay_us`, but each of ``segments`` is captured as a CUDA graph of its
    own and one replay launches them all in order, back to back: a piecewise capture (vLLM's
    breakable CUDA graphs, whose eager cores sit between the graphs; no PDL crosses from one
    graph to the next). One segment is :func:`graph_replay_us`."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        warm()
    torch.cuda.current_stream().wait_stream(stream)
    torch.cuda.synchronize()
    graphs = []
    for seg in segments:
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            seg()
        graphs.append(graph)
    for graph in graphs:  # the first replay uploads each graph
        graph.replay()
    torch.cuda.synchronize()
    times = []
    for _ in range(replays):
        start = torch.cuda.Event(enable_timing=True)
        end = torch.cuda.Event(enable_timing=True)
        start.record()
        for graph in graphs:
            graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1000.0 / per)
    del graphs
    return statistics.median(times)


def read_bandwidth_Bps(nbytes: int = 4 << 30, replays: int = 9) -> float:
    """HBM read bandwidth in bytes/s, from a bf16 sum over ``nbytes`` (median)."""
    t = torch.randn(nbytes // 2, dtype=torch.bfloat16, device="cuda")
    for _ in range(2):
        t.sum(dtype=torch.float32)
    torch.cuda.synchronize()
    times = []
    for _ in range(replays):
        s = torch.cuda.Event(enable_timing=True)
        e = torch.cuda.Event(enable_timing=True)
        s.record()
        t.sum(dtype=torch.float32)
        e.record()
        e.synchronize()
        times.append(s.elapsed_time(e) / 1000.0)
    del t
    return nbytes / statistics.median(times)


def rel_err(out: torch.Tensor, ref64: torch.Tensor) -> float:
    """‖out − ref‖ / ‖ref‖ in float64; inf if ``out`` holds NaN/Inf."""
    o = out.double()
    if not torch.isfinite(o).all():
        return math.inf
    return float(torch.linalg.vector_norm(o - ref64) / torch.linalg.vector_norm(ref64))


def ref64(x: torch.Tensor, w: torch.Tensor, residual=None) -> torch.Tensor:
    """Float64 reference ``x @ w.T (+ residual)`` on the GPU."""
    r = x.double() @ w.double().t()
    return r if residual is None else r + residual.double()
