"""Found by the adversarial pass: ``--workdir`` naming this repository's own checkout (or a
folder holding it) published vLLM's branch there, switching patches/, overlay/ and apply.py
out of the user's work tree."""

from __future__ import annotations

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
