"""The rebase job's table diff and per-target environments on real releases (README command).

Expectations come from elsewhere than the diff: upstream's tables as ``k3lab/upstream_tables.py``
reads them out of the release's source text (AST, no import), ours from the overlay's SM90
data module, and facts about the releases kept with the targets in ``ci/targets.toml`` (the
torch and CuTe DSL each pins; whether upstream's SM107 table is SM103's, as from v0.33.0 on).
"""

from __future__ import annotations

import json
import runpy
import subprocess
import sys

import pytest

from ci import targets
from k3lab import upstream_tables
from k3overlay import git
from k3overlay.project import ROOT

from .conftest import DISPATCH, LLG, require_vllm_deps

TARGETS = targets.load()
REFS = targets.e2e_refs()


@pytest.fixture(scope="module")
def job(mirror_repo, tmp_path_factory):
    require_vllm_deps()
    from k3overlay import source
    from k3overlay.mirror import release_of

    source.default_mirror().ensure([release_of(ref) for ref in REFS])
    out = tmp_path_factory.mktemp("tables") / "out.json"
    onto = [arg for ref in targets.e2e_refs() for arg in ("--onto", ref)]
    proc = subprocess.run([sys.executable, "-m", "ci.rebase", *onto, "--json", str(out), "-q"],
                          cwd=ROOT, capture_output=True, text=True)
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


@pytest.mark.parametrize("ref", REFS)
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


@pytest.mark.parametrize("ref", REFS)
def test_sm107_has_an_upstream_table_where_the_target_says_and_it_is_sm103s(job, ref):
    archs = job[ref]["tables"]["archs"]
    if TARGETS[ref].e2e.sm107_table:
        assert archs["SM107"] == archs["SM103"]
    else:
        assert archs["SM107"]["same"] == 0 and not archs["SM107"]["upstream_only"]


def test_our_dispatch_is_read_from_the_built_tree(job):
    for ref in REFS:
        tables = job[ref]["tables"]
        # The overlay only adds files, so our module is always laid in the tree.
        assert tables["ours"]["module"] == DISPATCH
        assert tables["ours"]["accessor"] == "device_table"
        assert tables["upstream"]["module"] == LLG  # where the maintainer finds it


def test_each_target_tests_in_its_own_environment(job):
    envs = {ref: job[ref]["tests"]["env"] for ref in REFS}
    for ref, env in envs.items():
        assert env["cute_dsl"] == [f"nvidia-cutlass-dsl[cu13]=={TARGETS[ref].cute_dsl}"]
        assert env["torch_pinned"] == TARGETS[ref].torch
    pins = {(TARGETS[ref].cute_dsl, TARGETS[ref].torch) for ref in REFS}
    assert len({env["key"] for env in envs.values()}) >= len(pins)
    for ref in REFS:
        assert job[ref]["tests"]["failed"] == 0 and job[ref]["tests"]["passed"] > 100
