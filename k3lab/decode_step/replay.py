"""Decode-step replay of one deployment mode: three Kimi-K3 layers, stock vs patched vs the roof (a benchmark).

``python -m k3lab.decode_step.replay --mode NAME --stock-dir DIR [--out DIR] [--m 1-16]
[--per-op-m 1,8,16]`` on a CUDA GPU with the GPU bundle's vLLM tree (the overlay laid):
``k3lab/device/run.sh replay DIR`` (``REPLAY_ARGS="--mode h200-nobreak"``). NAME is a mode
of ``modes.json`` (``python -m k3lab.decode_step.modes`` lists them; default
``h200-default``, what v0.28.0 runs on an H200 when the user sets nothing: one full CUDA
graph per decode step, vLLM's aux-stream forks, ``_C`` small ops). DIR holds
v0.28.0's three Triton op files (``python -m k3lab.decode_step.imports extract DIR``).
Writes ``decode_step_<mode>_<date>[tag].json`` to ``--out`` (default ``$OUT``).
Exit codes: 0 done, 2 bad usage / no GPU / no bundle, 3 an unknown mode, 4 a mode whose
kernels do not run on the H200 (data only), 5 a ``--layers`` layer the mode does not run
(the MTP layer runs only in a drafting mode: ``h200-mtp``).

What runs (TP8 local shapes, the mode's token counts in 1..16, each at the size of the graph
the mode replays for it: ``M_run``, the next capture size up, :func:`modes.tokens_run`):
the layers the mode's decode step runs (:func:`modes.layers_run`): one KDA decoder layer,
one MLA decoder layer and, in a drafting mode, the MTP layer's draft step (at M = requests
x 2 tokens; its embedding lookup first; its logits, 294 MB of lm_head a rank, left out),
each op in the order the mode runs it, on the stream it runs on, with the mode's graph breaks
(:mod:`k3lab.decode_step.mode_ops`: which op is which kernel, stand-ins named; the JSON's
``ops`` lists them per layer and variant). Left out, their outputs fixed random tensors:
the MLA attention core, the KDA core, the routed experts (top-k, grouped GEMMs) and every
collective (the latent and shared all-reduces, o_proj's). Two variants, same weights, same
run: **stock** (v0.28.0) and **patched** (the series and the overlay: each call site
through its patched line's entry point, with its guards; ``patched_stock_sites`` names per
graph size the sites that took the stock path under capture).

Timing: each variant is the layer over ``--copies`` rotated weight copies (>= 4x the 60
MiB L2), captured as the mode captures it: under breakable capture one CUDA graph per
segment between the cores (consecutive copies' segments joined as consecutive layers are),
replayed back to back (no PDL across a break); under full capture one graph. Median of
``--reps`` replays, µs per layer. Per op: one graph per op over the copies (at the graph
sizes ``--per-op-m`` pads to; a per-op record's ``M`` is that size). Roof: the stock ops'
fewest bytes (weights + activations in and out, ``layers.Op.nbytes``) over the read
bandwidth of a bf16 reduction over 4 GiB measured in the same run. ``stand_ins``: each
stand-in timed once against the closest real kernel (:mod:`k3lab.decode_step.standins`).
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import json
import os
import pathlib
import sys

from k3lab import provenance, timing
from k3lab.decode_step import imports, layers, mode_ops, modes, patched, standins

HERE = pathlib.Path(__file__).resolve().parent


def parse_ms(text: str) -> list[int]:
    """``"1-16"`` or ``"1,8,16"`` -> token counts; ValueError outside 1..16."""
    out: list[int] = []
    for part in text.split(","):
        lo, _, hi = part.partition("-")
        out.extend(range(int(lo), int(hi or lo) + 1))
    if not out or min(out) < 1 or max(out) > 16:
        raise ValueError(f"token counts {text!r} outside 1..16")
    return out


def step_counts(mode: str, names: list[str], m: str, per_op_m: str) -> tuple[list[int], list[int]]:
    """(token counts, token counts timed per op too) of a replay of ``mode``'s layers
    ``names``: ``m`` / ``per_op_m`` parsed (:func:`parse_ms`), by default every count 1..16
    the mode's steps have and (the fewest, 8, 16). ValueError (one line) for a count no step
    of the mode has (with drafting: not requests x (1 + K))."""
    ms = parse_ms(m) if m else modes.token_counts(mode)
    per_op_ms = parse_ms(per_op_m) if per_op_m else sorted({ms[0], 8, 16} & set(ms))
    for layer in names:
        br = modes.branches(mode, layer)
        for count in (*ms, *per_op_ms):
            modes.tokens_run(count, br)  # ValueError: no step of this mode has that many tokens
    return ms, per_op_ms


def kernels(stock_dir: pathlib.Path) -> layers.Kernels:
    """Our overlay kernels, v0.28.0's Triton ops from ``stock_dir`` and its CuTe DSL router
    gate (GateLinear's tier 1: needs vLLM's tree and cutlass, the GPU bundle; ImportError
    without them, ValueError if the tree says the CuTe DSL is not available)."""
    from k3lab.decode_step import stock

    sab = imports.overlay("swap_ab_gemm")
    data = json.loads((HERE / "configs.json").read_text())

    def cfg(n: int, k: int, fused: bool = False):
        return sab.SwapAbConfig(*data["fused" if fused else "configs"][f"{n}x{k}"])

    ours = [imports.overlay(name) for name in ("fused_gemm", "norm", "pointwise")]
    v028 = [imports.stock(stock_dir, name) for name in ("attn_res", "fused_qk_rmsnorm", "common_mtp")]
    ll_bf16 = importlib.import_module("vllm.model_executor.kernels.linear.cute_dsl.ll_bf16")
    if not ll_bf16.is_available():
        raise ValueError("vLLM's ll_bf16.is_available() is False: cutlass.cute does not import")
    one_launch = imports.overlay("attn_res")

    def attn_res_ours(prefix, delta, blocks, nw, qw, ow, nb, eps, out_eps):
        # the replay's sites write no block (block_write_idx -1), as its stock op
        return one_launch.attn_res(prefix, delta, blocks, nw, qw, ow, nb, -1, eps, out_eps)

    return layers.Kernels(sab, *ours, *v028, stock, cfg, gate_ll_bf16=ll_bf16.ll_bf16_gemm,
                          attn_res_ours=attn_res_ours,
                          attn_res_ours_name="ours: one launch (nvidia/attn_res.py, patch 0010)")  # fmt: skip


def _output_key(layer: str) -> str:
    return "logits_h" if layer == "mtp" else "moe_out"


@contextlib.contextmanager
def _capture_mode(breakable: bool):
    """While building, warming and capturing a breakable mode, v0.28.0's
    ``BreakableCUDAGraphCapture.is_active()`` answers True, as in the model's capture, so
    the patched tree's own guards (the KDA overlap's, the FusedMoE entries' switches) see
    the mode; under full capture it answers False, as in a decode batch's one graph; a tree
    without it: no-op."""
    try:
        from vllm.compilation.breakable_cudagraph import BreakableCUDAGraphCapture as capture
    except ImportError:
        capture = None
    if not breakable or capture is None:
        yield
        return
    prev = getattr(capture._tls, "active", None)
    capture._tls.active = object()
    try:
        yield
    finally:
        capture._tls.active = prev


def _step_us(torch, ops: list, ws: list, st: dict, reps: int) -> tuple[float, int, dict]:
    """µs per layer of ``ops`` over the weight copies: one CUDA graph for a full capture,
    one per segment between breaks for a breakable one (replayed in order). Returns (µs,
    graphs, the state the replays left: the last copy's outputs, as the graphs computed them)."""
    segs = mode_ops.segments(ops, len(ws))
    shared = dict(st)  # one state for every segment: a later graph reads what an earlier one wrote

    def seg_fn(seg):
        def run():
            for op, c in seg:
                op.run(shared, ws[c])

        return run

    fns = [seg_fn(seg) for seg in segs]
    us = timing.segments_replay_us(lambda: [f() for f in fns], fns, len(ws), reps)
    torch.cuda.synchronize()
    return us, len(segs), shared


def timed_sizes(ms: list[int], per_op_ms: list[int], br: dict) -> dict[int, bool]:
    """The graph sizes a replay of the token counts ``ms`` times under the branches ``br``,
    in the order first met, each once (``modes.tokens_run``: M padded to its capture size),
    mapped to whether its ops are timed one by one too: where a count of ``per_op_ms``
    pads to it, whichever count of ``ms`` reached that size first."""
    per_op = {modes.tokens_run(m, br) for m in per_op_ms}
    return {size: size in per_op for size in dict.fromkeys(modes.tokens_run(m, br) for m in ms)}


def run_layer(torch, kn, pk, layer: str, mode: str, ms: list[int], per_op_ms: list[int], copies: int,
              reps: int, bw: float, routed: str = "none") -> tuple[list[dict], list[dict]]:  # fmt: skip
    br = modes.branches(mode, layer)
    gen = torch.Generator(device="cuda").manual_seed(21)
    ws = [layers.weights(layer, "cuda", gen, routed == "standin") for _ in range(copies)]
    enabled = None if pk is None else patched.enable(pk, ws)  # before the lists: the switches read it
    # Lists, warm-up runs and captures in the mode's capture: the switches read it as the
    # model's call sites do.
    with _capture_mode(br["capture"] == "breakable"):
        variants = mode_ops.lists(kn, pk, layer, mode, routed)
        stock_leaves = {op.name: op for op in mode_ops.leaves(variants["stock"])}
        first_cover = {}  # (variant, stock op) -> the variant's first top-level op that covers it
        for variant, ops in variants.items():
            for op in ops:
                for leaf in mode_ops.leaves([op]) or [op]:
                    for name in leaf.covers or (leaf.name,):
                        first_cover.setdefault((variant, name), op.name)
        timed, per_op = {}, []  # graph size -> its record; per-op records at graph sizes
        for m, per_op_too in timed_sizes(ms, per_op_ms, br).items():
            st0 = layers.inputs(layer, m, "cuda", gen)
            roof = mode_ops.roof_bytes(variants["stock"], m)
            rec = {"layer": layer, "M_run": m, "roof_bytes": roof, "roof_us": round(roof / bw * 1e6, 2)}
            outs = {}
            for variant, ops in variants.items():
                st = {k: v.clone() for k, v in st0.items()}
                for op in ops:  # eager once: compiles, fills the state for the graphs
                    op.run(st, ws[0])
                torch.cuda.synchronize()
                st.get("_via", {}).clear()  # the record below is of the captured step, not this run
                us, rec["graphs_per_step"], done = _step_us(torch, ops, ws, st, reps)
                rec[f"{variant}_us"] = round(us, 2)
                # the captured step's output (last weight copy; both variants replay the same copies)
                outs[variant] = done[_output_key(layer)].double()
                if variant == "patched":  # the call sites that took the stock path under capture
                    via = st.get("_via", {})
                    rec["patched_stock_sites"] = sorted(k for k, v in via.items() if v == "stock")
                if not per_op_too:
                    continue
                for op in (o for o in ops if not mode_ops.is_break(o)):

                    def one(op=op, st=st):
                        s2 = dict(st)
                        for w in ws:
                            op.run(s2, w)

                    mine = [n for leaf in mode_ops.leaves([op]) or [op] for n in (leaf.covers or (leaf.name,))
                            if first_cover.get((variant, n)) == op.name]  # fmt: skip
                    nbytes = sum(stock_leaves[n].nbytes(m) for n in mine if n in stock_leaves)
                    us = timing.graph_replay_us(one, one, copies, reps)
                    per_op.append({"layer": layer, "M": m, "variant": variant, "op": op.name,
                                   "us": round(us, 2), "roof_us": round(nbytes / bw * 1e6, 3),
                                   "covers": mine})  # fmt: skip
            for variant in variants:
                rec[f"frac_roof_{variant}"] = round(rec["roof_us"] / rec[f"{variant}_us"], 3)
            if "patched" in variants:
                diff = (outs["patched"] - outs["stock"]).norm() / outs["stock"].norm()
                rec["rel_diff_patched_vs_stock"] = float(diff)
                rec["speedup_patched"] = round(rec["stock_us"] / rec["patched_us"], 3)
            print(json.dumps(rec), flush=True)
            timed[m] = rec
    ws.clear()  # free the copies before the next layer
    torch.cuda.empty_cache()
    # one record per requested M: the record of the graph it replays
    steps = [{"layer": layer, "M": m, **timed[modes.tokens_run(m, br)]} for m in ms]
    return steps, per_op, enabled


def _compact(doc: dict) -> str:
    """JSON with each step, per-op, stand-in and op-table record on one line."""
    lines = []
    for key, value in doc.items():
        if isinstance(value, list) or (key == "ops" and isinstance(value, dict)):
            items = value.items() if isinstance(value, dict) else enumerate(value)
            body = [(f"{json.dumps(k)}: " if isinstance(value, dict) else "") + json.dumps(v, separators=(",", ":"))
                    for k, v in items]  # fmt: skip
            open_, close = ("{", "}") if isinstance(value, dict) else ("[", "]")
            lines.append(f"{json.dumps(key)}: {open_}\n  " + ",\n  ".join(body) + f"\n {close}")
        else:
            lines.append(f"{json.dumps(key)}: {json.dumps(value)}")
    return "{\n " + ",\n ".join(lines) + "\n}\n"


def op_table(kn, pk, mode: str, routed: str = "none") -> dict:
    """Per ``layer/variant``, the ops in order as the replay runs them: [name, v0.28.0
    file:line (stock), what runs]; a fork's arms and a graph break are spelled out in the
    name: what the JSON and the CPU tests compare with the modes data."""
    out = {}
    for layer in modes.layers_run(mode):
        with _capture_mode(modes.branches(mode, layer)["capture"] == "breakable"):
            lists = mode_ops.lists(kn, pk, layer, mode, routed)
        for variant, ops in lists.items():
            out[f"{layer}/{variant}"] = [[o.name, o.where, o.runs] for o in ops]
    return out


def _edit_paths(fused, paths: list[str], edit) -> None:
    """``fused.MODES_BY_CAPABILITY`` with each of ``paths``' modes replaced by
    ``edit(modes)``, in this process only. ValueError for a path the tree does not know."""
    unknown = sorted(set(paths) - set(fused.PATHS))
    if unknown:
        raise ValueError(f"{', '.join(unknown)} not among {', '.join(fused.PATHS)}")
    fused.MODES_BY_CAPABILITY = {
        cap: {**by_path, **{p: edit(by_path.get(p, {})) for p in paths}}
        for cap, by_path in fused.MODES_BY_CAPABILITY.items()}  # fmt: skip


def measure_paths_here(fused, paths: list[str], branch: str, capture: str) -> None:
    """Let ``paths`` run on ``branch`` under ``capture`` in this process, as if
    ``MEASURED_MODES`` listed them there (``fused``: the patched tree's
    ``low_latency_fused_dispatch``): the replay that measures a path before it is listed.
    ValueError for a path the tree does not know."""
    _edit_paths(fused, paths, lambda modes_: {**modes_, (branch, capture): "replay --measure-paths"})


def drop_paths_here(fused, paths: list[str], branch: str, capture: str) -> None:
    """Keep ``paths`` off on ``branch`` under ``capture`` in this process although
    ``MEASURED_MODES`` lists them there: the same run with and without a path.
    ValueError for a path the tree does not know."""
    _edit_paths(fused, paths, lambda modes_: {k: v for k, v in modes_.items() if k != (branch, capture)})


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        prog="python -m k3lab.decode_step.replay", description=__doc__.split("\n")[0]
    )
    ap.add_argument("--mode", default="h200-default", help="a mode of modes.json (python -m k3lab.decode_step.modes)")
    ap.add_argument("--stock-dir", type=pathlib.Path, required=True)
    ap.add_argument("--out", type=pathlib.Path, default=pathlib.Path(os.environ.get("OUT", ".")))
    ap.add_argument("--layers", default="", help="comma list of the mode's layers (default: all it runs)")
    ap.add_argument("--m", default="",
                    help="token counts, e.g. 1-16 (default: every count 1..16 the mode's steps have)")
    ap.add_argument("--per-op-m", default="",
                    help="token counts timed per op too (default: the fewest, 8, 16)")
    ap.add_argument("--copies", type=int, default=8)
    ap.add_argument("--reps", type=int, default=15)
    ap.add_argument("--tag", default="")
    ap.add_argument("--measure-paths", default="",
                    help="comma list of our model-level paths (moe_front, moe_tail, mla_front) to run in "
                         "this mode although MEASURED_MODES does not list it: how a path is measured "
                         "before it is listed")
    ap.add_argument("--drop-paths", default="",
                    help="comma list of our model-level paths to keep off in this mode although MEASURED_MODES "
                         "lists it: the same harness without the path")
    ap.add_argument("--routed-experts", choices=("none", "standin"), default="none",
                    help="standin: the routed experts' stand-in (layers.routed_standin) on the main stream "
                         "beside the shared experts' aux-stream fork, in both variants; none: left out")
    args = ap.parse_args(argv)
    try:
        rec = modes.replayable(args.mode)
    except (modes.UnknownMode, modes.NotReplayable) as e:
        print(f"error: {e}", file=sys.stderr)
        return e.exit_code
    names = [n for n in args.layers.split(",") if n]
    if any(n not in layers.LAYERS for n in names):
        print(f"error: --layers {args.layers!r}: each of {sorted(layers.LAYERS)}", file=sys.stderr)
        return 2
    try:
        names = modes.layers_run(args.mode, asked=names)
    except modes.NotRun as e:
        print(f"error: {e}", file=sys.stderr)
        return e.exit_code
    try:
        ms, per_op_ms = step_counts(args.mode, names, args.m, args.per_op_m)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    import torch

    if not torch.cuda.is_available():
        print("error: no CUDA GPU", file=sys.stderr)
        return 2
    # The mode's environment, as vLLM reads it at import (the patched tree's switches too).
    os.environ.update(rec["env"])
    try:
        kn = kernels(args.stock_dir)
        pk = patched.load()
    except (FileNotFoundError, ValueError, ImportError) as e:
        print(f"error: the replay needs v0.28.0's ops and the patched vLLM tree (the GPU bundle): {e}",
              file=sys.stderr)  # fmt: skip
        return 2
    trial = [p for p in args.measure_paths.split(",") if p]
    dropped = [p for p in args.drop_paths.split(",") if p]
    for flag, paths, apply in (("--measure-paths", trial, measure_paths_here),
                               ("--drop-paths", dropped, drop_paths_here)):
        try:
            for path in paths:
                branch = mode_ops.path_branch(path, rec["all"]["moe_branch"])
                apply(pk.fused, [path], branch, rec["all"]["capture"])
        except ValueError as e:
            print(f"error: {flag}: {e}", file=sys.stderr)
            return 2
    bw = timing.read_bandwidth_Bps(replays=12)
    doc = {**provenance.environment(), "mode": args.mode, "mode_record": rec, "tag": args.tag,
           "measure_paths": trial, "drop_paths": dropped, "routed_experts": args.routed_experts,
           "tree": os.environ.get("K3_TREE", "unnamed: set K3_TREE to the commit the bundle and overlay are of"),
           "read_bw_TBps": round(bw / 1e12, 4), "copies": args.copies, "reps": args.reps,
           "method": "per variant: the layer over rotated weight copies, one CUDA graph per segment between "
                     "graph breaks (one graph under full capture), replayed in order, median of reps, µs per layer; "
                     "per-op: one graph per op; roof = stock ops' bytes / read bandwidth of this run",
           "ops": {}, "stand_ins": standins.check(torch, kn, args.reps), "steps": [], "per_op": []}  # fmt: skip
    args.out.mkdir(parents=True, exist_ok=True)
    path = args.out / f"decode_step_{args.mode}_{doc['date']}{args.tag}.json"
    for name in names:
        steps, per_op, doc["patched_enabled"] = run_layer(torch, kn, pk, name, args.mode, ms, per_op_ms,
                                                          args.copies, args.reps, bw, args.routed_experts)  # fmt: skip
        doc["steps"] += steps
        doc["per_op"] += per_op
        doc["ops"] = op_table(kn, pk, args.mode, args.routed_experts)  # after enable: as the timed lists were built
        # one record a line: results/ holds at most 2 MB in all (tests/test_layout.py)
        path.write_text(_compact(doc))
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
