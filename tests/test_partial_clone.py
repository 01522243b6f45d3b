"""A checkout that is a partial clone (``git clone --filter=blob:none`` or ``tree:0``, common
for a repository vLLM's size) or a shallow one: the tool's scratch repository shares its
objects, and must fetch a blob or tree not fetched yet from the promisor remote, as the
checkout itself would (it used to stop at "git reset failed: unable to read sha1 file")."""

from __future__ import annotations

import pytest

from k3overlay import cli, errors

from .conftest import MOD_BASE, USER, commit_tag, g, model


@pytest.mark.parametrize("how", ["--filter=blob:none", "--filter=tree:0", "--depth=1"])
def test_a_partial_or_shallow_checkout_is_applied_onto(project, upstream, tmp_path, monkeypatch, capsys, how):
    monkeypatch.setattr(cli, "Project", lambda: project)
    g(upstream, "config", "uploadpack.allowFilter", "true")
    wd = tmp_path / "wd"
    g(tmp_path, "clone", "-q", how, "--branch", "v1.0.0", f"file://{upstream}", str(wd))
    config = (wd / ".git" / "config").read_text()
    code = cli.main(["--vllm-repo", f"file://{upstream}", "--vllm-ref", "v1.1.0", "--workdir", str(wd),
                     "--json", str(tmp_path / "r.json")])
    err = capsys.readouterr().err
    assert code == errors.OK, err
    assert (wd / "pkg" / "new.py").is_file() and g(wd, "status", "--porcelain") == ""
    assert (wd / ".git" / "config").read_text().count("promisor") == config.count("promisor")


def test_a_sha256_source_or_checkout_is_one_line_and_no_half_checkout(project, tmp_path, monkeypatch, capsys):
    # the scratch repository was SHA-1: "git checkout failed: fatal: invalid reference"; and the
    # manifest's blob ids are SHA-1's, so each overlay file would read as drift
    monkeypatch.setattr(cli, "Project", lambda: project)
    repo = tmp_path / "up256"
    repo.mkdir()
    g(repo, "init", "-q", "--object-format=sha256", "-b", "main")
    commit_tag(repo, {"pkg/__init__.py": "", "pkg/mod.py": MOD_BASE, "pkg/user.py": USER,
                      "pkg/model.txt": model({})}, "v1.0.0")
    wd = tmp_path / "wd"
    for args in (["--vllm-ref", "v1.0.0"], ["--vllm-ref", "v1.0.0", "--check"], ["--rebase-to", "v1.0.0"]):
        assert cli.main(["--vllm-repo", str(repo), "--workdir", str(wd), *args]) == errors.USAGE
        err = capsys.readouterr().err.strip().splitlines()
        assert "is a SHA256 repository" in err[-1] and err[-1].startswith("apply.py: error: ")
        assert not wd.exists() and not list(tmp_path.glob(".wd.k3-clone-*"))
    g(tmp_path, "clone", "-q", str(repo), str(wd))  # a checkout of it
    assert cli.main(["--vllm-repo", str(repo), "--workdir", str(wd), "--vllm-ref", "v1.0.0"]) == errors.USAGE
    assert "--workdir" in capsys.readouterr().err and g(wd, "status", "--porcelain") == ""
