# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-k3-overlay project
"""SM90 (H200) table data of the fused decode ops of Kimi-K3: data only.

``FUSED_SM90[op][shape] = (backend, config tuple or None, token counts)``: the backend
(its name as its module in ``gemm_backends/`` spells it) that runs ``op`` for a local
``shape`` at each listed M; or a tuple of such entries, for a shape that one backend serves
at some M and another at others (no M in two). GEMM-kind ops (``rmsnorm_gemm``, ``add_rmsnorm_gemm``,
``gate_gemm``) are keyed by the weight's ``(N, K)`` (``gate_gemm``: the stacked
weight's); row ops (``rmsnorm``, ``act_mul``, ``sigmoid_mul``, ``mtp_input``,
``attn_res``, ``embed_rows``) by ``(width,)``.
An (op, shape, M) without an entry keeps the model's stock path. Read by
``low_latency_fused_dispatch``, which checks every entry at import.

Source of every row: :data:`PROVENANCE`, and the row's own line below.

:data:`MEASURED_MODES`: the deployment modes (MoE branch, capture mode) in which each
model-level path of ours was measured, and so may run.
"""

from __future__ import annotations

DECODE = tuple(range(1, 17))

PROVENANCE = {
    "gpu": "NVIDIA H200",
    "date": "2026-12-02",
    "source": "run decode_step 2026-12-02 (python -m k3lab.decode_step.replay, code of commit "
    "97f2bf9): results/decode_step/decode_step_2026-12-02.json; prologue configs from "
    "python -m k3lab.decode_step.prologue_bench: results/decode_step/"
    "prologue_sweep_2026-12-02.json (M = 16); both k3lab/decode_step/configs.json",
    "versions": "torch 2.11.0+cu130, Triton 3.6.0, CUDA 13.0, driver 580.159.04",
}

FUSED_SM90 = {
    "rmsnorm_gemm": {
        # routed_expert_norm -> routed_expert_up_proj (TP8): sweep 15.46 µs vs plain 14.17
        # at M = 16; in the replay's "ours" at every M 1..16.
        # At M = 1, 2 our GEMV with the norm in its prologue (gemv_rmsnorm), at the config
        # the plain GEMV won at alone (gemv_pdl_sweep_sm90.json: 13.46 / 14.51 µs). In the
        # replay of the breakable H200 mode (h200-piecewise; H200, 2026-12-04, one lease,
        # code of commit d73e6fd): routed_expert_norm + routed_up + shared add at M = 1
        # 15.0-15.3 µs against 15.8-15.9 with swap_ab_rmsnorm
        # (decode_step_h200-piecewise_2026-12-04_gemv_norm.json against _gemv_nonorm.json,
        # the latter in git history: git show 26687a0:results/decode_step/...). This row
        # serves moe_tail, which runs under a breakable capture only (MEASURED_MODES).
        (7168, 3584): (("gemv_rmsnorm", (64, 4, 7), (1, 2)),
                       ("swap_ab_rmsnorm", (64, 256, 1, 4, 4, 55), DECODE[2:])),
        # q_a_layernorm -> q_b_proj (TP8): sweep 6.46 µs vs plain 5.01 at M = 16; in the
        # replay's "ours" at every M 1..16. At M = 1..4 gemv_rmsnorm, at the configs the
        # plain GEMV won at alone (2.55-4.01 µs against swap-AB's 4.23-4.30); in the same
        # replays, fused_q_kv_rmsnorm + q_b_proj at M = 1 4.05-4.28 µs against 7.08-7.17.
        (2304, 1536): (("gemv_rmsnorm", (64, 2, 3), (1, 4)), ("gemv_rmsnorm", (64, 4, 3), (2, 3)),
                       ("swap_ab_rmsnorm", (64, 256, 2, 4, 3), DECODE[4:])),
    },
    "add_rmsnorm_gemm": {
        # 3584x7168 (routed_expert_down_proj's shape): sweep 17.71 µs vs plain 15.66 at
        # M = 16 only; not in the replay.
        (3584, 7168): ("swap_ab_add_rmsnorm", (64, 256, 2, 4, 4, 55), (16,)),
    },
    "rmsnorm": {
        # kv_a_layernorm (MLA): 1.4 µs in the replay's "ours", M = 1..16.
        (512,): ("pdl_rmsnorm", None, DECODE),
        # MTP input_layernorm / post_attention_layernorm / shared_head.norm: 2.2 µs each
        # against 2.9-3.6 stock, M = 1..16.
        (7168,): ("pdl_rmsnorm", None, DECODE),
    },
    "act_mul": {
        # shared experts' SITU-and-mul (TP8, D = 768): 1.4 µs vs 2.0 stock at M = 16.
        (768,): ("pdl_act_mul", None, DECODE),
    },
    "sigmoid_mul": {
        # MLA's output gate attn_out * sigmoid(g_proj out) (TP8, D = 1536): "gate_sigmoid_mul
        # (PDL)" 1.30 / 1.36 / 1.39 µs vs 1.62 / 1.67 / 1.69 stock at M = 1 / 8 / 16 (MLA
        # layer; MTP block 1.28-1.37 vs 1.65-1.93); in the replay's "ours" at every M 1..16.
        (1536,): ("pdl_sigmoid_mul", None, DECODE),
    },
    "mtp_input": {
        # fused_mtp_input (H = 7168): "fused_mtp_input (PDL)" 2.33 / 2.42 / 2.44 µs vs
        # v0.28.0's kernel 2.40 / 2.45 / 2.72 at M = 1 / 8 / 16; in the replay's "ours" at
        # every M 1..16.
        (7168,): ("pdl_mtp_input", None, DECODE),
    },
    "embed_rows": {
        # the MTP draft step's token embedding at TP8 (H = 7168, a 20480-row shard, patch
        # 0011): "embed_tokens" 1.99 / 2.06 / 2.12 µs against v0.28.0's compiled shard mask,
        # gather and masked_fill_ 5.81 / 7.86 / 10.36 at M = 2 / 8 / 16 (replay of h200-mtp,
        # H200, 2026-12-04, code of commit 77d12ba:
        # results/decode_step/decode_step_h200-mtp_2026-12-04_embed_rows.json).
        (7168,): ("pdl_embed_rows", None, DECODE),
    },
    "gate_gemm": {
        # router gate 384 + routed_expert_down_proj 3584 + shared gate_up 1536 rows (TP8)
        # as one weight, fp32 logits: 20.9-21.1 µs at M = 1, 8, 16 against 25.1-25.3 for
        # the gate (5.6-5.8) and the 5120-row stack (19.3-19.7) back to back (roof 18.76;
        # H200, 2026-12-02, python -m k3lab.decode_step.gate_stack_bench, code of commit
        # ffbec85: results/decode_step/gate_stack_bench_2026-12-02.json); in the replay's
        # "ours" of the KDA layer at every M 1..16, 21.2 µs per op at M = 16
        # (decode_step_2026-12-02_kda_gate_stack.json).
        (5504, 7168): ("swap_ab_gate", (64, 128, 1, 4, 6, 42), DECODE),
    },
    "attn_res": {
        # the decoder layers' attn-res mix (H = 7168; pre- and post-attention, patch 0010),
        # 8 earlier blocks: ours over a cluster of 8 CTAs (attn_res_cluster.py, CuTe DSL, the
        # row-wide sums pushed through DSMEM) 3.03-3.55 us at M = 1..15 and 4.21 at M = 16,
        # against v0.28.0's kernel 7.72-8.35 and our one-CTA-a-row tile kernel 5.76-6.10 in
        # the same run; clusters of 4: 3.37-3.82 (faster at M = 16 only), of 2: 4.61-4.88
        # (H200, 2026-12-04, python -m k3lab.decode_step.attn_res_bench --kinds ours,cluster
        # --apply-best, code of commit a3ad5dd: results/decode_step/attn_res_bench_2026-12-04_cluster.json).
        # In the replay of the breakable H200 mode (h200-piecewise), same lease:
        # decode_step_h200-piecewise_2026-12-04_cluster.json against _tile.json; in the
        # default mode's full graph, 3.0 µs a call at M = 1
        # (decode_step_h200-default_2026-12-04_upproj.json). Where the cluster build cannot
        # run, the tile kernel does (8, 0, True).
        (7168,): ("pdl_attn_res", ("cluster", 8), DECODE),
    },
}

# Where each of our model-level paths was measured on the H200, as the deployment mode
# it ran in: (the MoE branch: "mega_moe" or "fused_moe", the capture of the call:
# "breakable", a BreakableCUDAGraphCapture active, vLLM keeping its own forks on one
# stream (a decode batch only under cudagraph_mode=PIECEWISE: replay mode h200-piecewise),
# or "full", none active, vLLM's aux-stream forks on: a decode batch's one CUDA graph,
# v0.28.0's default with either value of VLLM_USE_BREAKABLE_CUDAGRAPH, replay modes
# h200-default and h200-nobreak). A path runs only in a mode listed here
# (low_latency_fused_dispatch.path_enabled); anywhere else the model keeps v0.28.0's
# lines and says so once in the log.
MEASURED_MODES = {
    # KimiMoE's router gate + routed_expert_down_proj + shared gate_up as one GEMM
    # (op gate_gemm, patches 0007 and 0008).
    "moe_front": {
        # the decode-step replay of 2026-12-02 ran the MegaMoE structure in one unbroken graph
        ("mega_moe", "full"): "run decode_step 2026-12-02: decode_step_2026-12-02_kda_gate_stack.json",
        # one stream (breakable capture): stock runs the gate, then routed_down, back to back
        # on the current stream, which is what gate_stack_bench timed the stacked GEMM
        # against: 20.9-21.1 us vs 25.1-25.3 (M = 1, 8, 16). On the FusedMoE branch the
        # shared gate_up leaves the runner's aux stream, where it ran beside the routed
        # experts, for the stacked GEMM on the main stream: timed in the replay of the
        # breakable H200 mode (h200-piecewise) with a routed experts' stand-in (sizes assumed, a long arm)
        # beside that fork, with and without moe_front and moe_tail in one lease (H200,
        # 2026-12-04): KDA 180.8 vs 188.2 us at M = 1, 187.6 vs 193.8 at M = 16; MLA 182.6
        # vs 189.0, 192.6 vs 198.3 (decode_step_h200-piecewise_2026-12-04_routed.json against
        # _routed_nomoe.json); without an arm they win more (results/decode_step/README.md).
        ("mega_moe", "breakable"): "gate_stack_bench_2026-12-02.json (back to back)",
        ("fused_moe", "breakable"): "decode_step_h200-piecewise_2026-12-04_routed{,_nomoe}.json",
    },
    # MLA's fused_qkv_a_proj + g_proj as one GEMM of one stacked weight (patch 0013, path
    # mla_front, branch "mla"): listed nowhere, so nothing is stacked. In the replay of the
    # full graph (H200, 2026-12-05, the table's 3648x7168 row of the same lease) the MLA
    # layer gains 0.6-1.6 us at M = 4..16 but not at M = 1, 2 (74.2 vs 73.1 us at M = 1 in
    # h200-default): stock forks g_proj beside the front end, which hides it at small M
    # (results/decode_step/decode_step_h200-{default,nobreak}_2026-12-05_mla_front{,_off}.json).
    # LatentMoERunner's small-M tail at TP > 1: all-reduce of the latent, of the shared
    # output, then one GEMM: latent norm in the prologue, up_proj, shared output added in
    # the epilogue (op rmsnorm_gemm, patch 0009). Under breakable capture stock runs the
    # up_proj GEMM, the shared all-reduce and the add on one stream; the GEMM row
    # (7168, 3584) is the one measured for 0005's routed_output (15.46 us vs plain 14.17 at
    # M = 16; plain swap-AB 1.31-1.34x cuBLAS). With aux streams ("full") stock hides the
    # shared all-reduce behind its GEMM, which this path cannot: not measured, off.
    "moe_tail": {
        # with moe_front in the same replays (above)
        ("fused_moe", "breakable"): "decode_step_h200-piecewise_2026-12-04_routed{,_nomoe}.json; "
        "prologue_sweep_2026-12-02.json; decode_gemm_sm90.json (7168, 3584)",
    },
}
