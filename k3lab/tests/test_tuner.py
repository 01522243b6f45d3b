"""CPU checks of the GPU tier's pure parts: table rendering, config legality, tune cache,
the tuner's seeds, skip rule and GPU lock.

The GPU itself is exercised on the device (docs/gpu-lab.md); these make sure
the committed SM90 table is exactly what the committed runs' JSONs say (issue 12's
all-backend run, ``decode_gemm/runner.py``, with the f_b_proj shapes and the KDA row
views added from the CuTe tuner's runs), and that the tuner never times a config the
kernel would reject.
"""

from __future__ import annotations

import json
import multiprocessing
import threading
import time

import pytest

from k3overlay.project import ROOT


from k3lab import aggregate
from k3lab import render_table
from k3lab import space
from k3lab import tune
from k3lab import tune_cache

RESULTS = ROOT / "results" / "sm90" / "decode_gemm_sm90.json"  # issue 12's all-backend run
TABLE = ROOT / "overlay" / "vllm" / "models" / "kimi_k3" / "nvidia" / "low_latency_gemm_sm90.py"
# Rows taken from other runs (render_table --add): the two KDA row views from their own run.
# The f_b_proj shapes (their input a strided slice of the packed KDA projection's output)
# came from the CuTe tuner's run until swap-AB took that slice (2026-12-04); they are this
# run's rows now.
F_B_SHAPES = {(1536, 128), (3072, 128), (768, 128)}
KDA_RESULTS = ROOT / "results" / "sm90" / "tune_sm90_kda.json"
KDA_SHAPES = {(6144, 7168), (144, 7168)}
# issue 28: the gemv_pdl sweep's rows (M 1..4) of every shape it timed but 6288x7168 (KDA's
# packed in_proj, faster alone on the GEMV at M = 1 and slower in the step's replay). It
# replaces the skinny_pdl sweep's rows (768x7168, 1152x1536 at M 1..4, timed again there).
GEMV_RESULTS = ROOT / "results" / "sm90" / "gemv_pdl_sweep_sm90.json"
GEMV_SHAPES = {(r["N"], r["K"]) for r in json.loads(GEMV_RESULTS.read_text())["rows"]} - {(6288, 7168)}
# issue 28: the isolated re-measure of 2026-12-04 routed swap-AB on KDA's QKVG view at M 5..16,
# where the KDA tuner's run (CuTe only) had left cuBLAS: those rows, kept as a run of their own.
ISOLATED_RESULTS = ROOT / "results" / "sm90" / "decode_gemm_isolated_2026-12-04_6144x7168.json"
# Patch 0013's stacked MLA front (fused_qkv_a_proj + g_proj, 3648x7168), 2026-12-05: the figures
# runner's core phase at M 1..16, then gemv_pdl / skinny_pdl at M 1..4 on top.
STACKED_MLA = [ROOT / "results" / "sm90" / f"{name}_2026-12-05_3648x7168.json"
               for name in ("decode_gemm_isolated", "skinny_pdl_sweep")]
# Every timing of the KDA run: its own cache, a small raw run kept as test data.
KDA_CACHE = ROOT / "k3lab" / "tests" / "data" / "tune_cache_kda"
# The benchmark of the call that tuned them (the KDA figures are a later run's).
KDA_TUNE_BENCH = ROOT / "results" / "kda" / "kda_bench_sm90_h200-20261130-1316-kda.json"


def _added() -> tuple:
    return ((json.loads(KDA_RESULTS.read_text()), "results/sm90/tune_sm90_kda.json"),
            (json.loads(GEMV_RESULTS.read_text()), "results/sm90/gemv_pdl_sweep_sm90.json", GEMV_SHAPES),
            (json.loads(ISOLATED_RESULTS.read_text()), "results/sm90/" + ISOLATED_RESULTS.name),
            *((json.loads(path.read_text()), "results/sm90/" + path.name) for path in STACKED_MLA))


def test_the_f_b_shapes_take_swap_ab_on_their_strided_input_at_every_m():
    rows = _table()["ROWS"]
    for n, k in F_B_SHAPES:
        assert {backend for backend, _ in rows[(n, k)].values()} == {"swap_ab"}, (n, k)
        assert set(rows[(n, k)]) == set(range(1, 17)), (n, k)


def test_committed_sm90_table_is_rendered_from_the_committed_runs():
    text = render_table.render(json.loads(RESULTS.read_text()), "results/sm90/decode_gemm_sm90.json",
                               _added())
    assert text == TABLE.read_text()


def _table() -> dict:
    namespace: dict = {}
    exec(compile(TABLE.read_text(), str(TABLE), "exec"), namespace)  # a data-only module
    return namespace


def test_every_routed_row_beat_cublas_by_5_percent_in_both_passes_of_that_run():
    run = json.loads(RESULTS.read_text())
    table = _table()
    rows, elsewhere = table["ROWS"], set(table["ROW_PROVENANCE"])
    decisions = {(r["N"], r["K"], r["M"]): r for r in run["rows"]}
    bar = run["criteria"]["win_both_passes"]
    routed = 0
    for (n, k), per_m in rows.items():
        if (n, k) in elsewhere:
            continue  # checked against its own run below
        for m, (backend, cfg) in per_m.items():
            row = decisions[(n, k, m)]
            assert row["status"] == "routed"
            # The winner is a candidate timed in both passes of this run, checked against
            # float64, and >= 5% faster than the cuBLAS of its own pass, twice.
            [cand] = [c for c in row["candidates"] if c["backend"] == backend
                      and (c["cfg"] is None and cfg is None or tuple(c["cfg"]) == cfg)]
            assert cand["status"] == "ok" and cand["relerr"] < 1e-2
            cub = cand.get("cublas_us") or row["cublas_us"]
            assert all(c / u >= bar for c, u in zip(cub, cand["us"]))
            if backend == "cute":
                assert space.illegal_reason(cfg, n, k, m) is None
            routed += 1
    assert routed == sum(1 for r in run["rows"] if r["status"] == "routed"
                         and (r["N"], r["K"]) not in elsewhere)
    assert run["summary"]["routed_slower_than_cublas"] == []


@pytest.mark.parametrize("path, cache, shapes", [(KDA_RESULTS, KDA_CACHE, KDA_SHAPES)])
def test_rows_from_an_added_run_beat_cublas_twice_in_that_run(path, cache, shapes):
    run = json.loads(path.read_text())
    rows = _table()["ROWS"]
    decisions = {(r["N"], r["K"], r["M"]): r for r in run["rows"]}
    timed = {tune_cache.key_of(r) for r in tune_cache.read_all(str(cache), run["provenance"]["gpu"])
             if r.get("status") == "ok"}
    bar = run["criteria"]["win_both_passes"]
    later = {(r["N"], r["K"], r["M"]) for r in json.loads(GEMV_RESULTS.read_text())["rows"]
             if (r["N"], r["K"]) in GEMV_SHAPES}  # (shape, M) the gemv sweep decided again
    later |= {(r["N"], r["K"], r["M"]) for r in json.loads(ISOLATED_RESULTS.read_text())["rows"]}
    for n, k in shapes:
        own = {m: e for m, e in rows.get((n, k), {}).items() if (n, k, m) not in later}
        assert set(own) == {m for (dn, dk, m), d in decisions.items()
                            if (dn, dk) == (n, k) and d["status"] == "routed" and (n, k, m) not in later}
        for m, (backend, cfg) in own.items():
            decision = decisions[(n, k, m)]
            assert backend == "cute" and tuple(decision["winner"]["cfg"]) == cfg
            assert min(decision["winner"]["speedup"]) >= bar  # >= 5% over cuBLAS, twice
            assert {(n, k, m, cfg, 1), (n, k, m, cfg, 2)} <= timed
            assert space.illegal_reason(cfg, n, k, m) is None


def test_the_isolated_runs_rows_beat_cublas_twice_and_say_where_the_other_m_come_from():
    run = json.loads(ISOLATED_RESULTS.read_text())
    rows, bar = _table()["ROWS"], run["criteria"]["win_both_passes"]
    assert run["covers"] == "rows" and run["provenance"]["gpu"] == "NVIDIA H200"
    for r in run["rows"]:
        assert r["status"] == "routed" and min(r["winner"]["speedup"]) >= bar
        assert all(c / u >= bar for c, u in zip(r["cublas_us"], r["winner"]["us"]))
        assert rows[(r["N"], r["K"])][r["M"]] == (r["winner"]["backend"], tuple(r["winner"]["cfg"]))
    counts = _table()["ROW_PROVENANCE"][(6144, 7168)]["token_counts"]
    assert counts == ("M 5..16 (M 1..4: results/sm90/gemv_pdl_sweep_sm90.json; "
                      "other M: results/sm90/tune_sm90_kda.json)")


def test_the_run_is_one_h200_run_with_its_baselines():
    run = json.loads(RESULTS.read_text())
    p = run["provenance"]
    assert p["gpu"] == "NVIDIA H200" and p["date"] and p["torch"] and p["triton"]
    assert run["read_bw_TBps"] > 3 and min(run["trivial_us"].values()) > 0
    assert all(r["roof_us"] > 0 and all(r["cublas_us"]) for r in run["rows"])
    # Every row from this one run, but the shapes added from other runs, each citing its run.
    table = _table()
    sources = {shape: src["run_id"] for shape, src in table["ROW_PROVENANCE"].items()}
    kda_run = json.loads(KDA_RESULTS.read_text())["provenance"]["run_id"]
    gemv_run = json.loads(GEMV_RESULTS.read_text())["provenance"]["run_id"]
    isolated = json.loads(ISOLATED_RESULTS.read_text())
    assert sources == {**dict.fromkeys(KDA_SHAPES - GEMV_SHAPES, kda_run),
                       **dict.fromkeys(GEMV_SHAPES, gemv_run),
                       **{(r["N"], r["K"]): isolated["provenance"]["run_id"] for r in isolated["rows"]},
                       (3648, 7168): json.loads(STACKED_MLA[1].read_text())["provenance"]["run_id"]}
    assert table["PROVENANCE"]["run_id"] == p["run_id"]


def test_the_committed_summary_is_what_the_runs_raw_cache_rebuilds_to(tmp_path):
    # The device's JSON of the KDA run did not come back; its summary was rebuilt from the
    # run's cache (a raw run, 445 records, kept here as this test's input) by this command.
    committed = json.loads(KDA_RESULTS.read_text())
    out = tmp_path / "rebuilt.json"
    aggregate.main([str(KDA_CACHE), "--provenance-of",
                    str(KDA_TUNE_BENCH), "--bw-tbps",
                    str(committed["read_bw_TBps"]), "--shape", "6144x7168", "--shape", "144x7168",
                    "--out", str(out)])
    assert json.loads(out.read_text()) == committed
    assert "rebuilt from the run's cache" in committed["provenance"]["rebuilt"]
    # The tuner and the benchmark of that call share one run id.
    bench = json.loads(KDA_TUNE_BENCH.read_text())
    assert committed["provenance"]["run_id"] == bench["provenance"]["run_id"]


@pytest.mark.parametrize("n, k", [(7168, 14336), (1536, 7168), (768, 128), (2112, 7168)])
@pytest.mark.parametrize("m", [1, 2, 8, 16])
def test_config_space_holds_only_legal_configs(n, k, m):
    configs = space.full_space(n, k, m)
    assert configs
    for bs, opb, ku, vw, sk in configs:
        assert k % (bs * vw) == 0 and n % opb == 0 and bs % 32 == 0
        assert sk in (None, k)


@pytest.mark.parametrize("cfg, n, k, reason", [
    ((48, 2, 1, 8, None), 7168, 14336, "warp"),
    ((128, 5, 1, 8, None), 7168, 14336, "N % outputs_per_block"),
    ((256, 2, 1, 8, None), 1536, 7168, "K % (block_size*vector_width)"),
    ((128, 2, 1, 8, 7168), 7168, 14336, "static_k"),
])
def test_illegal_configs_are_pruned_with_a_reason(cfg, n, k, reason):
    assert reason in space.illegal_reason(cfg, n, k, 1)


def test_tune_cache_resumes_and_survives_a_torn_line(tmp_path):
    writer = tune_cache.Writer(str(tmp_path), "NVIDIA H200", 3)
    rec = {"N": 768, "K": 128, "M": 3, "cfg": [32, 3, 1, 4, None], "pass": 1, "us": 1.7}
    writer.put(rec)
    writer.put({**rec, "us": 1.6})  # a later measurement of the same key wins
    writer.f.close()
    with open(tune_cache.path_for(str(tmp_path), "NVIDIA H200", 3), "a") as f:
        f.write('{"N": 768, "K"')  # a call killed mid-write
    got = tune_cache.read(str(tmp_path), "NVIDIA H200", 3)
    assert list(got.values()) == [{**rec, "us": 1.6}]


# ------------------------------------------------------------- tuner scheduling

GPU = "NVIDIA H200"


def _write(cache, m, *recs):
    writer = tune_cache.Writer(str(cache), GPU, m)
    for rec in recs:
        writer.put(rec)
    writer.f.close()


def _timed(n, k, m, cfg, us):
    return {"N": n, "K": k, "M": m, "cfg": list(cfg), "pass": 1, "status": "ok", "us": us}


def test_gpu_lock_serves_the_smallest_waiting_m_first():
    lock = tune.GpuLock(multiprocessing.get_context("spawn"), 16)
    order: list = []

    def worker(m):
        with lock.held(m):
            order.append(m)

    with lock.held(1):  # the GPU is busy while three workers queue up
        threads = [threading.Thread(target=worker, args=(m,)) for m in (9, 2, 5)]
        for t in threads:
            t.start()
        deadline = time.time() + 10
        while sum(lock._waiting[:]) < 3 and time.time() < deadline:
            time.sleep(0.01)
    for t in threads:
        t.join(10)
    assert order == [2, 5, 9]


def test_seeds_come_from_the_shape_and_its_donor_at_the_nearest_m(tmp_path):
    view, donor = (6144, 7168), (6288, 7168)
    _write(tmp_path, 1, _timed(*view, 1, (224, 2, 4, 4, None), 21.3),
           _timed(*view, 1, (224, 3, 2, 8, None), 21.4),
           {**_timed(*view, 1, (64, 1, 1, 8, None), 9.0), "status": "wrong"})
    _write(tmp_path, 3, _timed(*donor, 3, (32, 3, 1, 8, 7168), 21.8),
           _timed(*donor, 3, (64, 3, 1, 8, 7168), 22.0), _timed(*donor, 3, (32, 4, 1, 8, 7168), 22.4))
    _write(tmp_path, 4, _timed(*donor, 4, (64, 4, 1, 8, 7168), 23.0))
    got = tune.seeds_from_cache(str(tmp_path), GPU, *view, 3, (donor,), top=2)
    # The view's own M1 (nearest measured), fastest first, the wrong one never; the
    # donor's two fastest at the same M.
    assert got == [(224, 2, 4, 4, None), (224, 3, 2, 8, None), (32, 3, 1, 8, 7168), (64, 3, 1, 8, 7168)]
    # At M 16 the donor's nearest (M4) config would hold 16 x 4 accumulators: dropped.
    assert tune.seeds_from_cache(str(tmp_path), GPU, *view, 16, (donor,), top=1) == [
        (224, 2, 4, 4, None)]
    assert tune.seeds_from_cache(str(tmp_path), GPU, 144, 7168, 2) == []  # nothing to seed from


def test_a_donor_that_lost_at_m_minus_1_skips_the_view(tmp_path):
    run, seed = tmp_path / "run", tmp_path / "seed"
    view, donor = (6144, 7168), (6288, 7168)
    _write(seed, 5, {"N": 6288, "K": 7168, "M": 5, "cfg": "done", "pass": 1, "best_speedup": 1.06})
    _write(seed, 6, {"N": 6288, "K": 7168, "M": 6, "cfg": "done", "pass": 1, "best_speedup": 0.92})
    _write(seed, 7, {"N": 6288, "K": 7168, "M": 7, "cfg": "skip", "pass": 1})

    def why(m, donors=(donor,)):
        return tune._prev_lost(str(run), GPU, *view, m, 0.0, donors, str(seed))

    assert why(1) is None and why(6) is None  # M1 always; the donor won at M5
    assert "donor 6288x7168 (seed cache)" in why(7) and "donor" in why(8)
    assert why(9) is None and why(7, donors=()) is None  # no answer anywhere: tune it
    # The view's own answer at M-1, once this run has it, comes before any donor's.
    _write(run, 6, {"N": 6144, "K": 7168, "M": 6, "cfg": "done", "pass": 1, "best_speedup": 1.1})
    assert why(7) is None
    _write(run, 9, {"N": 6144, "K": 7168, "M": 9, "cfg": "done", "pass": 1, "best_speedup": 0.9})
    assert why(10) == "nothing reached cuBLAS at M-1"


@pytest.mark.parametrize("path, shapes", [(GEMV_RESULTS, GEMV_SHAPES), (STACKED_MLA[1], {(3648, 7168)})])
def test_rows_from_the_gemv_sweep_are_its_winners_and_beat_cublas_twice(path, shapes):
    run = json.loads(path.read_text())
    rows, bar = _table()["ROWS"], json.loads(RESULTS.read_text())["criteria"]["win_both_passes"]
    checked = 0
    for r in run["rows"]:
        if (r["N"], r["K"]) not in shapes:
            assert r["M"] not in rows.get((r["N"], r["K"]), {}) or rows[(r["N"], r["K"])][r["M"]][0] != "gemv_pdl"
            continue
        entry = rows.get((r["N"], r["K"]), {}).get(r["M"])
        if r["status"] != "routed":
            # cuBLAS there, unless the sweep never timed the entry beneath (it ran against
            # a table with none there: the stacked MLA front's M 4 keeps the figures run's)
            assert entry is None or r["today"][0] == "cublas"
            continue
        assert entry == (r["winner"]["backend"], tuple(r["winner"]["cfg"]))
        assert min(r["winner"]["speedup"]) >= bar  # >= 5% over cuBLAS, in both passes
        checked += entry[0] == "gemv_pdl"
    assert checked == sum(e[0] == "gemv_pdl" for shape in shapes for e in rows.get(shape, {}).values())
