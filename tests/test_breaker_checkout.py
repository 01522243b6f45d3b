"""Found by the second adversarial pass: files in the user's checkout that git does not
track because they are ignored. ``git checkout`` and ``git am --3way`` treat ignored files
as expendable, and laying an overlay file replaced whatever sat there, so publishing the
work branch or ``--rebase-to`` overwrote a user's ignored file without a word. And the
user's own ignore rules (``~/.config/git/ignore``, ``core.excludesFile``) were shut out, so
a checkout their ``git status`` calls clean (a ``.venv`` they ignore) was refused as dirty."""

from __future__ import annotations

import os
import signal
import subprocess

import pytest

from k3overlay import cli, errors, git
from k3overlay.job import Options, run_apply
from k3overlay.rebase import rebase_to

from .conftest import g, snapshot

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


# Found by the second adversarial pass: Ctrl-C landing just as --rebase-to had switched the
# checkout to the new branch, before it recorded the branch as its own, left a branch every
# later run refused ("has commits apply.py did not write"), with no way on but deleting it.

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


# Found by the second adversarial pass: the checkout's own .git/info/attributes, which no
# config can shut out and the tool's temporary worktrees share. ``* merge=evil`` with the
# checkout's merge.evil.driver ran the user's command in the tool's 3-way merge and published
# its output as pkg/model.txt, exit 0; ``* merge=binary`` made a clean 3-way a "conflict".

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
