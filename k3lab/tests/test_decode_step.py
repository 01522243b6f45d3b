"""The decode-step replay's bookkeeping, on the CPU (k3lab/decode_step; the timing itself needs a GPU)."""

from __future__ import annotations

import pytest

from k3lab.decode_step import layers, patched, replay


class _Any:
    """Stand-in for every kernel module: the op lists only take references at build time."""

    def __getattr__(self, name):
        return self

    def __call__(self, *a, **k):
        return self


def _ops(layer):
    return layers.LAYERS[layer](layers.Kernels(*([_Any()] * 9)))


@pytest.mark.parametrize("layer", sorted(layers.LAYERS))
def test_ours_covers_every_stock_op_and_nothing_else(layer) -> None:
    stock, ours = _ops(layer)
    names = [op.name for op in stock]
    assert len(names) == len(set(names)), "stock op names must be unique"
    covered = [c for op in ours for c in op.covers]
    assert set(covered) == set(names), set(covered) ^ set(names)
    for op in stock:
        assert op.where.startswith(("nvidia/", "common/")) and ":" in op.where, op
        assert op.nbytes(1) > 0 and op.nbytes(16) > op.nbytes(1), op.name


def test_roof_bytes_are_dominated_by_the_weights() -> None:
    # M = 16: the activations are a few MB next to 200-450 MB of weights.
    for layer in layers.LAYERS:
        stock, _ = _ops(layer)
        weight_bytes = sum(2 * s[0] * s[1] for s in layers.WEIGHTS[layer].values() if len(s) == 2)
        total = sum(op.nbytes(16) for op in stock)
        assert weight_bytes < total < 1.05 * weight_bytes, layer


@pytest.mark.parametrize("text,want", [("1-4", [1, 2, 3, 4]), ("1,8,16", [1, 8, 16]), ("3", [3])])
def test_token_counts_parse(text, want) -> None:
    assert replay.parse_ms(text) == want


@pytest.mark.parametrize("text", ["0-4", "15-17", "x"])
def test_token_counts_outside_decode_are_refused(text) -> None:
    with pytest.raises(ValueError):
        replay.parse_ms(text)


def test_bad_layer_name_exits_2(capsys) -> None:
    assert replay.main(["--stock-dir", ".", "--layers", "mtp,dense"]) == 2
    assert "--layers" in capsys.readouterr().err


def test_a_layer_the_mode_does_not_run_is_one_line_with_its_own_exit_code(capsys) -> None:
    from k3lab.decode_step import modes

    assert replay.main(["--stock-dir", ".", "--layers", "mtp"]) == modes.NOT_RUN  # h200-default: no drafting
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "runs no mtp layer" in err and "h200-mtp" in err


def test_a_token_count_no_step_of_the_mode_has_exits_2(capsys) -> None:
    assert replay.main(["--stock-dir", ".", "--mode", "h200-mtp", "--m", "2-5"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "3 tokens" in err and "requests x 2" in err


@pytest.mark.parametrize("mode,m,per_op,want", [
    ("h200-default", "", "", (list(range(1, 17)), [1, 8, 16])),
    ("h200-mtp", "", "", (list(range(2, 17, 2)), [2, 8, 16])),
    ("h200-mtp", "2-4", "", ([2, 3, 4], None)),
    ("h200-default", "1-4", "", ([1, 2, 3, 4], [1])),
])  # fmt: skip
def test_the_replay_takes_the_token_counts_of_the_modes_steps(mode, m, per_op, want) -> None:
    from k3lab.decode_step import modes

    names = modes.layers_run(mode)
    if want[1] is None:
        with pytest.raises(ValueError):
            replay.step_counts(mode, names, m, per_op)
    else:
        assert replay.step_counts(mode, names, m, per_op) == want


@pytest.mark.parametrize("layer", sorted(patched.LAYERS))
def test_patched_covers_every_stock_op_once_in_stock_order(layer) -> None:
    # The patched variant replays v0.28.0's order call site by call site: each stock op is
    # covered by exactly one patched op, and the covering ops come in the stock order.
    stock, _ = _ops(layer)
    ops = patched.LAYERS[layer](_Any(), layers.Kernels(*([_Any()] * 9)))
    covered = [c for op in ops for c in (op.covers or (op.name,))]
    names = [op.name for op in stock]
    assert sorted(covered) == sorted(names), set(covered) ^ set(names)
    assert covered == names


def test_patched_via_marks_fallbacks(monkeypatch) -> None:
    # A try_* entry that answers None is recorded as the stock path, one that answers as ours.
    import torch

    state: dict = {"gu": torch.ones(2, 8)}

    class Fused:
        def __init__(self, answer):
            self.answer = answer

        def try_act_mul(self, gate_up, situ_beta=None):
            return self.answer

    class Kn:
        class stock:
            @staticmethod
            def situ_and_mul(gu, beta):
                return gu[:, :4] * 0

    for answer, want in ((None, "stock"), (torch.full((2, 4), 7.0), "patched")):
        pk = type("Pk", (), {"fused": Fused(answer), "llg": _Any()})()
        situ = next(
            op for op in patched._moe(pk, Kn, "hn2", {"router_gate": _Any()}) if op.name == "situ_and_mul"
        )
        situ.run(state, {})
        assert state["_via"]["situ_and_mul"] == want
        assert float(state["act"].sum()) == (0.0 if answer is None else 56.0)


class _Recorder:
    def __init__(self, name, calls):
        self.name, self.calls = name, calls

    def attn_res(self, *a, **k):  # v0.28.0's module
        self.calls.append((self.name, a, k))
        return self.name

    def __call__(self, *a, **k):  # replay.py's wrapper of ours
        self.calls.append((self.name, a, k))
        return self.name


@pytest.mark.parametrize("layer", ["kda", "mla"])
def test_attn_res_switch_routes_ours_only_and_keeps_stock_on_v028(layer) -> None:
    calls = []
    v028, mine = _Recorder("v028", calls), _Recorder("mine", calls)
    for ours_fn, want in ((None, "v028"), (mine, "mine")):
        kn = layers.Kernels(*([_Any()] * 4), v028, *([_Any()] * 4), attn_res_ours=ours_fn)
        stock, ours = layers.LAYERS[layer](kn)
        st = {k: k for k in ("prefix", "delta_in", "o_out", "blocks")}
        w = {k: k for k in layers.RES_W}
        for variant, ops, expect in (("stock", stock, "v028"), ("ours", ours, want)):
            calls.clear()
            for op in (o for o in ops if o.name.startswith("attn_res")):
                op.run(st, w)
            assert [c[0] for c in calls] == [expect, expect], (variant, ours_fn)
            assert st["hn"] == expect and st["hn2"] == expect
            if expect == "mine":  # num_blocks, eps, output-norm eps follow the six tensors
                assert calls[0][1] == ("prefix", "delta_in", "blocks", "sa_res_norm", "sa_res_proj",
                                       "in_norm", layers.NB, layers.EPS, layers.EPS)  # fmt: skip
            else:
                assert calls[1][2]["num_blocks"] == layers.NB and calls[1][2]["block_write_idx"] == -1
def test_every_stacked_weight_has_a_config_and_the_gate_rows_come_first() -> None:
    import json

    configs = json.loads((replay.HERE / "configs.json").read_text())["configs"]
    for cat, parts in layers.CONCAT.items():
        shapes = [layers.WEIGHTS["mla"].get(p) or layers.WEIGHTS["kda"][p] for p in parts]
        assert len({s[1] for s in shapes}) == 1, f"{cat}: parts of different K"
        assert f"{sum(s[0] for s in shapes)}x{shapes[0][1]}" in configs, cat
    # gemm_split_dtype writes the first NE columns as fp32: the router gate must lead
    assert layers.CONCAT["gate_down_sgu"][0] == "gate"


def test_gate_stack_bench_candidates_fit_the_stacked_shape() -> None:
    import subprocess
    import sys

    from k3lab.decode_step import gate_stack_bench as gsb

    n = gsb.NE + gsb.REST
    assert n == layers.NE + layers.LAT + 2 * layers.SI
    # In a subprocess: the stand-in vllm package must not leak into this test session.
    code = (
        "from k3lab.decode_step import imports, gate_stack_bench as g; "
        "s = imports.overlay('swap_ab_gemm'); "
        "print([c for c in g.CANDIDATES if s.config_error(s.SwapAbConfig(*c), g.NE + g.REST, g.K)])"
    )
    proc = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, cwd=replay.HERE.parents[1], timeout=120
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.strip() == "[]", f"candidates swap_ab_gemm.config_error refuses: {proc.stdout}"


def test_the_benchmarks_json_header_names_gpu_date_and_versions(monkeypatch) -> None:
    import platform

    import torch
    import triton

    from k3lab import provenance

    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *a: "NVIDIA H200")
    env = provenance.environment()
    assert list(env) == ["date", "gpu", "torch", "triton", "cuda", "python"]
    assert env["gpu"] == "NVIDIA H200" and env["triton"] == triton.__version__
    assert env["torch"] == torch.__version__ and env["python"] == platform.python_version()
    assert len(env["date"]) == 10 and env["date"][4] == "-"


def test_pristine_holds_v028s_copy_of_every_file_the_series_modifies(tmp_path) -> None:
    """The model check lays these over the bundle's patched tree: one left out would run
    patched code as v0.28.0's."""
    from k3lab.decode_step import imports

    tree = tmp_path / "release"
    wanted = imports.patched_paths()
    assert "vllm/models/kimi_k3/nvidia/model.py" in wanted
    for i, rel in enumerate(wanted):
        (tree / rel).parent.mkdir(parents=True, exist_ok=True)
        (tree / rel).write_text(f"v0.28.0 copy {i}\n")
    (tree / "PKG-INFO").write_text("Metadata-Version: 2.4\nName: vllm\nVersion: 0.28.0\n")
    imports.extract_pristine(tmp_path / "out", None, tree)
    written = sorted(str(p.relative_to(tmp_path / "out")) for p in (tmp_path / "out").rglob("*") if p.is_file())
    assert written == wanted
    assert (tmp_path / "out" / wanted[-1]).read_text() == f"v0.28.0 copy {len(wanted) - 1}\n"
    series = (imports.ROOT / "patches" / "series").read_text().split()
    touched = {line.split()[2][2:] for name in series
               for line in (imports.ROOT / "patches" / name).read_text().splitlines()
               if line.startswith("diff --git a/")}  # fmt: skip
    assert touched == set(wanted)


def test_pristine_from_a_patched_checkout_is_v028s_copy_not_its_files(tmp_path) -> None:
    """README command 1 leaves work/vllm: a v0.28.0 checkout whose files are patched. Read as
    files, the model check would lay the patched model over the patched model."""
    import subprocess

    from k3lab.decode_step import imports

    tree, wanted = tmp_path / "vllm", imports.patched_paths()
    for rel in wanted:
        (tree / rel).parent.mkdir(parents=True, exist_ok=True)
        (tree / rel).write_text(f"v0.28.0's own {rel}\n")
    git = ["git", "-C", str(tree)]
    subprocess.run([*git, "init", "-q"], check=True)
    subprocess.run([*git, "add", "-A"], check=True)
    subprocess.run([*git, "commit", "-qm", "release"], check=True)
    subprocess.run([*git, "tag", imports.REF], check=True)
    for rel in wanted:
        (tree / rel).write_text("patched by the series\n")
    assert imports.main(["pristine", str(tmp_path / "out"), "--tree", str(tree)]) == 0
    assert [(tmp_path / "out" / rel).read_text() for rel in wanted] == [f"v0.28.0's own {rel}\n" for rel in wanted]


@pytest.mark.parametrize("pkg_info", [None, "Name: vllm\nVersion: 0.29.0\n"])
def test_pristine_refuses_a_tree_that_is_neither_git_nor_v028s_sdist(tmp_path, capsys, pkg_info) -> None:
    from k3lab.decode_step import imports

    tree, rel = tmp_path / "vllm", imports.patched_paths()[0]
    (tree / rel).parent.mkdir(parents=True)
    (tree / rel).write_text("whose?\n")
    if pkg_info:
        (tree / "PKG-INFO").write_text(pkg_info)
    assert imports.main(["pristine", str(tmp_path / "out"), "--tree", str(tree)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "neither a git checkout" in err[0], err
    assert not (tmp_path / "out").exists()


def test_measure_paths_lets_only_the_named_paths_run_in_this_mode() -> None:
    from types import MappingProxyType, SimpleNamespace

    from k3lab.decode_step import replay

    measured = MappingProxyType({"moe_front": {("fused_moe", "breakable"): "run A"},
                                 "moe_tail": {("fused_moe", "breakable"): "run B"}})
    fused = SimpleNamespace(PATHS=("moe_front", "moe_tail"), MODES_BY_CAPABILITY={(9, 0): measured})
    replay.measure_paths_here(fused, ["moe_tail"], "fused_moe", "full")
    now = fused.MODES_BY_CAPABILITY[(9, 0)]
    assert ("fused_moe", "full") in now["moe_tail"] and ("fused_moe", "breakable") in now["moe_tail"]
    assert ("fused_moe", "full") not in now["moe_front"]
    assert ("fused_moe", "full") not in measured["moe_tail"]  # the tree's data is left as it was
    with pytest.raises(ValueError, match="moe_middle"):
        replay.measure_paths_here(fused, ["moe_middle"], "fused_moe", "full")


def _bench_rows(us: dict) -> list[dict]:
    """attn_res_bench rows: ``us[(kind, warps)] = [µs at M 1, 2]``."""
    rows = []
    for (kind, warps), times in us.items():
        opts = {} if kind == "v028" else (
            dict(variant="loop", chunk=1024, num_warps=warps, num_stages=4) if kind == "loop"
            else dict(cluster=warps) if kind in ("cluster", "floor")
            else dict(num_warps=warps, block_s=None, reload=True))  # fmt: skip
        rows += [{"M": m, "kind": kind, "opts": opts, "us": t, "rel_err": 4e-3, "prefix_equal": True}
                 for m, t in zip((1, 2), times)]  # fmt: skip
    return rows


def test_attn_res_apply_best_writes_the_fastest_winner_or_turns_ours_off(tmp_path) -> None:
    from k3lab.decode_step import attn_res_bench as bench

    table = tmp_path / "t.py"
    row = '        (7168,): ("pdl_attn_res", None, DECODE),\n'
    table.write_text('X = {\n    "attn_res": {\n' + row + "    },\n}\n")
    rows = _bench_rows({("v028", 0): [7.6, 7.7], ("ours", 16): [3.0, 7.9], ("loop", 8): [3.5, 3.6],
                        ("loop", 4): [2.9, 4.5]})
    done = bench.apply_best(rows, [1, 2], table)
    assert done["config"] == ["loop", 8, 1024, 4]  # ours 16 lost at M = 2; loop 8 sums below loop 4
    assert '("pdl_attn_res", (\'loop\', 8, 1024, 4), DECODE)' in table.read_text()
    rows = _bench_rows({("v028", 0): [3.0, 3.0], ("ours", 16): [3.1, 2.0]})
    assert bench.apply_best(rows, [1, 2], table)["config"] is None
    assert table.read_text().count("# (7168,)") == 1 and "lost to v0.28.0" in table.read_text()
    with pytest.raises(ValueError, match="no attn_res row"):
        bench.apply_best(rows, [1, 2], table)
    table.write_text('X = {\n    "attn_res": {\n' + row + "    },\n}\n")
    rows = _bench_rows({("v028", 0): [7.7, 7.8], ("ours", 8): [5.8, 5.9], ("cluster", 8): [3.0, 3.1],
                        ("cluster", 4): [3.4, 3.4]})  # fmt: skip
    assert bench.apply_best(rows, [1, 2], table)["config"] == ["cluster", 8]
    assert '("pdl_attn_res", (\'cluster\', 8), DECODE)' in table.read_text()
    rows += _bench_rows({("floor", 8): [1.0, 1.0]})  # not attn-res: never a winner
    assert bench.choose(rows, [1, 2])["kind"] == "cluster"


def test_attn_res_row_pattern_matches_the_shipped_table() -> None:
    from k3lab.decode_step import attn_res_bench as bench

    assert len(bench.ROW.findall(bench.TABLE.read_text())) == 1


def test_the_model_checks_c_stand_ins_return_nothing_as_their_schemas_say(monkeypatch) -> None:
    """A ``-> ()`` op whose impl returns a tensor fails at call time in torch (the breakable
    mode's model check on the H200, 2026-12-04)."""
    from k3lab.decode_step import model_check, stock

    seen = []
    monkeypatch.setattr(stock, "situ_and_mul", lambda x, beta, out=None: seen.append((x, beta, out)) or out)
    assert model_check._situ_and_mul_out("out", "x", 1.0, 0.5) is None
    assert seen == [("x", 1.0, "out")]


def test_attn_res_bench_times_by_default_the_kernel_the_table_routes_to() -> None:
    """A run with no --kinds timed only the tile kernel (H100, 2026-12-05), while the SM90
    fused table routes attn-res to the cluster kernel."""
    import runpy

    from k3lab.decode_step import attn_res_bench, imports

    table = runpy.run_path(str(imports.OVERLAY_PKG / "low_latency_fused_sm90.py"))["FUSED_SM90"]
    kinds = {row[1][0] for row in table["attn_res"].values()}
    assert kinds and kinds <= set(attn_res_bench.DEFAULT_KINDS) <= set(attn_res_bench.OURS)
