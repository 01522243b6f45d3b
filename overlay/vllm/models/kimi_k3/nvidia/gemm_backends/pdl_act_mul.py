# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-k3-overlay project
"""Backend ``"pdl_act_mul"`` of op ``"act_mul"``: our PDL-aware SiLU/SITU-and-mul.

:func:`vllm.models.kimi_k3.nvidia.pointwise.act_mul`, ``act(gate_up[:, :D]) *
gate_up[:, D:]`` (SiLU, or vLLM's SITU ``beta*tanh(g/beta)*sigmoid(g)`` with the
optional soft clip of ``up``), a kernel that triggers the next launch first and waits
only before reading ``gate_up``. Fusing it into the down projection's prologue did not
pay (H200, 2026-12-02, ``results/decode_step/prologue_sweep_2026-12-02.json``: 7168x768
11.8 µs against 4.7 for the plain GEMM); as its own kernel it ran 1.4 µs against the
stock op's 2.0 in the decode-step replay (the shared experts' SITU, D = 768, TP8, at
M = 1..16).

Rows of op ``"act_mul"`` are keyed by ``(D,)``, the output width; no config. Operands
(:meth:`PdlActMul.operands_ok`): ``gate_up`` (1..16, 2D) BF16 with unit column stride.
"""

from __future__ import annotations

from typing import Any, ClassVar

import torch

from vllm.models.kimi_k3.nvidia import pointwise

from .base import WarmupCall, bf16_on
from .pdl_rmsnorm import PdlKernel, token_rows_ok


class PdlActMul(PdlKernel):
    """Our PDL-aware act-and-mul kernel."""

    name = "pdl_act_mul"
    op: ClassVar[str] = "act_mul"

    def operands_ok(self, config: Any, gate_up: torch.Tensor) -> bool:
        """Whether :meth:`launch` takes ``gate_up`` (module docstring)."""
        return (
            gate_up.dim() == 2
            and gate_up.shape[1] % 2 == 0
            and token_rows_ok(gate_up, gate_up.shape[1])
            and bf16_on(gate_up.device, gate_up)
        )

    def launch(
        self,
        config: None,
        gate_up: torch.Tensor,
        situ_beta: float | None,
        situ_linear_beta: float | None,
    ) -> torch.Tensor:
        """A new packed BF16 (M, D); SiLU unless ``situ_beta``."""
        return pointwise.act_mul(
            gate_up, situ_beta=situ_beta, situ_linear_beta=situ_linear_beta
        )

    def compile_for(self, call: WarmupCall, dtype: torch.dtype) -> None:
        """SiLU, and SITU with and without the clip."""
        gate_up = torch.zeros(call.num_tokens, 2 * call.k, dtype=dtype, device=call.device)
        for beta, linear in ((None, None), (1.0, None), (1.0, 1.0)):
            self.launch(None, gate_up, beta, linear)


BACKEND = PdlActMul()
