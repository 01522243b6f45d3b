"""Every ref form git accepts is either exactly one commit or refused in one line, exit 2;
no run loses a report it was asked to write."""

from __future__ import annotations

import json

import pytest

from k3overlay import cli, errors

from .conftest import g, snapshot
from .test_rebase import load_ci_rebase

REFUSED = {
    "^v1.0.0": "negative ref", "^refs/tags/v1.0.0": "negative ref",
    "v1.*": "wildcard", "refs/tags/*": "wildcard", "v1.?.0": "wildcard", "v1.[01].0": "wildcard",
    "HEAD@{-1}": "@{...}", "@{-1}": "@{...}", "main@{upstream}": "@{...}", "main@{u}": "@{...}",
    "main@{push}": "@{...}", "main@{1}": "@{...}", "main@{yesterday}": "@{...}",
    "v1.0.0..v1.1.0": "range", "v1.0.0...v1.1.0": "range", "v1.1.0^@": "range",
    "v1.1.0^!": "range", "v1.1.0^-1": "range",
    ":/release": "':'", "v1.1.0:pkg/model.txt": "':'", ":0:pkg/model.txt": "':'",
    "v1.1.0^{tree}": "may follow a name", "v1.1.0^{/release}": "may follow a name",
    "v1.1.0^{blob}": "may follow a name",
    "FETCH_HEAD": "this machine's", "ORIG_HEAD": "this machine's",
    "--upload-pack=touch x": "option", "-v1": "option", "": "empty", "v1 .0": "whitespace",
    "v1.0.0\t": "whitespace", "+main": "forced refspec", "@": "check-ref-format",
    "x.lock": "check-ref-format", "a//b": "check-ref-format", "v1.0.0/": "check-ref-format",
}


@pytest.mark.parametrize("ref", list(REFUSED))
@pytest.mark.parametrize("option", ["--vllm-ref", "--rebase-to"])
def test_a_ref_naming_no_single_commit_is_one_line_exit_2_and_the_json_is_kept(
        project, upstream, tmp_path, monkeypatch, capsys, ref, option):
    monkeypatch.setattr(cli, "Project", lambda: project)
    wd = tmp_path / "wd"
    assert cli.main(["-q", "--vllm-repo", str(upstream), "--workdir", str(wd)]) == errors.OK
    before = snapshot(wd)
    capsys.readouterr()
    report = tmp_path / "report.json"
    code = cli.main(["-q", "--vllm-repo", str(upstream), "--workdir", str(wd), f"{option}={ref}",
                     "--json", str(report)])
    err = capsys.readouterr().err
    assert code == errors.USAGE and REFUSED[ref] in err and len(err.splitlines()) == 1, err
    assert json.loads(report.read_text())["error"] == err.strip().removeprefix("apply.py: error: ")
    assert snapshot(wd) == before


@pytest.mark.parametrize("ref, equals", [("v1.2.0~1", "v1.1.0"), ("v1.2.0^", "v1.1.0"),
                                         ("v1.1.0^0", "v1.1.0"), ("v1.1.0^{commit}", "v1.1.0"),
                                         ("refs/tags/v1.1.0", "v1.1.0"), ("main~2", "v1.1.0"),
                                         ("v1.2.0^{}~1", "v1.1.0")])
def test_ancestry_steps_name_exactly_one_commit(project, upstream, tmp_path, monkeypatch, capsys,
                                                ref, equals):
    monkeypatch.setattr(cli, "Project", lambda: project)
    report = tmp_path / "r.json"
    code = cli.main(["-q", "--check", "--vllm-repo", str(upstream), "--vllm-ref", ref,
                     "--workdir", str(tmp_path / "wd"), "--json", str(report)])
    assert code == errors.OK, capsys.readouterr().err
    want = g(upstream, "rev-parse", f"{equals}^{{commit}}").strip()
    assert json.loads(report.read_text())["ref_sha"] == want


def test_an_abbreviated_sha_is_one_commit(project, upstream, tmp_path, monkeypatch):
    monkeypatch.setattr(cli, "Project", lambda: project)
    sha = g(upstream, "rev-parse", "v1.1.0").strip()
    report = tmp_path / "r.json"
    assert cli.main(["-q", "--check", "--vllm-repo", str(upstream), "--vllm-ref", sha[:10],
                     "--workdir", str(tmp_path / "wd"), "--json", str(report)]) == errors.OK
    assert json.loads(report.read_text())["ref_sha"] == sha


@pytest.mark.parametrize("bad", ["^v1.0.0", "v1.*", "HEAD@{-1}", "v1.0.0..v1.1.0", ":/release",
                                 "v1.1.0^{tree}", "-x", ""])
def test_rebase_job_onto_a_bad_ref_keeps_the_other_targets(project, upstream, tmp_path, monkeypatch,
                                                           capsys, bad):
    ci_rebase = load_ci_rebase()
    monkeypatch.setattr(ci_rebase, "Project", lambda: project)
    outs = [tmp_path / "out.json", tmp_path / "out.xml", tmp_path / "out.md"]
    code = ci_rebase.main(["-q", f"--onto={bad}", "--onto", "v1.1.0", "--vllm-repo", str(upstream),
                           "--no-tests", "--json", str(outs[0]), "--junit", str(outs[1]),
                           "--markdown", str(outs[2])])
    assert code == errors.USAGE and "Traceback" not in capsys.readouterr().err
    first, second = json.loads(outs[0].read_text())
    assert first["error"].startswith(f"bad ref {bad!r}") and second["ok"] and second["ref"] == "v1.1.0"
    assert outs[1].read_text().count("<testsuite ") == 2 and "v1.1.0" in outs[2].read_text()


def test_an_internal_error_still_writes_the_json_report(project, upstream, tmp_path, monkeypatch):
    from k3overlay import job

    def broken(*args, **kwargs):
        raise TypeError("expected str, not NoneType")

    monkeypatch.setattr(cli, "Project", lambda: project)
    monkeypatch.setattr(job, "build", broken)
    report = tmp_path / "r.json"
    with pytest.raises(TypeError):
        cli.main(["-q", "--vllm-repo", str(upstream), "--workdir", str(tmp_path / "wd"),
                  "--json", str(report)])
    data = json.loads(report.read_text())
    assert data["ok"] is False and data["error"].startswith("internal error (a bug of apply.py): TypeError")


def test_an_internal_error_in_the_rebase_job_still_writes_every_report(project, upstream, tmp_path,
                                                                      monkeypatch):
    ci_rebase = load_ci_rebase()

    def broken(*args, **kwargs):
        raise TypeError("expected str, not NoneType")

    monkeypatch.setattr(ci_rebase, "Project", lambda: project)
    monkeypatch.setattr(ci_rebase, "run_rebase", broken)
    outs = [tmp_path / "out.json", tmp_path / "out.xml", tmp_path / "out.md"]
    with pytest.raises(TypeError):
        ci_rebase.main(["-q", "--onto", "v1.1.0", "--vllm-repo", str(upstream), "--json", str(outs[0]),
                        "--junit", str(outs[1]), "--markdown", str(outs[2])])
    [data] = json.loads(outs[0].read_text())
    assert data["error"].startswith("internal error (a bug of rebase.py): TypeError")
    assert "internal error" in outs[1].read_text() and "internal error" in outs[2].read_text()
