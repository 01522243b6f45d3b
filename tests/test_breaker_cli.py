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
