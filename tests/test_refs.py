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


def test_check_reads_head_and_branches_in_the_source_as_a_normal_run_does(project, upstream, tmp_path,
                                                                          monkeypatch, capsys):
    """Issue 25, 12: ``--check --vllm-ref HEAD --vllm-repo SRC`` on a published checkout read
    the checkout's HEAD (the patched work branch: landed-upstream and drift, exit 4), and a
    branch name the checkout also has its stale local copy. Every ref is now resolved by the
    one rule a normal run uses: fetched from the source unless a full sha or a release tag;
    only a name the source lacks is the checkout's."""
    monkeypatch.setattr(cli, "Project", lambda: project)
    src, wd = tmp_path / "src", tmp_path / "wd"
    g(tmp_path, "clone", "-q", str(upstream), str(src))
    g(src, "reset", "-q", "--hard", "v1.0.0")
    assert cli.main(["-q", "--vllm-repo", str(src), "--workdir", str(wd)]) == errors.OK
    g(wd, "branch", "mine", "v1.0.0")  # a branch only the checkout has
    g(src, "reset", "-q", "--hard", "v1.1.0")  # the source moves on; the checkout's main is stale
    before = snapshot(wd)
    sha = {t: g(src, "rev-parse", f"{t}^{{commit}}").strip() for t in ("v1.0.0", "v1.1.0")}
    expected = {"HEAD": sha["v1.1.0"], "main": sha["v1.1.0"], "HEAD~1": sha["v1.0.0"],
                "refs/heads/main": sha["v1.1.0"], "mine": sha["v1.0.0"]}
    report = tmp_path / "r.json"
    for ref, want in expected.items():
        code = cli.main(["-q", "--check", "--vllm-repo", str(src), "--vllm-ref", ref,
                         "--workdir", str(wd), "--json", str(report)])
        assert (code, json.loads(report.read_text())["ref_sha"]) == (errors.OK, want), (
            ref, capsys.readouterr())
        assert snapshot(wd) == before, ref
    for ref in ("main", "mine"):  # the normal run agrees
        assert cli.main(["-q", "--vllm-repo", str(src), "--vllm-ref", ref, "--workdir", str(wd),
                         "--json", str(report)]) == errors.OK
        assert json.loads(report.read_text())["ref_sha"] == expected[ref], ref


def test_head_is_never_the_checkouts_own_when_the_source_cannot_answer(project, upstream, tmp_path,
                                                                      monkeypatch, capsys):
    """The fallback to what the checkout says (a branch only it has) is never taken for
    HEAD, with or without --check: the checkout's HEAD is the patched work branch."""
    monkeypatch.setattr(cli, "Project", lambda: project)
    src, wd = tmp_path / "src", tmp_path / "wd"
    g(tmp_path, "clone", "-q", "--bare", str(upstream), str(src))
    assert cli.main(["-q", "--vllm-repo", str(src), "--workdir", str(wd)]) == errors.OK
    g(src, "symbolic-ref", "HEAD", "refs/heads/gone")  # a source whose HEAD names no commit
    before = snapshot(wd)
    for mode in (["--check"], []):
        code = cli.main(["-q", *mode, "--vllm-repo", str(src), "--vllm-ref", "HEAD", "--workdir", str(wd)])
        assert code == errors.USAGE and "HEAD" in capsys.readouterr().err, mode
        assert snapshot(wd) == before, mode
