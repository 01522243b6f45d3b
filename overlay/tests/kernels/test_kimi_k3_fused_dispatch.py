# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-k3-overlay project
"""CPU tests of the fused decode ops' dispatch, backends and model call sites (vllm-k3-overlay).

* the registry finds one backend per fused op, apart from the GEMM dispatch's;
* the SM90 table holds every row of its data module, each checked by its backend, and
  a table with a bad row does not build;
* each ``try_*`` routes a table row to its backend (a recording fake: no GPU here) and
  answers None, without raising, on every precondition it guards: switch off, no
  table, no row, M outside the row, dtype, device, strides, shapes, batch-invariant
  mode, a backend not built;
* the model's call sites (``fused_decode``) return the fused result when routed and
  run the very vLLM module they wrap otherwise; the MoE's three input projections are
  stacked into row views of one weight only where the fused path can run, and read
  back as one GEMM;
* each backend's ``launch`` on the real kernel under Triton's interpreter (fp16: numpy
  has no bf16) against float64 of the unfused sequence, new residual included (and the
  gate GEMM's fp32 logits to fp32 accuracy).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from types import SimpleNamespace

import pytest
import torch
from torch import nn

from vllm.model_executor.layers.activation import SiluAndMul, SituAndMul
from vllm.model_executor.layers.fused_moe.router.gate_linear import GateLinear
from vllm.model_executor.layers.layernorm import RMSNorm
from vllm.model_executor.layers.linear import UnquantizedLinearMethod
from vllm.models.kimi_k3.nvidia import fused_decode, gemm_backends
from vllm.models.kimi_k3.nvidia import low_latency_fused_dispatch as fd
from vllm.models.kimi_k3.nvidia import low_latency_fused_sm90 as sm90_data
from vllm.models.kimi_k3.nvidia import low_latency_gemm_dispatch as k3

BF16 = torch.bfloat16
SM90 = (9, 0)


def _rows_of(op: str) -> dict:
    """``{shape: (backend, cfg, token counts)}`` of the SM90 data for ``op``."""
    return sm90_data.FUSED_SM90[op]


def _a_row(op: str) -> tuple[tuple, str, int]:
    """(shape, backend name, an M it routes) of the first SM90 data row of ``op``."""
    shape, (name, _, token_counts) = next(iter(_rows_of(op).items()))
    return shape, name, token_counts[0]


# ---------------------------------------------------------------------- fixtures


class Recorder:
    """Stands in for a backend's ``launch``: records the operands, returns a marker."""

    def __init__(self, result) -> None:
        self.calls: list[tuple] = []
        self.result = result

    def __call__(self, _self, config, *operands):
        self.calls.append((config, *operands))
        return self.result


@pytest.fixture
def routed(monkeypatch: pytest.MonkeyPatch) -> dict[str, Recorder]:
    """Switch on, an SM90 device, CPU tensors let through, every fused backend built and
    its launch a recorder; ``{op: recorder}``."""
    monkeypatch.setattr(fd, "_device_capability", lambda: SM90)
    monkeypatch.setattr(fd, "_FAST_PATH_DEVICE_TYPE", "cpu")
    monkeypatch.setattr(fd, "_enabled", True)
    monkeypatch.delenv("VLLM_BATCH_INVARIANT", raising=False)
    recorders = {}
    for op in fd.OPS:
        result = ("out", "h") if op in ("add_rmsnorm_gemm", "rmsnorm") else "out"
        for backend in gemm_backends.backends_for(op).values():
            recorders[op] = Recorder(result)
            monkeypatch.setattr(type(backend), "launch", recorders[op])
            monkeypatch.setattr(type(backend), "is_available", lambda self: True)
    return recorders


def bf16(*shape: int) -> torch.Tensor:
    return torch.empty(shape, dtype=BF16)


def gemm_operands(op: str, m: int | None = None):
    """Valid operands for the first SM90 row of a GEMM-kind op: x, g, weight, residual."""
    (n, k), _, m0 = _a_row(op)
    m = m or m0
    residual = bf16(m, k) if op == "add_rmsnorm_gemm" else None
    return bf16(m, k), bf16(k), bf16(n, k), residual


# ---------------------------------------------------------------------- registry


def test_registry_finds_one_backend_per_fused_op_apart_from_the_gemm_dispatch() -> None:
    for op in fd.OPS:
        found = gemm_backends.backends_for(op)
        assert found, f"no backend of op {op!r}"
        assert all(b.op == op for b in found.values())
        assert not set(found) & set(gemm_backends.BACKENDS), "a fused backend in the GEMM op"
    assert not set(k3.BACKENDS) & {b for op in fd.OPS for b in gemm_backends.backends_for(op)}


def test_sm90_table_holds_every_data_row_with_its_source() -> None:
    table = fd.TABLES_BY_CAPABILITY[SM90]
    want = {(op, tuple(shape), m, name)
            for op, rows in sm90_data.FUSED_SM90.items()
            for shape, (name, _, ms) in rows.items() for m in ms}  # fmt: skip
    got = {(op, shape, m, call.backend) for op, shape, m, call in table.rows()}
    assert got == want
    assert {"gpu", "date", "source"} <= set(table.provenance)
    assert table.provenance["gpu"] == sm90_data.PROVENANCE["gpu"]


@pytest.mark.parametrize(
    "mutate, message",
    [
        (lambda d: d.update(no_such_op={}), "unknown fused op"),
        (lambda d: d["rmsnorm"].update({(64,): ("no_such", None, (1,))}), "unknown backend"),
        (lambda d: d["rmsnorm"].update({(64,): ("pdl_rmsnorm", None, (17,))}), "outside"),
        (lambda d: d["rmsnorm"].update({(64,): ("pdl_rmsnorm", (1, 2), (1,))}), "no config"),
        # a backend of another op under this op's name is unknown here
        (lambda d: d["rmsnorm"].update({(64,): ("pdl_act_mul", None, (1,))}), "unknown backend"),
        # block_k 256 does not fit a K of 100
        (lambda d: d["rmsnorm_gemm"].update({(64, 100): ("swap_ab_rmsnorm", (64, 256, 1, 4, 4), (1,))}),
         "at M=1"),
    ],
)  # fmt: skip
def test_a_table_with_a_bad_row_does_not_build(mutate, message) -> None:
    data = {op: dict(rows) for op, rows in sm90_data.FUSED_SM90.items()}
    mutate(data)
    with pytest.raises(ValueError, match=message):
        fd.FusedTable("SM90", data, {})


# ---------------------------------------------------------------------- routing


@pytest.mark.parametrize("op", ["rmsnorm_gemm", "add_rmsnorm_gemm"])
def test_try_rmsnorm_gemm_routes_a_table_row(routed, op) -> None:
    x, g, w, residual = gemm_operands(op)
    add_to = bf16(x.shape[0], w.shape[0])
    got = fd.try_rmsnorm_gemm(x, g, 1e-5, w, residual, add_to=add_to)
    assert got == (("out", None) if residual is None else ("out", "h"))
    (call,) = routed[op].calls
    assert call[-1] is add_to and any(t is x for t in call)
    assert any(isinstance(v, float) and v == 1e-5 for v in call), "eps not passed on"


def test_try_rms_norm_and_act_mul_route_their_rows(routed) -> None:
    (k,), _, m = _a_row("rmsnorm")
    x, g = bf16(m, k), bf16(k)
    assert fd.try_rms_norm(x, g, 1e-6) == ("out", "h")
    assert fd.try_rms_norm(x, g, 1e-6, bf16(m, k)) == ("out", "h")
    assert len(routed["rmsnorm"].calls) == 2
    (d,), _, m = _a_row("act_mul")
    assert fd.try_act_mul(bf16(m, 2 * d), situ_beta=2.0, situ_linear_beta=3.0) == "out"
    assert routed["act_mul"].calls[0][-2:] == (2.0, 3.0)


def _gemm_refusals():
    """(why, function(x, g, w, residual) -> kwargs for try_rmsnorm_gemm) per precondition."""
    return {
        "fp16 x": lambda x, g, w, r: dict(x=x.half()),
        "fp32 norm weight": lambda x, g, w, r: dict(norm_weight=g.float()),
        "norm weight of another length": lambda x, g, w, r: dict(norm_weight=bf16(g.shape[0] + 8)),
        "x with a column stride": lambda x, g, w, r: dict(x=bf16(x.shape[0], 2 * x.shape[1])[:, ::2]),
        "x of another K": lambda x, g, w, r: dict(x=bf16(x.shape[0], x.shape[1] + 64)[:, :-128]),
        "M = 17": lambda x, g, w, r: dict(x=bf16(17, x.shape[1])),
        "a 1-D x": lambda x, g, w, r: dict(x=x[0]),
        "x not a tensor": lambda x, g, w, r: dict(x=None),
        "a weight without a row": lambda x, g, w, r: dict(weight=bf16(w.shape[0] + 16, w.shape[1])),
        "a transposed weight": lambda x, g, w, r: dict(weight=bf16(w.shape[1], w.shape[0]).t()),
        "an epilogue addend of another shape": lambda x, g, w, r: dict(add_to=bf16(x.shape[0], 8)),
        "a strided epilogue addend": lambda x, g, w, r: dict(add_to=bf16(x.shape[0], 2 * w.shape[0])[:, ::2]),
        "a meta x": lambda x, g, w, r: dict(x=torch.empty(x.shape, dtype=BF16, device="meta")),
    }  # fmt: skip


@pytest.mark.parametrize("op", ["rmsnorm_gemm", "add_rmsnorm_gemm"])
@pytest.mark.parametrize("why", sorted(_gemm_refusals()))
def test_try_rmsnorm_gemm_answers_none_on_each_precondition(routed, op, why) -> None:
    x, g, w, r = gemm_operands(op)
    kwargs = dict(x=x, norm_weight=g, eps=1e-6, weight=w, residual=r)
    kwargs.update(_gemm_refusals()[why](x, g, w, r))
    assert fd.try_rmsnorm_gemm(**kwargs) is None, why
    assert not routed[op].calls


def test_the_add_variant_checks_its_residual(routed) -> None:
    x, g, w, r = gemm_operands("add_rmsnorm_gemm")
    for bad in (r[:-1], r.half(), bf16(r.shape[0], 2 * r.shape[1])[:, ::2]):
        assert fd.try_rmsnorm_gemm(x, g, 1e-6, w, bad) is None
    assert not routed["add_rmsnorm_gemm"].calls


@pytest.mark.parametrize(
    "state",
    ["switch off", "no CUDA device", "a GPU without a table", "batch invariant", "not built",
     "M without an entry"],
)  # fmt: skip
def test_every_entry_answers_none_off_the_table(routed, monkeypatch, state) -> None:
    if state == "switch off":
        fd.disable_kimi_k3_fused_decode()
    elif state == "no CUDA device":
        monkeypatch.setattr(fd, "_device_capability", lambda: None)
    elif state == "a GPU without a table":
        monkeypatch.setattr(fd, "_device_capability", lambda: (10, 0))
    elif state == "batch invariant":
        monkeypatch.setenv("VLLM_BATCH_INVARIANT", "1")
    elif state == "not built":
        for op in fd.OPS:
            for backend in gemm_backends.backends_for(op).values():
                monkeypatch.setattr(type(backend), "is_available", lambda self: False)
    x, g, w, r = gemm_operands("add_rmsnorm_gemm")
    if state == "M without an entry":  # the add row lists M = 16 only
        missing = min(set(range(1, 17)) - set(_rows_of("add_rmsnorm_gemm")[tuple(w.shape)][2]))
        x, r = x[:missing], r[:missing]
    (k,), _, m = _a_row("rmsnorm")
    (d,), _, _ = _a_row("act_mul")
    assert fd.try_rmsnorm_gemm(x, g, 1e-6, w, r) is None
    if state != "M without an entry":
        assert fd.try_rms_norm(bf16(m, k), bf16(k), 1e-6) is None
        assert fd.try_act_mul(bf16(m, 2 * d)) is None
        (gn, gk), _, gm = _a_row("gate_gemm")
        assert fd.try_gate_gemm(bf16(gm, gk), bf16(gn, gk), 384) is None
        assert fd.try_rmsnorm_gemm(*gemm_operands("rmsnorm_gemm")[:1], bf16(_a_row("rmsnorm_gemm")[0][1]),
                                   1e-6, gemm_operands("rmsnorm_gemm")[2]) is None  # fmt: skip
    assert not any(rec.calls for rec in routed.values())


def test_row_ops_answer_none_on_odd_operands(routed) -> None:
    (k,), _, m = _a_row("rmsnorm")
    (d,), _, _ = _a_row("act_mul")
    assert fd.try_rms_norm(bf16(m, k + 64), bf16(k + 64), 1e-6) is None  # no row
    assert fd.try_rms_norm(bf16(m, k), bf16(k), 1e-6, bf16(m + 1, k)) is None
    assert fd.try_rms_norm(bf16(m, k).half(), bf16(k), 1e-6) is None
    assert fd.try_rms_norm(bf16(m, k), bf16(k + 1)[1:], 1e-6) is not None  # a view is fine
    assert fd.try_act_mul(bf16(m, 2 * d + 1)) is None
    assert fd.try_act_mul(bf16(m, 4 * d)[:, ::2]) is None
    assert fd.try_act_mul(bf16(17, 2 * d)) is None
    assert fd.try_act_mul("not a tensor") is None
    assert len(routed["rmsnorm"].calls) == 1 and not routed["act_mul"].calls


def test_try_gate_gemm_routes_its_row_and_answers_none_on_odd_operands(routed) -> None:
    (n, k), _, m = _a_row("gate_gemm")
    x, w = bf16(m, k), bf16(n, k)
    assert fd.try_gate_gemm(x, w, 384) == "out"
    (call,) = routed["gate_gemm"].calls
    assert call[-3] is x and call[-2] is w and call[-1] == 384
    for bad in (
        dict(n_fp32=0), dict(n_fp32=n), dict(n_fp32=384.0), dict(n_fp32=True), dict(n_fp32=None),
        dict(x=x.half()), dict(x=bf16(17, k)), dict(x=bf16(m, 2 * k)[:, ::2]), dict(x=x[0]),
        dict(x="not a tensor"), dict(stacked_weight=bf16(n + 16, k)),
        dict(stacked_weight=bf16(k, n).t()), dict(stacked_weight=w.half()), dict(stacked_weight=None),
        dict(x=torch.empty(x.shape, dtype=BF16, device="meta")),
    ):  # fmt: skip
        kwargs = dict(x=x, stacked_weight=w, n_fp32=384) | bad
        assert fd.try_gate_gemm(**kwargs) is None, bad
    assert len(routed["gate_gemm"].calls) == 1


# ---------------------------------------------------------------------- switch


def test_the_gemm_dispatchs_enable_call_turns_the_switch_on(monkeypatch) -> None:
    monkeypatch.setattr(fd, "_enabled", False)
    model = nn.Linear(4, 4, bias=False).to(BF16)
    monkeypatch.setattr(fd, "_device_capability", lambda: None)
    k3.enable_kimi_k3_low_latency_gemm(model, BF16)
    assert not fd._enabled, "switched on without a table"
    monkeypatch.setattr(fd, "_device_capability", lambda: SM90)
    k3.enable_kimi_k3_low_latency_gemm(model, torch.float16)
    assert not fd._enabled, "switched on for a non-BF16 model"
    assert k3.enable_kimi_k3_low_latency_gemm(model, BF16) == 0  # CPU: no GEMM layers planned
    assert fd._enabled
    assert fd.enable_kimi_k3_fused_decode(model, BF16) == 0, "warmed a kernel on the CPU"


# ---------------------------------------------------------------------- call sites


class Module(nn.Module):
    """A stand-in vLLM layer: records its calls, returns a marker."""

    def __init__(self) -> None:
        super().__init__()
        self.calls = []

    def forward(self, *args):
        self.calls.append(args)
        return "stock"


def test_call_sites_run_the_stock_module_unless_routed(monkeypatch) -> None:
    x = bf16(2, 512)
    other = Module()
    assert fused_decode.rms_norm(other, x) == "stock"
    assert fused_decode.rms_norm(other, x, x) == "stock"
    assert fused_decode.act_and_mul(other, x) == "stock"
    assert len(other.calls) == 3
    transform = SimpleNamespace(norm=other, up_proj=None)
    assert fused_decode.routed_output(transform, x, None) is None


def bare(cls, **attrs) -> nn.Module:
    """An instance of vLLM's ``cls`` with only ``attrs`` set: its constructor wants a
    vLLM config and a device, the call sites read only attributes."""
    module = cls.__new__(cls)
    nn.Module.__init__(module)
    for name, value in attrs.items():
        setattr(module, name, value)
    return module


def test_call_sites_take_the_fused_path_for_vllm_modules(monkeypatch) -> None:
    seen = {}
    monkeypatch.setattr(fused_decode, "try_rms_norm", lambda *a: seen.setdefault("norm", ("y", "h")))
    monkeypatch.setattr(fused_decode, "try_act_mul", lambda g, **kw: seen.setdefault("act", kw) and "a")
    monkeypatch.setattr(fused_decode, "try_rmsnorm_gemm",
                        lambda *a, **kw: seen.setdefault("gemm", (a, kw)) and ("o", None))  # fmt: skip
    norm = bare(RMSNorm, weight=nn.Parameter(bf16(512)), variance_epsilon=1e-5, has_weight=True,
                variance_size_override=None)  # fmt: skip
    x = bf16(2, 512)
    assert fused_decode.rms_norm(norm, x) == "y"
    assert fused_decode.rms_norm(norm, x, x) == ("y", "h")
    assert fused_decode.act_and_mul(bare(SituAndMul, beta=2.0, linear_beta=3.0), x) == "a"
    assert seen["act"] == {"situ_beta": 2.0, "situ_linear_beta": 3.0}
    assert fused_decode.act_and_mul(bare(SiluAndMul), x) == "a"
    w = bf16(64, 512)
    up = SimpleNamespace(quant_method=UnquantizedLinearMethod(), bias=None, weight=w)
    shared = bf16(2, 64)
    assert fused_decode.routed_output(SimpleNamespace(norm=norm, up_proj=up), x, shared) == "o"
    args, kw = seen["gemm"]
    assert args[0] is x and args[1] is norm.weight and args[3] is w and kw["add_to"] is shared
    # a biased or quantized projection, or a norm without weight, keeps the stock lines
    for bad in (SimpleNamespace(quant_method=UnquantizedLinearMethod(), bias=w[0], weight=w),
                SimpleNamespace(quant_method=object(), bias=None, weight=w)):  # fmt: skip
        assert fused_decode.routed_output(SimpleNamespace(norm=norm, up_proj=bad), x, None) is None
    assert fused_decode.routed_output(SimpleNamespace(norm=None, up_proj=up), x, None) is None
    weightless = bare(RMSNorm, weight=None, variance_epsilon=1e-5, has_weight=False,
                      variance_size_override=None)  # fmt: skip
    assert fused_decode.routed_output(SimpleNamespace(norm=weightless, up_proj=up), x, None) is None


# ------------------------------------------------- the MoE's stacked input projections


class FakeMoE(nn.Module):
    """Stands in for v0.28.0's ``KimiMoE``: only the attributes the stacking reads."""


E, L, G, H = 384, 3584, 1536, 7168  # Kimi-K3 TP8: gate, routed_down, shared gate_up rows


def _linear(weight: torch.Tensor, quant_method=None, bias=None):
    return SimpleNamespace(quant_method=quant_method or UnquantizedLinearMethod(), bias=bias,
                           weight=nn.Parameter(weight, requires_grad=False))  # fmt: skip


def fake_moe(rows=(E, L, G), empty=True, **changes) -> FakeMoE:
    """A MegaMoE-branch MoE whose three projections can stack; ``changes`` spoil one thing."""
    make = (lambda n: torch.empty(n, H, dtype=BF16)) if empty else (lambda n: torch.randn(n, H).to(BF16))
    moe = FakeMoE()
    moe.use_mega_moe = changes.get("use_mega_moe", True)
    moe.gate = changes.get("gate") or bare(
        GateLinear, weight=nn.Parameter(make(rows[0]), requires_grad=False), bias=None,
        out_dtype=changes.get("out_dtype", torch.float32))  # fmt: skip
    moe.routed_expert_down_proj = changes.get("down") or _linear(make(rows[1]))
    moe.shared_experts = SimpleNamespace(
        shard_sequence_parallel=changes.get("shard_sp", False), gate_up_proj=_linear(make(rows[2])))
    return moe


def test_stacking_makes_the_three_weights_views_of_one_tensor(routed) -> None:
    model = nn.Sequential(fake_moe(empty=False), nn.Linear(2, 2))
    moe = model[0]
    params = (moe.gate.weight, moe.routed_expert_down_proj.weight, moe.shared_experts.gate_up_proj.weight)
    before = [p.detach().clone() for p in params]
    assert fused_decode.stack_moe_input_weights(model, FakeMoE) == 1
    after = (moe.gate.weight, moe.routed_expert_down_proj.weight, moe.shared_experts.gate_up_proj.weight)
    assert all(a is b for a, b in zip(after, params)), "the parameters must stay the same objects"
    assert all(torch.equal(p, b) for p, b in zip(params, before)), "values changed"
    storage = params[0].untyped_storage()
    # one storage of exactly the stack's bytes: the old ones are no longer held by the params
    assert all(p.untyped_storage().data_ptr() == storage.data_ptr() for p in params)
    assert storage.nbytes() == (E + L + G) * H * 2
    assert [p.data_ptr() - storage.data_ptr() for p in params] == [0, E * H * 2, (E + L) * H * 2]
    assert all(p.is_contiguous() for p in params)


@pytest.mark.parametrize("spoil", [
    dict(use_mega_moe=False), dict(out_dtype=BF16), dict(shard_sp=True),
    dict(gate=SimpleNamespace(weight=nn.Parameter(torch.empty(E, H, dtype=BF16)), bias=None,
                              out_dtype=torch.float32)),
    dict(down=_linear(torch.empty(L, H, dtype=BF16), quant_method=object())),
    dict(down=_linear(torch.empty(L, H, dtype=BF16), bias=torch.empty(L, dtype=BF16))),
    dict(down=_linear(torch.empty(L, H, dtype=torch.float16))),
    dict(down=_linear(torch.empty(L, 2 * H, dtype=BF16)[:, :H])),
    dict(rows=(E, L, G + 64)),  # a stacked shape without a table row
], ids=["FusedMoE branch", "bf16 logits", "sequence-parallel shared experts",
        "another gate class", "quantized down_proj", "biased down_proj", "fp16 down_proj",
        "strided down_proj", "no row"])  # fmt: skip
def test_stacking_leaves_a_moe_alone_where_the_fused_path_cannot_run(routed, spoil) -> None:
    moe = fake_moe(**spoil)
    ptrs = [moe.gate.weight.data_ptr(), moe.routed_expert_down_proj.weight.data_ptr()]
    assert fused_decode.stack_moe_input_weights(nn.Sequential(moe), FakeMoE) == 0
    assert ptrs == [moe.gate.weight.data_ptr(), moe.routed_expert_down_proj.weight.data_ptr()]
    assert fused_decode.moe_input_projections(moe, bf16(2, H)) is None
    assert not routed["gate_gemm"].calls


def test_stacking_needs_the_switch_on_and_the_exact_class(routed, monkeypatch) -> None:
    class SubMoE(FakeMoE):
        pass

    sub = fake_moe()
    sub.__class__ = SubMoE
    assert fused_decode.stack_moe_input_weights(nn.Sequential(sub), FakeMoE) == 0
    fd.disable_kimi_k3_fused_decode()
    assert fused_decode.stack_moe_input_weights(nn.Sequential(fake_moe()), FakeMoE) == 0


def test_the_stacked_moe_runs_one_gemm_and_hands_out_views(routed) -> None:
    moe = fake_moe()
    assert fused_decode.stack_moe_input_weights(nn.Sequential(moe), FakeMoE) == 1
    logits, rest = torch.empty(3, E), bf16(3, L + G)
    routed["gate_gemm"].result = (logits, rest)
    x = bf16(3, H)
    got_logits, latent, gate_up = fused_decode.moe_input_projections(moe, x)
    (call,) = routed["gate_gemm"].calls
    assert call[-3] is x and call[-2] is moe._k3_input_stack.weight and call[-1] == E
    assert got_logits is logits
    assert latent.data_ptr() == rest.data_ptr() and latent.shape == (3, L)
    assert gate_up.data_ptr() == rest[:, L:].data_ptr() and gate_up.shape == (3, G)
    # a weight reload that replaced a parameter's storage: the stack is stale, stock lines
    moe.routed_expert_down_proj.weight.data = torch.empty(L, H, dtype=BF16)
    assert fused_decode.moe_input_projections(moe, x) is None
    assert len(routed["gate_gemm"].calls) == 1


def test_the_stock_activation_gets_a_packed_gate_up(routed) -> None:
    other = Module()
    wide = torch.randn(2, 3 * 512).to(BF16)
    assert fused_decode.act_and_mul(other, wide[:, 512:]) == "stock"
    (args,) = other.calls
    assert args[0].is_contiguous() and torch.equal(args[0], wide[:, 512:])


# ---------------------------------------------------------------------- real kernels

_SCRIPT = textwrap.dedent(
    """
    import json, torch
    from vllm.models.kimi_k3.nvidia import gemm_backends
    from vllm.models.kimi_k3.nvidia.swap_ab_gemm import SwapAbConfig
    D = torch.float64
    def rms(t, g, eps=1e-6):
        t = t.to(D); return t * torch.rsqrt(t.pow(2).mean(-1, keepdim=True) + eps) * g.to(D)
    def err(y, ref):
        return float((y.to(D) - ref).norm() / ref.norm())
    def of(op):
        (backend,) = gemm_backends.backends_for(op).values(); return backend
    g = torch.Generator().manual_seed(7)
    rnd = lambda *s: torch.randn(*s, generator=g).half()
    m, n, k = 5, 40, 256
    cfg = SwapAbConfig(16, 64, 2, 4, 2)
    w = (torch.randn(n, k, generator=g) / k ** 0.5).half()
    x, r, add, gw = rnd(m, k), rnd(m, k), rnd(m, n), (1 + 0.1 * torch.randn(k, generator=g)).half()
    out = {}
    y = of("rmsnorm_gemm").launch(cfg, x, gw, 1e-6, w, add)
    out["rmsnorm_gemm"] = err(y, rms(x, gw) @ w.to(D).t() + add.to(D))
    y, h = of("add_rmsnorm_gemm").launch(cfg, x, r, gw, 1e-6, w, None)
    hr = x.to(D) + r.to(D)
    out["add_rmsnorm_gemm"] = err(y, rms(hr, gw) @ w.to(D).t()); out["add_h"] = err(h, hr)
    y, none = of("rmsnorm").launch(None, x, gw, 1e-6, None)
    out["rmsnorm"] = err(y, rms(x, gw)); out["rmsnorm_none"] = none is None
    y, h = of("rmsnorm").launch(None, x, gw, 1e-6, r)
    out["add_rmsnorm"] = err(y, rms(hr, gw)); out["add_rmsnorm_h"] = err(h, hr)
    gu = rnd(m, 2 * k); gt, up = gu[:, :k].to(D), gu[:, k:].to(D)
    y = of("act_mul").launch(None, gu, 2.0, 3.0)
    out["act_mul"] = err(y, 2.0 * torch.tanh(gt / 2.0) * torch.sigmoid(gt) * 3.0 * torch.tanh(up / 3.0))
    lo, hi = of("gate_gemm").launch(cfg, x, w, 13)  # the split inside the first 16-row tile
    ref = x.to(D) @ w.to(D).t()
    out["gate_gemm_fp32"] = err(lo, ref[:, :13]); out["gate_gemm_rest"] = err(hi, ref[:, 13:])
    out["gate_gemm_dtypes"] = [str(lo.dtype), str(hi.dtype)]
    print(json.dumps(out))
    """
)


def test_each_backend_launches_its_kernel_right_under_the_interpreter() -> None:
    pytest.importorskip("triton")
    env = dict(os.environ, TRITON_INTERPRET="1", CUDA_VISIBLE_DEVICES="")
    proc = subprocess.run([sys.executable, "-c", _SCRIPT], capture_output=True, text=True,
                          env=env, timeout=900)  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    got = json.loads(proc.stdout.strip().splitlines()[-1])
    assert got.pop("rmsnorm_none") is True
    assert got.pop("gate_gemm_dtypes") == ["torch.float32", "torch.float16"]
    assert got["gate_gemm_fp32"] < 2e-5, "the logits went through a 16-bit rounding"
    for what, rel in got.items():
        # fp16 operands, fp32 accumulation: ~5e-4; a swapped operand or scale is O(1).
        assert rel < 3e-3, f"{what}: rel err {rel:.2e}"


# ---------------------------------------------------------------------- the patch


def _calls_in(tree, cls: str, method: str) -> set[str]:
    """Names of the functions ``cls.method`` of a parsed module calls by plain name."""
    import ast

    (node,) = [n for n in ast.walk(tree) if isinstance(n, ast.ClassDef) and n.name == cls]
    (fn,) = [f for f in node.body if isinstance(f, ast.FunctionDef) and f.name == method]
    return {c.func.id for c in ast.walk(fn) if isinstance(c, ast.Call) and isinstance(c.func, ast.Name)}


def test_patch_0007_stacks_the_moe_input_projections_and_calls_them_as_one() -> None:
    """The tree's model.py (patched): the post-load hook stacks, the MoE's router/down
    method tries the one GEMM first, and KimiMLP takes the precomputed gate_up."""
    import ast
    from pathlib import Path

    source = Path(fused_decode.__file__).with_name("model.py").read_text("utf-8")
    tree = ast.parse(source)
    assert "stack_moe_input_weights" in _calls_in(tree, "KimiLinearForCausalLM",
                                                  "process_weights_after_loading")  # fmt: skip
    assert "moe_input_projections" in _calls_in(tree, "KimiMoE", "_maybe_overlap_router_and_down_proj")
    (mlp,) = [n for n in ast.walk(tree) if isinstance(n, ast.ClassDef) and n.name == "KimiMLP"]
    (fwd,) = [f for f in mlp.body if isinstance(f, ast.FunctionDef) and f.name == "forward"]
    assert [a.arg for a in fwd.args.args] == ["self", "x", "gate_up"]


def test_patch_0005_routes_each_call_site_through_fused_decode() -> None:
    """The tree's model.py (patched) calls our call-site functions where the stock lines were."""
    import ast
    from pathlib import Path

    source = Path(fused_decode.__file__).with_name("model.py").read_text("utf-8")
    tree = ast.parse(source)
    assert "from vllm.models.kimi_k3.nvidia.fused_decode import" in source
    assert "act_and_mul" in _calls_in(tree, "KimiMLP", "forward")
    assert "routed_output" in _calls_in(tree, "KimiRoutedOutputTransform", "forward")
    for method in ("_pre_attn_norm", "_post_attn_norm"):
        assert "rms_norm" in _calls_in(tree, "KimiDecoderLayer", method), method
