"""The rebase job on real newer releases: what landed, what drifted, what the tests say."""

from __future__ import annotations

import pytest

from ci import targets
from k3overlay.project import Project
from k3overlay.rebase import run_rebase

from .conftest import LLG, require_vllm_deps

REFS = targets.e2e_refs()  # ci/targets.toml: the targets the job is checked on, and what it finds


@pytest.fixture(scope="module")
def reports(mirror_repo):
    require_vllm_deps()
    from ci.cpu_tier import run_cpu_tier

    return {r.ref: r for r in run_rebase(Project(), REFS, tests=run_cpu_tier)}


@pytest.mark.parametrize("ref", REFS)
def test_the_patches_the_target_holds_landed_upstream(reports, ref):
    statuses = {p.name.split("-")[0]: p.status for p in reports[ref].patches}
    landed = targets.load()[ref].e2e.landed
    assert landed and all(statuses[number] == "landed-upstream" for number in landed)


@pytest.mark.parametrize("ref", REFS)
def test_low_latency_gemm_drift_is_merged_or_conflict_never_replaced(reports, ref):
    llg = next(f for f in reports[ref].overlay if f.path == LLG)
    assert llg.status in ("merged", "conflict")
    assert llg.upstream_diff.startswith("diff --git a/" + LLG)
    assert not reports[ref].ok  # the overlay file needs a maintainer either way


@pytest.mark.parametrize("ref", REFS)
def test_tests_ran_on_the_result(reports, ref):
    tests = reports[ref].tests
    assert set(tests) >= {"passed", "failed", "skipped", "errors"}
    assert sum(tests[k] for k in ("passed", "failed", "skipped", "errors")) > 0
