# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-k3-overlay project
"""Backend ``"pdl_rmsnorm"`` of op ``"rmsnorm"``: our PDL-aware RMSNorm (and add + RMSNorm).

For the norms no GEMM prologue absorbs (more than one consumer, or the attention core
next): :func:`vllm.models.kimi_k3.nvidia.norm.rms_norm` and ``add_rms_norm``, which
let the next kernel launch first, load the norm weight, and wait
(``griddepcontrol.wait``) only before reading ``x``. Between two decode GEMMs a
non-PDL norm costs about 2.5-3 µs, this one about 1.3 µs (H200,
``shared/reference/h200/decode_chain_norm_pdl_2026-12-01.json``); in the decode-step
replay (H200, 2026-12-02, ``results/decode_step/``) "ours" runs it for MLA's
``kv_a_layernorm`` (K = 512) and the MTP block's norms (K = 7168) at M = 1..16:
1.4-2.2 µs each against 2.9-3.6 for the stock kernels.

Rows of op ``"rmsnorm"`` are keyed by ``(K,)``, the row width; no config. Operands
(:meth:`PdlRmsNorm.operands_ok`): ``x`` (1..16, K) BF16 with unit column stride,
``weight`` a contiguous BF16 (K,), ``residual`` None or (M, K) BF16 with unit column
stride, one device.
"""

from __future__ import annotations

from typing import Any, ClassVar

import torch

from vllm.models.kimi_k3.nvidia import norm
from vllm.triton_utils import HAS_TRITON

from .base import CompiledOnFirstLaunch, KernelBackend, WarmupCall, bf16_on, is_row_major, is_vector_of

MAX_TOKENS = 16


def token_rows_ok(t: torch.Tensor, width: int, m: int | None = None) -> bool:
    """``t`` is (1..16, width) (M rows if given) with unit column stride."""
    rows = t.shape[0] if t.dim() == 2 else 0
    return (
        is_row_major(t)
        and t.shape[1] == width
        and 1 <= rows <= MAX_TOKENS
        and (m is None or rows == m)
    )


class PdlKernel(CompiledOnFirstLaunch, KernelBackend):
    """What our PDL-aware norm and pointwise kernels say of their table data: available
    wherever Triton is, and no config (a row routes the op, nothing to tune); compiled
    once per width (their calls have N = K = the width)."""

    def is_available(self) -> bool:
        return HAS_TRITON

    def config_error(self, n: int, k: int, num_tokens: int, config: Any) -> str | None:
        """No config."""
        return None if config is None else f"{self.name} takes no config"


class PdlRmsNorm(PdlKernel):
    """Our PDL-aware one-launch RMSNorm / fused add + RMSNorm."""

    name = "pdl_rmsnorm"
    op: ClassVar[str] = "rmsnorm"

    def operands_ok(
        self,
        config: Any,
        x: torch.Tensor,
        weight: torch.Tensor,
        residual: torch.Tensor | None,
    ) -> bool:
        """Whether :meth:`launch` takes these operands (module docstring)."""
        if x.dim() != 2 or not token_rows_ok(x, x.shape[1]):
            return False
        k = x.shape[1]
        return (
            is_vector_of(weight, k)
            and (residual is None or token_rows_ok(residual, k, x.shape[0]))
            and bf16_on(x.device, x, weight, residual)
        )

    def launch(
        self,
        config: None,
        x: torch.Tensor,
        weight: torch.Tensor,
        eps: float,
        residual: torch.Tensor | None,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """``(RMSNorm(h), h)`` with ``h = x + residual`` (new packed tensors), or
        ``(RMSNorm(x), None)`` without a residual."""
        if residual is None:
            return norm.rms_norm(x, weight, eps), None
        return norm.add_rms_norm(x, residual, weight, eps)

    def compile_for(self, call: WarmupCall, dtype: torch.dtype) -> None:
        """The plain norm and the add + norm."""
        x = torch.zeros(call.num_tokens, call.k, dtype=dtype, device=call.device)
        for res in (None, x.clone()):
            self.launch(None, x, x.new_ones(call.k), 1e-6, res)


BACKEND = PdlRmsNorm()
