"""Run a figures run's phases as child processes, each under deadlines; merge (CPU side).

A GPU kernel that never ends (vLLM's ``ll_bf16`` split-K with a split that owns no K
tile did, run h200-20261130-decode) cannot be interrupted from inside its process, so
the run is cut into child processes (``figures.py --phase``, ``phases.PHASES``, most
important first) and this parent, which never touches the GPU, watches them:

* each phase gets ``min(Phase.cap_s, seconds left)``; a child past it is killed;
* a child names every unit of work it starts, with the seconds it may take, in its
  progress file; one past that limit (or silent past ``STARTUP_LIMIT_S`` after start)
  is killed with its process group, the unit is recorded as skipped with the reason,
  and the phase starts again with ``--skip UNIT``, resuming from its part JSON, while
  at least ``Phase.min_s`` is left (at most ``MAX_ATTEMPTS`` times);
* a child that dies inside a unit (a crash, a CUDA error) is treated the same way;
* after every phase the figures JSON is merged from the parts (``phases.merge``),
  decided (``winners.decide``) and written, so a run cut short keeps every phase done.

Usage (after ``install.sh``; ``k3lab/device/run.sh decode`` runs it)::

    python -m k3lab.bench.decode_gemm.runner --out-dir OUT --deadline-s 370 -- \\
        --sweep SWEEP.json --tune TUNE.json --table TABLE.py   # passed on to figures.py
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from typing import Callable

from k3lab import paths
from k3lab.bench.decode_gemm import phases, winners

WORKER = "k3lab.bench.decode_gemm.figures"  # one child process per phase
MAX_ATTEMPTS = 3
MARGIN_S = 5.0  # a child's own deadline ends this much before the parent's kill
OUT_JSON = "decode_gemm_sm90.json"


def _read(path: str):
    try:
        with open(path) as f:
            return json.load(f)
    except (OSError, ValueError):
        return None


def _kill(proc: subprocess.Popen) -> None:
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    try:
        proc.wait(timeout=10)
    except subprocess.TimeoutExpired:  # stuck in the driver: go on, it is not ours to wait
        pass


def watch(argv: list, progress: str, cap_s: float, poll_s: float = 0.25) -> tuple:
    """Run ``argv`` until it exits or must be killed.

    Returns ``(rc, unit, reason)``: ``unit`` None when the child ended on its own with
    no unit open; else the unit it was in (``"startup"`` before it named one) and why it
    was stopped (limit passed, phase cap, or the exit status it died with).
    """
    if os.path.exists(progress):
        os.remove(progress)
    start = time.time()
    proc = subprocess.Popen(argv, start_new_session=True, cwd=paths.REPO)  # finds k3lab
    while True:
        rc = proc.poll()
        prog = _read(progress)
        prog = prog if prog and prog.get("pid") == proc.pid else None
        unit = prog["unit"] if prog else "startup"
        if rc is not None:
            if rc == 0 or prog and prog["unit"] is None:
                return rc, None, None
            return rc, unit, f"child exited with status {rc} inside this unit"
        now = time.time()
        if now - start > cap_s:
            _kill(proc)
            return None, unit or "phase", f"phase cap {cap_s:.0f} s reached (killed)"
        if prog and prog["unit"] and now - prog["since"] > prog["limit_s"]:
            _kill(proc)
            return None, unit, f"no progress in {prog['limit_s']:.0f} s, the unit's limit (killed)"
        if not prog and now - start > phases.STARTUP_LIMIT_S:
            _kill(proc)
            return None, "startup", f"no unit started in {phases.STARTUP_LIMIT_S:.0f} s (killed)"
        time.sleep(poll_s)


def run(
    argv_for: Callable[[phases.Phase, str, str, list, float], list],
    out_dir: str,
    deadline_s: float,
    phase_list=phases.PHASES,
    poll_s: float = 0.25,
) -> dict:
    """Every phase of ``phase_list`` in order, within ``deadline_s``; the merged figures.

    ``argv_for(phase, part_path, progress_path, skip_units, child_deadline_s)`` gives
    a child's command line. Writes ``out_dir/part_<phase>.json`` (the children) and
    ``out_dir/decode_gemm_sm90.json`` after every phase.
    """
    t_end = time.time() + deadline_s
    skipped, log, parts = [], [], {}
    result: dict = {}
    for ph in phase_list:
        part = os.path.join(out_dir, f"part_{ph.name}.json")
        progress = os.path.join(tempfile.gettempdir(), f"k3_figures_{os.getpid()}_{ph.name}.progress")
        ph_end = min(t_end, time.time() + ph.cap_s)
        skip: list = []
        for attempt in range(1, MAX_ATTEMPTS + 1):
            left = ph_end - time.time()
            if left < ph.min_s:
                skipped.append({"phase": ph.name, "unit": "phase" if attempt == 1 else "rest",
                                "reason": f"{left:.0f} s left, under the {ph.min_s:.0f} s "
                                          f"it needs (attempt {attempt})"})
                break
            t0 = time.time()
            rc, unit, why = watch(argv_for(ph, part, progress, skip, left - MARGIN_S),
                                  progress, left, poll_s)
            log.append({"phase": ph.name, "attempt": attempt, "rc": rc, "unit": unit,
                        "reason": why, "wall_s": round(time.time() - t0, 1)})
            print(f"[runner] {ph.name} attempt {attempt}: rc {rc}"
                  + (f", stopped in {unit}: {why}" if unit else "")
                  + f" ({time.time() - t0:.0f} s)", flush=True)
            if unit is None:
                break
            skipped.append({"phase": ph.name, "unit": unit, "reason": why})
            skip.append(unit)
            if unit == "phase" or "phase cap" in (why or ""):
                break
        parts[ph.name] = _read(part)
        result = winners.decide(phases.merge(parts, skipped, log))
        with open(os.path.join(out_dir, OUT_JSON) + ".tmp", "w") as f:
            json.dump(result, f, indent=1, sort_keys=True)
        os.replace(os.path.join(out_dir, OUT_JSON) + ".tmp", os.path.join(out_dir, OUT_JSON))
        if os.path.exists(progress):
            os.remove(progress)
    return result


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    rest = argv[argv.index("--") + 1:] if "--" in argv else []
    own = argv[:argv.index("--")] if "--" in argv else argv
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out-dir", required=True)
    ap.add_argument("--deadline-s", type=float, default=370.0)
    ap.add_argument("--phase", action="append", help="run only these phases (in PHASES order)")
    args = ap.parse_args(own)
    os.makedirs(args.out_dir, exist_ok=True)
    chosen = [p for p in phases.PHASES if not args.phase or p.name in args.phase]
    def argv_for(ph, part, progress, skip, deadline):
        cmd = [sys.executable, "-m", WORKER, "--phase", ph.name, "--part", part,
               "--progress", progress, "--deadline-s", f"{deadline:.0f}", *rest]
        for unit in skip:
            cmd += ["--skip", unit]
        return cmd

    res = run(argv_for, args.out_dir, args.deadline_s, chosen)
    print("[runner] summary " + json.dumps(res.get("summary")), flush=True)
    print("[runner] skipped " + json.dumps(res.get("skipped")), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
