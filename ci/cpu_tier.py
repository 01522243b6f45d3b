"""CPU test tier: the Kimi-K3 low-latency GEMM tests on a patched vLLM tree.

Runs, with pytest in a subprocess (cwd and PYTHONPATH = the tree):

* vLLM's own ``tests/kernels/test_bf16_skinny_gemm.py``, which tests upstream's
  ``low_latency_gemm.py`` (the overlay leaves it as upstream has it);
* our ``tests/kernels/test_kimi_k3_low_latency_gemm.py`` (with ``_gemm_tables`` and
  ``_gemm_guards``), ``test_kimi_k3_kda_projection.py`` and their ``..._gpu.py`` files
  (from ``overlay/``; the GPU files skip without a GPU, and must say why).

The ``pytest_no_accelerator`` plugin next to this file keeps vLLM's per-test device
cleanup from erroring without a GPU, so GPU cases report as skipped with their reason.

Usage: ``python ci/cpu_tier.py TREE [--junit FILE]``; exits 1 on any failure or error.
The Python used needs torch, pytest, tblib and the tree's requirements: the rebase job
gives each target an environment of its own (``target_env.py``).
"""

from __future__ import annotations

import argparse
import os
import pathlib
import re
import subprocess
import sys
import tempfile
import xml.etree.ElementTree as ET

CI_DIR = pathlib.Path(__file__).resolve().parent
PLUGIN = "pytest_no_accelerator"
TEST_FILES = (
    "tests/kernels/test_bf16_skinny_gemm.py",
    "tests/kernels/test_kimi_k3_low_latency_gemm.py",
    "tests/kernels/test_kimi_k3_gemm_tables.py",
    "tests/kernels/test_kimi_k3_gemm_guards.py",
    "tests/kernels/test_kimi_k3_swap_ab_gemm.py",  # our Triton kernel, interpreted on the CPU
    "tests/kernels/test_kimi_k3_low_latency_gemm_gpu.py",  # must skip cleanly, with reasons
    "tests/kernels/test_kimi_k3_kda_projection.py",
    "tests/kernels/test_kimi_k3_kda_projection_gpu.py",  # likewise
)
COUNT_KEYS = ("passed", "failed", "skipped", "errors", "env_errors")
_MISSING = re.compile(r"ModuleNotFoundError: No module named '([\w.]+)'")


def pytest_command(python: str, junit_xml: pathlib.Path) -> list[str]:
    """The pytest invocation, relative to the tree."""
    return [
        python, "-m", "pytest", *TEST_FILES,
        "-p", PLUGIN,
        "-p", "no:cacheprovider",  # leave the tree as we found it
        "-q", "-rs",  # list skip reasons in the log
        # On a rebase target where our module conflicted, our test file cannot import
        # but upstream's can still tell us something: keep going.
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


def count_junit(junit_xml: pathlib.Path, tree: pathlib.Path | None = None) -> dict:
    """Outcome counts from a pytest JUnit XML file.

    A test can count twice, as pytest's own summary does: e.g. skipped in its body
    and an error at teardown. With ``tree``, a failure or error that
    ``environment_cause`` pins on the environment counts as ``env_errors`` instead,
    and ``env_causes`` lists those causes.
    """
    counts = dict.fromkeys(COUNT_KEYS, 0)
    causes = set()
    for case in ET.parse(junit_xml).getroot().iter("testcase"):
        bad = [child for child in case if child.tag in ("failure", "error")]
        kinds = {child.tag for child in case}
        cause = None
        if bad and tree is not None:
            text = " ".join((b.get("message") or "") + "\n" + (b.text or "") for b in bad)
            cause = environment_cause(text, tree)
        if cause:
            counts["env_errors"] += 1
            causes.add(cause)
        else:
            counts["failed"] += "failure" in kinds
            counts["errors"] += "error" in kinds
        counts["skipped"] += "skipped" in kinds
        counts["passed"] += not kinds & {"failure", "error", "skipped"}
    if causes:
        counts["env_causes"] = sorted(causes)
    return counts


def run_cpu_tier(
    tree: pathlib.Path,
    python: str = sys.executable,
    junit_xml: pathlib.Path | None = None,
) -> dict:
    """Run both test files on ``tree`` and return their counts.

    Args:
        tree: root of a patched vLLM source tree (patches applied, overlay copied).
        python: interpreter with torch, pytest and vLLM's common requirements.
        junit_xml: where pytest writes its JUnit report; a temporary file if None.

    Returns:
        ``{"passed", "failed", "skipped", "errors", "env_errors", "returncode"}`` (and
        ``env_causes`` when there are environment errors, see ``count_junit``). If pytest
        ran no test at all (usage error, crash, missing file), ``errors`` is 1.
    """
    tree = pathlib.Path(tree).resolve()
    with tempfile.TemporaryDirectory() as tmp:
        report = pathlib.Path(junit_xml or pathlib.Path(tmp) / "cpu_tier.xml").resolve()
        env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(tree), str(CI_DIR)]))
        # pytest's log goes to stderr: stdout is for the callers' reports.
        proc = subprocess.run(pytest_command(python, report), cwd=tree, env=env,
                              stdout=sys.stderr)
        counts = count_junit(report, tree) if report.is_file() else dict.fromkeys(COUNT_KEYS, 0)
        if proc.returncode >= 2 and not any(counts.values()):
            counts["errors"] = 1  # interrupted, usage error or crash before any test ran
    return {**counts, "returncode": proc.returncode}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("tree", type=pathlib.Path, help="patched vLLM tree")
    parser.add_argument("--junit", type=pathlib.Path, help="keep the JUnit XML here")
    parser.add_argument("--python", default=sys.executable, help="interpreter to use")
    args = parser.parse_args(argv)
    result = run_cpu_tier(args.tree, args.python, args.junit)
    print(" ".join(f"{key}={result[key]}" for key in (*COUNT_KEYS, "returncode")))
    ok = result["failed"] == 0 and result["errors"] == 0 and result["returncode"] == 0
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
