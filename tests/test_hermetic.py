"""The suite's own footing: no test depends on the git or pip config of whoever runs it."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys

from k3overlay.project import ROOT

from .conftest import TEST_IDENTITY


def test_git_in_a_test_sees_no_global_or_system_config_and_the_suites_own_identity(tmp_path):
    listed = subprocess.run(["git", "config", "--global", "--list"], capture_output=True, text=True)
    assert listed.stdout == ""  # an empty global config (exit 1: nothing in it)
    assert os.environ["GIT_CONFIG_NOSYSTEM"] == "1"
    ident = subprocess.run(["git", "var", "GIT_COMMITTER_IDENT"], capture_output=True, text=True,
                           check=True, cwd=tmp_path).stdout
    assert ident.startswith(f"{TEST_IDENTITY['GIT_COMMITTER_NAME']} "
                            f"<{TEST_IDENTITY['GIT_COMMITTER_EMAIL']}>")
    leaked = {k for k in os.environ if k.startswith("GIT_")} - set(TEST_IDENTITY) - {
        "GIT_CONFIG_GLOBAL", "GIT_CONFIG_NOSYSTEM"}
    assert not leaked


def test_pip_in_a_synthetic_test_reads_no_config():
    listed = subprocess.run([sys.executable, "-m", "pip", "config", "list"], capture_output=True,
                            text=True, check=True)
    assert listed.stdout.splitlines() == [f":env:.config-file='{os.devnull}'"]  # and nothing else
    assert not [k for k in os.environ if k.startswith("PIP_") and k != "PIP_CONFIG_FILE"]


def test_a_plain_git_am_in_a_test_commits_without_any_user_config(tmp_path):
    """The kind of step that failed on a fresh machine ("Committer identity unknown")."""
    repo = tmp_path / "r"
    subprocess.run(["git", "init", "-q", str(repo)], check=True)
    (repo / "f").write_text("1\n")
    subprocess.run(["git", "add", "f"], cwd=repo, check=True)
    subprocess.run(["git", "commit", "-qm", "one"], cwd=repo, check=True)
    (repo / "f").write_text("2\n")
    patch = subprocess.run(["git", "diff"], cwd=repo, check=True, capture_output=True, text=True)
    subprocess.run(["git", "checkout", "-q", "--", "f"], cwd=repo, check=True)
    mail = f"From: a <a@a.invalid>\nSubject: two\n\n---\n{patch.stdout}"
    am = subprocess.run(["git", "am"], cwd=repo, input=mail, capture_output=True, text=True)
    assert am.returncode == 0, am.stderr
    assert (repo / "f").read_text() == "2\n"


def test_ci_run_gives_the_suite_no_git_identity_and_keeps_home(tmp_path):
    """.ci/run as CI runs it on a developer's machine (an identity in the global config, GIT_*
    variables set): ci/test.sh must see none of it, and the same HOME (the download cache)."""
    (tmp_path / ".ci").mkdir()
    (tmp_path / "ci").mkdir()
    shutil.copy2(ROOT / ".ci" / "run", tmp_path / ".ci" / "run")
    stub = tmp_path / "ci" / "test.sh"
    stub.write_text("#!/usr/bin/env bash\n"
                    "echo \"args=$*\"\n"
                    "echo \"home=$HOME\"\n"
                    "echo \"global=$(git config --global --list | tr '\\n' ' ')\"\n"
                    "echo \"system=${GIT_CONFIG_NOSYSTEM:-}\"\n"
                    "echo \"gitvars=$(compgen -e | grep '^GIT_' | grep -v '^GIT_CONFIG_' | tr '\\n' ' ')\"\n"
                    "git var GIT_COMMITTER_IDENT >/dev/null 2>&1 && echo ident=yes || echo ident=no\n")
    stub.chmod(0o755)
    developer = tmp_path / "developer.gitconfig"
    developer.write_text("[user]\n\tname = Dev Eloper\n\temail = dev@example.invalid\n")
    env = {k: v for k, v in os.environ.items() if not k.startswith("GIT_")}
    env.update(GIT_CONFIG_GLOBAL=str(developer), GIT_AUTHOR_NAME="Dev Eloper",
               GIT_COMMITTER_NAME="Dev Eloper", GIT_COMMITTER_EMAIL="dev@example.invalid",
               HOME=str(tmp_path / "home"))
    proc = subprocess.run([str(tmp_path / ".ci" / "run"), "-k", "x"], env=env, cwd=tmp_path,
                          capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    seen = dict(line.split("=", 1) for line in proc.stdout.splitlines())
    assert seen["args"].split()[-2:] == ["-k", "x"]
    assert seen["home"] == str(tmp_path / "home")
    assert seen["global"] == "" and seen["system"] == "1"
    assert seen["gitvars"].strip() == "" and seen["ident"] == "no"
