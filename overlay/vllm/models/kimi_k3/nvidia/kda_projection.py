# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-k3-overlay project
"""Kimi-K3 KDA decode projections on two CUDA streams (vllm-k3-overlay).

At decode a KDA (Kimi Delta Attention) layer of Kimi-K3 at TP8 reads one packed BF16
projection weight ``in_proj_qkvgfab`` ``[6288, 7168]`` (rows 0..6143 Q/K/V/G, four
blocks of 1536; then F_A, 128 rows; beta, 12 rows; 4 rows of zero padding) and a small
``f_b_proj`` weight ``[1536, 128]`` applied to F_A's output. vLLM v0.28.0 runs them one
after the other: the packed GEMM, then F_B on a strided F_A slice. The QKVG GEMM and
the F_A/beta -> F_B chain are independent, so at decode this module runs QKVG on the
current stream and the chain on the model's aux stream, forked and joined with two
CUDA events, each GEMM through the low-latency table of the device
(:mod:`low_latency_gemm_dispatch`). Shapes of the three GEMMs at TP8 (local ``(N, K)``):

=========  ================  =========================================
GEMM       weight (N, K)     what
=========  ================  =========================================
QKVG       (6144, 7168)      rows 0..6143 of the packed weight (a view)
F_A/beta   (144, 7168)       rows 6144..6287 of the packed weight
F_B        (1536, 128)       ``f_b_proj``, input F_A ``[M, 128]``
=========  ================  =========================================

Whether the overlap pays depends on the GPU and M: the fork and join cost a few µs that
the hidden chain must pay back, so each architecture has the set of M at which it
measured faster (:data:`KDA_OVERLAP_TOKENS`, with its source) and the layer overlaps only
there, only under CUDA-graph capture (decode); prefill and eager forwards keep v0.28.0's
path (patch 0003 to ``kda.py``). An architecture nobody measured gets none.

The chain may also run on a stream of higher priority (:func:`high_priority_aux_stream`;
CUDA graphs captured by PyTorch keep each kernel's priority), so that the GPU dispatches
its blocks before the rest of the QKVG GEMM's; an architecture uses it only where that
measured faster (``OverlapTokens.high_priority_aux``), as on the H200.

Entry points: :func:`run_kda_projection_overlap` (the forward), and
:func:`enable_kda_projection_overlap` (called by the model at construction, right after
``enable_kimi_k3_low_latency_gemm``: patch 0004), which qualifies layers and runs
:func:`autotune_kda_qkvg`. This module uses the dispatch; the dispatch does not know it.
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Collection, Iterator, Mapping
from types import MappingProxyType
from typing import NamedTuple

import torch
from torch import nn

from vllm.logger import init_logger
from vllm.models.kimi_k3.nvidia import low_latency_gemm_dispatch as llg

logger = init_logger(__name__)

#: Local shapes at TP8 (see the module docstring).
KDA_TP_SIZE = 8
KDA_PACKED_SHAPE: llg.Shape = (6288, 7168)
KDA_F_B_SHAPE: llg.Shape = (1536, 128)

#: The QKVG GEMM of FlashInfer's low-M BF16 backend, where the installed FlashInfer has it.
FLASHINFER_QKVG_BACKEND = "cute-dsl"


class OverlapTokens(NamedTuple):
    """Token counts M at which the overlap runs on one architecture, and their source.

    ``high_priority_aux``: the chain runs on :func:`high_priority_aux_stream` (measured
    faster there) rather than on the model's aux stream.
    """

    tokens: frozenset[int]
    source: str
    high_priority_aux: bool = False


#: H200 (SM90): the M of ``results/kda/kda_bench_sm90.json`` at which the chosen
#: overlap (see below) beat (B), our sequential path, in both timing passes, with the table
#: as committed: M 1 (by 0.66 µs) and every M from 5 (by 1.4-3.1 µs, 1.05-1.12x). At M 2-4
#: the packed GEMM's CuTe rows run (B) at 1.05-1.15x the read roof, and the overlap, whose
#: QKVG GEMM alone takes about as long as the packed one, lost by 0.15-0.71 µs. Since
#: 2026-12-02 the SM90 table gives those packed rows to swap-AB (the chain penalty of
#: k3lab's winners.py); the decode-step replay of that day measured the patched KDA layer
#: with these token counts 4.5 µs faster at M = 3 and within 0.5 µs elsewhere; the
#: overlap itself at M 2-4 was not re-measured against the new rows.
SM90_OVERLAP_TOKENS = (1, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16)
SM90_OVERLAP_SOURCE = (
    "NVIDIA H200 (SM90), run h200-20261130-1347-kda (2026-11-30), "
    "results/kda/kda_bench_sm90.json: (D) faster than (B) in both timing passes"
)
#: That run's ``high_priority_aux``: the chain on :func:`high_priority_aux_stream` (D)
#: summed lower than on a default-priority stream (C) over M 1..16, each only where it won
#: (410.4 against 412.1 µs). The difference is M 1, where (D) beat (B) and (C) did not,
#: in both of our runs ((D) 23.2 µs in each, (C) 24.2 and 23.6, (B) 23.9 and 23.4); from
#: M 5 on, (C) and (D) were within 0.4 µs of each other.
SM90_HIGH_PRIORITY_AUX = True

#: Per architecture, where the overlap measured faster than the sequential path.
KDA_OVERLAP_TOKENS: Mapping[llg.Capability, OverlapTokens] = MappingProxyType(
    {
        (9, 0): OverlapTokens(
            frozenset(SM90_OVERLAP_TOKENS), SM90_OVERLAP_SOURCE, SM90_HIGH_PRIORITY_AUX
        )
    }
)

#: Any architecture without figures of ours (B300's upstream limit of 14 is not reused).
NOT_MEASURED = OverlapTokens(frozenset(), "not measured on this architecture: overlap off")
#: With the breakable flag on (v0.28.0's default for Kimi-K3) a decode batch is still one
#: full CUDA graph with vLLM's forks, but there the two-stream path measured no faster than
#: the packed GEMM on the table. In the replay of the default H200 mode, one lease
#: (results/decode_step/decode_step_h200-default_2026-12-04_kda_{overlap,packed}.json), the
#: KDA layer's speedup over stock was 1.289 against 1.298 at M = 1, 1.249 against 1.234 at
#: M = 8 and 1.238 against 1.235 at M = 16, within the run's noise. The overlap would also
#: add a second stream and FlashInfer's tuning at load. So the layer keeps its packed
#: ``in_proj_qkvgfab`` and ``f_b_proj`` lines there, whose linear methods are the table's
#: planned kernels (SM90 rows (6288, 7168) and (1536, 128), installed and warmed by
#: ``enable_kimi_k3_low_latency_gemm``). The opt-out (flag 0) keeps the measured set.
FLAG_DEFAULT = OverlapTokens(
    frozenset(),
    "off with VLLM_USE_BREAKABLE_CUDAGRAPH on (v0.28.0's default): no faster than the packed "
    "GEMM on the table in the default decode graph",
)


@functools.cache
def high_priority_aux_stream(device: torch.device) -> torch.cuda.Stream:
    """One stream per device at a priority above the default (PyTorch's priority -1).

    Shared by every KDA layer on ``device``: layers run one after another and each joins
    the stream before it returns.
    """
    return torch.cuda.Stream(device=device, priority=-1)


def overlap_tokens(capability: llg.Capability | None) -> OverlapTokens:
    """Where the overlap runs on ``capability``; :data:`NOT_MEASURED` without figures."""
    if capability is None:
        return NOT_MEASURED
    return KDA_OVERLAP_TOKENS.get(tuple(capability), NOT_MEASURED)


def deployment_overlap_tokens(capability: llg.Capability | None) -> OverlapTokens:
    """Where the overlap runs in this process: :func:`overlap_tokens`, or :data:`FLAG_DEFAULT`
    where that set is not empty and ``VLLM_USE_BREAKABLE_CUDAGRAPH`` is on. What
    :func:`autotune_kda_qkvg` gives the layers, and what the decode-step replay of a mode runs."""
    where = overlap_tokens(capability)
    return FLAG_DEFAULT if where.tokens and _breakable_flag() else where


def _breakable_flag() -> bool:
    from vllm.compilation.breakable_cudagraph import is_breakable_cudagraph_enabled

    # v0.34.0 keeps the flag in compilation_config (the environment variable only its
    # fallback), read from the config it is given; v0.28.0's function takes none. Outside
    # a config's context (the decode-step replay) the variable decides, as on v0.28.0.
    if "compilation_config" not in inspect.signature(is_breakable_cudagraph_enabled).parameters:
        return is_breakable_cudagraph_enabled()
    from vllm.config import get_current_vllm_config_or_none

    config = get_current_vllm_config_or_none()
    return is_breakable_cudagraph_enabled(config.compilation_config if config is not None else None)


def use_kda_projection_overlap(num_tokens: int, tokens: Collection[int]) -> bool:
    """Whether a KDA forward of ``num_tokens`` tokens takes the two-stream path.

    Only for ``num_tokens`` in the layer's ``tokens`` (the architecture's measured set,
    all in 1..16) while a CUDA graph is being captured: vLLM captures decode steps only,
    so prefill and eager forwards keep v0.28.0's path.
    Not under vLLM's breakable capture (a mixed batch, or decode under
    ``cudagraph_mode=PIECEWISE``), where vLLM keeps to one stream (its
    ``maybe_execute_in_parallel`` rule) and the overlap was never measured; said once
    in the log.
    """
    if num_tokens not in tokens or not torch.cuda.is_current_stream_capturing():
        return False
    from vllm.compilation.breakable_cudagraph import BreakableCUDAGraphCapture

    if not BreakableCUDAGraphCapture.is_active():
        return True
    if not _breakable_refusal_logged:
        _breakable_refusal_logged.append(True)
        logger.info(
            "Kimi-K3 KDA projections: the packed GEMM under a breakable CUDA-graph capture "
            "(one stream), where the two-stream overlap was not measured"
        )
    return False


_breakable_refusal_logged: list[bool] = []  # once per process


# ---------------------------------------------------------------------- the GEMMs


def _table_gemm(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """``x @ weight.T`` on the device table's kernel, else cuBLAS (``torch.mm``)."""
    out = llg.try_low_latency_gemm(x, weight)
    return torch.mm(x, weight.t()) if out is None else out


def _qkvg_gemm(x: torch.Tensor, weight: torch.Tensor, backend: str | None) -> torch.Tensor:
    if backend == FLASHINFER_QKVG_BACKEND:
        import flashinfer

        # FlashInfer takes the weight as a column-major (K, N) operand.
        return flashinfer.mm_bf16(x, weight.t(), backend=backend)
    return _table_gemm(x, weight)


def run_kda_projection_overlap(
    hidden_states: torch.Tensor,
    packed_weight: torch.Tensor,
    f_b_weight: torch.Tensor,
    aux_stream: torch.cuda.Stream | None,
    events: tuple[torch.cuda.Event, torch.cuda.Event],
    *,
    qkvg_backend: str | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """KDA decode projections: QKVG here, F_A/beta then F_B on ``aux_stream``.

    Args:
        hidden_states: ``[M, K]`` BF16 (K = 7168 at TP8).
        packed_weight: ``in_proj_qkvgfab.weight``, ``[4*P + D + H + pad, K]`` BF16
            (``[6288, 7168]`` at TP8), packed row-major.
        f_b_weight: ``f_b_proj.weight``, ``[P, D]`` BF16 (``[1536, 128]``); P = H * D
            is the local projection size, D the head dim, H the local head count.
        aux_stream: the second stream; None runs everything on the current stream.
        events: ``(fork, join)``: ``fork`` recorded on the current stream before QKVG
            and waited on by ``aux_stream``; ``join`` recorded on ``aux_stream`` after
            F_B and waited on by the current stream (vLLM's ``maybe_execute_in_parallel``
            pattern, without its breakable-capture switch: :func:`use_kda_projection_overlap`
            decides that before this is called).
        qkvg_backend: ``"cute-dsl"`` for FlashInfer's BF16 GEMM, None for the table.

    Returns:
        ``(qkvg [M, 4*P], f_b_out [M, P], beta [M, H])``, each with unit column stride:
        ``qkvg`` and ``f_b_out`` packed, ``beta`` a view with row stride ``D + H + pad``,
        the same values (up to GEMM rounding) as v0.28.0's sequential path. Safe under
        CUDA-graph capture: the aux work joins the current stream before returning.
    """
    proj, head_dim = f_b_weight.shape
    heads = proj // head_dim
    qkvg_weight = packed_weight[: 4 * proj]
    fab_weight = packed_weight[4 * proj :]

    def qkvg() -> torch.Tensor:
        return _qkvg_gemm(hidden_states, qkvg_weight, qkvg_backend)

    def f_a_chain() -> tuple[torch.Tensor, torch.Tensor]:
        fab = _table_gemm(hidden_states, fab_weight)
        f_b_out = _table_gemm(fab[:, :head_dim], f_b_weight)
        return f_b_out, fab[:, head_dim : head_dim + heads]

    if aux_stream is None:
        return qkvg(), *f_a_chain()
    fork, join = events
    fork.record()
    qkvg_out = qkvg()
    with torch.cuda.stream(aux_stream):
        fork.wait()
        f_b_out, beta = f_a_chain()
        join.record()
    join.wait()
    return qkvg_out, f_b_out, beta


# ----------------------------------------------------------------- qualification


def _plain_bf16_linear(linear: nn.Module | None, shape: llg.Shape) -> bool:
    """Unquantized (or our planned) BF16 linear of local weight ``shape`` on the GPU."""
    method = type(getattr(linear, "quant_method", None))
    if method not in (llg.UnquantizedLinearMethod, llg.KimiK3LowLatencyLinearMethod):
        return False
    weight = getattr(linear, "weight", None)
    return (
        isinstance(weight, torch.Tensor)
        and tuple(weight.shape) == shape
        and weight.dtype is torch.bfloat16
        and weight.device.type == llg._FAST_PATH_DEVICE_TYPE
        and llg._is_packed_row_major(weight)
    )


def _qualifies(layer: nn.Module) -> bool:
    """A KDA layer (patched ``kda.py``) at TP8 with BF16 weights of the exact shapes."""
    if not hasattr(layer, "kda_overlap_tokens"):
        return False
    return (
        getattr(layer, "tp_size", None) == KDA_TP_SIZE
        and getattr(layer, "aux_stream", None) is not None
        and getattr(layer, "kda_overlap_events", None) is not None
        and _plain_bf16_linear(getattr(layer, "in_proj_qkvgfab", None), KDA_PACKED_SHAPE)
        and _plain_bf16_linear(getattr(layer, "f_b_proj", None), KDA_F_B_SHAPE)
    )


def qualifying_layers(model: nn.Module) -> Iterator[nn.Module]:
    """KDA layers under ``model`` the overlap may serve (see :func:`_qualifies`)."""
    return (layer for layer in model.modules() if _qualifies(layer))


# ---------------------------------------------------------------------- autotune


def _kda_qkvg_flashinfer_backend() -> str | None:
    """``"cute-dsl"`` if the installed FlashInfer offers it for this GPU, else None.

    Detected, not assumed from a version: FlashInfer's ``mm_bf16`` must declare the
    backend and accept this compute capability (SM100/SM103 in 0.7.2.post1; v0.28.0's
    pinned 0.6.16.post3 has no such backend). None without a CUDA device or FlashInfer.
    """
    capability = llg._device_capability()
    if capability is None:
        return None
    try:
        import flashinfer
    except Exception:  # absent, or a broken install: keep our own kernels
        return None
    supported = getattr(getattr(flashinfer, "mm_bf16", None), "is_backend_supported", None)
    if supported is None:
        return None
    try:
        ok = supported(FLASHINFER_QKVG_BACKEND, 10 * capability[0] + capability[1])
    except (TypeError, ValueError):
        return None
    return FLASHINFER_QKVG_BACKEND if ok else None


def _tune_flashinfer_qkvg(qkvg_weight: torch.Tensor, tokens: Collection[int]) -> None:
    """Warm FlashInfer's QKVG GEMM and let its autotuner time it at each M of ``tokens``."""
    import flashinfer

    with torch.inference_mode(), flashinfer.autotune(True):
        for m in sorted(tokens):
            x = torch.randn(m, qkvg_weight.shape[1], dtype=qkvg_weight.dtype,
                            device=qkvg_weight.device)  # fmt: skip
            flashinfer.mm_bf16(x, qkvg_weight.t(), backend=FLASHINFER_QKVG_BACKEND)


def request_overlap_warmup(packed_weight: torch.Tensor, f_b_weight: torch.Tensor) -> None:
    """Warm up, before graph capture, the table's kernels of the overlap's three GEMMs (QKVG
    and F_A/beta, row views of ``packed_weight``, and F_B): a build first seen inside the
    capture would be refused there and the GEMM would fall back to ``torch.mm``."""
    proj = f_b_weight.shape[0]
    for weight in (packed_weight[: 4 * proj], packed_weight[4 * proj :], f_b_weight):
        llg.request_low_latency_warmup(weight)


def autotune_kda_qkvg(model: nn.Module) -> int:
    """Set up every qualifying KDA layer's decode projections; call before capture.

    Per layer: the QKVG backend, FlashInfer's ``cute-dsl`` BF16 GEMM where the installed
    FlashInfer offers it for this GPU (warmed and tuned by its autotuner at each M the
    overlap runs at), else our table (its kernels warmed up for the QKVG, F_A/beta and
    F_B rows); ``kda_overlap_tokens``, this architecture's measured set of M
    (:func:`overlap_tokens`; empty where nothing was measured: overlap off); and, where
    the architecture measured it faster, ``aux_stream`` replaced by
    :func:`high_priority_aux_stream`. With ``VLLM_USE_BREAKABLE_CUDAGRAPH`` on (v0.28.0's
    default for Kimi-K3) nothing of the overlap is set up (:data:`FLAG_DEFAULT`: measured
    no faster there), and the log says so; a breakable capture also turns it off per call
    (:func:`use_kda_projection_overlap`).

    Args:
        model: model (or sub-model) to walk; qualifying layers are changed in place.

    Returns:
        How many layers were set (0 on CPU, without TP8 KDA layers, or non-BF16).
    """
    layers = list(qualifying_layers(model))
    if not layers:
        return 0
    where = deployment_overlap_tokens(llg._device_capability())
    backend = _kda_qkvg_flashinfer_backend() if where.tokens else None
    for layer in layers:
        layer.kda_qkvg_backend = backend
        layer.kda_overlap_tokens = where.tokens
        if where.tokens and where.high_priority_aux:
            layer.aux_stream = high_priority_aux_stream(layer.in_proj_qkvgfab.weight.device)
    # Every layer has the same shapes: one warm-up (or tuning) covers them all.
    packed, f_b = layers[0].in_proj_qkvgfab.weight, layers[0].f_b_proj.weight
    if where.tokens and backend is not None:
        _tune_flashinfer_qkvg(packed[: 4 * f_b.shape[0]], where.tokens)
    elif where.tokens:
        request_overlap_warmup(packed, f_b)
    logger.info(
        "Kimi-K3 KDA projections: %d layers, overlap at M %s (%s), QKVG on %s",
        len(layers), sorted(where.tokens), where.source, backend or "the low-latency table",
    )  # fmt: skip
    return len(layers)


def enable_kda_projection_overlap(module: nn.Module, dtype: torch.dtype) -> int:
    """Qualify the KDA layers under ``module`` and run :func:`autotune_kda_qkvg`.

    Call after ``enable_kimi_k3_low_latency_gemm`` on the same module. A layer qualifies
    at TP8 with BF16 weights of exactly ``[6288, 7168]`` (``in_proj_qkvgfab``) and
    ``[1536, 128]`` (``f_b_proj``), unquantized or planned, on the GPU, with an aux
    stream and events (patch 0003). Others keep ``kda_overlap_tokens`` empty.

    Returns:
        How many layers were set up (0 for a ``dtype`` other than BF16, or on a device
        without a low-latency table, where the dispatch installs nothing either).
    """
    if dtype is not torch.bfloat16 or llg.device_table() is None:
        return 0
    return autotune_kda_qkvg(module)
