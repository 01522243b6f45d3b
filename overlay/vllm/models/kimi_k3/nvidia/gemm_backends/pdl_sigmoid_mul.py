# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-k3-overlay project
"""Backend ``"pdl_sigmoid_mul"`` of op ``"sigmoid_mul"``: our PDL-aware output gate.

:func:`vllm.models.kimi_k3.nvidia.pointwise.sigmoid_mul`, ``x * sigmoid(gate)`` (MLA's
``_gate_sigmoid_mul(attn_out, gate)``: the ``g_proj`` output is the operand passed
through the sigmoid), fp32 math and one bf16 rounding, as the one kernel Inductor makes
of v0.28.0's ``torch.compile``-d ``attn_out * gate.sigmoid()``. The kernel triggers the
next launch first and waits only before reading its inputs, so ``o_proj`` (our swap-AB
GEMM) prefetches its weight meanwhile. Fusing the gate into ``o_proj``'s prologue did
not pay (H200, 2026-12-02, ``results/decode_step/prologue_sweep_2026-12-02.json``:
7168x1536 at M = 16, 13.9 µs at best against 7.6 for the plain GEMM); as its own kernel
it ran 1.28-1.39 µs against 1.62-1.93 µs for the stock stand-in in the decode-step
replay (``results/decode_step/decode_step_2026-12-02.json``, width 1536: TP8's 12 local
heads x ``v_head_dim`` 128; per-op figures at M = 1, 8, 16).

Rows of op ``"sigmoid_mul"`` are keyed by ``(D,)``, the width; no config. Operands
(:meth:`PdlSigmoidMul.operands_ok`): ``x`` and ``gate`` (1..16, D) BF16 with unit column
stride (row-strided views are fine), same M, one device.
"""

from __future__ import annotations

from typing import Any, ClassVar

import torch

from vllm.models.kimi_k3.nvidia import pointwise

from .base import WarmupCall, bf16_on
from .pdl_rmsnorm import PdlKernel, token_rows_ok


class PdlSigmoidMul(PdlKernel):
    """Our PDL-aware ``x * sigmoid(gate)`` kernel."""

    name = "pdl_sigmoid_mul"
    op: ClassVar[str] = "sigmoid_mul"

    def operands_ok(self, config: Any, x: torch.Tensor, gate: torch.Tensor) -> bool:
        """Whether :meth:`launch` takes these operands (module docstring)."""
        if x.dim() != 2 or gate.dim() != 2:
            return False
        width = x.shape[1]
        return (
            token_rows_ok(x, width) and token_rows_ok(gate, width, x.shape[0]) and bf16_on(x.device, x, gate)
        )

    def launch(self, config: None, x: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        """A new packed BF16 (M, D): ``x * sigmoid(gate)``."""
        return pointwise.sigmoid_mul(x, gate)

    def compile_for(self, call: WarmupCall, dtype: torch.dtype) -> None:
        x = torch.zeros(call.num_tokens, call.k, dtype=dtype, device=call.device)
        self.launch(None, x, x)

BACKEND = PdlSigmoidMul()
