"""The decode-step replay's stock ops and what v0.28.0 runs on an H200 stay in step (issue 27).

``results/decode_step/h200_modes_from_code.json`` lists v0.28.0's ops per capture mode and layer
and explains every way the replay's stock ops part from them; a difference that appears
unexplained, or an explained one that is gone (fixed), fails here. The trace summarizer the
model check uses on the GPU is checked on a synthetic trace.
"""

from __future__ import annotations

import copy
import json

import pytest

from k3lab.decode_step import trace_summary
from k3overlay.project import ROOT

pytest.importorskip("torch")  # layers.py builds its op lists with torch in scope
from k3lab.decode_step import step_sync  # noqa: E402

MODES = ROOT / "results" / "decode_step" / "h200_modes_from_code.json"
LAYERS = ("mtp", "kda", "mla")


@pytest.fixture(scope="module")
def doc() -> dict:
    return json.loads(MODES.read_text())


@pytest.mark.parametrize("mode", ("breakable", "full"))
@pytest.mark.parametrize("layer", LAYERS)
def test_every_difference_is_explained_and_every_explanation_is_current(doc, mode, layer):
    found = step_sync.differences(doc, mode, layer)
    said = step_sync.explained(doc, mode, layer)
    assert not found - set(said), f"{mode}/{layer}: unexplained differences {sorted(found - set(said))}"
    assert not set(said) - found, f"{mode}/{layer}: fixed, drop the explanation of {sorted(set(said) - found)}"
    assert all(len(why) > 40 for why in said.values())


def test_every_replay_name_in_the_modes_is_a_stock_op_of_its_layer(doc):
    for mode, m in doc["modes"].items():
        for layer, ops in m["layers"].items():
            stock = {op.name for op in step_sync.replay_stock_ops(layer)}
            named = {op["replay"] for op in ops if op["replay"]}
            assert named <= stock, f"{mode}/{layer}: {sorted(named - stock)}"


def test_the_default_mode_keeps_the_shared_experts_fork_and_breaks_at_the_cores(doc):
    kda = {op["op"]: op for op in doc["modes"]["breakable"]["layers"]["kda"]}
    assert kda["shared_gate_up"]["stream"] == "aux"
    assert kda["routed_down"]["stream"] == "main"  # maybe_execute_in_parallel: in line under capture
    assert kda["in_proj_qkvgfab"]["segment"] == 0 and kda["o_proj"]["segment"] == 1
    assert doc["modes"]["full"]["layers"]["kda"][-1]["segment"] == 0


def test_a_moved_op_a_new_stream_and_a_new_break_each_show(doc):
    d = copy.deepcopy(doc)
    ops = d["modes"]["breakable"]["layers"]["mla"]
    names = [op["op"] for op in ops]
    i, j = names.index("q_b_proj"), names.index("fused_qkv_a_proj")
    ops[i], ops[j] = ops[j], ops[i]
    ops[names.index("router_gate")]["stream"] = "aux"
    ops[names.index("attn_res (post-attn)")]["segment"] = 7
    found = step_sync.differences(d, "breakable", "mla")
    assert {("stream", "router_gate"), ("break", "attn_res (post-attn)")} <= found
    assert found & {("order", "q_b_proj"), ("order", "fused_qkv_a_proj")}


def test_a_fixed_difference_leaves_its_explanation_stale(doc, monkeypatch):
    stock = step_sync.replay_stock_ops
    cute = "CuTe DSL ll_bf16_gemm (GateLinear tier 1)"
    monkeypatch.setattr(step_sync, "replay_stock_ops", lambda layer: [
        op._replace(runs=cute) if op.name == "router_gate" else op for op in stock(layer)])  # fmt: skip
    found = step_sync.differences(doc, "breakable", "kda")
    assert ("kernel", "router_gate") in set(step_sync.explained(doc, "breakable", "kda")) - found


def test_kernel_kinds():
    assert not step_sync._kernel_differs("_C", "stand-in for _C rms_norm (no PDL)")
    assert step_sync._kernel_differs("torch.compile", "stand-in for the torch.compile kernel (Triton)")
    assert step_sync._kernel_differs("CuTe DSL (GateLinear tier 1)", "cuBLAS bf16 x bf16 -> fp32 (GateLinear tier 5)")
    assert not step_sync._kernel_differs("cuBLAS", "cuBLAS on the strided f_a view")
    assert not step_sync._kernel_differs("Triton", "v0.28.0 Triton (no PDL)")


def _x(cat, name, ts, dur, tid, **args):
    return {"ph": "X", "cat": cat, "name": name, "ts": ts, "dur": dur, "tid": tid, "pid": 1, "args": args}


def test_trace_summary_places_each_kernel_in_its_innermost_op_and_segment():
    events = [
        _x("user_annotation", "k3seg:2:graph", 0, 100, 1),
        _x("user_annotation", "k3:block_sparse_moe", 5, 50, 1),
        _x("user_annotation", "k3:block_sparse_moe.gate", 10, 5, 1),
        _x("cpu_op", "aten::mm", 11, 2, 1, **{"Input Dims": [[1, 7168], [7168, 384]]}),
        _x("cuda_runtime", "cudaLaunchKernel", 12, 1, 1, correlation=5),
        _x("cuda_runtime", "cudaLaunchKernel", 30, 1, 1, correlation=6),  # in the parent only
        _x("kernel", "late_kernel", 900, 3, 7, correlation=6, stream=9),
        _x("kernel", "nvjet_gemm", 800, 3, 7, correlation=5, stream=7),
    ]
    ks = trace_summary.kernels_of(events)
    assert [k["name"] for k in ks] == ["nvjet_gemm", "late_kernel"]  # launch order, not GPU order
    assert ks[0]["label"] == "block_sparse_moe.gate" and ks[1]["label"] == "block_sparse_moe"
    assert ks[0]["segment"] == 2 and ks[0]["dims"] == [[1, 7168], [7168, 384]]
    launches = [{"label": "block_sparse_moe", "stream": 11, "segment": 0},
                {"label": "block_sparse_moe.gate", "stream": 11, "segment": 0},
                {"label": "shared", "stream": 12, "segment": 1}]  # fmt: skip
    s = trace_summary.summarize(ks, [], launches, ["graph"])
    assert [(o["label"], o["stream"]) for o in s["ops"]] == [("block_sparse_moe", "main"),
                                                             ("block_sparse_moe.gate", "main")]  # fmt: skip
    assert s["unplaced"] == {}


# v0.28.0's own layers on the H200, one run per deployment mode (model_check_<mode>_<date>.json),
# against the code read of the capture the run took: each way they part, and why.
MEASURED_EXPLAINED = {
    ("unlabelled", "block_sparse_moe.experts"): "the model check's stand-in for the routed experts "
    "(torch.topk + zeros_like: the Triton fused_moe needs _moe_C); left out of the replay too",
    ("unlabelled", "self_attn"): "one fill of [M, 1536] bf16: the model check's stub MLA attention "
    "backend writing the core's output (the core is left out, as in the replay)",
    ("order", "latent all-reduce + routed_expert_norm (fused)"): "a labelling artefact: the tail "
    "function's first kernel (a copy) carries the routed_up label, so the tail's label comes first; "
    "by the graph's kernel order the norm's kernels run before the up GEMM, as the code read says",
}
CHECKS = {mode: ROOT / "results" / "decode_step" / f"model_check_{mode}_2026-12-04.json"
          for mode in ("h200-default", "h200-nobreak", "h200-piecewise")}


# Runs from before the model check took a mode name (--mode breakable / full): their mode and
# capture were written in by hand when the modes were renamed, and they record no environment.
RELABELLED = {"h200-nobreak", "h200-piecewise"}


def test_each_check_ran_its_modes_environment_and_capture() -> None:
    from k3lab.decode_step import modes

    for mode, path in CHECKS.items():
        check = json.loads(path.read_text())
        assert check["mode"] == mode and check["capture"] == modes.branches(mode, "kda")["capture"]
        if mode in RELABELLED:
            assert "env" not in check, f"{mode}: ran with a mode name: drop it from RELABELLED"
        else:
            assert check["env"] == modes.mode(mode)["env"]


@pytest.mark.parametrize("mode", sorted(CHECKS))
@pytest.mark.parametrize("layer", ["kda", "mla", "mtp"])
@pytest.mark.parametrize("m", [1, 16])
def test_v028s_own_layers_on_the_h200_run_what_the_code_read_says(mode, layer, m) -> None:
    """Every difference between the profiled run of v0.28.0's own layer (each mode) and the
    code read of its capture is explained above, and every explanation still names a
    difference: the same ops in the same order, on the same streams, with the graph broken
    where it says."""
    code = json.loads(MODES.read_text())
    check = json.loads(CHECKS[mode].read_text())
    kind = check["capture"]
    found = step_sync.measured_differences(code, check, kind, layer, m)
    assert found <= set(MEASURED_EXPLAINED), sorted(found - set(MEASURED_EXPLAINED))
    if layer == "kda":  # KDA has no MLA attention stub
        assert found == set(MEASURED_EXPLAINED) - {("unlabelled", "self_attn")}
    else:
        assert found == set(MEASURED_EXPLAINED)
    ran = step_sync.measured_ops(check, layer, m)
    # the forks as read: routed_down on an aux stream only outside a breakable capture; the
    # runner's shared experts on theirs in every mode (SharedExperts never asks about it)
    assert ("routed_down", "aux" if kind == "full" else "main") in ran
    assert ("router_gate", "main") in ran and ("shared_down", "aux") in ran
