# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-k3-overlay project
"""The Kimi-K3 model's call sites of the fused decode ops (vllm-k3-overlay).

Patch 0005 replaces three kinds of lines of v0.28.0's ``nvidia/model.py`` with one call
each of this module; each call takes the vLLM module the stock line used, tries the
fused path (``low_latency_fused_dispatch``) and otherwise runs that very module, so the
model computes what v0.28.0 computes wherever the fused path does not apply:

======================  ============================================  =================
function                stock line it wraps                           fused op
======================  ============================================  =================
:func:`rms_norm`        ``self.input_layernorm(h[, residual])``,      ``rmsnorm``
                        ``self.post_attention_layernorm(h, residual)``
:func:`act_and_mul`     ``KimiMLP``: ``self.act_fn(gate_up)``          ``act_mul``
:func:`routed_output`   ``KimiRoutedOutputTransform``: norm, then      ``rmsnorm_gemm``
                        ``up_proj`` (or ``residual.addmm_``)
======================  ============================================  =================

A module is taken only when it is exactly the vLLM class the model builds
(``type(...) is``, as the GEMM dispatch does for methods: a subclass may compute
something else) with the attributes that class documents; none of these functions
raises where the stock line would not.
"""

from __future__ import annotations

import torch
from torch import nn

from vllm.model_executor.layers.activation import SiluAndMul, SituAndMul
from vllm.model_executor.layers.layernorm import RMSNorm
from vllm.model_executor.layers.linear import UnquantizedLinearMethod
from vllm.models.kimi_k3.nvidia.low_latency_fused_dispatch import (
    try_act_mul,
    try_rms_norm,
    try_rmsnorm_gemm,
)


def _norm_weight(norm: nn.Module) -> torch.Tensor | None:
    """The weight of a plain vLLM ``RMSNorm`` (weighted, no variance override), else None."""
    if type(norm) is not RMSNorm or not getattr(norm, "has_weight", False):
        return None
    if getattr(norm, "variance_size_override", None) is not None:
        return None
    return norm.weight


def rms_norm(norm: nn.Module, x: torch.Tensor, residual: torch.Tensor | None = None):
    """``norm(x)`` or ``norm(x, residual)`` (the same return forms: a tensor, or
    ``(out, new_residual)``), on our PDL-aware kernel where the device's table has a row."""
    weight = _norm_weight(norm)
    fused = None if weight is None else try_rms_norm(x, weight, norm.variance_epsilon, residual)
    if fused is None:
        return norm(x) if residual is None else norm(x, residual)
    return fused[0] if residual is None else fused


def act_and_mul(act_fn: nn.Module, gate_up: torch.Tensor) -> torch.Tensor:
    """``act_fn(gate_up)`` for vLLM's ``SiluAndMul`` / ``SituAndMul``, on our PDL-aware
    kernel where the device's table has a row."""
    out = None
    if type(act_fn) is SiluAndMul:
        out = try_act_mul(gate_up)
    elif type(act_fn) is SituAndMul:
        out = try_act_mul(gate_up, situ_beta=act_fn.beta, situ_linear_beta=act_fn.linear_beta)
    return act_fn(gate_up) if out is None else out


def _plain_linear_weight(linear: nn.Module) -> torch.Tensor | None:
    """The weight of an unquantized, bias-free linear layer (the GEMM dispatch's method
    included: it subclasses the unquantized one), else None."""
    if not isinstance(getattr(linear, "quant_method", None), UnquantizedLinearMethod):
        return None
    if getattr(linear, "bias", None) is not None:
        return None
    return getattr(linear, "weight", None)


def routed_output(
    transform: nn.Module, hidden_states: torch.Tensor, residual: torch.Tensor | None
) -> torch.Tensor | None:
    """``up_proj(norm(hidden_states)) (+ residual)`` in one launch, or None for the stock lines.

    Args:
        transform: v0.28.0's ``KimiRoutedOutputTransform`` (``norm``, ``up_proj``).
        hidden_states: the routed experts' latent output, (M, K).
        residual: None or the (M, N) tensor the stock path accumulates into.

    Returns:
        A new (M, N) tensor, or None: no norm, a norm or projection of another kind,
        or any precondition of ``try_rmsnorm_gemm``.
    """
    norm = getattr(transform, "norm", None)
    norm_weight = None if norm is None else _norm_weight(norm)
    weight = _plain_linear_weight(getattr(transform, "up_proj", None))
    if norm_weight is None or weight is None:
        return None
    fused = try_rmsnorm_gemm(
        hidden_states, norm_weight, norm.variance_epsilon, weight, add_to=residual
    )
    return None if fused is None else fused[0]
