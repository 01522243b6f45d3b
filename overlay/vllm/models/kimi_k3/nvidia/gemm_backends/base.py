# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-k3-overlay project
"""The interfaces the Kimi-K3 decode kernel backends implement (vllm-k3-overlay).

:class:`KernelBackend` is what every backend of any op answers: its name in the tables,
whether it runs here, how its configs are read and checked, how it is warmed up.
:class:`GemmBackend` adds the op of this package's dispatch: ``y[M, N] = x[M, K] @
weight[N, K]^T`` in BF16 for the decode token counts M = 1..16. A backend of another op
(e.g. a GEMM with a fused RMSNorm prologue) subclasses :class:`KernelBackend` with its own
``op`` and launch, in a module of its own; the registry keeps each op's backends apart
(``gemm_backends.backends_for``).

The GEMM dispatch (``low_latency_gemm_dispatch``) never names a backend: it looks a table
entry's backend name up in the registry and asks it, in this order:

1. at table construction: :meth:`~KernelBackend.config_from_data`,
   :meth:`~KernelBackend.config_error` (a row it cannot run raises ``ValueError``) and
   :meth:`~KernelBackend.is_supported` on the table's capability (likewise);
2. at install: :meth:`~KernelBackend.is_available` (a row whose backend this build lacks
   keeps cuBLAS), then :meth:`~KernelBackend.warm_up`;
3. per forward, after the dispatch's own checks (BF16 ``x`` (M, K) row-major and
   ``weight`` (N, K) packed row-major on one CUDA device, equal K):
   :meth:`~GemmBackend.operands_ok`, then :meth:`~GemmBackend.launch`.

``operands_ok`` exists so that the dispatch never raises: every precondition a kernel
enforces (alignment, row stride, layout) is checked before it is called, and a call that
would fail falls back to the layer's normal path instead.

The operand predicates at the end of this module are shared by the backends and the
dispatch.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence
from typing import Any, ClassVar, NamedTuple

import torch

Capability = tuple[int, int]  # (major, minor) CUDA compute capability

#: Bytes every backend without a rule of its own wants its pointers aligned to: the
#: kernels load 16 bytes at a time (dsv3_fused_a checks packed strides itself but not
#: alignment).
DEFAULT_ALIGN_BYTES = 16


class WarmupCall(NamedTuple):
    """One planned (shape, M) a backend should compile before CUDA-graph capture.

    Attributes:
        n: output features N of the local weight (N, K).
        k: input features K.
        num_tokens: M, 1..16.
        config: the backend's config for this entry (None for a backend without one).
        device: the device of the layer's weight (``meta`` or ``cpu`` before loading).
    """

    n: int
    k: int
    num_tokens: int
    config: Any
    device: torch.device


class KernelBackend(ABC):
    """One decode kernel a table may route a (shape, M) of its op to.

    Subclasses set :attr:`name` (the string tables use) and :attr:`op`, and implement the
    abstract methods; a module under ``gemm_backends/`` exports one instance as
    ``BACKEND``.

    Attributes:
        name: the backend's name in the tables' data (``(N, K) -> {M: (name, cfg)}``).
        op: what it computes; the registry groups backends by it.
        min_capability: the oldest compute capability it runs on (no table routes a
            backend below it: checked when the tables are built).
    """

    name: ClassVar[str]
    op: ClassVar[str]
    min_capability: ClassVar[Capability] = (9, 0)

    def is_supported(self, capability: Capability | None) -> bool:
        """Whether the kernel exists for ``capability`` (None: no CUDA device)."""
        return capability is not None and tuple(capability) >= self.min_capability

    @abstractmethod
    def is_available(self) -> bool:
        """Whether this build can run it: its package imports, its op was compiled."""

    def config_from_data(self, num_tokens: int, data: Any) -> Any:
        """A table data module's config (a tuple, or None) -> the config :meth:`launch` takes.

        The default keeps what it is given, as a tuple, for :meth:`config_error` to judge.

        Raises:
            ValueError: for data of a form the backend does not know.
        """
        return None if data is None else tuple(data)

    @abstractmethod
    def config_error(self, n: int, k: int, num_tokens: int, config: Any) -> str | None:
        """Why ``config`` cannot run the op on a (N, K) weight at M = ``num_tokens``, or None."""

    def warm_up(
        self, calls: Sequence[WarmupCall], dtype: torch.dtype, *, residual: bool = False
    ) -> int:
        """Compile (or request the compilation of) what ``calls`` need, before capture.

        Kernels that compile on first use must not do so inside CUDA-graph capture. By
        default there is nothing to compile (a prebuilt op).

        Returns:
            How many of ``calls`` were compiled or requested.
        """
        return 0

    def __repr__(self) -> str:
        return f"<{type(self).__name__} {self.op}:{self.name}>"


class CompiledOnFirstLaunch:
    """``warm_up`` of a backend whose kernels compile on their first launch (Triton), which
    CUDA-graph capture must not see: one launch per distinct (N, K, config, device) of the
    calls on CUDA devices, the first call of each kept (the token count is no compile-time
    constant of these kernels); nothing for ``meta``/CPU weights. Mixed in ahead of
    :class:`KernelBackend`; a subclass says in :meth:`compile_for` what to launch."""

    def warm_up(
        self, calls: Sequence[WarmupCall], dtype: torch.dtype, *, residual: bool = False
    ) -> int:
        """Returns how many distinct builds were launched."""
        first: dict = {}
        for call in calls:
            if call.device.type == "cuda":
                first.setdefault((call.n, call.k, call.config, call.device), call)
        for call in first.values():
            self.compile_for(call, dtype)
        return len(first)

    def compile_for(self, call: WarmupCall, dtype: torch.dtype) -> None:
        """Launch every variant the backend runs once, on zeros of ``call``'s shape."""
        raise NotImplementedError


class GemmBackend(KernelBackend):
    """A backend of the dispatch's op, ``x @ weight.T`` (optionally ``+ residual``).

    Attributes:
        fuses_residual: True for the one backend that adds ``+ residual`` in its
            epilogue (:meth:`launch_residual`); the tables' residual rows are its.
    """

    op: ClassVar[str] = "gemm"
    fuses_residual: ClassVar[bool] = False

    def operands_ok(self, config: Any, x: torch.Tensor, weight: torch.Tensor) -> bool:
        """Whether the kernel accepts these operands; by default packed ``x`` and 16-byte
        aligned pointers. Called only on operands the dispatch's own checks passed."""
        return (
            is_packed_row_major(x)
            and aligned(x, DEFAULT_ALIGN_BYTES)
            and aligned(weight, DEFAULT_ALIGN_BYTES)
        )

    def residual_operands_ok(self, config: Any, x: torch.Tensor, weight: torch.Tensor) -> bool:
        """Whether :meth:`launch_residual` accepts these operands (the residual itself is
        checked by the dispatch: packed BF16 (M, N) on ``x``'s device)."""
        return self.operands_ok(config, x, weight)

    @abstractmethod
    def launch(self, config: Any, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        """``x @ weight.T`` as a new BF16 (M, N) tensor, on operands :meth:`operands_ok` took."""

    def launch_residual(
        self, config: Any, x: torch.Tensor, weight: torch.Tensor, residual: torch.Tensor
    ) -> torch.Tensor:
        """``x @ weight.T + residual``; only where :attr:`fuses_residual` is True.

        Raises:
            NotImplementedError: for a backend without a residual epilogue.
        """
        raise NotImplementedError(f"{self.name} has no residual epilogue")


# ------------------------------------------------------------------ operand predicates


def is_packed_row_major(t: torch.Tensor) -> bool:
    """True for a 2-D tensor whose rows lie back to back with unit column stride.

    Stricter than ``is_contiguous()``: a one-row slice of a wider tensor reports
    contiguous (a size-1 dim's stride is ignored) yet its row stride is the parent's
    width, and the kernels index with the packed stride.
    """
    if t.dim() != 2:
        return False
    _, cols = t.shape
    return t.stride() == (cols, 1)


def is_row_major(t: torch.Tensor) -> bool:
    """True for a 2-D tensor of unit column stride whose rows do not overlap.

    The row stride may exceed the width: e.g. KDA's F_A, a ``[M, 128]`` slice of the
    packed projection's output.
    """
    if t.dim() != 2:
        return False
    rows, cols = t.shape
    return t.stride(1) == 1 and (rows == 1 or t.stride(0) >= cols)


def aligned(t: torch.Tensor, nbytes: int) -> bool:
    """Whether ``t``'s data pointer is a multiple of ``nbytes``."""
    return t.data_ptr() % nbytes == 0


def bf16_on(device: torch.device, *tensors: torch.Tensor | None) -> bool:
    """Whether every given tensor (None skipped) is BF16 on ``device``."""
    return all(
        t is None or (t.dtype is torch.bfloat16 and t.device == device) for t in tensors
    )


def is_vector_of(t: torch.Tensor, length: int) -> bool:
    """Whether ``t`` is a contiguous 1-D tensor of ``length`` elements (a norm weight)."""
    return t.dim() == 1 and t.shape[0] == length and t.stride(0) == 1
