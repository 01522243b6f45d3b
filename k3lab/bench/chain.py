"""Issue 28's chain: a table's decode GEMMs back to back in one CUDA graph, per table (GPU).

A decode step is a chain of kernels, so a GEMM that wins alone can lose in it (a kernel
without PDL pays its launch and ramp in full; split-K pays its second pass). For each token
count M, the shapes of the first table with weights of at most ``--max-mb`` MB (the SM90
table's 23 come to about 0.7 GB, so L2 keeps nothing from one pass to the next) run once
each, back to back, in one CUDA graph, in these variants:

* ``cublas``: ``torch.mm`` on every shape;
* ``NAME``, for every ``--table NAME=PATH`` (a table data module with ``ROWS``, e.g.
  ``low_latency_gemm_sm90.py`` as committed now, or an earlier revision of it from
  ``git show REV:overlay/vllm/models/kimi_k3/nvidia/low_latency_gemm_sm90.py``): the
  table's (backend, config) at (shape, M) through the dispatch's launch, ``torch.mm``
  where it has no row or the backend is not built here, as the dispatch runs it;
* ``NAME+norm``: the same with the overlay's PDL-aware RMSNorm (``norm.rms_norm``) before
  every GEMM, as the step's norms and pointwise ops sit between its projections;
* ``cublas+norm``: that norm without PDL before every ``torch.mm``.

The roof is the chain's summed ``shapes.min_bytes_moved`` over the read bandwidth measured
in the same run. Writes ``chain_sm90_<date>.json`` into ``--out``: provenance, read
bandwidth, the shapes, per M and variant the µs of one chain and its fraction of the roof,
and each table's path and ``PROVENANCE``. Usage (after the bundle's install;
``k3lab/device/run.sh chain`` runs it)::

    python -m k3lab.bench.chain --table now=overlay/vllm/models/kimi_k3/nvidia/low_latency_gemm_sm90.py \\
        --table before=OLD_SM90.py --out OUT [--m 1-16] [--max-mb 100]
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import sys
import time

from k3lab import shapes as shp
from k3lab.bench.gemm import load_ours

EPS = 1e-6
PASSES = 4  # chains per graph replay: long enough that the launch of the replay is noise


def parse_tables(specs: list[str]) -> list[tuple[str, str]]:
    """``["NAME=PATH", ...]`` -> ``[(NAME, PATH), ...]``; ValueError for a spec without a
    name or path, a name used twice, or a name that is a variant of its own."""
    out: list[tuple[str, str]] = []
    for spec in specs:
        name, sep, path = spec.partition("=")
        if not sep or not name or not path:
            raise ValueError(f"--table {spec!r}: want NAME=PATH")
        if name in {n for n, _ in out} or name.startswith("cublas") or name.endswith("+norm"):
            raise ValueError(f"--table {spec!r}: the name {name!r} is taken")
        out.append((name, path))
    if not out:
        raise ValueError("at least one --table NAME=PATH")
    return out


def parse_m(text: str) -> list[int]:
    """``"1-16"`` or ``"1,2,4"`` -> token counts, each in ``shapes.M_RANGE``; ValueError else."""
    ms: list[int] = []
    for part in text.split(","):
        lo, sep, hi = part.partition("-")
        ms += list(range(int(lo), int(hi) + 1)) if sep else [int(lo)]
    if not ms or any(m not in shp.M_RANGE for m in ms):
        raise ValueError(f"--m {text!r}: token counts in 1..16")
    return sorted(set(ms))


def chain_shapes(rows: dict, max_mb: float) -> list[tuple[int, int]]:
    """The (N, K) of a table's ``rows`` (``{(N, K, M): entry}``) with weights <= ``max_mb`` MB."""
    return sorted({(n, k) for n, k, _ in rows if shp.weight_bytes(n, k) <= max_mb * 1e6})


def plan(rows: dict, chain: list[tuple[int, int]], m: int) -> list[tuple[tuple[int, int], tuple | None]]:
    """``[(shape, (backend, cfg) or None for torch.mm)]`` of one table at M = ``m``."""
    return [(s, rows.get((*s, m))) for s in chain]


def roof_us(chain: list[tuple[int, int]], m: int, read_bps: float) -> float:
    """The chain's read roof at M = ``m`` (µs)."""
    return sum(shp.min_bytes_moved(n, k, m) for n, k in chain) / read_bps * 1e6


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m k3lab.bench.chain", description=__doc__.split("\n")[0])
    ap.add_argument("--table", action="append", default=[], help="NAME=PATH of a table data module")
    ap.add_argument("--m", default="1-16")
    ap.add_argument("--max-mb", type=float, default=100.0)
    ap.add_argument("--replays", type=int, default=15)
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    ap.add_argument("--run-id", default=os.environ.get("K3_RUN_ID", "chain"))
    args = ap.parse_args(argv)
    try:
        tables = [(name, path, *load_ours(path)) for name, path in parse_tables(args.table)]
        ms = parse_m(args.m)
    except (ValueError, OSError, KeyError, SyntaxError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    chain = chain_shapes(tables[0][2], args.max_mb)
    if not chain:
        print(f"error: the first table has no shape of <= {args.max_mb} MB", file=sys.stderr)
        return 2

    import torch

    from k3lab import candidates, timing
    from k3lab.provenance import provenance

    norm = importlib.import_module("vllm.models.kimi_k3.nvidia.norm")
    read_bps = timing.read_bandwidth_Bps()
    gen = torch.Generator(device="cuda").manual_seed(28)
    ws = {s: (torch.randn(*s, generator=gen, device="cuda") / s[1] ** 0.5).to(torch.bfloat16) for s in chain}
    nw = {s: torch.ones(s[1], dtype=torch.bfloat16, device="cuda") for s in chain}
    doc = {"provenance": provenance(args.run_id, kernel="the tables' backends, cuBLAS, norm.py"),
           "read_bw_TBps": round(read_bps / 1e12, 4), "max_mb": args.max_mb,
           "shapes": [list(s) for s in chain],
           "weight_MB": round(sum(shp.weight_bytes(*s) for s in chain) / 1e6, 1),
           "tables": {name: {"path": path, "provenance": prov} for name, path, _, prov in tables},
           "method": f"k3lab.timing.graph_replay_us: {PASSES} chains per CUDA graph, median of "
                     f"{args.replays} replays; roof = summed min_bytes_moved / read bandwidth of this run",
           "chains": []}  # fmt: skip
    mm = lambda x, w: torch.mm(x, w.t())  # noqa: E731
    for m in ms:
        xs = {s: torch.randn(m, s[1], generator=gen, device="cuda").to(torch.bfloat16) for s in chain}
        variants = {"cublas": ([(s, mm) for s in chain], None)}
        for name, _, rows, _ in tables:
            fns = [(s, candidates.routed(e[0], e[1], m) if e and candidates.available(e[0]) else mm)
                   for s, e in plan(rows, chain, m)]  # fmt: skip
            variants[name] = (fns, None)
            variants[name + "+norm"] = (fns, True)
        variants["cublas+norm"] = (variants["cublas"][0], False)
        roof = roof_us(chain, m, read_bps)
        rec = {"M": m, "n_gemms": len(chain), "roof_us": round(roof, 2)}
        for variant, (fns, pdl_norm) in variants.items():
            def one(fns=fns, pdl_norm=pdl_norm):
                for s, fn in fns:
                    x = xs[s] if pdl_norm is None else norm.rms_norm(xs[s], nw[s], EPS, pdl=pdl_norm)
                    fn(x, ws[s])

            def body(one=one):
                for _ in range(PASSES):
                    one()

            try:
                us = timing.graph_replay_us(one, body, PASSES, args.replays)
                rec[variant + "_us"], rec["frac_" + variant] = round(us, 2), round(roof / us, 3)
            except Exception as exc:  # one variant that cannot run must not lose the others
                rec[variant + "_error"] = f"{type(exc).__name__}: {exc}"[:200]
        doc["chains"].append(rec)
        print("[chain]", json.dumps(rec), flush=True)
        os.makedirs(args.out, exist_ok=True)
        path = os.path.join(args.out, f"chain_sm90_{time.strftime('%Y-%m-%d')}.json")
        with open(path, "w") as f:
            json.dump(doc, f, separators=(",", ":"), sort_keys=True)
    print(f"[chain] wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
