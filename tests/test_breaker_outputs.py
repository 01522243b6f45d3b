"""Found after issue 8: a file or folder the user names for the tool to write (``--json``,
``--junit``, ``--markdown``, the wheel folder and its build log, the rebase job's
``--wheels`` and ``--gpu-export``, the work directory) could be one of this repository's
own data (VERSION, overlay.json, patches/ and its series, overlay/) or lie inside a
``.git`` folder, and was then written over. Each is refused in one line, exit 2, before
anything is written: the data and the checkout stay byte for byte as they were."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from k3overlay import cli, errors

from .conftest import g, snapshot
from .test_rebase import load_ci_rebase

# (path under the project's root, what the message calls it, over it or inside it)
DATA = [("VERSION", "VERSION", "is"), ("overlay.json", "overlay.json", "is"),
        ("patches/series", "patches/", "inside"),
        ("patches/0001-model-line-4.patch", "patches/", "inside"),
        ("overlay/pkg/mod.py", "overlay/", "inside"), ("overlay/pkg/report.json", "overlay/", "inside")]
GIT = [".git/config", ".git/HEAD", ".git/refs/heads/report.json", ".git"]


def files_of(root: Path) -> dict[str, bytes]:
    """Every file under ``root`` (``.git`` too) with its bytes."""
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


@pytest.fixture
def checked_in(project, monkeypatch):
    """The synthetic project as a git checkout, as apply.py's own; its files, before."""
    g(project.root, "init", "-q", "-b", "main")
    g(project.root, "add", "-A")
    g(project.root, "commit", "-qm", "the overlay project")
    monkeypatch.setattr(cli, "Project", lambda: project)
    return project, files_of(project.root), snapshot(project.root)


def message(option: str, path: Path, what: str, how: str) -> str:
    if how == "is":
        return f"{option} {path} is this repository's {what}; refusing to write over it"
    return f"{option} {path} is inside this repository's {what}; refusing to write there"


def git_message(option: str, path: Path, root: Path) -> str:
    return f"{option} {path} is inside a .git folder ({root.resolve() / '.git'}); refusing to write there"


@pytest.mark.parametrize("rel, what, how", DATA)
def test_json_report_onto_the_projects_data_is_refused(checked_in, upstream, capsys, rel, what, how):
    project, before, state = checked_in
    for path in (project.root / rel, Path(os.path.relpath(project.root / rel))):
        code = cli.main(["-q", "--check", "--vllm-repo", str(upstream), "--json", str(path)])
        assert code == errors.USAGE
        assert capsys.readouterr().err.splitlines() == [
            "apply.py: error: " + message("--json", path, what, how)]
    assert files_of(project.root) == before and snapshot(project.root) == state


@pytest.mark.parametrize("rel", GIT)
def test_json_report_inside_dot_git_is_refused(checked_in, upstream, capsys, rel):
    project, before, state = checked_in
    path = project.root / rel
    assert cli.main(["-q", "--check", "--vllm-repo", str(upstream), "--json", str(path)]) == errors.USAGE
    assert capsys.readouterr().err.splitlines() == [
        "apply.py: error: " + git_message("--json", path, project.root)]
    assert files_of(project.root) == before and snapshot(project.root) == state


def test_a_link_leading_to_the_data_is_refused_too(checked_in, upstream, capsys, tmp_path):
    project, before, state = checked_in
    link = tmp_path / "report.json"
    link.symlink_to(project.manifest_path)
    mode = ["--export"], ["--check", "--vllm-repo", str(upstream)]  # --export refuses --json too
    for args in mode:
        assert cli.main(["-q", *args, "--json", str(link)]) == errors.USAGE
        assert capsys.readouterr().err.splitlines() == [
            "apply.py: error: " + message("--json", link, "overlay.json", "is")], args
    assert files_of(project.root) == before and snapshot(project.root) == state


@pytest.mark.parametrize("option, rel, what, how", [
    ("--wheel-dir", "patches", "patches/", "is"), ("--wheel-dir", "overlay/pkg", "overlay/", "inside"),
    ("--workdir", "patches/vllm", "patches/", "inside"), ("--workdir", "overlay", "overlay/", "is")])
def test_wheel_folder_or_workdir_in_the_data_is_refused(checked_in, upstream, capsys, option, rel,
                                                         what, how):
    project, before, state = checked_in
    path = project.root / rel
    extra = ["--build-wheel"] if option == "--wheel-dir" else []
    assert cli.main(["-q", "--vllm-repo", str(upstream), *extra, option, str(path)]) == errors.USAGE
    assert capsys.readouterr().err.splitlines() == ["apply.py: error: " + message(option, path, what, how)]
    assert files_of(project.root) == before and snapshot(project.root) == state


@pytest.mark.parametrize("option", ["--wheel-dir", "--workdir"])
def test_wheel_folder_or_workdir_inside_dot_git_is_refused(checked_in, upstream, capsys, option):
    project, before, state = checked_in
    path = project.root / ".git" / "vllm"
    extra = ["--build-wheel"] if option == "--wheel-dir" else []
    assert cli.main(["-q", "--vllm-repo", str(upstream), *extra, option, str(path)]) == errors.USAGE
    assert capsys.readouterr().err.splitlines() == [
        "apply.py: error: " + git_message(option, path, project.root)]
    assert files_of(project.root) == before and not path.exists()


@pytest.mark.parametrize("option, rel, expected", [
    ("--json", "overlay.json", ("overlay.json", "is")),
    ("--junit", "patches/series", ("patches/", "inside")),
    ("--markdown", "VERSION", ("VERSION", "is")),
    ("--wheels", "overlay", ("overlay/", "is")),
    ("--gpu-export", "patches/out", ("patches/", "inside")),
    ("--markdown", ".git/description", None),
    ("--gpu-export", ".git/bundle", None)])
def test_rebase_job_outputs_onto_the_data_are_refused(checked_in, upstream, capsys, monkeypatch,
                                                      option, rel, expected):
    project, before, state = checked_in
    job = load_ci_rebase()
    monkeypatch.setattr(job, "Project", lambda: project)
    path = project.root / rel
    code = job.main(["-q", "--no-tests", "--onto", "v1.1.0", "--vllm-repo", str(upstream), option, str(path)])
    line = git_message(option, path, project.root) if expected is None else message(option, path, *expected)
    assert code == errors.USAGE and capsys.readouterr().err.splitlines() == ["rebase.py: error: " + line]
    assert files_of(project.root) == before and snapshot(project.root) == state


# Found by the second adversarial pass: two options naming one file. The rebase job wrote
# --junit over the --json report it had just written (CI read an XML file as JSON), and
# apply.py wrote its --json report over the --release-wheel it had built from (the air-gapped
# user's only copy of vLLM's 314 MB release wheel). Refused in one line before any work.

@pytest.mark.parametrize("first, second, through_a_link", [
    ("--json", "--junit", False), ("--json", "--markdown", True), ("--junit", "--markdown", False)])
def test_rebase_job_reports_naming_one_file_are_refused(checked_in, upstream, capsys, monkeypatch,
                                                        tmp_path, first, second, through_a_link):
    job = load_ci_rebase()
    monkeypatch.setattr(job, "Project", lambda: checked_in[0])
    report = tmp_path / "report.json"
    report.write_text("the previous report\n")
    other = report
    if through_a_link:
        other = tmp_path / "link.json"
        other.symlink_to(report)
    code = job.main(["-q", "--no-tests", "--onto", "v1.1.0", "--vllm-repo", str(upstream),
                     first, str(report), second, str(other)])
    assert code == errors.USAGE and capsys.readouterr().err.splitlines() == [
        f"rebase.py: error: {second} {other} is the file {first} {report} names; give each its own"]
    assert report.read_text() == "the previous report\n"


def test_rebase_job_may_send_two_reports_to_stdout(checked_in, upstream, capfd, monkeypatch):
    job = load_ci_rebase()
    monkeypatch.setattr(job, "Project", lambda: checked_in[0])
    code = job.main(["-q", "--no-tests", "--onto", "v1.1.0", "--vllm-repo", str(upstream),
                     "--json", "/dev/stdout", "--markdown", "/dev/stdout"])
    out = capfd.readouterr().out
    assert code == errors.OK and '"ref": "v1.1.0"' in out and "## vllm-k3-overlay rebase report" in out


def test_json_over_the_release_wheel_is_refused(checked_in, upstream, capsys, tmp_path):
    wheel = tmp_path / "vllm-1.0.0-py3-none-any.whl"
    wheel.write_bytes(b"PK\x05\x06" + bytes(18))  # what it holds is not read: refused before
    for json_to in (wheel, tmp_path / "sub" / ".." / wheel.name):
        code = cli.main(["-q", "--vllm-repo", str(upstream), "--workdir", str(tmp_path / "wd"),
                         "--build-wheel", "--release-wheel", str(wheel), "--json", str(json_to)])
        assert code == errors.USAGE and capsys.readouterr().err.splitlines() == [
            f"apply.py: error: --json {json_to} is the file --release-wheel {wheel} names; give "
            f"each its own"]
    assert wheel.read_bytes() == b"PK\x05\x06" + bytes(18) and not (tmp_path / "wd").exists()


# Found by the second adversarial pass: only a folder named ``.git`` counted as a git folder,
# so a report or the wheel folder inside a bare repository (the release mirror in the cache)
# or a ``--separate-git-dir`` was written there, over its config or HEAD.

@pytest.mark.parametrize("kind", ["bare", "separate"])
@pytest.mark.parametrize("option, rel", [("--json", "config"), ("--json", "HEAD"),
                                         ("--wheel-dir", "wheels"), ("--workdir", "vllm")])
def test_outputs_inside_a_git_folder_of_any_name_are_refused(checked_in, upstream, capsys, tmp_path,
                                                             kind, option, rel):
    if kind == "bare":
        repo = tmp_path / "mirror-v2.git"
        g(tmp_path, "clone", "-q", "--bare", str(upstream), str(repo))
    else:
        repo = tmp_path / "separate"
        g(tmp_path, "clone", "-q", "--separate-git-dir", str(repo), str(upstream), str(tmp_path / "co"))
    before = files_of(repo)
    path = repo / rel
    extra = ["--build-wheel"] if option == "--wheel-dir" else ["--check"] if option == "--json" else []
    code = cli.main(["-q", "--vllm-repo", str(upstream), *extra, option, str(path)])
    assert code == errors.USAGE and capsys.readouterr().err.splitlines() == [
        f"apply.py: error: {option} {path} is inside the git repository {repo.resolve()} (a bare or "
        f"separate git folder); refusing to write there"]
    assert files_of(repo) == before
