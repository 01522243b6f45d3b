"""The replay's op lists per deployment mode are what modes.json says (CPU; timing needs a GPU)."""

from __future__ import annotations

import pytest

from k3lab.decode_step import layers, mode_ops, modes, replay

REPLAYED = [n for n in modes.names() if modes.mode(n)["replay"]]


class _Any:
    """Stand-in for every kernel module and entry point: the op lists only take references."""

    def __getattr__(self, name):
        return self

    def __call__(self, *a, **k):
        return self

    def __iter__(self):  # an empty collection (e.g. a tree's PATHS): nothing is in it
        return iter(())


class _Pk:
    """A patched tree without the paths' switch (an older overlay), or with one that lets
    ``paths`` run; ``known``: the paths the tree has (an older one lacks ``mla_front``)."""

    def __init__(self, paths=(), known=("moe_front", "moe_tail", "mla_front")):
        self.llg, self.kda = _Any(), _Any()
        self.fused = _Any()
        if paths is not None:
            def enabled(s, p, branch):
                assert p in known and branch == mode_ops.path_branch(p, "fused_moe")
                return p in paths

            self.fused = type("F", (_Any,), {"path_enabled": enabled, "PATHS": known})()
        else:
            self.fused = type("F", (_Any,), {"path_enabled": None})()


def _kn(**kw):
    return layers.Kernels(*([_Any()] * 9), **kw)


def _shape(ops):
    """Names, with a fork as (main names, aux names) and a break as 'BREAK'."""
    out = []
    for op in ops:
        arms = getattr(op.run, "arms", None)
        if isinstance(arms, tuple):
            out.append(tuple(tuple(o.name for o in arm) for arm in arms))
        else:
            out.append("BREAK" if mode_ops.is_break(op) else op.name)
    return out


def _expected_stock(layer: str, br: dict) -> list:
    """The stock op list derived from the data alone (independent of mode_ops)."""
    brk = br["capture"] == "breakable"
    front = ["fused_qkv_a_proj", "fused_q_kv_rmsnorm", "q_b_proj"]
    if br.get("g_proj", "after_core") == "after_core":
        mla = [*front, *(["BREAK"] if brk else []), "g_proj", "gate_sigmoid_mul", "o_proj"]
    else:
        mla = [(tuple(front), ("g_proj",)), "gate_sigmoid_mul", "o_proj"]
    if layer == "kda":
        attn = ["attn_res (pre-attn)", "in_proj_qkvgfab", "f_b_proj", *(["BREAK"] if brk else []), "o_proj",
                "attn_res (post-attn)"]  # fmt: skip
    elif layer == "mla":
        attn = ["attn_res (pre-attn)", *mla, "attn_res (post-attn)"]
    else:
        attn = ["embed_tokens", "fused_mtp_input", "eh_proj", "input_layernorm", *mla,
                "post_attention_layernorm"]
    gate = ["router_gate", "routed_down"] if br["gate_down"] == "in_line" else [(("router_gate",), ("routed_down",))]
    assert br["shared_experts"] == "runner_aux" and br["latent_tail"] == "allreduce_overlap"
    moe = [*gate, ((), ("shared_gate_up", "situ_and_mul", "shared_down")), "routed_expert_norm", "routed_up",
           "shared_add"]  # fmt: skip
    return [*attn, *moe, *(["shared_head.norm"] if layer == "mtp" else [])]


@pytest.mark.parametrize("mode", REPLAYED)
@pytest.mark.parametrize("layer", modes.LAYERS)
def test_stock_ops_are_what_the_modes_data_says(mode, layer) -> None:
    br = modes.branches(mode, layer)
    ops = mode_ops.stock_ops(_kn(), layer, br)
    assert _shape(ops) == _expected_stock(layer, br)
    for op in mode_ops.leaves(ops):
        assert ":" in op.where and op.nbytes(16) > op.nbytes(1) > 0, op


@pytest.mark.parametrize("mode", REPLAYED)
@pytest.mark.parametrize("layer", modes.LAYERS)
@pytest.mark.parametrize("paths", [None, (), ("moe_front", "moe_tail"), ("mla_front",),
                                   ("moe_front", "moe_tail", "mla_front")])  # fmt: skip
def test_patched_covers_every_stock_op_once_in_stock_order(mode, layer, paths) -> None:
    br = modes.branches(mode, layer)
    stock = [op.name for op in mode_ops.leaves(mode_ops.stock_ops(_kn(), layer, br))]
    ops = mode_ops.patched_ops(_Pk(paths), _kn(), layer, br)
    covered = [c for op in mode_ops.leaves(ops) for c in (op.covers or (op.name,))]
    front = paths is not None and "mla_front" in paths and layer != "kda"
    if front:  # patch 0013 moves g_proj, in the stacked GEMM, ahead of the core: stock order otherwise
        assert covered.count("g_proj") == stock.count("g_proj") == 1
        covered, stock = ([c for c in names if c != "g_proj"] for names in (covered, stock))
    assert covered == stock
    # the same breaks and the same forks of the stream structure as stock
    assert [mode_ops.is_break(o) for o in ops].count(True) == (br["capture"] == "breakable")
    names = [o.name for o in ops]
    assert ("fused_qkv_a_proj+g_proj" in names) == front
    fork = layer != "kda" and br["g_proj"] == "fork" and not front
    assert ("attention front end || g_proj" in names) == fork
    if front:  # patch 0013: the stacked GEMM before the core, the gate's consumer after it
        at = names.index("fused_qkv_a_proj+g_proj")
        assert names.index("gate_sigmoid_mul") > at and "g_proj" not in names
        if br["capture"] == "breakable":
            assert at < [mode_ops.is_break(o) for o in ops].index(True)
    assert "shared experts (runner, aux stream)" in names
    stacked = "router_gate+routed_down+shared_gate_up" in names
    assert stacked == (paths is not None and "moe_front" in paths)
    assert ("routed_expert_norm+routed_up+shared_add" in names) == (paths is not None and "moe_tail" in paths)
    assert ("router_gate || routed_down" in names) == (not stacked and br["gate_down"] == "fork")


@pytest.mark.parametrize("has_line", [False, True])
def test_the_patched_tail_takes_the_gemm_table_for_routed_up_where_the_tree_has_the_line(has_line) -> None:
    # patch 0009's latent_up_proj: only the up projection moves, the fork and the add stay v0.28.0's
    pk = _Pk(())
    if has_line:
        pk.decode = _Any()
    br = modes.branches("h200-default", "kda")
    ops = {o.name: o for o in mode_ops.leaves(mode_ops.patched_ops(pk, _kn(), "kda", br))}
    stock = {o.name: o for o in mode_ops.leaves(mode_ops.stock_ops(_kn(), "kda", br))}
    assert ("try_low_latency_gemm" in ops["routed_up"].runs) == has_line
    assert (ops["routed_up"].runs == stock["routed_up"].runs) != has_line
    for name in ("routed_expert_norm", "shared_add"):
        assert ops[name].runs == stock[name].runs


def test_the_stock_router_gate_is_ll_bf16_tier_1() -> None:
    calls = []
    kn = _kn(gate_ll_bf16=lambda x, w: calls.append((x, w)) or "logits")
    br = modes.branches("h200-default", "kda")
    (gate,) = [op for op in mode_ops.leaves(mode_ops.stock_ops(kn, "kda", br)) if op.name == "router_gate"]
    st = {"hn2": "x"}
    gate.run(st, {"gate": "w"})
    assert calls == [("x", "w")] and st["logits"] == "logits" and "ll_bf16" in gate.runs


@pytest.mark.parametrize("mode", [n for n in modes.names() if not modes.mode(n)["replay"]])
def test_a_data_only_mode_is_refused_by_the_op_builder_and_the_replay(mode, capsys) -> None:
    # SM100/SM103 modes: the tail fusion, MegaMoE or the SM103 table do not run on the H200
    for layer in modes.LAYERS:
        with pytest.raises(modes.NotReplayable):
            mode_ops.stock_ops(_kn(), layer, modes.branches(mode, layer))
    assert replay.main(["--mode", mode, "--stock-dir", "."]) == modes.NOT_REPLAYABLE
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "data only" in err


def test_an_unknown_mode_exits_with_its_own_code(capsys) -> None:
    assert replay.main(["--mode", "h200-megamoe", "--stock-dir", "."]) == modes.UNKNOWN_MODE
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "unknown mode 'h200-megamoe'" in err


@pytest.mark.parametrize("mode,graphs", [("h200-piecewise", 3), ("h200-default", 1), ("h200-nobreak", 1)])
def test_a_breakable_mode_cuts_the_step_into_one_graph_per_segment(mode, graphs) -> None:
    ops = mode_ops.stock_ops(_kn(), "kda", modes.branches(mode, "kda"))
    segs = mode_ops.segments(ops, copies=2)
    assert len(segs) == graphs
    flat = [(op.name, c) for seg in segs for op, c in seg]
    assert flat == [(op.name, c) for c in range(2) for op in ops if not mode_ops.is_break(op)]
    if graphs == 3:  # copy 0's tail and copy 1's head share a graph, as consecutive layers do
        assert segs[1][0] == (ops[4], 0) and segs[1][-1] == (ops[2], 1)


def test_the_plot_attributes_stock_time_to_the_patched_ops_that_cover_it() -> None:
    from k3lab.decode_step import plot

    def rec(variant, op, us, covers):
        return {"layer": "kda", "M": 8, "variant": variant, "op": op, "us": us, "roof_us": 1.0, "covers": covers}

    doc = {"per_op": [
        rec("stock", "router_gate", 4.0, ["router_gate"]),
        rec("stock", "shared experts", 18.0, ["shared_gate_up", "situ_and_mul", "shared_down"]),
        rec("patched", "router_gate+routed_down+shared_gate_up", 20.0, ["router_gate", "routed_down", "shared_gate_up"]),
        rec("patched", "shared experts", 9.0, ["situ_and_mul", "shared_down"]),
    ]}  # fmt: skip
    rows = plot.per_op_rows(doc, "kda", 8)
    assert [r[0] for r in rows] == ["router_gate+routed_down+shared_gate_up", "shared experts"]
    assert rows[0][2] == 4.0 + 6.0 and rows[1][2] == 12.0  # a third of the fork to the stack


@pytest.mark.parametrize("mode", REPLAYED)
def test_the_small_ops_are_the_modes_c_kernels_or_native_torch(mode) -> None:
    # Breakable capture (compile mode NONE): vLLM's _C kernels (stand-ins); full capture
    # (Inductor): the norms as eager PyTorch ops and SITU-and-mul torch.compile'd.
    calls = []

    class Stock:
        def __getattr__(self, name):
            return lambda *a, **k: calls.append(name) or (_Any(), _Any())

    class Norm(_Any):
        def rms_norm(self, *a, **k):
            calls.append("norm.rms_norm")
            return _Any()

        def add_rms_norm(self, *a, **k):
            calls.append("norm.rms_norm")
            return _Any(), _Any()

    kn = layers.Kernels(*([_Any()] * 2), Norm(), *([_Any()] * 4), Stock(), _Any())
    br = modes.branches(mode, "mtp")
    by = {op.name: op for op in mode_ops.leaves(mode_ops.stock_ops(kn, "mtp", br))}
    st = {k: _Any() for k in ("h0", "o_out", "moe_out", "r1", "gu")}
    for name in ("input_layernorm", "post_attention_layernorm", "shared_head.norm", "situ_and_mul"):
        by[name].run(st, {k: _Any() for k in ("in_norm", "post_norm", "head_norm")})
    if br["small_ops"] == "native":
        assert calls == ["native_rms_norm", "native_add_rms_norm", "native_add_rms_norm", "compiled_situ_and_mul"]
    else:
        assert calls == ["norm.rms_norm"] * 3 + ["situ_and_mul"]


def test_the_figures_file_is_json_one_record_a_line() -> None:
    import json

    doc = {"mode": "h200-default", "steps": [{"M": 1, "stock_us": 1.5}, {"M": 2}], "per_op": [],
           "ops": {"kda/stock": [["router_gate", "gate_linear.py:183", "ll_bf16"]]}, "stand_ins": [{"M": 1}]}  # fmt: skip
    text = replay._compact(doc)
    assert json.loads(text) == doc
    assert '  {"M":1,"stock_us":1.5},\n  {"M":2}\n' in text


# stock op -> the stand-in row of standins.py that times it against the closest real kernel
STAND_IN_ROW = {"input_layernorm": "rms_norm", "routed_expert_norm": "rms_norm",
                "post_attention_layernorm": "add_rms_norm", "shared_head.norm": "add_rms_norm",
                "situ_and_mul": "situ_and_mul"}  # fmt: skip


@pytest.mark.parametrize("mode", REPLAYED)
def test_every_stand_in_is_named_and_timed_against_the_closest_kernel(mode) -> None:
    from k3lab.decode_step import standins

    rows = {r[0] for r in standins.rows(pytest.importorskip("torch"), _kn())}
    for layer in modes.LAYERS:
        for op in mode_ops.leaves(mode_ops.stock_ops(_kn(), layer, modes.branches(mode, layer))):
            if "stand-in" in op.runs:
                assert STAND_IN_ROW.get(op.name) in rows, (mode, layer, op.name, op.runs)
            assert op.name != "gate_sigmoid_mul" or "torch.compile" in op.runs  # the real kernel runs


@pytest.mark.parametrize("layer", ["kda", "mla"])
@pytest.mark.parametrize("answer", ["ours", None])
def test_patched_attn_res_sites_take_try_attn_res_or_the_modes_stock_op(layer, answer) -> None:
    """Patch 0010: both attn-res sites call ``fused.try_attn_res`` with v0.28.0's arguments
    (the replay's NB, no block write) and record ``_via``; None runs the stock op."""
    seen = []

    class Fused(_Any):
        def try_attn_res(self, *args):
            seen.append(args)
            return answer

    pk = _Pk()
    pk.fused = Fused()
    br = modes.branches(REPLAYED[0], layer)
    ops = {op.name: op for op in mode_ops.leaves(mode_ops.patched_ops(pk, _kn(), layer, br))}
    stock = {op.name: op for op in mode_ops.leaves(mode_ops.stock_ops(_kn(), layer, br))}
    for which, out in (("pre", "hn"), ("post", "hn2")):
        name = f"attn_res ({which}-attn)"
        assert ops[name] is not stock[name] and ops[name].covers == (name,)
        st = {"prefix": "P", "delta_in": "D", "o_out": "O", "blocks": "B"}
        w = {k: k for k in ("sa_res_norm", "sa_res_proj", "in_norm", "mlp_res_norm", "mlp_res_proj",
                            "post_norm")}  # fmt: skip
        ops[name].run(st, w)
        assert seen[-1][:3] == ("P", "D" if which == "pre" else "O", "B")
        assert seen[-1][6:8] == (layers.NB, -1)
        assert st["_via"][name] == ("patched" if answer else "stock")
        # the stock op (its kernels stand-ins here) writes a stand-in, ours the answer
        assert st[out] == "ours" if answer else isinstance(st[out], _Any)


@pytest.mark.parametrize("mode", REPLAYED)
@pytest.mark.parametrize("paths", [(), ("moe_front", "moe_tail")])
def test_the_routed_experts_stand_in_runs_beside_the_shared_experts_in_both_variants(mode, paths) -> None:
    """--routed-experts standin: the same op on the main arm of the shared experts' fork in
    stock and patched (so the aux stream's work overlaps it as in the model); off: no main arm."""
    for routed, want in (("standin", ("routed experts (stand-in)",)), ("none", ())):
        got = {}
        for variant, ops in mode_ops.lists(_kn(), _Pk(paths), "kda", mode, routed).items():
            forks = [op.run.arms for op in ops if "shared experts" in op.name]
            assert len(forks) == 1, variant
            got[variant] = tuple(o.name for o in forks[0][0])
            if routed == "standin" and variant == "stock":  # the roof counts its bytes
                assert mode_ops.roof_bytes(ops, 1) > mode_ops.roof_bytes(mode_ops.lists(
                    _kn(), _Pk(paths), "kda", mode)[variant], 1)  # fmt: skip
        assert got == {"stock": want, "patched": want}


def test_drop_paths_keeps_a_listed_path_off_in_one_mode_only() -> None:
    fused = type("F", (), {})()
    fused.PATHS = ("moe_front", "moe_tail")
    fused.MODES_BY_CAPABILITY = {(9, 0): {"moe_front": {("fused_moe", "breakable"): "run", ("mega_moe", "full"): "r2"},
                                          "moe_tail": {("fused_moe", "breakable"): "run"}}}  # fmt: skip
    replay.drop_paths_here(fused, ["moe_front"], "fused_moe", "breakable")
    assert fused.MODES_BY_CAPABILITY[(9, 0)] == {"moe_front": {("mega_moe", "full"): "r2"},
                                                  "moe_tail": {("fused_moe", "breakable"): "run"}}
    with pytest.raises(ValueError, match="moe_middle"):
        replay.drop_paths_here(fused, ["moe_middle"], "fused_moe", "breakable")


def test_each_graph_size_is_timed_once_and_per_op_wherever_a_per_op_count_pads_to_it() -> None:
    # --m 1-16 --per-op-m 1,8,16 in the default mode: M = 5 reaches size 8 and M = 9 size 16
    # before 8 and 16 themselves; their ops are timed one by one all the same
    br = modes.branches("h200-default", "kda")
    assert replay.timed_sizes(list(range(1, 17)), [1, 8, 16], br) == {1: True, 2: False, 4: False, 8: True, 16: True}
    assert replay.timed_sizes([3], [3], br) == {4: True}
    exact = modes.branches("h200-piecewise", "kda") | {"tokens": "exact"}
    assert list(replay.timed_sizes([1, 3, 5], [5], exact)) == [1, 3, 5]


def test_run_layer_times_each_graph_size_once_and_gives_every_m_its_record(monkeypatch) -> None:
    """The layer loop on the CPU with its GPU parts stood in: one timing per graph size, per-op
    figures at every size a --per-op-m count pads to, and a record per requested M."""
    import types

    import torch

    timed = []
    fake = types.SimpleNamespace(Generator=lambda device=None: types.SimpleNamespace(manual_seed=lambda s: None),
                                 cuda=types.SimpleNamespace(synchronize=lambda: None, empty_cache=lambda: None))

    def op(st, w):
        st["moe_out"] = st["m"]

    monkeypatch.setattr(layers, "weights", lambda *a, **k: {})
    monkeypatch.setattr(layers, "inputs", lambda layer, m, dev, gen: {"m": torch.tensor([float(m)])})
    monkeypatch.setattr(mode_ops, "lists", lambda *a: {v: [layers.Op("a", "x.py:1", op, "r", lambda m: 100 * m)]
                                                       for v in ("stock", "patched")})  # fmt: skip
    monkeypatch.setattr(replay, "_step_us", lambda torch, ops, ws, st, reps: timed.append(st["m"].item())
                        or (10.0, 1, dict(st, moe_out=st["m"] + 1)))  # fmt: skip
    monkeypatch.setattr(replay.timing, "graph_replay_us", lambda *a: 1.0)
    steps, per_op, _ = replay.run_layer(fake, None, None, "kda", "h200-default", list(range(1, 17)), [1, 8, 16],
                                        2, 3, 1e12)  # fmt: skip
    assert timed == [1, 1, 2, 2, 4, 4, 8, 8, 16, 16], "each size once, both variants"
    assert [s["M"] for s in steps] == list(range(1, 17))
    assert [s["M_run"] for s in steps] == [1, 2, 4, 4, *[8] * 4, *[16] * 8]
    assert sorted({p["M"] for p in per_op}) == [1, 8, 16] and len(per_op) == 6
    assert all(s["layer"] == "kda" and s["speedup_patched"] == 1.0 for s in steps)


def test_a_tree_without_the_mla_front_path_keeps_v0_28_0_s_front() -> None:
    # an overlay before patch 0013: path_enabled would refuse "mla_front" as a typo
    pk = _Pk(("moe_front",), known=("moe_front", "moe_tail"))
    for mode in REPLAYED:
        ops = mode_ops.patched_ops(pk, _kn(), "mla", modes.branches(mode, "mla"))
        names = [o.name for o in mode_ops.leaves(ops)]
        assert "fused_qkv_a_proj+g_proj" not in names and "fused_qkv_a_proj" in names


def test_measure_paths_lists_the_mla_front_on_its_own_branch() -> None:
    fused = type("F", (), {})()
    fused.PATHS = ("moe_front", "moe_tail", "mla_front")
    fused.MODES_BY_CAPABILITY = {(9, 0): {"moe_tail": {("fused_moe", "breakable"): "run"}}}
    for path in ("mla_front", "moe_front"):
        replay.measure_paths_here(fused, [path], mode_ops.path_branch(path, "fused_moe"), "breakable")
    got = fused.MODES_BY_CAPABILITY[(9, 0)]
    assert set(got["mla_front"]) == {("mla", "breakable")}
    assert set(got["moe_front"]) == {("fused_moe", "breakable")}
