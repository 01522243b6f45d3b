"""The rebase job on real newer releases, as CI runs it: what landed, what conflicted, what
the tests say, and the reports a maintainer reads (README "The rebase job")."""

from __future__ import annotations

import json
import re
import subprocess
import sys
import xml.etree.ElementTree as ET

import pytest

from ci import targets
from k3overlay.project import ROOT

from .conftest import LLG, require_vllm_deps

REFS = tuple(targets.e2e_refs())  # ci/targets.toml: the targets the job is checked on


@pytest.fixture(scope="module")
def job(mirror_repo, tmp_path_factory):
    require_vllm_deps()
    from k3overlay import source
    from k3overlay.mirror import release_of

    source.default_mirror().ensure([release_of(ref) for ref in REFS])
    out = tmp_path_factory.mktemp("rebase")
    proc = subprocess.run([sys.executable, "-m", "ci.rebase",
                           *[a for ref in REFS for a in ("--onto", ref)],
                           "--json", str(out / "out.json"), "--junit", str(out / "out.xml"),
                           "--markdown", str(out / "out.md"), "-q"], cwd=ROOT, capture_output=True,
                          text=True)
    assert (out / "out.json").is_file(), proc.stderr[-2000:]
    reports = {r["ref"]: r for r in json.loads((out / "out.json").read_text())}
    return reports, (out / "out.md").read_text(), ET.parse(out / "out.xml").getroot()


@pytest.mark.parametrize("ref", REFS)
def test_the_patches_the_target_holds_landed_upstream(job, ref):
    statuses = {p["name"].split("-")[0]: p["status"] for p in job[0][ref]["patches"]}
    landed = targets.load()[ref].e2e.landed
    assert landed and all(statuses[number] == "landed-upstream" for number in landed)


@pytest.mark.parametrize("ref", REFS)
def test_upstreams_dispatch_stays_theirs_and_only_the_patches_the_target_names_conflict(job, ref):
    report = job[0][ref]
    assert LLG not in {f["path"] for f in report["overlay"]}  # upstream's, never ours
    assert {f["status"] for f in report["overlay"]} == {"added"}
    statuses = {p["name"].split("-")[0]: p["status"] for p in report["patches"]}
    assert statuses["0002"] == "applied"  # the MTP layer's import line
    # On every target 0003/0004 meet upstream's KDA overlap, 0006 its rewritten MLA front
    # end, 0013 the same front end around upstream's own stack of fused_qkv_a_proj and
    # g_proj (ci/targets.toml names the others). The job's fresh clone lacks mtp.py's blob
    # after 0001/0002, so git am cannot 3-way 0006: git names the mla.py hunk that fails
    # (mla.py's _forward_attn), and nothing of mtp.py.
    conflict = targets.load()[ref].e2e.conflict
    assert {"0003", "0004", "0006", "0013"} <= set(conflict)
    assert {n for n, s in statuses.items() if s == "conflict"} == set(conflict)
    [mla] = [p for p in report["patches"] if p["name"].startswith("0006")]
    assert mla["hunks"] and all("vllm/models/kimi_k3/nvidia/mla.py:" in h for h in mla["hunks"])
    assert not report["ok"]  # the KDA and MLA patches need a maintainer


@pytest.mark.parametrize("ref", REFS)
def test_upstreams_tests_ran_and_every_error_is_explained(job, ref):
    report = job[0][ref]
    tests = report["tests"]
    assert tests["passed"] > 0
    problems = tests.get("problems", [])
    assert len(problems) >= bool(tests["failed"] or tests["errors"] or tests.get("env_errors"))
    assert all(p["first_line"] for p in problems)
    lacks = report["verify"]["status"] == "not run"  # a patch or overlay file did not go in
    assert bool(tests.get("not_run")) == lacks  # then ours are left out, and say why
    assert all("the tree lacks our overlay" in line for line in tests.get("not_run", []))


@pytest.mark.parametrize("ref", REFS)
def test_verify_says_the_same_in_every_report(job, ref):
    reports, text, xml = job
    verify = reports[ref]["verify"]
    line = "ok" if verify["status"] == "ok" else (
        f"not run: {verify['not_run']}" if verify["status"] == "not run"
        else f"failed: {len(verify['errors'])} error(s)")
    assert f"- verify: {line}" in text
    [case] = [c for s in xml for c in s if c.get("name") == "verify"
              and s.get("name") == f"rebase onto {ref}"]
    assert case.findtext("system-out") == line


def test_markdown_first_screen_answers_the_maintainer(job):
    reports, text, _ = job
    first = text.split("\n---\n")[0]
    assert len(text.encode()) <= 20_000, len(text.encode())  # GitHub's job summary: 1 MiB
    for ref in REFS:
        report = reports[ref]
        assert re.search(rf"^### {re.escape(ref)} `\w+`: needs a maintainer", first, re.M)
        regions = [h for p in report["patches"] for h in p.get("hunks", [])
                   if re.match(r"^\S+:\d+-\d+$", h)]
        regions += [r for f in report["overlay"] for r in f.get("regions", [])]
        assert regions and all(f"`{r}`" in first for r in regions)
        assert f"python apply.py --rebase-to {ref}\n" in first
    assert first.count("python apply.py --export") == len(REFS)
    assert "released tree/" not in text
