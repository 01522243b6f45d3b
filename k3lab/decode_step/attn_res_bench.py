"""attn-res alone: v0.28.0's Triton kernel against ours, a benchmark.

Kinds: ``ours``, the overlay's one-launch kernel (``overlay/.../nvidia/attn_res.py``, what
patch 0010 routes to; options: its meta-parameters ``num_warps``, ``block_s``, ``reload``,
``pdl``), ``loop``, the same module's ``variant="loop"`` (options ``chunk``,
``num_warps``, ``num_stages``), ``cluster``, ``attn_res_cluster.attn_res_cluster``
(``overlay/.../nvidia/attn_res_cluster.py``, CuTe DSL: the row over a thread-block cluster;
option ``cluster``, its size), the earlier attempts of ``k3lab/experiments/attn_res_split.py`` (``last``,
``row``, ``spin``), which lost, and ``floor`` (``k3lab/experiments/attn_res_floor.py``: the
cluster kernel's loads and store without its math, options ``cluster`` and ``sync``, one
cluster barrier; its output is not attn-res, so only its time counts).

``python -m k3lab.decode_step.attn_res_bench --stock-dir DIR [--out DIR] [--m 1,2,4,8,16]
[--kinds ours,loop,cluster,last,row,spin] [--tag T]`` (default kinds ``ours,cluster``: the
SM90 fused table routes attn-res to ``cluster``) on a CUDA GPU (no vLLM: :mod:`k3lab.decode_step.imports`).
Writes ``attn_res_bench_<date><tag>.json`` to ``--out`` (default ``$OUT``) and prints the
best config of each kind (lowest summed µs over the M asked for). Exit codes: 0 done,
2 bad usage / no GPU / missing stock files.

Shapes: the replay's (hidden 7168, 8 earlier blocks in a ``[M, 9, 7168]`` buffer, delta
given, output norm on, no block write). Timing as the replay's per-op figures
(``replay.py``): one CUDA graph of 8 calls, each with its own copy of the three weight
vectors, the same activations; median of ``--reps`` replays, µs per call
(:func:`k3lab.timing.graph_replay_us`). Numerics on fresh inputs: the output against
float64 of the math (``rel_err``) and against v0.28.0's output; the prefix write
against v0.28.0's (``prefix_equal``: bit-exact expected).
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import pathlib
import re
import sys

from k3lab import provenance, timing
from k3lab.decode_step import imports
from k3lab.decode_step.layers import EPS, NB, H

COPIES = 8
#: The kinds of the overlay's launcher (``--apply-best`` chooses among them).
OURS = ("ours", "loop", "cluster")
#: What a run times unless told: the SM90 fused table's attn-res row is a ``cluster`` one, and
#: its fallback the tile kernel (a default of ``ours`` alone timed a kernel no model runs).
DEFAULT_KINDS = ("ours", "cluster")
GRID = {  # kind -> list of option dicts
    # NB = 8 blocks (u apart): one tile of 8 (block_s None) or two of 4
    "ours": [dict(num_warps=w, block_s=b, reload=r)
             for w, b, r in itertools.product((8, 16, 32), (None, 4), (False, True))],
    # the loop variant (column chunks, pipelined): configs ptxas (sm_90a) compiles without
    # spills; CH 2048 at 8 warps, 3-4 stages (8 stages would need 336 KB of shared memory)
    "loop": [dict(variant="loop", chunk=c, num_warps=w, num_stages=st)
             for c, w, st in itertools.product((1024,), (4, 8, 16), (4, 8))]
            + [dict(variant="loop", chunk=2048, num_warps=8, num_stages=st) for st in (3, 4)]
            + [dict(variant="loop", chunk=512, num_warps=w, num_stages=8) for w in (4, 8)],
    # the row over a cluster of 2, 4 or 8 CTAs (the portable sizes)
    "cluster": [dict(cluster=c) for c in (2, 4, 8)],
    "last": [dict(chunk=c, num_warps=w) for c, w in itertools.product((256, 512, 1024), (4, 8))],
    "row": [dict(chunk=c, num_warps=w, unroll=u)
            for c, w, u in itertools.product((512, 1024, 2048), (8, 16), (False, True))],
    "spin": [dict(chunk=c, num_warps=w) for c, w in itertools.product((256, 512, 1024, 2048), (4, 8))],
    # not attn-res: the cluster kernel's loads and store alone, and with one cluster barrier
    "floor": [dict(cluster=c, sync=s) for c in (4, 8) for s in (False, True)],
}  # fmt: skip


def reference(torch, prefix, delta, blocks, nw, qw, ow):
    """float64 output and the bf16 prefix write of the math in attn_res_split's docstring."""
    d = torch.float64
    u = (prefix.to(d) + delta.to(d)).to(prefix.dtype)
    src = torch.cat([blocks[:, :NB].to(d), u.to(d)[:, None]], 1)
    logit = (src * (nw.to(d) * qw.to(d))).sum(-1) * torch.rsqrt(src.pow(2).mean(-1) + EPS)
    mixed = (torch.softmax(logit, -1)[..., None] * src).sum(1)
    return mixed * torch.rsqrt(mixed.pow(2).mean(-1, keepdim=True) + EPS) * ow.to(d), u


TABLE = pathlib.Path(__file__).resolve().parents[2] / "overlay/vllm/models/kimi_k3/nvidia/low_latency_fused_sm90.py"
ROW = re.compile(r'^(\s*)\(7168,\): \("pdl_attn_res", .*, DECODE\),$', re.M)


def config_of(kind: str, opts: dict):
    """The table's config tuple (gemm_backends/pdl_attn_res.py) of a bench row's options."""
    if kind == "loop":
        return ("loop", opts["num_warps"], opts["chunk"], opts["num_stages"])
    if kind == "cluster":
        return ("cluster", opts["cluster"])
    return (opts["num_warps"], opts["block_s"] or 0, opts["reload"])


def choose(rows: list[dict], ms: list[int]) -> dict | None:
    """Ours (kinds ours, loop, cluster) fastest summed over ``ms`` among the configs that ran at every M,
    matched float64 (rel_err < 1e-2) and v0.28.0's prefix write, and beat v0.28.0 at every M;
    None if none did."""
    stock = {r["M"]: r["us"] for r in rows if r["kind"] == "v028" and "us" in r}
    runs: dict = {}
    for r in rows:
        if r["kind"] in OURS and "us" in r:
            runs.setdefault((r["kind"], json.dumps(r["opts"], sort_keys=True)), {})[r["M"]] = r
    good = {key: by_m for key, by_m in runs.items()
            if set(by_m) == set(ms) and all(by_m[m]["us"] < stock.get(m, 0) and by_m[m]["rel_err"] < 1e-2
                                            and by_m[m]["prefix_equal"] for m in ms)}  # fmt: skip
    if not good:
        return None
    kind, opts = min(good, key=lambda key: sum(r["us"] for r in good[key].values()))
    return {"kind": kind, "opts": json.loads(opts), "us": [good[(kind, opts)][m]["us"] for m in ms],
            "v028_us": [stock[m] for m in ms]}


def apply_best(rows: list[dict], ms: list[int], table: pathlib.Path = TABLE) -> dict:
    """Write :func:`choose`'s config into the attn_res row of ``table``, or comment the row
    out (v0.28.0's kernel then runs) when none of ours won. Returns what was done."""
    won = choose(rows, ms)
    text = table.read_text()
    if ROW.search(text) is None:
        raise ValueError(f"{table}: no attn_res row to set")
    if won is None:
        new = ROW.sub(lambda m: f"{m.group(1)}# {m.group(0).strip()}  (lost to v0.28.0: off)", text)
    else:
        cfg = config_of(won["kind"], won["opts"])
        new = ROW.sub(lambda m: f'{m.group(1)}(7168,): ("pdl_attn_res", {cfg!r}, DECODE),', text)
    table.write_text(new)
    return {"table": str(table), "config": None if won is None else list(config_of(won["kind"], won["opts"])),
            **(won or {"kind": None})}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m k3lab.decode_step.attn_res_bench")
    ap.add_argument("--stock-dir", type=pathlib.Path, required=True)
    ap.add_argument("--out", type=pathlib.Path, default=pathlib.Path(os.environ.get("OUT", ".")))
    ap.add_argument("--m", default="1,2,4,8,16")
    ap.add_argument("--kinds", default=",".join(DEFAULT_KINDS))
    ap.add_argument("--reps", type=int, default=15)
    ap.add_argument("--tag", default="")
    ap.add_argument("--grid", default="{}", help="JSON {kind: [options, ...]} replacing GRID[kind]")
    ap.add_argument("--apply-best", action="store_true",
                    help="write the fastest config of ours that beat v0.28.0 at every M into the SM90 "
                         "fused table of this tree, or take our row out if none did (a device copy of the "
                         "tree, so that a replay after it runs that choice)")
    args = ap.parse_args(argv)
    ms = [int(x) for x in args.m.split(",")]
    kinds = args.kinds.split(",")
    grid = {**GRID, **json.loads(args.grid)}
    if any(k not in grid for k in kinds):
        print(f"error: --kinds {args.kinds!r}: each of {sorted(grid)}", file=sys.stderr)
        return 2
    import torch
    import triton

    if not torch.cuda.is_available():
        print("error: no CUDA GPU", file=sys.stderr)
        return 2
    try:
        stock = imports.stock(args.stock_dir, "attn_res")
    except FileNotFoundError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    from k3lab.experiments import attn_res_floor
    from k3lab.experiments import attn_res_split as split

    one_launch = imports.overlay("attn_res")

    def ours_fn(prefix, delta, blocks, nw, qw, ow, nb, eps, out_eps, **opts):
        return one_launch.attn_res(prefix, delta, blocks, nw, qw, ow, nb, -1, eps, out_eps, **opts)

    cluster_launcher = imports.overlay("attn_res_cluster")

    def cluster_fn(prefix, delta, blocks, nw, qw, ow, nb, eps, out_eps, **opts):
        return cluster_launcher.attn_res_cluster(prefix, delta, blocks, nw, qw, ow, nb, -1, eps, out_eps, **opts)

    def floor_fn(prefix, delta, blocks, nw, qw, ow, nb, eps, out_eps, **opts):
        return attn_res_floor.floor(prefix, delta, blocks, nw, qw, ow, nb, -1, eps, out_eps, **opts)

    kind_fns = {**split.KINDS, "ours": ours_fn, "loop": ours_fn, "cluster": cluster_fn, "floor": floor_fn}

    def v028(prefix, delta, blocks, nw, qw, ow):
        return stock.attn_res(prefix, delta, blocks, nw, qw, ow, num_blocks=NB, block_write_idx=-1,
                              eps=EPS, output_norm_eps=EPS)  # fmt: skip

    variants = [("v028", {}, v028)]
    for kind in kinds:
        for opts in grid[kind]:

            def fn(prefix, delta, blocks, nw, qw, ow, f=kind_fns[kind], o=opts):
                return f(prefix, delta, blocks, nw, qw, ow, NB, EPS, EPS, **o)

            variants.append((kind, opts, fn))

    gen = torch.Generator(device="cuda").manual_seed(21)

    def rnd(*shape):
        return torch.randn(*shape, generator=gen, device="cuda").to(torch.bfloat16)

    wcopies = [[(1 + 0.1 * torch.randn(H, generator=gen, device="cuda")).to(torch.bfloat16)
                for _ in range(3)] for _ in range(COPIES)]  # fmt: skip
    doc = {**provenance.environment(), "tag": args.tag, "reps": args.reps,
           "shape": {"H": H, "num_blocks": NB, "blocks_rows": NB + 1},
           "method": "one CUDA graph of 8 calls (8 copies of the 3 weight vectors, same activations, "
                     "PDL launches where the kernel supports it), median of reps, us per call "
                     "(k3lab.timing.graph_replay_us); rel_err vs float64, rel_diff vs v0.28.0",
           "rows": []}  # fmt: skip
    args.out.mkdir(parents=True, exist_ok=True)
    path = args.out / f"attn_res_bench_{doc['date']}{args.tag}.json"
    for m in ms:
        prefix0, delta, blocks = rnd(m, H), rnd(m, H), rnd(m, NB + 1, H)
        ref, u = reference(torch, prefix0, delta, blocks, *wcopies[0])
        p_stock = prefix0.clone()
        out_stock = v028(p_stock, delta, blocks, *wcopies[0]).double()
        for kind, opts, fn in variants:
            if kind == "spin" and m * triton.cdiv(H, opts["chunk"]) > split.MAX_SPIN_PROGRAMS:
                continue
            rec = {"M": m, "kind": kind, "opts": opts}
            try:
                p = prefix0.clone()
                out = fn(p, delta, blocks, *wcopies[0])
                out2 = fn(prefix0.clone(), delta, blocks, *wcopies[0])  # counters reset?
                torch.cuda.synchronize()
                rec["rel_err"] = timing.rel_err(out, ref)
                rec["rel_diff_v028"] = timing.rel_err(out, out_stock)
                rec["second_call_equal"] = bool(torch.equal(out, out2))
                rec["prefix_equal"] = bool(torch.equal(p, p_stock) and torch.equal(p, u))
                pw = prefix0.clone()

                def body(fn=fn, pw=pw):
                    for w in wcopies:
                        fn(pw, delta, blocks, *w)

                rec["us"] = round(timing.graph_replay_us(body, body, COPIES, args.reps), 3)
            except Exception as e:  # a config that does not compile or run: record, go on
                rec["error"] = f"{type(e).__name__}: {str(e)[:300]}"
            print(json.dumps(rec), flush=True)
            doc["rows"].append(rec)
            path.write_text(json.dumps(doc, indent=1))
    best = {}
    for kind in ["v028", *kinds]:
        sums = {}
        for r in doc["rows"]:
            if r["kind"] == kind and "us" in r:
                key = json.dumps(r["opts"], sort_keys=True)
                sums.setdefault(key, []).append(r["us"])
        full = {k: v for k, v in sums.items() if len(v) == len(ms)}
        if full:
            key = min(full, key=lambda k: sum(full[k]))
            best[kind] = {"opts": json.loads(key), "us": full[key]}
    doc["best"] = best
    if args.apply_best:
        doc["applied"] = apply_best(doc["rows"], ms)
        print(json.dumps({"applied": doc["applied"]}))
    path.write_text(json.dumps(doc, indent=1))
    print(json.dumps({"best": best}))
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
