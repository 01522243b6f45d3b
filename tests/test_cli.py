"""The command line as a user meets it: help, option errors, messages, where things go."""

from __future__ import annotations

import io
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from rich.console import Console

from k3overlay import cli, errors, git, progress
from k3overlay.project import ROOT, cache_dir

from .conftest import g, snapshot
from .test_rebase import load_ci_rebase

def test_help_names_every_mode_and_the_exit_codes(project, monkeypatch, capsys):
    monkeypatch.setattr(cli, "Project", lambda: project)
    monkeypatch.setenv("COLUMNS", "200")
    with pytest.raises(SystemExit) as stop:
        cli.main(["--help"])
    assert stop.value.code == 0
    text = capsys.readouterr().out
    lines = [" ".join(line.split()) for line in text.splitlines()]
    assert lines[0].startswith("usage: apply.py ")
    assert "Apply the Kimi-K3 patch series and overlay onto a vLLM checkout." in lines
    assert ("--rebase-to REF maintainers: rebuild the work branch on REF in the checkout, dropping "
            "landed patches, 3-way merging drifted overlay files, stopping at conflicts") in lines
    assert "--export maintainers: regenerate patches/ and overlay.json from the work branch" in lines
    assert ("--check do everything in a temporary worktree; leave the checkout as it was") in lines
    assert "--workdir DIR patched checkout (default: work/vllm)" in lines
    assert "--branch NAME work branch (default: k3-overlay/9.9.9)" in lines
    epilog = " ".join(lines).split("exit codes:")[-1]
    for code in ("0 ok", "2 bad input or unsafe checkout", "3 patch conflict", "4 overlay drift",
                 "5 verification failed", "6 vLLM source unreachable"):  # README's table
        assert code in epilog


def test_export_takes_only_workdir(project, monkeypatch, capsys):
    monkeypatch.setattr(cli, "Project", lambda: project)
    assert cli.main(["--export", "--vllm-ref", "v1.0.0"]) == errors.USAGE
    assert capsys.readouterr().err == ("apply.py: error: --export takes only --workdir (it reads the "
                                       "checked-out work branch)\n")


def test_reports_are_wide_when_piped(monkeypatch):
    monkeypatch.setattr("sys.stdout.isatty", lambda: False)
    console = cli.report_console()  # one line per patch or file in a CI log, never wrapped
    assert console.width == cli.PIPE_WIDTH and console.soft_wrap


def test_cache_lives_under_xdg_cache_home_or_home(monkeypatch, tmp_path):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert cache_dir() == tmp_path / "xdg" / "vllm-k3-overlay"
    monkeypatch.delenv("XDG_CACHE_HOME")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert cache_dir() == tmp_path / "home" / ".cache" / "vllm-k3-overlay"


@pytest.mark.parametrize("stderr, line", [
    ("hint: try this\nerror: the reason\nfatal: later", "error: the reason"),
    ("\n  stderr: 'fatal: no such ref\nhint: fetch it first'", "fatal: no such ref"),  # GitPython's wrap
    ("warning: first\nplain second", "warning: first"),
    ("'origin' does not appear to be a git repository", "'origin' does not appear to be a git repository"),
    ("hint: only hints", "no message"),
    ("", "no message"),
])
def test_one_line_of_gits_complaint(stderr, line):
    assert git.first_line(stderr) == line


def test_every_option_is_explained(project, monkeypatch, capsys):
    monkeypatch.setattr(cli, "Project", lambda: project)
    monkeypatch.setenv("COLUMNS", "300")
    with pytest.raises(SystemExit):
        cli.main(["--help"])
    text = " ".join(capsys.readouterr().out.split())
    for line in ("--vllm-ref REF vLLM ref to patch: a release tag, upstream's commit id of a release "
                 "(full or abbreviated; see --list-releases), or a tag, branch or sha of --vllm-repo "
                 "(default: the pinned base in overlay.json)",
                 "--list-releases list the vLLM releases whose upstream commit id this tool records "
                 "(releases.json) and those already in the release mirror, with the mirror's sha "
                 "(offline); any other vX.Y.Z with an sdist on the package index works as --vllm-ref too",
                 "--vllm-repo PATH_OR_URL vLLM git repository (default: $VLLM_REPO, else a local "
                 "mirror of release sdists under ~/.cache/vllm-k3-overlay)",
                 "--json FILE also write the report as JSON",
                 "--allow-drift lay overlay files even where upstream changed the file since the base",
                 "-q, --quiet no progress messages",
                 "--workdir DIR patched checkout (default: work/vllm)",
                 "--branch NAME work branch (default: k3-overlay/9.9.9)",
                 "--check do everything in a temporary worktree; leave the checkout as it was",
                 "--rebase-to REF maintainers: rebuild the work branch on REF in the checkout, dropping "
                 "landed patches, 3-way merging drifted overlay files, stopping at conflicts",
                 "--export maintainers: regenerate patches/ and overlay.json from the work branch",
                 "internal wheels (docs/apply.md: Internal vLLM wheels):",
                 "--build-wheel after applying, build vllm-X.Y.Z+k3ov.<VERSION> from the work branch, "
                 "reusing the release's compiled code; it is checked before it is kept",
                 "--wheel-dir DIR where wheels go (default: work/wheels)",
                 "--release-wheel PATH the vLLM release wheel to reuse, for air-gapped use (default: "
                 "the package index's, cached and checked against its sha256)",
                 "--wheel-build {repack,vllm} repack (default): the release wheel with our Python files "
                 "put in; vllm: vLLM's own precompiled build (needs the CUDA torch the tree pins)"):
        assert line in text, line


@pytest.mark.parametrize("args, message", [
    (["--wheel-dir", "w"], "--wheel-dir, --release-wheel and --wheel-build go with --build-wheel"),
    (["--wheel-build", "repack"], "--wheel-dir, --release-wheel and --wheel-build go with --build-wheel"),
    *[(["--build-wheel", mode], "--build-wheel builds from the work branch apply.py publishes; it does "
                                "not go with --check, --rebase-to or --export")
      for mode in ("--check", "--export")],
    (["--build-wheel", "--release-wheel", "/nonexistent/vllm.whl"],
     "--release-wheel /nonexistent/vllm.whl: no such file"),
])
def test_wheel_options_alone_are_bad_usage(project, monkeypatch, capsys, args, message):
    monkeypatch.setattr(cli, "Project", lambda: project)
    assert cli.main(args) == errors.USAGE
    assert capsys.readouterr().err == f"apply.py: error: {message}\n"


@pytest.mark.parametrize("extra, given", [(["--vllm-ref", "v1.2.0"], "--vllm-ref"),
                                           (["--allow-drift"], "--allow-drift")])
def test_rebase_to_refuses_what_it_would_drop(project, upstream, monkeypatch, capsys, tmp_path,
                                              extra, given):
    # --vllm-ref X --rebase-to Y used to rebuild on Y and drop X without a word.
    monkeypatch.setattr(cli, "Project", lambda: project)
    wd = tmp_path / "wd"
    code = cli.main(["-q", "--vllm-repo", str(upstream), "--workdir", str(wd),
                     "--rebase-to", "v1.1.0", *extra])
    assert code == errors.USAGE
    assert capsys.readouterr().err == (
        f"apply.py: error: --rebase-to REF takes no {given}: REF is the ref the work branch is "
        f"rebuilt on, and drifted files are 3-way merged\n")
    assert not wd.exists()  # refused before anything was cloned


def test_json_that_cannot_be_written_is_named(project, monkeypatch, capsys, tmp_path):
    monkeypatch.setattr(cli, "Project", lambda: project)
    assert cli.main(["--json", str(tmp_path)]) == errors.USAGE
    assert capsys.readouterr().err.startswith(f"apply.py: error: --json {tmp_path}: cannot write there (")


def test_interrupt_says_the_checkout_was_left_alone(project, monkeypatch, capsys):
    def interrupted(*args):
        raise KeyboardInterrupt

    monkeypatch.setattr(cli, "Project", lambda: project)
    monkeypatch.setattr(cli, "run_apply", interrupted)
    assert cli.main(["-q"]) == 130
    assert capsys.readouterr().err == ("apply.py: interrupted; the checkout's branches, HEAD and "
                                       "files were left as they were\n")


def test_cli_modes_check_allow_drift_and_rebase_to(project, upstream, monkeypatch, tmp_path):
    monkeypatch.setattr(cli, "Project", lambda: project)
    wd = tmp_path / "wd"
    common = ["-q", "--vllm-repo", str(upstream), "--workdir", str(wd)]
    nested = tmp_path / "reports" / "today" / "check.json"  # folders that do not exist yet
    assert cli.main([*common, "--check", "--json", str(nested)]) == errors.OK
    assert not wd.exists()  # --check made no checkout
    assert json.loads(nested.read_text())["ref"] == "v1.0.0"
    assert [p.name for p in nested.parent.iterdir()] == ["check.json"]  # no probe left behind
    assert cli.main([*common, "--vllm-ref", "v1.2.0", "--allow-drift"]) == errors.OK
    assert "def ours" in (wd / "pkg/mod.py").read_text()
    out = tmp_path / "r.json"
    assert cli.main([*common, "--rebase-to", "v1.1.0", "--json", str(out)]) == errors.OK
    data = json.loads(out.read_text())
    assert data["ref"] == "v1.1.0" and data["patches"] == [
        {"name": "0001-model-line-4.patch", "status": "applied-3way"}]
    assert g(wd, "rev-parse", "HEAD~2") == g(upstream, "rev-parse", "v1.1.0")
    assert cli.main([*common, "--rebase-to", "nope", "--json", str(out)]) == errors.USAGE
    assert json.loads(out.read_text())["ref"] == "nope"


@pytest.mark.parametrize("terminal, quiet, shown", [(True, False, True), (True, True, False),
                                                    (False, False, False)])
def test_a_byte_bar_is_drawn_on_a_terminal_only_and_never_with_quiet(monkeypatch, terminal, quiet,
                                                                       shown):
    out = io.StringIO()
    monkeypatch.setattr(progress, "console", Console(file=out, force_terminal=terminal, width=100))
    monkeypatch.setattr(progress, "quiet", quiet)
    with progress.ByteBar(4096, "packing x.whl") as bar:
        bar.update(4096)
    assert ("packing x.whl" in out.getvalue()) == shown


@pytest.mark.parametrize("args, message", [
    (["--check", "--export"], "argument --export: not allowed with argument --check"),
    (["--no-such-option"], "unrecognized arguments: --no-such-option"),
    (["--workdir"], "argument --workdir: expected one argument"),
])
def test_usage_errors_are_one_line(project, monkeypatch, capsys, args, message):
    monkeypatch.setattr(cli, "Project", lambda: project)
    with pytest.raises(SystemExit) as stop:
        cli.main(args)
    assert stop.value.code == errors.USAGE
    assert capsys.readouterr().err == f"apply.py: error: {message} (see --help)\n"


def test_rebase_job_usage_errors_are_one_line():
    # The rebase job's own options go through the same parser: no usage block either.
    proc = subprocess.run([sys.executable, "-m", "ci.rebase", "--gpu", "--gpu-results", "x",
                           "--onto", "v0.28.0"], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode == errors.USAGE
    assert proc.stderr.splitlines() == [
        "rebase.py: error: argument --gpu-results: not allowed with argument --gpu (see --help)"]


# -- Found by the adversarial pass: ``--workdir`` naming this repository's own checkout (or a
# folder holding it) published vLLM's branch there, switching patches/, overlay/ and apply.py
# out of the user's work tree.


@pytest.mark.parametrize("where", ["root", "parent", "a bind mount of the root",
                                   "a bind mount of the parent"])
def test_workdir_holding_the_project_is_refused_and_left_as_it_was(project, upstream, tmp_path,
                                                                  monkeypatch, capsys, where):
    """Round 8b: a bind mount of the project (another name for it) was taken for a checkout of
    its own; the run then waited on its own lock, for ever."""
    root = project.root
    (root / ".gitignore").write_text("work/\n")
    g(root, "init", "-q", "-b", "main")
    g(root, "add", "-A")
    g(root, "commit", "-qm", "the overlay project")
    before = snapshot(root)
    monkeypatch.setattr(cli, "Project", lambda: project)
    workdir = root if where.endswith("root") else root.parent
    if where.startswith("a bind mount"):
        alias = tmp_path / "alias"
        alias.mkdir()
        if subprocess.run(["mount", "--bind", str(workdir), str(alias)], capture_output=True).returncode:
            pytest.skip("mount --bind needs root (CI runs as root)")
        workdir = alias
    try:
        _refused_everywhere(project, upstream, workdir, root, monkeypatch, capsys)
    finally:
        if where.startswith("a bind mount"):  # (whatever the asserts said)
            subprocess.run(["umount", str(workdir)], check=True)
    assert snapshot(root) == before and (root / "overlay.json").is_file()


def _refused_everywhere(project, upstream, workdir, root, monkeypatch, capsys):
    for mode in ([], ["--check"], ["--export"], ["--rebase-to", "v1.1.0"]):
        extra = [] if mode == ["--export"] else ["--vllm-repo", str(upstream)]
        assert cli.main(["-q", "--workdir", str(workdir), *extra, *mode]) == errors.USAGE
        err = capsys.readouterr().err.strip().splitlines()
        assert err == [f"apply.py: error: --workdir {workdir} holds this repository "
                       f"({root.resolve()}); give a folder of its own (default: work/vllm)"], mode


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


def _make(path, kind):
    path.unlink()
    if kind == "missing":
        return
    if kind == "folder":
        path.mkdir()
    elif kind == "fifo":
        os.mkfifo(path)
    elif kind == "empty":
        path.write_text("\n")
    else:
        path.write_bytes(b"\xff\xfe0.1\n")


@pytest.mark.parametrize("kind", ["missing", "folder", "fifo", "empty", "not utf-8"])
@pytest.mark.parametrize("args", [["--help"], ["--check"], ["--export"]])
def test_an_unreadable_version_file_is_one_line_never_a_traceback_or_a_hang(project, monkeypatch,
                                                                          capsys, kind, args):
    _make(project.root / "VERSION", kind)
    monkeypatch.setattr(cli, "Project", lambda: project)
    assert cli.main(["-q", *args]) == errors.USAGE  # a FIFO read would block here forever
    assert capsys.readouterr().err.splitlines() == [
        f"apply.py: error: {project.root / 'VERSION'} is missing, empty, not UTF-8 text or not a "
        f"regular file; it holds the overlay version (restore it with git)"]


@pytest.mark.parametrize("kind", ["missing", "folder", "fifo"])
def test_an_unreadable_manifest_is_one_line_never_a_hang(project, upstream, tmp_path, monkeypatch,
                                                         capsys, kind):
    _make(project.manifest_path, kind)
    monkeypatch.setattr(cli, "Project", lambda: project)
    assert cli.main(["-q", "--check", "--vllm-repo", str(upstream), "--workdir", str(tmp_path / "wd")]) == 2
    assert capsys.readouterr().err.splitlines() == [
        f"apply.py: error: cannot read overlay manifest {project.manifest_path}: overlay.json is "
        f"missing or not a regular file"]


@pytest.mark.parametrize("how", ["option", "environment"])
def test_a_relative_vllm_repo_is_read_from_the_current_folder(project, upstream, tmp_path,
                                                              monkeypatch, how):
    here = tmp_path / "here"
    here.mkdir()
    g(tmp_path, "clone", "-q", "--bare", str(upstream), str(here / "up.git"))
    wd = tmp_path / "work" / "vllm"
    decoy = tmp_path / "work" / "up.git"  # where git would have looked, beside the workdir
    decoy.parent.mkdir()
    g(tmp_path, "init", "-q", "--bare", str(decoy))
    monkeypatch.chdir(here)
    monkeypatch.setattr(cli, "Project", lambda: project)
    repo = ["--vllm-repo", "up.git"] if how == "option" else []
    if how == "environment":
        monkeypatch.setenv("VLLM_REPO", "up.git")
    for ref in ("v1.0.0", "v1.1.0"):  # a fresh clone, then a fetch into the checkout
        assert cli.main(["-q", *repo, "--workdir", str(wd), "--vllm-ref", ref]) == errors.OK
        assert g(wd, "rev-parse", "HEAD~2").strip() == g(upstream, "rev-parse", ref).strip()


# -- Found after issue 8: a file or folder the user names for the tool to write (``--json``,
# ``--junit``, ``--markdown``, the wheel folder and its build log, the rebase job's
# ``--wheels`` and ``--gpu-export``, the work directory) could be one of this repository's
# own data (VERSION, overlay.json, patches/ and its series, overlay/) or lie inside a
# ``.git`` folder, and was then written over. Each is refused in one line, exit 2, before
# anything is written: the data and the checkout stay byte for byte as they were.


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
