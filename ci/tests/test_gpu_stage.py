"""The GPU stage's deadlines, shards and records, on the CPU: what a stage cut short reports.

Real pytest runs (in shards, as on the runner) on hand-written test files stand in for the
GPU suites; expectations are the outcomes written into those files. The A/B runs
its real worker processes, which on this GPU-less machine can only say why a row has no
time. The last test runs ``offline.sh`` itself end to end on a synthetic add-on bundle.
"""

from __future__ import annotations

import errno
import hashlib
import json
import os
import subprocess
import sys
import tarfile
import textwrap
import time
from pathlib import Path

import pytest

from ci.gpu_report import ab_section
from ci.gpu_stage import ab, compile_shards, pytest_record, run, stage, summary
from k3overlay import errors, files
from k3overlay.project import ROOT, cache_dir
from k3overlay.report import Report, markdown
from tests.test_downloads import WHAT, plant

CI = str(ROOT / "ci")

# 2 pass, 1 skips, 1 fails, 1 errors in setup, then one that outlives any deadline.
CUT_SUITE = textwrap.dedent("""\
    import time
    import pytest

    @pytest.fixture
    def broken():
        raise RuntimeError("setup breaks")

    @pytest.mark.parametrize("i", [1, 2])
    def test_a_pass(i):
        assert i

    def test_b_skip():
        pytest.skip("not here")

    def test_c_fail():
        assert 1 == 2

    def test_d_error(broken):
        pass

    def test_e_hangs():
        time.sleep(600)
    """)

# Six CuTe configs, two rows each, two tests per row and one per config (as the plain,
# graph and residual tests of routed rows); Triton configs and a plain test stay apart.
GROUPED_SUITE = textwrap.dedent("""\
    import pytest
    from collections import namedtuple

    SkinnyGemmConfig = namedtuple("SkinnyGemmConfig", "cfg n")
    SwapAbConfig = namedtuple("SwapAbConfig", "cfg n")
    Row = namedtuple("Row", "n config")
    ROWS = [Row(n, SkinnyGemmConfig("cfg", n % 6)) for n in range(12)]

    @pytest.mark.parametrize("row", [Row(n, SwapAbConfig("cfg", 0)) for n in range(4)], ids=str)
    def test_triton(row):
        pass

    @pytest.mark.parametrize("row", ROWS, ids=str)
    def test_plain(row):
        pass

    @pytest.mark.parametrize("row", ROWS, ids=str)
    def test_residual(row):
        pass

    @pytest.mark.parametrize("config", sorted({r.config for r in ROWS}), ids=str)
    def test_by_config(config):
        pass

    def test_ungrouped():
        pass
    """)


def write_tree(root: Path, files: dict[str, str]) -> Path:
    for rel, text in files.items():
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_text(text)
    return root


def test_a_suite_cut_at_its_deadline_counts_the_tests_that_ran(tmp_path):
    tree = write_tree(tmp_path / "tree", {"tests/test_cut.py": CUT_SUITE})
    start = time.monotonic()
    result = run.run_suite(tree, ("tests/test_cut.py",), dict(os.environ, PYTHONPATH=CI),
                           2, 25, tmp_path / "rec.jsonl")
    assert time.monotonic() - start < 60, "the hanging test was not stopped at the deadline"
    assert {k: result[k] for k in ("passed", "skipped", "failed")} == \
        {"passed": 2, "skipped": 1, "failed": 1}
    assert result["errors"] == 2  # test_d_error's setup, and the cut itself
    assert (result["ran"], result["collected"]) == (5, 6)
    assert "finished" not in result and "cut at its deadline" in result["note"]
    assert "5 of 6 tests" in result["note"]
    assert "test_c_fail" in json.dumps(result["timing"]["slowest"])


def test_a_suite_that_ends_counts_as_junit_would_and_splits_by_file(tmp_path):
    tree = write_tree(tmp_path / "tree", {
        "tests/test_one.py": "import pytest\n\ndef test_p():\n    pass\n\n"
                             "def test_s():\n    pytest.skip('x')\n",
        "tests/test_two.py": "import no_such_dep_k3  # noqa: F401\n\ndef test_x():\n    pass\n"})
    result = run.run_suite(tree, ("tests/test_one.py", "tests/test_two.py"),
                           dict(os.environ, PYTHONPATH=CI), 1, 120, tmp_path / "rec.jsonl")
    assert result["finished"] == 1 and "note" not in result  # 1: the collection error
    assert (result["passed"], result["skipped"], result["failed"]) == (1, 1, 0)
    # A module the tree does not hold is the environment's fault, as in the CPU tier; a
    # file that cannot be collected does not stop the other file's tests.
    assert result["env_errors"] == 1 and result["env_causes"] == ["no module named 'no_such_dep_k3'"]
    assert result["files"]["tests/test_one.py"]["passed"] == 1
    assert result["files"]["tests/test_two.py"]["env_errors"] == 1


def test_the_tests_of_one_kernel_config_run_in_one_shard(tmp_path):
    tree = write_tree(tmp_path / "tree", {"tests/test_grouped.py": GROUPED_SUITE})
    record = tmp_path / "rec.jsonl"
    result = run.run_suite(tree, ("tests/test_grouped.py",), dict(os.environ, PYTHONPATH=CI),
                           3, 120, record)
    assert (result["passed"], result["collected"], result["finished"]) == (35, 35, 0)
    shards: dict[str, set] = {}
    entries = [e for i in range(3) for e in pytest_record.read(tmp_path / f"rec.{i}.jsonl")]
    triton = set()
    for nodeid, test in pytest_record.outcomes(entries).items():
        if "test_triton" in nodeid:
            triton.add(test["shard"])
        elif "ungrouped" not in nodeid:
            config = nodeid.split("cfg='cfg', n=")[1][0]  # SkinnyGemmConfig(cfg='cfg', n=3)
            shards.setdefault(config, set()).add(test["shard"])
    assert len(shards) == 6 and all(len(s) == 1 for s in shards.values()), shards
    assert set().union(*shards.values()) == {"0", "1", "2"}
    assert len(triton) > 1, "the Triton rows were grouped"
    # Six groups of cost 5, the plain test (1), four Triton rows (0.05 each), each to the
    # cheapest shard: 10 + 1, 10 + 2, 10 + 2 tests.
    per_shard = [sum(1 for t in pytest_record.outcomes(entries).values() if t["shard"] == str(i))
                 for i in range(3)]
    assert sorted(per_shard) == [11, 12, 12]


def test_shards_are_balanced_by_cost_not_by_count():
    def item(name, **params):
        return type("I", (), {"nodeid": name, "callspec": type("C", (), {"params": params})})

    triton = type("SwapAbConfig", (), {})()
    light = [item(f"t{i}", config=triton) for i in range(19)]  # 19 x 0.05 < 1
    heavy = [item("kda", m=1), item("kda2", m=2)]  # 1 each: no config, may compile
    assert compile_shards.assign(light + heavy, 3) == [2] * 19 + [0, 1]


def test_a_killed_pytest_leaves_no_partial_line_in_the_counts(tmp_path):
    record = tmp_path / "rec.jsonl"
    record.write_text(json.dumps({"collected": 3}) + "\n"
                      + json.dumps({"nodeid": "t.py::a", "when": "call", "outcome": "passed",
                                    "duration": 0.5}) + "\n" + '{"nodeid": "t.py::b", "wh')
    counts = pytest_record.counts(pytest_record.read(record), tmp_path, lambda text, tree: None)
    assert (counts["passed"], counts["ran"], counts["collected"]) == (1, 1, 3)


AB_ROWS = [{"N": 64, "K": 128, "M": m, "residual": False, "upstream": None,
            "ours": {"backend": "cute", "config": {}}} for m in (1, 2, 3)]


def fake_clock(moves_on):
    """A clock for ``ab.measure`` that stands at 0 until ``moves_on()``, then jumps past any
    deadline and grace: what happens by the deadline is the test's choice, not the
    machine's speed. After 600 real seconds it jumps anyway, a guard against a hang only
    (a worker that never got there leaves its row not run, and the test fails)."""
    guard = time.monotonic() + 600
    return lambda: 1e9 if moves_on() or time.monotonic() > guard else 0.0


def began_then_hangs(row, lock_path, biggest, replays):
    """``ab.measure``'s ``run_row``, in a worker: says it began, then runs until killed."""
    Path(f"{lock_path}.began.{row['M']}").touch()
    time.sleep(3600)


def test_ab_rows_past_the_deadline_are_reported_not_run_and_streamed_in_order(tmp_path):
    # Past its deadline before it starts: the gate is closed before any worker could begin
    # a row, so however slowly workers would start, no row is reported still running.
    seen = []
    results = ab.measure(AB_ROWS, lock_path=str(tmp_path / "lock"), workers=2, replays=3,
                         deadline_s=-1, on_row=lambda done: seen.append([r["M"] for r in done]))
    assert [r["status"] for r in results] == ["not run: deadline"] * 3
    assert len(seen) == 3 and seen[-1] == [1, 2, 3] and all(s == sorted(s) for s in seen)
    s = ab.summarize(results)
    assert (s["measured"], s["rows"], s["errors"]) == (0, 3, 0)


def test_ab_row_begun_and_running_past_the_grace_is_still_running_the_rest_not_run(tmp_path):
    """One worker begins a row that never ends; the clock moves past the deadline and the
    grace only once it has begun. The rows queued behind it never began: ``not run:
    deadline``, settled at the deadline (so streamed), not when the pool is given up."""
    seen = []
    began = lambda: sorted(tmp_path.glob("lock.began.*"))  # noqa: E731
    results = ab.measure(AB_ROWS, lock_path=str(tmp_path / "lock"), workers=1, replays=3,
                         deadline_s=10, grace_s=5, clock=fake_clock(lambda: bool(began())),
                         on_row=lambda done: seen.append([r["M"] for r in done]),
                         run_row=began_then_hangs)
    [m] = [int(path.name.rsplit(".", 1)[1]) for path in began()]
    assert {r["M"]: r["status"] for r in results} == {
        k: "not run: deadline (still running)" if k == m else "not run: deadline"
        for k in (1, 2, 3)}
    assert len(seen) == 2 and seen[-1] == sorted({1, 2, 3} - {m})  # the abandoned row: not streamed
    assert ab.summarize(results)["measured"] == 0


def test_ab_row_handed_out_but_not_begun_when_the_gate_closes_is_not_run(monkeypatch, tmp_path):
    """A worker that reaches a row after the deadline does not begin it, however late."""
    import multiprocessing as mp

    gate = ab._new_gate(2, mp.get_context("spawn"))
    monkeypatch.setattr(ab, "_GATE", gate)
    ran = []

    def task(index):
        return ab._row_task((index, AB_ROWS[index], str(tmp_path / "lock"), 1, 3,
                             lambda row, *_: ran.append(row["M"]) or {"M": row["M"]}))

    assert task(0) == (0, {"M": 1})
    assert ab._close(gate) == [True, False]
    index, result = task(1)
    assert (index, result["status"], ran) == (1, "not run: deadline", [1])


def test_ab_row_whose_gpu_fails_is_an_error_row_not_a_crash(tmp_path):
    rows = [{"N": 64, "K": 128, "M": 1, "residual": False, "upstream": None, "ours": None}]
    results = ab.measure(rows, lock_path=str(tmp_path / "lock"), workers=1, replays=3,
                         deadline_s=120, clock=fake_clock(lambda: False))
    assert results[0]["winner"] == "unmeasured" and results[0]["status"].startswith("error: ")
    assert ab.summarize(results)["errors"] == 1


def test_markdown_and_summary_show_a_partial_ab_and_a_cut_suite():
    rows = [{"N": 64, "K": 128, "M": 1, "residual": False, "upstream": None, "ours": None,
             "winner": "unmeasured", "status": "not run: deadline"}]
    section = {"arch": "SM90", "rows": rows, "summary": ab.summarize(rows),
               "partial": "1 of 3 rows; the stage stopped before the rest"}
    r = Report("0.1.0", "v0.28.0", "v0.29.0")
    r.sections = [ab_section(section)]
    text = markdown([r])
    assert "| 64x128 | 1 | not run: deadline |" in text and "partial: 1 of 3 rows" in text
    cut = {"passed": 5, "errors": 1, "ran": 5, "collected": 9, "note": "cut at its deadline"}
    out = "\n".join(summary.lines({"ref": "v0.29.0", "tree_sha": "ab" * 20,
                                   "gpu": {"suites": {"ours": cut}}, "ab": section}))
    assert "ours: 5 passed 1 errors (5/9 ran); cut at its deadline" in out
    assert "0/1 rows measured" in out and "partial: 1 of 3 rows" in out


def test_offline_run_installs_an_add_on_and_reports_every_target(tmp_path):
    """offline.sh stash + run on a synthetic add-on (two targets), without a GPU."""
    trees = tmp_path / "trees"
    suite = "def test_ok():\n    pass\n"
    for ref in ("v9.8.0", "v9.9.0"):
        tree = write_tree(tmp_path / "src" / ref, {
            "vllm/__init__.py": "", **{f: suite for f in run.VLLM_TESTS + run.OUR_TESTS}})
        (trees / ref).mkdir(parents=True)
        with tarfile.open(trees / ref / "tree.tar.xz", "w:xz") as tar:
            tar.add(tree, arcname=".")
        (trees / ref / "meta.json").write_text(json.dumps({
            "ref": ref, "tree_sha": ref * 4, "cute_dsl": [], "prefer": None,
            "tables": {"upstream": {"archs": {}}, "ours": {"archs": {}}}}))
    parts = tmp_path / "parts"
    subprocess.run([sys.executable, "-m", "ci.gpu_stage.addon", "--target-trees", str(trees),
                    "--part-mib", "0.001", "--out", str(parts)], cwd=ROOT, check=True)
    site = tmp_path / "site"
    write_tree(site, {".k3/env.sh": "", ".k3/k3/k3lab/device/no_compiled_vllm_shim.py": ""})
    env = dict(os.environ, SITE=str(site), STASH=str(tmp_path / "stash"), PYTHON=sys.executable,
               OUT=str(tmp_path / "out"), TESTS_END="120", AB_END="150", OURS_WORKERS="1",
               VLLM_WORKERS="1", AB_WORKERS="1")
    script = str(ROOT / "ci/gpu_stage/offline.sh")
    first, *rest = sorted(parts.iterdir())
    subprocess.run(["bash", script, "stash", str(first)], env=env, check=True, capture_output=True)
    proc = subprocess.run(["bash", script, "run", *map(str, rest)], env=env, capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    out = tmp_path / "out"
    assert sorted(p.name for p in out.iterdir()) == ["logs.tgz", "stage.log", "v9.8.0.json",
                                                     "v9.9.0.json"]
    for ref in ("v9.8.0", "v9.9.0"):
        result = json.loads((out / f"{ref}.json").read_text())
        assert result["tree_sha"] == ref * 4
        assert {n: s["passed"] for n, s in result["gpu"]["suites"].items()} == {"vllm": 1, "ours": 2}
        assert result["ab"]["error"]  # no GPU here: said, not crashed
        assert f"{ref} ({(ref * 4)[:12]})" in proc.stdout  # summary.py's block
    with tarfile.open(out / "logs.tgz") as tar:
        assert {"v9.8.0.ours.0.jsonl", "v9.9.0.vllm.0.jsonl", "v9.8.0.log"} <= set(tar.getnames())


def test_ab_times_ours_swap_ab_rows_with_our_triton_kernel():
    """A swap_ab choice resolves to the overlay's kernel at that config (no GPU: no compile)."""
    code = textwrap.dedent("""\
        from ci.gpu_stage import ab
        from k3lab import candidates
        row = {"N": 768, "K": 128, "M": 3, "residual": False}
        cfg = {"block_n": 64, "block_k": 128, "split_k": 1, "num_warps": 4, "num_stages": 6}
        fn = ab._kernel_fn({"backend": "swap_ab", "config": cfg}, row, kernels=None)
        mod = candidates.swap_ab_module()
        want = mod.SwapAbConfig(64, 128, 1, 4, 6)
        print(fn.__qualname__, any(c.cell_contents == want for c in fn.__closure__))
        """)
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True)
    assert out.stdout.split() == ["swap_ab.<locals>.f", "True"], out.stderr[-2000:]



# Found by the second adversarial pass: --gpu-export wrote each target's tree.tar.xz in
# place (a cut-short export left a truncated tarball that looked like a bundle) and its
# tarball and meta.json through any link already there. Both now land whole or not at all.

def _exported_tree(root: Path) -> Path:
    tree = root / "tree"
    (tree / "vllm").mkdir(parents=True)
    (tree / "vllm/_version.py").write_text("__version__ = version = '0.29.0'\n")
    (tree / "tests/kernels").mkdir(parents=True)
    (tree / "tests/kernels/test_x.py").write_text("def test_x():\n    pass\n")
    (tree / "pyproject.toml").write_text("[project]\nname = 'vllm'\n")
    return tree


def test_gpu_export_writes_the_tarball_and_meta_whole(tmp_path):
    out = tmp_path / "bundle"
    stage.export(_exported_tree(tmp_path), {"ref": "v0.29.0", "prefer": None}, out, "v0.29.0")
    assert sorted(os.listdir(out / "v0.29.0")) == ["meta.json", "tree.tar.xz"]
    with tarfile.open(out / "v0.29.0/tree.tar.xz") as tar:
        names = tar.getnames()
    assert {"vllm/_version.py", "tests/kernels/test_x.py", "pyproject.toml",
            "vllm-0.29.0.dist-info/METADATA"} <= set(names)
    assert json.loads((out / "v0.29.0/meta.json").read_text()) == {"ref": "v0.29.0", "prefer": None}


def test_gpu_export_writes_nothing_through_a_link_and_nothing_half(tmp_path, monkeypatch):
    tree, out = _exported_tree(tmp_path), tmp_path / "bundle"
    (out / "v0.29.0").mkdir(parents=True)
    outside = tmp_path / "outside.json"
    outside.write_text("not ours\n")
    (out / "v0.29.0/meta.json").symlink_to(outside)
    with pytest.raises(errors.UsageError) as err:
        stage.export(tree, {"ref": "v0.29.0", "prefer": None}, out, "v0.29.0")
    assert str(err.value) == ("refusing to write v0.29.0/meta.json: it is a symbolic link in the "
                              "tree, not a file")
    assert outside.read_text() == "not ours\n" and os.listdir(out / "v0.29.0") == ["meta.json"]
    (out / "v0.29.0/meta.json").unlink()

    def full(fd, data):  # the disk fills up at meta.json, after the tarball is on disk
        if data.startswith(b"{"):
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        os.write(fd, data)

    monkeypatch.setattr(files, "_write_all", full)
    with pytest.raises(errors.UsageError):
        stage.export(tree, {"ref": "v0.29.0", "prefer": None}, out, "v0.29.0")
    assert os.listdir(out / "v0.29.0") == []  # no tarball without its meta.json


def test_bundle_out_removes_only_an_earlier_bundles_part_files(tmp_path):
    """Found by the second adversarial pass: ``bundle.py --out DIR`` (whose parts the add-on
    writes too) took any entry named
    ``part-NNN`` for an earlier part and removed DIR whole: a file of the user's put in a
    part's folder went too."""
    trees = tmp_path / "trees"
    (trees / "v9.9.0").mkdir(parents=True)
    tree = write_tree(tmp_path / "src", {"vllm/__init__.py": ""})
    with tarfile.open(trees / "v9.9.0" / "tree.tar.xz", "w:xz") as tar:
        tar.add(tree, arcname=".")
    (trees / "v9.9.0" / "meta.json").write_text(json.dumps({"ref": "v9.9.0", "tree_sha": "a" * 40,
                                                           "cute_dsl": []}))
    out = tmp_path / "parts"
    bundle = [sys.executable, "-m", "ci.gpu_stage.addon", "--target-trees", str(trees),
              "--part-mib", "0.001", "--out", str(out)]
    subprocess.run(bundle, cwd=ROOT, check=True, capture_output=True)
    first = sorted(os.listdir(out))
    subprocess.run(bundle, cwd=ROOT, check=True, capture_output=True)  # earlier parts are replaced
    assert sorted(os.listdir(out)) == first and first[:2] == ["part-000", "part-001"]
    (out / "part-001" / "notes.txt").write_text("the user's\n")
    proc = subprocess.run(bundle, cwd=ROOT, capture_output=True, text=True)
    assert proc.returncode == 1 and proc.stderr.splitlines()[-1] == (
        f"--out {out} holds other files (part-001); pick an empty folder")
    assert (out / "part-001" / "notes.txt").read_text() == "the user's\n"
    assert sorted(os.listdir(out)) == first  # and no other part was removed either


# -- Found after issue 8: the cache's own files (``~/.cache/vllm-k3-overlay``) were opened by
# name, following links and waiting on FIFOs. A FIFO at the download lock hung the run for
# good; a link at a partial download was written through. Every file the tool keeps there
# (lock files, cached and partial downloads, the test environments' records, the CuTe DSL
# mark) is now opened without following a link or waiting on a FIFO: anything but a regular
# file is one line, exit 2, and left as it was.


def test_cute_dsl_mark_is_not_written_through_a_link(tmp_path, monkeypatch):
    lines = ("nvidia-cutlass-dsl==4.8.0",)
    key = hashlib.sha256(b'["nvidia-cutlass-dsl==4.8.0"]').hexdigest()[:16]
    outside = tmp_path / "outside" / "mark"
    as_it_was = plant(cache_dir() / "cute-dsl" / key / ".complete", "dangling link", outside)
    monkeypatch.setattr(stage.subprocess, "run", lambda *a, **k: subprocess.CompletedProcess(a, 0))
    with pytest.raises(RuntimeError, match=r"refusing to write \.complete: it is a symbolic link"):
        stage.cute_dsl_site(lines)
    assert as_it_was() and not outside.exists()


@pytest.mark.parametrize("what", WHAT)
def test_gpu_lock_in_the_shared_tmp_is_never_followed_or_waited_on(what, tmp_path):
    with ab.GpuLock(str(tmp_path / "fine.lock")):  # a regular file, made on first use
        assert (tmp_path / "fine.lock").is_file()
    path = tmp_path / "k3-gpu.lock"
    as_it_was = plant(path, what, tmp_path / "outside" / "target")
    with pytest.raises(OSError):
        with ab.GpuLock(str(path)):
            pass
    assert as_it_was()
