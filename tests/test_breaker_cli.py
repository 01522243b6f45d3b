"""Found by the adversarial pass: ``--workdir`` naming this repository's own checkout (or a
folder holding it) published vLLM's branch there, switching patches/, overlay/ and apply.py
out of the user's work tree."""

from __future__ import annotations

import os

import pytest

from k3overlay import cli, errors

from .conftest import g, snapshot


@pytest.mark.parametrize("where", ["root", "parent"])
def test_workdir_holding_the_project_is_refused_and_left_as_it_was(project, upstream, tmp_path,
                                                                  monkeypatch, capsys, where):
    root = project.root
    (root / ".gitignore").write_text("work/\n")
    g(root, "init", "-q", "-b", "main")
    g(root, "add", "-A")
    g(root, "commit", "-qm", "the overlay project")
    before = snapshot(root)
    monkeypatch.setattr(cli, "Project", lambda: project)
    workdir = root if where == "root" else root.parent
    for mode in ([], ["--check"], ["--export"], ["--rebase-to", "v1.1.0"]):
        extra = [] if mode == ["--export"] else ["--vllm-repo", str(upstream)]
        assert cli.main(["-q", "--workdir", str(workdir), *extra, *mode]) == errors.USAGE
        err = capsys.readouterr().err.strip().splitlines()
        assert err == [f"apply.py: error: --workdir {workdir} holds this repository "
                       f"({root.resolve()}); give a folder of its own (default: work/vllm)"], mode
    assert snapshot(root) == before and (root / "overlay.json").is_file()


# Found by the second adversarial pass: a --branch git refuses (HEAD, -f, @{-1}, "a b") was
# found out only when publishing, after all the work, and never by --check (which said ok).
# The same holds for a work branch named from a VERSION git cannot take.

@pytest.mark.parametrize("branch", ["HEAD", "-f", "@{-1}", "a b", "x.lock", "a..b"])
@pytest.mark.parametrize("mode", [["--check"], [], ["--rebase-to", "v1.1.0"]])
def test_a_branch_name_git_refuses_is_refused_before_any_work(project, upstream, tmp_path,
                                                             monkeypatch, capsys, branch, mode):
    monkeypatch.setattr(cli, "Project", lambda: project)
    wd = tmp_path / "wd"
    code = cli.main(["-q", "--vllm-repo", str(upstream), "--workdir", str(wd), f"--branch={branch}", *mode])
    assert code == errors.USAGE and capsys.readouterr().err.splitlines() == [
        f"apply.py: error: --branch {branch!r} is not a valid git branch name"]
    assert not wd.exists()


def test_a_version_that_makes_no_branch_name_is_refused(project, upstream, tmp_path, monkeypatch,
                                                       capsys):
    (project.root / "VERSION").write_text("1.0 rc1\n")
    monkeypatch.setattr(cli, "Project", lambda: project)
    assert cli.main(["-q", "--check", "--vllm-repo", str(upstream), "--workdir", str(tmp_path / "wd")]) == 2
    assert capsys.readouterr().err.splitlines() == [
        "apply.py: error: the work branch (from VERSION) 'k3-overlay/1.0 rc1' is not a valid git "
        "branch name"]


# Found by the second adversarial pass: this repository's own VERSION missing (or a folder, or
# empty) ended every mode, --help included, in a traceback; a FIFO at VERSION or overlay.json
# hung the tool, waiting for a writer that never came.

def _make(path, kind):
    path.unlink()
    if kind == "missing":
        return
    if kind == "folder":
        path.mkdir()
    elif kind == "fifo":
        os.mkfifo(path)
    elif kind == "empty":
        path.write_text("\n")
    else:
        path.write_bytes(b"\xff\xfe0.1\n")


@pytest.mark.parametrize("kind", ["missing", "folder", "fifo", "empty", "not utf-8"])
@pytest.mark.parametrize("args", [["--help"], ["--check"], ["--export"]])
def test_an_unreadable_version_file_is_one_line_never_a_traceback_or_a_hang(project, monkeypatch,
                                                                          capsys, kind, args):
    _make(project.root / "VERSION", kind)
    monkeypatch.setattr(cli, "Project", lambda: project)
    assert cli.main(["-q", *args]) == errors.USAGE  # a FIFO read would block here forever
    assert capsys.readouterr().err.splitlines() == [
        f"apply.py: error: {project.root / 'VERSION'} is missing, empty, not UTF-8 text or not a "
        f"regular file; it holds the overlay version (restore it with git)"]


@pytest.mark.parametrize("kind", ["missing", "folder", "fifo"])
def test_an_unreadable_manifest_is_one_line_never_a_hang(project, upstream, tmp_path, monkeypatch,
                                                         capsys, kind):
    _make(project.manifest_path, kind)
    monkeypatch.setattr(cli, "Project", lambda: project)
    assert cli.main(["-q", "--check", "--vllm-repo", str(upstream), "--workdir", str(tmp_path / "wd")]) == 2
    assert capsys.readouterr().err.splitlines() == [
        f"apply.py: error: cannot read overlay manifest {project.manifest_path}: overlay.json is "
        f"missing or not a regular file"]


# Found by the second adversarial pass: a relative --vllm-repo (or $VLLM_REPO) was handed to
# git as it was, and git runs beside the work directory (clone) or in the checkout (fetch):
# "up.git" from the current folder was not found, or another repository of that name there
# was silently used instead.

@pytest.mark.parametrize("how", ["option", "environment"])
def test_a_relative_vllm_repo_is_read_from_the_current_folder(project, upstream, tmp_path,
                                                              monkeypatch, how):
    here = tmp_path / "here"
    here.mkdir()
    g(tmp_path, "clone", "-q", "--bare", str(upstream), str(here / "up.git"))
    wd = tmp_path / "work" / "vllm"
    decoy = tmp_path / "work" / "up.git"  # where git would have looked, beside the workdir
    decoy.parent.mkdir()
    g(tmp_path, "init", "-q", "--bare", str(decoy))
    monkeypatch.chdir(here)
    monkeypatch.setattr(cli, "Project", lambda: project)
    repo = ["--vllm-repo", "up.git"] if how == "option" else []
    if how == "environment":
        monkeypatch.setenv("VLLM_REPO", "up.git")
    for ref in ("v1.0.0", "v1.1.0"):  # a fresh clone, then a fetch into the checkout
        assert cli.main(["-q", *repo, "--workdir", str(wd), "--vllm-ref", ref]) == errors.OK
        assert g(wd, "rev-parse", "HEAD~2").strip() == g(upstream, "rev-parse", ref).strip()
