"""The dense path of three Kimi-K3 decode layers, op by op, stock and ours (TP8 local shapes).

A layer is a list of :class:`Op` per variant. Each op reads and writes named tensors
of a state dict and reads one copy of the layer's weights, so the replay can run it
over rotated weight copies and capture it in a CUDA graph. ``covers`` names the stock
ops an op of ours replaces (its roof is theirs); ``nbytes(M)`` of a stock op is the
fewest bytes it must move: its weights, the activations it reads and writes.

Shapes (TP8, hidden 7168; bf16 unless said): MLA ``fused_qkv_a`` 2112x7168 (q_c 1536,
kv_c 512, k_pe 64), ``q_b`` 2304x1536, ``g_proj`` 1536x7168, ``o_proj`` 7168x1536; KDA
``in_proj_qkvgfab`` 6288x7168 (qkv 4608, g 1536, f_a 128, beta 12, pad 4), ``f_b``
1536x128, ``o_proj`` 7168x1536; MoE router ``gate`` 384x7168 (fp32 logits; 384 experts
is our assumption, v0.28.0 reads it from the checkpoint's config), latent
``routed_expert_down_proj`` 3584x7168, ``routed_expert_norm`` 3584,
``routed_expert_up_proj`` 7168x3584, shared experts ``gate_up`` 1536x7168 / ``down``
7168x768 (SITU, beta 1.0); MTP ``eh_proj`` 7168x14336, its token embedding a gather of M rows
of a 20480x7168 vocab shard. The KDA and MLA layers take the
attn-res path with 8 earlier blocks (a mid-depth, non-block-write layer); the MTP
block has none (v0.28.0 clears ``attn_res_block_size`` for it).
"""

from __future__ import annotations

from typing import Callable, NamedTuple

import torch

H, QL, KVL, ROPE, QB, HV = 7168, 1536, 512, 64, 2304, 1536
KDA_IN, KDA_P, FA, FA_AT = 6288, 1536, 128, 6144
NE, LAT, SI, NB, EPS, SITU_BETA = 384, 3584, 768, 8, 1e-6, 1.0
TOPK = 8  # routed experts per token
# One rank's rows of the vocab-parallel embedding at TP8: 163840 / 8, the lm_head shard
# that v0.28.0's SM103 GEMM table lists (N = 20480, K = 7168 in nvidia/low_latency_gemm.py).
TP, V_LOCAL = 8, 20480

# The routed experts' stand-in (replay --routed-experts standin): the top-k experts of one
# token, TP8 shards as the model check builds them (w13 2 x 768 x 3584, w2 3584 x 768).
ROUTED_W = {"rexp13": (TOPK, 2 * SI, LAT), "rexp2": (TOPK, LAT, SI)}

# (name, shape or None for [K] vectors) of every layer's weights
MOE_W = {"gate": (NE, H), "down": (LAT, H), "lat_norm": (LAT,), "up": (H, LAT),
         "sgu": (2 * SI, H), "sdown": (H, SI)}  # fmt: skip
MLA_W = {"qkv_a": (QL + KVL + ROPE, H), "q_a_norm": (QL,), "kv_a_norm": (KVL,), "q_b": (QB, QL),
         "g": (HV, H), "o": (H, HV)}  # fmt: skip
RES_W = {"sa_res_norm": (H,), "sa_res_proj": (H,), "in_norm": (H,), "mlp_res_norm": (H,),
         "mlp_res_proj": (H,), "post_norm": (H,)}  # fmt: skip
KDA_W = {"in_proj": (KDA_IN, H), "f_b": (KDA_P, FA), "o": (H, KDA_P)}
MTP_W = {"enorm": (H,), "hnorm": (H,), "eh": (H, 2 * H), "in_norm": (H,), "post_norm": (H,),
         "head_norm": (H,)}  # fmt: skip
WEIGHTS = {"mtp": {**MTP_W, **MLA_W, **MOE_W}, "kda": {**RES_W, **KDA_W, **MOE_W},
           "mla": {**RES_W, **MLA_W, **MOE_W}}  # fmt: skip

# ours: concatenated weights (name -> the projections whose rows it stacks)
CONCAT = {"qkv_a_g": ("qkv_a", "g"), "gate_down_sgu": ("gate", "down", "sgu")}

class Op(NamedTuple):
    name: str
    where: str  # file:line in vLLM v0.28.0 (vllm/models/kimi_k3/...)
    run: Callable[[dict, dict], None]  # (state, weights) -> None, writes into state
    runs: str  # what runs, in words (stock: the kernel or its stand-in)
    nbytes: Callable[[int], int] | None = None  # stock ops: fewest HBM bytes at M tokens
    covers: tuple[str, ...] = ()  # ours: the stock ops it replaces


def _gemm_bytes(n, k, out=2):
    return lambda m: 2 * n * k + 2 * m * k + out * m * n


def _norm_bytes(k, add=False):
    return lambda m: 2 * k + (8 if add else 4) * m * k


def _attn_res_bytes(m):  # prefix in/out, delta, NB blocks, 3 weights, output
    return 2 * m * H * (4 + NB) + 6 * H


class Kernels(NamedTuple):
    """The modules the ops call: ours (overlay) and v0.28.0's Triton ops."""

    sab: object  # swap_ab_gemm
    fg: object  # fused_gemm
    norm: object  # norm
    pw: object  # pointwise
    attn_res: object  # v0.28.0 ops/attn_res.py
    qk_norm: object  # v0.28.0 common/ops/fused_qk_rmsnorm.py
    mtp_input: object  # v0.28.0 common/mtp.py
    stock: object  # k3lab.decode_step.stock
    cfg: Callable[..., object]  # (N, K[, fused]) -> SwapAbConfig
    # ours' attn-res when not v0.28.0's: (prefix, delta, blocks, norm_w, qk_w, out_norm_w,
    # num_blocks, eps, out_eps) -> out (replay.py --attn-res)
    attn_res_ours: Callable[..., object] | None = None
    attn_res_ours_name: str = "v0.28.0's"
    # v0.28.0's router gate on SM90 at M <= 16: GateLinear's tier 1, CuTe DSL ll_bf16_gemm
    # (x, weight) -> fp32 logits (mode_ops.py; None where vLLM's tree is not importable)
    gate_ll_bf16: Callable[..., object] | None = None


def _moe_stock(kn, src: str) -> list[Op]:
    """KimiMoE.forward's dense ops (model.py:789-815, MegaMoE branch order), input ``st[src]``."""
    s = kn.stock

    def gate(st, w):
        st["logits"] = s.mm_fp32(st[src], w["gate"])

    def down(st, w):
        st["lat"] = torch.mm(st[src], w["down"].t())

    def sgu(st, w):
        st["gu"] = torch.mm(st[src], w["sgu"].t())

    def situ(st, w):
        st["act"] = s.situ_and_mul(st["gu"], SITU_BETA)

    def sdown(st, w):
        st["shared"] = torch.mm(st["act"], w["sdown"].t())

    def lat_norm(st, w):
        st["lat_n"] = kn.norm.rms_norm(st["lat_out"], w["lat_norm"], EPS, pdl=False)

    def up(st, w):
        st["moe_out"] = st["shared"].addmm_(st["lat_n"], w["up"].t())

    return [
        Op("router_gate", "nvidia/model.py:756", gate,
           "cuBLAS bf16 x bf16 -> fp32 (base list; a mode's list runs GateLinear tier 1, mode_ops.py)",
           _gemm_bytes(NE, H, 4)),
        Op("routed_down", "nvidia/model.py:779", down, "cuBLAS (its stream: the mode's, mode_ops.py)",
           _gemm_bytes(LAT, H)),
        Op("shared_gate_up", "nvidia/model.py:279", sgu, "cuBLAS", _gemm_bytes(2 * SI, H)),
        Op("situ_and_mul", "nvidia/model.py:280", situ, "stand-in for _C situ_and_mul (Triton, no PDL)",
           lambda m: 6 * m * SI),
        Op("shared_down", "nvidia/model.py:289", sdown, "cuBLAS", _gemm_bytes(H, SI)),
        Op("routed_expert_norm", "nvidia/model.py:319", lat_norm, "stand-in for _C rms_norm (no PDL)",
           _norm_bytes(LAT)),
        Op("routed_up+shared", "nvidia/model.py:321", up,
           "cuBLAS addmm_ (MegaMoE's beta-add; base list: a mode's list runs the FusedMoE tail, mode_ops.py)",
           lambda m: _gemm_bytes(H, LAT)(m) + 2 * m * H),
    ]  # fmt: skip


def routed_standin() -> Op:
    """The routed experts of the FusedMoE branch, a stand-in: TOPK experts (w13, then w2 on
    half its output) as 16 cuBLAS GEMMs on ``st["lat"]``, the result kept apart
    (``st["routed_standin"]``: the replay's ``lat_out`` stays the fixed tensor both variants
    share). What it is for: v0.28.0 runs the runner's shared experts on an aux stream beside
    the routed experts, and without an arm there the fork's time sits on the critical path.
    Its size is the harness's assumption, not v0.28.0's: the tree fixes only the latent
    (3584); 8 experts a token, 768 intermediate a rank and bf16 weights are the model check's
    choices, while v0.28.0's tests hint at 384 a rank and 4-bit (MXFP4) routed experts, which
    SM90 would run on Marlin. Measured at ~100 µs with the fork (H200, 2026-12-04), it is an
    upper bracket of the routed experts' time at small M (a real fused launch reads 4-66 MB
    there), and it reads the same 8 experts at every M where fused_moe reads up to 8 M."""

    def run(st, w):
        for e in range(TOPK):
            h = torch.mm(st["lat"], w["rexp13"][e].t())
            st["routed_standin"] = torch.mm(h[:, :SI], w["rexp2"][e].t())

    return Op("routed experts (stand-in)", "model_executor/layers/fused_moe (fused_moe, Triton)", run,
              "stand-in: 8 experts' w13 and w2 as 16 cuBLAS GEMMs (sizes assumed; see layers.routed_standin)",
              lambda m: TOPK * (_gemm_bytes(2 * SI, LAT)(m) + _gemm_bytes(LAT, SI)(m)))


def _moe_ours(kn, src: str, residual: str | None) -> list[Op]:
    """Ours, input ``st[src]`` (already normalized): the router gate, ``routed_down`` and the
    shared ``gate_up`` as one stacked weight in one launch (fp32 logits, bf16 rest), our
    PDL-aware SITU-and-mul, the latent norm in ``routed_up``'s prologue; ``residual`` is added
    in ``shared_down``'s epilogue."""
    fg, sab, c = kn.fg, kn.sab, kn.cfg

    def gate_down_sgu(st, w):
        st["logits"], st["dsg"] = fg.gemm_split_dtype(st[src], w["gate_down_sgu"], NE,
                                                      c(NE + LAT + 2 * SI, H))  # fmt: skip
        st["lat"], st["gu"] = st["dsg"][:, :LAT], st["dsg"][:, LAT:]

    def situ(st, w):
        st["act"] = kn.pw.act_mul(st["gu"], situ_beta=SITU_BETA)

    def sdown(st, w):
        st["shared"] = sab.swap_ab_gemm(st["act"], w["sdown"], c(H, SI), st[residual] if residual else None)

    def up(st, w):
        st["moe_out"] = fg.rmsnorm_gemm(st["lat_out"], w["lat_norm"], EPS, w["up"], c(H, LAT, True),
                                        residual=st["shared"])  # fmt: skip

    return [
        Op("router_gate+routed_down+shared_gate_up", "", gate_down_sgu,
           "ours (one stacked weight; fp32 logits, bf16 rest)",
           covers=("router_gate", "routed_down", "shared_gate_up")),
        Op("situ_and_mul (PDL)", "", situ, "ours", covers=("situ_and_mul",)),
        Op("shared_down" + ("+residual" if residual else ""), "", sdown, "ours", covers=("shared_down",)),
        Op("routed_up+norm+shared", "", up, "ours", covers=("routed_expert_norm", "routed_up+shared")),
    ]


def _attn_res(kn, which: str, delta: str, ours: bool = False) -> Callable[[dict, dict], None]:
    pre = which == "pre"
    mine = kn.attn_res_ours if ours else None

    def run(st, w):
        args = (st["prefix"], st[delta], st["blocks"],
                w["sa_res_norm" if pre else "mlp_res_norm"], w["sa_res_proj" if pre else "mlp_res_proj"],
                w["in_norm" if pre else "post_norm"])  # fmt: skip
        if mine is not None:
            st["hn" if pre else "hn2"] = mine(*args, NB, EPS, EPS)
            return
        st["hn" if pre else "hn2"] = kn.attn_res.attn_res(
            *args, num_blocks=NB, block_write_idx=-1, eps=EPS, output_norm_eps=EPS)  # fmt: skip

    return run


def _mla_front_stock(kn, src: str) -> list[Op]:
    def qkv_a(st, w):
        st["qkv"] = torch.mm(st[src], w["qkv_a"].t())

    def qk_norm(st, w):
        st["q_c"], st["kv_n"] = kn.qk_norm.fused_q_kv_rmsnorm(
            st["qkv"][:, :QL], st["qkv"][:, QL:QL + KVL], w["q_a_norm"], w["kv_a_norm"], EPS)

    def q_b(st, w):
        st["q"] = torch.mm(st["q_c"], w["q_b"].t())

    def g(st, w):
        st["gate_o"] = torch.mm(st[src], w["g"].t())

    return [
        Op("fused_qkv_a_proj", "nvidia/mla.py:495", qkv_a, "cuBLAS", _gemm_bytes(QL + KVL + ROPE, H)),
        Op("fused_q_kv_rmsnorm", "nvidia/mla.py:499", qk_norm, "v0.28.0 Triton (PDL: wait, then trigger)",
           lambda m: 2 * (QL + KVL) + 4 * m * (QL + KVL)),
        Op("q_b_proj", "nvidia/mla.py:506", q_b, "cuBLAS", _gemm_bytes(QB, QL)),
        Op("g_proj", "nvidia/mla.py:545", g, "cuBLAS (its stream: the mode's, mode_ops.py)",
           _gemm_bytes(HV, H)),
    ]  # fmt: skip


def _mla_back_stock(kn) -> list[Op]:
    s = kn.stock

    def gsm(st, w):
        st["a_gated"] = s.sigmoid_mul(st["attn_out"], st["gate_o"])

    def o(st, w):
        st["o_out"] = torch.mm(st["a_gated"], w["o"].t())

    return [
        Op("gate_sigmoid_mul", "nvidia/mla.py:555", gsm, "stand-in for the torch.compile kernel (Triton)",
           lambda m: 6 * m * HV),
        Op("o_proj", "nvidia/mla.py:564", o, "cuBLAS", _gemm_bytes(H, HV)),
    ]  # fmt: skip


def _mla_ours(kn, src: str, residual: str | None) -> list[Op]:
    """Ours, input ``st[src]`` (already normalized); ``residual`` added in ``o_proj``'s epilogue."""
    fg, sab, c, nm = kn.fg, kn.sab, kn.cfg, kn.norm

    def qkv_a_g(st, w):
        st["qkvg"] = sab.swap_ab_gemm(st[src], w["qkv_a_g"], c(QL + KVL + ROPE + HV, H))
        st["qkv"], st["gate_o"] = st["qkvg"][:, :QL + KVL + ROPE], st["qkvg"][:, QL + KVL + ROPE:]

    def q_b(st, w):
        st["q"] = fg.rmsnorm_gemm(st["qkv"][:, :QL], w["q_a_norm"], EPS, w["q_b"], c(QB, QL, True))

    def kv_norm(st, w):
        st["kv_n"] = nm.rms_norm(st["qkv"][:, QL:QL + KVL], w["kv_a_norm"], EPS)

    def gsm(st, w):
        st["a_gated"] = kn.pw.sigmoid_mul(st["attn_out"], st["gate_o"])

    def o(st, w):
        st["o_out"] = sab.swap_ab_gemm(st["a_gated"], w["o"], c(H, HV), st[residual] if residual else None)

    return [
        Op("fused_qkv_a_proj+g_proj", "", qkv_a_g, "ours (one stacked weight)",
           covers=("fused_qkv_a_proj", "g_proj")),
        Op("q_b_proj+q_a_norm", "", q_b, "ours", covers=("q_b_proj",)),
        Op("kv_a_norm (PDL)", "", kv_norm, "ours", covers=("fused_q_kv_rmsnorm",)),
        Op("gate_sigmoid_mul (PDL)", "", gsm, "ours", covers=("gate_sigmoid_mul",)),
        Op("o_proj" + ("+residual" if residual else ""), "", o, "ours", covers=("o_proj",)),
    ]


def _shard_ids(ids: torch.Tensor, start: int, end: int) -> tuple[torch.Tensor, torch.Tensor]:
    # This rank's rows of the vocab-sharded table: an id outside [start, end) reads row 0
    # and its embedding is zeroed after the gather (the all-reduce then sums the ranks').
    inside = (ids >= start) & (ids < end)
    return (ids - start) * inside, ~inside


def embed_tokens_op() -> Op:
    """The draft step's token embedding (the MTP layer's own lookup, nvidia/mtp.py:184-185):
    the target's vocab-parallel table at TP8, rank 0's shard of ``V_LOCAL`` rows. v0.28.0
    runs the shard mask as one Inductor kernel (``torch.compile(dynamic=True)`` on its mask
    function), the gather, and ``masked_fill_``; its all-reduce is left out, as every
    collective. Each weight copy brings its own ids (``embed_ids``), so the rows come from
    HBM as in a real step. Patch 0011 runs it as one launch (``patched.mtp_ops``)."""
    mask = torch.compile(_shard_ids, dynamic=True)

    def run(st, w):
        ids, outside = mask(embed_ids(st, w), 0, V_LOCAL)
        rows = torch.nn.functional.embedding(ids, st["embed_table"])
        st["embeds"] = rows.masked_fill_(outside.unsqueeze(-1), 0)

    return Op("embed_tokens", "nvidia/mtp.py:185 (model_executor/layers/vocab_parallel_embedding.py:487-507)",
              run, "v0.28.0's torch ops: the compiled shard mask (Inductor), the gather, masked_fill_",
              lambda m: 2 * (2 * m * H) + 8 * m)  # fmt: skip


def embed_ids(st: dict, w: dict) -> torch.Tensor:
    """The step's token ids in weight copy ``w``: its first M (M from the step's positions)."""
    return w["embed_ids"][: st["positions"].shape[0]]


def mtp_ops(kn) -> tuple[list[Op], list[Op]]:
    """(a) MTP step: mtp.py:100-145 with the MTP block's KimiDecoderLayer (MLA + MoE), after
    the draft step's token embedding (:func:`embed_tokens_op`)."""
    embed = embed_tokens_op()

    def mtp_in(st, w):
        st["cat"] = kn.mtp_input.fused_mtp_input(st["positions"], st["embeds"], st["prev"],
                                                 w["enorm"], w["hnorm"], EPS)  # fmt: skip

    def eh(st, w):
        st["h0"] = torch.mm(st["cat"], w["eh"].t())

    def in_norm(st, w):
        st["hn"] = kn.norm.rms_norm(st["h0"], w["in_norm"], EPS, pdl=False)

    def post_norm(st, w):
        st["hn2"], st["r1"] = kn.norm.add_rms_norm(st["o_out"], st["h0"], w["post_norm"], EPS, pdl=False)

    def head_norm(st, w):
        st["logits_h"], st["r2"] = kn.norm.add_rms_norm(st["moe_out"], st["r1"], w["head_norm"], EPS,
                                                        pdl=False)  # fmt: skip

    stock = [
        embed,
        Op("fused_mtp_input", "common/mtp.py:62 (called nvidia/mtp.py:110)", mtp_in,
           "v0.28.0 Triton (no PDL)",
           lambda m: 4 * H + 8 * m * H),
        Op("eh_proj", "nvidia/mtp.py:109", eh, "cuBLAS", _gemm_bytes(H, 2 * H)),
        Op("input_layernorm", "nvidia/model.py:999", in_norm, "stand-in for _C rms_norm (no PDL)",
           _norm_bytes(H)),
        *_mla_front_stock(kn, "hn"),
        *_mla_back_stock(kn),
        Op("post_attention_layernorm", "nvidia/model.py:1027", post_norm,
           "stand-in for _C fused_add_rms_norm (no PDL)", _norm_bytes(H, True)),
        *_moe_stock(kn, "hn2"),
        Op("shared_head.norm", "nvidia/mtp.py:141", head_norm, "stand-in for _C fused_add_rms_norm (no PDL)",
           _norm_bytes(H, True)),
    ]  # fmt: skip

    def mtp_in_o(st, w):
        st["cat"] = kn.pw.mtp_input(st["positions"], st["embeds"], st["prev"], w["enorm"], w["hnorm"], EPS)

    def eh_o(st, w):
        st["h0"] = kn.sab.swap_ab_gemm(st["cat"], w["eh"], kn.cfg(H, 2 * H))

    def in_norm_o(st, w):
        st["hn"] = kn.norm.rms_norm(st["h0"], w["in_norm"], EPS)

    def post_norm_o(st, w):
        st["hn2"] = kn.norm.rms_norm(st["o_out"], w["post_norm"], EPS)

    def head_o(st, w):
        st["logits_h"] = kn.norm.rms_norm(st["moe_out"], w["head_norm"], EPS)

    # The residual adds ride in GEMM epilogues: o_proj adds h0 (its output is the
    # post-attention residual r1), shared_down adds r1, so routed_up's output is the new
    # residual and both add-norms become plain PDL-aware norms.
    ours = [
        embed._replace(covers=("embed_tokens",)),  # the stock lookup: nothing of ours replaces it
        Op("fused_mtp_input (PDL)", "", mtp_in_o, "ours", covers=("fused_mtp_input",)),
        Op("eh_proj", "", eh_o, "ours", covers=("eh_proj",)),
        Op("input_layernorm (PDL)", "", in_norm_o, "ours", covers=("input_layernorm",)),
        *_mla_ours(kn, "hn", "h0"),
        Op("post_attention_layernorm (PDL)", "", post_norm_o, "ours", covers=("post_attention_layernorm",)),
        *_moe_ours(kn, "hn2", "o_out"),
        Op("shared_head.norm (PDL)", "", head_o, "ours", covers=("shared_head.norm",)),
    ]
    return stock, ours


def kda_ops(kn) -> tuple[list[Op], list[Op]]:
    """(b) KDA decoder layer: model.py:1053-1087 with KimiK3DeltaAttention (kda.py:489-530)."""

    def in_proj_s(st, w):
        st["proj"] = torch.mm(st["hn"], w["in_proj"].t())

    def f_b_s(st, w):
        st["g1"] = torch.mm(st["proj"][:, FA_AT:FA_AT + FA], w["f_b"].t())

    def o_s(st, w):
        st["o_out"] = torch.mm(st["core_out"], w["o"].t())

    stock = [
        Op("attn_res (pre-attn)", "nvidia/model.py:1006", _attn_res(kn, "pre", "delta_in"),
           "v0.28.0 Triton (PDL: wait first, trigger after the mix)", _attn_res_bytes),
        Op("in_proj_qkvgfab", "nvidia/kda.py:495", in_proj_s, "cuBLAS", _gemm_bytes(KDA_IN, H)),
        Op("f_b_proj", "nvidia/kda.py:507", f_b_s, "cuBLAS on the strided f_a view", _gemm_bytes(KDA_P, FA)),
        Op("o_proj", "nvidia/kda.py:530", o_s, "cuBLAS", _gemm_bytes(H, KDA_P)),
        Op("attn_res (post-attn)", "nvidia/model.py:1039", _attn_res(kn, "post", "o_out"),
           "v0.28.0 Triton (PDL: wait first, trigger after the mix)", _attn_res_bytes),
        *_moe_stock(kn, "hn2"),
    ]  # fmt: skip
    fg, sab, c = kn.fg, kn.sab, kn.cfg

    def in_proj_o(st, w):
        st["proj"] = sab.swap_ab_gemm(st["hn"], w["in_proj"], c(KDA_IN, H))

    def f_b_o(st, w):
        st["g1"] = fg.gemm(st["proj"][:, FA_AT:FA_AT + FA], w["f_b"], c(KDA_P, FA))

    def o_o(st, w):
        st["o_out"] = sab.swap_ab_gemm(st["core_out"], w["o"], c(H, KDA_P))

    ours = [
        Op("attn_res (pre-attn)", "", _attn_res(kn, "pre", "delta_in", True), kn.attn_res_ours_name,
           covers=("attn_res (pre-attn)",)),
        Op("in_proj_qkvgfab", "", in_proj_o, "ours", covers=("in_proj_qkvgfab",)),
        Op("f_b_proj", "", f_b_o, "ours", covers=("f_b_proj",)),
        Op("o_proj", "", o_o, "ours", covers=("o_proj",)),
        Op("attn_res (post-attn)", "", _attn_res(kn, "post", "o_out", True), kn.attn_res_ours_name,
           covers=("attn_res (post-attn)",)),
        *_moe_ours(kn, "hn2", None),
    ]  # fmt: skip
    return stock, ours


def mla_ops(kn) -> tuple[list[Op], list[Op]]:
    """(c) MLA decoder layer: model.py:1053-1087 with MultiHeadLatentAttention (mla.py:483-564)."""
    stock = [
        Op("attn_res (pre-attn)", "nvidia/model.py:1006", _attn_res(kn, "pre", "delta_in"),
           "v0.28.0 Triton (PDL: wait first, trigger after the mix)", _attn_res_bytes),
        *_mla_front_stock(kn, "hn"),
        *_mla_back_stock(kn),
        Op("attn_res (post-attn)", "nvidia/model.py:1039", _attn_res(kn, "post", "o_out"),
           "v0.28.0 Triton (PDL: wait first, trigger after the mix)", _attn_res_bytes),
        *_moe_stock(kn, "hn2"),
    ]  # fmt: skip
    ours = [
        Op("attn_res (pre-attn)", "", _attn_res(kn, "pre", "delta_in", True), kn.attn_res_ours_name,
           covers=("attn_res (pre-attn)",)),
        *_mla_ours(kn, "hn", None),
        Op("attn_res (post-attn)", "", _attn_res(kn, "post", "o_out", True), kn.attn_res_ours_name,
           covers=("attn_res (post-attn)",)),
        *_moe_ours(kn, "hn2", None),
    ]  # fmt: skip
    return stock, ours


LAYERS = {"mtp": mtp_ops, "kda": kda_ops, "mla": mla_ops}


def inputs(layer: str, m: int, device, gen: torch.Generator) -> dict:
    """The step's inputs and the stand-in outputs of the left-out cores (fresh random data)."""

    def rnd(*shape):
        return torch.randn(*shape, generator=gen, device=device).to(torch.bfloat16)

    st = {"lat_out": rnd(m, LAT)}  # routed experts' output (latent)
    if layer == "mtp":
        # one table for every copy (294 MB); each copy's ids pick its rows (weights' embed_ids)
        st.update(positions=torch.arange(1, m + 1, device=device), prev=rnd(m, H), attn_out=rnd(m, HV),
                  embed_table=rnd(V_LOCAL, H))  # fmt: skip
    else:
        st.update(prefix=rnd(m, H), delta_in=rnd(m, H), blocks=rnd(m, NB + 1, H))
        st["attn_out" if layer == "mla" else "core_out"] = rnd(m, HV if layer == "mla" else KDA_P)
    return st


def weights(layer: str, device, gen: torch.Generator, routed: bool = False) -> dict:
    """One copy of the layer's weights: projections ~ N(0, 1/K), norm weights ~ 1 + N(0, 0.1);
    with ``routed``, also the routed experts' stand-in weights (:data:`ROUTED_W`, 132 MB)."""
    out = {}
    for name, shape in {**WEIGHTS[layer], **(ROUTED_W if routed else {})}.items():
        if len(shape) == 1:
            out[name] = (1 + 0.1 * torch.randn(shape, generator=gen, device=device)).to(torch.bfloat16)
        else:
            w = torch.randn(shape, generator=gen, device=device) / shape[-1] ** 0.5
            out[name] = w.to(torch.bfloat16)
    # Ours reads the projections of one input as one weight (rows concatenated at load
    # time, as vLLM packs qkv): fewer launches, one weight stream instead of two.
    for cat, parts in CONCAT.items():
        if all(p in out for p in parts):
            out[cat] = torch.cat([out[p] for p in parts]).contiguous()
    if layer == "mtp":
        # the draft tokens of this copy (int32 ids over the whole vocabulary, as the V2 runner
        # keeps them, v1/worker/gpu/input_batch.py:28; at most 16 a step):
        # each copy gathers other rows of the shared table, cold from HBM as in a real step
        out["embed_ids"] = torch.randint(0, V_LOCAL * TP, (16,), generator=gen, device=device,
                                         dtype=torch.int32)  # fmt: skip
    return out
