"""CPU checks of issue 12's GPU tooling (k3lab/bench/decode_gemm): configs, winners, table.

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


from k3lab import render_table
from k3lab import shapes
from k3lab import tiles
from k3lab.bench.decode_gemm import winners

SWEEP = ROOT / "results" / "sm90" / "swap_ab_sweep_sm90.json"


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


@pytest.mark.parametrize("n, k", list(shapes.SHAPES))
def test_ragged_configs_fill_the_sms_without_oversized_tiles(n, k):
    for bn, bk, split, warps, stages, rows in tiles.ragged(n, k):
        assert 1 <= rows < bn and (2 * rows > bn or bn == 16)
        assert split in tiles.reachable_splits(k, bk)
        # At most two CTAs per SM: ceil(n / rows) row groups of every split.
        assert math.ceil(n / rows) * split <= 2 * tiles.SMS


def test_ragged_spreads_7168_rows_over_131_ctas():
    # 7168 / 132 SMs = 54.3 rows: 55-row CTAs in 64-row tiles, 131 of them (112 in plain
    # 64-row tiles); two per SM: 28-row CTAs in 32-row tiles.
    got = tiles.ragged(7168, 1536)
    assert (64, 128, 1, 4, 6, 55) in got and (32, 256, 1, 4, 4, 28) in got
    assert math.ceil(7168 / 55) == 131
    assert not tiles.ragged(768, 128)  # 12 plain 64-row tiles: nothing to balance


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
    # Alone (no chain penalty): the rule of the CuTe tuner.
    row = _row((10.0, 20.0), [("swap_ab", [64, 128, 1, 4, 6], (5.0, 12.0)),  # 0.5, 0.6
                              ("tinygemm", None, (6.0, 10.0))])  # 0.6, 0.5 -> tie: name order
    assert winners.winner(row, chain_penalty_us=0.0)["backend"] == "swap_ab"
    row["candidates"][1]["us"] = [5.0, 10.0]  # 0.5, 0.5: now strictly better
    assert winners.winner(row, chain_penalty_us=0.0)["backend"] == "tinygemm"


def test_a_backend_that_breaks_the_pdl_chain_must_lead_by_more_than_the_penalty():
    # CuTe 3 µs ahead of swap-AB alone: the chain penalty (4 µs) gives the row to swap-AB;
    # 5 µs ahead, CuTe keeps it. The speedups reported are still the times alone.
    row = _row((30.0, 30.0), [("swap_ab", [64, 128, 1, 4, 6], (20.0, 20.0)),
                              ("cute", [224, 1, 4, 8, None], (17.0, 17.0))])
    assert winners.winner(row, chain_penalty_us=0.0)["backend"] == "cute"
    w = winners.winner(row)
    assert w["backend"] == "swap_ab" and w["speedup"] == [1.5, 1.5]
    row["candidates"][1]["us"] = [15.0, 15.0]
    assert winners.winner(row)["backend"] == "cute"
    assert winners.CHAIN_PENALTY_US == 4.0 and "swap_ab" in winners.PDL_AWARE
    assert winners.decide({"rows": [row]})["criteria"]["chain_penalty_us"] == 4.0


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
    # At the roof (4.6, 4.6) and, for the small one, at the 0.8 µs launch floor (roof 0.1).
    bound = (10 / 4.6 * 10 / 4.6 * 2 / 0.8) ** (1 / 3)
    assert s["geomean_bound_roof_or_launch"] == pytest.approx(bound, 1e-3)


def test_cute_queue_ranks_by_scaled_time_and_puts_unranked_rows_last():
    cfg = (32, 2, 1, 8, None)
    table = {(64, 256): {1: ("cute", cfg), 2: ("cute", cfg), 3: ("cute", cfg)}}
    tune = {"rows": [
        {"N": 64, "K": 256, "M": 1, "cublas_us": [0, 10.0], "winner": {"us": [0, 5.0]}},
        {"N": 64, "K": 256, "M": 2, "cublas_us": [0, 10.0], "winner": {"us": [0, 8.0]}},
    ]}
    # Our run's cuBLAS is 20 (2x): CuTe scales to 10 and 16 against ours at 12 and 12;
    # M = 3 has no tuner row (a shape tuned by a run not given): last, unranked.
    sweep = {"shapes": [{"N": 64, "K": 256, "per_m": [
        {"M": 1, "us": 12.0, "cublas_us": 20.0}, {"M": 2, "us": 12.0, "cublas_us": 20.0},
        {"M": 3, "us": 12.0, "cublas_us": 20.0}]}]}
    assert winners.cute_queue(table, tune, sweep) == [
        (64, 256, 1, cfg, 0.8333), (64, 256, 2, cfg, 1.3333), (64, 256, 3, cfg, None)]
    # A shape our sweep never saw: ranked by the tuner's own speedup (10 / 9 -> 0.9).
    table[(32, 256)] = {1: ("cute", cfg)}
    tune["rows"].append({"N": 32, "K": 256, "M": 1, "cublas_us": [0, 10.0], "winner": {"us": [0, 9.0]}})
    assert winners.cute_queue(table, tune, sweep)[1] == (32, 256, 1, cfg, 0.9)


def test_table_rendered_from_a_figures_run_names_every_backend():
    run = {"provenance": {"gpu": "NVIDIA H200", "capability": "9.0", "date": "2026-11-30",
                          "torch": "2.11.0", "cutlass_dsl": "4.6.2", "run_id": "r1",
                          "tool": "k3lab/bench/decode_gemm/figures.py"},
           "criteria": {"win_both_passes": 1.05}, "trivial_us": {"pdl=True": 1.0}, "rows": [
               dict(_row((10, 10), [("swap_ab", [64, 128, 2, 4, 6], (5, 5))]), M=1),
               dict(_row((10, 10), [("ll_bf16", ["splitk", 2, 4], (5, 5))]), M=2),
               dict(_row((10, 10), [("tinygemm", None, (5, 5))]), M=3),
               dict(_row((10, 10), [("cute", [32, 2, 1, 8, None], (5, 5))]), M=4)]}
    winners.decide(run)
    text = render_table.render(run, "results/sm90/decode_gemm_sm90.json")
    ns: dict = {}
    exec(compile(text, "table", "exec"), ns)  # a data-only module
    assert ns["ROWS"] == {(64, 256): {
        1: ("swap_ab", (64, 128, 2, 4, 6)), 2: ("ll_bf16", ("splitk", 2, 4)),
        3: ("tinygemm", None), 4: ("cute", (32, 2, 1, 8, None))}}
    assert ns["PROVENANCE"]["source"].startswith("k3lab/bench/decode_gemm/figures.py run r1")


def test_committed_sweep_is_one_run_with_its_baselines():
    run = json.loads(SWEEP.read_text())
    p = run["provenance"]
    assert p["gpu"] == "NVIDIA H200" and p["date"] and p["triton"] and p["torch"]
    assert run["read_bw_TBps"] > 3 and min(run["trivial_us"].values()) > 0
    # Every SM90 shape known at the run; the KDA row views and MLA's stacked front end were
    # added to the list later.
    swept = {(s["N"], s["K"]) for s in run["shapes"]}
    assert swept == set(shapes.SHAPES) - set(shapes.KDA_SHAPES) - {shapes.MLA_FRONT}
    for s in run["shapes"]:
        assert [p["M"] for p in s["per_m"]] == list(shapes.M_RANGE)
        for p in s["per_m"]:
            # Every figure next to its baseline and roof, and checked against float64.
            assert p["cublas_us"] > 0 and p["us"] > 0 and p["roof_us"] > 0
            assert p["status"] == "ok" and p["relerr"] < 1e-2
    assert all(e < 1e-2 for e in run["chain_relerr"])


# ----------------------------------------------------------------- phases and runner

from k3lab.bench.decode_gemm import phases
from k3lab.bench.decode_gemm import runner

STUB_WORKER = r'''
import json, os, sys, time
a = sys.argv[1:]
opt = lambda k: a[a.index(k) + 1]
part, prog = opt("--part"), opt("--progress")
skip = [a[i + 1] for i, x in enumerate(a) if x == "--skip"]
hang, crash = os.environ.get("STUB_HANG", ""), os.environ.get("STUB_CRASH", "")
data = json.load(open(part)) if os.path.exists(part) else {"rows": [], "done": [], "skipped": []}
def put(path, obj):
    open(path + ".tmp", "w").write(json.dumps(obj)); os.replace(path + ".tmp", path)
for unit in ["startup", "shape:1x8", "shape:2x8", "shape:3x8"]:
    if unit in data["done"]:
        continue
    if unit in skip:
        data["skipped"].append({"unit": unit, "reason": "killed before"}); continue
    limit = float(os.environ.get("STUB_LIMIT", "1"))
    put(prog, {"unit": unit, "since": time.time(), "limit_s": limit, "pid": os.getpid()})
    if unit == hang:
        time.sleep(60)
    if unit == crash:
        os._exit(7)
    if unit.startswith("shape"):
        n = int(unit[6])
        data["rows"].append({"N": n, "K": 8, "M": 1, "cublas_us": [2.0, 2.0], "roof_us": 0.5,
                             "weight_bytes": 16 * n, "today": ["cublas", None], "candidates": [
            {"backend": opt("--phase"), "cfg": None, "us": [1.0, 1.0], "status": "ok"}]})
    data["done"].append(unit)
    put(part, data)
    put(prog, {"unit": None, "since": time.time(), "pid": os.getpid()})
'''


def _stub_run(tmp_path, monkeypatch, env, phase_list, deadline=30.0):
    worker = tmp_path / "worker.py"
    worker.write_text(STUB_WORKER)
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    calls = []

    def argv_for(ph, part, progress, skip, deadline_s):
        calls.append((ph.name, list(skip)))
        cmd = [sys.executable, str(worker), "--phase", ph.name, "--part", part,
               "--progress", progress]
        for u in skip:
            cmd += ["--skip", u]
        return cmd

    res = runner.run(argv_for, str(tmp_path), deadline, phase_list, poll_s=0.05)
    return res, calls


def test_runner_kills_a_hung_unit_records_it_and_resumes_after_it(tmp_path, monkeypatch):
    ph = (phases.Phase("core", ("swap_ab",), 40.0, 0.5),)
    res, calls = _stub_run(tmp_path, monkeypatch, {"STUB_HANG": "shape:2x8"}, ph)
    assert calls == [("core", []), ("core", ["shape:2x8"])]
    assert [(r["N"], r["M"]) for r in res["rows"]] == [(1, 1), (3, 1)]
    assert res["skipped"][0]["unit"] == "shape:2x8" and "no progress in 1 s" in res["skipped"][0]["reason"]
    assert [e["attempt"] for e in res["runner"]] == [1, 2] and res["runner"][1]["unit"] is None
    on_disk = json.loads((tmp_path / runner.OUT_JSON).read_text())
    assert on_disk["summary"]["rows"] == 2  # written by the runner, decided


def test_runner_treats_a_crash_inside_a_unit_like_a_hang(tmp_path, monkeypatch):
    ph = (phases.Phase("core", ("swap_ab",), 40.0, 0.5),)
    res, calls = _stub_run(tmp_path, monkeypatch, {"STUB_CRASH": "shape:1x8"}, ph)
    assert calls[1] == ("core", ["shape:1x8"])
    assert res["skipped"][0]["reason"] == "child exited with status 7 inside this unit"
    assert sorted(r["N"] for r in res["rows"]) == [2, 3]


def test_runner_skips_phases_it_has_no_time_for_and_merges_the_others(tmp_path, monkeypatch):
    ph = (phases.Phase("core", ("swap_ab",), 40.0, 0.5),
          phases.Phase("tinygemm", ("tinygemm",), 40.0, 1000.0))
    res, calls = _stub_run(tmp_path, monkeypatch, {}, ph)
    assert [c[0] for c in calls] == ["core"]
    assert res["skipped"] == [{"phase": "tinygemm", "unit": "phase",
                               "reason": res["skipped"][0]["reason"]}]
    assert "under the 1000 s it needs" in res["skipped"][0]["reason"]


def test_runner_gives_up_a_phase_at_its_cap(tmp_path, monkeypatch):
    ph = (phases.Phase("core", ("swap_ab",), 1.5, 0.5),)
    # The hung unit may take 100 s by its own word: the phase cap (1.5 s) stops it, and
    # nothing is restarted after a cap.
    res, calls = _stub_run(tmp_path, monkeypatch, {"STUB_HANG": "shape:2x8", "STUB_LIMIT": "100"}, ph)
    assert len(calls) == 1
    [skip] = res["skipped"]
    assert skip["unit"] == "shape:2x8" and skip["reason"].startswith("phase cap")
    assert [r["N"] for r in res["rows"]] == [1]  # the unit finished before the hang is kept


def test_merge_keeps_each_later_phase_candidate_with_its_own_cublas():
    core = {"provenance": {"run_id": "r"}, "read_bw_TBps": 4.0, "trivial_us": {"pdl=True": 0.7},
            "rows": [dict(_row((10.0, 10.0), [("swap_ab", [64, 128, 1, 4, 6], (9.0, 9.0))]),
                          today=["cublas", None])]}
    ll = {"rows": [{"N": 64, "K": 256, "M": 1, "cublas_us": [12.0, 12.0], "candidates": [
        {"backend": "ll_bf16", "cfg": ["splitk", 2, 4], "us": [8.0, 8.0], "status": "ok"}]},
        {"N": 64, "K": 256, "M": 2, "cublas_us": [12.0, 12.0], "candidates": []}]}
    res = winners.decide(phases.merge({"core": core, "ll_bf16": ll}, [], []), chain_penalty_us=0.0)
    row = res["rows"][0]
    # ll_bf16: 12/8 = 1.5x against its own cuBLAS beats swap_ab's 10/9 = 1.11x (alone).
    assert row["winner"]["backend"] == "ll_bf16" and row["winner"]["speedup"] == [1.5, 1.5]
    assert row["candidates"][1]["phase"] == "ll_bf16"
    # A row only the later phase timed gets the core run's roof: 2*(64*256+2*256+2*64) B / 4 TB/s.
    assert res["rows"][1]["roof_us"] == round(2 * (64 * 256 + 2 * 256 + 2 * 64) / 4e12 * 1e6, 3)
    assert res["summary"]["geomean_vs_cublas_all_rows"] == pytest.approx(1.5 ** 0.5, 1e-3)


def test_ll_bf16_split_k_only_where_every_split_owns_a_k_tile():
    for n, k in shapes.SHAPES:
        for m in shapes.M_RANGE:
            for cfg in phases.ll_configs(n, k, m):
                if cfg[0] == "splitk":
                    assert math.ceil(k / 256) >= cfg[1]  # K tiles of 256 >= splits
    assert phases.ll_configs(1536, 128, 8) == []


def test_phase_orders_put_the_important_rows_first():
    sel = list(shapes.SHAPES)
    core = phases.shape_order("core", sel)
    assert core[0] == (40960, 7168) and set(core) == set(sel)
    ll = phases.shape_order("ll_bf16", sel)
    assert all(k >= 2048 for _, k in ll) and ll[0] == (144, 7168)
    assert set(phases.shape_order("tinygemm", sel)) == set(sel)  # every K % 64, N % 16


def test_today_speedup_counts_only_the_very_config_retimed():
    row = dict(_row((10.0, 10.0), [("cute", [32, 2, 1, 8, None], (8.0, None))]),
               today=["cute", [32, 2, 1, 8, None]])
    assert winners.today_speedup(row) == 10.0 / 8.0  # pass 1 when pass 2 was not run
    row["today"] = ["cute", [64, 2, 1, 8, None]]
    assert winners.today_speedup(row) is None
    row["today"] = ["cublas", None]
    assert winners.today_speedup(row) == 1.0


def test_report_reads_every_figure_from_the_run():
    from k3lab.bench.decode_gemm import targets as figures_targets

    run = {"provenance": {"run_id": "r1", "gpu": "NVIDIA H200"}, "read_bw_TBps": 4.0,
           "trivial_us": {"pdl=True": 1.0}, "skipped": [
               {"phase": "ll_bf16", "unit": "shape:1x8", "reason": "no progress in 45 s"}],
           "rows": [
               dict(_row((10.0, 10.0), [("swap_ab", [64, 128, 1, 4, 6], (5.0, 5.0))],
                         n=4096, k=4096, roof=4.6), today=["cublas", None]),  # 92% of roof
               dict(_row((10.0, 10.0), [("cute", [32, 2, 1, 8, None], (9.9, 9.9))],
                         n=4096, k=4096, m=2, roof=4.6), today=["cute", [32, 2, 1, 8, None]]),
           ]}
    text = figures_targets.render(winners.decide(run), "results/sm90/x.json")
    assert "| weights >= 20 MB at >= 90% of the read roof | 1 of 2 | 0 (cuBLAS) |" in text
    # after: 2x and 1x (cute 1.01x is under the 5% margin); before: 1x and 10/9.9.
    assert f"| {2 ** 0.5:.3f}x over 2 | {(10 / 9.9) ** 0.5:.3f}x (today's table; 0 rows whose config" in text
    assert "| 4096x4096 | 33.6 | `S.` | 46-92% | 46% | 1.00-2.00x | 5.00 / 10.00 |" in text
    assert "- skipped `shape:1x8` (ll_bf16): no progress in 45 s" in text


def test_the_sm90_results_page_carries_the_committed_runs_report_verbatim():
    from k3lab.bench.decode_gemm import targets as figures_targets

    path = ROOT / "results" / "sm90" / "decode_gemm_sm90.json"
    text = figures_targets.render(json.loads(path.read_text()), "results/sm90/decode_gemm_sm90.json")
    assert text.strip() in (ROOT / "results" / "sm90" / "README.md").read_text()


def test_the_backend_letters_have_one_home():
    """plot.py and targets.py each kept a copy of the letter map; a new backend in one only
    would mark a plot and its table differently."""
    import ast

    folder = ROOT / "k3lab" / "bench" / "decode_gemm"
    homes = [path.name for path in sorted(folder.glob("*.py"))
             for node in ast.walk(ast.parse(path.read_text()))
             if isinstance(node, ast.Assign) and isinstance(node.value, ast.Dict)
             and any(isinstance(t, ast.Name) and t.id == "LETTER" for t in node.targets)]
    assert homes == ["winners.py"]
