# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-k3-overlay project
"""Backend ``"gemv_rmsnorm"`` of op ``"rmsnorm_gemm"``: RMSNorm in the prologue of our
PDL-aware CuTe DSL GEMV (vllm-k3-overlay).

``out[M, N] = RMSNorm(x; g, eps)[M, K] @ weight[N, K]^T (+ add_to[M, N])`` in one launch
of :func:`vllm.models.kimi_k3.nvidia.gemv_pdl.rmsnorm_gemv_pdl`. Why a second backend
beside ``swap_ab_rmsnorm``: every CTA of the GEMV reads the whole of ``x`` anyway, so the
norm's sum of squares rides along with the dot products (one more warp reduction per
token) and ``g`` is a parameter, loaded with the weights before ``griddepcontrol.wait``;
the swap-AB prologue pays about 1 µs per K step (``results/decode_step/
prologue_sweep_2026-12-02.json``). Table data: ``(threads, rows, prefetch)``
(:class:`~vllm.models.kimi_k3.nvidia.gemv_pdl.GemvPdlConfig`).

Operands (:meth:`GemvRmsNorm.operands_ok`, so the dispatch never raises): those of
``gemv_pdl.operands_error`` with ``norm_weight`` a contiguous BF16 (K,) and ``add_to``
None or a packed BF16 (M, N); a build not compiled yet is refused while the stream
captures a CUDA graph, and :meth:`GemvRmsNorm.warm_up` compiles each (M, config,
addend or not) before capture. SM90 and newer.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, ClassVar

import torch

from vllm.models.kimi_k3.nvidia import gemv_pdl
from vllm.models.kimi_k3.nvidia.gemv_pdl import GemvPdlConfig

from .base import KernelBackend, WarmupCall
from .gemv_pdl import BACKEND as _GEMV
from .gemv_pdl import cuda_builds


class GemvRmsNorm(KernelBackend):
    """Our CuTe DSL GEMV with the RMSNorm prologue (and an addend epilogue)."""

    name = "gemv_rmsnorm"
    op: ClassVar[str] = "rmsnorm_gemm"

    def is_available(self) -> bool:
        return _GEMV.is_available()

    def config_from_data(self, num_tokens: int, data: Any) -> GemvPdlConfig | None:
        return _GEMV.config_from_data(num_tokens, data)

    def config_error(self, n: int, k: int, num_tokens: int, config: Any) -> str | None:
        """The plain GEMV's rules (``gemv_pdl.config_error``, M in 1..16)."""
        return _GEMV.config_error(n, k, num_tokens, config)

    def operands_ok(self, config: GemvPdlConfig, x: torch.Tensor, norm_weight: torch.Tensor,
                    weight: torch.Tensor, add_to: torch.Tensor | None) -> bool:  # fmt: skip
        return gemv_pdl.operands_error(config, x, weight, norm_weight, add_to) is None

    def launch(self, config: GemvPdlConfig, x: torch.Tensor, norm_weight: torch.Tensor, eps: float,
               weight: torch.Tensor, add_to: torch.Tensor | None) -> torch.Tensor:  # fmt: skip
        """A new BF16 (M, N): ``RMSNorm(x) @ weight.T (+ add_to)``."""
        return gemv_pdl.launch(config, x, weight, norm_weight, eps, add_to)

    def warm_up(
        self, calls: Sequence[WarmupCall], dtype: torch.dtype, *, residual: bool = False
    ) -> int:
        """Compile each build of ``cuda_builds`` with and without the addend (a table row
        does not say which site it serves)."""
        return sum(gemv_pdl.warmup(cfg, m, index, norm=True, add=add)
                   for m, cfg, index in cuda_builds(calls) for add in (False, True))  # fmt: skip


BACKEND = GemvRmsNorm()
