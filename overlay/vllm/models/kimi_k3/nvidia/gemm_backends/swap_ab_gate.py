# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-k3-overlay project
"""Backend ``"swap_ab_gate"`` of op ``"gate_gemm"``: a router gate stacked on bf16 projections.

``(logits[M, n_fp32], rest[M, N - n_fp32]) = x[M, K] @ weight[N, K]^T`` in one launch of
:func:`vllm.models.kimi_k3.nvidia.fused_gemm.gemm_split_dtype`: the first ``n_fp32`` rows
of the stacked weight are the MoE router gate, whose logits come out in fp32 (never
rounded to bf16), the rest (``routed_expert_down_proj`` and the shared experts'
``gate_up`` in Kimi-K3) in bf16. Table data: the swap-AB tuple ``(block_n, block_k,
split_k, num_warps, num_stages[, rows])`` for the stacked (N, K).

Where it pays (one H200 run, 2026-12-02, ``results/decode_step/``
``gate_stack_bench_2026-12-02.json``): Kimi-K3's 5504x7168 stack in 20.9-21.1 µs at
M = 1, 8, 16, where the gate alone (fp32 out, 5.6-5.8 µs) and the 5120-row stack of the
other two (19.3-19.7 µs) took 25.1-25.3 back to back; the plain kernel on the same
weight (bf16 out everywhere) 20.3-20.8, so the second store costs 0.2-0.6 µs.

Operands (:meth:`SwapAbGate.operands_ok`, so the dispatch never raises): ``x`` (M, K)
BF16 with unit column stride and 16-byte aligned rows (1 <= M <= 16), ``weight`` packed
BF16 (N, K) 16-byte aligned, on ``x``'s device, and ``1 <= n_fp32 < N``.
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
)
from .swap_ab import SwapAbTable
from .swap_ab_rmsnorm import rows_ok


class SwapAbGate(CompiledOnFirstLaunch, SwapAbTable, KernelBackend):
    """Our swap-AB kernel with the split-dtype (fp32 gate | bf16 rest) epilogue."""

    name = "swap_ab_gate"
    op: ClassVar[str] = "gate_gemm"

    def operands_ok(self, config: Any, x: torch.Tensor, weight: torch.Tensor, n_fp32: Any) -> bool:
        """Whether :meth:`launch` takes these operands (module docstring)."""
        if not (is_packed_row_major(weight) and aligned(weight, DEFAULT_ALIGN_BYTES)):
            return False
        n, k = weight.shape
        return (
            isinstance(n_fp32, int)
            and not isinstance(n_fp32, bool)
            and 0 < n_fp32 < n
            and rows_ok(x, k)
            and bf16_on(x.device, x, weight)
        )

    def launch(
        self, config: SwapAbConfig, x: torch.Tensor, weight: torch.Tensor, n_fp32: int
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """New packed ``(fp32 (M, n_fp32), BF16 (M, N - n_fp32))``."""
        return fused_gemm.gemm_split_dtype(x, weight, n_fp32, config)

    def compile_for(self, call: WarmupCall, dtype: torch.dtype) -> None:
        """The split point is no compile-time constant: any ``n_fp32`` shares the build."""
        x = torch.zeros(call.num_tokens, call.k, dtype=dtype, device=call.device)
        w = torch.zeros(call.n, call.k, dtype=dtype, device=call.device)
        self.launch(call.config, x, w, 1)


BACKEND = SwapAbGate()
