# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-k3-overlay project
"""Backend ``"swap_ab"``: our Triton swap-AB split-K GEMM (vllm-k3-overlay).

The kernel is :mod:`vllm.models.kimi_k3.nvidia.swap_ab_gemm` (its docstring gives its
design and its measurements); this module only adapts it to the registry. Table data:
``(block_n, block_k, split_k, num_warps, num_stages[, rows])``, a
:class:`~vllm.models.kimi_k3.nvidia.swap_ab_gemm.SwapAbConfig`.

The SM90 table routes it on 401 of its 458 rows (one H200 run timing every backend
against cuBLAS: run ``h200-20261130-figures3``, ``results/sm90/decode_gemm_sm90.json``,
1.26x cuBLAS geo-mean over the 496 (shape, M) it ran). Operands: ``x`` packed or a
row-strided slice (``swap_ab_gemm.x_error``: KDA's F_A slice, which f_b_proj reads) and
16-byte aligned pointers. Triton compiles on first launch, so
:meth:`SwapAb.warm_up` compiles each config before CUDA-graph capture.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from vllm.models.kimi_k3.nvidia import swap_ab_gemm
from vllm.models.kimi_k3.nvidia.swap_ab_gemm import SwapAbConfig
from vllm.triton_utils import HAS_TRITON

from .base import DEFAULT_ALIGN_BYTES, GemmBackend, WarmupCall, aligned


class SwapAbTable:
    """What every backend running our swap-AB kernel (plain, or with a fused prologue) says
    of its table data: available wherever Triton is, a :class:`SwapAbConfig` per row,
    checked by ``swap_ab_gemm.config_error`` for (N, K)."""

    name: str

    def is_available(self) -> bool:
        return HAS_TRITON

    def config_from_data(self, num_tokens: int, data: Any) -> SwapAbConfig | None:
        return None if data is None else SwapAbConfig(*data)

    def config_error(self, n: int, k: int, num_tokens: int, config: Any) -> str | None:
        """A :class:`SwapAbConfig` that ``swap_ab_gemm.config_error`` accepts for (N, K)."""
        if not isinstance(config, SwapAbConfig):
            return f"a {self.name} entry needs a SwapAbConfig"
        return swap_ab_gemm.config_error(config, n, k)


class SwapAb(SwapAbTable, GemmBackend):
    """Our Triton swap-AB split-K kernel."""

    name = "swap_ab"

    def operands_ok(self, config: SwapAbConfig, x: torch.Tensor, weight: torch.Tensor) -> bool:
        """The base rule with ``x``'s rows strided as :func:`swap_ab_gemm.x_error` allows."""
        return (
            swap_ab_gemm.x_error(x) is None
            and aligned(x, DEFAULT_ALIGN_BYTES)
            and aligned(weight, DEFAULT_ALIGN_BYTES)
        )

    def launch(self, config: SwapAbConfig, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        return swap_ab_gemm.swap_ab_gemm(x, weight, config)

    def warm_up(
        self, calls: Sequence[WarmupCall], dtype: torch.dtype, *, residual: bool = False
    ) -> int:
        """Compile each call's kernel now on a CUDA weight; nothing for ``meta``/CPU ones
        (vLLM's eager warm-up runs compile them before capture then)."""
        compiled = 0
        for call in calls:
            if call.device.type == "cuda":
                swap_ab_gemm.warmup(call.config, call.n, call.k, call.device)
                compiled += 1
        return compiled


BACKEND = SwapAb()
