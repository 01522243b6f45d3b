# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-k3-overlay project
"""Backend ``"ll_bf16"``: vLLM's CuTe DSL ``ll_bf16`` router GEMM (vllm-k3-overlay).

:mod:`vllm.model_executor.kernels.linear.cute_dsl.ll_bf16` (v0.28.0 ships it: a
dot-product kernel for M <= 4, split-K above), pinned to one :class:`LLBf16Config`
instead of its own per-shape choice. It writes fp32, so a cast to BF16 follows (one
more launch). Table data: ``("splitk", split_k, num_stages)`` or
``("dotprod", block_size)``. It was timed on every SM90 (shape, M) in the H200 run the
SM90 table is rendered from (``h200-20261130-figures3``), which routes none of its 446
rows to it.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import Any, Literal, NamedTuple

import torch

from vllm.model_executor.kernels.linear.cute_dsl import ll_bf16

from .base import GemmBackend, WarmupCall

# K tile of vLLM v0.28.0's ll_bf16 split-K kernel (its _compile_splitk's tile_k).
_TILE_K = 256


class LLBf16Config(NamedTuple):
    """One compiled variant of vLLM's ``ll_bf16`` GEMM.

    Attributes:
        variant: ``"splitk"`` (shape-dynamic split-K kernel) or ``"dotprod"``
            (dot-product kernel compiled per M and K).
        split_k: K splits of the split-K kernel (0 for dotprod).
        num_stages: pipeline stages of the split-K kernel (0 for dotprod).
        block_size: threads per block of the dot-product kernel (0 for splitk).
    """

    variant: Literal["splitk", "dotprod"]
    split_k: int = 0
    num_stages: int = 0
    block_size: int = 0


@functools.cache
def runner(config: LLBf16Config) -> Any:
    """vLLM's ``LLBf16Gemm`` with its per-shape dispatch pinned to ``config``.

    Overriding ``dispatch`` (a public method) keeps the kernel's own compile cache,
    input checks and launch; nothing of the kernel is copied.
    """

    class _Pinned(ll_bf16.LLBf16Gemm):
        def dispatch(self, *, M: int, K: int, N: int) -> Any:
            if config.variant == "splitk":
                return self.CompileKey(
                    backend="splitk",
                    split_k=config.split_k,
                    num_stages=config.num_stages,
                )
            return self.CompileKey(backend="dotprod", M=M, K=K, bs=config.block_size)

    return _Pinned()


class LLBf16(GemmBackend):
    """vLLM's ``ll_bf16`` at a pinned variant, plus the cast of its fp32 output."""

    name = "ll_bf16"

    def is_available(self) -> bool:
        return ll_bf16.is_available()

    def config_from_data(self, num_tokens: int, data: Any) -> LLBf16Config | None:
        """Raises ValueError for a tuple of neither form."""
        if data is None:
            return None
        if data[0] == "splitk" and len(data) == 3:
            return LLBf16Config("splitk", split_k=data[1], num_stages=data[2])
        if data[0] == "dotprod" and len(data) == 2:
            return LLBf16Config("dotprod", block_size=data[1])
        raise ValueError(f"ll_bf16 config {data!r} is neither splitk nor dotprod")

    def config_error(self, n: int, k: int, num_tokens: int, config: Any) -> str | None:
        """An :class:`LLBf16Config`, K % 8 == 0, split-K no wider than K's 256-wide tiles."""
        if not isinstance(config, LLBf16Config) or config.variant not in ("splitk", "dotprod"):
            return "an ll_bf16 entry needs an LLBf16Config"
        if k % 8:
            return "ll_bf16 needs K % 8 == 0"
        # Its split-K kernel (K tiles of 256, taken round-robin) primes a pipeline stage
        # in every split; in a split with no K tile no consumer releases it and
        # producer_tail waits forever: the H200 hung (K = 128, split_k = 2). vLLM's own
        # dispatch never asks for it (split-K from K = 2048 on).
        if config.variant == "splitk" and -(-k // _TILE_K) < config.split_k:
            return f"ll_bf16 split_k={config.split_k} > K tiles"
        return None

    def launch(self, config: LLBf16Config, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        return runner(config)(x, weight).to(torch.bfloat16)

    def warm_up(
        self, calls: Sequence[WarmupCall], dtype: torch.dtype, *, residual: bool = False
    ) -> int:
        """vLLM's own warm-up of each pinned variant, on CUDA weights only."""
        compiled = 0
        for call in calls:
            if call.device.type == "cuda":
                runner(call.config).warmup(shapes=[(call.k, call.n)], m_values=[call.num_tokens])
                compiled += 1
        return compiled


BACKEND = LLBf16()
