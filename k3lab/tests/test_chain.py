"""Issue 28's chain benchmark (k3lab/bench/chain.py): its CPU side, i.e. the arguments, the
chain a table gives and each table's plan; the timing needs a GPU."""

from __future__ import annotations

import subprocess
import sys

import pytest

from k3lab import paths
from k3lab import shapes as shp
from k3lab.bench import chain
from k3lab.bench.gemm import load_ours

SM90 = paths.REPO / "overlay/vllm/models/kimi_k3/nvidia/low_latency_gemm_sm90.py"


def test_tables_are_name_equals_path_and_names_are_distinct() -> None:
    assert chain.parse_tables(["now=a.py", "before=b.py"]) == [("now", "a.py"), ("before", "b.py")]
    for bad in (["a.py"], ["=a.py"], ["now="], ["now=a.py", "now=b.py"], ["cublas=a.py"], ["x+norm=a"], []):
        with pytest.raises(ValueError):
            chain.parse_tables(bad)


def test_token_counts_are_ranges_or_lists_within_the_decode_range() -> None:
    assert chain.parse_m("1-16") == list(range(1, 17))
    assert chain.parse_m("16,1,4,4") == [1, 4, 16]
    assert chain.parse_m("1-3,8") == [1, 2, 3, 8]
    for bad in ("0", "17", "1-17", "", "a"):
        with pytest.raises(ValueError):
            chain.parse_m(bad)


def test_the_chain_is_the_tables_shapes_under_the_cap_and_each_table_plans_its_own_rows() -> None:
    rows, prov = load_ours(str(SM90))
    assert prov["gpu"].startswith("NVIDIA H200")
    full = chain.chain_shapes(rows, 100.0)
    assert full and all(shp.weight_bytes(n, k) <= 100e6 for n, k in full)
    assert {(n, k) for n, k, _ in rows} - set(full), "the lm_head and the 100+ MB shapes stay out"
    assert chain.chain_shapes(rows, 30.0) == [s for s in full if shp.weight_bytes(*s) <= 30e6]
    # an earlier table without a shape runs torch.mm there; with one, its own entry
    older = {key: entry for key, entry in rows.items() if key[:2] != full[0]}
    for m in (1, 16):
        now, before = dict(chain.plan(rows, full, m)), dict(chain.plan(older, full, m))
        assert list(now) == full and before[full[0]] is None
        assert all(now[s] == rows.get((*s, m)) for s in full)
    assert chain.roof_us(full, 16, 4e12) > chain.roof_us(full, 1, 4e12) > 0


def test_bad_arguments_exit_2_with_one_line_before_any_gpu_work(tmp_path) -> None:
    for args in (["--table", "now"], ["--table", f"now={tmp_path / 'missing.py'}"],
                 ["--table", f"now={SM90}", "--m", "0"], ["--table", f"now={SM90}", "--max-mb", "0.001"]):
        proc = subprocess.run([sys.executable, "-m", "k3lab.bench.chain", *args], cwd=paths.REPO,
                              capture_output=True, text=True, timeout=120)  # fmt: skip
        assert proc.returncode == 2, (args, proc.stderr)
        assert proc.stderr.startswith("error: ") and proc.stderr.count("\n") == 1, proc.stderr
