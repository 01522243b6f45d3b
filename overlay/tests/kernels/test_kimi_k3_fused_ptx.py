# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-k3-overlay project
"""PDL order in the PTX of our fused GEMM, skinny GEMM and norm kernels, built for sm_90 on a CPU.

Triton compiles for a GPU target without a GPU. What PDL buys depends on where the
instructions sit: the trigger (``griddepcontrol.launch_dependents``) early, and
nothing a previous kernel may have written read before ``griddepcontrol.wait``. In
the fused GEMM only the weight's L2 prefetch may come before the wait (every load
comes after it); in the norm kernel the norm weight's load may, the row's may not; in
the skinny GEMM the first weight chunk's loads must (its point), x's must not.
Skipped, with the reason, where this Triton cannot compile for sm_90.
"""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
triton = pytest.importorskip("triton")

from vllm.triton_utils import HAS_TRITON  # noqa: E402

if not HAS_TRITON:  # vLLM's placeholders stand in for triton.jit: no kernel to compile
    pytest.skip("vllm.triton_utils found no usable Triton (HAS_TRITON is False)",
                allow_module_level=True)  # fmt: skip

from vllm.models.kimi_k3.nvidia import attn_res as ar  # noqa: E402
from vllm.models.kimi_k3.nvidia import fused_gemm as fg  # noqa: E402
from vllm.models.kimi_k3.nvidia import norm  # noqa: E402
from vllm.models.kimi_k3.nvidia import pointwise as pw  # noqa: E402

_INTS = {"M", "N", "K", "D", "H", "stride_x", "stride_a", "HALF", "tiles_per_split", "split_k", "ROWS",
         "chunks_per_split", "ss_off", "stride_r", "stride_g", "stride_e", "stride_h", "N_FP32",
         "stride_p", "stride_d", "stride_bm", "stride_br", "write_idx", "start", "end",
         "stride_w"}  # fmt: skip
_FLOATS = {"eps", "beta", "lin_beta", "out_eps"}
_POINTERS = {"part_ptr": "*fp32", "cnt_ptr": "*i32", "pos_ptr": "*i64", "ids_ptr": "*i64", "x_ptr": "*bf16"}


def _ptx(kernel, constexprs: dict, pointers: dict | None = None, options: dict | None = None,
         divisible: bool | tuple = ()) -> str:
    """PTX for sm_90; ``divisible``: the arguments to compile as multiples of 16 (pointers:
    16-byte aligned), as Triton specialises them at a launch: a tuple of names, or True for
    every pointer and int argument."""
    try:
        from triton.backends.compiler import GPUTarget
        from triton.compiler import ASTSource
    except ImportError as e:  # pragma: no cover - Triton layout changed
        pytest.skip(f"this Triton has no ASTSource/GPUTarget: {e}")
    sig = {}
    for name in kernel.arg_names:
        if name in constexprs:
            sig[name] = "constexpr"
        elif name in _INTS:
            sig[name] = "i32"
        elif name in _FLOATS:
            sig[name] = "fp32"
        else:
            sig[name] = {**_POINTERS, **(pointers or {})}.get(name, "*bf16")
    named = set(divisible) if isinstance(divisible, tuple) else None
    attrs = {(i,): [["tt.divisibility", 16]] for i, name in enumerate(kernel.arg_names)
             if (name in named if named is not None else divisible)
             and sig[name] != "constexpr" and sig[name] != "fp32"}  # fmt: skip
    try:
        compiled = triton.compile(ASTSource(kernel, sig, constexprs=constexprs, attrs=attrs),
                                  target=GPUTarget("cuda", 90, 32), options=options or {})  # fmt: skip
    except Exception as e:  # no ptxas / no NVIDIA backend in this Triton
        pytest.skip(f"Triton cannot compile for sm_90 here: {type(e).__name__}: {str(e)[-300:]}")
    return compiled.asm["ptx"]


def _lines(ptx: str) -> list[str]:
    return [ln.strip() for ln in ptx.splitlines()]


# prologue "none" with the split-dtype epilogue (gemm_split_dtype: fp32 y, bf16 y2)
_VARIANTS = [(p, False) for p in sorted(fg.PROLOGUES)] + [("none", True)]


@pytest.mark.parametrize("split", [False, True])
@pytest.mark.parametrize("prologue,split_out", _VARIANTS,
                         ids=[p + ("-split_dtype" if so else "") for p, so in _VARIANTS])  # fmt: skip
def test_fused_gemm_loads_nothing_before_the_wait_but_prefetches_weights(prologue, split_out,
                                                                         split) -> None:  # fmt: skip
    ptx = _ptx(fg._fused_kernel, dict(
        BLOCK_N=64, BLOCK_K=256, BLOCK_M=16, EVEN_K=not split, HAS_RESIDUAL=not split_out,
        USE_PDL=True, RAGGED=split, PROLOGUE=fg.PROLOGUES[prologue], ACT=1, LIN_CLIP=False,
        SPLIT_OUT=split_out), {"y_ptr": "*fp32"} if split_out else None)  # fmt: skip
    lines = _lines(ptx)
    wait = next(i for i, ln in enumerate(lines) if ln.startswith("griddepcontrol.wait"))
    trigger = next(i for i, ln in enumerate(lines) if ln.startswith("griddepcontrol.launch_dependents"))
    prefetch = [i for i, ln in enumerate(lines) if "prefetch.global.L2" in ln]
    loads = [i for i, ln in enumerate(lines) if "ld.global" in ln or "cp.async" in ln]
    assert prefetch and max(prefetch) < wait, "the weight prefetch must precede the wait"
    assert trigger < wait, "the trigger must come before the wait"
    assert loads and min(loads) > wait, f"{prologue}: a load precedes griddepcontrol.wait"
    assert any("mma" in ln for ln in lines[wait:]), "no tensor-core MMA after the wait"


@pytest.mark.parametrize("has_add", [False, True])
def test_norm_triggers_first_and_reads_the_row_after_the_wait(has_add) -> None:
    ptx = _ptx(norm._rms_norm_kernel, dict(BLOCK=8192, HAS_ADD=has_add, USE_PDL=True))
    lines = _lines(ptx)
    first_gdc = next(ln for ln in lines if ln.startswith("griddepcontrol"))
    assert first_gdc.startswith("griddepcontrol.launch_dependents")
    wait = next(i for i, ln in enumerate(lines) if ln.startswith("griddepcontrol.wait"))
    before = sum("ld.global" in ln for ln in lines[:wait])
    after = sum("ld.global" in ln for ln in lines[wait:])
    # The norm weight (8192 bf16 over 256 threads) is loaded before the wait, x (and the
    # residual) after it: as many loads again after, twice as many with the add.
    assert before > 0, "the norm weight should load before the wait"
    assert after >= before * (2 if has_add else 1), (before, after)


@pytest.mark.parametrize("kernel,constexprs", [
    (pw._act_mul_kernel, dict(BLOCK=1024, SITU=True, LIN_CLIP=False, USE_PDL=True)),
    (pw._sigmoid_mul_kernel, dict(BLOCK=1024, USE_PDL=True)),
    (pw._mtp_input_kernel, dict(BLOCK=8192, USE_PDL=True)),
    (pw._embed_rows_kernel, dict(BLOCK=1024, USE_PDL=True)),
], ids=["act_mul", "sigmoid_mul", "mtp_input", "embed_rows"])  # fmt: skip
def test_pointwise_trigger_first_and_read_inputs_after_the_wait(kernel, constexprs) -> None:
    lines = _lines(_ptx(kernel, constexprs))
    first_gdc = next(ln for ln in lines if ln.startswith("griddepcontrol"))
    assert first_gdc.startswith("griddepcontrol.launch_dependents")
    wait = next(i for i, ln in enumerate(lines) if ln.startswith("griddepcontrol.wait"))
    before = sum("ld.global" in ln for ln in lines[:wait])
    after = sum("ld.global" in ln for ln in lines[wait:])
    assert after > 0
    if kernel is pw._mtp_input_kernel:  # the norm weights may load early, the rows may not
        assert before > 0 and after >= before, (before, after)
    else:
        assert before == 0, f"{before} loads before griddepcontrol.wait"


@pytest.mark.parametrize("block_k,split", [(8192, False), (2048, False), (2048, True)],
                         ids=["whole-slice", "chunked", "split-k"])  # fmt: skip
@pytest.mark.parametrize("block_m", [1, 4])
def test_skinny_pdl_issues_its_weight_loads_before_the_wait(block_k, split, block_m) -> None:
    """The skinny GEMM triggers first, loads its first weight chunk (the whole slice at
    block_k >= K) before ``griddepcontrol.wait`` and x after it."""
    from vllm.models.kimi_k3.nvidia import skinny_pdl_gemm as sk

    lines = _lines(_ptx(sk._skinny_pdl_kernel, dict(
        BLOCK_N=2, BLOCK_K=block_k, BLOCK_M=block_m, SPLIT=split, HAS_RESIDUAL=True,
        USE_PDL=True), {"acc_ptr": "*fp32", "cnt_ptr": "*i32"},
        divisible=("x_ptr", "w_ptr", "y_ptr", "r_ptr", "N", "K")))  # fmt: skip
    first_gdc = next(ln for ln in lines if ln.startswith("griddepcontrol"))
    assert first_gdc.startswith("griddepcontrol.launch_dependents")
    wait = next(i for i, ln in enumerate(lines) if ln.startswith("griddepcontrol.wait"))
    before = [ln for ln in lines[:wait] if "ld.global" in ln]
    after = [ln for ln in lines[wait:] if "ld.global" in ln]
    assert before, "no weight load before griddepcontrol.wait"
    # 16-byte loads of W: 2 rows x block_k bf16 over 128 threads, 8 per vector.
    assert all(".v4.b32" in ln for ln in before), before[:3]
    assert len(before) == 2 * block_k // (128 * 8), len(before)
    assert after, "x and the residual must load after the wait"
    assert not any(ln.startswith("griddepcontrol.wait") for ln in lines[wait + 1:])


@pytest.mark.parametrize("nb,block_s,reload", [(8, 8, False), (8, 8, True), (15, 8, True), (0, 1, False)])
@pytest.mark.parametrize("has_delta", [False, True])
def test_attn_res_loads_only_the_weights_before_the_wait(nb, block_s, reload, has_delta) -> None:
    """The trigger first; before the wait only the three weight vectors load (parameters
    no kernel writes), ``prefix``, ``delta`` and ``blocks`` after it; and no store
    (the prefix and block writes) before the wait either."""
    ptx = _ptx(ar._attn_res_kernel, dict(
        NB=nb, BLOCK_S=block_s, BLOCK_D=8192, HAS_DELTA=has_delta, WRITE_BLOCK=True, OUT_NORM=True,
        RELOAD=reload, USE_PDL=True), {"out_ptr": "*bf16"})  # fmt: skip
    lines = _lines(ptx)
    first_gdc = next(ln for ln in lines if ln.startswith("griddepcontrol"))
    assert first_gdc.startswith("griddepcontrol.launch_dependents")
    wait = next(i for i, ln in enumerate(lines) if ln.startswith("griddepcontrol.wait"))
    before = sum("ld.global" in ln for ln in lines[:wait])
    after = sum("ld.global" in ln for ln in lines[wait:])
    stores_before = sum("st.global" in ln for ln in lines[:wait])
    # 8192 bf16 over the CTA's threads per vector: norm_w and qk_w (NB > 0) and out_w
    weights = 3 if nb else 1
    assert before > 0 and stores_before == 0, (before, stores_before)
    # after the wait: prefix (+ delta), and at least the NB block rows for NB > 0
    rows_after = (1 + has_delta + nb) * before // weights
    assert after >= rows_after, (before, after, rows_after)


@pytest.mark.parametrize("nb,has_delta,out_norm,stages",
                         [(8, True, True, 4), (8, False, False, 1), (0, True, True, 4),
                          (15, True, False, 8)])  # fmt: skip
def test_attn_res_loop_variant_loads_nothing_before_the_wait(nb, has_delta, out_norm, stages) -> None:
    """The loop variant: the trigger first, no load (``ld.global`` nor ``cp.async``) and
    no store before ``griddepcontrol.wait``; with aligned operands (how the launcher's
    strides and pointers specialize at H = 7168) the loads are 16-byte vectors, and
    with ``num_stages`` > 1 pass 1 is software-pipelined (``cp.async``)."""
    ptx = _ptx(ar._attn_res_loop_kernel, dict(
        NB=nb, BLOCK_S=max(1, 1 << max(nb - 1, 0).bit_length()), CH=1024, NCH=7, STAGES=stages,
        HAS_DELTA=has_delta, WRITE_BLOCK=True, OUT_NORM=out_norm, USE_PDL=True),
        {"out_ptr": "*bf16"}, dict(num_warps=8, num_stages=stages), divisible=True)  # fmt: skip
    lines = _lines(ptx)
    first_gdc = next(ln for ln in lines if ln.startswith("griddepcontrol"))
    assert first_gdc.startswith("griddepcontrol.launch_dependents")
    wait = next(i for i, ln in enumerate(lines) if ln.startswith("griddepcontrol.wait"))
    before = [ln for ln in lines[:wait] if "ld.global" in ln or "cp.async" in ln or "st.global" in ln]
    assert not before, before[:3]
    after = lines[wait:]
    assert not any("ld.global.b16" in ln for ln in after), "scalar 16-bit loads"
    if stages > 1:
        assert any(ln.startswith("cp.async") for ln in after), "pass 1 is not pipelined"
    else:
        assert any("ld.global.v4" in ln for ln in after), "no 16-byte vector loads"
