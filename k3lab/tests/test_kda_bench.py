"""CPU checks of the KDA GPU tooling (k3lab/bench/kda.py) and of the figures it committed.

The benchmark itself runs on the device (k3lab/device/kda.sh); these check its pure
parts on hand-built cases, the render of a shape-restricted tuner run, and that the
overlay's SM90 set of token counts is exactly what the committed run measured.
"""

from __future__ import annotations

import ast
import json

import pytest

from k3overlay.project import ROOT


from k3lab.bench import kda_report as report
from k3lab import render_table

BENCH = ROOT / "results" / "kda" / "kda_bench_sm90.json"
KDA_MODULE = ROOT / "overlay" / "vllm" / "models" / "kimi_k3" / "nvidia" / "kda_projection.py"


# ------------------------------------------------------------------ pure parts


def test_bytes_moved_by_hand():
    weights = 2 * (6288 * 7168 + 1536 * 128)
    assert report.weights_bytes() == weights
    # M=1: x in (7168), packed out (6288), F_A in (128), F_B out (1536), 2 bytes each.
    assert report.bytes_moved("A", 1) == weights + 2 * (7168 + 6288 + 128 + 1536)
    assert report.bytes_moved("B", 3) == report.bytes_moved("A", 3)
    # (C) reads x twice and writes QKVG (6144) and F_A/beta (144) separately.
    assert report.bytes_moved("C", 1) == weights + 2 * (2 * 7168 + 6144 + 144 + 128 + 1536)
    assert report.bytes_moved("D", 2) == report.bytes_moved("C", 2)  # only the stream differs
    with pytest.raises(ValueError):
        report.bytes_moved("E", 1)


def test_roof_is_bytes_over_bandwidth_in_microseconds():
    assert report.roof_us(4_000_000, 4e12) == pytest.approx(1.0)


def _row(m, b, c):
    return {"M": m, "us": {"A": [30.0, 30.0], "B": b, "C": c}}


def test_overlap_runs_only_where_it_won_every_pass():
    rows = [
        _row(1, [23.5, 23.5], [23.5, 23.6]),  # tie, then a loss
        _row(2, [24.0, 24.0], [23.0, 24.1]),  # won one pass only
        _row(5, [28.0, 28.0], [25.0, 25.0]),
        _row(9, [28.0, 28.0], [30.0, 30.0]),
        _row(16, [29.0, 29.0], [27.5, 27.6]),
    ]
    assert report.overlap_tokens(rows) == [5, 16]
    assert report.overlap_tokens([]) == []


def _row4(m, b, c, d):
    return {"M": m, "us": {"A": [30.0, 30.0], "B": b, "C": c, "D": d}}


def test_policy_time_takes_the_overlap_only_where_it_won():
    rows = [_row4(1, [23.0, 23.0], [24.0, 24.0], [22.0, 22.5]),
            _row4(5, [28.0, 28.0], [25.0, 25.5], [27.0, 29.0])]
    # C: loses at 1 (B 23.0), wins at 5 (25.5); D: wins at 1 (22.5), loses a pass at 5 (B 28.0).
    assert report.policy_us(rows, "C") == pytest.approx(23.0 + 25.5)
    assert report.policy_us(rows, "D") == pytest.approx(22.5 + 28.0)


def test_derive_picks_the_high_priority_stream_only_when_it_is_faster():
    rows = [_row4(1, [23.0, 23.0], [24.0, 24.0], [22.0, 22.5]),
            _row4(5, [28.0, 28.0], [25.0, 25.5], [27.0, 29.0])]
    res = report.derive({"roof_weights_us": 20.0, "rows": rows})
    assert (res["overlap_variant"], res["high_priority_aux"]) == ("C", False)  # 48.5 < 50.5
    assert res["tokens_by_variant"] == {"C": [5], "D": [1]} and res["overlap_tokens"] == [5]
    assert res["c_over_roof_weights_m_le_2"] == [1.2]  # C's 24.0 at M1 over the 20 µs roof
    rows[1]["us"]["D"] = [24.0, 24.0]  # D now wins at 5 too: 22.5 + 24.0 < 48.5
    res = report.derive({"roof_weights_us": 20.0, "rows": rows})
    assert (res["overlap_variant"], res["high_priority_aux"]) == ("D", True)
    assert res["overlap_tokens"] == [1, 5] and res["c_over_roof_weights_m_le_2"] == [1.125]
    rows[1]["us"]["D"] = [25.0, 26.0]  # 22.5 + 26.0 ties 48.5: the model's stream stays
    assert report.derive({"roof_weights_us": 20.0, "rows": rows})["overlap_variant"] == "C"


def test_derive_checks_c_against_the_roof_at_m_le_2():
    res = {"roof_weights_us": 20.0, "rows": [_row(1, [25.0], [21.8]), _row(2, [25.0], [22.1])]}
    report.derive(res)
    assert res["c_over_roof_weights_m_le_2"] == [1.09, 1.105]
    assert res["c_within_10pct_of_roof_m_le_2"] is False
    res["rows"][1]["us"]["C"] = [21.9]
    assert report.derive(res)["c_within_10pct_of_roof_m_le_2"] is True


def _run(run_id, rows):
    prov = {"gpu": "NVIDIA H200", "capability": "9.0", "date": "2026-11-30",
            "torch": "2.11.0+cu130", "cutlass_dsl": "4.6.2", "run_id": run_id}
    return {"provenance": prov, "criteria": {"win_both_passes": 1.05}, "rows": [
        {"N": n, "K": k, "M": m, "status": "routed" if cfg else "cublas",
         "winner": {"backend": "cute", "cfg": cfg, "speedup": [1.2, 1.2]} if cfg else None}
        for n, k, m, cfg in rows]}


def test_an_added_run_owns_the_shapes_it_covers():
    first = _run("first", [(64, 128, 1, [32, 2, 1, 4, None]), (32, 128, 1, [32, 1, 1, 4, None])])
    later = _run("later", [(32, 128, 1, None), (32, 128, 2, [32, 2, 1, 4, None]), (16, 128, 1, None)])
    ns: dict = {}
    exec(render_table.render(first, "a.json", ((later, "b.json"),)), ns)
    # 32x128 is the later run's (M1 lost there, M2 won); 16x128 routed nothing.
    assert ns["ROWS"] == {(64, 128): {1: ("cute", (32, 2, 1, 4, None))},
                          (32, 128): {2: ("cute", (32, 2, 1, 4, None))}}
    assert set(ns["ROW_PROVENANCE"]) == {(32, 128)}
    assert ns["ROW_PROVENANCE"][(32, 128)]["run_id"] == "later"
    assert ns["PROVENANCE"]["run_id"] == "first"
    # Only the named shapes of a run: 64x128 keeps the first run's row.
    ns = {}
    exec(render_table.render(first, "a.json", ((later, "b.json", {(32, 128)}),)), ns)
    assert ns["ROWS"][(64, 128)] == {1: ("cute", (32, 2, 1, 4, None))}
    both = _run("both", [(64, 128, 1, [64, 1, 1, 4, None]), (32, 128, 1, [64, 1, 1, 4, None])])
    ns = {}
    exec(render_table.render(first, "a.json", ((both, "c.json", {(64, 128)}),)), ns)
    assert ns["ROWS"] == {(64, 128): {1: ("cute", (64, 1, 1, 4, None))},
                          (32, 128): {1: ("cute", (32, 1, 1, 4, None))}}
    assert set(ns["ROW_PROVENANCE"]) == {(64, 128)}
    # Without an added run the module has no ROW_PROVENANCE at all.
    ns = {}
    exec(render_table.render(first, "a.json"), ns)
    assert "ROW_PROVENANCE" not in ns


def test_a_row_says_which_run_each_of_its_token_counts_comes_from():
    cfg = [32, 2, 1, 4, None]
    first = _run("first", [(64, 128, m, cfg) for m in range(1, 9)])
    whole = _run("whole", [(64, 128, m, cfg) for m in range(1, 9)])
    some = {**_run("some", [(64, 128, m, cfg) for m in (1, 2)]), "covers": "rows"}
    more = {**_run("more", [(64, 128, m, cfg) for m in (5, 6)]), "covers": "rows"}
    ns: dict = {}
    exec(render_table.render(first, "a.json", ((some, "c.json"),)), ns)
    assert ns["ROW_PROVENANCE"][(64, 128)]["token_counts"] == "M 1..2 (other M: a.json)"
    ns = {}
    exec(render_table.render(first, "a.json", ((whole, "b.json"), (some, "c.json"), (more, "d.json"))), ns)
    src = ns["ROW_PROVENANCE"][(64, 128)]
    assert src["run_id"] == "more" and src["token_counts"] == "M 5..6 (M 1..2: c.json; other M: b.json)"
    # a later run of the whole shape takes every M again
    ns = {}
    exec(render_table.render(first, "a.json", ((some, "c.json"), (whole, "b.json"))), ns)
    assert ns["ROW_PROVENANCE"][(64, 128)]["run_id"] == "whole"
    assert "token_counts" not in ns["ROW_PROVENANCE"][(64, 128)]


# ------------------------------------------------------------ committed figures


def _module_constant(name: str):
    tree = ast.parse(KDA_MODULE.read_text())
    for node in tree.body:
        if isinstance(node, ast.Assign) and [t.id for t in node.targets] == [name]:
            return ast.literal_eval(node.value)
    raise AssertionError(f"{name} not found in {KDA_MODULE}")


def test_sm90_overlap_tokens_are_what_the_committed_run_measured():
    res = json.loads(BENCH.read_text())
    tokens = _module_constant("SM90_OVERLAP_TOKENS")
    # Exactly the M where the chosen overlap beat (B) in every pass, recomputed by hand.
    chosen = "D" if _module_constant("SM90_HIGH_PRIORITY_AUX") else "C"
    won = [r["M"] for r in res["rows"]
           if all(x < b for b, x in zip(r["us"]["B"], r["us"][chosen]))]
    assert list(tokens) == won == res["overlap_tokens"]
    assert (res["overlap_variant"], res["high_priority_aux"]) == (chosen, chosen == "D")
    source = _module_constant("SM90_OVERLAP_SOURCE")
    assert res["provenance"]["run_id"] in source and BENCH.name in source
    assert res["provenance"]["gpu"] in source and res["provenance"]["date"] in source


def test_committed_run_never_enables_the_overlap_where_it_was_slower():
    res = json.loads(BENCH.read_text())
    by_m = {r["M"]: r for r in res["rows"]}
    assert set(by_m) == set(range(1, 17))  # every decode size measured
    chosen = "D" if _module_constant("SM90_HIGH_PRIORITY_AUX") else "C"
    for m in _module_constant("SM90_OVERLAP_TOKENS"):
        b, c = by_m[m]["us"]["B"], by_m[m]["us"][chosen]
        assert len(b) == len(c) == 2 and all(ci < bi for bi, ci in zip(b, c))
    for r in res["rows"]:  # numerics were checked before timing
        assert max(r["relerr"].values()) <= 1e-2


def test_the_high_priority_stream_is_used_only_if_it_summed_lower():
    res = json.loads(BENCH.read_text())
    by_variant = {}
    for v in ("C", "D"):  # each overlap where it beat (B) in every pass, (B) elsewhere
        by_variant[v] = sum(
            r["us"][v][-1] if all(x < b for b, x in zip(r["us"]["B"], r["us"][v])) else r["us"]["B"][-1]
            for r in res["rows"])
    assert _module_constant("SM90_HIGH_PRIORITY_AUX") is (by_variant["D"] < by_variant["C"])


def test_committed_run_has_provenance_and_a_rotation_beyond_l2():
    res = json.loads(BENCH.read_text())
    assert {"gpu", "date", "torch", "cutlass_dsl", "run_id", "capability"} <= set(res["provenance"])
    assert "H200" in res["provenance"]["gpu"]
    assert res["read_bw_TBps"] > 1
    # The method string names the MiB rotated: > 4 x the H200's 60 MiB L2.
    mib = int(res["method"].split(" layer copies (")[1].split(" MiB")[0])
    assert mib > 4 * 60
