"""Table diff, target environments, environment errors and the GPU stage's pure parts (CPU).

The tables are read from a hand-built stand-in of vLLM's package (a module with a
``_low_latency_table()`` keyed on ``current_platform``, like upstream's, and one with a
``device_table()``, like ours), imported by ``ci/table_dump.py`` in a subprocess exactly as
the rebase job imports the real ones; expectations are the rows written into those files.
"""

from __future__ import annotations

import json
import os
import sys
import textwrap
import xml.etree.ElementTree as ET
from pathlib import Path
from types import SimpleNamespace

import pytest

from ci import cpu_tier, gpu_report, table_diff, target_env, targets
from ci.gpu_stage import ab, addon, stage
from ci.gpu_stage.run import python_path
from k3overlay import errors
from k3overlay.report import Report, junit_xml, markdown
from k3overlay.stages import Problem, TestRun
from tests.test_downloads import plant

PKG = "vllm/models/kimi_k3/nvidia"
SPEC = textwrap.dedent("""\
    from dataclasses import dataclass

    @dataclass(frozen=True)
    class SkinnyGemmConfig:
        num_rows: int
        block_size: int
        outputs_per_block: int
        k_unroll: int = 1
        vector_width: int = 8
        static_k: int | None = None
    """)
# Upstream-like: a dict table per arch, chosen through current_platform.is_device_capability.
UPSTREAM = SPEC + textwrap.dedent("""\
    from vllm.platforms import current_platform

    SM90 = {(64, 128): {1: ("cute", SkinnyGemmConfig(1, 32, 2)), 2: ("dsv3_fused_a", None)},
            (128, 64): {1: ("cute", SkinnyGemmConfig(1, 32, 4))}}
    SM100 = {(64, 128): {3: ("cute", SkinnyGemmConfig(3, 64, 2))}}

    def _low_latency_table():
        if current_platform.is_device_capability((9, 0)):
            return SM90
        if current_platform.is_device_capability(100):
            return SM100
        return None

    def _build_plan(spec):
        return dict(spec)

    def _build_residual_plan(spec):
        return {}
    """)
# Ours-like: device_table() through get_device_capability(); one residual row on SM90.
OURS = SPEC + textwrap.dedent("""\
    from vllm.platforms import current_platform

    SM90 = {(64, 128): {1: ("cute", SkinnyGemmConfig(1, 32, 2)), 3: ("cute", SkinnyGemmConfig(3, 32, 1))},
            (128, 64): {1: ("cute", SkinnyGemmConfig(1, 64, 4, static_k=64))}}

    def device_table():
        if not current_platform.is_cuda():
            return None
        cap = current_platform.get_device_capability()
        return SM90 if (cap.major, cap.minor) == (9, 0) else None

    def _build_plan(spec):
        return dict(spec)

    def _build_residual_plan(spec):
        return {1: SkinnyGemmConfig(1, 32, 2)} if (64, 128) in SM90 and spec is SM90[(64, 128)] else {}
    """)
PLATFORMS = "class _CPU:\n    def is_cuda(self):\n        return False\n\ncurrent_platform = _CPU()\n"
# vLLM's package __init__ imports the model (and so the module) eagerly: so does this one.
KIMI_INIT = "from .nvidia import low_latency_gemm  # noqa: F401\n"


def make_tree(root: Path, module: str) -> Path:
    files = {"vllm/__init__.py": "", "vllm/platforms/__init__.py": PLATFORMS,
             "vllm/models/__init__.py": "", "vllm/models/kimi_k3/__init__.py": KIMI_INIT,
             f"{PKG}/__init__.py": "", f"{PKG}/low_latency_gemm.py": module}
    for rel, text in files.items():
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_text(text)
    return root


@pytest.fixture
def trees(tmp_path):
    upstream = make_tree(tmp_path / "upstream", UPSTREAM)
    overlay = tmp_path / "overlay" / PKG
    overlay.mkdir(parents=True)
    (overlay / "low_latency_gemm.py").write_text(OURS)
    return upstream, overlay


def test_upstream_tables_are_read_per_architecture_by_import(trees):
    upstream, _ = trees
    dump = table_diff.read_tables(upstream, sys.executable)
    assert dump["accessor"] == "_low_latency_table"
    assert set(dump["archs"]) == {"SM90", "SM100"}  # the int form (100) works too
    cfg = {"block_size": 32, "outputs_per_block": 2, "k_unroll": 1, "vector_width": 8,
           "static_k": None}
    assert [64, 128, 1, "cute", cfg] in dump["archs"]["SM90"]["rows"]
    assert [64, 128, 2, "dsv3_fused_a", None] in dump["archs"]["SM90"]["rows"]
    assert not list(upstream.rglob("__pycache__"))  # the tree is left as it was


def test_our_module_wins_the_import_over_the_trees_even_when_the_package_imports_it(trees):
    upstream, overlay = trees
    dump = table_diff.read_tables(upstream, sys.executable, prefer=overlay)
    assert dump["accessor"] == "device_table" and Path(dump["module"]).parent == overlay
    assert set(dump["archs"]) == {"SM90"}
    assert dump["archs"]["SM90"]["residual"] == [[64, 128, 1, {
        "block_size": 32, "outputs_per_block": 2, "k_unroll": 1, "vector_width": 8,
        "static_k": None}]]


def test_diff_sorts_rows_into_upstream_only_ours_only_different_and_same(trees):
    upstream, overlay = trees
    up = table_diff.read_tables(upstream, sys.executable)
    us = table_diff.read_tables(upstream, sys.executable, prefer=overlay)
    section = table_diff.section(up, us, upstream, upstream, overlay)
    assert section["ours"]["module"] == f"overlay/{PKG}/low_latency_gemm.py"
    sm90 = section["archs"]["SM90"]
    rows = {kind: [(d["N"], d["K"], d["M"], d["residual"]) for d in sm90[kind]]
            for kind in table_diff.KINDS}
    assert rows == {"upstream_only": [(64, 128, 2, False)],  # dsv3 row we dropped
                    "ours_only": [(64, 128, 3, False), (64, 128, 1, True)],
                    "different": [(128, 64, 1, False)]}  # static_k differs
    assert sm90["same"] == 1  # (64, 128) M1
    assert table_diff.summary(section)["SM100"] == {"upstream_only": 1, "ours_only": 0,
                                                    "different": 0, "same": 0}


def test_an_unreadable_module_is_one_line_naming_the_problem(tmp_path):
    tree = make_tree(tmp_path / "t", "import not_a_module_here\n")
    with pytest.raises(table_diff.TableReadError, match="No module named 'not_a_module_here'"):
        table_diff.read_tables(tree, sys.executable)
    tree2 = make_tree(tmp_path / "t2", "X = 1\n")
    with pytest.raises(table_diff.TableReadError, match="no table accessor"):
        table_diff.read_tables(tree2, sys.executable)


REQ_COMMON = "regex\nrequests >= 2.26.0\n"
REQ_CUDA = textwrap.dedent("""\
    -r common.txt
    numba == 0.65.0 # Required for N-gram speculative decoding
    torch==2.14.0
    --extra-index-url https://flashinfer.ai/whl/
    flashinfer-python==0.7.2.post1
    nvidia-cutlass-dsl[cu13]==4.8.0
    quack-kernels==0.6.5  # Required by MSA
    """)


def requirements_tree(root: Path, cuda: str = REQ_CUDA, common: str = REQ_COMMON) -> Path:
    (root / "requirements").mkdir(parents=True)
    (root / "requirements" / "common.txt").write_text(common)
    (root / "requirements" / "cuda.txt").write_text(cuda)
    return root


def test_target_env_reads_the_torch_pin_and_the_cute_dsl_line(tmp_path):
    tree = requirements_tree(tmp_path / "t")
    spec = target_env.spec_of(tree)
    assert spec.torch == "2.14.0"
    assert spec.cute_dsl == ("nvidia-cutlass-dsl[cu13]==4.8.0",)
    assert spec.common == REQ_COMMON


def test_target_env_key_changes_with_any_pin_and_only_then(tmp_path):
    a = target_env.spec_of(requirements_tree(tmp_path / "a"))
    b = target_env.spec_of(requirements_tree(tmp_path / "b"))
    c = target_env.spec_of(requirements_tree(tmp_path / "c", REQ_CUDA.replace("4.8.0", "4.7.1")))
    d = target_env.spec_of(requirements_tree(tmp_path / "d", common=REQ_COMMON + "cbor2\n"))
    assert a.key == b.key
    assert len({a.key, c.key, d.key}) == 3


def test_target_env_without_common_requirements_is_an_env_error(tmp_path):
    with pytest.raises(target_env.EnvError, match="requirements/common.txt"):
        target_env.ensure(tmp_path, root=tmp_path / "envs")


JUNIT = """<?xml version="1.0"?><testsuites><testsuite name="pytest">
<testcase classname="tests.kernels.test_x" name="test_ok"/>
<testcase classname="tests.kernels.test_x" name="test_skip"><skipped message="no GPU"/></testcase>
<testcase classname="tests.kernels.test_x" name="test_cuda"><failure message="ModuleNotFoundError">
E   ModuleNotFoundError: No module named 'cuda'</failure></testcase>
<testcase classname="tests.kernels.test_x" name="test_tree"><failure message="boom">
E   ModuleNotFoundError: No module named 'vllm.gone'</failure></testcase>
<testcase classname="" name="tests.kernels.test_y"><error message="collection failure">
E   AssertionError: 1 != 2</error></testcase>
</testsuite></testsuites>"""


def test_a_missing_third_party_module_is_an_environment_error_not_a_failure(tmp_path):
    (tmp_path / "vllm").mkdir()
    xml = tmp_path / "j.xml"
    xml.write_text(JUNIT)
    run = cpu_tier.count_junit(xml, tmp_path)
    assert (run.passed, run.failed, run.skipped, run.errors, run.env_errors) == (1, 1, 1, 1, 1)
    assert run.problems == [  # every count explained, by its first line
        Problem("tests/kernels/test_x.py::test_cuda", "no module named 'cuda'", "environment"),
        Problem("tests/kernels/test_x.py::test_tree",
                "ModuleNotFoundError: No module named 'vllm.gone'", "failed"),
        Problem("tests/kernels/test_y.py", "AssertionError: 1 != 2", "error")]
    assert cpu_tier.count_junit(xml).failed == 2  # without the tree, nothing is excused


TABLES = {"upstream": {"module": "vllm/x.py", "accessor": "_low_latency_table"},
          "ours": {"module": "overlay/x.py", "accessor": "device_table"},
          "archs": {"SM90": {"upstream_only": [{"N": 64, "K": 128, "M": 2, "residual": False,
                                                "upstream": {"backend": "dsv3_fused_a",
                                                             "config": None},
                                                "ours": None}],
                             "ours_only": [], "different": [], "same": 3}}}


def report_with_sections() -> Report:
    r = Report("0.1.0", "v0.28.0", "v0.29.0", ref_sha="a" * 40)
    r.runs = [TestRun(passed=5, skipped=1, env_errors=2, problems=[
        Problem("tests/t.py::test_a", "no module named 'cuda'", "environment")] * 2)]
    r.sections = [table_diff.as_section(TABLES, "v0.29.0")]
    return r


def test_environment_errors_get_their_own_exit_code_below_test_failures():
    r = report_with_sections()
    assert r.exit_code == errors.ENVIRONMENT
    r.runs.append(gpu_report.gpu_run({"passed": 1, "failed": 1, "skipped": 0, "errors": 0}))
    assert r.exit_code == errors.VERIFY


def test_junit_has_a_case_per_section_written_by_junit_xml():
    r = report_with_sections()
    r.runs.append(gpu_report.gpu_run({"passed": 3, "failed": 1, "skipped": 0, "errors": 0}))
    r.sections.append(gpu_report.ab_section({"error": "no CUDA"}))
    suite = ET.fromstring(junit_xml([r]))[0]
    cases = {c.get("name"): c for c in suite.iter("testcase")}
    assert cases["table diff"].find("failure") is None
    assert cases["table diff"].find("system-out").text == \
        "SM90 1 upstream only, 0 ours only, 0 different, 3 same"
    assert cases["gpu tests"].find("failure") is not None
    assert cases["gpu a/b ours vs upstream vs cuBLAS"].find("error") is not None
    assert cases["cpu tests"].find("error") is not None  # environment, not the tree
    assert suite.get("failures") == "1" and suite.get("errors") == "2"


def test_markdown_shows_the_table_diff_and_its_rows():
    text = markdown([report_with_sections()])
    first, details = text.split("\n---\n")
    assert "- table diff: SM90 1 upstream only, 0 ours only, 0 different, 3 same" in first
    assert "2 environment errors" in first
    assert "| SM90 | upstream only | 64x128 M2 | dsv3_fused_a | cuBLAS |" in details
    assert ("Upstream's `vllm/x.py` as v0.29.0 released it vs ours, `overlay/x.py`."
            in details)  # no "released tree/..." path that exists nowhere


def test_the_table_diff_names_modules_as_a_maintainer_finds_them(tmp_path):
    released, built, ours = tmp_path / "released", tmp_path / "built", tmp_path / "ov"
    up = {"module": str(released / PKG / "low_latency_gemm.py"), "accessor": "a", "archs": {}}
    us = {"module": str(ours / "low_latency_gemm.py"), "accessor": "b", "archs": {}}
    section = table_diff.section(up, us, released, built, ours)
    assert section["upstream"]["module"] == f"{PKG}/low_latency_gemm.py"
    assert section["ours"]["module"] == f"overlay/{PKG}/low_latency_gemm.py"


def test_table_rows_past_the_limit_are_counted_not_listed():
    rows = [{"N": 64, "K": 128, "M": m, "residual": False, "upstream": None,
             "ours": {"backend": "cute", "config": None}} for m in range(1, 100)]
    tables = {**TABLES, "archs": {"SM90": {"upstream_only": [], "ours_only": rows,
                                           "different": [], "same": 0}}}
    details = table_diff.as_section(tables, "v0.29.0").details.splitlines()
    assert len([line for line in details if line.startswith("| SM90 |")]) == table_diff.DETAIL_ROWS
    assert f"{99 - table_diff.DETAIL_ROWS} more rows in the JSON report's `tables`." in details


def row(n, k, m, up_us, our_us, cublas=10.0):
    def side(us):
        return {"backend": "cute", "us": us, "speedup": cublas / us}
    out = {"N": n, "K": k, "M": m, "residual": False, "cublas_us": cublas,
           "upstream": side(up_us), "ours": side(our_us)}
    out["winner"] = ab.winner(out["upstream"], out["ours"])
    return out


def test_ab_union_rows_fall_back_to_cublas_where_a_side_has_no_row():
    up = {"archs": {"SM90": {"rows": [[1, 2, 1, "cute", {"a": 1}], [1, 2, 2, "dsv3_fused_a", None]],
                             "residual": []}}}
    us = {"archs": {"SM90": {"rows": [[1, 2, 1, "cute", {"a": 2}]], "residual": [[1, 2, 1, {"a": 3}]]},
                    "SM100": {"rows": [[9, 9, 1, "cute", {}]], "residual": []}}}
    rows = ab.union_rows(up, us, "SM90")
    assert [(r["M"], r["residual"]) for r in rows] == [(1, False), (2, False), (1, True)]
    assert rows[1]["ours"] is None and rows[2]["upstream"] is None
    assert ab.union_rows(up, us, "SM100")[0]["upstream"] is None


def test_ab_winner_and_geomeans():
    rows = [row(1, 1, 1, 5.0, 4.0), row(1, 1, 2, 4.0, 5.0), row(1, 1, 3, 5.0, 5.05)]
    rows.append({"N": 1, "K": 1, "M": 4, "residual": False, "winner": "unmeasured",
                 "upstream": {"backend": "dsv3_fused_a", "status": "unmeasured: not built"},
                 "ours": {"backend": "cute", "us": 1.0, "speedup": 10.0}})
    assert [r["winner"] for r in rows] == ["ours", "upstream", "tie", "unmeasured"]
    s = ab.summarize(rows)
    assert s["wins"] == {"ours": 1, "upstream": 1, "tie": 1} and s["measured"] == 3
    # speedups over cuBLAS (10 us): ours 2.5, 2.0, 1.98; upstream 2.0, 2.5, 2.0
    assert s["geomean_ours"] == round((2.5 * 2.0 * (10 / 5.05)) ** (1 / 3), 4)
    assert s["geomean_upstream"] == round((2.0 * 2.5 * 2.0) ** (1 / 3), 4)
    assert s["unmeasured"] == [[1, 1, 4, "upstream: unmeasured: not built"]]


def test_gpu_results_of_another_tree_are_refused():
    got = SimpleNamespace(gpu=None, ab=None)  # what the job hands ``stage.attach``
    stage.attach(got, {"tree_sha": "b" * 40, "gpu": {"passed": 1}}, "c" * 40)
    assert "env_error" in got.gpu and got.ab is None
    assert gpu_report.gpu_run(got.gpu).exit_code == errors.ENVIRONMENT
    stage.attach(got, {"tree_sha": "c" * 40, "gpu": {"passed": 1}, "ab": {"rows": []}}, "c" * 40)
    assert got.gpu == {"passed": 1} and got.ab == {"rows": []}


def test_only_the_first_sites_cute_dsl_goes_on_the_path(tmp_path):
    new, base = tmp_path / "new", tmp_path / "base"
    for site in (new, base):
        (site / "nvidia_cutlass_dsl" / "dsl_packages").mkdir(parents=True)
    paths = python_path(tmp_path / "tree", [new, base])
    assert paths[:4] == [str(tmp_path / "tree"), str(new),
                         str(new / "nvidia_cutlass_dsl" / "dsl_packages"), str(base)]
    assert str(base / "nvidia_cutlass_dsl" / "dsl_packages") not in paths


def test_results_folder_is_keyed_by_ref(tmp_path):
    (tmp_path / "v0.29.0.json").write_text(json.dumps({"ref": "v0.29.0", "tree_sha": "x"}))
    (tmp_path / "other.json").write_text(json.dumps([1, 2]))
    assert list(stage.load_results(tmp_path)) == ["v0.29.0"]


def _target_tree(trees: Path, ref: str, cute_dsl: str) -> None:
    (trees / ref).mkdir(parents=True)
    (trees / ref / "meta.json").write_text(json.dumps({"cute_dsl": [f"nvidia-cutlass-dsl[cu13]=={cute_dsl}"]}))
    (trees / ref / "tree.tar.xz").write_bytes(b"x")


def test_addon_refuses_a_target_whose_cute_dsl_it_would_not_carry(tmp_path):
    import tarfile

    base = next(t for t in targets.load().values() if t.base)
    assert addon.cute_dsl_pin(["nvidia-cutlass-dsl[cu13]==4.8.0"]) == "4.8.0"
    _target_tree(tmp_path / "trees", "v9.9.9", "9.9.9")  # in no table of targets.toml
    with tarfile.open(tmp_path / "p.tar", "w") as tar:
        with pytest.raises(SystemExit, match=f"pins CuTe DSL 9.9.9, the base bundle carries {base.cute_dsl}"):
            addon.add_targets(tar, str(tmp_path / "trees"), str(tmp_path), "3.12")
    _target_tree(tmp_path / "same", "v9.9.8", base.cute_dsl)
    with tarfile.open(tmp_path / "q.tar", "w") as tar:  # the base bundle's wheels serve it
        assert addon.add_targets(tar, str(tmp_path / "same"), str(tmp_path), "3.12") == ["v9.9.8"]
        assert "targets/v9.9.8/wheels" not in " ".join(tar.getnames())


def test_addon_refuses_wheels_that_miss_the_targets_own_cute_dsl(tmp_path, monkeypatch):
    import tarfile

    known = targets.load()
    odd = targets.Target(ref="v9.9.7", torch="2.14.0", cute_dsl="4.8.0", flashinfer="x",
                         quack_kernels="y", gpu_stage=True, gpu_wheels=("quack-kernels==0.6.5",))
    monkeypatch.setattr(targets, "load", lambda: {**known, "v9.9.7": odd})
    _target_tree(tmp_path / "trees", "v9.9.7", "4.8.0")
    with tarfile.open(tmp_path / "p.tar", "w") as tar, pytest.raises(SystemExit, match="do not carry it"):
        addon.add_targets(tar, str(tmp_path / "trees"), str(tmp_path), "3.12")


def test_every_gpu_stage_target_that_pins_another_cute_dsl_lists_its_wheels():
    """What the add-on would refuse on the day it is built, refused now: the data file (the
    add-on carries the GPU stage's targets only)."""
    known = targets.load()
    base = [t for t in known.values() if t.base]
    assert len(base) == 1 and base[0].gpu_stage
    for t in known.values():
        if t.gpu_stage and t.cute_dsl != base[0].cute_dsl:
            assert f"nvidia-cutlass-dsl=={t.cute_dsl}" in t.gpu_wheels, t.ref


def test_other_backends_configs_come_out_as_their_fields():
    from collections import namedtuple

    from ci import table_dump

    swap = namedtuple("SwapAbConfig", "block_n block_k split_k")
    assert table_dump._config(swap(16, 128, 4)) == {"block_n": 16, "block_k": 128, "split_k": 4}
    assert table_dump._config((1, 2)) == [1, 2] and table_dump._config(None) is None
    with pytest.raises(LookupError, match="no handle for backend other"):
        ab._kernel_fn({"backend": "other", "config": None},
                      {"N": 1, "K": 8, "M": 1, "residual": False}, kernels=None)


CUTE = {"backend": "cute", "config": {"block_size": 32, "outputs_per_block": 2, "k_unroll": 1,
                                      "vector_width": 8, "static_k": None}}
AB = {"arch": "SM90", "method": "CUDA graphs, median of 50",
      "summary": {"measured": 2, "rows": 3, "geomean_ours": 1.31, "geomean_upstream": 1.12,
                  "geomean_ours_over_upstream": 1.17, "errors": 0,
                  "wins": {"ours": 2, "upstream": 0, "tie": 1}},
      "provenance": {"gpu": "NVIDIA H200", "date": "2026-11-30", "torch": "2.13.0",
                     "cutlass_dsl": "4.3.0"},
      "rows": [{"N": 64, "K": 256, "M": 1, "cublas_us": 6.5, "upstream": None,
                "ours": {**CUTE, "us": 4.25}, "winner": "ours"},
               {"N": 64, "K": 256, "M": 2, "cublas_us": 7.0, "winner": "cuBLAS",
                "upstream": {"backend": "dsv3_fused_a", "config": None, "status": "failed"},
                "ours": {"backend": "dsv3_fused_a", "config": None}}]}


def test_the_gpu_stage_as_the_report_gets_it():
    gpu = {"passed": 5, "failed": 0, "skipped": 1, "errors": 0, "ours_from": "overlay",
           "env": {"gpu": "NVIDIA H200", "torch": "2.13.0", "count": 1},
           "suites": {"kernels": {"passed": 5, "skipped": 1, "ran": 6, "note": "cut"}}}
    run = gpu_report.gpu_run(gpu)
    assert (run.key, run.name, run.line()) == ("gpu", "gpu tests",
                                               "5 passed, 0 failed, 1 skipped, 0 errors")
    assert run.env == {"gpu": "NVIDIA H200", "torch": "2.13.0"}
    assert run.suites["kernels"].line() == "5 passed, 0 failed, 1 skipped, 0 errors; cut"
    assert run.to_json()["ours_from"] == "overlay"  # what else the stage said, kept
    assert run.to_json()["suites"]["kernels"]["ran"] == 6
    section = gpu_report.ab_section(AB)
    assert section.lines == [
        "SM90 2/3 rows measured; geo-mean x cuBLAS ours 1.31 upstream 1.12 (ours/upstream 1.17); "
        "wins ours 2, upstream 0, tie 1"] and not section.error and section.data is AB
    assert section.details.splitlines() == [
        "Measured on NVIDIA H200 2026-11-30, torch 2.13.0, nvidia-cutlass-dsl 4.3.0; "
        "CUDA graphs, median of 50", "",
        "| N x K | M | cuBLAS µs | upstream | µs | ours | µs | faster |",
        "|---|--:|--:|---|--:|---|--:|---|",
        "| 64x256 | 1 | 6.5 | cuBLAS | = | cute 32,2,1,8,- | 4.25 | ours |",
        "| 64x256 | 2 | 7.0 | dsv3_fused_a | failed | dsv3_fused_a | n/a | cuBLAS |"]
    assert gpu_report.ab_section({**AB, "arch": None} | {"arch": "?"}).lines[0].startswith("? 2/3")
    assert gpu_report.ab_section({"error": "no CUDA"}).error == "not run: no CUDA"


def test_cpu_tier_runs_our_tests_only_on_a_tree_that_holds_our_overlay(tmp_path):
    # A tree where our module conflicted holds upstream's: our test files, imported against
    # it, error at collection. The tier leaves them out, says why, and still runs upstream's.
    tree = tmp_path / "tree"
    (tree / "vllm").mkdir(parents=True)
    (tree / "vllm/__init__.py").write_text("")
    (tree / "vllm/llg.py").write_text("TABLE = {}\n")  # upstream's module: no BACKENDS
    (tree / "tests/kernels").mkdir(parents=True)
    (tree / cpu_tier.UPSTREAM_FILES[0]).write_text("def test_upstream():\n    pass\n")
    for name in cpu_tier.OUR_FILES:
        (tree / name).write_text("from vllm import llg\nBACKENDS = llg.BACKENDS\n\n"
                                 "def test_ours():\n    pass\n")
    run = cpu_tier.run_cpu_tier(tree, sys.executable, lacks_overlay="overlay vllm/llg.py conflicts")
    assert (run.passed, run.failed, run.errors) == (1, 0, 0)
    assert run.not_run == [f"{name}: the tree lacks our overlay (overlay vllm/llg.py "
                           f"conflicts)" for name in cpu_tier.OUR_FILES]
    whole = cpu_tier.run_cpu_tier(tree, sys.executable)  # a tree said to hold it all: run all
    assert whole.errors == len(cpu_tier.OUR_FILES) and not whole.not_run
    assert {p.first_line for p in whole.problems} == {
        "AttributeError: module 'vllm.llg' has no attribute 'BACKENDS'"}
    assert sorted(p.test for p in whole.problems) == sorted(cpu_tier.OUR_FILES)


# -- Found after issue 8: the cache's own files (``~/.cache/vllm-k3-overlay``) were opened by
# name, following links and waiting on FIFOs. A FIFO at the download lock hung the run for
# good; a link at a partial download was written through. Every file the tool keeps there
# (lock files, cached and partial downloads, the test environments' records, the CuTe DSL
# mark) is now opened without following a link or waiting on a FIFO: anything but a regular
# file is one line, exit 2, and left as it was.


def test_target_environment_lock_and_record_are_never_followed_or_waited_on(tmp_path, monkeypatch):
    tree = tmp_path / "tree"
    (tree / "requirements").mkdir(parents=True)
    (tree / "requirements" / "common.txt").write_text("regex\n")
    key = target_env.spec_of(tree).key
    root = tmp_path / "envs"
    lock_as_it_was = plant(root / f"{key}.lock", "FIFO", tmp_path / "unused")
    with pytest.raises(errors.UsageError, match="is a FIFO, not a regular file"):
        target_env.ensure(tree, root)
    assert lock_as_it_was()
    os.unlink(root / f"{key}.lock")

    # a record that is a FIFO is not read (it would never end): the environment is built again
    (root / key).mkdir(parents=True)
    os.mkfifo(root / key / "env.json")
    built = []

    def build(spec, tree, home):
        built.append(home)
        (home / "env.json").unlink()  # the real build starts from an empty folder too
        (home / "env.json").write_text('{"installed_torch": "2.13.0"}')

    monkeypatch.setattr(target_env, "_build", build)
    env = target_env.ensure(tree, root)
    assert built == [root / key] and env.torch == "2.13.0"
