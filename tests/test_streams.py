"""Crashes after the work: standard streams closed or gone, a malformed ``SOURCE_DATE_EPOCH``,
a bug after publishing. The work is done or refused before it starts, the report asked for
is written, nothing ends in a traceback or a false "interrupted" (issue 25, 16, 17, 23).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from k3overlay import cli, errors
from k3overlay.wheel import LAST_ZIP_SECOND, source_date_epoch

from .test_concurrency import REBASE_RUNNER, RUNNER, as_in_a_terminal

ROOT = Path(__file__).resolve().parent.parent


def _close(fd: int):
    def setup() -> None:
        as_in_a_terminal()
        os.close(fd)
    return setup


@pytest.mark.parametrize("runner, args", [
    (RUNNER, ["--help"]), (RUNNER, ["--list-releases"]), (REBASE_RUNNER, ["--help"])])
def test_a_reader_gone_before_the_first_line_ends_quietly(project, tmp_path, runner, args):
    # `apply.py --help | true`: "interrupted; the checkout was left as it was", exit 130
    run = subprocess.Popen([sys.executable, "-c", runner, str(project.root), *args], cwd=ROOT,
                           stdout=subprocess.PIPE, stderr=subprocess.PIPE, preexec_fn=as_in_a_terminal)
    run.stdout.close()  # gone before the tool has started
    err = run.stderr.read().decode()
    assert run.wait(60) == -signal.SIGPIPE and err == ""


@pytest.mark.parametrize("runner", [RUNNER, REBASE_RUNNER])
@pytest.mark.parametrize("closed", [1, 2])
def test_a_closed_stdout_or_stderr_still_gets_the_work_and_its_report_done(project, upstream, tmp_path,
                                                                           runner, closed):
    # `apply.py >&-`: an AttributeError traceback; `2>&-`: "internal error"
    out = tmp_path / "out.json"
    args = (["--vllm-repo", str(upstream), "--workdir", str(tmp_path / "wd")] if runner == RUNNER
            else ["--onto", "v1.1.0", "--vllm-repo", str(upstream), "--no-tests"])
    run = subprocess.run([sys.executable, "-c", runner, str(project.root), *args, "--json", str(out)],
                         cwd=ROOT, capture_output=True, preexec_fn=_close(closed), timeout=120)
    left = (run.stderr if closed == 1 else run.stdout).decode()
    assert run.returncode == errors.OK, left
    assert "Traceback" not in left and "error" not in left
    report = json.loads(out.read_text())
    assert (report if runner == RUNNER else report[0])["ok"] is True


@pytest.mark.parametrize("value", ["1.7e9", "abc", "-5", "1700000000.5", " 1700000000", "1e3",
                                   str(LAST_ZIP_SECOND + 1), "9" * 5000, "١٧٠٠"])
def test_a_malformed_source_date_epoch_is_refused_before_any_work(project, upstream, tmp_path,
                                                                  monkeypatch, capsys, value):
    # a traceback after publishing, and no --json report (the wheel build ran outside the
    # internal-error handler)
    monkeypatch.setenv("SOURCE_DATE_EPOCH", value)
    monkeypatch.setattr(cli, "Project", lambda: project)
    wd, out = tmp_path / "wd", tmp_path / "out.json"
    code = cli.main(["--vllm-repo", str(upstream), "--workdir", str(wd), "--build-wheel",
                     "--release-wheel", str(project.root / "VERSION"), "--json", str(out)])
    err = capsys.readouterr().err
    assert code == errors.USAGE and err.startswith("apply.py: error: SOURCE_DATE_EPOCH=")
    assert err.count("\n") == 1 and not wd.exists()
    assert json.loads(out.read_text())["error"].startswith("SOURCE_DATE_EPOCH=")


@pytest.mark.parametrize("value, epoch", [("", None), ("0", 0), ("1700000000", 1700000000),
                                          (str(LAST_ZIP_SECOND), LAST_ZIP_SECOND)])
def test_a_sound_source_date_epoch_is_taken(monkeypatch, value, epoch):
    monkeypatch.setenv("SOURCE_DATE_EPOCH", value)
    assert source_date_epoch() == epoch


@pytest.mark.parametrize("where", ["build_for", "write_human"])
def test_a_bug_after_publishing_still_writes_the_json_report(project, upstream, tmp_path, monkeypatch,
                                                             where):
    monkeypatch.setattr(cli, "Project", lambda: project)

    def bug(*_args, **_kwargs):
        raise RuntimeError("a bug after publishing")

    monkeypatch.setattr(cli, where, bug)
    out = tmp_path / "out.json"
    with pytest.raises(RuntimeError):
        cli.main(["--vllm-repo", str(upstream), "--workdir", str(tmp_path / "wd"), "--build-wheel",
                  "--release-wheel", str(project.root / "VERSION"), "--json", str(out)])
    report = json.loads(out.read_text())
    assert report["error"] == "internal error (a bug of apply.py): RuntimeError: a bug after publishing"
    assert report["ok"] is False and report["branch"] and report["patches"]  # what was published


@pytest.mark.parametrize("where", ["write_human", "markdown"])
def test_a_bug_after_the_rebase_jobs_work_still_writes_every_report(project, upstream, tmp_path,
                                                                   monkeypatch, where):
    from .test_rebase import load_ci_rebase

    ci_rebase = load_ci_rebase()
    monkeypatch.setattr(ci_rebase, "Project", lambda: project)

    def bug(*_args, **_kwargs):
        raise RuntimeError("a bug after the work")

    monkeypatch.setattr(ci_rebase, where, bug)
    outs = [tmp_path / "out.json", tmp_path / "out.xml"]
    with pytest.raises(RuntimeError):
        ci_rebase.main(["-q", "--onto", "v1.1.0", "--vllm-repo", str(upstream), "--no-tests",
                        "--json", str(outs[0]), "--junit", str(outs[1]),
                        "--markdown", str(tmp_path / "out.md")])
    [report] = json.loads(outs[0].read_text())
    assert report["error"] == "internal error (a bug of rebase.py): RuntimeError: a bug after the work"
    assert "internal error" in outs[1].read_text()


def test_an_interrupt_during_the_wheel_build_still_writes_the_json_report(project, upstream, tmp_path,
                                                                          monkeypatch, capsys):
    # the branch was published, then Ctrl-C in the wheel build: no --json report at all
    monkeypatch.setattr(cli, "Project", lambda: project)

    def interrupted(*_args, **_kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(cli, "build_for", interrupted)
    out = tmp_path / "out.json"
    code = cli.main(["--vllm-repo", str(upstream), "--workdir", str(tmp_path / "wd"), "--build-wheel",
                     "--release-wheel", str(project.root / "VERSION"), "--json", str(out)])
    err = capsys.readouterr().err
    assert code == 130 and err.endswith("apply.py: interrupted; branch k3-overlay/9.9.9 was "
                                        "published, no wheel was written\n"), err
    report = json.loads(out.read_text())
    assert report["error"].startswith("interrupted; branch") and report["patches"]
