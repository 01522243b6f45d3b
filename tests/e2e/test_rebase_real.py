"""The rebase job on real newer releases: what landed, what drifted, what the tests say."""

from __future__ import annotations

import pytest

from k3overlay.project import Project
from k3overlay.rebase import run_rebase

from .conftest import LLG, require_vllm_deps


@pytest.fixture(scope="module")
def reports(mirror_repo):
    require_vllm_deps()
    from cpu_tier import run_cpu_tier

    return {r.ref: r for r in run_rebase(Project(), ["v0.29.0", "v0.33.0"], tests=run_cpu_tier)}


@pytest.mark.parametrize("ref", ["v0.29.0", "v0.33.0"])
def test_eh_proj_patch_landed_upstream(reports, ref):
    statuses = {p.name.split("-")[0]: p.status for p in reports[ref].patches}
    assert statuses["0001"] == "landed-upstream"


@pytest.mark.parametrize("ref", ["v0.29.0", "v0.33.0"])
def test_upstreams_dispatch_stays_theirs_and_only_the_kda_patches_conflict(reports, ref):
    report = reports[ref]
    assert LLG not in {f.path for f in report.overlay}
    assert {f.status for f in report.overlay} == {"added"}
    statuses = {p.name.split("-")[0]: p.status for p in report.patches}
    assert statuses["0002"] == "applied"  # the model's two import lines
    assert {n for n, s in statuses.items() if s == "conflict"} == {"0003", "0004"}
    assert not report.ok  # the KDA patches need a maintainer


@pytest.mark.parametrize("ref", ["v0.29.0", "v0.33.0"])
def test_tests_ran_on_the_result(reports, ref):
    tests = reports[ref].tests
    assert set(tests) >= {"passed", "failed", "skipped", "errors"}
    assert sum(tests[k] for k in ("passed", "failed", "skipped", "errors")) > 0
