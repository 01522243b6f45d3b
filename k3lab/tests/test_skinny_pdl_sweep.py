"""CPU checks of issue 28's sweep tooling: the skinny_pdl rows reach the table.

Pure parts only: CuTe's best configs from a figures run, the decision (``skinny_pdl`` is
PDL-aware: no chain penalty), a sweep of some M rendered on top of a full run (only its
(shape, M) replaced), the short table printed last. Hand-built rows, not the functions'
own output. The sweep module imports nothing of the GPU at import time.
"""

from __future__ import annotations

import json

from k3lab import render_table
from k3lab.bench import skinny_pdl_sweep as sweep
from k3lab.bench.decode_gemm import winners

PROV = {"gpu": "NVIDIA H200", "capability": "9.0", "date": "2026-12-04", "torch": "2.11.0",
        "cutlass_dsl": "4.6.2", "run_id": "r1", "tool": "k3lab/bench/decode_gemm/figures.py"}


def _row(m, cands, cublas=(10, 10), n=768, k=7168, today=("swap_ab", [64, 128, 8, 4, 6, 48])):
    return {"N": n, "K": k, "M": m, "weight_bytes": 2 * n * k, "roof_us": 1.0,
            "cublas_us": list(cublas), "today": list(today), "candidates": [
                {"backend": b, "cfg": c, "us": list(us), "status": "ok"} for b, c, us in cands]}


def test_skinny_pdl_pays_no_chain_penalty_and_cute_still_does():
    # CuTe 4.2 µs alone, skinny_pdl 4.4 µs: with the 4 µs penalty on CuTe, skinny wins.
    row = _row(1, [("cute", [224, 1, 4, 8, None], (4.2, 4.2)),
                   ("skinny_pdl", [2, 8192, 1, 4, 1], (4.4, 4.4)),
                   ("swap_ab", [64, 128, 8, 4, 6, 48], (6.2, 6.2))])
    assert winners.winner(row)["backend"] == "skinny_pdl"
    assert winners.winner(row, chain_penalty_us=0.0)["backend"] == "cute"
    assert "skinny_pdl" in winners.PDL_AWARE and winners.LETTER["skinny_pdl"] not in (
        set(winners.LETTER.values()) - {winners.LETTER["skinny_pdl"]})


def test_a_sweep_of_some_m_replaces_only_those_rows():
    full = {"provenance": PROV, "criteria": {"win_both_passes": 1.05},
            "rows": [_row(m, [("swap_ab", [64, 128, 8, 4, 6, 48], (6.2, 6.2))])
                     for m in (1, 2, 3, 4, 5, 6)]}  # fmt: skip
    winners.decide(full)
    part = {"provenance": {**PROV, "run_id": "r2", "tool": "k3lab/bench/skinny_pdl_sweep.py"},
            "covers": "rows", "rows": [
                _row(1, [("skinny_pdl", [2, 8192, 1, 4, 1], (4.0, 4.1)),
                         ("swap_ab", [64, 128, 8, 4, 6, 48], (6.2, 6.2))]),
                # M = 2: nothing beats cuBLAS in this run: the row goes to cuBLAS.
                _row(2, [("skinny_pdl", [2, 8192, 1, 4, 1], (9.9, 9.9))]),
                # M = 3: nothing beats cuBLAS either, but the table this run ran against had
                # no entry there (today: cuBLAS), so the full run's swap-AB was never timed
                # against it: it stays (2026-12-05: the stacked MLA front's M 4 was lost so).
                _row(3, [("skinny_pdl", [2, 8192, 1, 4, 1], (9.9, 9.9))], today=("cublas", None))]}
    winners.decide(part)
    text = render_table.render(full, "results/sm90/decode_gemm_sm90.json",
                               ((part, "results/sm90/skinny_pdl_sweep_sm90.json"),))
    ns: dict = {}
    exec(compile(text, "table", "exec"), ns)  # a data-only module
    swap = ("swap_ab", (64, 128, 8, 4, 6, 48))
    assert ns["ROWS"] == {(768, 7168): {1: ("skinny_pdl", (2, 8192, 1, 4, 1)), 3: swap,
                                        4: swap, 5: swap, 6: swap}}
    assert "# skinny_pdl (block_n, block_k, split_k, num_warps, num_stages)." in text
    assert ns["ROW_PROVENANCE"][(768, 7168)]["run_id"] == "r2"


def test_the_table_file_may_follow_the_added_runs(tmp_path):
    run = {"provenance": PROV, "rows": [_row(1, [("swap_ab", [64, 128, 8, 4, 6, 48], (5, 5))])]}
    winners.decide(run)
    (tmp_path / "full.json").write_text(json.dumps(run))
    (tmp_path / "kda.json").write_text(json.dumps({**run, "provenance": {**PROV, "run_id": "r3"}}))
    out = tmp_path / "table.py"
    assert render_table.main([str(tmp_path / "full.json"), "--add", str(tmp_path / "kda.json"), str(out)]) == 0
    assert "run_id" in out.read_text() and "r3" in out.read_text()


def test_a_full_run_renders_as_before_without_the_skinny_line():
    run = {"provenance": PROV, "rows": [_row(1, [("swap_ab", [64, 128, 8, 4, 6, 48], (5, 5))])]}
    winners.decide(run)
    assert "skinny_pdl" not in render_table.render(run)


def test_cute_configs_take_the_fastest_and_the_nearest_m():
    figures = {"rows": [
        _row(1, [("cute", [224, 1, 4, 8, None], (4.5, 4.4)), ("cute", [224, 2, 4, 8, None],
                                                               (4.3, None))]),
        _row(4, [("cute", [224, 2, 1, 8, 7168], (5.0, 5.0)), ("swap_ab", [64, 128, 1, 4, 6],
                                                              (1.0, 1.0))])]}  # fmt: skip
    cute = sweep.cute_configs(figures)
    # By pass 1: 4.3 beats 4.5 (pass 2 is not compared: it re-timed only some).
    assert cute == {(768, 7168, 1): [224, 2, 4, 8, None], (768, 7168, 4): [224, 2, 1, 8, 7168]}
    assert sweep.nearest_cute(cute, 768, 7168, 2) == [224, 2, 4, 8, None]
    assert sweep.nearest_cute(cute, 768, 7168, 3) == [224, 2, 1, 8, 7168]
    assert sweep.nearest_cute(cute, 144, 7168, 1) is None
    assert sweep.cute_configs(None) == {}


def test_the_summary_names_each_row_and_the_chain():
    run = {"rows": [_row(1, [("skinny_pdl", [2, 8192, 1, 4, 1], (4.0, 4.1)),
                             ("swap_ab", [64, 128, 8, 4, 6, 48], (6.2, 6.3))])],
           "chain": [{"M": 1, "roof_us": 160.0, "table_us": 210.0, "cublas_us": 250.0}]}
    text = sweep.summary_table(run)
    assert "768x7168" in text and "6.30" in text and "4.10" in text and "[2, 8192, 1, 4, 1]" in text
    assert "chain M=1 roof 160.0: table 210.0, alone -" in text
