# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-k3-overlay project
"""Backend ``"swap_ab_rmsnorm"`` of op ``"rmsnorm_gemm"``: RMSNorm in our GEMM's prologue.

``out[M, N] = RMSNorm(x; g, eps)[M, K] @ weight[N, K]^T (+ add_to[M, N])`` in one
launch of :func:`vllm.models.kimi_k3.nvidia.fused_gemm.rmsnorm_gemm` (its docstring:
each CTA accumulates its rows' sum of squares next to the MMA and scales at the end;
split-K CTAs reduce their partial sums with the tile). Table data: the swap-AB tuple
``(block_n, block_k, split_k, num_warps, num_stages[, rows])``.

Where it pays (one H200 run, 2026-12-02, ``results/decode_step/``): with ``block_k``
256 the prologue costs 1.1-2.1 µs over the plain GEMM, about what the PDL-aware norm
kernel it replaces costs, and the decode-step replay's "ours" runs it for ``q_b_proj``
(2304x1536, ``q_a_layernorm``) and ``routed_expert_up_proj`` (7168x3584,
``routed_expert_norm``, the shared experts' output in the epilogue) at M = 1..16.

Operands (:meth:`SwapAbRmsNorm.operands_ok`, so the dispatch never raises): ``x``
(M, K) BF16 with unit column stride (a row-strided view such as MLA's ``q_c`` is fine),
``g`` a contiguous BF16 (K,), ``weight`` packed BF16 (N, K), ``add_to`` None or packed
BF16 (M, N), all on one device; 16-byte aligned ``x`` and ``weight``.
"""

from __future__ import annotations

from typing import Any, ClassVar

import torch

from vllm.models.kimi_k3.nvidia import fused_gemm, swap_ab_gemm
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


def rows_ok(x: torch.Tensor, k: int) -> bool:
    """``x`` is (1..16, K) with unit column stride, 16-byte aligned rows, and a row stride
    the packed warm-up's kernel serves (``swap_ab_gemm.x_error``: divisible by 16 as K is)."""
    return (
        swap_ab_gemm.x_error(x) is None  # 2-D, unit column stride, a stride keyed as K's
        and x.shape[1] == k
        and 1 <= x.shape[0] <= swap_ab_gemm.MAX_TOKENS
        and aligned(x, DEFAULT_ALIGN_BYTES)
        and (x.shape[0] == 1 or (x.stride(0) * x.element_size()) % DEFAULT_ALIGN_BYTES == 0)
    )


def addend_ok(t: torch.Tensor | None, m: int, n: int) -> bool:
    """None, or a packed (M, N) tensor (the epilogue's addend)."""
    return t is None or (is_packed_row_major(t) and tuple(t.shape) == (m, n))


class SwapAbRmsNorm(CompiledOnFirstLaunch, SwapAbTable, KernelBackend):
    """Our swap-AB kernel with the RMSNorm prologue."""

    name = "swap_ab_rmsnorm"
    op: ClassVar[str] = "rmsnorm_gemm"

    def operands_ok(
        self,
        config: Any,
        x: torch.Tensor,
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
            and is_vector_of(norm_weight, k)
            and addend_ok(add_to, x.shape[0], n)
            and bf16_on(x.device, x, norm_weight, weight, add_to)
        )

    def launch(
        self,
        config: SwapAbConfig,
        x: torch.Tensor,
        norm_weight: torch.Tensor,
        eps: float,
        weight: torch.Tensor,
        add_to: torch.Tensor | None,
    ) -> torch.Tensor:
        """A new BF16 (M, N): ``RMSNorm(x) @ weight.T (+ add_to)``."""
        return fused_gemm.rmsnorm_gemm(x, norm_weight, eps, weight, config, residual=add_to)

    def compile_for(self, call: WarmupCall, dtype: torch.dtype) -> None:
        """With and without the epilogue's addend."""
        x = torch.zeros(call.num_tokens, call.k, dtype=dtype, device=call.device)
        w = torch.zeros(call.n, call.k, dtype=dtype, device=call.device)
        for add_to in (None, x.new_zeros(call.num_tokens, call.n)):
            self.launch(call.config, x, x.new_ones(call.k), 1e-6, w, add_to)


BACKEND = SwapAbRmsNorm()
