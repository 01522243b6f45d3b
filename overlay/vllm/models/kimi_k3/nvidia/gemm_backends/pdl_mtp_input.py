# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-k3-overlay project
"""Backend ``"pdl_mtp_input"`` of op ``"mtp_input"``: our PDL-aware MTP input norms.

:func:`vllm.models.kimi_k3.nvidia.pointwise.mtp_input`: ``[enorm(embeds) |
hnorm(prev)]`` as one packed (M, 2H) tensor, the rows of ``embeds`` read as zeros where
``positions == 0`` (so that half of the row is 0), one ``eps`` for both norms, fp32 math
and one rounding: what v0.28.0's ``fused_mtp_input`` (``kimi_k3/common/mtp.py``)
computes. Ours loads both norm weights before ``griddepcontrol.wait`` and triggers the
next launch first, so ``eh_proj`` (our swap-AB GEMM) prefetches its weight meanwhile.
In the decode-step replay (H200, 2026-12-02, ``results/decode_step/``, H = 7168) it ran
2.33-2.44 µs against 2.40-2.72 µs for v0.28.0's kernel (M = 1, 8, 16); folding it into
``eh_proj``'s prologue cost more than it saved (``prologue_sweep_2026-12-02.json``:
7168x14336 at M = 16, 71.9 µs at best against 49.6 for the plain GEMM).

Rows of op ``"mtp_input"`` are keyed by ``(H,)``; no config. Operands
(:meth:`PdlMtpInput.operands_ok`): ``embeds`` and ``prev`` (1..16, H) BF16 with unit
column stride, same M; ``positions`` a contiguous int32/int64 (M,); both norm weights
contiguous BF16 (H,); one device.
"""

from __future__ import annotations

from typing import Any, ClassVar

import torch

from vllm.models.kimi_k3.nvidia import pointwise

from .base import WarmupCall, bf16_on, is_vector_of
from .pdl_rmsnorm import PdlKernel, token_rows_ok

POSITION_DTYPES = (torch.int64, torch.int32)


class PdlMtpInput(PdlKernel):
    """Our PDL-aware MTP input kernel (two norms and the concat)."""

    name = "pdl_mtp_input"
    op: ClassVar[str] = "mtp_input"

    def operands_ok(
        self,
        config: Any,
        positions: torch.Tensor,
        embeds: torch.Tensor,
        prev: torch.Tensor,
        enorm_weight: torch.Tensor,
        hnorm_weight: torch.Tensor,
    ) -> bool:
        """Whether :meth:`launch` takes these operands (module docstring)."""
        if embeds.dim() != 2:
            return False
        m, h = embeds.shape
        return (
            token_rows_ok(embeds, h)
            and token_rows_ok(prev, h, m)
            and is_vector_of(positions, m)
            and positions.dtype in POSITION_DTYPES
            and positions.device == embeds.device
            and is_vector_of(enorm_weight, h)
            and is_vector_of(hnorm_weight, h)
            and bf16_on(embeds.device, embeds, prev, enorm_weight, hnorm_weight)
        )

    def launch(
        self,
        config: None,
        positions: torch.Tensor,
        embeds: torch.Tensor,
        prev: torch.Tensor,
        enorm_weight: torch.Tensor,
        hnorm_weight: torch.Tensor,
        eps: float,
    ) -> torch.Tensor:
        """A new packed BF16 (M, 2H): ``[enorm(embeds, 0 where positions == 0) | hnorm(prev)]``."""
        return pointwise.mtp_input(positions, embeds, prev, enorm_weight, hnorm_weight, eps)

    def compile_for(self, call: WarmupCall, dtype: torch.dtype) -> None:
        """int64 positions, as vLLM passes them."""
        x = torch.zeros(call.num_tokens, call.k, dtype=dtype, device=call.device)
        positions = torch.ones(call.num_tokens, dtype=torch.int64, device=call.device)
        g = x.new_ones(call.k)
        self.launch(None, positions, x, x, g, g, 1e-6)

BACKEND = PdlMtpInput()
