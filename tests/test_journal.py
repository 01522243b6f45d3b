"""A journal the next run cannot make sense of (issue 18, G, round 3): entries of another
version of the tool (facts missing or of other types), or a fact that would have recovery
remove something not the tool's own. The run still goes on, alone, and nothing but the
tool's own scratch folders is ever removed."""

from __future__ import annotations

import json

import pytest

from k3overlay import cli, errors, journal
from k3overlay.lock import workdir_lock_path


def test_a_journal_it_cannot_read_is_set_aside_never_a_traceback_or_a_licence(project, upstream, tmp_path,
                                                                               monkeypatch, capsys):
    monkeypatch.setattr(cli, "Project", lambda: project)
    wd = tmp_path / "wd"
    args = ["--vllm-repo", str(upstream), "--vllm-ref", "v1.1.0", "--workdir", str(wd)]
    assert cli.main(args) == errors.OK
    precious = tmp_path / "precious"  # the user's: no journal line may have it removed
    (precious / "k3-check-x").mkdir(parents=True)
    (precious / "k3-check-x" / "keep.txt").write_text("mine\n")
    (precious / ".notes.deadbeef.k3-tmp").write_text("mine\n")  # named like a staged file
    entries = [
        {"step": "clone", "id": "1"},                                          # no scratch
        {"step": "clone", "id": "2", "scratch": str(precious), "prefix": ""},  # any name matches ""
        {"step": "clone", "id": "3", "scratch": str(precious), "prefix": "pre"},
        {"step": "worktree", "id": "4", "parent": 5, "repo": None},
        {"step": "write", "id": "5", "root": str(wd), "folders": "pkg"},       # a string, not a list
        {"step": "write", "id": "6", "root": str(wd), "folders": ["../../" + precious.name]},
        {"step": "publish", "id": "7", "repo": str(wd)},                      # older: fewer facts
        {"step": "fetch", "id": "8", "repo": str(wd), "since": "yesterday"},
        {"step": "check", "id": "9", "scratch": ["a"]},
        {"step": "clone", "id": 10, "scratch": str(tmp_path / ".wd.k3-clone-x")},
        # issue 25, 18: a write's staging folder is its own token's, under the project's .k3-tmp
        {"step": "write", "id": "11", "root": str(tmp_path), "folders": [], "token": "deadbeef",
         "staging": precious.name},
        {"step": "write", "id": "12", "root": str(tmp_path), "folders": [precious.name], "token": ".*"},
        [1, 2], "text", None,
    ]
    journal = workdir_lock_path(wd).with_suffix(".journal")
    journal.write_text("".join(json.dumps(e) + "\n" for e in entries))
    capsys.readouterr()
    assert cli.main(args) == errors.OK
    err = capsys.readouterr().err
    assert "Traceback" not in err and "could not be read" in err and err.count("note:") == 1
    assert (precious / "k3-check-x" / "keep.txt").read_text() == "mine\n" and precious.is_dir()
    assert (precious / ".notes.deadbeef.k3-tmp").read_text() == "mine\n"
    assert not journal.exists()


def test_a_lay_entry_naming_the_users_files_by_their_digest_removes_nothing(project, upstream, tmp_path,
                                                                             monkeypatch, capsys):
    """The review of round 6: a forged or damaged lay entry naming an untracked file of the
    user's, and a tracked one they edited, each with its exact digest, had them removed or put
    back. Only the project's overlay files are undone, an added one only holding its content."""
    import hashlib

    from k3overlay import git

    monkeypatch.setattr(cli, "Project", lambda: project)
    wd = tmp_path / "wd"
    args = ["--vllm-repo", str(upstream), "--vllm-ref", "v1.1.0", "--workdir", str(wd)]
    assert cli.main(args) == errors.OK
    (wd / "NOTES.txt").write_text("mine\n")
    (wd / "pkg/model.txt").write_text("my edit\n")
    files = [[p, hashlib.sha256((wd / p).read_bytes()).hexdigest(), False]
             for p in ("NOTES.txt", "pkg/model.txt")]
    entry = {"step": "lay", "id": "1", "workdir": str(wd), "repo": str(wd),
             "head": git.resolve(git.open_repo(wd), "HEAD"), "files": files}
    workdir_lock_path(wd).with_suffix(".journal").write_text(json.dumps(entry) + "\n")
    capsys.readouterr()
    assert cli.main(args) == errors.USAGE  # the user's edit: uncommitted changes, as always
    err = capsys.readouterr().err
    assert "left as it is (not this project's overlay files)" in err, err
    assert (wd / "NOTES.txt").read_text() == "mine\n" and (wd / "pkg/model.txt").read_text() == "my edit\n"


def test_a_journal_larger_than_any_run_writes_is_not_read(tmp_path):
    """Round 8b: a claim naming a 1.5 GB file took 2 GB of memory, the journal read whole."""
    path = tmp_path / "big.journal"
    with open(path, "wb") as f:
        f.truncate(journal.MAX_BYTES + 1)  # (sparse: nothing written)
    with pytest.raises(errors.UsageError, match="more than any run writes"):
        journal.Journal(path, str(tmp_path)).unfinished()


def test_a_journal_with_a_second_name_is_never_appended_to(tmp_path):
    """Round 9: the project's journal sits in its git folder, and a ``cp -al`` copy of the
    project shares it by a hard link: a step the copy's run recorded would be the original's."""
    original = tmp_path / "original.journal"
    original.write_text("")
    path = tmp_path / "copy.journal"
    path.hardlink_to(original)
    with pytest.raises(errors.UsageError, match="hard link"):
        journal.Journal(path, str(tmp_path)).begin("write", root=str(tmp_path), folders=[])
    assert original.read_text() == ""


def test_a_journal_entry_with_a_nul_is_set_aside_never_a_traceback(project, upstream, tmp_path, monkeypatch,
                                                                   capsys):
    """Round 9: a NUL in an entry's path (``\\u0000`` in its JSON), or a lone surrogate
    (``\\ud800``), raised ValueError from every call on it, on every run, ``--check`` too."""
    monkeypatch.setattr(cli, "Project", lambda: project)
    wd = tmp_path / "wd"
    args = ["--vllm-repo", str(upstream), "--workdir", str(wd)]
    assert cli.main(args) == errors.OK
    entries = [{"step": "publish", "id": "1", "repo": f"{wd}\0x", "workdir": str(wd)},
               {"step": "worktree", "id": "2", "repo": str(wd), "parent": "/tmp/k3-worktree-x", "workdir": str(wd)},
               {"step": "write", "id": "3", "root": "/tmp/k3-worktree-x/tree\0", "folders": [], "workdir": str(wd)},
               {"step": "publish", "id": "4", "repo": "/x\ud800y", "workdir": str(wd)},  # (9c: a lone surrogate)
               {"step": "write", "id": "5", "root": str(wd), "folders": ["a" * 300], "workdir": str(wd)},
               {"step": "fetch", "id": "6", "repo": [[[["x"]]]] * 3, "workdir": str(wd)}]  # (9d: too long, nested)
    path = workdir_lock_path(wd).with_suffix(".journal")
    nested = "[" * 100_000 + "]" * 100_000 + "\n"  # (9d: past the JSON parser's depth)
    for extra in (["--check"], []):
        path.write_text(nested + "".join(json.dumps(e) + "\n" for e in entries))
        capsys.readouterr()
        assert cli.main([*args, *extra]) == errors.OK
        said = capsys.readouterr().err
        assert "Traceback" not in said and ("could not be read" in said or extra), said


@pytest.mark.parametrize("entry", [
    {"step": "squash", "id": "1", "repo": "{wd}", "branch": "main"},  # a newer version's step
    {"step": "publish", "id": "1", "repo": "{wd}"},                   # an older one's facts
    {"step": "publish", "id": "1", "repo": "{wd}/../elsewhere", "branch": "main", "sha": "0" * 40,
     "ref": "v1.1.0", "old_head": "x", "old_tip": None, "since": 0},  # another checkout's
])
def test_check_keeps_a_journal_it_could_not_act_on_for_the_run_that_can(project, upstream, tmp_path,
                                                                       monkeypatch, capsys, entry):
    """Round 9's open point: ``--check`` deleted, without a word, a journal none of whose
    steps it could read; a step of a newer version of the tool was dropped unseen by both
    ``--check`` and a normal run. ``--check`` now keeps it and says so; a normal run says
    what it left alone, as for any step it cannot read."""
    monkeypatch.setattr(cli, "Project", lambda: project)
    wd = tmp_path / "wd"
    args = ["--vllm-repo", str(upstream), "--vllm-ref", "v1.1.0", "--workdir", str(wd)]
    assert cli.main(args) == errors.OK
    path = workdir_lock_path(wd).with_suffix(".journal")
    entry = {k: v.format(wd=wd) if isinstance(v, str) else v for k, v in entry.items()}
    path.write_text(json.dumps({**entry, "workdir": str(wd)}) + "\n")
    kept = path.read_bytes()
    capsys.readouterr()
    assert cli.main([*args, "--check"]) == errors.OK
    err = capsys.readouterr().err
    assert "1 step(s) of its journal" in err and "--check keeps the journal" in err, err
    assert path.read_bytes().startswith(kept)  # (then --check's own steps, each done)
    assert cli.main(args) == errors.OK
    err = capsys.readouterr().err
    assert "1 step(s) of its journal" in err and "left alone" in err, err
    assert not path.exists()
