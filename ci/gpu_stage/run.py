"""Run the GPU stage on one target tree, on the GPU machine; write its JSON.

    python -m ci.gpu_stage.run {tests,ab,all} --tree DIR --meta META.json --out OUT.json
        [--site DIR ...] [--workers N] [--vllm-workers N] [--deadline-s S] [--lock FILE]

``--tree``: the tree the rebase job built (vllm/, tests/, pyproject.toml). ``--meta``:
what the job knew of it (``stage.py``: ref, tree sha, both tables, whether our module must
be imported ahead of the tree's and from where). ``--site``: folders to put after the tree
on PYTHONPATH (the CuTe DSL release the target pins first, then the rest; a folder's
``nvidia_cutlass_dsl/dsl_packages`` is added as the wheel's .pth would). ``tests`` fills
``gpu``, ``ab`` fills ``ab`` of OUT (read-modify-write, so the phases can run apart:
the air-gapped runner runs every target's tests at once, then every target's A/B under
one GPU lock). Exit 0 when it wrote OUT, whatever the tests said.

Suites: ``vllm`` (vLLM's skinny-GEMM file, in ``--vllm-workers`` pytest shards) and
``ours`` (our two GPU files, low-latency GEMM and KDA projections, in ``--workers``
shards), the tests of one kernel config in one shard (``compile_shards.py``). Counts come
from ``pytest_record.py``'s per-test files, so a suite cut at ``--deadline-s`` reports
what ran.
OUT is rewritten after each suite and each A/B row, so a phase killed from outside keeps
what it had.
"""

from __future__ import annotations

import argparse
import datetime
import importlib.metadata as md
import json
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from ci import prefer_overlay
from ci.cpu_tier import environment_cause
from ci.gpu_stage import ab, pytest_record

# On the tests' PYTHONPATH: the pytest plugins are loaded from here as gpu_stage.* and
# prefer_overlay, in processes that run in the target's tree, not in this repository.
CI_DIR = Path(__file__).resolve().parent.parent

VLLM_TESTS = ("tests/kernels/test_bf16_skinny_gemm.py",)
OUR_TESTS = ("tests/kernels/test_kimi_k3_low_latency_gemm_gpu.py",
             "tests/kernels/test_kimi_k3_kda_projection_gpu.py")


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


def run_suite(tree: Path, files: tuple[str, ...], env: dict, shards: int, timeout_s: float,
              record: Path, plugins: tuple[str, ...] = ()) -> dict:
    """pytest on ``files`` of ``tree`` in ``shards`` processes side by side (the tests of
    one kernel config in one: ``compile_shards.py``); counts as in cpu_tier, from the
    shards' ``pytest_record`` files (``<record stem>.<shard>.jsonl``).

    ``--noconftest``: vLLM's tests/conftest.py imports its whole engine (its full
    requirements); the skinny-GEMM file uses no fixture of it but pytest's own. A shard
    still going at ``timeout_s`` is killed; the counts are the tests that reached an
    outcome, plus one error saying where the suite was cut. With several ``files``,
    ``files`` in the result holds each one's counts.
    """
    start = time.monotonic()
    procs = []
    for index in range(shards):
        shard_record = record.with_name(f"{record.stem}.{index}.jsonl")
        shard_record.unlink(missing_ok=True)
        # One file that cannot be collected must not keep the other from running.
        cmd = [sys.executable, "-m", "pytest", *files, "-q", "-rs", "--noconftest",
               "--continue-on-collection-errors", "-p", "no:cacheprovider",
               "-p", "gpu_stage.pytest_record",
               "-p", "gpu_stage.compile_shards", *[arg for p in plugins for arg in ("-p", p)]]
        shard_env = dict(env, **{pytest_record.ENV: str(shard_record),
                                 pytest_record.SHARD_ENV: f"{index}/{shards}"})
        # Its own process group: on timeout all of it goes, and nothing of it is left
        # on the GPU while the A/B times.
        procs.append((subprocess.Popen(cmd, cwd=tree, env=shard_env, stdout=sys.stderr,
                                       start_new_session=True), shard_record))
    codes = []
    for proc, _ in procs:
        try:
            codes.append(proc.wait(timeout=max(0.1, start + timeout_s - time.monotonic())))
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            codes.append("timeout")
    wall = time.monotonic() - start
    entries = [e for _, path in procs for e in pytest_record.read(path)]
    result = suite_counts(entries, tree)
    cut = codes.count("timeout")
    if cut:
        result["errors"] += 1
        result["note"] = (f"cut at its deadline after {wall:.0f} s ({cut} of {shards} shards): "
                          f"{result['ran']} of {result.get('collected', '?')} tests reached an "
                          f"outcome")
    elif not result["ran"] and not result["errors"] and max(codes) >= 2:  # nothing ran
        result["errors"] = 1
        result["note"] = f"pytest ended with {max(codes)}"
    if len(files) > 1:
        result["files"] = {f: suite_counts([e for e in entries if e.get("nodeid", "") == f
                                            or e.get("nodeid", "").startswith(f + "::")], tree)
                           for f in files}
    return {**result, "wall_s": round(wall, 1), "shards": shards,
            "timing": pytest_record.timing(entries)}


def suite_counts(entries: list[dict], tree: Path) -> dict:
    return pytest_record.counts(entries, tree, environment_cause)


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


def tests_phase(tree: Path, meta: dict, env: dict, shards: dict[str, int], timeout_s: float,
                out: Path, save) -> dict:
    """The report's ``gpu`` section: each suite's counts (run side by side), summed, and
    the versions; ``save(section)`` after each suite ends, so a later kill loses neither.
    Each suite's ``pytest_record`` files are ``<out's stem>.<suite>.<shard>.jsonl`` beside
    ``out``."""
    prefer = prefer_dir(tree, meta)
    ours_env = dict(env, **{prefer_overlay.ENV: str(prefer)}) if prefer else env
    section = {"suites": {}, "ours_from": "overlay (the job's merge of our module conflicted)"
               if prefer else "tree"}
    lock = threading.Lock()

    def probe() -> None:  # beside the suites: it imports torch and touches the GPU too
        found = versions(env, tree)
        with lock:
            section["env"] = found

    def one(name: str, files: tuple[str, ...], suite_env: dict,
            plugins: tuple[str, ...] = ()) -> None:
        counts = run_suite(tree, files, suite_env, shards[name], timeout_s,
                           out.with_name(f"{out.stem}.{name}.jsonl"), plugins)
        with lock:
            section["suites"][name] = counts
            section.update(totals(section["suites"]))
            save(section)

    with ThreadPoolExecutor(3) as pool:
        jobs = [pool.submit(probe), pool.submit(one, "vllm", VLLM_TESTS, env),
                pool.submit(one, "ours", OUR_TESTS, ours_env, ("prefer_overlay",) if prefer else ())]
        for job in jobs:
            job.result()
    return section


def totals(suites: dict) -> dict:
    return {k: sum(s.get(k, 0) for s in suites.values())
            for k in ("passed", "failed", "skipped", "errors", "env_errors")}


def ab_phase(meta: dict, workers: int, deadline_s: float, lock: str, replays: int,
             save) -> dict:
    """The report's ``ab`` section for this GPU's architecture (runs in this process's env);
    ``save(section)`` after each row, marked ``partial`` until the last."""
    import torch

    cap = torch.cuda.get_device_capability(0)
    arch = ab.arch_of(cap)
    rows = ab.union_rows(meta["tables"]["upstream"], meta["tables"]["ours"], arch)
    section = {
        "arch": arch,
        "provenance": {"gpu": torch.cuda.get_device_name(0), "capability": f"{cap[0]}.{cap[1]}",
                       "date": datetime.date.today().isoformat(), "torch": torch.__version__,
                       "cuda": torch.version.cuda, "cutlass_dsl": md.version("nvidia-cutlass-dsl"),
                       "triton": version_or_absent("triton"),
                       "flashinfer": version_or_absent("flashinfer-python"),
                       "kernel": f"CuTe: {meta['ref']}'s ShapeDynamicSkinnyGemm (the tree's own); "
                                 "ours' swap_ab: our Triton kernel; ours' tinygemm, ll_bf16: our "
                                 "module's launch"},
        "method": f"CUDA-graph replay, >= 256 MiB rotating weights, median of {replays} replays; "
                  f"cuBLAS, upstream, ours back to back per row; tie within {ab.TIE:.0%}",
    }

    def progress(done: list[dict]) -> None:
        save({**section, "rows": done, "summary": ab.summarize(done),
              "partial": f"{len(done)} of {len(rows)} rows; the stage stopped before the rest"})

    results = ab.measure(rows, lock_path=lock, workers=workers, replays=replays,
                         deadline_s=deadline_s, on_row=progress)
    return {**section, "rows": results, "summary": ab.summarize(results)}


def version_or_absent(dist: str) -> str:
    try:
        return md.version(dist)
    except md.PackageNotFoundError:
        return "absent"


def write_json(path: Path, data: dict) -> None:
    """``data`` to ``path`` through a temporary file, so a kill never leaves half a file."""
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(data, indent=1, sort_keys=True) + "\n")
    os.replace(tmp, path)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("phase", choices=("tests", "ab", "all"))
    parser.add_argument("--tree", type=Path, required=True)
    parser.add_argument("--meta", type=Path, required=True)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--site", type=Path, action="append", default=[])
    parser.add_argument("--workers", type=int, default=4,
                        help="pytest shards for our files; processes for the A/B")
    parser.add_argument("--vllm-workers", type=int, default=2,
                        help="pytest shards for vLLM's file")
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

    def saver(key: str):
        def save(section: dict) -> None:
            result[key] = section
            write_json(args.out, result)
        return save

    if args.phase in ("tests", "all"):
        saver("gpu")(tests_phase(tree, meta, env, {"ours": args.workers, "vllm": args.vllm_workers},
                                 args.deadline_s, args.out, saver("gpu")))
    if args.phase in ("ab", "all"):
        sys.path[:0] = paths  # the tree's kernel and the target's CuTe DSL, in this process
        os.environ["PYTHONPATH"] = env["PYTHONPATH"]  # and in the spawned workers
        prefer = prefer_dir(tree, meta)
        if prefer:  # our module's launch for ours' ll_bf16/tinygemm rows (ab.py)
            os.environ[prefer_overlay.ENV] = str(prefer)
        try:
            section = ab_phase(meta, args.workers, args.deadline_s, args.lock, args.replays,
                               saver("ab"))
        except Exception as exc:  # report it; the tests' results must still come back
            section = {"error": f"{type(exc).__name__}: {exc}"[:500]}
        saver("ab")(section)
    write_json(args.out, result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
