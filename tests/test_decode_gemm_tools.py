"""CPU checks of issue 12's GPU tooling (ci/gpu/decode_gemm): configs, winners, table.

Everything here is pure: the swap-AB configs the sweep may time, the rule that picks
a row's backend from a figures run, the pruning order of CuTe rows, and that a table
rendered from a figures run with every backend is a valid data module. Expectations
are hand-built rows, not the functions' own output.
"""

from __future__ import annotations

import json
import math
import sys

import pytest

from k3overlay.project import ROOT

sys.path.insert(0, str(ROOT / "ci" / "gpu"))
sys.path.insert(0, str(ROOT / "ci" / "gpu" / "decode_gemm"))

import render_table  # noqa: E402
import shapes  # noqa: E402
import tiles  # noqa: E402
import winners  # noqa: E402

SWEEP = ROOT / "ci" / "gpu" / "results" / "swap_ab_sweep_sm90.json"


@pytest.mark.parametrize("n, k", list(shapes.SHAPES))
def test_every_candidate_gives_each_split_k_tiles(n, k):
    cands = tiles.candidates(n, k)
    assert cands
    for bn, bk, split, warps, stages in cands:
        n_k_tiles = math.ceil(k / bk)
        per = math.ceil(n_k_tiles / split)
        assert math.ceil(n_k_tiles / per) == split  # no split without K tiles
        assert split == 1 or math.ceil(n / bn) * split <= tiles.MAX_GRID
        assert bn in (16, 32, 64, 128) and bk & (bk - 1) == 0 and k % 8 == 0


def test_splits_aim_at_whole_waves():
    # 1536 rows in 64-row tiles = 24 tiles; 28 K tiles of 256. Nearest reachable grids
    # to 132 / 264 / 396 / 528 CTAs: 5 (120; 6 ties at 144, the smaller wins),
    # 10 (240), 14 (336), 28 (672).
    assert tiles.reachable_splits(7168, 256) == [1, 2, 3, 4, 5, 6, 7, 10, 14, 28]
    assert tiles.splits_for(1536, 7168, 64, 256) == [1, 5, 10, 14, 28]
    assert tiles.splits_for(40960, 7168, 64, 256) == [1]


def test_seeded_keeps_the_seeds_first_and_adds_new_tiles_once():
    got = tiles.seeded(768, 128, [[64, 128, 1, 4, 6], (64, 128, 1, 4, 6)])
    assert got[0] == (64, 128, 1, 4, 6) and got.count((64, 128, 1, 4, 6)) == 1
    assert {c[0] for c in got[1:]} == {16}


def _row(cublas, cands, n=64, k=256, m=1, roof=1.0):
    return {"N": n, "K": k, "M": m, "weight_bytes": 2 * n * k, "roof_us": roof,
            "cublas_us": list(cublas), "candidates": [
                {"backend": b, "cfg": c, "us": list(us), "status": "ok"} for b, c, us in cands]}


def test_winner_needs_five_percent_in_both_passes():
    # swap_ab wins pass 1 by 25% but pass 2 by only 4%: it must not win.
    row = _row((10.0, 10.0), [("swap_ab", [64, 128, 1, 4, 6], (8.0, 9.62)),
                              ("cute", [32, 2, 1, 8, None], (9.0, 9.0))])
    w = winners.winner(row)
    assert w["backend"] == "cute" and w["speedup"] == [1.1111, 1.1111]


def test_winner_is_the_lowest_mean_normalised_time():
    row = _row((10.0, 20.0), [("swap_ab", [64, 128, 1, 4, 6], (5.0, 12.0)),  # 0.5, 0.6
                              ("tinygemm", None, (6.0, 10.0))])  # 0.6, 0.5 -> tie: name order
    assert winners.winner(row)["backend"] == "swap_ab"
    row["candidates"][1]["us"] = [5.0, 10.0]  # 0.5, 0.5: now strictly better
    assert winners.winner(row)["backend"] == "tinygemm"


def test_no_winner_without_two_timed_passes_or_with_a_wrong_result():
    assert winners.winner(_row((10.0, 10.0), [("swap_ab", [1], (5.0, None))])) is None
    row = _row((10.0, 10.0), [("swap_ab", [1], (5.0, 5.0))])
    row["candidates"][0]["status"] = "wrong"
    assert winners.winner(row) is None


def test_decide_summarises_the_targets():
    run = {"trivial_us": {"pdl=False": 1.0, "pdl=True": 0.8}, "rows": [
        _row((10.0, 10.0), [("swap_ab", [64, 128, 1, 4, 6], (5.0, 5.0))],
             n=4096, k=4096, roof=4.6),  # 33.5 MB, 92% of roof
        _row((10.0, 10.0), [("swap_ab", [64, 128, 1, 4, 6], (9.9, 9.9))],
             n=4096, k=4096, m=2, roof=4.6),  # not 5% faster: cuBLAS, 46%
        _row((2.0, 2.0), [("cute", [32, 2, 1, 4, None], (0.9, 0.9))], n=64, k=128, roof=0.1),
    ]}
    s = winners.decide(run)["summary"]
    assert s["ge20MB_rows"] == 2 and s["ge20MB_at_90pct_roof"] == 1
    assert s["ge20MB_below_90pct"] == [[4096, 4096, 2, 0.46]]
    assert s["routed_by_backend"] == {"cute": 1, "swap_ab": 1}
    assert s["lt8MB_rows"] == 1 and s["lt8MB_within_1p2_of_trivial"] == 1
    assert s["geomean_vs_cublas_all_rows"] == pytest.approx((2 * 1 * (2 / 0.9)) ** (1 / 3), 1e-3)


def test_cute_queue_ranks_by_scaled_time_and_drops_hopeless_rows():
    table = {(64, 256): {1: ("cute", (32, 2, 1, 8, None)), 2: ("cute", (32, 2, 1, 8, None))}}
    tune = {"rows": [
        {"N": 64, "K": 256, "M": 1, "cublas_us": [0, 10.0], "winner": {"us": [0, 5.0]}},
        {"N": 64, "K": 256, "M": 2, "cublas_us": [0, 10.0], "winner": {"us": [0, 8.0]}},
    ]}
    # Our run's cuBLAS is 20 (2x): CuTe scales to 10 and 16 against ours at 12 and 12.
    sweep = {"shapes": [{"N": 64, "K": 256, "per_m": [
        {"M": 1, "us": 12.0, "cublas_us": 20.0}, {"M": 2, "us": 12.0, "cublas_us": 20.0}]}]}
    assert winners.cute_queue(table, tune, sweep) == [(64, 256, 1, (32, 2, 1, 8, None), 0.8333)]


def test_table_rendered_from_a_figures_run_names_every_backend():
    run = {"provenance": {"gpu": "NVIDIA H200", "capability": "9.0", "date": "2026-11-30",
                          "torch": "2.11.0", "cutlass_dsl": "4.6.2", "run_id": "r1",
                          "tool": "ci/gpu/decode_gemm/figures.py"},
           "criteria": {"win_both_passes": 1.05}, "trivial_us": {"pdl=True": 1.0}, "rows": [
               dict(_row((10, 10), [("swap_ab", [64, 128, 2, 4, 6], (5, 5))]), M=1),
               dict(_row((10, 10), [("ll_bf16", ["splitk", 2, 4], (5, 5))]), M=2),
               dict(_row((10, 10), [("tinygemm", None, (5, 5))]), M=3),
               dict(_row((10, 10), [("cute", [32, 2, 1, 8, None], (5, 5))]), M=4)]}
    winners.decide(run)
    text = render_table.render(run, "ci/gpu/results/decode_gemm_sm90.json")
    ns: dict = {}
    exec(compile(text, "table", "exec"), ns)  # a data-only module
    assert ns["ROWS"] == {(64, 256): {
        1: ("swap_ab", (64, 128, 2, 4, 6)), 2: ("ll_bf16", ("splitk", 2, 4)),
        3: ("tinygemm", None), 4: ("cute", (32, 2, 1, 8, None))}}
    assert ns["PROVENANCE"]["source"].startswith("ci/gpu/decode_gemm/figures.py run r1")


def test_committed_sweep_is_one_run_with_its_baselines():
    run = json.loads(SWEEP.read_text())
    p = run["provenance"]
    assert p["gpu"] == "NVIDIA H200" and p["date"] and p["triton"] and p["torch"]
    assert run["read_bw_TBps"] > 3 and min(run["trivial_us"].values()) > 0
    # Every SM90 shape known at the run; the KDA row views were added to the list later.
    swept = {(s["N"], s["K"]) for s in run["shapes"]}
    assert swept == set(shapes.SHAPES) - set(shapes.KDA_SHAPES)
    for s in run["shapes"]:
        assert [p["M"] for p in s["per_m"]] == list(shapes.M_RANGE)
        for p in s["per_m"]:
            # Every figure next to its baseline and roof, and checked against float64.
            assert p["cublas_us"] > 0 and p["us"] > 0 and p["roof_us"] > 0
            assert p["status"] == "ok" and p["relerr"] < 1e-2
    assert all(e < 1e-2 for e in run["chain_relerr"])
