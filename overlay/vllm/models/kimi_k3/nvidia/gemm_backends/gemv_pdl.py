# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-k3-overlay project
"""Backend ``"gemv_pdl"``: our PDL-aware CuTe DSL GEMV (vllm-k3-overlay).

The kernel is :mod:`vllm.models.kimi_k3.nvidia.gemv_pdl` (its docstring gives the design:
trigger first, the CTA's weight rows loaded before ``griddepcontrol.wait``); this module
adapts it to the registry. Table data: ``(threads, rows, prefetch)``, a
:class:`~vllm.models.kimi_k3.nvidia.gemv_pdl.GemvPdlConfig`, checked when the table is
built (``gemv_pdl.config_error``). Operands: ``x`` of any row stride that is a multiple
of 8 (KDA's strided F_A slice included), ``weight`` packed, 16-byte aligned pointers; a
build not compiled yet is refused while the stream captures a CUDA graph (the dispatch
then takes the layer's normal path), and :meth:`GemvPdl.warm_up` compiles each build
before capture. SM90 and newer (PDL, the CuTe DSL's sm_90a target).
"""

from __future__ import annotations

import importlib.util
from collections.abc import Sequence
from typing import Any

import torch

from vllm.models.kimi_k3.nvidia import gemv_pdl
from vllm.models.kimi_k3.nvidia.gemv_pdl import GemvPdlConfig

from .base import GemmBackend, WarmupCall


def cuda_builds(calls: Sequence[WarmupCall]) -> set[tuple[int, GemvPdlConfig, int]]:
    """The distinct ``(M, config, device index)`` of the calls on CUDA weights: M is a
    compile-time constant of these builds; ``meta``/CPU calls are left to vLLM's eager
    warm-up runs, which compile before capture."""
    return {(c.num_tokens, c.config, c.device.index or 0) for c in calls if c.device.type == "cuda"}


class GemvPdl(GemmBackend):
    """Our CuTe DSL GEMV, PDL-aware, M <= 16 (timed at M <= 4)."""

    name = "gemv_pdl"

    def is_available(self) -> bool:
        return importlib.util.find_spec("cutlass") is not None

    def config_from_data(self, num_tokens: int, data: Any) -> GemvPdlConfig | None:
        return None if data is None else GemvPdlConfig(*data)

    def config_error(self, n: int, k: int, num_tokens: int, config: Any) -> str | None:
        """A :class:`GemvPdlConfig` that ``gemv_pdl.config_error`` accepts, M in 1..16."""
        if not isinstance(config, GemvPdlConfig):
            return f"a {self.name} entry needs a GemvPdlConfig"
        if not 1 <= num_tokens <= gemv_pdl.MAX_TOKENS:
            return f"M={num_tokens} outside 1..{gemv_pdl.MAX_TOKENS}"
        return gemv_pdl.config_error(config, n, k)

    def operands_ok(self, config: GemvPdlConfig, x: torch.Tensor, weight: torch.Tensor) -> bool:
        return gemv_pdl.operands_error(config, x, weight) is None

    def launch(self, config: GemvPdlConfig, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        return gemv_pdl.launch(config, x, weight)

    def warm_up(
        self, calls: Sequence[WarmupCall], dtype: torch.dtype, *, residual: bool = False
    ) -> int:
        """Compile each build of :func:`cuda_builds` now."""
        return sum(gemv_pdl.warmup(cfg, m, index) for m, cfg, index in cuda_builds(calls))


BACKEND = GemvPdl()
