# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-k3-overlay project
"""Backend ``"pdl_embed_rows"`` of op ``"embed_rows"``: one rank's embedding rows in one launch.

:func:`vllm.models.kimi_k3.nvidia.pointwise.embed_rows`: for token ids over the whole
vocabulary, the rows of this rank's shard ``[start, end)`` of a vocab-parallel embedding
and zeros for the ids outside it, what v0.28.0's ``VocabParallelEmbedding.forward``
computes before its all-reduce at TP > 1 (its compiled shard mask, the gather and
``masked_fill_``: three launches). A copy, so the rows are bit-exact. PDL: it triggers the
next launch first and waits before it reads the ids.

Rows of op ``"embed_rows"`` are keyed by ``(H,)``; no config. Operands
(:meth:`PdlEmbedRows.operands_ok`): ``ids`` a contiguous int32/int64 ``(M,)``, M = 1..16;
``weight`` a BF16 ``(rows, H)`` with unit column stride on the ids' device, ``end - start``
of its rows in use.
"""

from __future__ import annotations

from typing import Any, ClassVar

import torch

from vllm.models.kimi_k3.nvidia import pointwise

from .base import WarmupCall, bf16_on
from .pdl_rmsnorm import MAX_TOKENS, PdlKernel

ID_DTYPES = (torch.int64, torch.int32)


class PdlEmbedRows(PdlKernel):
    """Our one-launch vocab-shard embedding lookup."""

    name = "pdl_embed_rows"
    op: ClassVar[str] = "embed_rows"

    def operands_ok(
        self, config: Any, ids: torch.Tensor, weight: torch.Tensor, start: int, end: int
    ) -> bool:
        """Whether :meth:`launch` takes these operands (module docstring)."""
        return (
            ids.dim() == 1
            and 1 <= ids.shape[0] <= MAX_TOKENS
            and ids.stride(0) == 1
            and ids.dtype in ID_DTYPES
            and weight.dim() == 2
            and weight.stride(1) == 1
            and 0 <= end - start <= weight.shape[0]
            and ids.device == weight.device
            and bf16_on(weight.device, weight)
        )

    def launch(
        self, config: None, ids: torch.Tensor, weight: torch.Tensor, start: int, end: int
    ) -> torch.Tensor:
        """A new packed BF16 (M, H): the shard's rows of ``ids``, zeros outside ``[start, end)``."""
        return pointwise.embed_rows(ids, weight, start, end)

    def compile_for(self, call: WarmupCall, dtype: torch.dtype) -> None:
        """Both id dtypes: Triton compiles one kernel per pointer dtype, and the drafter's ids
        are int32 (v1/worker/gpu/input_batch.py:28) where other callers pass int64; a
        compile must never fall inside a CUDA-graph capture."""
        weight = torch.zeros(1, call.k, dtype=dtype, device=call.device)
        for ids_dtype in ID_DTYPES:
            self.launch(None, torch.zeros(call.num_tokens, dtype=ids_dtype, device=call.device), weight, 0, 1)


BACKEND = PdlEmbedRows()
