"""CPU test tier: the Kimi-K3 low-latency GEMM tests on a patched vLLM tree.

Runs, with pytest in a subprocess (cwd and PYTHONPATH = the tree):

* vLLM's own ``tests/kernels/test_bf16_skinny_gemm.py``, which tests upstream's
  ``low_latency_gemm.py`` (the overlay leaves it as upstream has it);
* our ``tests/kernels/test_kimi_k3_low_latency_gemm.py`` (with ``_gemm_tables`` and
  ``_gemm_guards``), ``test_kimi_k3_kda_projection.py`` and their ``..._gpu.py`` files
  (from ``overlay/``; the GPU files skip without a GPU, and must say why).

The ``pytest_no_accelerator`` plugin next to this file keeps vLLM's per-test device
cleanup from erroring without a GPU, so GPU cases report as skipped with their reason.

On a tree that lacks part of our overlay (a patch or overlay file conflicted on a
rebase target) only vLLM's file runs; ours are listed as not run, with that reason.

Usage: ``python ci/cpu_tier.py TREE [--junit FILE]``; exits 1 on any failure or error.
The Python used needs torch, pytest, tblib and the tree's requirements: the rebase job
gives each target an environment of its own (``target_env.py``).
"""

from __future__ import annotations

import argparse
import functools
import os
import pathlib
import re
import subprocess
import sys
import tempfile
import xml.etree.ElementTree as ET
from pathlib import PurePosixPath

from k3overlay.manifest import load
from k3overlay.project import Project
from k3overlay.stages import Problem, TestRun

CI_DIR = pathlib.Path(__file__).resolve().parent

PLUGIN = "pytest_no_accelerator"
UPSTREAM_FILES = ("tests/kernels/test_bf16_skinny_gemm.py",)  # vLLM's own, as upstream ships it


@functools.cache
def our_files() -> tuple[str, ...]:
    """Ours: every test file the overlay lays (overlay.json), so a new one runs without being
    listed here. They test our modules, so only a tree holding them all can pass them; the
    GPU ones must skip cleanly, with reasons. Read when first asked for: the GPU stage
    imports this module where only its helpers are needed."""
    project = Project()
    return tuple(f.path for f in load(project.manifest_path, project.overlay_dir).files
                 if f.path.startswith("tests/") and PurePosixPath(f.path).name.startswith("test_"))


def __getattr__(name: str):  # OUR_FILES and TEST_FILES, as constants to the tests that read them
    if name == "OUR_FILES":
        return our_files()
    if name == "TEST_FILES":
        return UPSTREAM_FILES + our_files()
    raise AttributeError(name)
COUNT_KEYS = ("passed", "failed", "skipped", "errors", "env_errors")
_MISSING = re.compile(r"ModuleNotFoundError: No module named '([\w.]+)'")


def pytest_command(python: str, junit_xml: pathlib.Path,
                   files: tuple[str, ...] | None = None) -> list[str]:
    """The pytest invocation, relative to the tree."""
    return [
        python, "-m", "pytest", *(UPSTREAM_FILES + our_files() if files is None else files),
        "-p", PLUGIN,
        "-p", "no:cacheprovider",  # leave the tree as we found it
        "-q", "-rs",  # list skip reasons in the log
        # A file that cannot be imported must not keep the others from telling us something.
        "--continue-on-collection-errors",
        f"--junitxml={junit_xml}",
    ]  # fmt: skip


def environment_cause(text: str, tree: pathlib.Path) -> str | None:
    """Why a failure is the environment's, not the tree's: the module it could not import.

    Only ``ModuleNotFoundError`` for a top-level package the tree does not hold counts
    (``cuda``: yes; ``vllm.x`` or ``tests.y``: no, those are the tree's own).
    """
    missing = _MISSING.findall(text)
    if not missing:
        return None
    top = missing[-1].split(".")[0]
    if (tree / top).exists() or (tree / f"{top}.py").exists():
        return None
    return f"no module named {missing[-1]!r}"


def first_error_line(message: str, text: str) -> str:
    """The first line that says what went wrong: pytest's first ``E`` line (the exception,
    ``AttributeError: module 'x' has no attribute 'BACKENDS'``), else the last line of the
    traceback, else the JUnit message."""
    lines = text.splitlines()
    for line in lines:
        if line.startswith("E   ") and line[1:].strip():
            return line[1:].strip()
    last = next((line.strip() for line in reversed(lines) if line.strip()), "")
    if last:
        return last
    return message.strip().splitlines()[0] if message.strip() else "no message"


def _test_id(case: ET.Element) -> str:
    classname, name = case.get("classname", ""), case.get("name", "")
    if not classname:  # a collection error: pytest names the module as the test
        return name.replace(".", "/") + ".py" if name.startswith("tests.") else name
    return f"{classname.replace('.', '/')}.py::{name}"


def count_junit(junit_xml: pathlib.Path, tree: pathlib.Path | None = None) -> TestRun:
    """Outcome counts from a pytest JUnit XML file, each failure and error explained
    (``problems``: the test and ``first_error_line``).

    A test can count twice, as pytest's own summary does: e.g. skipped in its body
    and an error at teardown. With ``tree``, a failure or error that
    ``environment_cause`` pins on the environment counts as ``env_errors`` instead
    (its problem's kind ``environment``, the cause its line).
    """
    run = TestRun()
    for case in ET.parse(junit_xml).getroot().iter("testcase"):
        bad = [child for child in case if child.tag in ("failure", "error")]
        kinds = {child.tag for child in case}
        text = "\n".join((b.get("message") or "") + "\n" + (b.text or "") for b in bad)
        cause = environment_cause(text, tree) if bad and tree is not None else None
        if cause:
            run.env_errors += 1
            run.problems.append(Problem(_test_id(case), cause, "environment"))
        elif bad:
            run.failed += "failure" in kinds
            run.errors += "error" in kinds
            first = bad[0]
            run.problems.append(Problem(_test_id(case),
                                        first_error_line(first.get("message") or "", first.text or ""),
                                        "failed" if first.tag == "failure" else "error"))
        run.skipped += "skipped" in kinds
        run.passed += not kinds & {"failure", "error", "skipped"}
    return run


def run_cpu_tier(
    tree: pathlib.Path,
    python: str = sys.executable,
    junit_xml: pathlib.Path | None = None,
    lacks_overlay: str = "",
) -> TestRun:
    """Run the tier's test files on ``tree`` and return what they said.

    Args:
        tree: root of a patched vLLM source tree (patches applied, overlay copied).
        python: interpreter with torch, pytest and vLLM's common requirements.
        junit_xml: where pytest writes its JUnit report; a temporary file if None.
        lacks_overlay: why ``tree`` does not hold our whole overlay (``"patch X
            conflicts"``), or "": then only upstream's files run, and each of ours is
            listed in ``not_run`` with that reason (importing our tests against
            upstream's modules tells nothing about either).

    Returns:
        A ``TestRun`` (counts, problems, files not run). If pytest ran no test at all
        (usage error, crash, missing file), ``errors`` is 1, its problem the last line
        pytest printed.
    """
    tree = pathlib.Path(tree).resolve()
    files = UPSTREAM_FILES if lacks_overlay else UPSTREAM_FILES + our_files()
    with tempfile.TemporaryDirectory() as tmp:
        report = pathlib.Path(junit_xml or pathlib.Path(tmp) / "cpu_tier.xml").resolve()
        env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(tree), str(CI_DIR)]))
        returncode, last = _pytest(pytest_command(python, report, files), tree, env)
        run = count_junit(report, tree) if report.is_file() else TestRun()
        if returncode >= 2 and not any(getattr(run, k) for k in COUNT_KEYS):
            run.errors = 1  # interrupted, usage error or crash before any test ran
            run.problems.append(Problem("pytest", f"exited {returncode} before any test ran: "
                                                  f"{last or 'no output'}", "error"))
    run.not_run = [f"{f}: the tree lacks our overlay ({lacks_overlay})"
                   for f in our_files()] if lacks_overlay else []
    return run


def _pytest(command: list[str], tree: pathlib.Path, env: dict) -> tuple[int, str]:
    """Run pytest, its log passed on to stderr as it comes (stdout is for the callers'
    reports); return its exit status and the last line it printed."""
    last = ""
    with subprocess.Popen(command, cwd=tree, env=env, stdout=subprocess.PIPE,
                          stderr=subprocess.STDOUT, text=True, errors="replace") as proc:
        for line in proc.stdout:
            sys.stderr.write(line)
            last = line.strip() or last
    return proc.returncode, last


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("tree", type=pathlib.Path, help="patched vLLM tree")
    parser.add_argument("--junit", type=pathlib.Path, help="keep the JUnit XML here")
    parser.add_argument("--python", default=sys.executable, help="interpreter to use")
    args = parser.parse_args(argv)
    run = run_cpu_tier(args.tree, args.python, args.junit)
    print(run.line())
    for problem in run.problems:
        print(f"  {problem.test}: {problem.first_line}")
    return 0 if run.exit_code == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
