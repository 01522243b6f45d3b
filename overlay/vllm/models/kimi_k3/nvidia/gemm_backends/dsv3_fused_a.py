# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-k3-overlay project
"""Backend ``"dsv3_fused_a"``: ``torch.ops._C.dsv3_fused_a_gemm`` (vllm-k3-overlay).

vLLM's DeepSeek-V3 fused-A GEMM, usable only where vLLM's ``_C`` extension was built with
it. It takes no config; it checks packed strides itself but not alignment, and loads 16
bytes at a time (hence the base rule: packed ``x``, 16-byte aligned pointers). The B300
and B200 tables route it (vLLM's figures); the SM90 table does not: it could not be built
against the H200 device's torch 2.11 (``results/sm90/tuner.md``).
"""

from __future__ import annotations

import functools
from typing import Any

import torch

import vllm._custom_ops as ops
from vllm.platforms import current_platform

from .base import GemmBackend


@functools.cache
def _built() -> bool:
    # Cached: the op either got registered when vllm._C loaded or it never will.
    return hasattr(torch.ops._C, "dsv3_fused_a_gemm")


@functools.cache
def _use_pdl() -> bool:
    # Same rule the CuTe kernel applies to itself.
    return current_platform.is_arch_support_pdl()


class Dsv3FusedA(GemmBackend):
    """vLLM's ``dsv3_fused_a_gemm`` op (prebuilt: nothing to warm up)."""

    name = "dsv3_fused_a"

    def is_available(self) -> bool:
        return _built()

    def config_error(self, n: int, k: int, num_tokens: int, config: Any) -> str | None:
        """No config."""
        return None if config is None else "dsv3_fused_a takes no config"

    def launch(self, config: None, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        out = x.new_empty((x.shape[0], weight.shape[0]))
        # The op wants the weight as a column-major (K, N) operand: weight.t() is that view.
        ops.dsv3_fused_a_gemm(out, x, weight.t(), enable_pdl=_use_pdl())
        return out


BACKEND = Dsv3FusedA()
