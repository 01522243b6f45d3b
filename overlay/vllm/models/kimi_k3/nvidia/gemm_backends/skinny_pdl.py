# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-k3-overlay project
"""Backend ``"skinny_pdl"``: our PDL-aware GEMV-style Triton GEMM (vllm-k3-overlay).

The kernel is :mod:`vllm.models.kimi_k3.nvidia.skinny_pdl_gemm` (its docstring gives the
design: dot products without tensor cores for M <= 4, the weight stream issued before
``griddepcontrol.wait``); this module only adapts it to the registry. Table data:
``(block_n, block_k, split_k, num_warps, num_stages)``, a
:class:`~vllm.models.kimi_k3.nvidia.skinny_pdl_gemm.SkinnyPdlConfig`, checked when the
table is built (``skinny_pdl_gemm.config_error``), so a bad row fails at import.

The SM90 table routes it on three rows where the H200 sweep found it fastest alone
(``k3lab/bench/skinny_pdl_sweep.py``, run h200-20261203: 1152x1536 at M = 1, 2; 768x7168 at M = 1).
Operands: packed ``x`` and 16-byte aligned pointers (the base rule). The kernel has a
residual epilogue, but the tables' residual rows belong to the one backend that fuses it
(``cute``), so :attr:`fuses_residual` stays False here. Triton compiles on first launch,
one build per power of two of M: :meth:`SkinnyPdl.warm_up` compiles each before capture.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from vllm.models.kimi_k3.nvidia import skinny_pdl_gemm
from vllm.models.kimi_k3.nvidia.skinny_pdl_gemm import SkinnyPdlConfig
from vllm.triton_utils import HAS_TRITON

from .base import GemmBackend, WarmupCall


class SkinnyPdl(GemmBackend):
    """Our Triton GEMV-style kernel, PDL-aware, M <= 16 (timed at M <= 4)."""

    name = "skinny_pdl"

    def is_available(self) -> bool:
        return HAS_TRITON

    def config_from_data(self, num_tokens: int, data: Any) -> SkinnyPdlConfig | None:
        return None if data is None else SkinnyPdlConfig(*data)

    def config_error(self, n: int, k: int, num_tokens: int, config: Any) -> str | None:
        """A :class:`SkinnyPdlConfig` that ``skinny_pdl_gemm.config_error`` accepts, and
        M within the kernel's 1..16."""
        if not isinstance(config, SkinnyPdlConfig):
            return f"a {self.name} entry needs a SkinnyPdlConfig"
        if not 1 <= num_tokens <= skinny_pdl_gemm.MAX_TOKENS:
            return f"M={num_tokens} outside 1..{skinny_pdl_gemm.MAX_TOKENS}"
        return skinny_pdl_gemm.config_error(config, n, k)

    def launch(
        self, config: SkinnyPdlConfig, x: torch.Tensor, weight: torch.Tensor
    ) -> torch.Tensor:
        return skinny_pdl_gemm.skinny_pdl_gemm(x, weight, config)

    def warm_up(
        self, calls: Sequence[WarmupCall], dtype: torch.dtype, *, residual: bool = False
    ) -> int:
        """Compile each distinct (N, K, config, power of two of M) on a CUDA weight now;
        nothing for ``meta``/CPU ones (vLLM's eager warm-up runs compile them before capture)."""
        builds = {
            (c.n, c.k, c.config, skinny_pdl_gemm.block_m_of(c.num_tokens), c.device): c
            for c in calls
            if c.device.type == "cuda"
        }
        for call in builds.values():
            skinny_pdl_gemm.warmup(call.config, call.n, call.k, call.device,
                                   num_tokens=call.num_tokens)  # fmt: skip
        return len(builds)


BACKEND = SkinnyPdl()
