"""One patch file, one commit: a file git am would split into several mails is refused before
git am, naming the file and the line; results are charged to the file git am applied."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from k3overlay import cli, errors, git, series
from k3overlay.job import Options, run_apply

from .conftest import IDENT, g, make_patch, snapshot

FROM_LINE = "From 1234567890123456789012345678901234567890 Mon Sep 17 00:00:00 2001"


def mail(upstream: Path, tmp: Path, files: dict[str, str], message: str, author: str) -> str:
    """A format-patch mail of ``files`` written on v1.0.0 by ``author``."""
    work = tmp / f"_mail_{abs(hash(message))}"
    g(upstream, "worktree", "add", "-q", "--detach", str(work), "v1.0.0")
    try:
        for rel, text in files.items():
            (work / rel).write_text(text)
        g(work, "add", "-A")
        g(work, "-c", f"user.name={author}", "-c", "user.email=m@evil.invalid", "commit", "-q",
          "--author", f"{author} <m@evil.invalid>", "-m", message)
        return g(work, "format-patch", "-1", "--zero-commit", "--no-signature", "--full-index",
                 "--stdout", "HEAD")
    finally:
        g(upstream, "worktree", "remove", "--force", str(work))


@pytest.fixture
def two_mails(project, upstream, tmp_path) -> Path:
    """The project's one patch file with a second mail appended (another author, a new file)."""
    path = project.patches_dir / "0001-model-line-4.patch"
    extra = mail(upstream, tmp_path, {"pkg/evil.py": "import os\n"},
                 "evil: add a module\n\nUpstream-Status: Pending", "Mallory")
    path.write_text(path.read_text() + extra)
    return path


def test_a_patch_file_holding_two_mails_is_refused_before_git_am(project, upstream, tmp_path,
                                                                 two_mails, monkeypatch, capsys):
    wd = tmp_path / "wd"
    g(upstream, "clone", "-q", str(upstream), str(wd))
    before = snapshot(wd)
    monkeypatch.setattr(cli, "Project", lambda: project)
    report = tmp_path / "r.json"
    code = cli.main(["-q", "--vllm-repo", str(upstream), "--workdir", str(wd), "--json", str(report)])
    err = capsys.readouterr().err
    start = next(i for i, line in enumerate(two_mails.read_text().splitlines())
                 if i and line.startswith("From "))
    assert code == errors.USAGE and len(err.splitlines()) == 1
    assert f"0001-model-line-4.patch holds 2 mails: line {start + 1} starts another" in err
    assert "holds 2 mails" in json.loads(report.read_text())["error"]
    assert snapshot(wd) == before and "evil" not in g(wd, "log", "--all", "--format=%an %s")


def test_a_from_line_in_the_message_is_refused_naming_the_line(project, upstream, tmp_path):
    path = project.patches_dir / "0001-model-line-4.patch"
    lines = path.read_text().splitlines(keepends=True)
    at = next(i for i, line in enumerate(lines) if line.startswith("Why: a test."))
    lines.insert(at + 1, FROM_LINE + "\n")
    path.write_text("".join(lines))
    with pytest.raises(errors.UsageError, match=rf"holds 2 mails: line {at + 2} starts another "
                                                rf"\('From 1234567890"):
        run_apply(project, Options(vllm_repo=str(upstream), workdir=tmp_path / "wd", check=True))


def test_a_quoted_from_line_in_the_message_applies(project, upstream, tmp_path):
    path = project.patches_dir / "0001-model-line-4.patch"
    path.write_text(path.read_text().replace("Why: a test.\n", f"Why: a test.\n>{FROM_LINE}\n"))
    report = run_apply(project, Options(vllm_repo=str(upstream), workdir=tmp_path / "wd"))
    assert report.ok and [p.status for p in report.patches] == ["applied"]
    assert f">{FROM_LINE}" in g(tmp_path / "wd", "log", "-1", "--format=%B", "HEAD~1")


def _patch(path: Path, lines: str = "[4]") -> series.Patch:
    """A series entry for ``path`` as if it had passed the series' checks (it changed since)."""
    return series.Patch(path.name, path, f"model: change lines {lines}", "Pending")


def _clone_at(upstream: Path, wd: Path, ref: str) -> git.Repo:
    g(upstream, "clone", "-q", str(upstream), str(wd))
    g(wd, "checkout", "-q", "--detach", ref)
    return git.open_repo(wd)


def test_results_are_charged_by_what_git_am_applied_never_by_position(project, upstream, tmp_path,
                                                                      two_mails):
    # the file changed after the series was read: git am would make two commits of it
    repo = _clone_at(upstream, tmp_path / "wd", "v1.1.0")
    head = g(tmp_path / "wd", "rev-parse", "HEAD")
    clean = make_patch(upstream, tmp_path, "0002-clean.patch", {9: "line 9 (ours)"})
    env = dict(os.environ, **IDENT)
    with pytest.raises(git.GitError, match="git am applied a mail with subject 'evil: add a module', "
                                           "which is no patch of the series: 0001-model-line-4.patch "
                                           "holds 2 mails: line 26 starts another"):
        series.apply(repo, [_patch(two_mails), _patch(clean, "[9]")], env=env, ref_sha=head.strip())
    assert g(tmp_path / "wd", "rev-parse", "HEAD") == head  # nothing of it is left committed
    assert not (tmp_path / "wd" / "pkg" / "evil.py").exists()
    assert not (tmp_path / "wd" / ".git" / "rebase-apply").exists()


def test_an_error_inside_git_am_names_the_patch_and_the_reason(project, upstream, tmp_path):
    path = project.patches_dir / "0001-model-line-4.patch"
    path.write_text(path.read_text().replace("Why: a test.\n", f"Why: a test.\n{FROM_LINE}\n"))
    line = path.read_text().splitlines().index(FROM_LINE) + 1
    repo = _clone_at(upstream, tmp_path / "wd", "v1.0.0")
    head = g(tmp_path / "wd", "rev-parse", "HEAD")
    with pytest.raises(git.GitError) as raised:
        series.apply(repo, [_patch(path)], env=dict(os.environ, **IDENT), ref_sha=head.strip())
    said = str(raised.value)
    assert "0001-model-line-4.patch" in said and f"line {line} starts another" in said
    assert g(tmp_path / "wd", "rev-parse", "HEAD") == head
    assert not (tmp_path / "wd" / ".git" / "rebase-apply").exists()


@pytest.mark.parametrize("subject, reason", [
    (b"Subject: [PATCH] caf\xe9 latin1, no charset", "subject is not UTF-8 ('caf\ufffd latin1"),
    (b"Subject: [PATCH] \xff\xfe", "subject is not UTF-8"),
    (b"Subject: [PATCH] ", "has an empty subject: git am would take its first message line"),
    (b"Subject: [PATCH]", "has an empty subject"),
])
def test_a_subject_git_am_reads_otherwise_is_refused_naming_the_patch(project, upstream, tmp_path,
                                                                      monkeypatch, capsys, subject, reason):
    # git am printed and committed another subject than the one read ("Applying: caf\udce9",
    # or the message's first line): the run was undone as "a mail … which is no patch of the
    # series: one patch file must be one commit", naming neither the patch nor the cause
    patch = project.patches_dir / "0001-model-line-4.patch"
    lines = patch.read_bytes().split(b"\n")
    lines[next(i for i, line in enumerate(lines) if line.startswith(b"Subject: "))] = subject
    patch.write_bytes(b"\n".join(lines))
    monkeypatch.setattr(cli, "Project", lambda: project)
    code = cli.main(["--vllm-repo", str(upstream), "--vllm-ref", "v1.1.0", "--workdir", str(tmp_path / "wd")])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == errors.USAGE and err[-1].startswith("apply.py: error: 0001-model-line-4.patch")
    assert reason in err[-1] and not (tmp_path / "wd").exists()


def test_a_subject_in_a_declared_charset_applies(project, upstream, tmp_path, monkeypatch, capsys):
    patch = project.patches_dir / "0001-model-line-4.patch"
    lines = patch.read_bytes().split(b"\n")
    lines[next(i for i, line in enumerate(lines) if line.startswith(b"Subject: "))] = \
        b"Subject: [PATCH] =?iso-8859-1?q?caf=E9?= model line 4"
    patch.write_bytes(b"\n".join(lines))
    monkeypatch.setattr(cli, "Project", lambda: project)
    assert cli.main(["--vllm-repo", str(upstream), "--vllm-ref", "v1.1.0",
                     "--workdir", str(tmp_path / "wd")]) == errors.OK
    assert g(tmp_path / "wd", "log", "-1", "--format=%s", "HEAD~1").strip() == "café model line 4"
