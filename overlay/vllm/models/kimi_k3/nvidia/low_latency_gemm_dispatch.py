# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-k3-overlay project
"""Shape-dispatched BF16 decode GEMMs for Kimi-K3 (vllm-k3-overlay).

At decode, M (the token count of a step) is 1..16 and every dense BF16 projection of
Kimi-K3 is bound by streaming its weight from HBM. cuBLAS picks kernels built for
larger M and leaves 10-60% of that bandwidth unused; the backends of ``gemm_backends/``
(one module each, vLLM's, FlashInfer's and our own kernels) can do better. Which one wins
depends on the GPU, the weight shape and M, so the decision is a table of measurements
per GPU architecture (``low_latency_gemm_spec``, each figure with its source); anything
a table does not route keeps cuBLAS.

This module replaces, for the Kimi-K3 model, vLLM's ``low_latency_gemm.py``, which stays
upstream's own: the model and its MTP layer import :func:`enable_kimi_k3_low_latency_gemm`
from here (patches 0002 and 0004). It keeps upstream's public API (:func:`select_kimi_k3_backend`,
:func:`try_low_latency_gemm`, :func:`enable_kimi_k3_low_latency_gemm`, the methods it
installs) and the dispatch core:

* :func:`enable_kimi_k3_low_latency_gemm` resolves the table once per layer at model
  construction into a ``{M: call}`` plan (entries whose backend this build lacks are
  dropped) and warms the planned kernels up, so a forward costs one dict lookup before
  it either launches the chosen kernel or defers to the unquantized method it replaced;
* the guards: a forward never raises for an input a kernel would refuse. The dispatch
  checks what every backend needs (BF16, one CUDA device, equal K, row-major ``x``,
  packed ``weight``, no bias, no ``VLLM_BATCH_INVARIANT``), the backend the rest
  (``GemmBackend.operands_ok``); anything else returns to the layer's normal path.

No backend is named here: a call's backend is looked up by its table name in the
registry. The KDA layers' two-stream projections (``kda_projection``) are enabled by the
model right after this (patch 0004).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any, NamedTuple

import torch
from torch import nn

from vllm import envs
from vllm.logger import init_logger
from vllm.model_executor.layers.linear import (
    LinearBase,
    UnquantizedLinearMethod,
)
from vllm.model_executor.layers.vocab_parallel_embedding import (
    ParallelLMHead,
    UnquantizedEmbeddingMethod,
)
from vllm.models.kimi_k3.nvidia import gemm_backends
from vllm.models.kimi_k3.nvidia.gemm_backends.base import (
    Capability,
    WarmupCall,
    is_packed_row_major,
    is_row_major,
)
from vllm.models.kimi_k3.nvidia.low_latency_fused_dispatch import enable_kimi_k3_fused_decode
from vllm.models.kimi_k3.nvidia.low_latency_gemm_spec import (  # noqa: F401 (public API)
    DECODE_TOKEN_COUNTS,
    KIMI_K3_PROJECTIONS,
    KIMI_K3_PROJECTIONS_SM90,
    KIMI_K3_PROJECTIONS_SM100,
    TABLES_BY_CAPABILITY,
    PlannedCall,
    ProjectionSpec,
    Shape,
    ShapeTable,
    config_from_data,
)
from vllm.platforms import current_platform

logger = init_logger(__name__)

#: Names of the registered backends (``gemm_backends``), as the tables spell them.
BACKENDS: tuple[str, ...] = tuple(gemm_backends.BACKENDS)

# Device type the fast paths run on. A module constant so that CPU tests can point it
# at "cpu" and drive the fast path through a fake kernel.
_FAST_PATH_DEVICE_TYPE = "cuda"


class RoutedRow(NamedTuple):
    """A (shape, M) that a table sends to a fast kernel; see :func:`routed_rows`."""

    n: int
    k: int
    num_tokens: int
    backend: str
    config: Any
    has_residual: bool


# ------------------------------------------------------------------------ routing


def _device_capability() -> Capability | None:
    """Compute capability of the current device, None without a CUDA device."""
    # ROCm reports gfx90a as (9, 0): only NVIDIA capabilities name our tables.
    if not current_platform.is_cuda():
        return None
    capability = current_platform.get_device_capability()
    if capability is None:
        return None
    return (capability.major, capability.minor)


def table_for_capability(capability: Capability | None) -> ShapeTable | None:
    """Measured table for a ``(major, minor)`` capability, or None if it has none."""
    if capability is None:
        return None
    return TABLES_BY_CAPABILITY.get(tuple(capability))


def device_table() -> ShapeTable | None:
    """Table of the current device; None on CPU or an architecture without one."""
    return table_for_capability(_device_capability())


def _backend_for(spec: ProjectionSpec, num_tokens: int, has_residual: bool) -> str | None:
    if has_residual:
        has_config = spec.residual_config(num_tokens) is not None
        return gemm_backends.residual_backend().name if has_config else None
    call = spec.winner(num_tokens)
    return None if call is None else call.backend


def select_kimi_k3_backend(
    num_tokens: int,
    n: int,
    k: int,
    *,
    has_residual: bool = False,
    capability: Capability | None = None,
) -> str | None:
    """Backend the table picks for a ``(num_tokens, K) x (N, K)^T`` GEMM, or None.

    Args:
        num_tokens: M, rows of the activation.
        n: N, rows of the local weight (output features).
        k: K, columns of the local weight (input features).
        has_residual: ask for the fused ``+ residual`` epilogue.
        capability: ``(major, minor)`` whose table to read; by default the current
            device's. Without a CUDA device there is no table, so the answer is None.

    Returns:
        The backend's name as the table spells it (one of :data:`BACKENDS`), or None
        meaning "keep the layer's normal path". This is the table's decision alone;
        whether the backend was built is checked when a plan is built (see
        :func:`enable_kimi_k3_low_latency_gemm`).
    """
    if capability is None:
        table = device_table()
    else:
        table = table_for_capability(capability)
    spec = None if table is None else table.get((n, k))
    if spec is None:
        return None
    return _backend_for(spec, num_tokens, has_residual)


def routed_rows(capability: Capability | None = None) -> tuple[RoutedRow, ...]:
    """Every (N, K, M) a table routes to a fast kernel, residual rows included.

    Args:
        capability: ``(major, minor)``; by default the current device's.

    Returns:
        Rows sorted by ``(has_residual, N, K, M)``; empty when there is no table.
        Meant for numerics tests and tuners that must cover each routed row.
    """
    table = device_table() if capability is None else table_for_capability(capability)
    if table is None:
        return ()
    rows = [
        RoutedRow(spec.n, spec.k, m, call.backend, call.config, False)
        for spec in table.values()
        for m, call in spec.winners
    ]
    fusing = gemm_backends.residual_backend()
    rows += [
        RoutedRow(spec.n, spec.k, m, fusing.name, config, True)
        for spec in table.values()
        for m, config in spec.residual_configs
    ]
    return tuple(sorted(rows, key=lambda r: (r.has_residual, r.n, r.k, r.num_tokens)))


# -------------------------------------------------------------------------- plans


def _build_plan(spec: ProjectionSpec) -> dict[int, PlannedCall]:
    """``{M: PlannedCall}`` straight from the table, whatever is installed."""
    return dict(spec.winners)


def _build_residual_plan(spec: ProjectionSpec) -> dict[int, Any]:
    """``{M: config}`` for the fused residual epilogue."""
    return dict(spec.residual_configs)


def _backend_available(backend: str) -> bool:
    """Whether the backend the tables call ``backend`` can run in this build.

    Raises:
        KeyError: no backend has that name.
    """
    return gemm_backends.get(backend).is_available()


def _runnable_plan(spec: ProjectionSpec) -> dict[int, PlannedCall]:
    """The table's plan minus backends this build lacks (those M use cuBLAS)."""
    return {
        m: call
        for m, call in _build_plan(spec).items()
        if _backend_available(call.backend)
    }


def _runnable_residual_plan(spec: ProjectionSpec) -> dict[int, Any]:
    fusing = gemm_backends.residual_backend()
    if fusing is None or not fusing.is_available():
        return {}
    return _build_residual_plan(spec)


# -------------------------------------------------------------------------- guards
#
# try_low_latency_gemm and the planned methods promise to fall back, never to raise, so
# every precondition a kernel enforces is checked before the call: what all of them
# need here, the rest by the backend (GemmBackend.operands_ok).

_is_packed_row_major = is_packed_row_major
_is_row_major = is_row_major


def _runtime_ok(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether activation ``x`` (M, K) and ``weight`` (N, K) may take a fast path.

    Both BF16 on the same CUDA device with equal K; ``weight`` packed row-major, ``x``
    row-major with any row stride (see :func:`_operands_ok` for what each backend
    then asks of it).
    """
    if not (is_row_major(x) and is_packed_row_major(weight)):
        return False
    if x.dtype is not torch.bfloat16 or weight.dtype is not torch.bfloat16:
        return False
    if x.device.type != _FAST_PATH_DEVICE_TYPE or weight.device != x.device:
        return False
    return x.shape[1] == weight.shape[1]


def _operands_ok(call: PlannedCall, x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether ``call``'s backend accepts these operands (after :func:`_runtime_ok`)."""
    return gemm_backends.get(call.backend).operands_ok(call.config, x, weight)


def _residual_ok(x: torch.Tensor, weight: torch.Tensor, residual: torch.Tensor) -> bool:
    """Whether ``residual`` is a packed BF16 (M, N) tensor on ``x``'s device."""
    expected = (x.shape[0], weight.shape[0])
    return (
        is_packed_row_major(residual)
        and tuple(residual.shape) == expected
        and residual.dtype is torch.bfloat16
        and x.device == residual.device
    )


def _residual_call_ok(
    config: Any, x: torch.Tensor, weight: torch.Tensor, residual: torch.Tensor
) -> bool:
    """Whether the fused-residual call accepts these inputs."""
    fusing = gemm_backends.residual_backend()
    return (
        _runtime_ok(x, weight)
        and fusing.residual_operands_ok(config, x, weight)
        and _residual_ok(x, weight, residual)
    )


# ------------------------------------------------------------------------- launch


def _launch(call: PlannedCall, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """``x @ weight.T`` on ``call``'s backend, unchecked (see :func:`_planned_forward`)."""
    return gemm_backends.get(call.backend).launch(call.config, x, weight)


def _launch_residual(
    config: Any, x: torch.Tensor, weight: torch.Tensor, residual: torch.Tensor
) -> torch.Tensor:
    return gemm_backends.residual_backend().launch_residual(config, x, weight, residual)


def _planned_forward(
    plan: Mapping[int, PlannedCall],
    weight: torch.Tensor,
    x: torch.Tensor,
    bias: torch.Tensor | None,
) -> torch.Tensor | None:
    """Run the planned kernel for ``x @ weight.T``, or None to use the base method."""
    # No backend adds a bias, and batch-invariant mode needs vLLM's own GEMM.
    if bias is not None or envs.VLLM_BATCH_INVARIANT or not _runtime_ok(x, weight):
        return None
    call = plan.get(x.shape[0])
    if call is None or not _operands_ok(call, x, weight):
        return None
    return _launch(call, x, weight)


def try_low_latency_gemm(
    x: torch.Tensor,
    weight: torch.Tensor,
    residual: torch.Tensor | None = None,
) -> torch.Tensor | None:
    """``x @ weight.T (+ residual)`` on the kernel the device's table picks, or None.

    Args:
        x: activation, (M, K) BF16, row-major (unit column stride; a wider row
            stride only where the routed kernel accepts it), CUDA.
        weight: local weight, (N, K) BF16, packed row-major, same device.
        residual: optional (M, N) BF16 packed tensor added in the fused epilogue.

    Returns:
        A new (M, N) BF16 tensor, or None when the caller must compute it itself: no
        table for this device, shape or M; a backend not built; an input failing the
        checks above or a precondition of the routed kernel (alignment, row stride:
        its ``operands_ok``); or ``VLLM_BATCH_INVARIANT`` set. Never raises for those.

    Builds the plan on every call; layers use the plan installed by
    :func:`enable_kimi_k3_low_latency_gemm` instead.
    """
    table = device_table()
    if table is None or envs.VLLM_BATCH_INVARIANT or not _runtime_ok(x, weight):
        return None
    spec = table.get(tuple(weight.shape))
    if spec is None:
        return None
    if residual is None:
        return _planned_forward(_runnable_plan(spec), weight, x, None)
    config = _runnable_residual_plan(spec).get(x.shape[0])
    if config is None or not _residual_call_ok(config, x, weight, residual):
        return None
    return _launch_residual(config, x, weight, residual)


def routes_any(shape: Shape) -> bool:
    """Whether the device's table routes an ``(N, K)`` weight to a built backend at some M:
    for load-time work that pays only if :func:`try_low_latency_gemm` can run on it (e.g.
    stacking two weights into one). False on CPU, on a GPU without a table, for a shape
    without a row, or with ``VLLM_BATCH_INVARIANT`` set; never raises."""
    table = device_table()
    spec = None if table is None or envs.VLLM_BATCH_INVARIANT else table.get(tuple(shape))
    return spec is not None and bool(_runnable_plan(spec))


# ------------------------------------------------------------------------ methods


class _PlannedApply:
    """``apply`` shared by both methods: the plan's call for this M, else the base method."""

    _plan: dict[int, PlannedCall]

    def apply(
        self,
        layer: nn.Module,
        x: torch.Tensor,
        bias: torch.Tensor | None = None,
    ) -> torch.Tensor:
        out = _planned_forward(self._plan, layer.weight, x, bias)
        return super().apply(layer, x, bias) if out is None else out  # type: ignore[misc]


class KimiK3LowLatencyLinearMethod(_PlannedApply, UnquantizedLinearMethod):
    """Unquantized linear method that first tries a precomputed ``{M: call}`` plan.

    Args:
        plan: ``{M: PlannedCall}`` for ``apply``.
        residual_plan: ``{M: config}`` of the residual backend for ``apply_with_residual``.
    """

    def __init__(
        self,
        plan: Mapping[int, PlannedCall],
        residual_plan: Mapping[int, Any] | None = None,
    ) -> None:
        super().__init__()
        self._plan = dict(plan)
        self._residual_plan = dict(residual_plan or {})

    def apply_with_residual(
        self,
        layer: nn.Module,
        x: torch.Tensor,
        residual: torch.Tensor,
    ) -> torch.Tensor:
        """``x @ layer.weight.T + residual``: (M, K) and (M, N) in, (M, N) out."""
        weight = layer.weight
        config = None
        if not envs.VLLM_BATCH_INVARIANT:
            config = self._residual_plan.get(x.shape[0])
        if config is None or not _residual_call_ok(config, x, weight, residual):
            return torch.addmm(residual, x, weight.t())
        return _launch_residual(config, x, weight, residual)


class KimiK3LowLatencyEmbeddingMethod(_PlannedApply, UnquantizedEmbeddingMethod):
    """LM-head method that first tries a precomputed ``{M: call}`` plan.

    Args:
        plan: ``{M: PlannedCall}`` for the logits GEMM ``apply``.
    """

    def __init__(self, plan: Mapping[int, PlannedCall]) -> None:
        super().__init__()
        self._plan = dict(plan)


# ------------------------------------------------------------------- installation


def _local_shape(module: nn.Module) -> Shape | None:
    weight = getattr(module, "weight", None)
    if not isinstance(weight, torch.Tensor) or weight.dim() != 2:
        return None
    return (weight.shape[0], weight.shape[1])


def _replacement_method(module: nn.Module, spec: ProjectionSpec) -> Any | None:
    """Our method for ``module``, or None unless it runs the exact unquantized method.

    ``type(...) is`` rather than isinstance: a subclass (a quantized or already
    replaced method) may compute something else, so it is left alone.
    """
    method_type = type(getattr(module, "quant_method", None))
    if isinstance(module, LinearBase) and method_type is UnquantizedLinearMethod:
        return KimiK3LowLatencyLinearMethod(
            _runnable_plan(spec), _runnable_residual_plan(spec)
        )
    if isinstance(module, ParallelLMHead) and method_type is UnquantizedEmbeddingMethod:
        return KimiK3LowLatencyEmbeddingMethod(_runnable_plan(spec))
    return None


def _warm_up(weights: Iterable[tuple[ProjectionSpec, torch.device]], dtype: torch.dtype) -> int:
    """Have each backend compile its planned entries of ``weights`` before capture.

    Kernels that compile on first use must not do so inside CUDA-graph capture; each
    backend's ``warm_up`` knows how (a deferred request, a compile now on a CUDA weight,
    nothing for a prebuilt op). Only the shapes given are warmed, so a TP8 model never
    compiles the TP16 configs.

    Returns:
        How many planned entries were compiled or requested.
    """
    calls: dict[str, list[WarmupCall]] = {}
    residual_calls: list[WarmupCall] = []
    for spec, device in dict.fromkeys(weights):
        for m, call in _runnable_plan(spec).items():
            entry = WarmupCall(spec.n, spec.k, m, call.config, device)
            calls.setdefault(call.backend, []).append(entry)
        for m, config in _runnable_residual_plan(spec).items():
            residual_calls.append(WarmupCall(spec.n, spec.k, m, config, device))
    done = sum(gemm_backends.get(name).warm_up(entries, dtype) for name, entries in calls.items())
    if residual_calls:
        fusing = gemm_backends.residual_backend()
        done += fusing.warm_up(residual_calls, dtype, residual=True)
    return done


def enable_kimi_k3_low_latency_gemm(module: nn.Module, dtype: torch.dtype) -> int:
    """Give every matching layer under ``module`` a shape-planned decode GEMM.

    A layer matches when it is a ``LinearBase`` whose ``quant_method`` is exactly
    ``UnquantizedLinearMethod``, or a ``ParallelLMHead`` whose method is exactly
    ``UnquantizedEmbeddingMethod``, and its local weight shape (N, K) has a row in
    the current device's table. Its method is replaced by one holding the ``{M:
    call}`` plan for that shape (entries whose backend is not built are dropped), and
    the planned kernels are warmed up for the shapes actually installed.

    Args:
        module: model (or sub-model) to walk; changed in place.
        dtype: the model's dtype; anything but ``torch.bfloat16`` is a no-op.

    It also turns on, once, the fused decode ops (``low_latency_fused_dispatch``: the
    norms, act-and-mul and norm-prologue GEMMs the model's patched call sites try).

    Returns:
        How many layers received a plan (0 on CPU, unsupported GPUs or non-BF16).
    """
    enable_kimi_k3_fused_decode(module, dtype)
    table = device_table()
    if dtype is not torch.bfloat16 or table is None:
        return 0
    installed: list[tuple[ProjectionSpec, torch.device]] = []
    for layer in module.modules():
        shape = _local_shape(layer)
        spec = None if shape is None else table.get(shape)
        method = None if spec is None else _replacement_method(layer, spec)
        if method is not None:
            layer.quant_method = method
            installed.append((spec, layer.weight.device))
    _warm_up(installed, dtype)
    logger.debug(
        "Kimi-K3 low-latency GEMM: %d layers planned from the %s table",
        len(installed),
        table.arch,
    )
    return len(installed)


def request_low_latency_warmup(weight: torch.Tensor) -> bool:
    """Warm up the planned kernels of a weight that no linear module owns.

    For weights used through :func:`try_low_latency_gemm` directly (e.g. a fused or
    concatenated projection), so their kernels compile before graph capture.

    Args:
        weight: the local (N, K) weight; only its shape, dtype and device are read.

    Returns:
        True if at least one entry was requested or compiled; False for non-BF16 or
        non-2-D weights, a device without a table, a shape without a row, or a row
        none of whose backends is installed.
    """
    table = device_table()
    if table is None or weight.dtype is not torch.bfloat16 or weight.dim() != 2:
        return False
    spec = table.get(tuple(weight.shape))
    if spec is None:
        return False
    return _warm_up([(spec, weight.device)], weight.dtype) > 0
