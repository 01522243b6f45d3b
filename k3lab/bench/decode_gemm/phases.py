"""Phases of one figures run: what each times, in what order, and their merge (pure).

A figures run (``runner.py``) is a sequence of child processes, one per phase, each
timing some backends next to cuBLAS and writing its own part JSON after every unit of
work, so that a phase killed at its deadline (or a GPU that hangs in it) loses only
that unit. The phases, in the order they run, most important first:

* ``core``: cuBLAS, ours (swap-AB), today's CuTe rows, the read roof and the trivial
  launch, on every shape x M: every target of issue 12 can be judged from it alone;
* ``ll_bf16``: vLLM's ``ll_bf16`` (+ cast), cuBLAS re-timed alongside it;
* ``tinygemm``: FlashInfer's ``tinygemm_bf16``, cuBLAS re-timed alongside it.

``merge`` puts the phases' rows together: the core row is the row (roof, today's
entry, cuBLAS); a later phase's candidate keeps the cuBLAS times of its own process
(``cublas_us`` on the candidate), which ``winners.winner`` compares it with.
"""

from __future__ import annotations

from typing import NamedTuple

from k3lab import shapes as shp


class Phase(NamedTuple):
    """One child process of a figures run.

    Attributes:
        name: ``core``, ``ll_bf16`` or ``tinygemm``.
        backends: what it times next to cuBLAS.
        cap_s: wall seconds it may take at most (start-up and compiles included).
        min_s: seconds left below which it is not started (or restarted) at all.
    """

    name: str
    backends: tuple[str, ...]
    cap_s: float
    min_s: float


PHASES: tuple[Phase, ...] = (
    Phase("core", ("swap_ab", "cute"), 240.0, 60.0),
    Phase("ll_bf16", ("ll_bf16",), 120.0, 45.0),
    Phase("tinygemm", ("tinygemm",), 90.0, 35.0),
)

# Seconds a child may spend in one unit of work before the runner kills it as hung,
# when the child names no limit of its own (start-up: imports and CUDA context).
STARTUP_LIMIT_S = 90.0
# ll_bf16 variants timed: its split-K kernel is shape-dynamic (one compile each); the
# dot-product kernel compiles per (M, K), so only where the probe saw it win (K = 7168, M <= 2).
LL_SPLITK = ("splitk", 2, 4)
LL_SPLITK_NARROW = ("splitk", 4, 4)  # N <= 1536: the probe's best there
LL_DOTPROD = ("dotprod", 256)


def ll_configs(n: int, k: int, m: int) -> list:
    """ll_bf16 variants for one row, inside the domain vLLM's own dispatch uses it in.

    Its split-K kernel only where vLLM dispatches it (K >= 2048). With fewer 256-wide K
    tiles than splits it hangs the GPU: a split that owns no K tile still primes a
    pipeline stage its consumer never waits for (``num_k_tiles`` = 0), so the producer's
    ``producer_tail`` waits forever for that stage to be released (v0.28.0
    ``_ll_bf16_splitk.py``; K = 128, split_k = 2 in run h200-20261130-decode).
    ``low_latency_gemm`` refuses such a row too.
    """
    cfgs = []
    if k >= 2048:
        cfgs += [LL_SPLITK] + ([LL_SPLITK_NARROW] if n <= 1536 else [])
    if k == 7168 and m <= 2:
        cfgs.append(LL_DOTPROD)
    return cfgs


def shape_order(phase: str, shapes) -> list:
    """The shapes ``phase`` times, in the order it times them.

    core: largest weight first (the >= 20 MB roof target; a cut run loses the smallest);
    ll_bf16: shapes it has a config for, smallest weight first (where the probe saw it
    win); tinygemm: every shape its kernel takes (K % 64 == 0, N % 16 == 0), smallest first.
    """
    by_size = sorted(shapes, key=lambda s: (s[0] * s[1], s))
    if phase == "core":
        return by_size[::-1]
    if phase == "ll_bf16":
        return [s for s in by_size if any(ll_configs(*s, m) for m in shp.M_RANGE)]
    if phase == "tinygemm":
        return [s for s in by_size if s[1] % 64 == 0 and s[0] % 16 == 0]
    raise ValueError(f"unknown phase {phase!r}")


def shape_unit(n: int, k: int) -> str:
    """Name of the unit that times every M of one weight shape."""
    return f"shape:{n}x{k}"


def merge(parts: dict, skipped: list, runner_log: list) -> dict:
    """One figures JSON from ``{phase name: part JSON}`` (any may be missing).

    ``skipped``: ``[{"phase", "unit", "reason"}]`` the runner recorded (kills);
    ``runner_log``: its events. Rows are keyed by (N, K, M); a row only a later phase
    timed gets its roof from the core phase's read bandwidth (None without one). The
    result has no ``winner``/``summary`` yet: ``winners.decide`` adds them.
    """
    core = parts.get("core") or {}
    first = core or next((p for p in parts.values() if p), {})
    bw = core.get("read_bw_TBps")
    res = {
        "provenance": first.get("provenance", {}),
        "criteria": first.get("criteria", {}),
        "method": first.get("method", {}),
        "available": {},
        "read_bw_TBps": bw,
        "trivial_us": core.get("trivial_us", {}),
        "compile_s": {},
        "cute_queue": core.get("cute_queue", []),
        "cute_timed": core.get("cute_timed", []),
        "phases": {},
        "skipped": list(skipped),
        "runner": list(runner_log),
    }
    rows: dict = {}
    for r in core.get("rows", []):
        rows[(r["N"], r["K"], r["M"])] = {**r, "candidates": [dict(c) for c in r["candidates"]]}
    for name, part in parts.items():
        if not part:
            continue
        res["available"].update(part.get("available", {}))
        res["compile_s"].update(part.get("compile_s", {}))
        res["skipped"] += [{"phase": name, **s} for s in part.get("skipped", [])]
        res["phases"][name] = {"units_done": part.get("done", []), "wall_s": part.get("wall_s")}
        if name == "core":
            continue
        for r in part.get("rows", []):
            key = (r["N"], r["K"], r["M"])
            if key not in rows:
                roof = bw and round(shp.roof_us(*key, bw * 1e12), 3)
                rows[key] = {"N": r["N"], "K": r["K"], "M": r["M"], "label": r.get("label", ""),
                             "weight_bytes": shp.weight_bytes(r["N"], r["K"]), "roof_us": roof,
                             "today": ["cublas", None],
                             "cublas_us": list(r["cublas_us"]), "candidates": []}
            rows[key]["candidates"] += [{**c, "cublas_us": list(r["cublas_us"]), "phase": name}
                                        for c in r["candidates"]]
    res["rows"] = [rows[k] for k in sorted(rows)]
    return res
