# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-k3-overlay project
"""Backend ``"tinygemm"``: FlashInfer's ``tinygemm_bf16`` (vllm-k3-overlay).

``flashinfer.gemm.tinygemm_bf16`` (SM90+; JIT-built from FlashInfer's ``tinygemm2.cu``
on its first call), where FlashInfer is installed: flashinfer-python 0.6.16.post3
(vLLM v0.28.0's pin) and 0.7.2.post1 both export it. It takes no config; it needs
K % 64 == 0 and N % 16 == 0. The SM90 table routes 2 of its 446 rows to it (H200 run
``h200-20261130-figures3``, ``results/sm90/decode_gemm_sm90.json``).
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import Any

import torch

from .base import GemmBackend, WarmupCall


@functools.cache
def _op() -> Any | None:
    """FlashInfer's ``tinygemm_bf16``, or None where FlashInfer does not import."""
    try:
        from flashinfer.gemm import tinygemm_bf16
    except Exception:  # ImportError, or a FlashInfer built for another CUDA
        return None
    return tinygemm_bf16


class TinyGemm(GemmBackend):
    """FlashInfer's ``tinygemm_bf16``, launched without PDL."""

    name = "tinygemm"

    def is_available(self) -> bool:
        return _op() is not None

    def config_error(self, n: int, k: int, num_tokens: int, config: Any) -> str | None:
        """No config; K % 64 == 0 and N % 16 == 0."""
        if config is not None:
            return "tinygemm takes no config"
        if k % 64 or n % 16:
            return "tinygemm needs K % 64 == 0 and N % 16 == 0"
        return None

    def launch(self, config: None, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        out = x.new_empty((x.shape[0], weight.shape[0]))
        # Without PDL: FlashInfer's kernel hangs unless every kernel before it uses PDL.
        _op()(x, weight, out, use_pdl=False)
        return out

    def warm_up(
        self, calls: Sequence[WarmupCall], dtype: torch.dtype, *, residual: bool = False
    ) -> int:
        """One call per CUDA entry on zeros: FlashInfer JIT-builds its module on the first."""
        compiled = 0
        for call in calls:
            if call.device.type == "cuda":
                x = torch.zeros((call.num_tokens, call.k), dtype=torch.bfloat16, device=call.device)
                w = torch.zeros((16, call.k), dtype=torch.bfloat16, device=call.device)
                self.launch(call.config, x, w)
                compiled += 1
        return compiled


BACKEND = TinyGemm()
