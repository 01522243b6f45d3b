# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-k3-overlay project
"""CPU tests of our model-level paths: the FusedMoE branch's, the one an H200 takes, and
MLA's stacked front end (vllm-k3-overlay).

* ``path_enabled``: a path runs only in a deployment mode (MoE branch, capture mode) its
  device's data says it was measured in, and says once in the log where it does not;
* the MoE front (patches 0007, 0008): the three input weights are stacked on the FusedMoE
  branch under breakable capture only; the shared experts' ``gate_up`` left for the
  runner's call is taken once, for exactly the input it was computed from; the patched
  ``KimiMoE.forward`` / ``KimiMLP.forward``, run on stub ``self`` objects with a stand-in
  of the runner, compute the shared experts from it and never run ``gate_up_proj``;
* the MoE tail (patch 0009): ``latent_moe_tail`` all-reduces the latent and the shared
  output and runs one ``rmsnorm_gemm`` with the shared output in its epilogue, or answers
  None before any all-reduce; the patched ``_overlap_allreduce_tail`` returns its result,
  or runs v0.28.0's lines (and only those) on None; and, through the dispatch and the real
  kernel under Triton's interpreter, it computes ``up_proj(norm(latent)) + shared``;
* MLA's front (patch 0013): ``fused_qkv_a_proj`` and ``g_proj`` are stacked only where
  the path was measured and the GEMM table routes the stack (today: nowhere), keep their
  values as row views of one weight, and one GEMM's output splits into the two; the
  patched ``mla.py`` calls both entries.
"""

from __future__ import annotations

import ast
import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from torch import nn

from vllm.model_executor.layers.fused_moe.router.gate_linear import GateLinear
from vllm.model_executor.layers.layernorm import RMSNorm
from vllm.model_executor.layers.linear import (
    ColumnParallelLinear,
    MergedColumnParallelLinear,
    UnquantizedLinearMethod,
)
from vllm.models.kimi_k3.nvidia import fused_decode, gemm_backends
from vllm.models.kimi_k3.nvidia import low_latency_fused_dispatch as fd

BF16 = torch.bfloat16
SM90 = (9, 0)
E, L, G, H = 384, 3584, 1536, 7168  # Kimi-K3 TP8: gate, routed_down, shared gate_up rows
BREAKABLE, FULL = "1", "0"


@pytest.fixture
def launches(monkeypatch: pytest.MonkeyPatch) -> dict[str, list]:
    """Switch on, an SM90 device, CPU tensors let through, every fused backend built;
    ``{op: [operands of each launch]}``, each launch answering ``"out"`` (``gate_gemm``:
    empty logits and rest)."""
    monkeypatch.setattr(fd, "_device_capability", lambda: SM90)
    monkeypatch.setattr(fd, "_FAST_PATH_DEVICE_TYPE", "cpu")
    monkeypatch.setattr(fd, "_enabled", True)
    monkeypatch.setattr(fd, "_refusals_logged", set())
    monkeypatch.delenv("VLLM_BATCH_INVARIANT", raising=False)
    calls: dict[str, list] = {op: [] for op in fd.OPS}
    for op in fd.OPS:
        for backend in gemm_backends.backends_for(op).values():
            def launch(_self, config, *operands, _op=op):
                calls[_op].append(operands)
                if _op == "gate_gemm":  # (x, stacked weight, gate rows) -> (logits, rest)
                    x, w, n = operands
                    return torch.empty(x.shape[0], n), bf16(x.shape[0], w.shape[0] - n)
                return "out"

            monkeypatch.setattr(type(backend), "launch", launch)
            monkeypatch.setattr(type(backend), "is_available", lambda self: True)
    return calls


@pytest.fixture
def logged(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    lines: list[str] = []
    monkeypatch.setattr(fd.logger, "info", lambda msg, *args: lines.append(msg % args))
    return lines


def capture(monkeypatch: pytest.MonkeyPatch, mode: str) -> None:
    """The call runs inside a breakable capture (BREAKABLE) or not (FULL: a decode batch's
    one full CUDA graph, v0.28.0's default with either value of the breakable flag)."""
    from vllm.compilation.breakable_cudagraph import BreakableCUDAGraphCapture

    monkeypatch.setenv("VLLM_USE_BREAKABLE_CUDAGRAPH", "1")
    monkeypatch.setattr(BreakableCUDAGraphCapture._tls, "active", object() if mode == BREAKABLE else None,
                        raising=False)  # fmt: skip


def bf16(*shape: int) -> torch.Tensor:
    return torch.empty(shape, dtype=BF16)


# ------------------------------------------------------------------ the modes


@pytest.mark.parametrize("path,branch,mode,expected", [
    ("moe_front", "fused_moe", BREAKABLE, True),
    ("moe_front", "fused_moe", FULL, False),
    ("moe_front", "mega_moe", FULL, True),
    ("moe_front", "mega_moe", BREAKABLE, True),
    ("moe_tail", "fused_moe", BREAKABLE, True),
    ("moe_tail", "fused_moe", FULL, False),
    ("moe_tail", "mega_moe", BREAKABLE, False),
])  # fmt: skip
def test_a_path_runs_only_in_the_modes_it_was_measured_in(
    launches, logged, monkeypatch, path, branch, mode, expected
) -> None:
    capture(monkeypatch, mode)
    assert fd.path_enabled(path, branch) is expected
    assert fd.path_enabled(path, branch) is expected
    assert len(logged) == (0 if expected else 1), "a refusal is said once, and only a refusal"
    if not expected:
        assert path in logged[0] and branch in logged[0]


def test_every_measured_mode_names_its_source() -> None:
    for modes in fd.MODES_BY_CAPABILITY.values():
        assert set(modes) <= set(fd.PATHS)
        for (branch, mode), source in (kv for m in modes.values() for kv in m.items()):
            assert branch in fd.BRANCHES and mode in ("breakable", "full")
            assert ".json" in source


def test_no_path_runs_off_the_switch_or_on_an_unmeasured_gpu(launches, logged, monkeypatch) -> None:
    capture(monkeypatch, BREAKABLE)
    monkeypatch.setattr(fd, "_device_capability", lambda: (10, 0))
    assert not fd.path_enabled("moe_front", "fused_moe")
    monkeypatch.setattr(fd, "_device_capability", lambda: SM90)
    fd.disable_kimi_k3_fused_decode()
    assert not fd.path_enabled("moe_front", "fused_moe")
    assert len(logged) == 1, "the switch off is no refusal to report"
    with pytest.raises(ValueError, match="moe_frnt"):
        fd.path_enabled("moe_frnt", "fused_moe")


# ------------------------------------------------------------------ the front


class FakeMoE(nn.Module):
    """Stands in for v0.28.0's ``KimiMoE``: only the attributes the stacking reads."""


def _linear(rows: int):
    return SimpleNamespace(quant_method=UnquantizedLinearMethod(), bias=None,
                           weight=nn.Parameter(torch.empty(rows, H, dtype=BF16), requires_grad=False))  # fmt: skip


def fused_moe_branch_moe() -> FakeMoE:
    moe = FakeMoE()
    moe.use_mega_moe = False
    moe.gate = bare(GateLinear, weight=nn.Parameter(bf16(E, H), requires_grad=False), bias=None,
                    out_dtype=torch.float32)  # fmt: skip
    moe.routed_expert_down_proj = _linear(L)
    moe.shared_experts = SimpleNamespace(shard_sequence_parallel=False, gate_up_proj=_linear(G))
    return moe


@pytest.mark.parametrize("mode,runs", [(BREAKABLE, 1), (FULL, 0)], ids=["breakable", "full"])
def test_the_fused_moe_branch_stacks_at_load_and_runs_only_in_a_measured_capture(
    launches, logged, monkeypatch, mode, runs
) -> None:
    """Load time knows no capture: the weights are stacked where the branch measured the
    path in any capture; each call then runs it only in a capture it was measured in."""
    capture(monkeypatch, FULL)  # load: no capture active
    moe = fused_moe_branch_moe()
    assert fused_decode.stack_moe_input_weights(nn.Sequential(moe), FakeMoE) == 1
    capture(monkeypatch, mode)
    assert (fused_decode.moe_input_projections(moe, bf16(2, H)) is not None) == bool(runs)
    assert len(launches["gate_gemm"]) == runs
    assert any("moe_front" in line for line in logged) != bool(runs)


def test_no_stack_where_the_branch_measured_the_path_in_no_capture(launches, monkeypatch) -> None:
    capture(monkeypatch, FULL)
    moe = fused_moe_branch_moe()
    monkeypatch.setattr(fd, "MODES_BY_CAPABILITY", {SM90: {"moe_front": {("mega_moe", "full"): "x.json"}}})
    assert fused_decode.stack_moe_input_weights(nn.Sequential(moe), FakeMoE) == 0
    assert not hasattr(moe, "_k3_input_stack")


def test_the_gate_up_left_for_the_runner_is_taken_once_for_its_own_input() -> None:
    mlp, x, gate_up = SimpleNamespace(), bf16(3, H), bf16(3, G)
    assert fused_decode.take_shared_gate_up(mlp, x) is None  # nothing left (MegaMoE, stock)
    fused_decode.hand_shared_gate_up(mlp, x, gate_up)
    # the runner's custom op may hand over another Python object of the same tensor
    assert fused_decode.take_shared_gate_up(mlp, x.view(3, H)) is gate_up
    assert fused_decode.take_shared_gate_up(mlp, x) is None, "taken twice"
    for other in (x[:2], bf16(3, H), x.t().contiguous().t()):
        fused_decode.hand_shared_gate_up(mlp, x, gate_up)
        assert fused_decode.take_shared_gate_up(mlp, other) is None
        assert fused_decode.take_shared_gate_up(mlp, x) is None, "a refused one must not linger"
    fused_decode.hand_shared_gate_up(mlp, x, gate_up)
    fused_decode.hand_shared_gate_up(mlp, x, None)  # a later forward without the fused front
    assert fused_decode.take_shared_gate_up(mlp, x) is None
    fused_decode.hand_shared_gate_up(None, x, gate_up)  # no shared experts: nothing to do


model = pytest.importorskip("vllm.models.kimi_k3.nvidia.model")
needs_patch_0008 = pytest.mark.skipif(
    not hasattr(model, "hand_shared_gate_up"), reason="model.py without patch 0008 here"
)


class Calls:
    def __init__(self) -> None:
        self.log: list[tuple] = []

    def linear(self, name: str, out):
        return lambda x: self.log.append((name, x)) or (out, None)


def _stub_mlp(calls: Calls, m: int) -> SimpleNamespace:
    mlp = SimpleNamespace(shard_sequence_parallel=False, run_gemm_rs=False, act_fn=nn.Identity())
    mlp.gate_up_proj = calls.linear("gate_up_proj", bf16(m, G))
    mlp.down_proj = calls.linear("down_proj", "shared out")
    return mlp


def _stub_moe(calls: Calls, shared_gate_up, m: int) -> SimpleNamespace:
    """What the patched KimiMoE.forward reads of ``self`` on the FusedMoE branch; its
    ``experts`` calls the shared experts the way the runner does (one argument)."""
    mlp = _stub_mlp(calls, m)
    shared = lambda x: model.KimiMLP.forward(mlp, x)  # noqa: E731

    def runner(hidden_states, router_logits, shared_experts_input):
        calls.log.append(("runner", hidden_states, router_logits))
        calls.log.append(("shared experts", shared(shared_experts_input)))
        return torch.zeros(m, H)

    moe = SimpleNamespace(use_mega_moe=False, experts=runner, shared_experts=mlp)
    moe._maybe_overlap_router_and_down_proj = lambda h: ("latent", "logits", None, shared_gate_up)
    return moe


@needs_patch_0008
def test_the_runner_s_shared_experts_take_the_stacked_gemm_s_gate_up(monkeypatch) -> None:
    acted: list = []
    monkeypatch.setattr(model, "act_and_mul", lambda act, gu: acted.append(gu) or "acted")
    calls, m = Calls(), 2
    gate_up = bf16(m, L + G)[:, L:]  # the row-strided view moe_input_projections hands out
    moe = _stub_moe(calls, gate_up, m)
    model.KimiMoE.forward(moe, bf16(m, H))
    assert [c[0] for c in calls.log] == ["runner", "down_proj", "shared experts"]
    assert acted == [gate_up] and acted[0] is gate_up
    assert calls.log[0][1:] == ("latent", "logits")
    # the stock front (no stacked GEMM): the shared experts run their own gate_up_proj
    calls.log.clear()
    model.KimiMoE.forward(_stub_moe(calls, None, m), bf16(m, H))
    assert [c[0] for c in calls.log] == ["runner", "gate_up_proj", "down_proj", "shared experts"]


@needs_patch_0008
def test_a_stale_gate_up_from_an_earlier_forward_is_never_read(monkeypatch) -> None:
    monkeypatch.setattr(model, "act_and_mul", lambda act, gu: "acted")
    calls, m, x = Calls(), 2, bf16(2, H)
    first = _stub_moe(calls, bf16(m, G), m)
    first.experts = lambda **kw: torch.zeros(m, H)  # a runner that did not call its shared experts
    model.KimiMoE.forward(first, x)
    second = _stub_moe(calls, None, m)  # the same layer, a forward without the stacked GEMM
    second.shared_experts = first.shared_experts
    second.experts = lambda hidden_states, router_logits, shared_experts_input: torch.zeros(m, H) + 0 * (
        calls.log.append(("shared", model.KimiMLP.forward(first.shared_experts, shared_experts_input))) or 0)
    model.KimiMoE.forward(second, x)
    assert [c[0] for c in calls.log] == ["gate_up_proj", "down_proj", "shared"]


def test_patch_0008_hands_the_gate_up_over_and_kimi_mlp_takes_it() -> None:
    tree = ast.parse(Path(fused_decode.__file__).with_name("model.py").read_text("utf-8"))
    assert "hand_shared_gate_up" in _calls_in(tree, "KimiMoE", "forward")
    assert "take_shared_gate_up" in _calls_in(tree, "KimiMLP", "forward")
    assert "moe_input_projections" in _calls_in(tree, "KimiMoE", "_maybe_overlap_router_and_down_proj")


def _calls_in(tree, cls: str, method: str) -> set[str]:
    (node,) = [n for n in ast.walk(tree) if isinstance(n, ast.ClassDef) and n.name == cls]
    (fn,) = [f for f in node.body if isinstance(f, ast.FunctionDef) and f.name == method]
    return {c.func.id for c in ast.walk(fn) if isinstance(c, ast.Call) and isinstance(c.func, ast.Name)}


# ------------------------------------------------------------------- the tail


def bare(cls, **attrs) -> nn.Module:
    """An instance of vLLM's ``cls`` with only ``attrs`` set (its constructor wants a vLLM
    config; the code under test reads attributes only)."""
    module = cls.__new__(cls)
    nn.Module.__init__(module)
    for name, value in attrs.items():
        setattr(module, name, value)
    return module


def _norm(width: int) -> RMSNorm:
    return bare(RMSNorm, weight=nn.Parameter(bf16(width)), variance_epsilon=1e-6, has_weight=True,
                variance_size_override=None)  # fmt: skip


def _transform(norm=True, up_rows=H) -> SimpleNamespace:
    up = SimpleNamespace(quant_method=UnquantizedLinearMethod(), bias=None,
                         weight=torch.empty(up_rows, L, dtype=BF16))  # fmt: skip
    return SimpleNamespace(norm=_norm(L) if norm else None, up_proj=up)


@pytest.fixture
def all_reduces(monkeypatch: pytest.MonkeyPatch) -> list:
    import vllm.distributed as dist

    done: list = []

    def all_reduce(t):
        done.append(t)
        return t.clone()

    monkeypatch.setattr(dist, "tensor_model_parallel_all_reduce", all_reduce)
    return done


def test_the_tail_reduces_both_and_runs_one_gemm_with_the_shared_add(launches, all_reduces, monkeypatch):
    capture(monkeypatch, BREAKABLE)
    runner = SimpleNamespace(routed_output_transform=_transform())
    latent, shared = bf16(4, L), bf16(4, H)
    assert fused_decode.latent_moe_tail(runner, latent, shared) == "out"
    assert [t is x for t, x in zip(all_reduces, (latent, shared))] == [True, True]
    ((x, norm_weight, eps, weight, add_to),) = launches["rmsnorm_gemm"]
    transform = runner.routed_output_transform
    assert norm_weight is transform.norm.weight and eps == transform.norm.variance_epsilon
    assert weight is transform.up_proj.weight
    # the GEMM reads the reduced tensors, not the partial sums
    assert x is not latent and x.shape == latent.shape and add_to is not shared


@pytest.mark.parametrize("spoil", ["full capture", "no norm", "no row", "M > 16", "strided shared"])
def test_the_tail_answers_none_before_any_all_reduce(launches, all_reduces, monkeypatch, spoil):
    capture(monkeypatch, FULL if spoil == "full capture" else BREAKABLE)
    runner = SimpleNamespace(routed_output_transform=_transform(norm=spoil != "no norm",
                                                                up_rows=H + 8 if spoil == "no row" else H))  # fmt: skip
    m = 17 if spoil == "M > 16" else 4
    shared = bf16(m, 2 * H)[:, :H] if spoil == "strided shared" else bf16(m, H)
    assert fused_decode.latent_moe_tail(runner, bf16(m, L), shared) is None
    assert all_reduces == [] and launches["rmsnorm_gemm"] == []


runner_module = pytest.importorskip("vllm.models.kimi_k3.nvidia.latent_moe_runner")
needs_patch_0009 = pytest.mark.skipif(
    "latent_moe_tail" not in Path(runner_module.__file__).read_text("utf-8"),
    reason="latent_moe_runner.py without patch 0009 here",
)


@needs_patch_0009
def test_the_patched_tail_returns_ours_or_runs_the_stock_lines(monkeypatch) -> None:
    log: list = []
    runner = SimpleNamespace(
        routed_output_transform=_transform(),
        _maybe_reduce_final_output=lambda r, trunc, output_is_reduced: ("final", r, trunc, output_is_reduced),
        allreduce_norm_latent_out=lambda x, norm: log.append("allreduce_norm") or x,
        _shared_ar_events=(None, None),
    )  # fmt: skip
    # the patched method imports it from fused_decode when it runs
    monkeypatch.setattr(fused_decode, "latent_moe_tail", lambda *a: log.append(("ours", a)) or "fused")
    tail = runner_module.LatentMoERunner._overlap_allreduce_tail
    latent, shared = torch.zeros(2, L, dtype=BF16), torch.zeros(2, H, dtype=BF16)
    assert tail(runner, latent, shared, 7) == ("final", "fused", 7, True)
    assert log == [("ours", (runner, latent, shared))]
    log.clear()
    monkeypatch.setattr(fused_decode, "latent_moe_tail", lambda *a: log.append("ours") or None)
    monkeypatch.setattr(runner_module, "tensor_model_parallel_all_reduce", lambda t: log.append("ar") or t)
    monkeypatch.setattr(runner_module, "aux_stream", lambda: None)
    up = runner.routed_output_transform.up_proj
    monkeypatch.setattr(fused_decode, "latent_up_proj",
                        lambda x, w: log.append(("up", x, w)) or torch.mm(x, w.t()))  # fmt: skip
    final = tail(runner, latent, shared, 7)
    assert [e if isinstance(e, str) else e[0] for e in log] == ["ours", "allreduce_norm", "up", "ar"], (
        "v0.28.0's lines, the up projection through the GEMM table"
    )
    assert log[2][1] is latent and log[2][2] is up.weight
    assert final[0] == "final" and final[1].shape == (2, H) and final[3] is True


_TAIL_SCRIPT = textwrap.dedent(
    """
    import json, os, types, torch
    from torch import nn
    import vllm.distributed as dist
    from vllm.model_executor.layers.layernorm import RMSNorm
    from vllm.model_executor.layers.linear import UnquantizedLinearMethod
    from vllm.models.kimi_k3.nvidia import fused_decode
    from vllm.models.kimi_k3.nvidia import low_latency_fused_dispatch as fd
    from vllm.models.kimi_k3.nvidia.gemm_backends import swap_ab_rmsnorm
    D, HALF = torch.float64, torch.float16
    # numpy has no bf16: the backend's dtype guard is pointed at fp16, all else is its own
    swap_ab_rmsnorm.bf16_on = lambda device, *ts: all(
        t is None or (t.dtype is HALF and t.device == device) for t in ts)
    L, H = 128, 64  # small rows: the interpreter is slow
    data = {"rmsnorm_gemm": {(H, L): ("swap_ab_rmsnorm", (16, 64, 2, 4, 2), (1, 5, 16))}}
    fd.TABLES_BY_CAPABILITY = {(9, 0): fd.FusedTable("SM90", data, {})}
    fd._device_capability = lambda: (9, 0)
    fd._FAST_PATH_DEVICE_TYPE = "cpu"
    fd._enabled = True
    from vllm.compilation.breakable_cudagraph import BreakableCUDAGraphCapture
    BreakableCUDAGraphCapture._tls.active = object()  # the capture the tail was measured in
    reduced = []
    dist.tensor_model_parallel_all_reduce = lambda t: reduced.append(t) or t.clone()  # one rank
    g = torch.Generator().manual_seed(5)
    norm = RMSNorm.__new__(RMSNorm); nn.Module.__init__(norm)
    norm.weight = nn.Parameter((1 + 0.1 * torch.randn(L, generator=g)).half())
    norm.variance_epsilon, norm.has_weight, norm.variance_size_override = 1e-6, True, None
    up = types.SimpleNamespace(quant_method=UnquantizedLinearMethod(), bias=None,
                               weight=(torch.randn(H, L, generator=g) / L**0.5).half())
    runner = types.SimpleNamespace(routed_output_transform=types.SimpleNamespace(norm=norm, up_proj=up))
    out = {}
    for m in (1, 5, 16):
        latent, shared = torch.randn(m, L, generator=g).half(), torch.randn(m, H, generator=g).half()
        y = fused_decode.latent_moe_tail(runner, latent, shared)
        t = latent.to(D)
        ref = (t * torch.rsqrt(t.pow(2).mean(-1, keepdim=True) + 1e-6) * norm.weight.to(D)
               @ up.weight.to(D).t() + shared.to(D))
        out[f"tail_M{m}"] = float((y.to(D) - ref).norm() / ref.norm())
    out["all_reduces"] = len(reduced)
    print(json.dumps(out))
    """
)


def test_the_tail_computes_v0_28_0_s_sequence_on_the_real_kernel_under_the_interpreter() -> None:
    pytest.importorskip("triton")
    env = dict(os.environ, TRITON_INTERPRET="1", CUDA_VISIBLE_DEVICES="")
    proc = subprocess.run([sys.executable, "-c", _TAIL_SCRIPT], capture_output=True, text=True,
                          env=env, timeout=900)  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    got = json.loads(proc.stdout.strip().splitlines()[-1])
    assert got.pop("all_reduces") == 6, "two all-reduces per call: the latent and the shared output"
    for what, rel in got.items():
        # fp16 operands, fp32 math, one rounding: ~5e-4; a wrong norm, operand or addend is O(1).
        assert rel < 3e-3, f"{what}: rel err {rel:.2e}"


def test_the_stock_tails_up_projection_takes_the_gemm_table_else_torch_mm(monkeypatch) -> None:
    """Patch 0009 outside the fused tail: only ``torch.mm`` gives way, to the GEMM table."""
    latent = torch.randn(3, 16).to(BF16)
    weight = torch.randn(8, 16).to(BF16)
    asked = []
    monkeypatch.setattr(fused_decode.llg, "try_low_latency_gemm", lambda x, w: asked.append((x, w)) or "table")
    assert fused_decode.latent_up_proj(latent, weight) == "table"
    assert asked == [(latent, weight)]
    monkeypatch.setattr(fused_decode.llg, "try_low_latency_gemm", lambda x, w: None)
    assert torch.equal(fused_decode.latent_up_proj(latent, weight), torch.mm(latent, weight.t()))


# --------------------------------------------------------- MLA's front (patch 0013)

QKV = 1536 + 512 + 64  # q_lora_rank + kv_lora_rank + qk_rope_head_dim: fused_qkv_a_proj's rows
GP = 1536  # g_proj's rows at TP8 (12 heads x 128)


class FakeMLA(nn.Module):
    """Stands in for v0.28.0's ``MultiHeadLatentAttention``: the attributes the stacking reads."""


def _plain(cls, rows: int, **attrs) -> nn.Module:
    weight = nn.Parameter(torch.randn(rows, 64).to(BF16), requires_grad=False)
    return bare(cls, quant_method=UnquantizedLinearMethod(), bias=None, weight=weight, **attrs)


def mla_layer() -> FakeMLA:
    attn = FakeMLA()
    attn.q_lora_rank, attn.kv_lora_rank, attn.qk_rope_head_dim = 1536, 512, 64
    attn.fused_qkv_a_proj = _plain(MergedColumnParallelLinear, QKV)
    attn.g_proj = _plain(ColumnParallelLinear, GP, gather_output=False)
    return attn


@pytest.fixture
def mla_measured(launches, monkeypatch: pytest.MonkeyPatch) -> dict[str, list]:
    """mla_front listed for breakable capture, the GEMM table routing the stack (a CPU
    ``x @ w.T`` in its place); ``{"gemm": [weights], "warm": [weights]}``."""
    seen: dict[str, list] = {"gemm": [], "warm": []}
    monkeypatch.setattr(fd, "MODES_BY_CAPABILITY", {SM90: {"mla_front": {("mla", "breakable"): "x.json"}}})
    llg = fused_decode.llg
    monkeypatch.setattr(llg, "routes_any", lambda shape: tuple(shape) == (QKV + GP, 64))
    monkeypatch.setattr(llg, "request_low_latency_warmup", lambda w: seen["warm"].append(w) or True)
    monkeypatch.setattr(llg, "try_low_latency_gemm",
                        lambda x, w: seen["gemm"].append(w) or (x.float() @ w.float().t()).to(BF16))  # fmt: skip
    return seen


def test_the_mla_front_runs_in_no_mode_until_an_h200_run_lists_it(launches, logged, monkeypatch) -> None:
    for mode in (BREAKABLE, FULL):
        capture(monkeypatch, mode)
        assert not fd.path_measured("mla_front", "mla")
        assert not fd.path_enabled("mla_front", "mla")
    assert sum("mla_front" in line for line in logged) == 2, "said once per capture mode"
    attn = mla_layer()
    before = [attn.fused_qkv_a_proj.weight.data_ptr(), attn.g_proj.weight.data_ptr()]
    assert not fused_decode.stack_mla_front_weights(attn)
    assert [attn.fused_qkv_a_proj.weight.data_ptr(), attn.g_proj.weight.data_ptr()] == before
    assert not hasattr(attn, "_k3_front_stack")
    assert fused_decode.mla_front(attn, bf16(2, 64)) is None


def test_the_mla_front_stacks_views_and_splits_one_gemm_where_measured(mla_measured, logged, monkeypatch):
    capture(monkeypatch, FULL)  # load: no capture active
    attn = mla_layer()
    params = (attn.fused_qkv_a_proj.weight, attn.g_proj.weight)
    values = [p.data.clone() for p in params]
    assert fused_decode.stack_mla_front_weights(attn)
    stack = attn._k3_front_stack.weight
    assert stack.shape == (QKV + GP, 64) and mla_measured["warm"] == [stack]
    assert (attn.fused_qkv_a_proj.weight, attn.g_proj.weight) == params, "the same parameter objects"
    for p, v, row in zip(params, values, (0, QKV)):
        assert torch.equal(p.data, v) and p.data_ptr() == stack[row].data_ptr()
    capture(monkeypatch, BREAKABLE)
    x = torch.randn(3, 64).to(BF16)
    qkv_lora, gate = fused_decode.mla_front(attn, x)
    assert mla_measured["gemm"] == [stack]
    assert qkv_lora.shape == (3, QKV) and gate.shape == (3, GP)
    assert qkv_lora.stride(0) == gate.stride(0) == QKV + GP, "column views of one output"
    assert torch.allclose(qkv_lora.float(), x.float() @ values[0].float().t(), rtol=2e-2, atol=2e-2)
    assert torch.allclose(gate.float(), x.float() @ values[1].float().t(), rtol=2e-2, atol=2e-2)
    capture(monkeypatch, FULL)  # measured under breakable capture only
    assert fused_decode.mla_front(attn, x) is None and any("mla_front" in line for line in logged)
    capture(monkeypatch, BREAKABLE)
    attn.g_proj.weight.data = values[1].clone()  # a reload that gave the parameter a new storage
    assert fused_decode.mla_front(attn, x) is None
    assert len(mla_measured["gemm"]) == 1


def _no_gate(attn):
    attn.g_proj = None


def _quantized(attn):
    attn.g_proj.quant_method = object()


def _gathers(attn):
    attn.g_proj.gather_output = True


def _replicated_gate(attn):
    attn.g_proj = _plain(MergedColumnParallelLinear, GP, gather_output=False)


def _fp16(attn):
    attn.g_proj.weight = nn.Parameter(attn.g_proj.weight.data.half(), requires_grad=False)


def _other_k(attn):
    attn.g_proj.weight = nn.Parameter(torch.randn(GP, 128).to(BF16), requires_grad=False)


def _no_q_lora(attn):
    attn.q_lora_rank = None


def _strided(attn):
    attn.g_proj.weight = nn.Parameter(torch.randn(GP, 128).to(BF16)[:, :64], requires_grad=False)


@pytest.mark.parametrize("spoil", [_no_gate, _quantized, _gathers, _replicated_gate, _fp16, _other_k,
                                   _no_q_lora, _strided])  # fmt: skip
def test_no_mla_front_stack_for_a_layer_it_was_not_built_for(mla_measured, monkeypatch, spoil) -> None:
    capture(monkeypatch, FULL)
    attn = mla_layer()
    spoil(attn)
    g = getattr(attn.g_proj, "weight", None) if attn.g_proj is not None else None
    assert not fused_decode.stack_mla_front_weights(attn)
    assert not hasattr(attn, "_k3_front_stack") and mla_measured["warm"] == []
    if g is not None:
        assert attn.g_proj.weight is g


def test_a_second_post_load_hook_keeps_each_stack_where_captured_graphs_read_it(mla_measured, launches,
                                                                               monkeypatch) -> None:  # fmt: skip
    """vLLM's layerwise reload refreshes the weights, then runs the layer's hook again."""
    capture(monkeypatch, FULL)
    attn, moe = mla_layer(), fused_moe_branch_moe()
    monkeypatch.setattr(fd, "MODES_BY_CAPABILITY", {SM90: {"mla_front": {("mla", "breakable"): "x.json"},
                                                           "moe_front": {("fused_moe", "breakable"): "y.json"}}})
    for stacked in (lambda: fused_decode.stack_mla_front_weights(attn) and attn._k3_front_stack,
                    lambda: fused_decode.stack_moe_input_weights(nn.Sequential(moe), FakeMoE)
                    and moe._k3_input_stack):  # fmt: skip
        first = stacked()
        params, where = first.params, first.weight.data_ptr()
        assert stacked().weight.data_ptr() == where, "a second hook moved the stack"
        # a reload that gave one parameter new storage: its values go into the same stack
        fresh = torch.randn(params[-1].shape).to(BF16)
        params[-1].data = fresh.clone()
        again = stacked()
        assert again.weight.data_ptr() == where and torch.equal(params[-1].data, fresh)
        assert params[-1].data_ptr() == again.weight[again.weight.shape[0] - fresh.shape[0]].data_ptr()


@pytest.mark.parametrize("how", ["offloader", "uva"])
def test_no_stack_where_vllm_offloads_weights_to_the_cpu(mla_measured, launches, monkeypatch, how) -> None:
    capture(monkeypatch, FULL)
    attn, moe = mla_layer(), fused_moe_branch_moe()
    if how == "offloader":
        from vllm.model_executor.offloader import base

        monkeypatch.setattr(base, "get_offloader", lambda: object())
    else:
        attn.g_proj.weight._vllm_is_uva_offloaded = True
        moe.gate.weight._vllm_is_uva_offloaded = True
    assert not fused_decode.stack_mla_front_weights(attn) and not hasattr(attn, "_k3_front_stack")
    assert fused_decode.stack_moe_input_weights(nn.Sequential(moe), FakeMoE) == 0


def test_the_stock_output_gate_gets_a_packed_gate(monkeypatch) -> None:
    """A refused gate (here: no table) of the stacked GEMM's strides reaches v0.28.0's
    torch.compile'd expression packed, as v0.28.0 hands it over: no recompile."""
    monkeypatch.setattr(fused_decode, "try_sigmoid_mul", lambda x, g: None)
    got = []
    attn_out, gate = bf16(2, GP), torch.randn(2, QKV + GP).to(BF16)[:, QKV:]
    fused_decode.output_gate(lambda a, g: got.append(g) or "stock", attn_out, gate)
    assert got[0].is_contiguous() and torch.equal(got[0], gate)
    fused_decode.output_gate(lambda a, g: got.append(g) or "stock", attn_out, got[0])
    assert got[1] is got[0], "a packed gate is handed over as it is"


def test_no_mla_front_stack_where_the_gemm_table_has_no_row_for_it(mla_measured, monkeypatch) -> None:
    capture(monkeypatch, FULL)
    monkeypatch.setattr(fused_decode.llg, "routes_any", lambda shape: False)
    attn = mla_layer()
    assert not fused_decode.stack_mla_front_weights(attn) and not hasattr(attn, "_k3_front_stack")


mla = pytest.importorskip("vllm.models.kimi_k3.nvidia.mla")


@pytest.mark.skipif(not hasattr(mla, "mla_front"), reason="mla.py without patch 0013 here")
def test_patch_0013_stacks_at_load_and_tries_the_stacked_gemm_first() -> None:
    tree, cls = ast.parse(Path(mla.__file__).read_text("utf-8")), "MultiHeadLatentAttention"
    assert "stack_mla_front_weights" in _calls_in(tree, cls, "process_weights_after_loading")
    assert "mla_front" in _calls_in(tree, cls, "forward")
    (node,) = [n for n in ast.walk(tree) if isinstance(n, ast.ClassDef) and n.name == cls]
    (fn,) = [f for f in node.body if isinstance(f, ast.FunctionDef) and f.name == "_forward_attn"]
    assert [a.arg for a in fn.args.args][-1] == "qkv_lora"
