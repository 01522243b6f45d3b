"""Attributes from REF's tree never choose how our series or overlay is merged or checked out:
a line both sides changed is always a conflict (exit 3)."""

from __future__ import annotations

import json

import pytest

from k3overlay import cli, errors
from k3overlay.job import Options, run_apply
from k3overlay.rebase import rebase_to, run_rebase

from .conftest import MOD_BASE, commit_tag, g, model, snapshot


@pytest.fixture
def with_attributes(upstream, tmp_path):
    """A copy of ``upstream`` whose tag ``vX`` is v1.3.0 (line 4 changed another way than our
    patch changes it) plus the attribute files given."""
    def make(files: dict[str, str]):
        repo = tmp_path / "up-attr"
        g(tmp_path, "clone", "-q", str(upstream), str(repo))
        g(repo, "checkout", "-q", "v1.3.0")
        commit_tag(repo, files, "vX")
        return repo
    return make


UNION = {
    "root": {".gitattributes": "pkg/model.txt merge=union\n"},
    "nested": {"pkg/.gitattributes": "model.txt merge=union\n"},
    "everything": {".gitattributes": "* merge=union\n"},
    "macro": {".gitattributes": "[attr]together merge=union\npkg/* together\n"},
    "deep glob": {"pkg/.gitattributes": "**/*.txt merge=union\n"},
}


@pytest.mark.parametrize("case", list(UNION))
def test_a_union_merge_attribute_in_the_tree_is_still_a_conflict(project, with_attributes, tmp_path,
                                                                 monkeypatch, capsys, case):
    up = with_attributes(UNION[case])
    wd = tmp_path / "wd"
    g(tmp_path, "clone", "-q", str(up), str(wd))
    before = snapshot(wd)
    monkeypatch.setattr(cli, "Project", lambda: project)
    code = cli.main(["-q", "--vllm-repo", str(up), "--vllm-ref", "vX", "--workdir", str(wd),
                     "--json", str(tmp_path / "r.json")])
    [patch] = json.loads((tmp_path / "r.json").read_text())["patches"]
    assert code == errors.CONFLICT and patch["status"] == "conflict", capsys.readouterr()
    assert patch["files"] == ["pkg/model.txt"] and snapshot(wd) == before


def test_a_merge_driver_the_tree_names_never_runs(project, with_attributes, tmp_path):
    up = with_attributes({".gitattributes": "pkg/model.txt merge=theirs\n"})
    wd = tmp_path / "wd"
    g(tmp_path, "clone", "-q", str(up), str(wd))
    ran = tmp_path / "driver-ran"
    g(wd, "config", "merge.theirs.driver", f"touch {ran}; cp %B %A")  # the user's own, say
    report = run_apply(project, Options(ref="vX", vllm_repo=str(up), workdir=wd))
    assert report.exit_code == errors.CONFLICT and not ran.exists()


def test_the_rebase_job_reports_the_conflict_too(project, with_attributes):
    up = with_attributes(UNION["root"])
    [report] = run_rebase(project, ["vX"], vllm_repo=str(up))
    assert [p.status for p in report.patches] == ["conflict"] and report.exit_code == errors.CONFLICT


@pytest.mark.parametrize("case", list(UNION))
def test_rebase_to_refuses_a_merge_attribute_then_stops_at_the_conflict(project, with_attributes,
                                                                        tmp_path, case):
    up = with_attributes(UNION[case])
    wd = tmp_path / "wd"
    assert run_apply(project, Options(vllm_repo=str(up), workdir=wd)).ok
    before = snapshot(wd)
    with pytest.raises(errors.UsageError, match=r"give pkg/\S+ merge=union: --rebase-to merges in "
                                                r"the checkout"):
        rebase_to(project, Options(ref="vX", vllm_repo=str(up), workdir=wd))
    assert snapshot(wd) == before
    (wd / ".git" / "info" / "attributes").write_text("* !merge\n")  # as it advises
    report = rebase_to(project, Options(ref="vX", vllm_repo=str(up), workdir=wd))
    assert [p.status for p in report.patches] == ["conflict"] and report.exit_code == errors.CONFLICT
    assert "<<<<<<< " in (wd / "pkg" / "model.txt").read_text()


@pytest.mark.parametrize("attributes", ["* text eol=crlf\n", "* ident\n", "*.py filter=lfs\n",
                                        "* -text -diff\n"])
def test_conversion_attributes_change_no_byte_we_commit(project, with_attributes, tmp_path, attributes):
    up = with_attributes({".gitattributes": attributes, "pkg/model.txt": model({})})
    wd = tmp_path / "wd"
    report = run_apply(project, Options(ref="vX", vllm_repo=str(up), workdir=wd, allow_drift=True))
    assert report.ok, report.to_json()
    ours = (project.overlay_dir / "pkg" / "mod.py").read_bytes()
    assert g(wd, "cat-file", "blob", "HEAD:pkg/mod.py").encode() == ours
    assert g(wd, "cat-file", "blob", "HEAD~1:pkg/model.txt") == model({4: "line 4 (ours)"})
    assert MOD_BASE in ours.decode()
