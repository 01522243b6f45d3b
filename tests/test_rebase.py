"""The rebase job, --rebase-to and --export on synthetic repos."""

from __future__ import annotations

import json
import os
import subprocess
import tempfile
import xml.etree.ElementTree as ET

import pytest

from k3overlay import errors
from k3overlay.export import export
from k3overlay.job import Options, run_apply
from k3overlay.rebase import rebase_to, run_rebase
from k3overlay.report import junit_xml, markdown
from k3overlay.stages import StageResults, TestRun

from .conftest import g


def model_test(target):
    """A stand-in for the job's stages: a test that passes when our patch's line is in the tree."""
    ok = "line 4 (ours)" in (target.built / "pkg/model.txt").read_text()
    return StageResults([TestRun(passed=int(ok), failed=int(not ok))])


@pytest.fixture
def reports(project, upstream):
    return {r.ref: r for r in run_rebase(project, ["v1.1.0", "v1.2.0", "v1.3.0", "v7.0.0"],
                                         vllm_repo=str(upstream), stages=model_test)}


def test_each_target_classified(reports):
    v11, v12, v13 = reports["v1.1.0"], reports["v1.2.0"], reports["v1.3.0"]
    assert [p.status for p in v11.patches] == ["applied-3way"] and v11.ok
    assert v11.to_json()["tests"] == {"passed": 1, "failed": 0, "skipped": 0, "errors": 0}
    assert [p.status for p in v12.patches] == ["landed-upstream"]
    mod12 = {f.path: f for f in v12.overlay}["pkg/mod.py"]
    assert mod12.status == "merged" and "Upstream docstring" in mod12.upstream_diff
    assert v12.ok and v12.verify.ok and v12.run("tests").passed == 1
    assert [p.status for p in v13.patches] == ["conflict"]
    assert v13.patches[0].files == ["pkg/model.txt"]
    mod13 = {f.path: f for f in v13.overlay}["pkg/mod.py"]
    assert mod13.status == "conflict" and "def theirs" in mod13.upstream_diff
    assert mod13.detail.endswith("; 3-way merge: 1 conflicting region(s)")  # both add at the end
    assert v13.exit_code == errors.CONFLICT
    assert v13.run("tests").failed == 1  # tests still ran, on what applied: upstream's line 4
    assert reports["v7.0.0"].exit_code == errors.USAGE and "not found" in reports["v7.0.0"].error
    assert reports["v7.0.0"].to_json()["overlay_version"] == "9.9.9"


def test_reports_render_for_ci(reports):
    ordered = list(reports.values())
    data = [r.to_json() for r in ordered]
    assert [d["ok"] for d in data] == [True, True, False, False]
    assert data[2]["tests"]["failed"] == 1
    suites = ET.fromstring(junit_xml(ordered))
    assert [s.get("failures") for s in suites] == ["0", "0", "3", "0"]
    assert [s.get("errors") for s in suites] == ["0", "0", "0", "1"]  # v7.0.0: not found
    text = markdown(ordered)
    assert "### v1.2.0 " in text and "landed-upstream: 0001" in text and "Upstream docstring" in text


def test_export_round_trips(project, upstream, tmp_path):
    wd = tmp_path / "wd"
    first = run_apply(project, Options(vllm_repo=str(upstream), workdir=wd))
    tree = g(wd, "rev-parse", "HEAD^{tree}")
    before = {p.name: p.read_bytes() for p in project.patches_dir.iterdir()}
    result = export(project, wd)
    assert first.ok and result.dropped == [] and result.base == "v1.0.0"
    after = {p.name: p.read_bytes() for p in project.patches_dir.iterdir()}
    assert after == before  # same names, same bytes
    export(project, wd)
    assert {p.name: p.read_bytes() for p in project.patches_dir.iterdir()} == after  # no churn
    again = run_apply(project, Options(vllm_repo=str(upstream), workdir=tmp_path / "wd2"))
    assert again.ok and g(tmp_path / "wd2", "rev-parse", "HEAD^{tree}") == tree


def test_rebase_to_merged_target_then_export(project, upstream, tmp_path):
    wd = tmp_path / "wd"
    report = rebase_to(project, Options(ref="v1.2.0", vllm_repo=str(upstream), workdir=wd))
    assert report.ok, report.to_json()
    assert [p.status for p in report.patches] == ["landed-upstream"]
    result = export(project, wd)
    assert result.patches == [] and result.dropped == ["0001-model-line-4.patch"]
    assert result.range_diff == ""  # nothing left to compare with: `dropped` says it
    assert (project.patches_dir / "series").read_text() == ""
    mod = (project.overlay_dir / "pkg/mod.py").read_text()
    assert mod.startswith('"""Upstream docstring."""') and "def ours" in mod
    manifest = json.loads(project.manifest_path.read_text())
    blobs = {f["path"]: f["base_blob"] for f in manifest["files"]}
    assert manifest["base"] == "v1.2.0"
    assert blobs == {"pkg/mod.py": g(upstream, "rev-parse", "v1.2.0:pkg/mod.py").strip(),
                     "pkg/new.py": "new"}
    check = run_apply(project, Options(ref="v1.2.0", vllm_repo=str(upstream), workdir=tmp_path / "w2"))
    assert check.ok and {f.path: f.status for f in check.overlay}["pkg/mod.py"] == "replaced"


@pytest.mark.parametrize("fails", [False, True])
def test_rebase_to_into_a_new_folder_from_a_source_of_tags_only(project, upstream, tmp_path, fails):
    """Round 6 (F4): the release mirror (the default source) holds tags and no branch, so its
    clone checks nothing out; --rebase-to into a new --workdir then refused its own clone as
    "a git repository with no commit yet" and left it there, refused by every later run. Now
    the clone goes on to the switch; a run that stops before the switch removes it."""
    tags = tmp_path / "tags.git"
    g(tmp_path, "clone", "-q", "--bare", str(upstream), str(tags))
    for branch in g(tags, "for-each-ref", "--format=%(refname)", "refs/heads/").split():
        g(tags, "update-ref", "-d", branch)
    wd = tmp_path / "new"
    opts = Options(ref="v9.9.9" if fails else "v1.2.0", vllm_repo=str(tags), workdir=wd)
    if fails:  # a ref the source lacks: refused after the clone, before the switch
        with pytest.raises(errors.OverlayError):
            rebase_to(project, opts)
        assert not wd.exists()
        return
    report = rebase_to(project, opts)
    assert report.ok, report.to_json()
    assert g(wd, "symbolic-ref", "--short", "HEAD").strip() == report.branch
    assert g(wd, "status", "--porcelain") == ""


def test_rebase_to_conflicts_resolved_by_maintainer(project, upstream, tmp_path):
    wd = tmp_path / "wd"
    opts = Options(ref="v1.3.0", vllm_repo=str(upstream), workdir=wd)
    first = rebase_to(project, opts)
    assert first.exit_code == errors.CONFLICT and (wd / ".git/rebase-apply").is_dir()
    with pytest.raises(errors.UsageError, match="in progress"):
        rebase_to(project, opts)
    (wd / ".git/index.lock").touch()  # a killed `git am` leaves one, and `git am --abort` fails on it:
    with pytest.raises(errors.UsageError, match="index.lock exists"):  # said first (round 6)
        rebase_to(project, opts)
    (wd / ".git/index.lock").unlink()
    (wd / "pkg/model.txt").write_text(
        "\n".join(["line 1 (upstream)", "line 2", "line 3", "line 4 (ours+theirs)"]
                  + [f"line {i}" for i in range(5, 13)]) + "\n")
    g(wd, "add", "pkg/model.txt")
    subprocess.run(["git", "am", "--continue"], cwd=wd, check=True, capture_output=True,
                   env={"GIT_COMMITTER_NAME": "m", "GIT_COMMITTER_EMAIL": "m@m", "PATH": "/usr/bin:/bin"})
    second = rebase_to(project, opts)
    assert second.exit_code == errors.DRIFT
    assert {f.path: f.status for f in second.overlay}["pkg/mod.py"] == "conflict"
    assert "<<<<<<<" in (wd / "pkg/mod.py").read_text()
    (wd / "pkg/mod.py").write_text((wd / "pkg/mod.py").read_text().replace("<<<<<<< ours\n", "")
                                   .replace("=======\n", "").split(">>>>>>>")[0])
    g(wd, "commit", "-qam", "resolve pkg/mod.py")
    resolved = (wd / "pkg/mod.py").read_text()
    third = rebase_to(project, opts)  # re-running must not lay markers over the resolution
    assert third.ok and "the overlay is already committed on the branch (a resolution is never " \
        "overwritten): run apply.py --export" in third.notes
    assert (wd / "pkg/mod.py").read_text() == resolved and g(wd, "status", "--porcelain") == ""
    # a resolution that breaks the tree: re-running checks it again, never "ok" (round 5, F4)
    (wd / "pkg/mod.py").write_text(resolved + "def broken(:\n")
    g(wd, "commit", "-qam", "a resolution that does not compile")
    fourth = rebase_to(project, opts)
    assert fourth.exit_code == errors.VERIFY and not fourth.ok
    assert any(n.endswith("fix what verify found, commit, run this again") for n in fourth.notes)
    g(wd, "reset", "-q", "--hard", "HEAD~1")
    result = export(project, wd)
    assert result.patches == ["0001-model-line-4.patch"] and result.base == "v1.3.0"
    patch = (project.patches_dir / result.patches[0]).read_text()
    assert "+line 4 (ours+theirs)" in patch and "Upstream-Status: Pending" in patch
    assert result.range_diff.count("model: change lines [4]") == 2  # old and new side
    check = run_apply(project, Options(ref="v1.3.0", vllm_repo=str(upstream), workdir=tmp_path / "w2"))
    assert check.ok, check.to_json()
    assert [p.status for p in check.patches] == ["applied"]


def test_export_refuses_commit_without_upstream_status(project, upstream, tmp_path):
    wd = tmp_path / "wd"
    run_apply(project, Options(vllm_repo=str(upstream), workdir=wd))
    (wd / "pkg/model.txt").write_text("changed\n")
    g(wd, "commit", "-qam", "a quick fix")
    before = {p.name: p.read_bytes() for p in project.patches_dir.iterdir()}
    with pytest.raises(errors.UsageError, match="Upstream-Status"):
        export(project, wd)
    assert {p.name: p.read_bytes() for p in project.patches_dir.iterdir()} == before


def test_export_refuses_commit_mixing_overlay_and_upstream_files(project, upstream, tmp_path):
    wd = tmp_path / "wd"
    run_apply(project, Options(vllm_repo=str(upstream), workdir=wd))
    (wd / "pkg/model.txt").write_text("changed\n")
    (wd / "pkg/new.py").write_text("X = 1\n")
    (wd / "pkg/mod.py").write_text("Y = 1\n")
    g(wd, "commit", "-qam", "mixed\n\nUpstream-Status: Pending")
    sha = g(wd, "rev-parse", "HEAD").strip()
    with pytest.raises(errors.UsageError) as err:
        export(project, wd)
    assert str(err.value) == (f"commit {sha[:12]} changes overlay files (pkg/mod.py, pkg/new.py) and "
                              f"upstream files; split it")


def data_files(project):
    return {p.relative_to(project.root).as_posix(): p.read_bytes()
            for p in project.root.rglob("*") if p.is_file()}


@pytest.mark.parametrize("spoil, message", [
    ("duplicate_subject", "share the subject"),
    ("markers", "conflict markers"),
    ("upstream_file", "upstream's pkg/mod.py, not ours"),
    ("merge", "merge commit"),
    ("broken", "^the work branch fails verification: pkg/new.py:1: does not compile"),
])
def test_refused_export_writes_nothing(project, upstream, tmp_path, spoil, message):
    wd = tmp_path / "wd"
    run_apply(project, Options(vllm_repo=str(upstream), workdir=wd))
    if spoil == "duplicate_subject":
        (wd / "pkg/model.txt").write_text("fixup\n")
        g(wd, "commit", "-qam", "model: change lines [4]\n\nUpstream-Status: Pending")
    elif spoil == "markers":
        (wd / "pkg/mod.py").write_text("<<<<<<< ours\nA = 1\n=======\nA = 2\n>>>>>>> theirs\n")
        g(wd, "commit", "-qam", "oops")
    elif spoil == "broken":
        (wd / "pkg/new.py").write_text("X = (\n")
        g(wd, "commit", "-qam", "k3-overlay: a typo")
    elif spoil == "upstream_file":
        g(wd, "checkout", "-q", "v1.0.0", "--", "pkg/mod.py")
        g(wd, "commit", "-qm", "back to upstream's file")
    else:
        g(wd, "checkout", "-q", "-b", "side", "HEAD~1")
        (wd / "pkg/side.txt").write_text("side\n")
        g(wd, "add", "pkg/side.txt")
        g(wd, "commit", "-qm", "side\n\nUpstream-Status: Pending")
        g(wd, "checkout", "-q", "k3-overlay/9.9.9")
        g(wd, "merge", "-q", "--no-edit", "side")
    before = data_files(project)
    with pytest.raises(errors.UsageError, match=message):
        export(project, wd)
    assert data_files(project) == before


def test_export_refuses_an_overlay_laid_with_allow_drift(project, upstream, tmp_path):
    wd = tmp_path / "wd"
    assert run_apply(project, Options(ref="v1.2.0", vllm_repo=str(upstream), workdir=wd,
                                      allow_drift=True)).ok
    with pytest.raises(errors.UsageError, match="--allow-drift"):
        export(project, wd)


def load_ci_rebase():
    """ci/rebase.py, the CI entry point, as a module."""
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parent.parent / "ci" / "rebase.py"
    spec = importlib.util.spec_from_file_location("ci_rebase", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("counts, code", [
    ({"passed": 3, "failed": 0, "skipped": 0, "errors": 1}, errors.VERIFY),  # the tier crashed
    ({"passed": 3, "failed": 1, "skipped": 0, "errors": 0}, errors.VERIFY),
    ({"passed": 3, "failed": 0, "skipped": 2, "errors": 0}, errors.OK),
])
def test_rebase_job_exit_code_counts_test_errors(project, upstream, tmp_path, monkeypatch, counts, code):
    ci_rebase = load_ci_rebase()
    monkeypatch.setattr(ci_rebase, "Project", lambda: project)

    class Stages:  # the job's stages as the core sees them, with the counts of this case
        def __init__(self, *args, **kwargs):
            pass

        def __call__(self, target):
            return StageResults([TestRun(**counts)])

    monkeypatch.setattr(ci_rebase, "JobStages", Stages)
    out = tmp_path / "out.json"
    assert ci_rebase.main(["-q", "--onto", "v1.1.0", "--vllm-repo", str(upstream),
                           "--json", str(out)]) == code
    [data] = json.loads(out.read_text())
    assert data["tests"] == counts and data["ok"] is (code == errors.OK)


def test_drift_whose_base_blob_is_unknown_is_a_conflict_that_says_why(project, upstream):
    manifest = json.loads(project.manifest_path.read_text())
    manifest["files"][0]["base_blob"] = "0" * 40  # a blob no repository has
    project.manifest_path.write_text(json.dumps(manifest))
    [report] = run_rebase(project, ["v1.2.0"], vllm_repo=str(upstream))
    mod = {f.path: f for f in report.overlay}["pkg/mod.py"]
    assert mod.status == "conflict" and report.exit_code == errors.DRIFT
    assert mod.upstream_diff == g(upstream, "diff", "v1.0.0", "v1.2.0", "--", "pkg/mod.py") != ""
    assert mod.detail.startswith("upstream blob ") and "; cannot merge: blob 00000000 is not in" in mod.detail


@pytest.mark.parametrize("spoil, message", [
    ("dirty", "wd has uncommitted changes; finish and commit first"),
    ("am", "wd has git am in progress; finish and commit first"),
])
def test_export_refuses_an_unsafe_checkout(project, upstream, tmp_path, spoil, message):
    wd = tmp_path / "wd"
    run_apply(project, Options(vllm_repo=str(upstream), workdir=wd))
    if spoil == "dirty":
        (wd / "pkg/model.txt").write_text("uncommitted\n")
    else:
        patch = project.patches_dir / "0001-model-line-4.patch"
        subprocess.run(["git", "am", str(patch)], cwd=wd, capture_output=True)
    before = data_files(project)
    with pytest.raises(errors.UsageError) as err:
        export(project, wd)
    assert str(err.value) == f"{wd.parent / message}"
    assert data_files(project) == before


def applied_from_a_project_checkout(project, upstream, tmp_path):
    """The work branch applied, and the project's own files committed in a git checkout."""
    wd = tmp_path / "wd"
    run_apply(project, Options(vllm_repo=str(upstream), workdir=wd))
    g(project.root, "init", "-q")
    g(project.root, "add", "-A")
    g(project.root, "commit", "-qm", "our data")
    return wd


def test_export_refuses_uncommitted_changes_to_the_data_files(project, upstream, tmp_path):
    wd = applied_from_a_project_checkout(project, upstream, tmp_path)
    (project.patches_dir / "series").write_text("0001-model-line-4.patch\n# edited\n")
    with pytest.raises(errors.UsageError) as err:
        export(project, wd)
    assert str(err.value) == ("patches/, overlay/ or overlay.json have uncommitted changes; "
                              "commit or stash them before --export")


@pytest.mark.parametrize("what", ["a patch", "an overlay file", "the series", "overlay.json"])
def test_an_edit_to_the_data_files_while_export_runs_is_never_overwritten(project, upstream, tmp_path,
                                                                         monkeypatch, what):
    """The start-of-run check passed; the user edits while the export is at work (round 5,
    F2): the export stops before it renames anything, and the edit stays as it was."""
    from k3overlay import export as export_mod

    wd = applied_from_a_project_checkout(project, upstream, tmp_path)
    target = {"a patch": next(project.patches_dir.glob("*.patch")),
              "the series": project.patches_dir / "series",
              "an overlay file": next(p for p in project.overlay_dir.rglob("*") if p.is_file()),
              "overlay.json": project.manifest_path}[what]
    mine = target.read_bytes() + b"\n# my note, written while --export ran\n"
    before = {p: p.read_bytes() for p in project.root.rglob("*") if p.is_file() and ".git" not in p.parts}
    real = export_mod._range_diff

    def range_diff(*args):  # after the check, before the write
        target.write_bytes(mine)
        return real(*args)

    monkeypatch.setattr(export_mod, "_range_diff", range_diff)
    with pytest.raises(errors.UsageError) as err:
        export(project, wd)
    assert str(err.value).startswith(target.relative_to(project.root).as_posix())
    assert "changed while this run went on; nothing was written" in str(err.value)
    assert target.read_bytes() == mine
    after = {p: p.read_bytes() for p in project.root.rglob("*") if p.is_file() and ".git" not in p.parts}
    assert {p: b for p, b in after.items() if p != target} == {p: b for p, b in before.items() if p != target}


def test_export_from_a_clean_project_checkout_goes_ahead(project, upstream, tmp_path):
    wd = applied_from_a_project_checkout(project, upstream, tmp_path)
    (project.root / "README.md").write_text("notes, not data\n")  # outside the data files
    result = export(project, wd)
    assert result.patches == ["0001-model-line-4.patch"]
    assert json.loads(project.manifest_path.read_text()) == \
        json.loads(g(project.root, "show", "HEAD:overlay.json"))  # the same manifest, re-recorded


def test_export_keeps_the_mode_of_each_overlay_file(project, upstream, tmp_path):
    wd = tmp_path / "wd"
    run_apply(project, Options(vllm_repo=str(upstream), workdir=wd))
    (wd / "pkg/new.py").chmod(0o755)
    g(wd, "commit", "-qam", "k3-overlay: new.py runs as a script")
    export(project, wd)
    modes = {line.split()[3]: line.split()[0] for line in g(wd, "ls-tree", "HEAD", "pkg/").splitlines()}
    assert modes["pkg/new.py"] == "100755" and modes["pkg/mod.py"] == "100644"  # git's word
    assert os.access(project.overlay_dir / "pkg/new.py", os.X_OK)
    assert not os.access(project.overlay_dir / "pkg/mod.py", os.X_OK)


def test_a_conflicted_overlay_file_does_not_keep_the_next_from_being_laid(project, upstream):
    seen = {}

    def look(target):
        seen["new"] = (target.built / "pkg/new.py").read_text()
        seen["mod"] = (target.built / "pkg/mod.py").read_text()
        return StageResults()

    [report] = run_rebase(project, ["v1.3.0"], vllm_repo=str(upstream), stages=look)
    assert [f.status for f in report.overlay] == ["conflict", "added"]
    assert seen["new"] == (project.overlay_dir / "pkg/new.py").read_text()
    assert seen["mod"] == g(upstream, "show", "v1.3.0:pkg/mod.py")  # upstream's, not markers


def test_rebase_job_leaves_no_scratch_behind(project, upstream, tmp_path, monkeypatch):
    scratch = tmp_path / "tmp"
    scratch.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(scratch))
    [report] = run_rebase(project, ["v1.1.0"], vllm_repo=str(upstream))
    assert report.ok and list(scratch.iterdir()) == []


def test_verify_means_one_thing_in_apply_check_and_the_rebase_job(project, upstream):
    # The same conflict (v1.3.0: the patch conflicts) once through apply.py --check and once
    # through the rebase job: both say verify was not run, and why, in every rendering.
    import io

    from rich.console import Console

    from k3overlay.report import write_human

    checked = run_apply(project, Options(ref="v1.3.0", vllm_repo=str(upstream), check=True))
    [job] = run_rebase(project, ["v1.3.0"], vllm_repo=str(upstream), stages=model_test)
    # Same meaning, each with what it found: apply refuses the drifted file, the job merges it.
    assert checked.to_json()["verify"] == {"ok": False, "status": "not run", "errors": [],
                                           "not_run": "patch 0001 conflicts; overlay pkg/mod.py drifts"}
    assert job.to_json()["verify"] == {"ok": False, "status": "not run", "errors": [],
                                       "not_run": "patch 0001 conflicts; overlay pkg/mod.py conflicts"}
    for report in (checked, job):
        out = io.StringIO()
        write_human(report, Console(file=out, width=200))
        assert f"verify: not run: {report.verification.not_run}" in out.getvalue()
        [verify] = [c for c in ET.fromstring(junit_xml([report])).iter("testcase")
                    if c.get("name") == "verify"]
        assert verify.find("failure") is None and verify.find("skipped") is not None
    assert f"- verify: not run: {job.verification.not_run}" in markdown([job])


NOTES = b"v2: context moved for v1.1.0\nmeasured: 4.1 \xc2\xb5s -> 3.9 \xc2\xb5s (H200, 2026-11-30)\n\n"


def _with_notes(path, notes):
    from k3overlay.series import with_notes

    path.write_bytes(with_notes(path.read_bytes(), notes))


def test_notes_below_the_dashes_survive_export_byte_for_byte(project, upstream, tmp_path):
    patch = project.patches_dir / "0001-model-line-4.patch"
    _with_notes(patch, NOTES)
    before = patch.read_bytes()
    assert b"\n---\n" + NOTES + b" pkg/model.txt | 2 +-\n" in before  # above the diffstat
    wd = tmp_path / "wd"
    assert run_apply(project, Options(vllm_repo=str(upstream), workdir=wd)).ok
    result = export(project, wd)
    assert patch.read_bytes() == before
    assert " = " in result.range_diff.splitlines()[0]  # nothing changed, notes included


def test_range_diff_tells_a_change_in_the_notes_apart_from_none(project, upstream, tmp_path):
    from k3overlay import git, series
    from k3overlay.export import _range_diff

    old = series.load(project.patches_dir)
    new_dir = tmp_path / "new"
    new_dir.mkdir()
    (new_dir / "series").write_text("0001-model-line-4.patch\n")
    copy = new_dir / "0001-model-line-4.patch"
    copy.write_bytes(old[0].path.read_bytes())
    g(tmp_path, "clone", "-q", str(upstream), "up")  # range-diff commits there
    repo = git.open_repo(tmp_path / "up")
    _with_notes(copy, NOTES)
    same = _range_diff(repo, ("v1.0.0", old), ("v1.0.0", old))
    changed = _range_diff(repo, ("v1.0.0", old), ("v1.0.0", series.load(new_dir)))
    assert " = " in same.splitlines()[0]
    assert " ! " in changed.splitlines()[0] and "measured: 4.1" in changed


@pytest.fixture
def took_then_reworked(project, upstream, tmp_path):
    """A clone of upstream (history, not a release mirror) where v1.5.0 took our patch as
    it is (commit ``took``), then reworked the same line: the tree no longer holds it."""
    repo = tmp_path / "history"
    g(tmp_path, "clone", "-q", str(upstream), str(repo))
    g(repo, "checkout", "-q", "-b", "next", "v1.0.0")
    g(repo, "am", "-q", str(project.patches_dir / "0001-model-line-4.patch"))
    took = g(repo, "rev-parse", "HEAD").strip()
    (repo / "pkg/model.txt").write_text((repo / "pkg/model.txt").read_text()
                                        .replace("line 4 (ours)", "line 4 (reworked)"))
    g(repo, "commit", "-q", "-am", "model: rework line 4")
    g(repo, "tag", "v1.5.0")
    return repo, took


def test_a_patch_upstream_took_then_reworked_is_landed_by_patch_id(project, took_then_reworked,
                                                                   tmp_path):
    repo, took = took_then_reworked
    [report] = run_rebase(project, ["v1.5.0"], vllm_repo=str(repo))
    [patch] = report.patches
    assert (patch.status, patch.upstream_commit) == ("landed-upstream", took)
    assert report.to_json()["patches"][0]["upstream_commit"] == took
    assert f"landed-upstream: 0001 (as {took[:12]})" in markdown([report])
    wd = tmp_path / "wd"
    first = rebase_to(project, Options(ref="v1.5.0", vllm_repo=str(repo), workdir=wd))
    assert [(p.status, p.upstream_commit) for p in first.patches] == [("landed-upstream", took)]
    assert first.ok, first.to_json()
    result = export(project, wd)
    assert result.dropped == ["0001-model-line-4.patch"] and result.patches == []


def test_without_history_the_tree_rule_decides(project, took_then_reworked):
    # The same tag through a source whose v1.5.0 has no history back to the base (a release
    # mirror's snapshot): the patch conflicts, as the tree says.
    repo, _ = took_then_reworked
    tree = g(repo, "rev-parse", "v1.5.0^{tree}").strip()
    lone = g(repo, "commit-tree", tree, "-m", "release v1.6.0").strip()
    g(repo, "tag", "v1.6.0", lone)
    [report] = run_rebase(project, ["v1.6.0"], vllm_repo=str(repo))
    assert [(p.status, p.upstream_commit) for p in report.patches] == [("conflict", "")]


def test_the_tool_knows_nothing_of_the_ci_job():
    # The job plugs its stages in (k3overlay.stages); nothing in k3overlay imports ci/.
    import ast
    from pathlib import Path

    import k3overlay

    ci = {p.stem for p in (Path(k3overlay.__file__).parent.parent / "ci").iterdir()}
    for path in Path(k3overlay.__file__).parent.glob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            names = ([a.name for a in node.names] if isinstance(node, ast.Import) else
                     [node.module or ""] if isinstance(node, ast.ImportFrom) and not node.level
                     else [])
            assert not {n.split(".")[0] for n in names} & (ci | {"ci"}), (path.name, names)


def test_an_unreachable_index_fails_only_the_targets_that_need_it(project, upstream, tmp_path, monkeypatch):
    """Issue 25, 13: ``latest`` (and an upstream id) need the package index; a tag of a
    local ``--vllm-repo`` does not. With the index out of reach only the former fail, each
    in its own report; the others run."""
    ci_rebase = load_ci_rebase()
    monkeypatch.setattr(ci_rebase, "Project", lambda: project)
    monkeypatch.setenv("PIP_INDEX_URL", "http://127.0.0.1:9/simple/")  # discard port: refused
    out = tmp_path / "out.json"
    code = ci_rebase.main(["-q", "--onto", "v1.1.0", "--onto", "latest", "--vllm-repo", str(upstream),
                           "--no-tests", "--json", str(out)])
    local, latest = json.loads(out.read_text())
    assert (local["ref"], local["ok"], local.get("error")) == ("v1.1.0", True, None), local
    assert latest["ref"] == "latest" and latest["error"].startswith("cannot reach the package index")
    assert code == errors.SOURCE


def test_the_suggested_next_commands_work_where_git_knows_no_identity(project, upstream, tmp_path,
                                                                     monkeypatch):
    """The report's commands after a patch conflict, run as written on a machine with no git
    identity (CI, a fresh clone): they stage the resolution and name an identity themselves."""
    no_identity = tmp_path / "gitconfig"
    no_identity.write_text("[user]\n\tuseConfigOnly = true\n")  # git guesses none from the host
    for key in [k for k in os.environ if k.startswith(("GIT_AUTHOR_", "GIT_COMMITTER_"))] + ["EMAIL"]:
        monkeypatch.delenv(key, raising=False)
    monkeypatch.setenv("GIT_CONFIG_GLOBAL", str(no_identity))
    wd = tmp_path / "work/vllm"
    report = rebase_to(project, Options(ref="v1.3.0", vllm_repo=str(upstream), workdir=wd))
    assert report.exit_code == errors.CONFLICT and report.patches[0].files == ["pkg/model.txt"]
    (wd / "pkg/model.txt").write_text((wd / "pkg/model.txt").read_text().split("<<<<<<<")[0] + "line 4\n")
    commands = [c for c in markdown([report]).split("```bash\n")[1].split("```")[0].splitlines()
                if c.startswith(f"git -C {wd}")]  # the checkout this run was given, not the default
    assert commands and "-c user.name=" in commands[0] and " add -- pkg/model.txt && " in commands[0]
    assert f"python apply.py --rebase-to v1.3.0 --vllm-repo {upstream} --workdir={wd}" in commands[0]
    git_part = commands[0].split(" && python apply.py")[0]
    done = subprocess.run(["bash", "-c", git_part], cwd=project.root, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    assert not (wd / ".git/rebase-apply").exists()
    # committed as the maintainer, never as the tool: the resolution is the maintainer's work,
    # which a plain run must not take back (round 5, F3)
    assert g(wd, "log", "-1", "--format=%s%n%cn").splitlines() == ["model: change lines [4]",
                                                                   "vllm-k3-overlay maintainer"]
    from k3overlay import git as k3git, safety

    tip = g(wd, "rev-parse", "HEAD").strip()
    assert safety.foreign_commits(k3git.open_repo(wd), report.branch, tip) == [tip]
