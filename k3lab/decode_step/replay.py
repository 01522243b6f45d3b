"""Decode-step replay: the dense path of three Kimi-K3 layers, stock vs ours vs the roof (a benchmark).

``python -m k3lab.decode_step.replay --stock-dir DIR [--out DIR] [--m 1-16] [--per-op-m 1,8,16]
[--patched]`` on a CUDA GPU (no vLLM needed: :mod:`k3lab.decode_step.imports`; ``--patched``
adds a third variant, the patched model's call sites (:mod:`k3lab.decode_step.patched`),
which needs the GPU bundle's vLLM tree with the overlay laid: ``k3lab/device/run.sh replay``).
DIR holds v0.28.0's three Triton op files (``python -m k3lab.decode_step.imports extract DIR``). Writes
``decode_step_<date>.json`` to ``--out`` (default ``$OUT``, else the current folder).
Exit codes: 0 done, 2 bad usage / no GPU / missing stock files.

What runs (TP8 local shapes, token counts M = 1..16; :mod:`k3lab.decode_step.layers`):

(a) the MTP step, (b) one KDA decoder layer, (c) one MLA decoder layer, op by op in the
order vLLM v0.28.0 runs them. Left out, with their place: the MLA attention core (after
``g_proj``, before the output gate), the KDA core (after ``f_b_proj``, before
``o_proj``; its gated ``o_norm`` is inside the fused decode kernel), the routed experts
(after ``routed_down``, before the shared experts). Their outputs are fixed random
tensors. The router gate and ``routed_down`` (and MLA's ``g_proj``) run on an aux
stream in vLLM; here both variants run them in line.

=========================  ================================  ====================================
stock op                   v0.28.0 (vllm/models/kimi_k3/)    stock variant runs
=========================  ================================  ====================================
fused_mtp_input            common/mtp.py:62, nvidia/mtp.py:110  vLLM's Triton kernel
eh_proj                    nvidia/mtp.py:109                 cuBLAS
input_layernorm            nvidia/model.py:999               stand-in for _C rms_norm
attn_res (pre-attn)        nvidia/model.py:1006 (ops/attn_res.py)  vLLM's Triton kernel (PDL)
fused_qkv_a_proj           nvidia/mla.py:495                 cuBLAS
fused_q_kv_rmsnorm         nvidia/mla.py:499                 vLLM's Triton kernel (PDL)
q_b_proj                   nvidia/mla.py:506                 cuBLAS
g_proj                     nvidia/mla.py:545                 cuBLAS
in_proj_qkvgfab            nvidia/kda.py:495                 cuBLAS
f_b_proj                   nvidia/kda.py:507                 cuBLAS (strided f_a view)
gate_sigmoid_mul           nvidia/mla.py:555                 stand-in for Inductor's kernel
o_proj                     nvidia/mla.py:564, kda.py:530     cuBLAS
post_attention_layernorm   nvidia/model.py:1027              stand-in for _C fused_add_rms_norm
attn_res (post-attn)       nvidia/model.py:1039              vLLM's Triton kernel (PDL)
router_gate                nvidia/model.py:756               cuBLAS bf16->fp32 (for CuTe ll_bf16)
routed_down                nvidia/model.py:779               cuBLAS
shared_gate_up             nvidia/model.py:279               cuBLAS
situ_and_mul               nvidia/model.py:280               stand-in for _C situ_and_mul
shared_down                nvidia/model.py:289               cuBLAS
routed_expert_norm         nvidia/model.py:319               stand-in for _C rms_norm
routed_up+shared           nvidia/model.py:321               cuBLAS addmm_ (beta-add)
shared_head.norm           nvidia/mtp.py:141                 stand-in for _C fused_add_rms_norm
=========================  ================================  ====================================

The stand-ins (:mod:`k3lab.decode_step.stock`; norms: our overlay norm kernel with
``pdl=False``) are one Triton launch each without PDL, as vLLM's CUDA kernels; the
router gate's CuTe DSL ``ll_bf16`` kernel is replaced by GateLinear's cuBLAS tier (the
CuTe DSL wheel is not carried). Ours: our swap-AB kernel for every projection at the
configs of ``configs.json``, the projections of one input as one stacked weight
(``fused_qkv_a_proj``+``g_proj``; the router gate+``routed_down``+shared ``gate_up``
through ``fused_gemm.gemm_split_dtype``: fp32 logits, bf16 rest), residual adds in
GEMM epilogues, a norm in the prologue of the GEMM that is its only reader
(``fused_gemm.py``), and the PDL-aware ``norm.py`` / ``pointwise.py`` kernels for the
rest (``layers.py`` says which op covers which); attn_res is v0.28.0's, unless
``--attn-res {last,row,spin}`` (with ``--attn-res-opts '{"chunk": 512}'``) puts a kernel of
``k3lab/experiments/attn_res_split.py`` in ours (stock keeps v0.28.0's).

Timing: each variant of a step is one CUDA graph over ``--copies`` rotated copies of
the layer's weights (>= 4x the 60 MiB L2 in all), median of ``--reps`` replays, µs per
step. Per op: a separate graph per op over the same copies (at ``--per-op-m``); an op
whose copies together fit in L2 (the norms' weights, ``f_b``, ``q_b``) reads them
partly from L2 there. Roof: the stock ops' fewest bytes (weights + activations in and
out, ``layers.Op.nbytes``) over the read bandwidth of a bf16 reduction over 4 GiB,
measured in the same run. ``rel_diff`` compares ours with stock on the layer's output.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import sys

from k3lab import provenance, timing
from k3lab.decode_step import imports, layers, patched

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


def kernels(stock_dir: pathlib.Path, attn_res: str = "v028", attn_res_opts: dict | None = None
            ) -> layers.Kernels:  # fmt: skip
    from k3lab.decode_step import stock

    sab = imports.overlay("swap_ab_gemm")
    data = json.loads((HERE / "configs.json").read_text())

    def cfg(n: int, k: int, fused: bool = False):
        return sab.SwapAbConfig(*data["fused" if fused else "configs"][f"{n}x{k}"])

    ours = [imports.overlay(name) for name in ("fused_gemm", "norm", "pointwise")]
    v028 = [imports.stock(stock_dir, name) for name in ("attn_res", "fused_qk_rmsnorm", "common_mtp")]
    kn = layers.Kernels(sab, *ours, *v028, stock, cfg)
    if attn_res != "v028":  # ours' attn-res: a kernel of attn_res_split.py at the given options
        from k3lab.experiments import attn_res_split

        fn = attn_res_split.KINDS[attn_res]
        opts = dict(attn_res_opts or {})

        def mine(prefix, delta, blocks, nw, qw, ow, nb, eps, out_eps):
            return fn(prefix, delta, blocks, nw, qw, ow, nb, eps, out_eps, **opts)

        kn = kn._replace(attn_res_ours=mine, attn_res_ours_name=f"attn_res_split {attn_res} {opts}")
    return kn


def _output_key(layer: str) -> str:
    return "logits_h" if layer == "mtp" else "moe_out"


def run_layer(torch, kn, layer: str, ms: list[int], per_op_ms: list[int], copies: int, reps: int,
              bw: float, pk=None) -> tuple[list[dict], list[dict]]:  # fmt: skip
    stock_ops, our_ops = layers.LAYERS[layer](kn)
    variants = [("stock", stock_ops), ("ours", our_ops)]
    if pk is not None:
        variants.append(("patched", patched.LAYERS[layer](pk, kn)))
    gen = torch.Generator(device="cuda").manual_seed(21)
    ws = [layers.weights(layer, "cuda", gen) for _ in range(copies)]
    enabled = None if pk is None else patched.enable(pk, ws)
    steps, per_op = [], []
    first_cover = {}  # (variant, stock op) -> the variant's first op that covers it
    for variant, ops in variants:
        for op in ops:
            for name in op.covers or (op.name,):
                first_cover.setdefault((variant, name), op.name)
    for m in ms:
        st0 = layers.inputs(layer, m, "cuda", gen)
        roof_bytes = sum(op.nbytes(m) for op in stock_ops)
        rec = {"layer": layer, "M": m, "roof_bytes": roof_bytes, "roof_us": round(roof_bytes / bw * 1e6, 2)}
        outs = {}
        for variant, ops in variants:
            st = {k: v.clone() for k, v in st0.items()}
            for op in ops:  # eager once: compiles, fills the state for the per-op graphs
                op.run(st, ws[0])
            torch.cuda.synchronize()
            outs[variant] = st[_output_key(layer)].double()
            st.get("_via", {}).clear()  # the record below is of the captured step, not this run

            def step(ops=ops, st=st):
                s2 = dict(st)
                for w in ws:
                    for op in ops:
                        op.run(s2, w)

            rec[f"{variant}_us"] = round(timing.graph_replay_us(step, step, copies, reps), 2)
            if variant == "patched":
                # Which call sites took the patched path, as decided under capture (the
                # step's copies of the state share one ``_via``; KDA's two streams only
                # exist while capturing).
                rec["patched_via"], rec["patched_enabled"] = dict(st.get("_via", {})), enabled
            if m in per_op_ms:
                for op in ops:

                    def one(op=op, st=st):
                        s2 = dict(st)
                        for w in ws:
                            op.run(s2, w)

                    covers = op.covers or (op.name,)
                    mine = [
                        o
                        for o in stock_ops
                        if o.name in covers and first_cover.get((variant, o.name)) == op.name
                    ]
                    nbytes = sum(o.nbytes(m) for o in mine)
                    per_op.append({"layer": layer, "M": m, "variant": variant, "op": op.name,
                                   "us": round(timing.graph_replay_us(one, one, copies, reps), 2),
                                   "roof_us": round(nbytes / bw * 1e6, 3), "runs": op.runs,
                                   "where": op.where, "covers": list(op.covers)})  # fmt: skip
        for variant, _ in variants:
            rec[f"frac_roof_{variant}"] = round(rec["roof_us"] / rec[f"{variant}_us"], 3)
            if variant != "stock":
                diff = (outs[variant] - outs["stock"]).norm() / outs["stock"].norm()
                rec[f"rel_diff_{variant}_vs_stock"] = float(diff)
        rec["speedup"] = round(rec["stock_us"] / rec["ours_us"], 3)
        if pk is not None:
            rec["speedup_patched"] = round(rec["stock_us"] / rec["patched_us"], 3)
        print(json.dumps(rec), flush=True)
        steps.append(rec)
    ws.clear()  # free the copies before the next layer
    torch.cuda.empty_cache()
    return steps, per_op


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        prog="python -m k3lab.decode_step.replay", description=__doc__.split("\n")[0]
    )
    ap.add_argument("--stock-dir", type=pathlib.Path, required=True)
    ap.add_argument("--out", type=pathlib.Path, default=pathlib.Path(os.environ.get("OUT", ".")))
    ap.add_argument("--layers", default="mtp,kda,mla")
    ap.add_argument("--m", default="1-16")
    ap.add_argument("--per-op-m", default="1,8,16")
    ap.add_argument("--copies", type=int, default=8)
    ap.add_argument("--reps", type=int, default=15)
    ap.add_argument("--tag", default="")
    ap.add_argument(
        "--patched",
        action="store_true",
        help="also time the patched model's call sites (needs the GPU bundle's vLLM tree)",
    )
    ap.add_argument("--attn-res", default="v028", choices=("v028", "last", "row", "spin"),
                    help="ours' attn-res: v0.28.0's kernel (default) or one of attn_res_split.py")
    ap.add_argument("--attn-res-opts", default="{}", help="JSON options of that kernel (chunk, num_warps)")
    args = ap.parse_args(argv)
    try:
        ms, per_op_ms = parse_ms(args.m), parse_ms(args.per_op_m)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    names = args.layers.split(",")
    if any(n not in layers.LAYERS for n in names):
        print(f"error: --layers {args.layers!r}: each of {sorted(layers.LAYERS)}", file=sys.stderr)
        return 2
    import torch

    if not torch.cuda.is_available():
        print("error: no CUDA GPU", file=sys.stderr)
        return 2
    try:
        kn = kernels(args.stock_dir, args.attn_res, json.loads(args.attn_res_opts))
    except (FileNotFoundError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    pk = None
    if args.patched:
        try:
            pk = patched.load()
        except ImportError as e:
            print(f"error: --patched needs the patched vLLM tree importable: {e}", file=sys.stderr)
            return 2
    bw = timing.read_bandwidth_Bps(replays=12)
    doc = {**provenance.environment(), "tag": args.tag, "read_bw_TBps": round(bw / 1e12, 4),
           "attn_res_ours": kn.attn_res_ours_name,
           "copies": args.copies, "reps": args.reps,
           "method": "one CUDA graph per variant over rotated weight copies, median of reps, µs per step; "
                     "per-op: one graph per op; roof = stock ops' bytes / read bandwidth of this run",
           "steps": [], "per_op": []}  # fmt: skip
    args.out.mkdir(parents=True, exist_ok=True)
    path = args.out / f"decode_step_{doc['date']}{args.tag}.json"
    for name in names:
        steps, per_op = run_layer(torch, kn, name, ms, per_op_ms, args.copies, args.reps, bw, pk)
        doc["steps"] += steps
        doc["per_op"] += per_op
        path.write_text(json.dumps(doc, indent=1))
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
