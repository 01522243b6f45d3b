"""The CI job's commands as a newcomer types them: --help says every option and the exit codes,
the old layout's ``python ci/rebase.py`` is refused at once with the command that works."""

from __future__ import annotations

import os
import subprocess
import sys
import time

from k3overlay.project import ROOT


def run(*args: str, cwd=ROOT) -> subprocess.CompletedProcess:
    env = {**os.environ, "COLUMNS": "300"}
    return subprocess.run([sys.executable, *args], cwd=cwd, env=env, capture_output=True, text=True)


def test_rebase_help_explains_every_option_and_the_exit_codes():
    proc = run("-m", "ci.rebase", "--help")
    assert proc.returncode == 0
    text = " ".join(proc.stdout.split())
    for option in ("--json FILE write", "--junit FILE write JUnit XML", "--markdown FILE write the maintainer's",
                   "-q, --quiet no progress messages"):
        assert option in text, option
    assert "exit codes: 0 every ref clean" in text and "3 patch conflict" in text and "7 test environment" in text


def test_table_diff_help_is_help_not_a_traceback():
    proc = run("-m", "ci.table_diff", "--help")
    assert proc.returncode == 0 and "Traceback" not in proc.stderr
    assert "pristine" in proc.stdout and "patched" in proc.stdout
    missing = run("-m", "ci.table_diff")
    assert missing.returncode == 2 and "Traceback" not in missing.stderr


def test_python_ci_rebase_py_is_refused_at_once_naming_the_module_form(tmp_path):
    start = time.monotonic()
    proc = run(str(ROOT / "ci" / "rebase.py"), "--onto", "v0.29.0", "--no-tests", cwd=ROOT)
    assert proc.returncode == 2 and time.monotonic() - start < 30
    assert proc.stderr == ("rebase.py: error: run it as a module, from the repository's root: "
                           "python -m ci.rebase --onto v0.29.0 --no-tests\n")
