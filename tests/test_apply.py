"""The apply job on synthetic repos: every patch/overlay status, exit code and safety rule."""

from __future__ import annotations

import json
import subprocess

import pytest

from k3overlay import cli, errors
from k3overlay.job import Options, run_apply

from .conftest import g, make_patch, snapshot


def apply(project, upstream, workdir, **kw):
    return run_apply(project, Options(vllm_repo=str(upstream), workdir=workdir, **kw))


def statuses(report):
    return ([p.status for p in report.patches], {f.path: f.status for f in report.overlay})


def test_base_applies_patch_and_overlay_on_work_branch(project, upstream, tmp_path):
    wd = tmp_path / "wd"
    report = apply(project, upstream, wd)
    assert report.exit_code == errors.OK, report.to_json()
    assert statuses(report) == (["applied"], {"pkg/mod.py": "replaced", "pkg/new.py": "added"})
    assert g(wd, "symbolic-ref", "--short", "HEAD").strip() == "k3-overlay/9.9.9"
    log = g(wd, "log", "--format=%s|%an", "v1.0.0~0..HEAD").splitlines()
    assert log == ["k3-overlay: lay overlay files (vllm-k3-overlay 9.9.9)|vllm-k3-overlay",
                   "model: change lines [4]|Upstream Dev"]  # authorship of the patch kept
    assert g(wd, "rev-parse", "HEAD~2").strip() == g(upstream, "rev-parse", "v1.0.0").strip()
    assert "line 4 (ours)" in (wd / "pkg/model.txt").read_text()
    assert "def ours" in (wd / "pkg/mod.py").read_text()
    assert (wd / "pkg/new.py").is_file()
    assert g(wd, "status", "--porcelain") == ""


def test_rerun_is_idempotent_and_shas_are_reproducible(project, upstream, tmp_path):
    first = apply(project, upstream, tmp_path / "a")
    tip = g(tmp_path / "a", "rev-parse", "HEAD")
    again = apply(project, upstream, tmp_path / "a")
    assert again.ok and any("nothing to do" in n for n in again.notes)
    assert g(tmp_path / "a", "rev-parse", "HEAD") == tip
    apply(project, upstream, tmp_path / "b")  # another clone, another day: same commits
    assert first.ok and g(tmp_path / "b", "rev-parse", "HEAD") == tip


def test_three_way_fallback(project, upstream, tmp_path):
    report = apply(project, upstream, tmp_path / "wd", ref="v1.1.0")
    assert report.ok
    assert statuses(report) == (["applied-3way"], {"pkg/mod.py": "replaced", "pkg/new.py": "added"})
    text = (tmp_path / "wd/pkg/model.txt").read_text()
    assert "line 1 (upstream)" in text and "line 4 (ours)" in text


def test_landed_upstream_and_drift_exit_4(project, upstream, tmp_path):
    wd = tmp_path / "wd"
    report = apply(project, upstream, wd, ref="v1.2.0")
    assert statuses(report) == (["landed-upstream"], {"pkg/mod.py": "drift", "pkg/new.py": "added"})
    assert report.exit_code == errors.DRIFT and not report.ok
    drift = report.overlay[0]
    assert "+\"\"\"Upstream docstring.\"\"\"" in drift.upstream_diff  # upstream's own base->ref diff is shown
    assert g(wd, "branch", "--list", "k3-overlay/*") == ""  # nothing published


def test_allow_drift_lays_file_but_still_says_drift(project, upstream, tmp_path):
    report = apply(project, upstream, tmp_path / "wd", ref="v1.2.0", allow_drift=True)
    assert report.ok and report.overlay[0].status == "drift"
    assert "def ours" in (tmp_path / "wd/pkg/mod.py").read_text()


def test_conflict_exit_3_names_patch_and_files_and_leaves_checkout(project, upstream, tmp_path):
    wd = tmp_path / "wd"
    apply(project, upstream, wd)  # an existing checkout on our branch
    before = snapshot(wd)
    report = apply(project, upstream, wd, ref="v1.3.0")
    assert report.exit_code == errors.CONFLICT
    conflict = report.patches[0]
    assert conflict.status == "conflict" and conflict.files == ["pkg/model.txt"]
    data = report.to_json()
    assert data["patches"][0]["files"] == ["pkg/model.txt"] and data["ok"] is False
    assert conflict.hunks[0] == "pkg/model.txt:4-8"  # the region the 3-way merge could not settle
    assert snapshot(wd) == before
    assert not (wd / ".git" / "rebase-apply").exists()


def test_check_leaves_checkout_exactly_as_it_was(project, upstream, tmp_path):
    wd = tmp_path / "wd"
    g(upstream, "clone", "-q", str(upstream), str(wd))
    (wd / "pkg/user.py").write_text("# my uncommitted work\n")
    before = snapshot(wd)
    report = apply(project, upstream, wd, ref="v1.1.0", check=True)
    assert report.ok and statuses(report)[0] == ["applied-3way"]
    assert snapshot(wd) == before


def test_check_without_checkout_creates_none(project, upstream, tmp_path):
    report = apply(project, upstream, tmp_path / "nowhere", check=True)
    assert report.ok and not (tmp_path / "nowhere").exists()


def test_dirty_checkout_refused_and_change_survives(project, upstream, tmp_path):
    wd = tmp_path / "wd"
    g(upstream, "clone", "-q", str(upstream), str(wd))
    (wd / "pkg/user.py").write_text("# my uncommitted work\n")
    with pytest.raises(errors.UsageError, match="uncommitted changes"):
        apply(project, upstream, wd)
    assert (wd / "pkg/user.py").read_text() == "# my uncommitted work\n"


def test_in_progress_am_refused_and_kept(project, upstream, tmp_path):
    wd = tmp_path / "wd"
    g(upstream, "clone", "-q", "--branch", "v1.3.0", str(upstream), str(wd))
    patch = project.patches_dir / "0001-model-line-4.patch"
    assert subprocess.run(["git", "am", str(patch)], cwd=wd, capture_output=True).returncode != 0
    g(wd, "checkout", "--", ".")  # a clean tree, but the am is still in progress
    with pytest.raises(errors.UsageError, match="git am in progress"):
        apply(project, upstream, wd)
    assert (wd / ".git" / "rebase-apply").is_dir()


def test_foreign_branch_is_never_rewritten(project, upstream, tmp_path):
    wd = tmp_path / "wd"
    g(upstream, "clone", "-q", str(upstream), str(wd))
    g(wd, "branch", "k3-overlay/9.9.9", "v1.1.0")
    tip = g(wd, "rev-parse", "k3-overlay/9.9.9")
    with pytest.raises(errors.UsageError, match="not created by apply.py"):
        apply(project, upstream, wd)
    assert g(wd, "rev-parse", "k3-overlay/9.9.9") == tip


def test_our_branch_with_user_commits_is_not_rewritten(project, upstream, tmp_path):
    wd = tmp_path / "wd"
    apply(project, upstream, wd)
    (wd / "notes.txt").write_text("mine\n")
    g(wd, "add", "notes.txt")
    g(wd, "commit", "-qm", "my work")
    tip = g(wd, "rev-parse", "HEAD")
    with pytest.raises(errors.UsageError, match="did not write"):
        apply(project, upstream, wd, ref="v1.1.0")
    assert g(wd, "rev-parse", "HEAD") == tip


def test_other_branch_name_and_unknown_ref(project, upstream, tmp_path):
    wd = tmp_path / "wd"
    assert apply(project, upstream, wd, branch="release/k3").ok
    assert g(wd, "symbolic-ref", "--short", "HEAD").strip() == "release/k3"
    with pytest.raises(errors.UsageError, match="not found"):
        apply(project, upstream, wd, ref="v9.9.9", check=True)


def test_verify_failure_exit_5(project, upstream, tmp_path):
    # Our replacement of pkg/mod.py drops VALUE, which pkg/user.py imports.
    (project.overlay_dir / "pkg/mod.py").write_text("def old():\n    return 1\n\n\ndef ours():\n    pass\n")
    report = apply(project, upstream, tmp_path / "wd")
    assert report.exit_code == errors.VERIFY
    assert report.verify.errors == ["pkg/user.py:1: cannot import name 'VALUE' from pkg.mod"]
    assert not (tmp_path / "wd" / "pkg/new.py").exists()  # nothing published


def test_patch_without_upstream_status_refused(project, upstream, tmp_path):
    make_patch(upstream, project.patches_dir, "0001-model-line-4.patch", {4: "x"}, status="")
    with pytest.raises(errors.UsageError, match="Upstream-Status"):
        apply(project, upstream, tmp_path / "wd")


def test_cli_json_report_shape_and_exit_codes(project, upstream, tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(cli, "Project", lambda: project)
    out = tmp_path / "r.json"
    base = ["--vllm-repo", str(upstream), "--workdir", str(tmp_path / "wd"), "--json", str(out), "-q"]
    assert cli.main(base) == 0
    data = json.loads(out.read_text())
    assert list(data) == ["overlay_version", "base_ref", "ref", "ref_sha", "branch", "workdir",
                          "ok", "patches", "overlay", "verify"]
    assert data["ok"] is True and data["ref"] == "v1.0.0" and data["base_ref"] == "v1.0.0"
    assert data["patches"] == [{"name": "0001-model-line-4.patch", "status": "applied"}]
    assert data["verify"] == {"ok": True, "status": "ok", "errors": []}
    assert cli.main([*base, "--vllm-ref", "v1.3.0"]) == errors.CONFLICT
    assert cli.main([*base, "--vllm-ref", "v1.2.0"]) == errors.DRIFT
    assert cli.main([*base, "--vllm-ref", "nope"]) == errors.USAGE
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1] == f"apply.py: error: ref 'nope' not found in {upstream}"
    assert json.loads(out.read_text())["error"].startswith("ref 'nope' not found")


def test_source_unreachable_exit_6(project, tmp_path, monkeypatch):
    monkeypatch.setattr(cli, "Project", lambda: project)
    monkeypatch.setenv("PIP_INDEX_URL", "http://127.0.0.1:9/simple/")
    assert cli.main(["--workdir", str(tmp_path / "wd"), "-q", "--vllm-ref", "v1.0.0"]) == errors.SOURCE


def test_new_overlay_file_that_upstream_has_since_added_is_drift(project, upstream, tmp_path,
                                                                  monkeypatch):
    up = tmp_path / "up"
    g(upstream, "clone", "-q", str(upstream), str(up))
    g(up, "checkout", "-q", "--detach", "v1.0.0")
    (up / "pkg/new.py").write_text("UPSTREAMS_OWN = 1\n")
    g(up, "add", "pkg/new.py")
    g(up, "commit", "-qm", "upstream adds pkg/new.py")
    g(up, "tag", "v1.0.1")
    monkeypatch.setattr(cli, "Project", lambda: project)
    out = tmp_path / "r.json"
    code = cli.main(["-q", "--vllm-repo", str(up), "--vllm-ref", "v1.0.1", "--workdir", str(tmp_path / "wd"),
                     "--json", str(out)])
    assert code == errors.DRIFT
    new = {f["path"]: f for f in json.loads(out.read_text())["overlay"]}["pkg/new.py"]
    assert new["status"] == "drift" and new["detail"] == "upstream now has a file at this path"
    assert "+UPSTREAMS_OWN = 1" in new["upstream_diff"]


def test_json_report_carries_upstream_diff_of_a_drifted_file(project, upstream, tmp_path, monkeypatch):
    monkeypatch.setattr(cli, "Project", lambda: project)
    out = tmp_path / "r.json"
    code = cli.main(["-q", "--vllm-repo", str(upstream), "--vllm-ref", "v1.2.0",
                     "--workdir", str(tmp_path / "wd"), "--json", str(out)])
    assert code == errors.DRIFT
    mod = {f["path"]: f for f in json.loads(out.read_text())["overlay"]}["pkg/mod.py"]
    assert mod["status"] == "drift"
    assert mod["upstream_diff"] == g(upstream, "diff", "--no-color", "v1.0.0", "v1.2.0", "--", "pkg/mod.py")


def test_vllm_repo_from_the_environment_when_no_option_names_one(project, upstream, tmp_path,
                                                                  monkeypatch):
    monkeypatch.setenv("VLLM_REPO", str(upstream))
    monkeypatch.setenv("PIP_INDEX_URL", "http://127.0.0.1:9/simple/")  # the mirror would fail
    report = run_apply(project, Options(workdir=tmp_path / "wd"))
    assert report.ok, report.to_json()
    assert g(tmp_path / "wd", "rev-parse", "HEAD~2").strip() == g(upstream, "rev-parse", "v1.0.0").strip()


def test_a_checkout_without_the_base_says_so_and_one_with_it_does_not(project, upstream, tmp_path):
    note = "note: base v1.0.0 is not in this checkout (shallow or foreign clone?): no upstream diff " \
           "of drifted files"
    full = apply(project, upstream, tmp_path / "full", ref="v1.1.0")
    assert full.ok and note not in full.notes
    shallow = tmp_path / "shallow"
    g(tmp_path, "clone", "-q", "--depth", "1", "--branch", "v1.1.0", f"file://{upstream}", str(shallow))
    assert subprocess.run(["git", "rev-parse", "--verify", "-q", "v1.0.0^{commit}"], cwd=shallow,
                          capture_output=True).returncode != 0  # git agrees: no base here
    report = apply(project, upstream, shallow, ref="v1.1.0", check=True)
    assert note in report.notes
