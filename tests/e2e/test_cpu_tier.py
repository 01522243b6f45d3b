"""The CPU test tier on the patched pinned base: vLLM's own skinny-GEMM tests and ours."""

from __future__ import annotations

import xml.etree.ElementTree as ET

from .conftest import require_vllm_deps


def test_vllm_and_our_kernel_tests_pass_on_patched_base(applied, tmp_path):
    require_vllm_deps()
    from ci.cpu_tier import run_cpu_tier

    wd, _ = applied
    xml = tmp_path / "tier.xml"
    run = run_cpu_tier(wd, junit_xml=xml)
    assert run.failed == 0 and run.errors == 0, run
    files = {}
    for case in ET.parse(xml).getroot().iter("testcase"):
        outcome = "skipped" if case.find("skipped") is not None else "ran"
        module = case.get("classname", "").split(".")[-1] if "." in case.get("classname", "") else ""
        files.setdefault(module, set()).add(outcome)
    # vLLM v0.28.0's file passed 85 tests on CPU before our changes; ours must run too.
    assert run.passed >= 85, run
    assert "ran" in files.get("test_bf16_skinny_gemm", set()), sorted(files)
    assert "ran" in files.get("test_kimi_k3_low_latency_gemm", set()), sorted(files)
    assert "ran" in files.get("test_kimi_k3_kda_projection", set()), sorted(files)
