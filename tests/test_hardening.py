"""Regression tests for ways a user (or an attacker's ref name) could hurt a checkout."""

from __future__ import annotations

import json
import subprocess

import pytest

from k3overlay import cli, errors, job
from k3overlay.export import export
from k3overlay.job import Options, run_apply

from .conftest import g, snapshot, write


def apply(project, upstream, workdir, **kw):
    return run_apply(project, Options(vllm_repo=str(upstream), workdir=workdir, **kw))


@pytest.mark.parametrize("ref", ["--upload-pack=touch {pwned}", "v1.0.0:refs/heads/keep",
                                 "+refs/tags/v1.1.0:refs/heads/keep", "a..b", "-v1", "keep@{{1}}",
                                 "v1.0.0\x7f", "v1 .0"])
def test_refs_that_git_would_read_as_options_or_refspecs_are_refused(project, upstream, tmp_path, ref):
    wd = tmp_path / "wd"
    apply(project, upstream, wd)
    g(wd, "branch", "keep", "v1.0.0")
    before = snapshot(wd)
    pwned = tmp_path / "pwned"
    for check in (True, False):
        with pytest.raises(errors.UsageError, match="bad ref"):
            apply(project, upstream, wd, ref=ref.format(pwned=pwned), check=check)
    assert not pwned.exists() and snapshot(wd) == before


def test_check_fetches_nothing_into_the_checkout(project, upstream, tmp_path):
    wd = tmp_path / "wd"
    g(upstream, "clone", "-q", str(upstream), str(wd))
    for tag in ("v1.1.0", "v1.2.0", "v1.3.0"):
        g(wd, "tag", "-d", tag)
    before = snapshot(wd)
    assert apply(project, upstream, wd, ref="v1.1.0", check=True).ok
    assert snapshot(wd) == before and not (wd / ".git" / "FETCH_HEAD").exists()


def test_users_own_stale_worktree_entries_survive(project, upstream, tmp_path):
    wd = tmp_path / "wd"
    apply(project, upstream, wd)
    g(wd, "worktree", "add", "-q", "--detach", str(tmp_path / "mine"), "v1.0.0")
    subprocess.run(["rm", "-rf", str(tmp_path / "mine")], check=True)
    apply(project, upstream, wd, check=True)
    assert str(tmp_path / "mine") in g(wd, "worktree", "list")


def test_a_branch_ref_is_fetched_fresh_every_run(project, upstream, tmp_path):
    up = tmp_path / "up"
    g(upstream, "clone", "-q", str(upstream), str(up))
    g(up, "checkout", "-q", "-b", "release", "v1.1.0")
    wd = tmp_path / "wd"
    assert apply(project, up, wd, ref="release").ok
    first = g(wd, "rev-parse", "HEAD~2").strip()
    write(up, {"pkg/extra.txt": "new upstream work\n"})
    g(up, "add", "-A")
    g(up, "commit", "-qm", "more")
    report = apply(project, up, wd, ref="release")
    assert report.ok and report.ref_sha == g(up, "rev-parse", "HEAD").strip() != first
    assert (wd / "pkg/extra.txt").is_file()


def test_bad_output_and_workdir_paths_are_one_line_errors(project, upstream, tmp_path, monkeypatch,
                                                          capsys):
    monkeypatch.setattr(cli, "Project", lambda: project)
    afile = tmp_path / "afile"
    afile.write_text("x")
    base = ["-q", "--vllm-repo", str(upstream)]
    assert cli.main([*base, "--workdir", str(tmp_path / "wd"), "--json", str(tmp_path)]) == errors.USAGE
    assert not (tmp_path / "wd").exists()  # refused before any work
    assert cli.main([*base, "--workdir", str(afile)]) == errors.USAGE
    assert cli.main([*base, "--workdir", str(afile / "sub")]) == errors.USAGE
    assert cli.main([*base, "--workdir", str(tmp_path / "w"), "--json", str(afile / "r.json")]) \
        == errors.USAGE
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 4 and all(line.startswith("apply.py: error: ") for line in lines)


def test_check_cannot_be_combined_with_maintainer_modes(project, monkeypatch):
    monkeypatch.setattr(cli, "Project", lambda: project)
    for mode in (["--rebase-to", "v1.1.0"], ["--export"]):
        with pytest.raises(SystemExit) as stop:
            cli.main(["--check", *mode])
        assert stop.value.code == errors.USAGE


def test_unreachable_repository_is_exit_6(project, tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(cli, "Project", lambda: project)
    code = cli.main(["-q", "--vllm-repo", "https://127.0.0.1:9/vllm.git", "--workdir", str(tmp_path / "w")])
    assert code == errors.SOURCE
    assert "cannot reach the vLLM source" in capsys.readouterr().err
    assert not (tmp_path / "w").exists()


def test_interrupted_first_run_leaves_no_half_made_checkout(project, upstream, tmp_path, monkeypatch):
    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(job, "build", interrupted)
    with pytest.raises(KeyboardInterrupt):
        apply(project, upstream, tmp_path / "wd")
    assert not (tmp_path / "wd").exists()


def test_unfinished_cherry_pick_sequence_is_refused(project, upstream, tmp_path):
    wd = tmp_path / "wd"
    g(upstream, "clone", "-q", str(upstream), str(wd))
    g(wd, "checkout", "-q", "-b", "work", "v1.3.0")
    who = {"GIT_AUTHOR_NAME": "m", "GIT_AUTHOR_EMAIL": "m@m", "GIT_COMMITTER_NAME": "m",
           "GIT_COMMITTER_EMAIL": "m@m", "PATH": "/usr/bin:/bin"}
    proc = subprocess.run(["git", "cherry-pick", "v1.2.0", "v1.1.0"], cwd=wd, capture_output=True, env=who)
    assert proc.returncode != 0  # the first pick conflicts; the sequence waits
    g(wd, "checkout", "--theirs", ".")
    g(wd, "add", "-A")
    subprocess.run(["git", "-c", "core.editor=true", "commit", "-q", "--no-edit"], cwd=wd, check=True,
                   env=who)
    assert (wd / ".git" / "sequencer").is_dir()
    with pytest.raises(errors.UsageError, match="cherry-pick/revert sequence"):
        apply(project, upstream, wd)


@pytest.mark.parametrize("files, message", [
    ([{"path": 5, "base_blob": "new"}], "bad path"),
    ([{"path": "pkg/new.py", "base_blob": 5}], "bad base_blob"),
    ([{"path": "../x", "base_blob": "new"}], "bad path"),
    ([{"path": "pkg/new.py", "base_blob": "new"}] * 2, "twice"),
])
def test_malformed_manifest_is_bad_input(project, upstream, tmp_path, files, message):
    project.manifest_path.write_text(json.dumps({"base": "v1.0.0", "files": files}))
    with pytest.raises(errors.UsageError, match=message):
        apply(project, upstream, tmp_path / "wd")


def test_malformed_series_is_bad_input(project, upstream, tmp_path):
    series = project.patches_dir / "series"
    series.write_bytes(b"0001-model-line-4.patch\n\xff\n")
    with pytest.raises(errors.UsageError, match="not UTF-8"):
        apply(project, upstream, tmp_path / "wd")
    series.write_text("0001-model-line-4.patch\n0001-model-line-4.patch\n")
    with pytest.raises(errors.UsageError, match="more than once"):
        apply(project, upstream, tmp_path / "wd")
    series.write_text("0001-model-line-4.patch\n")
    (project.patches_dir / "0001-model-line-4.patch").write_text("Subject: x\n\nUpstream-Status: Pending\n")
    with pytest.raises(errors.UsageError, match="holds no diff"):
        apply(project, upstream, tmp_path / "wd")


def test_latin1_subject_still_applies(project, upstream, tmp_path):
    patch = project.patches_dir / "0001-model-line-4.patch"
    patch.write_bytes(patch.read_bytes().replace(b"Why: a test.", b"Why: a caf\xe9 test."))
    assert apply(project, upstream, tmp_path / "wd").ok


def test_after_export_apply_may_rebuild_the_branch(project, upstream, tmp_path):
    wd = tmp_path / "wd"
    manifest = project.manifest_path.read_text()
    apply(project, upstream, wd)
    (wd / "pkg/model.txt").write_text((wd / "pkg/model.txt").read_text() + "line 13\n")
    g(wd, "commit", "-qam", "model: line 13\n\nUpstream-Status: Pending")
    (wd / "pkg/model.txt").write_text((wd / "pkg/model.txt").read_text() + "line 14\n")
    g(wd, "commit", "-qam", "model: line 14\n\nUpstream-Status: Pending")
    export(project, wd)
    assert json.loads(project.manifest_path.read_text()) == json.loads(manifest)  # order kept
    assert (project.patches_dir / "series").read_text().splitlines() == [  # numbered after the last
        "0001-model-line-4.patch", "0002-model-line-13.patch", "0003-model-line-14.patch"]
    report = apply(project, upstream, wd)
    assert report.ok and [p.status for p in report.patches] == ["applied", "applied", "applied"]


def test_users_hooks_and_signing_config_change_nothing(project, upstream, tmp_path, monkeypatch):
    clean = apply(project, upstream, tmp_path / "clean")
    wd = tmp_path / "wd"
    g(upstream, "clone", "-q", str(upstream), str(wd))
    ran = tmp_path / "hooks-ran"
    for hook in ("applypatch-msg", "pre-commit", "post-checkout", "reference-transaction"):
        script = wd / ".git" / "hooks" / hook
        script.write_text(f"#!/bin/sh\necho {hook} >> {ran}\nexit 1\n")
        script.chmod(0o755)
    config = tmp_path / "gitconfig"
    config.write_text("[commit]\n\tgpgSign = true\n[gpg]\n\tprogram = /bin/false\n")
    monkeypatch.setenv("GIT_CONFIG_GLOBAL", str(config))
    report = apply(project, upstream, wd)
    assert report.ok, report.to_json()
    assert g(wd, "rev-parse", "HEAD") == g(tmp_path / "clean", "rev-parse", "HEAD")  # same shas
    assert clean.ok and not ran.exists()


@pytest.mark.parametrize("operation, name", [
    (["merge", "v1.3.0"], "git merge"), (["rebase", "--merge", "v1.3.0"], "git rebase"),
    (["rebase", "--apply", "v1.3.0"], "git rebase"), (["revert", "--no-edit", "v1.3.0"], "git revert"),
])
def test_unfinished_merge_rebase_or_revert_is_refused(project, upstream, tmp_path, operation, name):
    wd = tmp_path / "wd"
    g(upstream, "clone", "-q", str(upstream), str(wd))
    g(wd, "checkout", "-q", "-b", "work", "v1.0.0")
    who = {"GIT_AUTHOR_NAME": "m", "GIT_AUTHOR_EMAIL": "m@m", "GIT_COMMITTER_NAME": "m",
           "GIT_COMMITTER_EMAIL": "m@m", "PATH": "/usr/bin:/bin"}
    (wd / "pkg/model.txt").write_text("mine\n")
    g(wd, "commit", "-qam", "mine")
    assert subprocess.run(["git", *operation], cwd=wd, capture_output=True, env=who).returncode != 0
    g(wd, "checkout", "--theirs", "pkg/model.txt")
    g(wd, "add", "-A")  # resolved, but not concluded
    with pytest.raises(errors.UsageError, match=f"has a {name} in progress"):
        apply(project, upstream, wd)
