# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-k3-overlay project
"""Backend ``"cute"``: vLLM's CuTe DSL skinny GEMM (vllm-k3-overlay).

:mod:`vllm.model_executor.kernels.linear.cute_dsl.skinny_gemm`, specialised by a
:class:`SkinnyGemmConfig` (block size, outputs per block, K unroll, vector width and,
optionally, a compile-time K). The only backend with a fused ``+ residual`` epilogue.
Its configs in the tables: vLLM's own (B300, B200) and our CuTe tuner's (H200); see the
table data modules for each figure's source.

Table data: ``(block_size, outputs_per_block, k_unroll, vector_width, static_k)``.

Preconditions (checked by :meth:`CuteSkinny.operands_ok`, so the dispatch never trips
them): v0.28.0's kernel is compiled with each operand's row stride symbolic and divisible
by ``vector_width`` and its data pointer assumed aligned to ``vector_width`` elements (it
raises "Misaligned Tensor data" otherwise, seen on the H200 for views at element offsets
1, 2 and 4); its Python wrapper also wants contiguous operands, so an ``x`` whose row
stride exceeds K (KDA's F_A slice) goes to the compiled entry point itself
(:func:`_launch_rows`). On the H200 at M = 2, F_B on the strided view this way takes
1.77 µs, against 2.85 µs for cuBLAS and 3.65 µs for a packed copy plus CuTe (figures of
``results/kda/README.md``; the CuTe one is the 1536x128 row of ``results/sm90/tuner.md``).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from vllm.model_executor.kernels.linear.cute_dsl.skinny_gemm import (
    SkinnyGemmConfig,
    shape_dynamic_skinny_gemm,
)

from .base import GemmBackend, WarmupCall, aligned, is_packed_row_major


def skinny_config(num_tokens: int, data: Sequence[Any]) -> SkinnyGemmConfig:
    """Table data ``(block_size, outputs_per_block, k_unroll, vector_width, static_k)``
    -> the :class:`SkinnyGemmConfig` for M = ``num_tokens``."""
    block_size, outputs_per_block, k_unroll, vector_width, static_k = data
    return SkinnyGemmConfig(
        num_rows=num_tokens,
        block_size=block_size,
        outputs_per_block=outputs_per_block,
        k_unroll=k_unroll,
        vector_width=vector_width,
        static_k=static_k,
    )


def _rows_launchable() -> bool:
    """Whether :func:`_launch_rows` can reach the kernel's compiled entry point."""
    kernel = shape_dynamic_skinny_gemm
    return all(hasattr(kernel, name) for name in ("_compiled", "_compile", "_stream"))


def _launch_rows(config: SkinnyGemmConfig, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """CuTe GEMM for an ``x`` whose row stride exceeds K (e.g. KDA's F_A slice).

    The compiled kernel takes any row stride that is a multiple of vector_width (checked
    by :meth:`CuteSkinny.operands_ok`); v0.28.0's Python wrapper admits only contiguous
    operands, so this calls the compiled entry point itself, compiling the config first
    where the warm-up has not. Saves the packed copy a wrapper call would need.
    """
    kernel = shape_dynamic_skinny_gemm
    key = (x.dtype, config, False)
    if key not in kernel._compiled:
        kernel._compile(x.dtype, config, False)
    out = x.new_empty((x.shape[0], weight.shape[0]))
    # No residual: the output doubles as the unused residual operand, as in the wrapper.
    kernel._compiled[key](x, weight, out, out, kernel._stream())
    return out


class CuteSkinny(GemmBackend):
    """vLLM's CuTe DSL skinny GEMM, any row stride of ``x``, optional fused residual."""

    name = "cute"
    fuses_residual = True

    def is_available(self) -> bool:
        return shape_dynamic_skinny_gemm.is_available()

    def config_from_data(self, num_tokens: int, data: Any) -> SkinnyGemmConfig | None:
        return None if data is None else skinny_config(num_tokens, data)

    def config_error(self, n: int, k: int, num_tokens: int, config: Any) -> str | None:
        """K must be a multiple of ``block_size * vector_width``, N of
        ``outputs_per_block``; ``num_rows`` must equal M and ``static_k``, if set, K."""
        if not isinstance(config, SkinnyGemmConfig):
            return "a cute entry needs a SkinnyGemmConfig"
        if config.num_rows != num_tokens:
            return f"config.num_rows is {config.num_rows}"
        if k % (config.block_size * config.vector_width):
            return "K not a multiple of block_size*vector_width"
        if n % config.outputs_per_block:
            return f"N not a multiple of {config.outputs_per_block}"
        if config.static_k not in (None, k):
            return f"static_k={config.static_k} but K={k}"
        return None

    def operands_ok(self, config: SkinnyGemmConfig, x: torch.Tensor, weight: torch.Tensor) -> bool:
        """Rows strided by a multiple of vector_width, pointers aligned to it; a row
        stride wider than K only where the compiled entry point is reachable."""
        if not _strides_ok(config, x, weight):
            return False
        return is_packed_row_major(x) or _rows_launchable()

    def launch(
        self, config: SkinnyGemmConfig, x: torch.Tensor, weight: torch.Tensor
    ) -> torch.Tensor:
        if not is_packed_row_major(x):
            return _launch_rows(config, x, weight)
        return shape_dynamic_skinny_gemm(x, weight, config)

    def residual_operands_ok(
        self, config: SkinnyGemmConfig, x: torch.Tensor, weight: torch.Tensor
    ) -> bool:
        """The fused-residual call goes through the wrapper: packed ``x`` only."""
        return is_packed_row_major(x) and _strides_ok(config, x, weight)

    def launch_residual(
        self,
        config: SkinnyGemmConfig,
        x: torch.Tensor,
        weight: torch.Tensor,
        residual: torch.Tensor,
    ) -> torch.Tensor:
        return shape_dynamic_skinny_gemm(x, weight, config, residual=residual)

    def warm_up(
        self, calls: Sequence[WarmupCall], dtype: torch.dtype, *, residual: bool = False
    ) -> int:
        """Ask vLLM's deferred CuTe warm-up (run before capture) for these configs."""
        configs = {call.config for call in calls}
        if not configs or not shape_dynamic_skinny_gemm.is_available():
            return 0
        if residual:
            shape_dynamic_skinny_gemm.request_warmup_configs(dtype, configs, has_residual=True)
        else:
            shape_dynamic_skinny_gemm.request_warmup_configs(dtype, configs)
        return len(calls)


def _strides_ok(config: SkinnyGemmConfig, x: torch.Tensor, weight: torch.Tensor) -> bool:
    """The kernel's own preconditions on x (M, K) and weight (N, K), any row stride."""
    width = config.vector_width
    align = width * x.element_size()
    return (
        x.stride(0) % width == 0
        and weight.stride(0) % width == 0
        and aligned(x, align)
        and aligned(weight, align)
    )


BACKEND = CuteSkinny()
