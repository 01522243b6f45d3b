"""The rebase job's table diff and per-target environments on real releases (README command).

Expectations come from elsewhere than the diff: upstream's tables as ``ci/gpu/upstream_tables.py``
reads them out of the release's source text (AST, no import), ours from the overlay's SM90
data module, and FACTS about the releases (SM107 has a table upstream from v0.33.0 on, where
it shares SM103's; v0.33.0 pins torch 2.14.0 and CuTe DSL 4.8.0).
"""

from __future__ import annotations

import json
import runpy
import subprocess
import sys

import pytest

from k3overlay import git
from k3overlay.project import ROOT

from .conftest import LLG, require_vllm_deps

sys.path.insert(0, str(ROOT / "ci" / "gpu"))

import upstream_tables  # noqa: E402


@pytest.fixture(scope="module")
def job(mirror_repo, tmp_path_factory):
    require_vllm_deps()
    from k3overlay import source
    from k3overlay.mirror import release_of

    source.default_mirror().ensure([release_of("v0.33.0")])
    out = tmp_path_factory.mktemp("tables") / "out.json"
    proc = subprocess.run([sys.executable, str(ROOT / "ci" / "rebase.py"), "--onto", "v0.29.0",
                           "--onto", "v0.33.0", "--json", str(out), "-q"],
                          capture_output=True, text=True)
    assert out.is_file(), proc.stderr[-2000:]
    return {r["ref"]: r for r in json.loads(out.read_text())}


def upstream_sm90_rows(mirror_repo, ref, tmp_path) -> set:
    path = tmp_path / f"{ref}.py"
    path.write_bytes(git.read_blob(mirror_repo, git.blob_at(mirror_repo, ref, LLG)))
    rows = set()
    for spec in upstream_tables.extract(str(path))["KIMI_K3_PROJECTIONS_SM90"]:
        rows |= {(spec["N"], spec["K"], int(m)) for m in spec["dsv3"]}
        rows |= {(spec["N"], spec["K"], int(m)) for m in spec["cute"]}
    return rows


def count(arch: dict, *kinds: str) -> int:
    return sum(len(arch[k]) if k != "same" else arch[k] for k in kinds)


@pytest.mark.parametrize("ref", ["v0.29.0", "v0.33.0"])
def test_sm90_diff_accounts_for_every_row_of_both_tables(job, mirror_repo, tmp_path, ref):
    sm90 = job[ref]["tables"]["archs"]["SM90"]
    upstream = upstream_sm90_rows(mirror_repo, ref, tmp_path)
    ours = runpy.run_path(str(ROOT / "overlay" / "vllm/models/kimi_k3/nvidia/low_latency_gemm_sm90.py"))
    our_rows = {(n, k, m) for (n, k), per_m in ours["ROWS"].items() for m in per_m}
    assert count(sm90, "same", "different", "upstream_only") == len(upstream)
    assert count(sm90, "same", "different", "ours_only") == len(our_rows)
    only = {(d["N"], d["K"], d["M"]) for d in sm90["upstream_only"]}
    assert only == upstream - our_rows
    assert {(d["N"], d["K"], d["M"]) for d in sm90["ours_only"]} == our_rows - upstream


def test_sm107_has_an_upstream_table_from_v0_33_0_on_and_it_is_sm103s(job):
    v29, v33 = job["v0.29.0"]["tables"]["archs"], job["v0.33.0"]["tables"]["archs"]
    assert v29["SM107"]["same"] == 0 and not v29["SM107"]["upstream_only"]
    assert v33["SM107"] == v33["SM103"]


def test_our_dispatch_is_read_from_the_built_tree(job):
    for ref in ("v0.29.0", "v0.33.0"):
        tables = job[ref]["tables"]
        # The overlay only adds files, so our module is always laid in the tree.
        assert tables["ours"]["module"] == ("built tree/vllm/models/kimi_k3/nvidia/"
                                            "low_latency_gemm_dispatch.py")
        assert tables["ours"]["accessor"] == "device_table"
        assert tables["upstream"]["module"].startswith("released tree/")


def test_each_target_tests_in_its_own_environment(job):
    env29, env33 = job["v0.29.0"]["tests"]["env"], job["v0.33.0"]["tests"]["env"]
    assert env29["cute_dsl"] == ["nvidia-cutlass-dsl[cu13]==4.6.2"]
    assert env33["cute_dsl"] == ["nvidia-cutlass-dsl[cu13]==4.8.0"]
    assert env33["torch_pinned"] == "2.14.0" and env29["torch_pinned"] == "2.13.0"
    assert env29["key"] != env33["key"]
    for ref in ("v0.29.0", "v0.33.0"):
        # One failure, meant: upstream's callers of its own dispatch (v0.29.0's mla.py, and
        # model.py where patch 0004 conflicted) fail test_no_kimi_k3_module_calls_upstreams_dispatch.
        assert job[ref]["tests"]["failed"] == 1 and job[ref]["tests"]["passed"] > 100
