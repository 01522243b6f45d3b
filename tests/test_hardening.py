"""Regression tests for ways a user (or an attacker's ref name) could hurt a checkout."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time

import pytest

from k3overlay import cli, errors, git, gitproc, job
from k3overlay.export import export
from k3overlay.job import Options, run_apply
from k3overlay.rebase import rebase_to

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


# -- Found by the second adversarial pass: files in the user's checkout that git does not
# track because they are ignored. ``git checkout`` and ``git am --3way`` treat ignored files
# as expendable, and laying an overlay file replaced whatever sat there, so publishing the
# work branch or ``--rebase-to`` overwrote a user's ignored file without a word. And the
# user's own ignore rules (``~/.config/git/ignore``, ``core.excludesFile``) were shut out, so
# a checkout their ``git status`` calls clean (a ``.venv`` they ignore) was refused as dirty.


MINE = "the user's own notes, ignored by git\n"


def add_patch_creating(project, upstream, tmp_path, path: str) -> None:
    """Append to the series a patch that creates ``path`` on v1.0.0."""
    work = tmp_path / "_mk_create"
    g(upstream, "worktree", "add", "-q", "--detach", str(work), "v1.0.0")
    try:
        (work / path).write_text("CREATED = 1\n")
        g(work, "add", path)
        g(work, "commit", "-qm", f"add {path}\n\nUpstream-Status: Pending")
        text = g(work, "format-patch", "-1", "--zero-commit", "--no-signature", "--stdout", "HEAD")
    finally:
        g(upstream, "worktree", "remove", "--force", str(work))
    (project.patches_dir / "0002-create.patch").write_text(text)
    with open(project.patches_dir / "series", "a") as series:
        series.write("0002-create.patch\n")


def ignore(wd, path, how, tmp_path, monkeypatch):
    """Make ``path`` a file of the user's in ``wd`` that git ignores, the way ``how`` says."""
    if how == "info/exclude":
        (wd / ".git/info/exclude").write_text(f"{path}\n")
    else:  # the user's own global ignore file, found by git itself
        home = tmp_path / "home"
        (home / ".config/git").mkdir(parents=True)
        (home / ".config/git/ignore").write_text(f"{path}\n")
        monkeypatch.setenv("HOME", str(home))
        monkeypatch.delenv("XDG_CONFIG_HOME", raising=False)
    (wd / path).write_text(MINE)
    assert g(wd, "status", "--porcelain") == ""  # git itself calls the checkout clean


@pytest.mark.parametrize("how", ["info/exclude", "global ignore"])
@pytest.mark.parametrize("path", ["pkg/new.py", "pkg/created.py"])  # overlay file, patch's file
def test_publishing_never_overwrites_an_ignored_file(project, upstream, tmp_path, monkeypatch,
                                                    capsys, path, how):
    add_patch_creating(project, upstream, tmp_path, "pkg/created.py")
    wd = tmp_path / "wd"
    g(tmp_path, "clone", "-q", str(upstream), str(wd))
    ignore(wd, path, how, tmp_path, monkeypatch)
    before = snapshot(wd)
    monkeypatch.setattr(cli, "Project", lambda: project)
    code = cli.main(["-q", "--vllm-repo", str(upstream), "--workdir", str(wd)])
    assert code == errors.USAGE
    assert capsys.readouterr().err.splitlines() == [
        "apply.py: error: git checkout failed: error: The following untracked working tree files "
        f"would be overwritten by checkout: {path}"]
    assert (wd / path).read_text() == MINE and snapshot(wd) == before


@pytest.mark.parametrize("how", ["info/exclude", "global ignore"])
@pytest.mark.parametrize("path", ["pkg/new.py", "pkg/created.py"])
def test_rebase_to_never_overwrites_an_ignored_file(project, upstream, tmp_path, monkeypatch,
                                                   path, how):
    add_patch_creating(project, upstream, tmp_path, "pkg/created.py")
    wd = tmp_path / "wd"
    g(tmp_path, "clone", "-q", str(upstream), str(wd))
    ignore(wd, path, how, tmp_path, monkeypatch)
    before = snapshot(wd)
    with pytest.raises(errors.UsageError) as err:
        rebase_to(project, Options(vllm_repo=str(upstream), workdir=wd, ref="v1.1.0"))
    assert str(err.value) == (f"{path} in {wd} is not tracked by git (ignored) and the series or "
                              f"overlay writes there; move it away first")
    assert (wd / path).read_text() == MINE and snapshot(wd) == before
    (wd / path).unlink()  # moved away: the same run goes through
    report = rebase_to(project, Options(vllm_repo=str(upstream), workdir=wd, ref="v1.1.0"))
    assert report.ok and (wd / path).read_text() != MINE


@pytest.mark.parametrize("how", ["xdg default", "core.excludesFile"])
def test_a_checkout_clean_by_the_users_own_ignore_rules_is_not_refused(project, upstream, tmp_path,
                                                                      monkeypatch, how):
    wd = tmp_path / "wd"
    assert run_apply(project, Options(vllm_repo=str(upstream), workdir=wd)).ok
    rules = tmp_path / "ignore-rules"
    rules.write_text(".venv/\n")
    if how == "xdg default":
        (tmp_path / "xdg/git").mkdir(parents=True)
        rules.rename(tmp_path / "xdg/git/ignore")
        monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path / "xdg"))
    else:
        (tmp_path / "gitconfig").write_text(f"[core]\n\texcludesFile = {rules}\n")
        monkeypatch.setenv("GIT_CONFIG_GLOBAL", str(tmp_path / "gitconfig"))
    (wd / ".venv").mkdir()
    (wd / ".venv/pyvenv.cfg").write_text("home = /usr/bin\n")
    assert g(wd, "status", "--porcelain") == ""
    report = run_apply(project, Options(vllm_repo=str(upstream), workdir=wd, ref="v1.1.0"))
    assert report.ok, report.to_json()
    assert g(wd, "rev-parse", "--abbrev-ref", "HEAD").strip() == "k3-overlay/9.9.9"
    assert (wd / ".venv/pyvenv.cfg").read_text() == "home = /usr/bin\n"


def test_gits_listed_paths_stay_on_the_one_line():
    stderr = ("error: The following untracked working tree files would be overwritten by checkout:\n"
              "\tpkg/a.py\n\tpkg/b c.py\nPlease move or remove them before you switch branches.\n"
              "Aborting\n")
    assert git.first_line(stderr) == ("error: The following untracked working tree files would be "
                                      "overwritten by checkout: pkg/a.py, pkg/b c.py")
    # a hint is skipped even as GitPython wraps it (the quote it opens is dropped)
    assert git.first_line("  stderr: 'hint: a hint GitPython wrapped\nplain reason") == "plain reason"


def test_ctrl_c_right_after_rebase_to_switches_the_branch_leaves_it_ours(project, upstream,
                                                                          tmp_path, monkeypatch):
    wd = tmp_path / "wd"
    assert run_apply(project, Options(vllm_repo=str(upstream), workdir=wd)).ok
    switch = git.set_branch

    def switched_then_ctrl_c(*args):
        switch(*args)
        os.kill(os.getpid(), signal.SIGINT)

    monkeypatch.setattr(git, "set_branch", switched_then_ctrl_c)
    with pytest.raises(KeyboardInterrupt):
        rebase_to(project, Options(vllm_repo=str(upstream), workdir=wd, ref="v1.1.0"))
    monkeypatch.undo()
    report = rebase_to(project, Options(vllm_repo=str(upstream), workdir=wd, ref="v1.1.0"))
    assert report.ok and [p.status for p in report.patches] == ["applied-3way"]
    tip = g(wd, "config", "branch.k3-overlay/9.9.9.k3overlaytip").strip()
    assert tip == g(wd, "rev-parse", "HEAD").strip()


@pytest.mark.parametrize("line", ["* merge=evil", "*.txt merge=binary", "* -merge",
                                  "[attr]mine filter=evil", "pkg/** filter=evil text"])
@pytest.mark.parametrize("mode", ["apply", "check", "rebase-to"])
def test_merge_or_filter_attributes_of_the_checkout_are_refused(project, upstream, tmp_path, line,
                                                                mode):
    wd = tmp_path / "wd"
    g(tmp_path, "clone", "-q", str(upstream), str(wd))
    (tmp_path / "attributes").write_text(f"# mine\n{line}\n")
    if mode == "check":  # the file a link, which git follows
        (wd / ".git/info/attributes").symlink_to(tmp_path / "attributes")
    else:
        (tmp_path / "attributes").rename(wd / ".git/info/attributes")
    ran = tmp_path / "driver-ran"
    g(wd, "config", "merge.evil.driver", f"echo EVIL > %A; touch {ran}")
    g(wd, "config", "filter.evil.clean", "cat")  # (git status runs it too: no marker)
    before = snapshot(wd)
    opts = Options(vllm_repo=str(upstream), workdir=wd, ref="v1.1.0", check=mode == "check")
    with pytest.raises(errors.UsageError) as err:
        rebase_to(project, opts) if mode == "rebase-to" else run_apply(project, opts)
    name = "filter" if "filter" in line else "merge"
    named = os.path.realpath(wd / ".git/info/attributes")  # git names a link's target
    assert str(err.value) == (f"{named} sets the {name!r} attribute ({line!r}): "
                              f"git would use it in the tool's own 3-way merges; remove the line, "
                              f"or give a fresh clone as --workdir")
    assert snapshot(wd) == before and not ran.exists()


def test_other_attributes_of_the_checkout_are_fine(project, upstream, tmp_path):
    wd = tmp_path / "wd"
    g(tmp_path, "clone", "-q", str(upstream), str(wd))
    (wd / ".git/info/attributes").write_text("*.py diff=python\n*.txt text eol=lf\n")
    report = run_apply(project, Options(vllm_repo=str(upstream), workdir=wd, ref="v1.1.0"))
    assert report.ok and [p.status for p in report.patches] == ["applied-3way"]


def test_a_users_worktree_named_like_ours_is_never_removed(project, upstream, tmp_path):
    """Found by the second adversarial pass: any worktree at ``…/k3-worktree-*/tree`` without
    an owner lock was taken for a killed run's, and every run (even --check) removed it: git's
    entry, its files (changed and untracked ones too) and the folder above it. A folder
    without ``owner.lock`` was never ours: only the entry of one that is gone is removed."""
    wd = tmp_path / "wd"
    g(tmp_path, "clone", "-q", str(upstream), str(wd))
    mine = tmp_path / "k3-worktree-review" / "tree"
    g(wd, "worktree", "add", "-q", str(mine), "v1.1.0")
    (mine / "my-notes.txt").write_text("precious\n")
    (mine / "pkg/model.txt").write_text("my edit\n")
    (mine.parent / "beside.txt").write_text("also precious\n")
    gone = tmp_path / "k3-worktree-gone" / "tree"  # a killed run's, its folder since cleaned
    g(wd, "worktree", "add", "-q", "--detach", str(gone), "v1.0.0")
    subprocess.run(["rm", "-rf", str(gone.parent)], check=True)
    before = g(wd, "worktree", "list", "--porcelain")
    assert run_apply(project, Options(vllm_repo=str(upstream), workdir=wd, check=True)).ok
    after = g(wd, "worktree", "list", "--porcelain")
    assert f"worktree {mine}\n" in after and f"worktree {gone}\n" in before
    assert f"worktree {gone}\n" not in after
    assert (mine / "my-notes.txt").read_text() == "precious\n"
    assert (mine / "pkg/model.txt").read_text() == "my edit\n"
    assert (mine.parent / "beside.txt").read_text() == "also precious\n"


@pytest.mark.parametrize("how", ["apply", "rebase-to", "check"])
def test_a_workdir_that_is_a_checkout_of_another_project_is_refused(project, upstream, tmp_path, how):
    """Round 5 (F8): a clean git repository of the user's own project given as --workdir: the
    tool fetched vLLM into it and checked vLLM out over its files."""
    mine = tmp_path / "myproj"
    mine.mkdir()
    g(tmp_path, "init", "-q", str(mine))
    (mine / "notes.md").write_text("my project\n")
    g(mine, "add", "notes.md")
    g(mine, "-c", "user.name=me", "-c", "user.email=me@x", "commit", "-qm", "mine")
    before = snapshot(mine)
    opts = Options(vllm_repo=str(upstream), workdir=mine, ref="v1.1.0" if how == "rebase-to" else None,
                   check=how == "check")
    with pytest.raises(errors.UsageError) as err:
        (rebase_to if how == "rebase-to" else run_apply)(project, opts)
    assert str(err.value).startswith(f"--workdir {mine} is a git checkout of something else")
    assert "pkg/" in str(err.value) and "\n" not in str(err.value)
    assert snapshot(mine) == before
    assert len(g(mine, "branch", "--format=%(refname:short)").split()) == 1  # no work branch made


def test_a_workdir_below_a_file_is_named_as_such(project, upstream, tmp_path):
    """Round 5 (F8): ``--workdir FILE/sub`` said 'File exists'."""
    (tmp_path / "plain").write_text("a file\n")
    with pytest.raises(errors.UsageError) as err:
        run_apply(project, Options(vllm_repo=str(upstream), workdir=tmp_path / "plain" / "sub"))
    assert str(err.value) == (f"cannot create --workdir {tmp_path / 'plain' / 'sub'}: "
                              f"{tmp_path / 'plain'} is a file, not a folder")
    assert (tmp_path / "plain").read_text() == "a file\n"


@pytest.mark.parametrize("run", [run_apply, rebase_to])
def test_a_bad_base_in_overlay_json_is_named_where_it_comes_from(project, upstream, tmp_path, run):
    """Round 5 (F8): the refusal of a hostile base said only "bad ref"."""
    data = json.loads(project.manifest_path.read_text())
    data["base"] = "--upload-pack=touch pwned"
    project.manifest_path.write_text(json.dumps(data))
    with pytest.raises(errors.UsageError) as err:
        run(project, Options(vllm_repo=str(upstream), workdir=tmp_path / "wd", ref="v1.1.0"))
    assert str(err.value).startswith("bad base in overlay.json '--upload-pack=touch pwned': ")
    assert not (tmp_path / "wd").exists() and not (tmp_path / "pwned").exists()


def test_a_workdir_that_is_a_git_repository_with_no_commit_is_refused(project, upstream, tmp_path):
    """A failed switch from an unborn HEAD has no old tree to go back to: refused up front."""
    empty = tmp_path / "empty"
    g(tmp_path, "init", "-q", str(empty))
    (empty / "draft.txt").write_text("not committed yet\n")
    with pytest.raises(errors.UsageError) as err:
        run_apply(project, Options(vllm_repo=str(upstream), workdir=empty))
    assert str(err.value).startswith(f"--workdir {empty} is a git repository with no commit yet")
    assert (empty / "draft.txt").read_text() == "not committed yet\n"
    assert g(empty, "for-each-ref").strip() == ""



@pytest.mark.parametrize("branch", ["v1.0.0", "origin/main"])
def test_a_work_branch_named_like_a_tag_or_a_remote_branch_is_still_the_tools(project, upstream, tmp_path,
                                                                              branch):
    """Round 7: ``--branch v1.0.0`` (upstream has that tag) or ``origin/main`` (a remote-tracking
    ref of the checkout): git's short name of HEAD is then ``heads/v1.0.0``, and every check of
    the current branch missed it: --export said "not on a work branch made by apply.py"."""
    wd = tmp_path / "wd"
    g(tmp_path, "clone", "-q", str(upstream), str(wd))
    assert apply(project, upstream, wd, branch=branch).ok
    assert git.current_branch(git.open_repo(wd)) == branch
    assert apply(project, upstream, wd, branch=branch, ref="v1.1.0").ok
    assert rebase_to(project, Options(vllm_repo=str(upstream), workdir=wd, branch=branch, ref="v1.1.0")).ok
    assert export(project, wd).patches == ["0001-model-line-4.patch"]


def _crlf_checkout(project, upstream, wd, paths, eol_config=(("core.autocrlf", "true"),)):
    """``wd``: apply.py's checkout, then the user's own: ``eol_config`` in its local config
    (``core.eol`` converts only what attributes call text: ``* text=auto`` in info/attributes
    then), branch ``mine`` at v1.0.0, ``paths`` written again by their git (CRLF) and saved
    unchanged by an editor (a newer mtime: stat-dirty, so git must read them to call them clean)."""
    assert apply(project, upstream, wd).ok
    for key, value in eol_config:
        g(wd, "config", "--local", key, value)
    if "core.eol" in dict(eol_config):
        (wd / ".git/info/attributes").write_text("* text=auto\n")
    g(wd, "checkout", "-q", "-b", "mine", "v1.0.0")
    for path in paths:
        (wd / path).unlink()
        g(wd, "checkout", "-q", "--", path)
        assert (wd / path).read_bytes().count(b"\r\n") > 1
    # a checkout written a while ago, its index up to date (no entry racily clean: git would
    # re-read those whatever their stat data), then the editor's save
    now = time.time()
    for path in filter(None, g(wd, "ls-files", "-z").split("\0")):
        os.utime(wd / path, (now - 100, now - 100))
    g(wd, "update-index", "-q", "--refresh")
    for path in paths:
        os.utime(wd / path, (now - 50, now - 50))


@pytest.mark.parametrize("eol_config", [(("core.autocrlf", "true"),),
                                        (("core.autocrlf", "true"), ("core.safecrlf", "true")),
                                        (("core.eol", "crlf"),)])
def test_a_touched_file_of_a_checkout_with_crlf_endings_is_no_uncommitted_change(project, upstream,
                                                                                  tmp_path, eol_config):
    """Round 6 (F6): the checkout's own config says ``core.autocrlf=true`` (its git wrote CRLF)
    and an editor saved a file unchanged; the user's `git status` calls it clean, yet the tool,
    pinning autocrlf=false for every git, re-hashed it unconverted: "has uncommitted changes"."""
    wd = tmp_path / "wd"
    paths = ["pkg/model.txt", "pkg/user.py"]  # one the switch rewrites, one it leaves alone
    _crlf_checkout(project, upstream, wd, paths, eol_config)
    repo = git.open_repo(wd)
    blobs = {p: ("100644", g(wd, "rev-parse", f"v1.0.0:{p}").strip()) for p in paths}
    assert git.work_tree_entries(repo, paths) == blobs  # what a switch's undo tells git's writes by
    assert not git.is_dirty(repo)
    report = apply(project, upstream, wd, ref="v1.1.0")
    assert report.ok, report.to_json()
    assert g(wd, "rev-parse", "--abbrev-ref", "HEAD").strip() == "k3-overlay/9.9.9"
    assert g(wd, "status", "--porcelain") == ""


def test_a_touched_file_of_a_checkout_under_a_global_autocrlf_is_no_uncommitted_change(project, upstream,
                                                                                     tmp_path, monkeypatch):
    """Round 7: ``core.autocrlf=true`` set once in the user's global config (Windows, WSL), not in
    the checkout's: their git wrote CRLF and calls a file an editor saved unchanged clean; the
    tool read only the checkout's own settings and refused, "has uncommitted changes"."""
    config = tmp_path / "gitconfig"
    config.write_text("[core]\n\tautocrlf = true\n")
    monkeypatch.setenv("GIT_CONFIG_GLOBAL", str(config))
    wd = tmp_path / "wd"
    _crlf_checkout(project, upstream, wd, ["pkg/model.txt", "pkg/user.py"], eol_config=())
    _clean_and_a_real_edit_refused(project, upstream, wd)


def _clean_and_a_real_edit_refused(project, upstream, wd):
    """The CRLF checkout ``wd`` is clean to the tool, which switches it; then a real edit of
    the user's is still an uncommitted change."""
    assert not git.is_dirty(git.open_repo(wd))
    assert apply(project, upstream, wd, ref="v1.1.0").ok
    assert g(wd, "status", "--porcelain") == ""
    (wd / "pkg/user.py").write_bytes((wd / "pkg/user.py").read_bytes() + b"# mine\r\n")
    with pytest.raises(errors.UsageError, match="has uncommitted changes"):  # a real edit still is one
        apply(project, upstream, wd, ref="v1.0.0")


@pytest.mark.parametrize("scope", ["global", "local"])
def test_a_touched_file_under_the_users_attributes_file_with_crlf_is_no_uncommitted_change(
        project, upstream, tmp_path, monkeypatch, scope):
    """Round 8: the user's ``core.attributesFile`` says ``* text eol=crlf`` (their git wrote CRLF
    and calls a file an editor saved unchanged clean); the tool pinned ``core.attributesFile``
    to /dev/null for its status too and refused the checkout, "has uncommitted changes"."""
    attributes = tmp_path / "my-attributes"
    attributes.write_text("* text eol=crlf\n")
    config = tmp_path / "gitconfig"
    config.write_text(f"[core]\n\tattributesFile = {attributes}\n" if scope == "global" else "")
    monkeypatch.setenv("GIT_CONFIG_GLOBAL", str(config))
    wd = tmp_path / "wd"
    assert apply(project, upstream, wd).ok
    if scope == "local":
        g(wd, "config", "--local", "core.attributesFile", str(attributes))
    paths = ["pkg/model.txt", "pkg/user.py"]
    _crlf_checkout(project, upstream, wd, paths, eol_config=())
    _clean_and_a_real_edit_refused(project, upstream, wd)
    attributes.unlink()
    os.mkfifo(attributes)  # never waited on: not carried, so the pin holds (and a refusal at worst)
    assert "core.attributesfile" not in " ".join(gitproc.checkouts_eol(wd))


def test_an_autocrlf_the_global_config_includes_for_the_checkout_alone_is_read(project, upstream,
                                                                              tmp_path, monkeypatch):
    """``core.autocrlf=true`` in a file the global config includes for this checkout alone
    (``includeIf "gitdir:…"``): the user's git reads it there; the tool read the global config
    from ``/``, where the condition holds for no repository, and refused a clean checkout."""
    wd = tmp_path / "wd"
    (tmp_path / "for-wd").write_text("[core]\n\tautocrlf = true\n")
    (tmp_path / "gitconfig").write_text(f'[includeIf "gitdir:{wd}/"]\n\tpath = {tmp_path / "for-wd"}\n')
    monkeypatch.setenv("GIT_CONFIG_GLOBAL", str(tmp_path / "gitconfig"))
    _crlf_checkout(project, upstream, wd, ["pkg/model.txt", "pkg/user.py"], eol_config=())
    assert not git.is_dirty(git.open_repo(wd))  # (the user's `git status` would refresh the index)
    assert apply(project, upstream, wd, ref="v1.1.0").ok
    assert g(wd, "status", "--porcelain") == ""


def test_a_real_edit_of_a_checkout_with_crlf_endings_is_still_refused(project, upstream, tmp_path):
    wd = tmp_path / "wd"
    _crlf_checkout(project, upstream, wd, ["pkg/user.py"])
    (wd / "pkg/user.py").write_bytes((wd / "pkg/user.py").read_bytes() + b"# mine\r\n")
    assert git.is_dirty(git.open_repo(wd))
    with pytest.raises(errors.UsageError, match="has uncommitted changes"):
        apply(project, upstream, wd, ref="v1.1.0")
    assert (wd / "pkg/user.py").read_bytes().endswith(b"# mine\r\n")


def test_what_a_file_of_a_crlf_checkout_holds_is_read_as_its_own_git_reads_it(tmp_path):
    """A failed switch's undo tells the files git wrote by their blob (``work_tree_entries``): under
    the checkout's own ``core.autocrlf=true`` a CRLF file from an LF blob holds that blob, and a file
    committed with CRLF (git never converts one whose index blob has a CR) holds its own, as for
    the checkout's `git status`; pinned autocrlf=false missed the first, converting every file the second."""
    repo = tmp_path / "r"
    g(tmp_path, "init", "-q", str(repo))
    (repo / "crlf.txt").write_bytes(b"committed\r\nwith CRLF\r\n")
    (repo / "lf.txt").write_bytes(b"committed\nwith LF\n")
    g(repo, "add", ".")
    g(repo, "commit", "-q", "-m", "files")
    g(repo, "config", "--local", "core.autocrlf", "true")
    (repo / "lf.txt").unlink()
    g(repo, "checkout", "-q", "--", "lf.txt")
    assert (repo / "lf.txt").read_bytes() == b"committed\r\nwith LF\r\n"
    assert g(repo, "status", "--porcelain") == ""
    paths = ["crlf.txt", "lf.txt"]
    assert git.work_tree_entries(git.open_repo(repo), paths) == {
        p: ("100644", g(repo, "rev-parse", f"HEAD:{p}").strip()) for p in paths}


# -- Round 10: a Ctrl-C, SIGTERM or SIGHUP that came while the checkout was switched (or an
# export written) was held until the step was done, then dropped: `--build-wheel` built and
# wrote the whole wheel, and the run exited 0; the export exited 0 without a word of it.


@pytest.mark.parametrize("wheel", [False, True])
@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM, signal.SIGHUP])
def test_a_signal_while_switching_finishes_the_switch_then_stops(project, upstream, tmp_path, monkeypatch,
                                                                capsys, sig, wheel):
    monkeypatch.setattr(cli, "Project", lambda: project)
    wd, out = tmp_path / "wd", tmp_path / "r.json"
    switch, built = git.set_branch, []

    def switched_then_signalled(*args):
        switch(*args)
        os.kill(os.getpid(), sig)

    monkeypatch.setattr(git, "set_branch", switched_then_signalled)
    monkeypatch.setattr(cli, "_build_wheel", lambda *args: built.append(args))
    extra = ["--build-wheel", "--wheel-dir", str(tmp_path / "wheels")] if wheel else []
    code = cli.main(["--vllm-repo", str(upstream), "--workdir", str(wd), "--json", str(out), *extra])
    assert code == errors.INTERRUPTED and built == []
    said = "interrupted while switching the checkout: the switch was finished first, branch " \
           "k3-overlay/9.9.9 is published" + (", no wheel was written" if wheel else "")
    assert capsys.readouterr().err.splitlines()[-1] == f"apply.py: {said}"
    report = json.loads(out.read_text())
    assert report["error"] == said and report["ok"] is False
    assert g(wd, "symbolic-ref", "HEAD").strip() == "refs/heads/k3-overlay/9.9.9"  # finished, recorded:
    monkeypatch.undo()
    assert run_apply(project, Options(vllm_repo=str(upstream), workdir=wd)).ok  # a rerun goes on


def test_a_signal_while_an_export_writes_finishes_it_then_stops(project, upstream, tmp_path, monkeypatch,
                                                                capsys):
    from k3overlay import export as export_mod

    monkeypatch.setattr(cli, "Project", lambda: project)
    wd = tmp_path / "wd"
    apply(project, upstream, wd)
    (wd / "pkg/model.txt").write_text((wd / "pkg/model.txt").read_text() + "line 13\n")
    g(wd, "commit", "-qam", "model: line 13\n\nUpstream-Status: Pending")
    write_all = export_mod.write_all_in_tree

    def written_then_ctrl_c(*args, **kwargs):
        os.kill(os.getpid(), signal.SIGINT)  # held: the writing goes on whole
        write_all(*args, **kwargs)

    monkeypatch.setattr(export_mod, "write_all_in_tree", written_then_ctrl_c)
    assert cli.main(["--export", "--workdir", str(wd)]) == errors.INTERRUPTED
    captured = capsys.readouterr()
    assert captured.err.splitlines()[-1] == "apply.py: interrupted while writing the export: it was finished first"
    assert "0002-model-line-13.patch" in captured.out
    assert (project.patches_dir / "series").read_text().splitlines()[-1] == "0002-model-line-13.patch"


# -- Round 10b: a signal just before or after the switch, or as the run ended, was said as
# "the checkout's branches, HEAD and files were left as they were" (after the switch: false),
# and a --json report of an earlier run was left as if it were this one's.


def test_an_interrupt_before_the_switch_writes_this_runs_report_file(project, upstream, tmp_path, monkeypatch,
                                                                    capsys):
    from k3overlay import source

    monkeypatch.setattr(cli, "Project", lambda: project)
    out = tmp_path / "r.json"
    out.write_text('{"ok": true, "workdir": "an earlier run\'s"}')
    real = source.locate

    def located_then_interrupted(*args):
        real(*args)
        raise KeyboardInterrupt  # (a signal's effect: the suite may run with SIGINT ignored)

    monkeypatch.setattr(source, "locate", located_then_interrupted)
    assert cli.main(["--vllm-repo", str(upstream), "--workdir", str(tmp_path / "wd"), "--json", str(out)]) == 130
    said = "interrupted; the checkout's branches, HEAD and files were left as they were"
    assert capsys.readouterr().err.splitlines()[-1] == f"apply.py: {said}"
    report = json.loads(out.read_text())
    assert report["ok"] is False and report["error"] == said


def test_an_interrupt_as_the_run_lets_go_after_the_switch_says_it_was_published(project, upstream, tmp_path,
                                                                                monkeypatch, capsys):
    from k3overlay import claim

    monkeypatch.setattr(cli, "Project", lambda: project)
    wd, out = tmp_path / "wd", tmp_path / "r.json"
    real = claim.release

    def released_then_interrupted(*args):
        real(*args)
        raise KeyboardInterrupt

    monkeypatch.setattr(claim, "release", released_then_interrupted)
    assert cli.main(["--vllm-repo", str(upstream), "--workdir", str(wd), "--json", str(out)]) == 130
    said = "interrupted after the switch: branch k3-overlay/9.9.9 is published"
    assert capsys.readouterr().err.splitlines()[-1] == f"apply.py: {said}"
    assert json.loads(out.read_text())["error"] == said
    assert g(wd, "symbolic-ref", "HEAD").strip() == "refs/heads/k3-overlay/9.9.9"


def test_an_interrupt_as_the_temporary_files_go_at_the_end_is_said_as_such(project, upstream, tmp_path,
                                                                          monkeypatch, capsys):
    import contextlib

    from k3overlay import scratch

    monkeypatch.setattr(cli, "Project", lambda: project)
    real = scratch.per_run

    @contextlib.contextmanager
    def interrupted_as_it_ends():
        with real() as folder:
            yield folder
        raise KeyboardInterrupt  # (a removal's own deferred raises it once it is done)

    monkeypatch.setattr(scratch, "per_run", interrupted_as_it_ends)
    out = tmp_path / "r.json"
    assert cli.main(["--vllm-repo", str(upstream), "--workdir", str(tmp_path / "wd"), "--json", str(out)]) == 0
    err = capsys.readouterr().err.splitlines()
    assert err[-1] == "apply.py: interrupted as the run ended: its temporary files were removed first"
    assert not any("left as they were" in line for line in err) and json.loads(out.read_text())["ok"] is True
