"""The third variant of the replay: what the *patched* v0.28.0 model runs at decode.

``ours`` (:mod:`k3lab.decode_step.layers`) is the layer as we would build it: our kernel
on every projection, stacked weights, residuals in epilogues. ``patched`` is what our
patch series makes v0.28.0's model files run today, call site by call site, through the
very entry points the patched lines call, with their guards and fallbacks:

=========================  ===============================================================
v0.28.0 op                 the patched line's call (fallback: the stock op)
=========================  ===============================================================
fused_mtp_input            ``low_latency_fused_dispatch.try_mtp_input`` (patch 0006)
eh_proj, every projection  ``low_latency_gemm_dispatch.try_low_latency_gemm`` (0002, 0004:
                           the layers' method), else cuBLAS (the base method)
input_layernorm, post_attention_layernorm (MTP block), shared_head.norm
                           ``try_rms_norm`` (0005, 0006)
fused_q_kv_rmsnorm+q_b     ``try_rmsnorm_gemm`` (q_a_layernorm in q_b_proj's prologue), then
                           ``try_rms_norm`` (kv_a_layernorm, else vLLM's norm) (0006)
gate_sigmoid_mul           ``try_sigmoid_mul`` (0006)
in_proj_qkvgfab, f_b_proj  ``kda_projection.run_kda_projection_overlap`` at the token counts
                           of ``deployment_overlap_tokens`` (0003: none with the breakable
                           flag on; under graph capture, two streams), else the two
                           projections through the dispatch
router_gate+routed_down+shared_gate_up
                           ``try_gate_gemm`` on the load-time stack (0007), else the three
                           (the gate on cuBLAS fp32, the other two through the dispatch)
situ_and_mul               ``try_act_mul`` (0005)
routed_expert_norm+up      ``try_rmsnorm_gemm(..., add_to=shared)`` (0005)
attn_res (pre-, post-attn) ``try_attn_res`` (0010: our one-launch kernel where the fused
                           table has an ``attn_res`` row)
=========================  ===============================================================

The MoE is its MegaMoE branch, as in the other two variants (patch 0007 stacks only
there). vLLM runs the router gate, ``routed_down`` and MLA's ``g_proj`` on aux streams;
as in the other two variants they run in line here. The KDA projections' two streams are the
patch's own, so they are kept. A ``try_*`` entry the tree does not have (an older overlay)
counts as a fallback. Each op records, per M, whether its patched call was taken
(``st["_via"]``), so the JSON says which sites ran ours.

Needs the real vLLM tree with the overlay laid (the GPU bundle): the dispatch imports
vLLM's envs, logger and linear layers. Nothing here runs on a CPU.
"""

from __future__ import annotations

import importlib
from types import SimpleNamespace

import torch

from k3lab.decode_step import layers
from k3lab.decode_step.layers import EPS, FA, FA_AT, KVL, LAT, NE, QL, ROPE, SITU_BETA, Op


def load() -> SimpleNamespace:
    """The patched tree's entry points; ImportError without a real vLLM."""
    base = "vllm.models.kimi_k3.nvidia."
    llg = importlib.import_module(base + "low_latency_gemm_dispatch")
    fused = importlib.import_module(base + "low_latency_fused_dispatch")
    kda = importlib.import_module(base + "kda_projection")
    decode = importlib.import_module(base + "fused_decode")
    return SimpleNamespace(llg=llg, fused=fused, kda=kda, decode=decode)


def enable(pk: SimpleNamespace, weights: list[dict]) -> dict:
    """Turn the fused switch on and warm up every projection weight's planned kernels,
    as ``enable_kimi_k3_low_latency_gemm`` does for a model. Returns what was enabled."""
    holder = torch.nn.Module()  # the switch reads only its parameters' device
    holder.w = torch.nn.Parameter(next(iter(weights[0].values())), requires_grad=False)
    warmed = pk.fused.enable_kimi_k3_fused_decode(holder, torch.bfloat16)
    planned = sum(bool(pk.llg.request_low_latency_warmup(w)) for ws in weights[:1]
                  for w in ws.values() if w.dim() == 2)  # fmt: skip
    table = pk.llg.device_table()
    return {"fused_kernels_warmed": warmed, "weights_planned": planned,
            "gemm_table": getattr(table, "arch", None),
            "fused_table": getattr(pk.fused.device_table(), "arch", None)}  # fmt: skip


def _via(st: dict, name: str, taken: bool) -> None:
    st.setdefault("_via", {})[name] = "patched" if taken else "stock"  # shared by shallow copies


def _pointwise(pk, name: str, entry: str, inputs: tuple, wnames: tuple, dst: str, stock: dict, *extra) -> Op:
    """A small op whose patched line calls ``fused.<entry>(*inputs, *weights, *extra)``,
    else the stock op; an overlay without that entry counts as the stock path."""

    def run(st, w):
        fn = getattr(pk.fused, entry, None)
        out = None if fn is None else fn(*(st[i] for i in inputs), *(w[n] for n in wnames), *extra)
        _via(st, name, out is not None)
        if out is None:
            stock[name].run(st, w)
        else:
            st[dst] = out

    return Op(name, "", run, f"{entry}, else stock", covers=(name,))


def attn_res(pk, kn, which: str, stock: dict) -> Op:
    """``attn_res (pre-attn)`` / ``(post-attn)`` as patch 0010's line runs it:
    ``fused.try_attn_res`` with v0.28.0's arguments (the replay's NB, no block write),
    else the stock op; an overlay without that entry counts as the stock path."""
    name = f"attn_res ({which}-attn)"
    pre = which == "pre"
    delta = "delta_in" if pre else "o_out"

    def run(st, w):
        fn = getattr(pk.fused, "try_attn_res", None)
        out = None
        if fn is not None:
            out = fn(st["prefix"], st[delta], st["blocks"], w["sa_res_norm" if pre else "mlp_res_norm"],
                     w["sa_res_proj" if pre else "mlp_res_proj"], w["in_norm" if pre else "post_norm"],
                     layers.NB, -1, EPS, EPS)  # fmt: skip
        _via(st, name, out is not None)
        if out is None:
            stock[name].run(st, w)
        else:
            st["hn" if pre else "hn2"] = out

    return Op(name, "", run, "try_attn_res (patch 0010), else stock", covers=(name,))


def _gemm(pk, st, name, x, w):
    """A linear layer of the patched model: its dispatch method, else the base method."""
    out = pk.llg.try_low_latency_gemm(x, w)
    _via(st, name, out is not None)
    return torch.mm(x, w.t()) if out is None else out


def _proj(pk, name: str, src: str, dst: str, wname: str) -> Op:
    def run(st, w):
        st[dst] = _gemm(pk, st, name, st[src], w[wname])

    return Op(name, "", run, "dispatch (try_low_latency_gemm), else cuBLAS", covers=(name,))


def _moe(pk, kn, src: str, stock: dict) -> list[Op]:
    def situ(st, w):
        out = pk.fused.try_act_mul(st["gu"], situ_beta=SITU_BETA)
        _via(st, "situ_and_mul", out is not None)
        if out is None:  # fused_decode.act_and_mul: the stock kernel gets packed rows
            gu = st["gu"] if st["gu"].is_contiguous() else st["gu"].contiguous()
            out = kn.stock.situ_and_mul(gu, SITU_BETA)
        st["act"] = out

    def up(st, w):
        fused = pk.fused.try_rmsnorm_gemm(st["lat_out"], w["lat_norm"], EPS, w["up"], add_to=st["shared"])
        _via(st, "routed_up", fused is not None)
        if fused is not None:
            st["moe_out"] = fused[0]
            return
        # The patched line's fallback: the norm, then residual.addmm_ (cuBLAS beta-add).
        stock["routed_expert_norm"].run(st, w)
        st["moe_out"] = st["shared"].addmm_(st["lat_n"], w["up"].t())

    def front(st, w):
        # Patch 0007 (fused_decode.moe_input_projections): the gate, routed_down and the
        # shared gate_up as one GEMM of the load-time stack; else the three stock lines.
        fn = getattr(pk.fused, "try_gate_gemm", None)
        fused = None if fn is None else fn(st[src], w["gate_down_sgu"], NE)
        _via(st, "router_gate", fused is not None)
        if fused is not None:
            st["logits"], rest = fused
            # vLLM's SITU kernel needs packed rows (fused_decode.act_and_mul copies for it).
            st["lat"], st["gu"] = rest[:, :LAT], rest[:, LAT:]
            return
        stock["router_gate"].run(st, w)
        st["lat"] = _gemm(pk, st, "routed_down", st[src], w["down"])
        st["gu"] = _gemm(pk, st, "shared_gate_up", st[src], w["sgu"])

    return [
        Op("router_gate+routed_down+shared_gate_up", "", front, "try_gate_gemm, else stock + dispatch",
           covers=("router_gate", "routed_down", "shared_gate_up")),
        Op("situ_and_mul", "", situ, "try_act_mul, else stock", covers=("situ_and_mul",)),
        _proj(pk, "shared_down", "act", "shared", "sdown"),
        Op("routed_expert_norm+routed_up+shared", "", up, "try_rmsnorm_gemm(add_to), else stock",
           covers=("routed_expert_norm", "routed_up+shared")),
    ]  # fmt: skip


def _mla(pk, kn, src: str, stock: dict) -> list[Op]:
    def q_kv(st, w):
        # fused_decode.mla_q_and_kv_c: q_b_proj with q_a_layernorm in its prologue, then
        # kv_a_layernorm on our norm (else vLLM's RMSNorm: the stock norm kernel); None
        # from the first keeps v0.28.0's lines.
        q_c, kv_c = st["qkv"][:, :QL], st["qkv"][:, QL : QL + KVL]
        fused_q = pk.fused.try_rmsnorm_gemm(q_c, w["q_a_norm"], EPS, w["q_b"])
        _via(st, "q_b_proj", fused_q is not None)
        if fused_q is None:
            stock["fused_q_kv_rmsnorm"].run(st, w)
            st["q"] = _gemm(pk, st, "q_b_proj(dispatch)", st["q_c"], w["q_b"])
            return
        fused_kv = pk.fused.try_rms_norm(kv_c, w["kv_a_norm"], EPS)
        _via(st, "kv_a_layernorm", fused_kv is not None)
        kv_n = kn.norm.rms_norm(kv_c, w["kv_a_norm"], EPS, pdl=False) if fused_kv is None else fused_kv[0]
        st["q"], st["kv_n"] = fused_q[0], kv_n

    return [
        _proj(pk, "fused_qkv_a_proj", src, "qkv", "qkv_a"),
        Op("fused_q_kv_rmsnorm+q_b_proj", "", q_kv, "try_rmsnorm_gemm + try_rms_norm, else stock",
           covers=("fused_q_kv_rmsnorm", "q_b_proj")),
        _proj(pk, "g_proj", src, "gate_o", "g"),
        _pointwise(pk, "gate_sigmoid_mul", "try_sigmoid_mul", ("attn_out", "gate_o"), (), "a_gated", stock),
        _proj(pk, "o_proj", "a_gated", "o_out", "o"),
    ]  # fmt: skip


def mla_front(pk, src: str) -> Op:
    """Patch 0013's line (``fused_decode.mla_front``) where the tree runs path ``mla_front``:
    ``fused_qkv_a_proj`` and ``g_proj`` as one GEMM of the load-time stack (``qkv_a_g``), its
    output split into ``qkv`` and ``gate_o`` (row stride 3648); else the two projections
    through the dispatch, in place."""

    def run(st, w):
        out = pk.llg.try_low_latency_gemm(st[src], w["qkv_a_g"])
        _via(st, "fused_qkv_a_proj+g_proj", out is not None)
        if out is None:
            st["qkv"] = _gemm(pk, st, "fused_qkv_a_proj", st[src], w["qkv_a"])
            st["gate_o"] = _gemm(pk, st, "g_proj", st[src], w["g"])
            return
        st["qkv"], st["gate_o"] = out[:, : QL + KVL + ROPE], out[:, QL + KVL + ROPE :]

    return Op("fused_qkv_a_proj+g_proj", "", run, "mla_front: the stack through the dispatch "
              "(patch 0013), else the two", covers=("fused_qkv_a_proj", "g_proj"))  # fmt: skip


def _norm(pk, kn, name: str, src: str, dst: str, wname: str, residual: str | None, new_res: str | None,
          stock: dict) -> Op:  # fmt: skip
    def run(st, w):
        fused = pk.fused.try_rms_norm(st[src], w[wname], EPS, st[residual] if residual else None)
        _via(st, name, fused is not None)
        if fused is None:
            stock[name].run(st, w)
            return
        st[dst] = fused[0]
        if new_res:
            st[new_res] = fused[1]

    return Op(name, "", run, "try_rms_norm, else stock", covers=(name,))


def _embed_tokens(pk, stock: dict) -> Op:
    """Patch 0011's lookup (``fused_decode.embed_tokens``): this rank's rows in one launch
    (``try_embed_rows``; the all-reduce after it left out, as stock's), else stock's three
    kernels; a tree without the entry: stock."""

    def run(st, w):
        try_rows = getattr(pk.fused, "try_embed_rows", None)
        ids = layers.embed_ids(st, w)
        rows = None if try_rows is None else try_rows(ids, st["embed_table"], 0, layers.V_LOCAL)
        _via(st, "embed_tokens", rows is not None)
        if rows is None:
            stock["embed_tokens"].run(st, w)
        else:
            st["embeds"] = rows

    return Op("embed_tokens", "", run, "try_embed_rows (0011), else stock", covers=("embed_tokens",))


def mtp_ops(pk, kn) -> list[Op]:
    stock = {op.name: op for op in layers.mtp_ops(kn)[0]}

    return [
        _embed_tokens(pk, stock),
        _pointwise(
            pk,
            "fused_mtp_input",
            "try_mtp_input",
            ("positions", "embeds", "prev"),
            ("enorm", "hnorm"),
            "cat",
            stock,
            EPS,
        ),
        _proj(pk, "eh_proj", "cat", "h0", "eh"),
        _norm(pk, kn, "input_layernorm", "h0", "hn", "in_norm", None, None, stock),
        *_mla(pk, kn, "hn", stock),
        _norm(pk, kn, "post_attention_layernorm", "o_out", "hn2", "post_norm", "h0", "r1", stock),
        *_moe(pk, kn, "hn2", stock),
        _norm(pk, kn, "shared_head.norm", "moe_out", "logits_h", "head_norm", "r1", "r2", stock),
    ]


def kda_ops(pk, kn) -> list[Op]:
    stock = {op.name: op for op in layers.kda_ops(kn)[0]}
    streams = {}  # made at the first run: the layer's aux stream and its fork/join events

    def proj(st, w):
        if not streams:
            # the model's set in this process (the mode's environment): empty with the flag on
            streams["tokens"] = pk.kda.deployment_overlap_tokens(pk.llg._device_capability()).tokens
            if streams["tokens"]:  # as autotune_kda_qkvg: the three GEMMs' kernels before capture
                pk.kda.request_overlap_warmup(w["in_proj"], w["f_b"])
            streams["aux"] = pk.kda.high_priority_aux_stream(st["hn"].device)
            streams["events"] = (torch.cuda.Event(), torch.cuda.Event())
        m = st["hn"].shape[0]
        two = pk.kda.use_kda_projection_overlap(m, streams["tokens"])
        if two:
            # The patched KDA layer reads qkvg and g1 (beta is a view it reads later).
            qkvg, st["g1"], _beta = pk.kda.run_kda_projection_overlap(
                st["hn"], w["in_proj"], w["f_b"], streams["aux"], streams["events"]
            )
            st["proj"] = qkvg
            return
        st["proj"] = _gemm(pk, st, "in_proj(dispatch)", st["hn"], w["in_proj"])
        st["g1"] = _gemm(pk, st, "f_b_proj(dispatch)", st["proj"][:, FA_AT : FA_AT + FA], w["f_b"])

    return [
        attn_res(pk, kn, "pre", stock),
        Op(
            "in_proj_qkvgfab+f_b_proj",
            "",
            proj,
            "two-stream overlap (patch 0003), else dispatch",
            covers=("in_proj_qkvgfab", "f_b_proj"),
        ),
        _proj(pk, "o_proj", "core_out", "o_out", "o"),
        attn_res(pk, kn, "post", stock),
        *_moe(pk, kn, "hn2", stock),
    ]


def mla_ops(pk, kn) -> list[Op]:
    stock = {op.name: op for op in layers.mla_ops(kn)[0]}
    return [
        attn_res(pk, kn, "pre", stock),
        *_mla(pk, kn, "hn", stock),
        attn_res(pk, kn, "post", stock),
        *_moe(pk, kn, "hn2", stock),
    ]


LAYERS = {"mtp": mtp_ops, "kda": kda_ops, "mla": mla_ops}
