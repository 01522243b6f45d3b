"""CPU checks of the GPU tier's pure parts: table rendering, config legality, tune cache.

The GPU itself is exercised on the device (ci/gpu/README.md); these make sure
the committed SM90 table is exactly what the committed run's JSON says, and
that the tuner never times a config the kernel would reject.
"""

from __future__ import annotations

import json
import sys

import pytest

from k3overlay.project import ROOT

sys.path.insert(0, str(ROOT / "ci" / "gpu"))

import render_table  # noqa: E402
import space  # noqa: E402
import tune_cache  # noqa: E402

RESULTS = ROOT / "ci" / "gpu" / "results" / "tune_sm90.json"
# A later run that tuned the KDA row views only (ci/gpu/kda/device.sh).
KDA_RESULTS = ROOT / "ci" / "gpu" / "results" / "tune_sm90_kda.json"
TABLE = ROOT / "overlay" / "vllm" / "models" / "kimi_k3" / "nvidia" / "low_latency_gemm_sm90.py"


def test_committed_sm90_table_is_rendered_from_the_committed_runs():
    added = ((json.loads(KDA_RESULTS.read_text()), "ci/gpu/results/tune_sm90_kda.json"),)
    text = render_table.render(json.loads(RESULTS.read_text()), "ci/gpu/results/tune_sm90.json", added)
    assert text == TABLE.read_text()


def _table() -> dict:
    namespace: dict = {}
    exec(compile(TABLE.read_text(), str(TABLE), "exec"), namespace)  # a data-only module
    return namespace


def test_every_routed_row_beat_cublas_by_5_percent_in_both_passes():
    runs = [json.loads(RESULTS.read_text()), json.loads(KDA_RESULTS.read_text())]
    rows = _table()["ROWS"]
    assert {1, 2} <= set(rows[(7168, 14336)])  # eh_proj routes at M1 and M2 on SM90
    # The later run's rows replace the first's for the shapes it covers.
    decisions = {(r["N"], r["K"], r["M"]): r for run in runs for r in run["rows"]}
    columns = runs[0]["measurements_columns"]
    timed = {(m["N"], m["K"], m["M"], tuple(m["cfg"]) if m["cfg"] else None, m["pass"])
             for run in runs for m in (dict(zip(columns, values)) for values in run["measurements"])}
    bar = runs[0]["criteria"]["win_both_passes"]
    assert all(run["criteria"]["win_both_passes"] == bar for run in runs)
    routed = 0
    for (n, k), per_m in rows.items():
        for m, (backend, cfg) in per_m.items():
            decision = decisions[(n, k, m)]
            assert decision["status"] == "routed" and backend == "cute"
            assert tuple(decision["winner"]["cfg"]) == cfg
            assert min(decision["winner"]["speedup"]) >= bar  # >= 5% over cuBLAS, twice
            assert {(n, k, m, cfg, 1), (n, k, m, cfg, 2)} <= timed
            assert space.illegal_reason(cfg, n, k, m) is None
            routed += 1
    assert routed == sum(1 for r in decisions.values() if r["status"] == "routed")


def test_kda_rows_name_their_own_run():
    table = _table()
    kda_run = json.loads(KDA_RESULTS.read_text())["provenance"]["run_id"]
    assert {(6144, 7168), (144, 7168)} <= set(table["ROWS"])
    for shape in ((6144, 7168), (144, 7168)):
        assert table["ROW_PROVENANCE"][shape]["run_id"] == kda_run
        assert "tune_sm90_kda.json" in table["ROW_PROVENANCE"][shape]["source"]
    assert set(table["ROW_PROVENANCE"]) <= set(table["ROWS"])


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
