"""Run the GPU stage on one target tree, on the GPU machine; write its JSON.

    python ci/gpu_stage/run.py {tests,ab,all} --tree DIR --meta META.json --out OUT.json
        [--site DIR ...] [--workers N] [--deadline-s S] [--lock FILE]

``--tree``: the tree the rebase job built (vllm/, tests/, pyproject.toml). ``--meta``:
what the job knew of it (``stage.py``: ref, tree sha, both tables, whether our module must
be imported ahead of the tree's and from where). ``--site``: folders to put after the tree
on PYTHONPATH (the CuTe DSL release the target pins first, then the rest; a folder's
``nvidia_cutlass_dsl/dsl_packages`` is added as the wheel's .pth would). ``tests`` fills
``gpu``, ``ab`` fills ``ab`` of OUT (read-modify-write, so the phases can run apart:
the air-gapped runner runs every target's tests at once, then every target's A/B under
one GPU lock). Exit 0 when it wrote OUT, whatever the tests said.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import signal
import subprocess
import sys
import tempfile
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

HERE = Path(__file__).resolve().parent
CI_DIR = HERE.parent
sys.path.insert(0, str(CI_DIR))
sys.path.insert(0, str(HERE))

from cpu_tier import count_junit  # noqa: E402

VLLM_TESTS = "tests/kernels/test_bf16_skinny_gemm.py"
OUR_TESTS = "tests/kernels/test_kimi_k3_low_latency_gemm_gpu.py"


def python_path(tree: Path, sites: list[Path]) -> list[str]:
    """The tree, then each site; the first site's CuTe DSL ``dsl_packages`` (what the
    wheel's .pth adds), so a later site's other CuTe DSL release never mixes in."""
    paths = [str(tree)]
    dsl = [s / "nvidia_cutlass_dsl" / "dsl_packages" for s in sites
           if (s / "nvidia_cutlass_dsl" / "dsl_packages").is_dir()]
    for site in sites:
        paths.append(str(site))
        if dsl and site == dsl[0].parent.parent:
            paths.append(str(dsl[0]))
    return paths + [str(CI_DIR)]


def prefer_dir(tree: Path, meta: dict) -> Path | None:
    """Where our overlay's Kimi-K3 package lives when it must win the import, else None."""
    prefer = meta.get("prefer")
    if not prefer:
        return None
    path = Path(prefer)
    return path if path.is_absolute() else tree / path


def run_suite(tree: Path, test_file: str, env: dict, workers: int, timeout_s: float,
              plugins: tuple[str, ...] = ()) -> dict:
    """pytest on one file of ``tree`` (xdist over ``workers``); counts as in cpu_tier.

    ``--noconftest``: vLLM's tests/conftest.py imports its whole engine (its full
    requirements); the skinny-GEMM file uses no fixture of it but pytest's own.
    """
    with tempfile.TemporaryDirectory() as tmp:
        junit = Path(tmp) / "junit.xml"
        cmd = [sys.executable, "-m", "pytest", test_file, "-q", "-rs", "--noconftest",
               "-p", "no:cacheprovider", f"--junitxml={junit}",
               *[arg for p in plugins for arg in ("-p", p)]]
        if workers > 1:
            cmd += ["-n", str(workers)]
        # Its own process group: on timeout the xdist workers go too, and none is left
        # on the GPU while the A/B times.
        proc = subprocess.Popen(cmd, cwd=tree, env=env, stdout=sys.stderr, start_new_session=True)
        try:
            code = proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            code = "timeout"
        counts = count_junit(junit, tree) if junit.is_file() else {"errors": 1}
    if code == "timeout" or (isinstance(code, int) and code >= 2 and not any(
            counts.get(k) for k in ("passed", "failed", "skipped"))):
        counts = {**counts, "errors": max(1, counts.get("errors", 0)),
                  "note": f"pytest ended with {code}"}
    return {k: counts.get(k, 0) for k in ("passed", "failed", "skipped", "errors", "env_errors")} \
        | {k: v for k, v in counts.items() if k in ("env_causes", "note")}


def versions(env: dict, tree: Path) -> dict:
    """GPU, torch, CuTe DSL and vLLM as the tests' interpreter sees them."""
    probe = ("import json, importlib.metadata as md, torch\n"
             "def v(d):\n try: return md.version(d)\n except Exception: return 'absent'\n"
             "print(json.dumps({'gpu': torch.cuda.get_device_name(0) if torch.cuda.is_available()"
             " else 'none', 'capability': list(torch.cuda.get_device_capability(0))"
             " if torch.cuda.is_available() else None, 'torch': torch.__version__,"
             " 'cutlass_dsl': v('nvidia-cutlass-dsl'), 'vllm': v('vllm')}))")
    out = subprocess.run([sys.executable, "-c", probe], cwd=tree, env=env, capture_output=True,
                         text=True)
    lines = out.stdout.strip().splitlines()
    return json.loads(lines[-1]) if out.returncode == 0 and lines else {"error": out.stderr[-300:]}


def tests_phase(tree: Path, meta: dict, env: dict, workers: int, timeout_s: float) -> dict:
    """The report's ``gpu`` section: both suites' counts (run side by side), summed, and
    the versions."""
    prefer = prefer_dir(tree, meta)
    ours_env = dict(env, K3_PREFER_OVERLAY=str(prefer)) if prefer else env
    with ThreadPoolExecutor(2) as pool:
        vllm = pool.submit(run_suite, tree, VLLM_TESTS, env, workers, timeout_s)
        ours = pool.submit(run_suite, tree, OUR_TESTS, ours_env, workers, timeout_s,
                           ("prefer_overlay",) if prefer else ())
        suites = {"vllm": vllm.result(), "ours": ours.result()}
    total = {k: sum(s.get(k, 0) for s in suites.values())
             for k in ("passed", "failed", "skipped", "errors", "env_errors")}
    return {**total, "suites": suites, "env": versions(env, tree),
            "ours_from": "overlay (the job's merge of our module conflicted)" if prefer
            else "tree"}


def ab_phase(meta: dict, workers: int, deadline_s: float, lock: str, replays: int) -> dict:
    """The report's ``ab`` section for this GPU's architecture (runs in this process's env)."""
    import importlib.metadata as md

    import ab
    import torch

    cap = torch.cuda.get_device_capability(0)
    arch = ab.arch_of(cap)
    rows = ab.union_rows(meta["tables"]["upstream"], meta["tables"]["ours"], arch)
    results = ab.measure(rows, lock_path=lock, workers=workers, replays=replays,
                         deadline_s=deadline_s)
    return {
        "arch": arch,
        "provenance": {"gpu": torch.cuda.get_device_name(0), "capability": f"{cap[0]}.{cap[1]}",
                       "date": datetime.date.today().isoformat(), "torch": torch.__version__,
                       "cuda": torch.version.cuda, "cutlass_dsl": md.version("nvidia-cutlass-dsl"),
                       "kernel": f"{meta['ref']}'s ShapeDynamicSkinnyGemm (the tree's own)"},
        "method": f"CUDA-graph replay, >= 256 MiB rotating weights, median of {replays} replays; "
                  f"cuBLAS, upstream, ours back to back per row; tie within {ab.TIE:.0%}",
        "rows": results,
        "summary": ab.summarize(results),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("phase", choices=("tests", "ab", "all"))
    parser.add_argument("--tree", type=Path, required=True)
    parser.add_argument("--meta", type=Path, required=True)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--site", type=Path, action="append", default=[])
    parser.add_argument("--workers", type=int, default=4)
    parser.add_argument("--deadline-s", type=float, default=300.0)
    parser.add_argument("--replays", type=int, default=15)
    parser.add_argument("--lock", default=os.path.join(tempfile.gettempdir(), "k3-gpu.lock"))
    args = parser.parse_args(argv)
    tree = args.tree.resolve()
    meta = json.loads(args.meta.read_text())
    paths = python_path(tree, [s.resolve() for s in args.site])
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(paths), PYTHONUNBUFFERED="1")
    result = json.loads(args.out.read_text()) if args.out.is_file() else {}
    result.update(ref=meta["ref"], tree_sha=meta["tree_sha"])
    if args.phase in ("tests", "all"):
        result["gpu"] = tests_phase(tree, meta, env, args.workers, args.deadline_s)
    if args.phase in ("ab", "all"):
        sys.path[:0] = paths  # the tree's kernel and the target's CuTe DSL, in this process
        os.environ["PYTHONPATH"] = env["PYTHONPATH"]  # and in the spawned workers
        try:
            result["ab"] = ab_phase(meta, args.workers, args.deadline_s, args.lock, args.replays)
        except Exception as exc:  # report it; the tests' results must still come back
            result["ab"] = {"error": f"{type(exc).__name__}: {exc}"[:500]}
    args.out.write_text(json.dumps(result, indent=1, sort_keys=True) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
