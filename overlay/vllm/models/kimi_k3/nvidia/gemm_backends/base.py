# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-k3-overlay project
"""The interface every Kimi-K3 decode GEMM backend implements (vllm-k3-overlay).

A backend computes ``y[M, N] = x[M, K] @ weight[N, K]^T`` in BF16 for the decode token
counts M = 1..16. The dispatch (``low_latency_gemm_dispatch``) never names one: it looks
a table entry's backend name up in the registry (``gemm_backends``) and asks it, in this
order, the questions of :class:`GemmBackend`:

1. at table construction: :meth:`~GemmBackend.config_from_data` and
   :meth:`~GemmBackend.config_error` (a table row it cannot run raises ``ValueError``);
2. at install: :meth:`~GemmBackend.is_supported` and :meth:`~GemmBackend.is_available`
   (a row whose backend is missing keeps cuBLAS), then :meth:`~GemmBackend.warm_up`;
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


class GemmBackend(ABC):
    """One decode GEMM kernel the dispatch may route a (shape, M) to.

    Subclasses set :attr:`name` (the string tables use) and implement the abstract
    methods; a module under ``gemm_backends/`` exports one instance as ``BACKEND``.

    Attributes:
        name: the backend's name in the tables' data (``(N, K) -> {M: (name, cfg)}``).
        min_capability: the oldest compute capability it runs on.
        fuses_residual: True for the one backend that adds ``+ residual`` in its
            epilogue (:meth:`launch_residual`); the tables' residual rows are its.
    """

    name: ClassVar[str]
    min_capability: ClassVar[Capability] = (9, 0)
    fuses_residual: ClassVar[bool] = False

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
        """Why ``config`` cannot run a (M, K) x (N, K)^T GEMM at M = ``num_tokens``; None if it can."""

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
        return f"<GemmBackend {self.name}>"


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
