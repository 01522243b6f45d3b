# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-k3-overlay project
"""Backend ``"swap_ab_add_rmsnorm"`` of op ``"add_rmsnorm_gemm"``: residual add + RMSNorm
in our GEMM's prologue.

``h = bf16(x + residual)``, written once as the new residual (by the CTAs of the
first N tile); ``out[M, N] = RMSNorm(h; g, eps) @ weight[N, K]^T (+ add_to[M, N])``, in
one launch of :func:`vllm.models.kimi_k3.nvidia.fused_gemm.add_rmsnorm_gemm`. It
replaces vLLM's ``RMSNorm(x, residual)`` where the normed output has one consumer, a
GEMM. Table data: the swap-AB tuple ``(block_n, block_k, split_k, num_warps,
num_stages[, rows])``.

What it costs (one H200 run, 2026-12-02, ``results/decode_step/``
``prologue_sweep_2026-12-02.json``, M = 16): 3584x7168 at ``(64, 256, 2, 4, 4, 55)``
17.71 µs against 15.66 for the plain GEMM, about what a PDL-aware add-norm kernel adds
(1.4-2.2 µs). The replay's "ours" did not run it (no call site of v0.28.0's dense
path has an add-norm with one GEMM consumer); its table row is that one measured M.

Operands (:meth:`SwapAbAddRmsNorm.operands_ok`): as ``swap_ab_rmsnorm``'s, plus the
residual, (M, K) BF16 with unit column stride on ``x``'s device.
"""

from __future__ import annotations

from typing import Any, ClassVar

import torch

from vllm.models.kimi_k3.nvidia import fused_gemm
from vllm.models.kimi_k3.nvidia.swap_ab_gemm import SwapAbConfig

from .base import (
    DEFAULT_ALIGN_BYTES,
    CompiledOnFirstLaunch,
    KernelBackend,
    WarmupCall,
    aligned,
    bf16_on,
    is_packed_row_major,
    is_vector_of,
)
from .swap_ab import SwapAbTable
from .swap_ab_rmsnorm import addend_ok, rows_ok


class SwapAbAddRmsNorm(CompiledOnFirstLaunch, SwapAbTable, KernelBackend):
    """Our swap-AB kernel with the residual-add + RMSNorm prologue."""

    name = "swap_ab_add_rmsnorm"
    op: ClassVar[str] = "add_rmsnorm_gemm"

    def operands_ok(
        self,
        config: Any,
        x: torch.Tensor,
        residual: torch.Tensor,
        norm_weight: torch.Tensor,
        weight: torch.Tensor,
        add_to: torch.Tensor | None,
    ) -> bool:
        """Whether :meth:`launch` takes these operands (module docstring)."""
        if not (is_packed_row_major(weight) and aligned(weight, DEFAULT_ALIGN_BYTES)):
            return False
        n, k = weight.shape
        return (
            rows_ok(x, k)
            and rows_ok(residual, k)
            and residual.shape[0] == x.shape[0]
            and is_vector_of(norm_weight, k)
            and addend_ok(add_to, x.shape[0], n)
            and bf16_on(x.device, x, residual, norm_weight, weight, add_to)
        )

    def launch(
        self,
        config: SwapAbConfig,
        x: torch.Tensor,
        residual: torch.Tensor,
        norm_weight: torch.Tensor,
        eps: float,
        weight: torch.Tensor,
        add_to: torch.Tensor | None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``(out, h)``: new BF16 (M, N) and the new residual, a new packed BF16 (M, K)."""
        h = torch.empty(x.shape, dtype=residual.dtype, device=x.device)
        out = fused_gemm.add_rmsnorm_gemm(
            x, residual, h, norm_weight, eps, weight, config, residual=add_to
        )
        return out, h

    def compile_for(self, call: WarmupCall, dtype: torch.dtype) -> None:
        """With and without the epilogue's addend."""
        x = torch.zeros(call.num_tokens, call.k, dtype=dtype, device=call.device)
        w = torch.zeros(call.n, call.k, dtype=dtype, device=call.device)
        for add_to in (None, x.new_zeros(call.num_tokens, call.n)):
            self.launch(call.config, x, x.clone(), x.new_ones(call.k), 1e-6, w, add_to)


BACKEND = SwapAbAddRmsNorm()
