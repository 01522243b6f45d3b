# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-k3-overlay project
"""Weights of one input stacked into one tensor at load time (vllm-k3-overlay).

Patches 0007 (the MoE's router gate, ``routed_expert_down_proj`` and shared ``gate_up``)
and 0013 (MLA's ``fused_qkv_a_proj`` and ``g_proj``) run projections of one input as one
decode GEMM. Their parameters become row views of one packed tensor (:func:`stack_rows`):
the same objects, shapes and values, so vLLM's own lines, weight loaders and state dicts
see no difference, and the fused call checks that they still are (:func:`views_of`).
Nothing is stacked where vLLM offloads weights to the CPU (:func:`offloaded`).
"""

from __future__ import annotations

import torch
from torch import nn


def stackable(params) -> bool:
    """Whether ``params`` can become row views of one tensor: each an ``nn.Parameter``,
    a packed row-major 2-D BF16 weight, all of one K on one device."""
    first = params[0]
    for p in params:
        if not isinstance(p, nn.Parameter) or p.dim() != 2 or p.dtype is not torch.bfloat16:
            return False
        if p.shape[1] != first.shape[1] or p.device != first.device or p.stride() != (p.shape[1], 1):
            return False
    return True


def is_view_of(param: torch.Tensor, weight: torch.Tensor, row: int) -> bool:
    """Whether ``param`` is the row view of ``weight`` that starts at ``row`` (same storage
    address, same strides)."""
    return param.data_ptr() == weight[row].data_ptr() and param.stride() == weight.stride()


def views_of(weight: torch.Tensor, params) -> bool:
    """Whether ``params`` are, in order, the row views that tile ``weight`` from its first row
    to its last (what :func:`stack_rows` made of them, and no reload has replaced since)."""
    if sum(p.shape[0] for p in params) != weight.shape[0]:
        return False
    starts = [sum(p.shape[0] for p in params[:i]) for i in range(len(params))]
    return all(is_view_of(p, weight, r) for p, r in zip(params, starts))


def offloaded(params) -> bool:
    """Whether vLLM offloads weights to the CPU (``--cpu-offload-gb`` and kin): a stack would
    pull them into HBM for good (a UVA view copied) or be left behind on the GPU when the
    loader moves the parameters back; neither is what the user asked for."""
    from vllm.model_executor.offloader.base import NoopOffloader, get_offloader

    return type(get_offloader()) is not NoopOffloader or any(
        getattr(p, "_vllm_is_uva_offloaded", False) for p in params
    )


def stack_rows(old: torch.Tensor | None, params) -> torch.Tensor:
    """Make ``params`` (2-D, one K, one device) row views of one packed tensor, in order,
    and return it. A second post-load hook on the same layer (a weight reload, an RL refit:
    vLLM refreshes the parameters in place, then runs the hook again) must not move them:
    CUDA graphs captured on the stack keep reading its address. So ``old``, the layer's
    stack, is kept when they are its views already, and refilled with their values when
    they are not (a reload that gave them new storage); a new tensor only on first use."""
    rows = [p.shape[0] for p in params]
    starts = [sum(rows[:i]) for i in range(len(rows))]
    first = params[0]
    fits = old is not None and tuple(old.shape) == (sum(rows), first.shape[1])
    if fits and old.dtype == first.dtype and old.device == first.device:
        if views_of(old, params):
            return old
        with torch.no_grad():
            for p, r, n in zip(params, starts, rows):
                old[r : r + n].copy_(p.data)
        weight = old
    else:
        with torch.no_grad():
            weight = torch.cat([p.data for p in params])
    for p, r, n in zip(params, starts, rows):
        p.data = weight[r : r + n]
    return weight
