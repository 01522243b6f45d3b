"""A checkout that is a partial clone (``git clone --filter=blob:none`` or ``tree:0``, common
for a repository vLLM's size) or a shallow one: the tool's scratch repository shares its
objects, and must fetch a blob or tree not fetched yet from the promisor remote, as the
checkout itself would (it used to stop at "git reset failed: unable to read sha1 file")."""

from __future__ import annotations

import pytest

from k3overlay import cli, errors

from .conftest import g


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
