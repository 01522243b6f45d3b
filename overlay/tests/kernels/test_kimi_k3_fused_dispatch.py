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
  run the very vLLM module (or function) they wrap otherwise;
* each backend's ``launch`` on the real kernel under Triton's interpreter (fp16: numpy
  has no bf16) against float64 of the unfused sequence, new residual included; and the
  call sites of patch 0006 (MLA's q/kv front end and output gate, the MTP input and
  ``shared_head``'s add + norm) end to end through the dispatch on the real kernels;
* patches 0005 and 0006 route the model files' call sites through ``fused_decode``; the
  patched ``mla.py`` / ``mtp.py`` methods, run on stub ``self`` objects, hand the fused
  result on and run v0.28.0's lines (and only those) when the fused path answers None.
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
from vllm.model_executor.layers.linear import (
    ColumnParallelLinear,
    RowParallelLinear,
    UnquantizedLinearMethod,
)
from vllm.model_executor.layers.vocab_parallel_embedding import (
    ParallelLMHead,
    UnquantizedEmbeddingMethod,
    VocabParallelEmbedding,
)
from vllm.models.kimi_k3.nvidia import fused_decode, gemm_backends
from vllm.models.kimi_k3.nvidia import low_latency_fused_dispatch as fd
from vllm.models.kimi_k3.nvidia import low_latency_fused_sm90 as sm90_data
from vllm.models.kimi_k3.nvidia import low_latency_gemm_dispatch as k3

BF16 = torch.bfloat16
SM90 = (9, 0)


def _rows_of(op: str) -> dict:
    """``{shape: (backend, cfg, token counts)}`` of the SM90 data for ``op``."""
    return sm90_data.FUSED_SM90[op]


#: Backends whose operands check wants a CUDA GPU (the CuTe DSL ones): their rows are
#: covered by their GPU tests, the routing tests here take another row.
GPU_CHECKED = frozenset({"gemv_rmsnorm"})


def _a_row(op: str) -> tuple[tuple, str, int]:
    """(shape, backend name, an M it routes) of the first SM90 data entry of ``op`` whose
    backend checks its operands on the CPU."""
    return next((shape, name, token_counts[0])
                for shape, value in _rows_of(op).items()
                for name, _, token_counts in fd.row_entries(value)
                if name not in GPU_CHECKED)  # fmt: skip


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
    # no breakable capture active (a decode batch's full graph): where the FusedMoE
    # branch's front is off (path_enabled)
    from vllm.compilation.breakable_cudagraph import BreakableCUDAGraphCapture

    monkeypatch.setattr(BreakableCUDAGraphCapture._tls, "active", None, raising=False)
    recorders = {}
    for op in fd.OPS:
        result = ("out", "h") if op in ("add_rmsnorm_gemm", "rmsnorm") else "out"
        recorders[op] = Recorder(result)  # one per op, whichever of its backends a row names
        for backend in gemm_backends.backends_for(op).values():
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
            for shape, value in rows.items() for name, _, ms in fd.row_entries(value) for m in ms}  # fmt: skip
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
        # one shape, two backends claiming one M
        (lambda d: d["rmsnorm"].update({(64,): (("pdl_rmsnorm", None, (1, 2)), ("pdl_rmsnorm", None, (2, 3)))}),
         "two entries at M=2"),
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


def mtp_operands(m: int | None = None) -> dict:
    """Valid ``try_mtp_input`` arguments for the first SM90 ``mtp_input`` row."""
    (h,), _, m0 = _a_row("mtp_input")
    m = m or m0
    return dict(positions=torch.arange(m), embeds=bf16(m, h), prev=bf16(m, h),
                enorm_weight=bf16(h), hnorm_weight=bf16(h), eps=1e-5)  # fmt: skip


def test_try_sigmoid_mul_and_mtp_input_route_their_rows(routed) -> None:
    (d,), _, m = _a_row("sigmoid_mul")
    x, gate = bf16(m, d), bf16(m, 2 * d)[:, d:]  # a row-strided gate is fine
    assert fd.try_sigmoid_mul(x, gate) == "out"
    ((got_x, got_gate),) = routed["sigmoid_mul"].calls  # the recorder keeps the operands
    assert got_x is x and got_gate is gate, "operands swapped: the gate is the sigmoid's"
    args = mtp_operands()
    assert fd.try_mtp_input(**args) == "out"
    (got,) = routed["mtp_input"].calls
    assert all(a is b for a, b in zip(got[:5], list(args.values())[:5])), "operands reordered"
    assert got[5] == 1e-5 and isinstance(got[5], float)
    args["positions"] = args["positions"].int()  # vLLM's int64, or int32
    assert fd.try_mtp_input(**args) == "out"


def _sigmoid_refusals():
    """(why, function(x, gate) -> kwargs for try_sigmoid_mul) per precondition."""
    return {
        "no gate": lambda x, g: dict(gate=None),
        "a gate of another M": lambda x, g: dict(gate=g[:-1]),
        "an fp16 gate": lambda x, g: dict(gate=g.half()),
        "an fp32 x": lambda x, g: dict(x=x.float()),
        "a gate of another width": lambda x, g: dict(gate=bf16(x.shape[0], x.shape[1] + 8)),
        "x with a column stride": lambda x, g: dict(x=bf16(x.shape[0], 2 * x.shape[1])[:, ::2]),
        "a width without a row": lambda x, g: dict(x=bf16(x.shape[0], 64), gate=bf16(x.shape[0], 64)),
        "M = 17": lambda x, g: dict(x=bf16(17, x.shape[1]), gate=bf16(17, x.shape[1])),
        "a 1-D x": lambda x, g: dict(x=x[0], gate=g[0]),
        "a meta gate": lambda x, g: dict(gate=torch.empty(g.shape, dtype=BF16, device="meta")),
    }  # fmt: skip


@pytest.mark.parametrize("why", sorted(_sigmoid_refusals()))
def test_try_sigmoid_mul_answers_none_on_each_precondition(routed, why) -> None:
    (d,), _, m = _a_row("sigmoid_mul")
    x, gate = bf16(m, d), bf16(m, d)
    kwargs = dict(x=x, gate=gate)
    kwargs.update(_sigmoid_refusals()[why](x, gate))
    assert fd.try_sigmoid_mul(**kwargs) is None, why
    assert not routed["sigmoid_mul"].calls


def _mtp_refusals():
    """(why, function(args) -> changed arguments of try_mtp_input) per precondition."""
    m, h = mtp_operands()["embeds"].shape
    return {
        "no positions": lambda a: dict(positions=None),
        "2-D positions": lambda a: dict(positions=a["positions"][None]),
        "float positions": lambda a: dict(positions=a["positions"].float()),
        "positions of another M": lambda a: dict(positions=torch.arange(m + 1)),
        "strided positions": lambda a: dict(positions=torch.arange(2 * m)[::2]),
        "meta positions": lambda a: dict(positions=a["positions"].to("meta")),
        "no previous hidden states": lambda a: dict(prev=None),
        "fp16 previous hidden states": lambda a: dict(prev=a["prev"].half()),
        "previous hidden states of another M": lambda a: dict(prev=a["prev"][:-1]),
        "embeds with a column stride": lambda a: dict(embeds=bf16(m, 2 * h)[:, ::2]),
        "an fp32 enorm weight": lambda a: dict(enorm_weight=a["enorm_weight"].float()),
        "an hnorm weight of another length": lambda a: dict(hnorm_weight=bf16(h + 8)),
        "no eps": lambda a: dict(eps=None),
        "an H without a row": lambda a: dict(embeds=bf16(m, 64), prev=bf16(m, 64), enorm_weight=bf16(64),
                                             hnorm_weight=bf16(64)),
        "M = 17": lambda a: mtp_operands(17),
    }  # fmt: skip


@pytest.mark.parametrize("why", sorted(_mtp_refusals()))
def test_try_mtp_input_answers_none_on_each_precondition(routed, why) -> None:
    args = mtp_operands()
    args.update(_mtp_refusals()[why](args))
    assert fd.try_mtp_input(**args) is None, why
    assert not routed["mtp_input"].calls


def embed_operands(m: int | None = None) -> dict:
    """Valid ``try_embed_rows`` arguments for the first SM90 ``embed_rows`` row: rank 1's
    shard of 64 rows."""
    (h,), _, m0 = _a_row("embed_rows")
    m = m or m0
    return dict(ids=torch.arange(m) * 37, weight=bf16(64, h), start=64, end=128)


def test_try_embed_rows_routes_its_row_with_int64_and_int32_ids(routed) -> None:
    args = embed_operands()
    assert fd.try_embed_rows(**args) == "out"
    ((ids, weight, start, end),) = routed["embed_rows"].calls  # the recorder keeps the operands
    assert ids is args["ids"] and weight is args["weight"] and (start, end) == (64, 128)
    assert fd.try_embed_rows(**{**args, "ids": args["ids"].int()}) == "out"


def _embed_refusals():
    """(why, function(args) -> changed arguments of try_embed_rows) per precondition."""
    m, h = embed_operands()["ids"].shape[0], embed_operands()["weight"].shape[1]
    return {
        "no ids": lambda a: dict(ids=None),
        "2-D ids": lambda a: dict(ids=a["ids"][None]),
        "float ids": lambda a: dict(ids=a["ids"].float()),
        "strided ids": lambda a: dict(ids=torch.arange(2 * m)[::2]),
        "meta ids": lambda a: dict(ids=a["ids"].to("meta")),
        "no weight": lambda a: dict(weight=None),
        "an fp16 weight": lambda a: dict(weight=a["weight"].half()),
        "a weight with a column stride": lambda a: dict(weight=bf16(64, 2 * h)[:, ::2]),
        "a shard past the weight's rows": lambda a: dict(end=a["start"] + 65),
        "a shard ending before it starts": lambda a: dict(end=a["start"] - 1),
        "a tensor start": lambda a: dict(start=torch.tensor(64)),
        "an H without a row": lambda a: dict(weight=bf16(64, 64)),
        "M = 17": lambda a: embed_operands(17),
        "no ids at all": lambda a: dict(ids=torch.zeros(0, dtype=torch.int64)),
    }  # fmt: skip


@pytest.mark.parametrize("why", sorted(_embed_refusals()))
def test_try_embed_rows_answers_none_on_each_precondition(routed, why) -> None:
    args = embed_operands()
    args.update(_embed_refusals()[why](args))
    assert fd.try_embed_rows(**args) is None, why
    assert not routed["embed_rows"].calls


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
        (w_gate,), _, m_gate = _a_row("sigmoid_mul")
        assert fd.try_sigmoid_mul(bf16(m_gate, w_gate), bf16(m_gate, w_gate)) is None
        assert fd.try_mtp_input(**mtp_operands()) is None
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


def a_norm(width: int, **attrs) -> nn.Module:
    """A bare vLLM ``RMSNorm`` of ``width`` the call sites take."""
    kw = dict(weight=nn.Parameter(bf16(width)), variance_epsilon=1e-5, has_weight=True,
              variance_size_override=None)  # fmt: skip
    kw.update(attrs)
    return bare(RMSNorm, **kw)


def an_mla(heads: int = 12, head_dim: int = 192, q_lora: int = 1536, kv_lora: int = 512, **over):
    """The attributes of v0.28.0's MultiHeadLatentAttention that ``mla_q_and_kv_c`` reads."""
    q_b_proj = bare(ColumnParallelLinear, quant_method=UnquantizedLinearMethod(), bias=None,
                    weight=bf16(heads * head_dim, q_lora), gather_output=False)  # fmt: skip
    attrs = dict(q_a_layernorm=a_norm(q_lora), kv_a_layernorm=a_norm(kv_lora), q_b_proj=q_b_proj,
                 rms_norm_eps=1e-6, num_local_heads=heads, qk_head_dim=head_dim)  # fmt: skip
    attrs.update(over)
    return SimpleNamespace(**attrs)


@pytest.fixture
def fused_calls(monkeypatch: pytest.MonkeyPatch) -> dict:
    """The dispatch entries fused_decode calls, as recorders answering a marker; the dict
    holds each one's calls under its name and, under ``"answer"``, what they return
    (set an entry to None to refuse)."""
    seen: dict = {"answer": {}}

    def entry(name, result):
        seen["answer"][name] = result

        def call(*args, **kwargs):
            seen.setdefault(name, []).append((args, kwargs))
            return seen["answer"][name]

        monkeypatch.setattr(fused_decode, name, call)

    entry("try_rmsnorm_gemm", (bf16(4, 12 * 192), None))
    entry("try_rms_norm", ("kv normed", None))
    entry("try_sigmoid_mul", "gated")
    entry("try_mtp_input", "mtp in")
    entry("try_embed_rows", "rows")
    return seen


def test_mla_front_end_takes_q_b_with_its_norm_and_the_kv_norm(fused_calls) -> None:
    attn = an_mla()
    qkv = bf16(4, 1536 + 512 + 64)
    q_c, kv_c, _ = qkv.split([1536, 512, 64], dim=-1)
    q, kv_c_normed = fused_decode.mla_q_and_kv_c(attn, q_c, kv_c)
    assert q.shape == (4, 12, 192), "q not in the stock line's (M, heads, qk_head_dim) view"
    assert kv_c_normed == "kv normed"
    ((args, kwargs),) = fused_calls["try_rmsnorm_gemm"]
    assert args[0] is q_c and args[1] is attn.q_a_layernorm.weight and args[2] == 1e-6
    assert args[3] is attn.q_b_proj.weight and kwargs == {}
    ((args, _),) = fused_calls["try_rms_norm"]
    assert args[0] is kv_c and args[1] is attn.kv_a_layernorm.weight


@pytest.mark.parametrize(
    "why, over",
    [
        ("q_a_layernorm of another class", lambda a: dict(q_a_layernorm=Module())),
        ("a weightless q_a_layernorm", lambda a: dict(q_a_layernorm=a_norm(1536, has_weight=False))),
        ("kv_a_layernorm of another class", lambda a: dict(kv_a_layernorm=Module())),
        ("no kv_a_layernorm", lambda a: dict(kv_a_layernorm=None)),
        ("q_b_proj a RowParallelLinear", lambda a: dict(q_b_proj=bare(
            RowParallelLinear, **{k: getattr(a.q_b_proj, k) for k in ("quant_method", "bias", "weight")}))),
        ("q_b_proj gathers its output", lambda a: dict(q_b_proj=bare(
            ColumnParallelLinear, quant_method=UnquantizedLinearMethod(), bias=None,
            weight=a.q_b_proj.weight, gather_output=True))),
        ("a quantized q_b_proj", lambda a: dict(q_b_proj=bare(
            ColumnParallelLinear, quant_method=object(), bias=None, weight=a.q_b_proj.weight,
            gather_output=False))),
        ("a biased q_b_proj", lambda a: dict(q_b_proj=bare(
            ColumnParallelLinear, quant_method=UnquantizedLinearMethod(), bias=bf16(2304),
            weight=a.q_b_proj.weight, gather_output=False))),
        ("q_b_proj rows not heads x head_dim", lambda a: dict(num_local_heads=11)),
        ("no eps", lambda a: dict(rms_norm_eps=None)),
    ],
)  # fmt: skip
def test_mla_front_end_keeps_the_stock_lines_and_launches_nothing(fused_calls, why, over) -> None:
    attn = an_mla()
    for name, value in over(attn).items():
        setattr(attn, name, value)
    q_c, kv_c = bf16(4, 1536), bf16(4, 512)
    assert fused_decode.mla_q_and_kv_c(attn, q_c, kv_c) is None, why
    assert "try_rmsnorm_gemm" not in fused_calls and "try_rms_norm" not in fused_calls


def test_mla_front_end_without_a_routed_q_b_keeps_the_stock_lines(fused_calls) -> None:
    fused_calls["answer"]["try_rmsnorm_gemm"] = None
    assert fused_decode.mla_q_and_kv_c(an_mla(), bf16(4, 1536), bf16(4, 512)) is None
    assert "try_rms_norm" not in fused_calls, "kv_a_layernorm ran although the stock lines run"


def test_mla_front_end_falls_back_to_the_kv_norm_module(fused_calls) -> None:
    """q_b_proj's fused path ran; a kv_c our norm refuses goes through vLLM's RMSNorm."""
    fused_calls["answer"]["try_rms_norm"] = None
    kv_norm = a_norm(512)
    kv_norm.forward = lambda x: ("stock kv_a_layernorm", x)
    kv_c = bf16(4, 512)
    q, kv_c_normed = fused_decode.mla_q_and_kv_c(an_mla(kv_a_layernorm=kv_norm), bf16(4, 1536), kv_c)
    assert kv_c_normed[0] == "stock kv_a_layernorm" and kv_c_normed[1] is kv_c


def test_output_gate_and_mtp_input_call_the_stock_function_unless_routed(fused_calls) -> None:
    stock_calls = []

    def stock(*args):
        stock_calls.append(args)
        return "stock"

    x, gate = bf16(2, 1536), bf16(2, 1536)
    assert fused_decode.output_gate(stock, x, gate) == "gated" and not stock_calls
    ((args, _),) = fused_calls["try_sigmoid_mul"]
    assert args[0] is x and args[1] is gate
    mtp_args = tuple(mtp_operands().values())
    assert fused_decode.mtp_input(stock, *mtp_args) == "mtp in" and not stock_calls
    assert fused_calls["try_mtp_input"][0][0] == mtp_args
    fused_calls["answer"].update(try_sigmoid_mul=None, try_mtp_input=None)
    assert fused_decode.output_gate(stock, x, gate) == "stock"
    assert fused_decode.mtp_input(stock, *mtp_args) == "stock"
    assert stock_calls == [(x, gate), mtp_args], "the stock function got other arguments"


def an_embedding(tp_size: int = 8, added: int = 0, quant=None, **over) -> nn.Module:
    """A bare vLLM ``VocabParallelEmbedding``, rank 1 of ``tp_size``: 64 vocab rows a rank,
    ``added`` LoRA rows; its stock forward records its calls and answers a marker."""
    shard = SimpleNamespace(org_vocab_start_index=64, org_vocab_end_index=128,
                            added_vocab_start_index=1000, added_vocab_end_index=1000 + added)  # fmt: skip
    attrs = dict(tp_size=tp_size, shard_indices=shard, weight=nn.Parameter(bf16(64, 7168)),
                 quant_method=quant or UnquantizedEmbeddingMethod())  # fmt: skip
    emb = bare(VocabParallelEmbedding, **{**attrs, **over})
    emb.stock_calls = []
    emb.forward = lambda ids: emb.stock_calls.append(ids) or "stock"
    return emb


def test_embed_tokens_looks_up_the_shard_in_one_launch_then_all_reduces(fused_calls, monkeypatch) -> None:
    import vllm.distributed

    reduced = []
    monkeypatch.setattr(vllm.distributed, "tensor_model_parallel_all_reduce",
                        lambda t: reduced.append(t) or "summed")  # fmt: skip
    fused_calls["answer"]["try_embed_rows"] = "rows"
    emb, ids = an_embedding(), torch.arange(4)
    assert fused_decode.embed_tokens(emb, ids) == "summed" and reduced == ["rows"] and not emb.stock_calls
    ((args, _),) = fused_calls["try_embed_rows"]
    assert args[0] is ids and args[1] is emb.weight and args[2:] == (64, 128)
    fused_calls["answer"]["try_embed_rows"] = None  # not routed: the stock forward, no second reduce
    assert fused_decode.embed_tokens(emb, ids) == "stock" and emb.stock_calls == [ids] and reduced == ["rows"]


@pytest.mark.parametrize("why, emb", [
    ("TP 1: one gather already", lambda: an_embedding(tp_size=1)),
    ("LoRA-added vocabulary", lambda: an_embedding(added=16)),
    ("a quantized embedding", lambda: an_embedding(quant=object())),
    ("no shard indices", lambda: an_embedding(shard_indices=None)),
    ("a subclass (the LM head)", lambda: bare(ParallelLMHead, tp_size=8)),
])  # fmt: skip
def test_embed_tokens_runs_the_stock_module_and_launches_nothing(fused_calls, why, emb) -> None:
    module = emb()
    if not hasattr(module, "stock_calls"):
        module.stock_calls = []
        module.forward = lambda ids: module.stock_calls.append(ids) or "stock"
    ids = torch.arange(3)
    assert fused_decode.embed_tokens(module, ids) == "stock", why
    assert module.stock_calls == [ids] and "try_embed_rows" not in fused_calls


def test_shared_head_norm_takes_the_add_norm_or_runs_the_module(fused_calls) -> None:
    """MTP's ``shared_head.norm(hidden_states, residual)`` through ``rms_norm``."""
    norm = a_norm(7168)
    h, r = bf16(3, 7168), bf16(3, 7168)
    fused_calls["answer"]["try_rms_norm"] = ("normed", "new residual")
    assert fused_decode.rms_norm(norm, h, r) == ("normed", "new residual")
    ((args, _),) = fused_calls["try_rms_norm"]
    assert args[0] is h and args[1] is norm.weight and args[3] is r
    fused_calls["answer"]["try_rms_norm"] = None
    norm.forward = lambda x, residual: ("stock", x, residual)
    assert fused_decode.rms_norm(norm, h, r) == ("stock", h, r)
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
    dict(out_dtype=BF16), dict(shard_sp=True),
    dict(gate=SimpleNamespace(weight=nn.Parameter(torch.empty(E, H, dtype=BF16)), bias=None,
                              out_dtype=torch.float32)),
    dict(down=_linear(torch.empty(L, H, dtype=BF16), quant_method=object())),
    dict(down=_linear(torch.empty(L, H, dtype=BF16), bias=torch.empty(L, dtype=BF16))),
    dict(down=_linear(torch.empty(L, H, dtype=torch.float16))),
    dict(down=_linear(torch.empty(L, 2 * H, dtype=BF16)[:, :H])),
    dict(rows=(E, L, G + 64)),  # a stacked shape without a table row
], ids=["bf16 logits", "sequence-parallel shared experts",
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
    def of(op):  # the op's Triton backend (the CuTe DSL ones need a GPU: their own tests)
        (backend,) = [b for b in gemm_backends.backends_for(op).values() if b.name != "gemv_rmsnorm"]
        return backend
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
    y = of("sigmoid_mul").launch(None, x, r)
    out["sigmoid_mul"] = err(y, x.to(D) * torch.sigmoid(r.to(D)))
    pos = torch.tensor([0, 3, 0, 1, 7])
    y = of("mtp_input").launch(None, pos, x, r, gw, gw.flip(0), 1e-6)
    live = (pos != 0).to(D)[:, None]
    out["mtp_input"] = err(y, torch.cat([rms(x, gw) * live, rms(r, gw.flip(0))], 1))
    out["mtp_input_zero_rows"] = bool((y[pos == 0, :k] == 0).all())
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
    assert got.pop("mtp_input_zero_rows") is True, "an embedding row at position 0 is not 0"
    assert got.pop("gate_gemm_dtypes") == ["torch.float32", "torch.float16"]
    assert got["gate_gemm_fp32"] < 2e-5, "the logits went through a 16-bit rounding"
    for what, rel in got.items():
        # fp16 operands, fp32 accumulation: ~5e-4; a swapped operand or scale is O(1).
        assert rel < 3e-3, f"{what}: rel err {rel:.2e}"


_CALL_SITES_SCRIPT = textwrap.dedent(
    """
    import json, types, torch
    from torch import nn
    from vllm.model_executor.layers.layernorm import RMSNorm
    from vllm.model_executor.layers.linear import ColumnParallelLinear, UnquantizedLinearMethod
    from vllm.models.kimi_k3.nvidia import fused_decode, gemm_backends
    from vllm.models.kimi_k3.nvidia import low_latency_fused_dispatch as fd
    from vllm.models.kimi_k3.nvidia.gemm_backends import (
        pdl_mtp_input, pdl_rmsnorm, pdl_sigmoid_mul, swap_ab_rmsnorm)
    D, HALF = torch.float64, torch.float16
    # numpy has no bf16: the backends' dtype guard is pointed at fp16, all else is theirs
    def half_on(device, *ts):
        return all(t is None or (t.dtype is HALF and t.device == device) for t in ts)
    for mod in (pdl_mtp_input, pdl_rmsnorm, pdl_sigmoid_mul, swap_ab_rmsnorm):
        mod.bf16_on = half_on
    # Small rows (the interpreter is slow), on the CPU, switch on: the call sites' real path.
    QL, KVL, ROPE, HEADS, HD, GATE, H = 128, 64, 16, 2, 32, 48, 64
    data = {"rmsnorm_gemm": {(HEADS * HD, QL): ("swap_ab_rmsnorm", (16, 64, 2, 4, 2), (1, 5, 16))},
            "rmsnorm": {(KVL,): ("pdl_rmsnorm", None, (1, 5, 16)), (H,): ("pdl_rmsnorm", None, (1, 5, 16))},
            "sigmoid_mul": {(GATE,): ("pdl_sigmoid_mul", None, (1, 5, 16))},
            "mtp_input": {(H,): ("pdl_mtp_input", None, (1, 5, 16))}}
    fd.TABLES_BY_CAPABILITY = {(9, 0): fd.FusedTable("SM90", data, {})}
    fd._device_capability = lambda: (9, 0)
    fd._FAST_PATH_DEVICE_TYPE = "cpu"
    fd._enabled = True
    def bare(cls, **attrs):
        module = cls.__new__(cls); nn.Module.__init__(module)
        for name, value in attrs.items():
            setattr(module, name, value)
        return module
    g = torch.Generator().manual_seed(11)
    rnd = lambda *s: torch.randn(*s, generator=g).half()
    def norm(width):
        return bare(RMSNorm, weight=nn.Parameter((1 + 0.1 * torch.randn(width, generator=g)).half()),
                    variance_epsilon=1e-6, has_weight=True, variance_size_override=None)
    def rms(t, w):
        t = t.to(D); return t * torch.rsqrt(t.pow(2).mean(-1, keepdim=True) + 1e-6) * w.to(D)
    def err(y, ref):
        return float((y.to(D) - ref).norm() / ref.norm())
    def stock(*args):
        raise AssertionError("the stock path ran")
    attn = types.SimpleNamespace(
        q_a_layernorm=norm(QL), kv_a_layernorm=norm(KVL), rms_norm_eps=1e-6, num_local_heads=HEADS,
        qk_head_dim=HD, q_b_proj=bare(ColumnParallelLinear, quant_method=UnquantizedLinearMethod(),
                                      bias=None, gather_output=False,
                                      weight=(torch.randn(HEADS * HD, QL, generator=g) / QL**0.5).half()))
    out = {}
    for m in (1, 5, 16):
        qkv = rnd(m, QL + KVL + ROPE)  # the q and kv latents are row-strided views of it
        q_c, kv_c, _ = qkv.split([QL, KVL, ROPE], dim=-1)
        q, kv_n = fused_decode.mla_q_and_kv_c(attn, q_c, kv_c)
        ref_q = rms(q_c, attn.q_a_layernorm.weight) @ attn.q_b_proj.weight.to(D).t()
        out[f"mla_q_M{m}"] = err(q.reshape(m, -1), ref_q)
        out[f"mla_q_shape_M{m}"] = list(q.shape) == [m, HEADS, HD]
        out[f"mla_kv_M{m}"] = err(kv_n, rms(kv_c, attn.kv_a_layernorm.weight))
        x, gate = rnd(m, GATE), rnd(m, 2 * GATE)[:, GATE:]
        out[f"gate_M{m}"] = err(fused_decode.output_gate(stock, x, gate), x.to(D) * torch.sigmoid(gate.to(D)))
        pos = torch.arange(m) % 3  # a position 0 every third token
        e, prev, en, hn = rnd(m, H), rnd(m, H), norm(H), norm(H)
        y = fused_decode.mtp_input(stock, pos, e, prev, en.weight, hn.weight, 1e-6)
        live = (pos != 0).to(D)[:, None]
        out[f"mtp_M{m}"] = err(y, torch.cat([rms(e, en.weight) * live, rms(prev, hn.weight)], 1))
        out[f"mtp_zero_rows_M{m}"] = bool((y[pos == 0, :H] == 0).all())
        h, r, head_norm = rnd(m, H), rnd(m, H), norm(H)
        y, new_r = fused_decode.rms_norm(head_norm, h, r)
        out[f"head_norm_M{m}"] = err(y, rms(h.to(D) + r.to(D), head_norm.weight))
        out[f"head_residual_M{m}"] = bool(torch.equal(new_r, (h.float() + r.float()).half()))
    print(json.dumps(out))
    """
)


def test_patch_0006_call_sites_compute_the_unfused_sequence_under_the_interpreter() -> None:
    """MLA's q/kv front end, its output gate, the MTP input and shared_head's add + norm
    through ``fused_decode``, the dispatch and the real kernels (a stock path that runs
    fails the test) against float64 of the unfused sequence, the written residual
    included, at M = 1, 5, 16."""
    pytest.importorskip("triton")
    env = dict(os.environ, TRITON_INTERPRET="1", CUDA_VISIBLE_DEVICES="")
    proc = subprocess.run([sys.executable, "-c", _CALL_SITES_SCRIPT], capture_output=True, text=True,
                          env=env, timeout=900)  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    got = json.loads(proc.stdout.strip().splitlines()[-1])
    flags = {k: got.pop(k) for k in list(got) if "shape" in k or "zero_rows" in k or "residual" in k}
    assert flags and all(flags.values()), {k: v for k, v in flags.items() if not v}
    for what, rel in got.items():
        # fp16 operands, fp32 math, one rounding: ~5e-4; a wrong norm, operand or mask is O(1).
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
    # v0.28.0's loader calls the model-level hook on the served model only: Kimi-K3's wrapper
    # must pass it on to its language model, or nothing is ever stacked.
    (wrapper,) = [n for n in ast.walk(tree)
                  if isinstance(n, ast.ClassDef) and n.name == "KimiK3ForConditionalGeneration"]
    (hook,) = [f for f in wrapper.body
               if isinstance(f, ast.FunctionDef) and f.name == "process_weights_after_loading"]
    calls = [ast.unparse(c) for c in ast.walk(hook) if isinstance(c, ast.Call)]
    assert "self.language_model.process_weights_after_loading()" in calls
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


class Calls:
    """Records calls by name; each returns what ``answers`` says for it."""

    def __init__(self, **answers) -> None:
        self.answers, self.log = answers, []

    def __getattr__(self, name):
        if name.startswith("__"):
            raise AttributeError(name)

        def call(*args, **kwargs):
            self.log.append((name, args))
            return self.answers[name]

        return call

    def names(self) -> list[str]:
        return [name for name, _ in self.log]


def _mla_stub(calls: Calls, q_lora_rank: int | None = 1536) -> SimpleNamespace:
    """What the patched ``MultiHeadLatentAttention._forward_attn`` / ``forward`` read of
    ``self`` (TP8 widths, M = 2), each module a recorder of ``calls``."""
    m = 2
    kv_norm = calls.kv_norm  # called by the uncompressed-q branch, its weight read by the stock line
    kv_norm.weight = SimpleNamespace(data="wk")
    return SimpleNamespace(
        q_lora_rank=q_lora_rank, kv_lora_rank=512, qk_rope_head_dim=64, num_local_heads=12, qk_head_dim=192,
        v_head_dim=128, rms_norm_eps=1e-6, q_a_layernorm=SimpleNamespace(weight=SimpleNamespace(data="wq")),
        kv_a_layernorm=kv_norm,
        fused_qkv_a_proj=lambda h: (bf16(m, 1536 + 512 + 64),),
        q_b_proj=lambda x: (bf16(m, 12 * 192),), q_proj=lambda h: (bf16(m, 12 * 192),),
        kv_a_proj_with_mqa=lambda h: (bf16(m, 512 + 64),), _attention=calls.attention,
        g_proj=lambda h: ("gate",), _gate_events=None, aux_stream=None, run_gemm_rs=False,
        o_proj=lambda x: ((x,),), _forward_attn=lambda pos, h: "attn_out",
    )  # fmt: skip


def test_patched_mla_takes_the_fused_front_end_or_runs_the_stock_lines(monkeypatch) -> None:
    """Patch 0006's control flow in the tree's mla.py, on a stub ``self``: the fused
    result goes to the attention core; None runs v0.28.0's lines; the uncompressed-q
    branch never asks for the fused path; the gate goes through ``output_gate``."""
    from vllm.models.kimi_k3.nvidia import mla

    fused_q, fused_kv = bf16(2, 12, 192), bf16(2, 512)
    calls = Calls(front=(fused_q, fused_kv), stock_norms=(bf16(2, 1536), "stock kv"), attention=None,
                  kv_norm="kv normed", gate="gated")  # fmt: skip
    monkeypatch.setattr(mla, "mla_q_and_kv_c", calls.front)
    monkeypatch.setattr(mla, "fused_q_kv_rmsnorm", calls.stock_norms)
    monkeypatch.setattr(mla, "output_gate", calls.gate)
    attn = _mla_stub(calls)
    hidden = bf16(2, 7168)
    mla.MultiHeadLatentAttention._forward_attn(attn, torch.arange(2), hidden)
    assert calls.names() == ["front", "attention"], "the stock norms ran next to the fused path"
    _, (_, q, kv_c_normed, k_pe, _) = calls.log[-1]
    assert q is fused_q and kv_c_normed is fused_kv and k_pe.shape == (2, 1, 64)
    calls.log.clear()
    calls.answers["front"] = None
    mla.MultiHeadLatentAttention._forward_attn(attn, torch.arange(2), hidden)
    assert calls.names() == ["front", "stock_norms", "attention"]
    _, (_, q, kv_c_normed, _, _) = calls.log[-1]
    assert q.shape == (2, 12, 192) and kv_c_normed == "stock kv"
    calls.log.clear()
    mla.MultiHeadLatentAttention._forward_attn(_mla_stub(calls, q_lora_rank=None), torch.arange(2), hidden)
    assert calls.names() == ["kv_norm", "attention"], "the uncompressed-q branch changed"
    calls.log.clear()
    assert mla.MultiHeadLatentAttention.forward(attn, torch.arange(2), hidden) == ("gated",)
    assert calls.log == [("gate", (mla._gate_sigmoid_mul, "attn_out", "gate"))]


def test_patched_mtp_layer_takes_the_fused_input_and_head_norm(monkeypatch) -> None:
    """Patch 0006 in the tree's mtp.py, on a stub ``self``: ``fused_mtp_input`` is handed
    to ``mtp_input`` as the fallback with v0.28.0's arguments; the non-sequence-parallel
    ``shared_head.norm(hidden_states, residual)`` goes through ``rms_norm``."""
    from vllm.models.kimi_k3.nvidia import mtp

    calls = Calls(mtp_input="cat", eh_proj="h0", block=("h", None, "residual"),
                  rms_norm=("logits h", "new residual"))  # fmt: skip
    monkeypatch.setattr(mtp, "mtp_input", calls.mtp_input)
    monkeypatch.setattr(mtp, "rms_norm", calls.rms_norm)
    def block(**kwargs):
        return calls.block(kwargs)

    block.use_sequence_parallel = False
    layer = SimpleNamespace(eh_proj=calls.eh_proj, enorm=SimpleNamespace(weight="we", variance_epsilon=1e-5),
                            hnorm=SimpleNamespace(weight="wh"), mtp_block=block,
                            shared_head=SimpleNamespace(norm="head norm"))  # fmt: skip
    positions, embeds, prev = torch.arange(2), bf16(2, 7168), bf16(2, 7168)
    out = mtp.KimiK3MultiTokenPredictorLayer.forward(layer, None, positions, prev, embeds)
    assert out == ("logits h", "new residual")
    assert calls.log[0] == ("mtp_input", (mtp.fused_mtp_input, positions, embeds, prev, "we", "wh", 1e-5))
    assert calls.log[1] == ("eh_proj", ("cat",))
    assert calls.log[-1] == ("rms_norm", ("head norm", "h", "residual"))


def test_embed_rows_warm_up_compiles_both_id_dtypes(monkeypatch) -> None:
    """The drafter passes int32 ids, other callers int64; Triton compiles one kernel per
    pointer dtype, so the warm-up before capture must launch both."""
    from vllm.models.kimi_k3.nvidia import pointwise
    from vllm.models.kimi_k3.nvidia.gemm_backends.base import WarmupCall

    seen = []
    monkeypatch.setattr(pointwise, "embed_rows",
                        lambda ids, w, start, end: seen.append((ids.dtype, w.shape[1])))  # fmt: skip
    backend = gemm_backends.backends_for("embed_rows")["pdl_embed_rows"]
    backend.compile_for(WarmupCall(7168, 7168, 4, None, torch.device("cpu")), BF16)
    assert sorted(map(str, seen)) == sorted(map(str, [(torch.int32, 7168), (torch.int64, 7168)]))


def test_patched_mtp_predictor_looks_up_its_embedding_through_embed_tokens(monkeypatch) -> None:
    """Patch 0011 in the tree's mtp.py, on a stub ``self``: without ``inputs_embeds`` the
    embedding module and the ids go to ``fused_decode.embed_tokens``, whose result is the
    layer's ``inputs_embeds``; given ``inputs_embeds``, no lookup runs."""
    from vllm.models.kimi_k3.nvidia import mtp

    seen = []
    monkeypatch.setattr(fused_decode, "embed_tokens",
                        lambda module, ids: seen.append((module, ids)) or "rows")  # fmt: skip
    layer_calls = []
    predictor = SimpleNamespace(embed_tokens="the embedding", num_mtp_layers=1, mtp_start_layer_idx=61,
                                layers={"61": lambda *args: layer_calls.append(args) or "out"})  # fmt: skip
    ids, positions, prev = torch.arange(3), torch.arange(3), bf16(3, 7168)
    assert mtp.KimiK3MultiTokenPredictor.forward(predictor, ids, positions, prev) == "out"
    assert seen == [("the embedding", ids)] and layer_calls[0][3] == "rows"
    given = bf16(3, 7168)
    mtp.KimiK3MultiTokenPredictor.forward(predictor, ids, positions, prev, given)
    assert len(seen) == 1 and layer_calls[1][3] is given


def test_patched_model_embeds_its_input_ids_through_embed_tokens(monkeypatch) -> None:
    """Patch 0012 in the tree's model.py, on a stub ``self``: ``embed_input_ids`` (the
    forward's and the runner's lookup) hands its embedding module and the ids to
    ``fused_decode.embed_tokens`` and returns its result."""
    from vllm.models.kimi_k3.nvidia import model

    seen = []
    monkeypatch.setattr(fused_decode, "embed_tokens",
                        lambda module, ids: seen.append((module, ids)) or "rows")  # fmt: skip
    ids = torch.arange(5)
    got = model.KimiLinearModel.embed_input_ids(SimpleNamespace(embed_tokens="the embedding"), ids)
    assert got == "rows" and seen == [("the embedding", ids)]


def test_patch_0006_routes_mla_and_mtp_through_fused_decode_and_keeps_the_stock_lines() -> None:
    """The tree's mla.py and mtp.py (patched) call our call-site functions, and still hold
    the stock calls they fall back to."""
    import ast
    from pathlib import Path

    here = Path(fused_decode.__file__)
    mla = ast.parse(here.with_name("mla.py").read_text("utf-8"))
    front = _calls_in(mla, "MultiHeadLatentAttention", "_forward_attn")
    assert {"mla_q_and_kv_c", "fused_q_kv_rmsnorm"} <= front, front
    assert "output_gate" in _calls_in(mla, "MultiHeadLatentAttention", "forward")
    mtp = ast.parse(here.with_name("mtp.py").read_text("utf-8"))
    calls = _calls_in(mtp, "KimiK3MultiTokenPredictorLayer", "forward")
    assert {"mtp_input", "rms_norm"} <= calls, calls
    names = {n.id for n in ast.walk(mtp) if isinstance(n, ast.Name)}
    assert "fused_mtp_input" in names, "the stock fused_mtp_input is no longer passed as fallback"


@pytest.mark.parametrize("op,name", [("rmsnorm", "pdl_rmsnorm"), ("act_mul", "pdl_act_mul"),
                                     ("sigmoid_mul", "pdl_sigmoid_mul"), ("mtp_input", "pdl_mtp_input"),
                                     ("embed_rows", "pdl_embed_rows")])
def test_pdl_backends_compile_once_per_width_and_device_on_cuda_only(monkeypatch, op, name) -> None:
    # PdlKernel.warm_up: one compile_for per distinct (width, CUDA device), the first call
    # of each kept; meta and CPU weights (before loading, or no GPU) compile nothing.
    backend = gemm_backends.backends_for(op)[name]
    seen = []
    monkeypatch.setattr(type(backend), "compile_for", lambda self, call, dtype: seen.append((call, dtype)))
    cuda0, cuda1 = torch.device("cuda", 0), torch.device("cuda", 1)
    W = gemm_backends.base.WarmupCall
    calls = [W(768, 768, 1, None, cuda0), W(768, 768, 8, None, cuda0), W(512, 512, 4, None, cuda0),
             W(768, 768, 2, None, cuda1), W(768, 768, 3, None, torch.device("meta")),
             W(768, 768, 5, None, torch.device("cpu"))]  # fmt: skip
    assert backend.warm_up(calls, torch.bfloat16) == 3
    got = [(c.k, c.num_tokens, c.device) for c, _ in seen]
    assert got == [(768, 1, cuda0), (512, 4, cuda0), (768, 2, cuda1)]
    assert {d for _, d in seen} == {torch.bfloat16}


@pytest.mark.parametrize("op,name", [("rmsnorm_gemm", "swap_ab_rmsnorm"),
                                     ("add_rmsnorm_gemm", "swap_ab_add_rmsnorm"),
                                     ("gate_gemm", "swap_ab_gate")])  # fmt: skip
def test_fused_swap_ab_backends_compile_once_per_shape_config_and_device(monkeypatch, op, name) -> None:
    # The same warm-up rule (base.CompiledOnFirstLaunch) keyed by (N, K, config, device):
    # two configs of one shape are two builds, two token counts of one config are one.
    backend = gemm_backends.backends_for(op)[name]
    seen = []
    monkeypatch.setattr(type(backend), "compile_for", lambda self, call, dtype: seen.append(call))
    cuda0 = torch.device("cuda", 0)
    W = gemm_backends.base.WarmupCall
    a, b = (64, 256, 1, 4, 4), (64, 128, 2, 4, 6)
    calls = [W(2304, 1536, 1, a, cuda0), W(2304, 1536, 8, a, cuda0), W(2304, 1536, 2, b, cuda0),
             W(7168, 3584, 4, a, cuda0), W(2304, 1536, 3, b, torch.device("meta"))]  # fmt: skip
    assert backend.warm_up(calls, torch.bfloat16) == 3
    assert [(c.n, c.k, c.num_tokens, c.config) for c in seen] == [
        (2304, 1536, 1, a), (2304, 1536, 2, b), (7168, 3584, 4, a)]


@pytest.mark.parametrize("width, ok", [(64, True), (256, True), (136, False), (72, False)])
def test_fused_swap_ab_rows_take_a_stride_keyed_as_the_packed_warm_up(width, ok) -> None:
    """The fused swap-AB kernels compile at their warm-up on packed rows (stride K); a view
    whose row stride Triton keys otherwise (not divisible by 16 where K is) would compile
    inside a capture, so the backends refuse it and the model's line runs."""
    from vllm.models.kimi_k3.nvidia.gemm_backends.swap_ab_rmsnorm import rows_ok

    x = torch.empty(4, width, dtype=torch.bfloat16)[:, :64]
    assert rows_ok(x, 64) is ok
    assert rows_ok(x[:1], 64), "one row: its stride is not passed to the kernel"
