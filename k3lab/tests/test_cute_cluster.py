"""CPU checks of the issue-12 cluster split-K experiment (k3lab/experiments/cute_cluster*.py).

The compile test builds our CuTe DSL kernel for sm_90a without a GPU and reads its SASS;
it skips where nvidia-cutlass-dsl is not importable (CI's venv does not carry it). The
bench's pure parts (arguments, config choice, JSON after every unit) need neither.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys

import pytest

from k3overlay.project import ROOT

from k3lab.experiments import cute_cluster_bench as bench

# The issue's split-K shapes (weight N x K) and token counts.
SHAPES = [(1536, 7168), (3072, 7168), (2112, 7168), (768, 7168)]

# Every config's dump has the same file names (they come from the argument types), so
# each is moved into a folder of its own before the next compile.
_COMPILE = """
import os
from k3lab.experiments import cute_cluster as cc
dump = os.environ["CUTE_DSL_DUMP_DIR"]
for c in (2, 4, 8):
    for s, tk in ((3, 128), (6, 128), (12, 64)):
        cc.compile_kernel(cc.ClusterConfig(c, s, tk))
        sub = os.path.join(dump, f"c{c}s{s}")
        os.mkdir(sub)
        for name in os.listdir(dump):
            if os.path.isfile(os.path.join(dump, name)):
                os.rename(os.path.join(dump, name), os.path.join(sub, name))
        print("compiled", c, s, flush=True)
"""


@pytest.fixture(scope="module")
def dumps(tmp_path_factory):
    """Every (cluster, stages) compiled for sm_90a in one process; the dump folder."""
    pytest.importorskip("cutlass.cute", reason="nvidia-cutlass-dsl is not installed here")
    out = tmp_path_factory.mktemp("cute_dump")
    env = {"CUTE_DSL_ARCH": "sm_90a", "CUTE_DSL_KEEP": "ptx,cubin,sass",
           "CUTE_DSL_DUMP_DIR": str(out)}
    proc = subprocess.run([sys.executable, "-c", _COMPILE], cwd=ROOT,  # finds k3lab
                          env={**os.environ, **env}, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.count("compiled") == 9
    return out


def _opcodes(sass: str) -> set[str]:
    return set(re.findall(r"/\*[0-9a-f]{4}\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9_]+)", sass))


def test_every_config_compiles_to_sm90a_with_mma_and_cluster_ops(dumps):
    sass = sorted(dumps.glob("c*s*/*.sass"))
    ptx = sorted(dumps.glob("c*s*/*.sm_90a.ptx"))
    assert len(ptx) == 9 and len(sass) == 9, sorted(str(p) for p in dumps.rglob("*"))
    for path in sass:
        ops = _opcodes(path.read_text())
        # HMMA: mma.sync; LDSM: ldmatrix; LDGSTS: cp.async; STAS: st.async into rank 0's
        # shared memory; SYNCS: its mbarrier; UCGABAR_*: the cluster barrier.
        missing = {"HMMA", "LDSM", "LDGSTS", "STAS", "SYNCS", "UCGABAR_ARV", "UCGABAR_WAIT"} - ops
        assert not missing, f"{path.name}: no {sorted(missing)}"


def test_ptx_splits_k_over_the_cluster_and_waits_before_reading_x(dumps):
    seen_clusters = set()
    for path in dumps.glob("c*s*/*.sm_90a.ptx"):
        text = path.read_text()
        assert ".target sm_90a" in text
        assert "st.async.shared::cluster.mbarrier::complete_tx::bytes" in text
        assert "mbarrier.arrive.expect_tx" in text
        # Every load is predicated (a register src-size: x rows past M and weight rows
        # past the cluster's read nothing); weight tiles go out before griddepcontrol.wait,
        # x after it (its prologue x loads are the first after the wait).
        wait = text.index("griddepcontrol.wait")
        loads = [m for m in re.finditer(r"cp\.async\.cg\.shared\.global [^;]*;", text)]
        assert loads and all(re.search(r", 16, %r\d+;$", m.group()) for m in loads)
        assert any(m.start() < wait for m in loads) and any(m.start() > wait for m in loads)
        # rank 0 arms its mbarrier with (C - 1) partials of 64 x 16 fp32 = 4096 bytes each
        armed = re.search(r"mov\.b32\s+%r\d+, (\d+);\s+mbarrier\.arrive\.expect_tx", text)
        assert armed, path.name
        seen_clusters.add(int(armed.group(1)) // 4096 + 1)
        assert "griddepcontrol.launch_dependents" in text
    assert seen_clusters == {2, 4, 8}


@pytest.mark.parametrize("n,k", SHAPES)
def test_config_error_accepts_the_issue_shapes_and_names_what_it_refuses(n, k):
    pytest.importorskip("cutlass.cute", reason="nvidia-cutlass-dsl is not installed here")
    from k3lab.experiments import cute_cluster as cc

    for c in (2, 4, 8):
        for s in (3, 4, 6):
            for m in (1, 8, 16):
                assert cc.config_error(cc.ClusterConfig(c, s), n, k, m) is None
    assert "rows=65" in cc.config_error(cc.ClusterConfig(4, 4), n, k, 1, 65)
    assert "rows=0" in cc.config_error(cc.ClusterConfig(4, 4), n, k, 1, 0)
    assert "multiple of cluster x tile_k" in cc.config_error(cc.ClusterConfig(4, 4), n, k + 128)
    assert "M=17" in cc.config_error(cc.ClusterConfig(4, 4), n, k, 17)
    assert "cluster=3" in cc.config_error(cc.ClusterConfig(3, 4), n, k)
    # 8 stages load 7 K tiles in the prologue: 7168 / (8 x 128) = 7 per rank is enough, 6144 not
    assert cc.config_error(cc.ClusterConfig(8, 8), n, k) is None
    assert "fewer than stages - 1" in cc.config_error(cc.ClusterConfig(8, 8), n, 6144)
    # every config the bench tries fits every issue shape
    for cfg in bench.cute_configs():
        for rows in bench.rows_for(n, cfg[0]):
            assert cc.config_error(cc.ClusterConfig(*cfg), n, k, 16, rows) is None, cfg
    assert "stages=17" in cc.config_error(cc.ClusterConfig(2, 17, 64), n, k)


def test_bench_arguments():
    a = bench.parse_args(["--phase", "check", "--out", "o.json", "--deadline-s", "5"])
    assert (a.phase, a.out, a.deadline_s) == ("check", "o.json", 5.0)
    for bad in (["--phase", "time", "--out", "o", "--deadline-s", "5"],  # no --checked
                ["--phase", "check", "--out", "o", "--deadline-s", "0"],
                ["--phase", "bogus", "--out", "o", "--deadline-s", "5"]):
        with pytest.raises(SystemExit) as exc:
            bench.parse_args(bad)
        assert exc.value.code == 2


def test_triton_config_follows_the_table_row_then_the_shapes_common_config():
    rows = {1: ("cute", (224, 1, 4, 8, None)),
            5: ("swap_ab", (64, 128, 4, 4, 6, 47)),
            6: ("swap_ab", (64, 128, 4, 4, 6, 47)),
            8: ("tinygemm", None),
            9: ("swap_ab", (64, 128, 2, 4, 6))}
    assert bench.triton_config(rows, 9) == (64, 128, 2, 4, 6)  # the row's own
    assert bench.triton_config(rows, 1) == (64, 128, 4, 4, 6, 47)  # most common
    assert bench.triton_config(rows, 8) == (64, 128, 4, 4, 6, 47)
    assert bench.triton_config({1: ("cute", (1,))}, 1) is None
    # a tie between two configs goes to the one at the nearest M
    tie = {2: ("swap_ab", (1, 2)), 12: ("swap_ab", (3, 4))}
    assert bench.triton_config(tie, 10) == (3, 4)
    assert bench.triton_config(tie, 4) == (1, 2)


def test_triton_config_exists_for_every_issue_shape_in_the_sm90_table():
    import runpy

    rows = runpy.run_path(bench.SM90_TABLE)["ROWS"]
    for shape in SHAPES:
        for m in (1, 8, 16):
            cfg = bench.triton_config(rows[shape], m)
            assert cfg is not None and cfg[2] > 1, (shape, m, cfg)  # a split-K config


def test_run_units_writes_after_every_unit_records_errors_and_skips_past_the_deadline(tmp_path):
    out = tmp_path / "r.json"
    seen = []
    now = [0.0]

    def work(unit):
        if seen:  # the previous unit's rows are on disk before this one starts
            assert [r["unit"] for r in json.loads(out.read_text())["rows"]] == seen
        seen.append(unit)
        now[0] += 10.0
        if unit == "b":
            raise RuntimeError("kernel exploded")
        return [{"unit": unit, "status": "ok"}]

    res = {"rows": [], "skipped": []}
    bench.run_units(["a", "b", "c", "d"], work, res, "rows", str(out), deadline=25.0,
                    clock=lambda: now[0])
    data = json.loads(out.read_text())
    assert [r["status"] for r in data["rows"]] == ["ok", "error", "ok"]
    assert "RuntimeError: kernel exploded" in data["rows"][1]["error"]
    assert data["skipped"] == [{"unit": "d", "reason": "deadline"}]
    assert not (tmp_path / "r.json.tmp").exists()


def test_passed_keeps_only_correct_configs():
    checked = {"checks": [
        {"N": 768, "K": 7168, "M": 1, "cluster": 2, "stages": 3, "tile_k": 64, "pdl": True,
         "rows": 12, "status": "ok"},
        {"N": 768, "K": 7168, "M": 8, "cluster": 2, "stages": 3, "tile_k": 64, "pdl": True,
         "rows": 12, "status": "wrong"},
        {"unit": "(4, 4)", "status": "error", "error": "x"},
    ]}
    assert bench.passed(checked) == {(768, 7168, 1, 2, 3, 64, True, 12)}


def test_rows_for_aims_the_grid_at_one_and_two_ctas_per_sm():
    # 1536 rows, cluster 4: 33 clusters of 47 rows (132 CTAs), 66 of 24 (264 CTAs)
    assert bench.rows_for(1536, 4) == [24, 47]
    # 768 rows, cluster 8: 16 clusters of 48 (128 CTAs), 33 of 24 (264)
    assert bench.rows_for(768, 8) == [24, 48]
    # a shape with more 64-row clusters than SMs keeps the full tile
    assert bench.rows_for(40960, 2) == [64]
    for n in (768, 1536, 2112, 3072):
        for c in (2, 4, 8):
            for rows in bench.rows_for(n, c):
                # at most 2 CTAs per SM unless already the full 64-row tile (3072 rows, C = 8)
                assert 1 <= rows <= 64 and (-(-n // rows) * c <= 2 * bench.tiles.SMS or rows == 64)
