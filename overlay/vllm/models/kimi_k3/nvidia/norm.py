# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-k3-overlay project
"""PDL-aware RMSNorm and residual-add + RMSNorm for the Kimi-K3 decode step (Triton).

For the norms no GEMM prologue can absorb (the MTP ``shared_head`` norm, MLA's
``kv_a_layernorm`` whose output feeds the attention core): one program per token row,
bf16 in and out, fp32 arithmetic, ``y = x * rsqrt(mean(x^2) + eps) * w``; the add
variant first forms ``h = bf16(x + residual)`` and writes it as the new residual,
as vLLM's ``fused_add_rms_norm`` does.

Why a kernel of our own: between two decode GEMMs a norm that knows nothing of PDL
costs about 2.5-3 µs, a PDL-aware one about 1.3 µs (``shared/reference/h200``,
``decode_chain_norm_pdl_2026-12-01.json``). So with PDL (SM90+) the kernel lets the
next kernel launch at once (``griddepcontrol.launch_dependents``), loads the norm
weight (no kernel's output) and only then waits (``griddepcontrol.wait``) before it
reads ``x``. With ``pdl=False`` it is a plain one-launch norm.

Errors: ``ValueError`` for a weight whose length is not the row length, or a row
without unit column stride.
"""

from __future__ import annotations

import functools

import torch

from vllm.triton_utils import tl, triton


@triton.jit(do_not_specialize=["stride_x", "stride_r"])
def _rms_norm_kernel(x_ptr, r_ptr, w_ptr, y_ptr, h_ptr, K, stride_x, stride_r, eps,
                     BLOCK: tl.constexpr, HAS_ADD: tl.constexpr, USE_PDL: tl.constexpr):  # fmt: skip
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK)
    ok = offs < K
    if USE_PDL:
        tl.extra.cuda.gdc_launch_dependents()
    w = tl.load(w_ptr + offs, mask=ok, other=0.0).to(tl.float32)
    if USE_PDL:
        tl.extra.cuda.gdc_wait()
    x = tl.load(x_ptr + row * stride_x + offs, mask=ok, other=0.0).to(tl.float32)
    if HAS_ADD:
        r = tl.load(r_ptr + row * stride_r + offs, mask=ok, other=0.0).to(tl.float32)
        h = (x + r).to(h_ptr.dtype.element_ty)
        tl.store(h_ptr + row * K + offs, h, mask=ok)
        x = h.to(tl.float32)
    rstd = tl.rsqrt(tl.sum(x * x, axis=0) / K + eps)
    tl.store(y_ptr + row * K + offs, (x * rstd * w).to(y_ptr.dtype.element_ty), mask=ok)


@functools.cache
def _pdl_default(device_index: int) -> bool:
    return torch.cuda.get_device_capability(device_index)[0] >= 9


def _check(x: torch.Tensor, weight: torch.Tensor) -> None:
    if x.dim() != 2 or x.stride(1) != 1:
        raise ValueError(f"x: expected [M, K] with unit column stride, got {tuple(x.shape)}")
    if weight.shape != (x.shape[1],):
        raise ValueError(f"norm weight {tuple(weight.shape)} does not match K={x.shape[1]}")


def _launch(x, r, weight, y, h, eps, pdl) -> None:
    m, k = x.shape
    if pdl is None:
        pdl = x.device.type == "cuda" and _pdl_default(x.device.index or 0)
    kw = dict(BLOCK=triton.next_power_of_2(k), HAS_ADD=r is not None, USE_PDL=pdl,
              num_warps=4 if k <= 1024 else 8)  # fmt: skip
    if pdl:
        kw["launch_pdl"] = True
    _rms_norm_kernel[(m,)](x, x if r is None else r, weight, y, y if h is None else h, k,
                           x.stride(0), 0 if r is None else r.stride(0), eps, **kw)  # fmt: skip


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, *,
             pdl: bool | None = None) -> torch.Tensor:  # fmt: skip
    """``RMSNorm(x) * weight`` as a new packed ``[M, K]`` tensor; ``x`` may be a row-strided
    view (e.g. ``kv_c`` inside MLA's ``qkv_lora``). ``pdl`` defaults to on for SM90+."""
    _check(x, weight)
    y = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    _launch(x, None, weight, y, None, eps, pdl)
    return y


def add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float, *,
                 pdl: bool | None = None) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    """``h = bf16(x + residual)``; returns ``(RMSNorm(h) * weight, h)``, both new packed tensors."""
    _check(x, weight)
    if residual.shape != x.shape or residual.stride(1) != 1:
        raise ValueError(f"residual {tuple(residual.shape)} does not match x {tuple(x.shape)}")
    y = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    h = torch.empty(x.shape, dtype=residual.dtype, device=x.device)
    _launch(x, residual, weight, y, h, eps, pdl)
    return y, h
