"""The command line as a user meets it: help, option errors, messages, where things go."""

from __future__ import annotations

import io
import json
import subprocess
import sys

import pytest
from rich.console import Console

from k3overlay import cli, errors, git, progress
from k3overlay.project import ROOT, cache_dir

from .conftest import g


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
                 "--list-releases list the vLLM releases --vllm-ref knows, with upstream's commit id "
                 "of each and the release mirror's sha (offline)",
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
                 "internal wheels (README: Internal vLLM wheels):",
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
    proc = subprocess.run([sys.executable, str(ROOT / "ci" / "rebase.py"), "--gpu", "--gpu-results", "x",
                           "--onto", "v0.28.0"], capture_output=True, text=True, timeout=120)
    assert proc.returncode == errors.USAGE
    assert proc.stderr.splitlines() == [
        "rebase.py: error: argument --gpu-results: not allowed with argument --gpu (see --help)"]
