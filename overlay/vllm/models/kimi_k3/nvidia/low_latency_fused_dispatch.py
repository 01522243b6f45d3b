# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-k3-overlay project
"""Dispatch of the fused Kimi-K3 decode ops (vllm-k3-overlay): tables, a switch, guards.

The GEMM dispatch (``low_latency_gemm_dispatch``) routes plain ``x @ W^T``; this module
routes the small ops next to it, each an ``op`` of the backend registry
(``gemm_backends.backends_for``):

==================  ===========================================================
op                  public entry
==================  ===========================================================
``rmsnorm_gemm``    :func:`try_rmsnorm_gemm` without ``residual``
``add_rmsnorm_gemm`` :func:`try_rmsnorm_gemm` with ``residual``
``rmsnorm``         :func:`try_rms_norm`
``act_mul``         :func:`try_act_mul`
``sigmoid_mul``     :func:`try_sigmoid_mul`
``mtp_input``       :func:`try_mtp_input`
``gate_gemm``       :func:`try_gate_gemm`
``attn_res``        :func:`try_attn_res`
``embed_rows``      :func:`try_embed_rows`
==================  ===========================================================

Which backend runs for an (op, shape, M) is table data per GPU architecture
(``low_latency_fused_sm90``, each row with its source); no backend is named here.

The model-level paths built of these ops (``PATHS``: on the MoE, and MLA's stacked front
end) also depend on the deployment mode: :func:`path_enabled` runs one only on the branch
and capture mode
(:func:`capture_mode`) that the device's data says it was measured in
(``MEASURED_MODES`` of ``low_latency_fused_sm90``), and logs each refusal once.

Every ``try_*`` returns None, never raises, when the model must run its stock ops:
the switch is off (it is turned on once, by :func:`enable_kimi_k3_fused_decode`, which
the GEMM dispatch's ``enable_kimi_k3_low_latency_gemm`` calls); ``VLLM_BATCH_INVARIANT``
is set; there is no table for this device, no row for the shape or no entry for M
(M > 16 included); the backend is not built; or an operand fails the backend's
``operands_ok`` (dtype, strides, device, shapes).
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from types import MappingProxyType
from typing import Any, NamedTuple

import torch
from torch import nn

from vllm import envs
from vllm.logger import init_logger
from vllm.models.kimi_k3.nvidia import gemm_backends
from vllm.models.kimi_k3.nvidia import low_latency_fused_sm90 as _sm90_data
from vllm.models.kimi_k3.nvidia.gemm_backends.base import Capability, KernelBackend, WarmupCall
from vllm.platforms import current_platform

logger = init_logger(__name__)

OPS = ("rmsnorm_gemm", "add_rmsnorm_gemm", "rmsnorm", "act_mul", "sigmoid_mul", "mtp_input",
       "gate_gemm", "attn_res", "embed_rows")
# keyed by (width,), not (N, K)
ROW_OPS = frozenset({"rmsnorm", "act_mul", "sigmoid_mul", "mtp_input", "attn_res", "embed_rows"})
DECODE_TOKEN_COUNTS = range(1, 17)

# Device type the fused paths run on: a module constant so that CPU tests can point it
# at "cpu" and drive them through the Triton interpreter or fakes.
_FAST_PATH_DEVICE_TYPE = "cuda"


class FusedCall(NamedTuple):
    """One (op, shape, M) entry: the backend's name and its parsed config (or None)."""

    backend: str
    config: Any


class FusedTable:
    """Read-only ``{op: {shape: {M: FusedCall}}}`` for one architecture, checked at build.

    Args:
        arch: e.g. ``"SM90"``.
        data: ``{op: {shape: (backend, config tuple or None, token counts)}}``.
        provenance: the figures' source (``gpu``, ``date``, ``source``...).

    Raises:
        ValueError: an unknown op or backend (of that op), an M outside 1..16, or a
            config the backend refuses for the shape (its ``config_error``).
    """

    def __init__(self, arch: str, data: Mapping, provenance: Mapping[str, str]) -> None:
        self.arch = arch
        self.provenance = MappingProxyType(dict(provenance))
        self._rows: dict[str, dict[tuple, dict[int, FusedCall]]] = {}
        for op, rows in data.items():
            if op not in OPS:
                raise ValueError(f"{arch}: unknown fused op {op!r}")
            for shape, value in rows.items():
                entries: dict[int, FusedCall] = {}
                for name, cfg, token_counts in row_entries(value):
                    new = self._entries(op, tuple(shape), name, cfg, token_counts)
                    if entries.keys() & new.keys():
                        raise ValueError(f"{arch} {op} {shape}: two entries at M={min(entries.keys() & new.keys())}")
                    entries.update(new)
                self._rows.setdefault(op, {})[tuple(shape)] = entries

    def _entries(self, op, shape, name, cfg, token_counts) -> dict[int, FusedCall]:
        backend = gemm_backends.backends_for(op).get(name)
        if backend is None:
            raise ValueError(f"{self.arch} {op} {shape}: unknown backend {name!r}")
        n, k = (shape[0], shape[0]) if op in ROW_OPS else shape
        entries = {}
        for m in token_counts:
            if m not in DECODE_TOKEN_COUNTS:
                raise ValueError(f"{self.arch} {op} {shape}: M={m} outside 1..16")
            config = backend.config_from_data(m, cfg)
            why = backend.config_error(n, k, m, config)
            if why:
                raise ValueError(f"{self.arch} {op} {shape} at M={m}: {why}")
            entries[m] = FusedCall(name, config)
        return entries

    def call(self, op: str, shape: tuple, num_tokens: int) -> FusedCall | None:
        """The entry for (op, shape, M), or None (stock path)."""
        return self._rows.get(op, {}).get(tuple(shape), {}).get(num_tokens)

    def rows(self) -> Iterator[tuple[str, tuple, int, FusedCall]]:
        """Every ``(op, shape, M, call)``, sorted: what numerics tests must cover."""
        for op in sorted(self._rows):
            for shape in sorted(self._rows[op]):
                for m, call in sorted(self._rows[op][shape].items()):
                    yield op, shape, m, call

    def __repr__(self) -> str:
        return f"FusedTable({self.arch}, {sum(1 for _ in self.rows())} entries)"


def row_entries(value: tuple) -> tuple[tuple[str, Any, Sequence[int]], ...]:
    """A data row's ``(backend, config, token counts)`` entries: the row itself, or the
    tuple of them it holds (a shape served by one backend at some M, another at others)."""
    return (value,) if isinstance(value[0], str) else tuple(value)


FUSED_SM90 = FusedTable("SM90", _sm90_data.FUSED_SM90, _sm90_data.PROVENANCE)
TABLES_BY_CAPABILITY: Mapping[Capability, FusedTable] = MappingProxyType({(9, 0): FUSED_SM90})


# ------------------------------------------------------------------------ switch

_enabled = False


def _device_capability() -> Capability | None:
    """Compute capability of the current device, None without a CUDA device."""
    # ROCm reports gfx90a as (9, 0): only NVIDIA capabilities name our tables.
    if not current_platform.is_cuda():
        return None
    capability = current_platform.get_device_capability()
    return None if capability is None else (capability.major, capability.minor)


def device_table() -> FusedTable | None:
    """The current device's table; None on CPU or an architecture without one."""
    capability = _device_capability()
    return None if capability is None else TABLES_BY_CAPABILITY.get(capability)


def _backend(op: str, call: FusedCall) -> KernelBackend | None:
    backend = gemm_backends.backends_for(op).get(call.backend)
    return backend if backend is not None and backend.is_available() else None


def _route(op: str, shape: tuple, num_tokens: int) -> tuple[KernelBackend, Any] | None:
    """The (backend, config) for this call, or None: switch off, no row, not built."""
    if not _enabled or envs.VLLM_BATCH_INVARIANT:
        return None
    table = device_table()
    call = None if table is None else table.call(op, shape, num_tokens)
    backend = None if call is None else _backend(op, call)
    return None if backend is None else (backend, call.config)


def _launch_routed(op: str, shape: tuple, x: torch.Tensor, checked: tuple, launched: tuple) -> Any:
    """The routed backend's ``launch(config, *launched)`` for ``x``'s token count (:func:`_tokens`),
    where its ``operands_ok(config, *checked)`` holds; None when nothing routes or it refuses."""
    routed = _route(op, shape, _tokens(x))
    if routed is None:
        return None
    backend, config = routed
    if not backend.operands_ok(config, *checked):
        return None
    return backend.launch(config, *launched)


def routes_any(op: str, shape: tuple) -> bool:
    """Whether ``op`` on ``shape`` would route at some M: the switch on, this device's
    table has a row, its backend built. For load-time work that only pays if the fused
    path can run (e.g. stacking weights for ``gate_gemm``); never raises."""
    return any(_route(op, tuple(shape), m) is not None for m in DECODE_TOKEN_COUNTS)


def _on_fast_device(first: Any, *tensors: torch.Tensor | None) -> bool:
    """``first`` a 2-D tensor, it and every other given one (None skipped) on the
    fast path's device type."""
    if not (isinstance(first, torch.Tensor) and first.dim() == 2):
        return False
    return all(
        t is None or (isinstance(t, torch.Tensor) and t.device.type == _FAST_PATH_DEVICE_TYPE)
        for t in (first, *tensors)
    )


def _tokens(x: Any) -> int:
    """M: the rows of a 2-D activation or the entries of a 1-D vector of token ids, else 0
    (no table has M = 0)."""
    return x.shape[0] if isinstance(x, torch.Tensor) and x.dim() in (1, 2) else 0


def enable_kimi_k3_fused_decode(module: nn.Module, dtype: torch.dtype) -> int:
    """Turn the fused decode paths on (once per process) and warm their kernels up.

    Args:
        module: the model (or sub-model); only its parameters' device is read.
        dtype: the model's dtype; anything but ``torch.bfloat16`` leaves the switch off.

    Returns:
        How many kernels were compiled (0 off CUDA, on a device without a table, or
        for non-BF16 models: the ``try_*`` entries then keep answering None).
    """
    global _enabled
    table = device_table()
    if dtype is not torch.bfloat16 or table is None:
        return 0
    device = next((p.device for p in module.parameters()), torch.device("cpu"))
    _enabled = True
    calls: dict[KernelBackend, list[WarmupCall]] = {}
    for op, shape, m, call in table.rows():
        backend = _backend(op, call)
        if backend is not None:
            n, k = (shape[0], shape[0]) if op in ROW_OPS else shape
            calls.setdefault(backend, []).append(WarmupCall(n, k, m, call.config, device))
    # Every row's call: each backend knows which of them share a build (M is a
    # compile-time constant of the CuTe DSL kernels, not of the Triton ones).
    compiled = sum(backend.warm_up(of_backend, dtype) for backend, of_backend in calls.items())
    logger.debug("Kimi-K3 fused decode ops on (%s table), %d kernels warmed", table.arch, compiled)
    return compiled


def disable_kimi_k3_fused_decode() -> None:
    """Turn the switch off again (tests; a process that unloads the model)."""
    global _enabled
    _enabled = False


# ------------------------------------------------------------- deployment modes

#: Our model-level paths (each of them a few call sites of ``fused_decode``), and the
#: branches they live on: the MoE's, as v0.28.0's ``KimiMoE`` takes them, MegaMoE
#: (``--moe-backend deep_gemm_mega_moe``, EP, SM100) or FusedMoE (``LatentMoERunner``:
#: every other deployment, the H200's); and ``mla``, MLA's q-LoRA front end with its output
#: gate (``mla_front``: one branch, so only the capture mode varies).
PATHS = ("moe_front", "moe_tail", "mla_front")
BRANCHES = ("mega_moe", "fused_moe", "mla")
#: Per capability, ``{path: {(branch, capture mode): source}}``: where each path was measured.
MODES_BY_CAPABILITY: Mapping[Capability, Mapping] = MappingProxyType(
    {(9, 0): MappingProxyType(_sm90_data.MEASURED_MODES)}
)
_refusals_logged: set[tuple[str, str, str]] = set()


def capture_mode() -> str:
    """The capture this call runs under, as it decides vLLM's stream forks.

    ``"breakable"`` while a ``BreakableCUDAGraphCapture`` is active: a mixed or prefill
    batch of v0.28.0's default (``VLLM_USE_BREAKABLE_CUDAGRAPH=1``), or a decode batch
    where the user chose ``cudagraph_mode=PIECEWISE``; vLLM keeps its forks on one
    stream there (utils/multi_stream_utils.py:45-49). Else ``"full"``: a decode batch
    of v0.28.0's default ``FULL_AND_PIECEWISE``, one ``torch.cuda.graph`` around the
    model (v1/worker/gpu/cudagraph_utils.py:355-366), with either value of the flag, or
    an eager forward; vLLM's aux-stream forks run. At load time no capture is active:
    ``"full"``, the decode step's capture.
    """
    from vllm.compilation.breakable_cudagraph import BreakableCUDAGraphCapture

    return "breakable" if BreakableCUDAGraphCapture.is_active() else "full"


def _measured_in(path: str, branch: str) -> Mapping:
    """``{(branch, capture mode): source}`` of ``path`` on this device, empty with the switch
    off (no device query then); ``ValueError`` for a ``path`` or ``branch`` not in
    :data:`PATHS` / :data:`BRANCHES` (a caller's typo)."""
    if path not in PATHS or branch not in BRANCHES:
        raise ValueError(f"unknown fused path {path!r} or branch {branch!r}")
    if not _enabled:
        return {}
    return MODES_BY_CAPABILITY.get(_device_capability(), {}).get(path, {})


def path_measured(path: str, branch: str) -> bool:
    """Whether ``path`` may run on ``branch`` (:data:`BRANCHES`) in any capture mode on this device
    (the switch on): for what is done once at load, such as stacking weights, before the
    capture of each call is known; :func:`path_enabled` then decides per call. Silent;
    ``ValueError`` as :func:`path_enabled`."""
    return any(b == branch for b, _ in _measured_in(path, branch))


def path_enabled(path: str, branch: str) -> bool:
    """Whether our ``path`` may run on ``branch`` (:data:`BRANCHES`) in this call's capture
    (:func:`capture_mode`): the switch on and the mode among those this device's data says
    it was measured in (:data:`MODES_BY_CAPABILITY`). A refusal with the switch on is
    logged once per (path, branch, mode). Never raises for a device or mode; a ``path`` or
    ``branch`` not in :data:`PATHS` / :data:`BRANCHES` raises ``ValueError`` (a caller's typo)."""
    measured = _measured_in(path, branch)
    if not _enabled:
        return False
    mode = capture_mode()
    if (branch, mode) in measured:
        return True
    if (path, branch, mode) not in _refusals_logged:
        _refusals_logged.add((path, branch, mode))
        logger.info(
            "Kimi-K3 %s: v0.28.0's lines on the %s branch under %s capture, where it was "
            "not measured (measured in: %s)", path, branch, mode, sorted(measured) or "none",
        )  # fmt: skip
    return False


# ------------------------------------------------------------------ public entries


def try_rmsnorm_gemm(
    x: torch.Tensor,
    norm_weight: torch.Tensor,
    eps: float,
    weight: torch.Tensor,
    residual: torch.Tensor | None = None,
    *,
    add_to: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None] | None:
    """``RMSNorm(x [+ residual]) @ weight.T (+ add_to)`` in one launch, or None.

    Args:
        x: (M, K) BF16, unit column stride (a row-strided view is fine), CUDA.
        norm_weight: the RMSNorm's (K,) BF16 weight; ``eps`` its epsilon.
        weight: the projection's (N, K) BF16 weight, packed row-major.
        residual: optional (M, K) BF16: the norm is then vLLM's ``RMSNorm(x, residual)``
            (op ``add_rmsnorm_gemm``), which also returns the new residual ``x + residual``.
        add_to: optional packed (M, N) BF16 added in the epilogue (e.g. the shared
            experts' output before ``routed_expert_up_proj``).

    Returns:
        ``(out, new_residual)``: a new BF16 (M, N), and a new packed BF16 (M, K) (None
        without ``residual``); or None for the stock path (module docstring). Never raises
        for those.
    """
    op = "rmsnorm_gemm" if residual is None else "add_rmsnorm_gemm"
    if not (isinstance(weight, torch.Tensor) and weight.dim() == 2):
        return None
    if not _on_fast_device(x, norm_weight, weight, residual, add_to):
        return None
    if residual is None:
        out = _launch_routed(op, tuple(weight.shape), x, (x, norm_weight, weight, add_to),
                             (x, norm_weight, eps, weight, add_to))  # fmt: skip
        return None if out is None else (out, None)
    return _launch_routed(op, tuple(weight.shape), x, (x, residual, norm_weight, weight, add_to),
                          (x, residual, norm_weight, eps, weight, add_to))  # fmt: skip


def rmsnorm_gemm_routes(
    x: torch.Tensor,
    norm_weight: torch.Tensor,
    weight: torch.Tensor,
    *,
    add_to: torch.Tensor | None = None,
) -> bool:
    """Whether :func:`try_rmsnorm_gemm` without ``residual`` would launch for operands
    of these shapes and layouts, launching nothing: for a caller that must decide before
    a step with side effects (an all-reduce whose output it would then pass). Never
    raises."""
    if not (isinstance(weight, torch.Tensor) and weight.dim() == 2):
        return False
    if not _on_fast_device(x, norm_weight, weight, add_to):
        return False
    routed = _route("rmsnorm_gemm", tuple(weight.shape), _tokens(x))
    return routed is not None and routed[0].operands_ok(routed[1], x, norm_weight, weight, add_to)


def try_rms_norm(
    x: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    residual: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None] | None:
    """``RMSNorm(x [+ residual])`` on our PDL-aware kernel, or None.

    Args:
        x: (M, K) BF16 with unit column stride, CUDA; ``weight`` its (K,) BF16 norm
            weight, ``eps`` the epsilon; ``residual`` optional (M, K) BF16.

    Returns:
        ``(out, new_residual)``, new packed BF16 (M, K) tensors (``new_residual`` None
        without ``residual``), or None for the stock path. Never raises for those.
    """
    if not _on_fast_device(x, weight, residual):
        return None
    return _launch_routed("rmsnorm", (x.shape[1],), x, (x, weight, residual), (x, weight, eps, residual))


def try_act_mul(
    gate_up: torch.Tensor,
    *,
    situ_beta: float | None = None,
    situ_linear_beta: float | None = None,
) -> torch.Tensor | None:
    """``act(gate_up[:, :D]) * gate_up[:, D:]`` on our PDL-aware kernel, or None.

    Args:
        gate_up: (M, 2D) BF16 with unit column stride, CUDA.
        situ_beta: SITU's beta (vLLM's ``SituAndMul``); None for SiLU.
        situ_linear_beta: SITU's soft clip of ``up``, or None.

    Returns:
        A new packed BF16 (M, D), or None for the stock path. Never raises for those.
    """
    if not _on_fast_device(gate_up) or gate_up.shape[1] % 2:
        return None
    return _launch_routed("act_mul", (gate_up.shape[1] // 2,), gate_up, (gate_up,),
                          (gate_up, situ_beta, situ_linear_beta))  # fmt: skip


def try_sigmoid_mul(x: torch.Tensor, gate: torch.Tensor) -> torch.Tensor | None:
    """``x * sigmoid(gate)`` (MLA's output gate) on our PDL-aware kernel, or None.

    Args:
        x: (M, D) BF16 with unit column stride, CUDA (MLA's ``attn_out``).
        gate: (M, D) BF16 with unit column stride on ``x``'s device (``g_proj``'s
            output): the operand that goes through the sigmoid.

    Returns:
        A new packed BF16 (M, D), fp32 math and one rounding; or None for the stock
        path (module docstring). Never raises for those.
    """
    if not (isinstance(gate, torch.Tensor) and _on_fast_device(x, gate)):
        return None
    return _launch_routed("sigmoid_mul", (x.shape[1],), x, (x, gate), (x, gate))


def try_mtp_input(
    positions: torch.Tensor,
    embeds: torch.Tensor,
    prev: torch.Tensor,
    enorm_weight: torch.Tensor,
    hnorm_weight: torch.Tensor,
    eps: float,
) -> torch.Tensor | None:
    """v0.28.0's ``fused_mtp_input`` on our PDL-aware kernel, or None.

    Args:
        positions: (M,) int64 or int32, contiguous, on ``embeds``' device; a token at
            position 0 has no previous token, so its ``embeds`` row counts as zeros.
        embeds: (M, H) BF16 with unit column stride, CUDA (the token embeddings).
        prev: (M, H) BF16 with unit column stride (the previous hidden states).
        enorm_weight, hnorm_weight: contiguous (H,) BF16 norm weights.
        eps: the epsilon of both norms (v0.28.0 passes ``enorm``'s).

    Returns:
        A new packed BF16 (M, 2H): ``[enorm(embeds) | hnorm(prev)]``; or None for the
        stock path (module docstring). Never raises for those.
    """
    operands = (positions, prev, enorm_weight, hnorm_weight)
    if not all(isinstance(t, torch.Tensor) for t in operands):
        return None
    if not (isinstance(eps, (int, float)) and _on_fast_device(embeds, *operands)):
        return None
    checked = (positions, embeds, prev, enorm_weight, hnorm_weight)
    return _launch_routed("mtp_input", (embeds.shape[1],), embeds, checked, (*checked, float(eps)))

def try_embed_rows(ids: torch.Tensor, weight: torch.Tensor, start: int, end: int) -> torch.Tensor | None:
    """One rank's part of a vocab-parallel embedding lookup in one launch, or None.

    Args:
        ids: (M,) int64 or int32 token ids over the whole vocabulary, contiguous, CUDA.
        weight: (rows, H) BF16 with unit column stride: this rank's shard of the table.
        start, end: the shard's vocabulary range; ``end - start <= rows``.

    Returns:
        A new BF16 (M, H): ``weight[id - start]`` for the ids in ``[start, end)``, zeros for
        the others (v0.28.0's ``VocabParallelEmbedding.forward`` before its all-reduce, for
        a shard with no added vocabulary); or None for the stock path (module docstring).
        Never raises for those.
    """
    if not (isinstance(ids, torch.Tensor) and ids.dim() == 1 and isinstance(start, int)
            and isinstance(end, int)):  # fmt: skip
        return None
    if not _on_fast_device(weight, ids):
        return None
    operands = (ids, weight, start, end)
    return _launch_routed("embed_rows", (weight.shape[1],), ids, operands, operands)


def try_gate_gemm(
    x: torch.Tensor,
    stacked_weight: torch.Tensor,
    n_fp32: int,
) -> tuple[torch.Tensor, torch.Tensor] | None:
    """A router gate and the bf16 projections of the same input, as one GEMM, or None.

    ``stacked_weight`` holds the gate's ``n_fp32`` rows first, then the other projections'
    rows (Kimi-K3: the router gate 384 x 7168, then ``routed_expert_down_proj`` and the
    shared experts' ``gate_up``, TP8 5504 x 7168); one launch streams it once.

    Args:
        x: (M, K) BF16 with unit column stride, CUDA (the normalized hidden state).
        stacked_weight: packed (N, K) BF16, the gate's rows first.
        n_fp32: the gate's rows, 1 <= n_fp32 < N.

    Returns:
        ``(logits, rest)``: a new packed fp32 (M, n_fp32), accumulated in fp32 and never
        rounded to bf16 (what a bf16 x bf16 -> fp32 GEMM of the gate gives), and a new
        packed BF16 (M, N - n_fp32); or None for the stock path (module docstring). Never
        raises for those.
    """
    if not (isinstance(stacked_weight, torch.Tensor) and stacked_weight.dim() == 2):
        return None
    if not _on_fast_device(x, stacked_weight):
        return None
    operands = (x, stacked_weight, n_fp32)
    return _launch_routed("gate_gemm", tuple(stacked_weight.shape), x, operands, operands)


def try_attn_res(
    prefix: torch.Tensor,
    delta: torch.Tensor | None,
    blocks: torch.Tensor,
    norm_weight: torch.Tensor,
    qk_weight: torch.Tensor,
    output_norm_weight: torch.Tensor | None,
    num_blocks: int,
    block_write_idx: int,
    eps: float,
    output_norm_eps: float,
) -> torch.Tensor | None:
    """v0.28.0's ``ops.attn_res`` (same arguments) on our one-launch PDL-aware kernel, or None.

    A row op, like the norms: valid in every capture mode and on either MoE branch, so
    it is gated by the table alone (no :func:`path_enabled`).

    Args:
        prefix: (M, H) BF16 with unit column stride, CUDA; updated in place to
            ``bf16(prefix + delta)`` when ``delta`` is given (and only when routed).
        delta: None or (M, H) BF16 with unit column stride.
        blocks: (M, R, H) BF16 with unit last stride: the sources ``[:, :num_blocks]``;
            ``[:, block_write_idx]`` is written with the new prefix when >= 0.
        norm_weight, qk_weight, output_norm_weight: contiguous (H,) BF16 (the last may
            be None: no output norm).
        num_blocks: 0..15; block_write_idx: -1 or a slot past the sources.
        eps, output_norm_eps: the source and output norms' epsilons.

    Returns:
        A new packed BF16 (M, H), or None for the stock path (module docstring; also
        NB > 15 or a block write into a source slot). Never raises for those.
    """
    operands = (prefix, delta, blocks, norm_weight, qk_weight, output_norm_weight)
    if not all(t is None or isinstance(t, torch.Tensor) for t in operands):
        return None
    if not isinstance(blocks, torch.Tensor) or not _on_fast_device(prefix, *operands[1:]):
        return None
    if not (isinstance(num_blocks, int) and isinstance(block_write_idx, int)):
        return None
    checked = (*operands, num_blocks, block_write_idx)
    return _launch_routed("attn_res", (prefix.shape[1],), prefix, checked,
                          (*checked, float(eps), float(output_norm_eps)))  # fmt: skip
