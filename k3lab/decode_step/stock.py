"""Stand-ins for the stock small ops whose v0.28.0 kernels cannot run without vLLM's ``_C``.

Each is one Triton launch without PDL, the shape of what vLLM runs on SM90:

* ``situ_and_mul``: ``torch.ops._C.situ_and_mul`` (``SituAndMul.forward_cuda``, one CUDA
  kernel, fp32 math, one bf16 rounding): ``beta*tanh(g/beta)*sigmoid(g) * u``;
* ``sigmoid_mul``: MLA's ``_gate_sigmoid_mul`` (``torch.compile``: Inductor emits one
  fused Triton kernel): ``x * sigmoid(gate)``.

The RMSNorm and fused-add RMSNorm stand-ins (``torch.ops._C.rms_norm`` /
``fused_add_rms_norm``) are our overlay ``norm`` kernel launched with ``pdl=False``: one
launch, fp32 math, no PDL, as vLLM's CUDA kernels. ``rms_norm_out`` and
``fused_add_rms_norm_`` are the same in ``_C``'s calling convention (output buffer, in-place
add), for the model check (:mod:`k3lab.decode_step.model_check`), which registers them, with
``situ_and_mul``, as ``torch.ops._C`` ops under v0.28.0's own layers.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _situ_and_mul(x_ptr, y_ptr, D, beta, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    ok = offs < D
    g = tl.load(x_ptr + row * 2 * D + offs, mask=ok, other=0.0).to(tl.float32)
    u = tl.load(x_ptr + row * 2 * D + D + offs, mask=ok, other=0.0).to(tl.float32)
    sg = 1.0 / (1.0 + tl.exp(-g))
    th = 2.0 / (1.0 + tl.exp(-2.0 * g / beta)) - 1.0
    tl.store(y_ptr + row * D + offs, (beta * th * sg * u).to(y_ptr.dtype.element_ty), mask=ok)


@triton.jit
def _sigmoid_mul(x_ptr, g_ptr, y_ptr, D, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    ok = offs < D
    x = tl.load(x_ptr + row * D + offs, mask=ok, other=0.0).to(tl.float32)
    g = tl.load(g_ptr + row * D + offs, mask=ok, other=0.0).to(tl.float32)
    tl.store(y_ptr + row * D + offs, (x / (1.0 + tl.exp(-g))).to(y_ptr.dtype.element_ty), mask=ok)


@triton.jit
def _rms_norm(x_ptr, r_ptr, w_ptr, y_ptr, D, eps, ADD: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK)
    ok = offs < D
    x = tl.load(x_ptr + row * D + offs, mask=ok, other=0.0).to(tl.float32)
    if ADD:  # _C fused_add_rms_norm: residual += x (bf16), x = norm(residual)
        x = (x + tl.load(r_ptr + row * D + offs, mask=ok, other=0.0).to(tl.float32)).to(tl.bfloat16)
        tl.store(r_ptr + row * D + offs, x, mask=ok)
        x = x.to(tl.float32)
    w = tl.load(w_ptr + offs, mask=ok, other=0.0).to(tl.float32)
    y = x * tl.rsqrt(tl.sum(x * x, axis=0) / D + eps) * w
    tl.store(y_ptr + row * D + offs, y.to(y_ptr.dtype.element_ty), mask=ok)


def _rows(x: torch.Tensor) -> tuple[int, int]:
    return x.numel() // x.shape[-1], x.shape[-1]


def rms_norm_out(out: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, eps: float) -> None:
    """``_C.rms_norm``'s convention: ``out = rmsnorm(x) * weight``, contiguous rows."""
    m, d = _rows(x)
    _rms_norm[(m,)](x, x, weight, out, d, eps, ADD=False, BLOCK=triton.next_power_of_2(d), num_warps=8)


def fused_add_rms_norm_(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float) -> None:
    """``_C.fused_add_rms_norm``'s convention, in place: ``residual += x``, ``x = rmsnorm(residual)``."""
    m, d = _rows(x)
    _rms_norm[(m,)](x, residual, weight, x, d, eps, ADD=True, BLOCK=triton.next_power_of_2(d), num_warps=8)


def situ_and_mul(gate_up: torch.Tensor, beta: float, out: torch.Tensor | None = None) -> torch.Tensor:
    """``[M, 2D]`` packed bf16 -> ``[M, D]`` (into ``out`` when given, ``_C``'s convention)."""
    m, d2 = gate_up.shape
    d = d2 // 2
    y = torch.empty((m, d), dtype=gate_up.dtype, device=gate_up.device) if out is None else out
    _situ_and_mul[(m, triton.cdiv(d, 1024))](gate_up, y, d, beta, BLOCK=1024, num_warps=4)
    return y


def sigmoid_mul(x: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
    """``x * sigmoid(gate)``, both ``[M, D]`` packed bf16."""
    m, d = x.shape
    y = torch.empty_like(x)
    _sigmoid_mul[(m, triton.cdiv(d, 1024))](x, gate, y, d, BLOCK=1024, num_warps=4)
    return y


def mm_fp32(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """Router logits in fp32 from bf16 operands through cuBLAS (GateLinear's tier 5)."""
    try:
        return torch.mm(x, w.t(), out_dtype=torch.float32)
    except TypeError:  # a torch without mm's out_dtype: bf16 GEMM then a cast (one more kernel)
        return torch.mm(x, w.t()).float()


# Under full capture (VLLM_USE_BREAKABLE_CUDAGRAPH=0) vLLM compiles with Inductor, so its IR
# ops take their "native" implementation (platforms/cuda.py:696-698) and custom ops are off
# (config/vllm.py:1392-1398); Kimi-K3's model classes are not torch.compile'd, so RMSNorm's
# native implementation (ir/ops/layernorm.py:10-61) runs as eager PyTorch ops, one kernel
# each; SituAndMul is built with compile_native=True (model_executor/layers/activation.py:169),
# one Inductor kernel. These are those computations, written out here (fp32 math).


def native_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm as eager PyTorch ops: upcast, square, mean, rsqrt, scale, cast, weight."""
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(dim=-1, keepdim=True) + eps)
    return (xf.to(weight.dtype) * weight).to(x.dtype)


def native_add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
                        ) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    """``(rms_norm(x + residual), x + residual)`` as eager PyTorch ops (fp32 sum)."""
    xf = x.float() + residual.float()
    new_residual = xf.to(x.dtype)
    xf = xf * torch.rsqrt(xf.pow(2).mean(dim=-1, keepdim=True) + eps)
    return (xf.to(weight.dtype) * weight).to(x.dtype), new_residual


def _situ_native(gate_up: torch.Tensor, beta: float) -> torch.Tensor:
    gate, up = gate_up.float().chunk(2, dim=-1)
    return (beta * torch.tanh(gate / beta) * torch.sigmoid(gate) * up).to(gate_up.dtype)


_situ_compiled = None


def compiled_situ_and_mul(gate_up: torch.Tensor, beta: float) -> torch.Tensor:
    """SITU-and-mul through ``torch.compile`` (Inductor: one fused Triton kernel), compiled at first use."""
    global _situ_compiled
    if _situ_compiled is None:
        _situ_compiled = torch.compile(_situ_native)
    return _situ_compiled(gate_up, beta)


def _gate_native(x: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
    return x * gate.sigmoid()


_gate_compiled = None


def compiled_sigmoid_mul(x: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
    """MLA's output gate as v0.28.0 runs it in every mode: the expression of
    ``mla.py:111-114`` under ``torch.compile`` (Inductor on CUDA), compiled at first use."""
    global _gate_compiled
    if _gate_compiled is None:
        _gate_compiled = torch.compile(_gate_native)
    return _gate_compiled(x, gate)
