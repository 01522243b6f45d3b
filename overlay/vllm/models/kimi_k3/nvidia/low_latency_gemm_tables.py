# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-k3-overlay project
"""Blackwell tables for low_latency_gemm: measured Kimi-K3 decode GEMM winners.

Pure data, same schema as ``low_latency_gemm_sm90.ROWS``:
``(N, K) -> {M: (backend, cfg)}`` with backend ``"cute"`` or ``"dsv3_fused_a"`` and,
for CuTe, ``cfg = (block_size, outputs_per_block, k_unroll, vector_width, static_k)``
(None for dsv3_fused_a). ``*_RESIDUAL_ROWS`` maps ``(N, K) -> {M: cfg}`` for the CuTe
kernel with the fused ``+ residual`` epilogue. A token count M absent from a row means
cuBLAS (the layer's normal path) won or was within the 5% noise threshold.

(N, K) is the *local* weight shape a rank sees, so a TP8 and a TP16 deployment hit
different rows. Labels in comments name the Kimi-K3 projections known to have that
shape; they are documentation only.

Sources (GPU, who measured, when) sit in ``*_PROVENANCE`` for a whole table and in
``*_ROW_PROVENANCE`` for rows that came from elsewhere. The tables are per GPU
architecture on purpose: winners differ between B300 and B200, so never merge them.
"""

# Every token count the decode kernels were measured for.
_ALL_M = range(1, 17)
_DSV3 = ("dsv3_fused_a", None)


def _dsv3_at(token_counts):
    """Rows where dsv3_fused_a won at each of ``token_counts``."""
    return {m: _DSV3 for m in token_counts}


# --------------------------------------------------------------------------- SM103
# SM103/B300 figures: vLLM v0.28.0 table (upstream KIMI_K3_PROJECTIONS, measured by
# vLLM authors on B300 over M=1..16, >=5% over cuBLAS to count as a win; release
# 2026-08-26). SM107 (Rubin) reuses this table until it has its own measurements.
SM103_PROVENANCE = {
    "gpu": "NVIDIA B300 (SM103)",
    "source": "vLLM v0.28.0 KIMI_K3_PROJECTIONS, measured by vLLM authors",
    "date": "2026-08-26",
}

# The MTP eh_proj row is newer than the rest of the SM103 table.
SM103_ROW_PROVENANCE = {
    (7168, 14336): {
        "gpu": "NVIDIA B300 (SM103)",
        "source": "vLLM v0.29.0 (PR #53942), measured by vLLM authors",
        "date": "2026-09-09",
    },
}

SM103_ROWS = {
    # TP8 shapes.
    (1536, 128): _dsv3_at(_ALL_M),  # f_b_proj
    (3072, 128): _dsv3_at(_ALL_M),  # f_b_proj
    # shared_gate_up_proj and mla_g_proj share this shape, hence one row for both.
    (1536, 7168): _dsv3_at(_ALL_M),
    (3072, 7168): {  # shared_gate_up_proj
        1: ("cute", (224, 3, 4, 8, None)),
        2: ("cute", (128, 3, 2, 8, None)),
        3: ("cute", (128, 2, 1, 8, None)),
        4: ("cute", (64, 2, 2, 8, None)),
        5: ("cute", (128, 3, 1, 8, None)),
    },
    (2112, 7168): _dsv3_at(_ALL_M),  # fused_qkv_a_proj
    (2304, 1536): _dsv3_at(_ALL_M),  # q_b_proj
    (4608, 1536): _dsv3_at(_ALL_M),  # q_b_proj
    (3584, 7168): {  # routed_expert_down_proj (replicated; same shape at TP16)
        1: ("cute", (224, 2, 4, 8, None)),
        **_dsv3_at(range(2, 9)),
    },
    (6288, 7168): {  # in_proj_qkvgfab
        1: ("cute", (224, 3, 4, 8, None)),
        2: ("cute", (64, 3, 2, 8, None)),
        3: ("cute", (32, 3, 4, 8, None)),
        4: ("cute", (128, 6, 1, 8, None)),
    },
    (12448, 7168): {  # in_proj_qkvgfab
        1: ("cute", (224, 4, 2, 8, None)),
        2: ("cute", (64, 4, 2, 8, None)),
        3: ("cute", (64, 2, 2, 8, None)),
    },
    (7168, 768): _dsv3_at(_ALL_M),  # shared_down_proj (also TP16 o_proj)
    (7168, 1536): {1: ("cute", (96, 4, 2, 8, None))},  # o_proj
    (7168, 3072): {  # o_proj
        1: ("cute", (96, 2, 4, 8, None)),
        2: ("cute", (32, 4, 4, 8, None)),
    },
    (7168, 3584): {  # routed_expert_up_proj (replicated)
        1: ("cute", (224, 4, 2, 8, None)),
        2: ("cute", (64, 4, 2, 8, None)),
    },
    (7168, 4224): {1: ("cute", (96, 4, 2, 4, None))},  # dense_down_proj
    (7168, 8448): {  # dense_down_proj
        1: ("cute", (32, 4, 4, 8, None)),
        2: ("cute", (96, 4, 1, 8, None)),
        3: ("cute", (96, 4, 1, 8, None)),
    },
    (8448, 7168): {  # dense_gate_up_proj
        1: ("cute", (224, 3, 4, 8, None)),
        2: ("cute", (32, 4, 4, 8, None)),
    },
    (16896, 7168): {  # dense_gate_up_proj
        1: ("cute", (224, 6, 4, 8, None)),
        2: ("cute", (32, 4, 4, 8, None)),
    },
    # MTP eh_proj (ReplicatedLinear after patch 0001). Source: SM103_ROW_PROVENANCE.
    # M1 compiles K=14336 into the kernel (static_k) and reads with 4-wide vectors.
    (7168, 14336): {
        1: ("cute", (256, 2, 1, 4, 14336)),
        2: ("cute", (224, 4, 2, 8, None)),
    },
    (20480, 7168): {  # lm_head
        1: ("cute", (224, 4, 2, 8, None)),
        2: ("cute", (64, 4, 2, 8, None)),
        3: ("cute", (64, 2, 2, 8, None)),
        4: ("cute", (64, 4, 1, 8, None)),
    },
    (40960, 7168): {  # lm_head
        1: ("cute", (128, 4, 2, 8, None)),
        2: ("cute", (64, 4, 2, 8, None)),
        3: ("cute", (64, 2, 2, 8, None)),
        4: ("cute", (64, 4, 1, 8, None)),
    },
    # TP16 shapes. Replicated projections keep their TP8 rows above.
    (3216, 7168): {  # in_proj_qkvgfab
        1: ("cute", (224, 3, 4, 8, None)),
        2: ("cute", (128, 4, 2, 8, None)),
        3: ("cute", (128, 2, 1, 8, None)),
        4: ("cute", (64, 2, 2, 8, None)),
        5: ("cute", (128, 3, 1, 8, None)),
        # M6..8 (dsv3 only 4% ahead) and M16 (cuBLAS picks a faster kernel there)
        # are measured gaps, not omissions.
        **_dsv3_at(range(9, 16)),
    },
    (768, 7168): {  # mla_g_proj / shared_gate_up_proj
        1: ("cute", (224, 2, 4, 8, None)),
        2: ("cute", (224, 2, 2, 8, None)),
        3: ("cute", (224, 2, 2, 8, None)),
        4: ("cute", (224, 2, 2, 8, None)),
        **_dsv3_at(range(5, 17)),
    },
    (1152, 1536): {  # q_b_proj
        1: ("cute", (192, 3, 4, 8, None)),
        **_dsv3_at(range(2, 17)),
    },
    (768, 128): _dsv3_at(_ALL_M),  # f_b_proj
    (7168, 384): _dsv3_at(range(1, 9)),  # shared_down_proj; dsv3 <5% ahead from M9
    (4224, 7168): {  # dense_gate_up_proj
        1: ("cute", (224, 3, 4, 8, None)),
        2: ("cute", (128, 2, 1, 8, None)),
        3: ("cute", (64, 2, 2, 8, None)),
        **_dsv3_at(range(4, 9)),
    },
    (10240, 7168): {  # lm_head
        1: ("cute", (224, 4, 2, 8, None)),
        2: ("cute", (32, 2, 4, 8, None)),
        3: ("cute", (64, 4, 1, 8, None)),
        4: ("cute", (64, 4, 1, 8, None)),
    },
    # No (7168, 2112) row (TP16 dense_down_proj): K=2112 fits no dsv3 tile_k and the
    # only CuTe vector width that divides it (2) measured slower than cuBLAS.
}

SM103_RESIDUAL_ROWS = {
    # routed_expert_up_proj with the latent-MoE residual add fused in.
    (7168, 3584): {
        1: (64, 4, 2, 8, None),
        2: (64, 7, 2, 8, None),
        3: (64, 2, 1, 8, None),
        4: (64, 2, 1, 8, None),
    },
}

# --------------------------------------------------------------------------- SM100
# SM100/B200 figures: vLLM v0.29.0 (2026-09-09), PR #53942, KIMI_K3_PROJECTIONS_SM100,
# measured by vLLM authors on B200 at TP8/TP16 shapes over M=1..16 with the same >=5%
# threshold; each (shape, M) keeps the better of the SM103 config and a fresh B200 one.
SM100_PROVENANCE = {
    "gpu": "NVIDIA B200 (SM100)",
    "source": (
        "vLLM v0.29.0 KIMI_K3_PROJECTIONS_SM100 (PR #53942), measured by vLLM authors"
    ),
    "date": "2026-09-09",
}

SM100_ROW_PROVENANCE = {}

SM100_ROWS = {
    (1536, 128): _dsv3_at((1, 16)),  # f_b_proj
    (3072, 128): _dsv3_at((8,)),  # f_b_proj
    (1536, 7168): {  # shared_gate_up_proj / mla_g_proj
        1: ("cute", (224, 3, 2, 8, None)),
        2: ("cute", (128, 2, 2, 8, None)),
        **_dsv3_at((4, 8)),
    },
    (3072, 7168): {  # shared_gate_up_proj
        1: ("cute", (224, 3, 4, 8, None)),
        2: ("cute", (128, 2, 1, 8, None)),
    },
    (2112, 7168): {  # fused_qkv_a_proj
        1: ("cute", (224, 3, 2, 8, None)),
        2: ("cute", (128, 2, 2, 8, None)),
        **_dsv3_at((4, 16)),
    },
    (2304, 1536): _dsv3_at(_ALL_M),  # q_b_proj
    (4608, 1536): _dsv3_at((1, 2, 4)),  # q_b_proj
    # The SM103 M2..4 configs lose to cuBLAS on B200; only M1 carries over.
    (6288, 7168): {1: ("cute", (224, 3, 4, 8, None))},  # in_proj_qkvgfab
    (12448, 7168): {  # in_proj_qkvgfab
        1: ("cute", (224, 4, 2, 8, None)),
        2: ("cute", (64, 4, 2, 8, None)),
        3: ("cute", (64, 2, 2, 8, None)),
        4: ("cute", (128, 2, 1, 8, None)),
    },
    (7168, 768): _dsv3_at((1,)),  # shared_down_proj
    (7168, 1536): {1: ("cute", (96, 4, 2, 8, None))},  # o_proj
    (7168, 3072): {  # o_proj
        1: ("cute", (96, 2, 4, 8, None)),
        2: ("cute", (32, 4, 4, 8, None)),
    },
    # No residual rows on SM100: the fused-residual path was not measured on B200.
    (7168, 3584): {  # routed_expert_up_proj
        1: ("cute", (64, 4, 2, 8, None)),
        2: ("cute", (64, 4, 2, 8, None)),
    },
    (7168, 8448): {  # dense_down_proj
        1: ("cute", (32, 4, 4, 8, None)),
        2: ("cute", (96, 4, 1, 8, None)),
        3: ("cute", (96, 4, 1, 8, None)),
    },
    (8448, 7168): {  # dense_gate_up_proj
        1: ("cute", (224, 3, 4, 8, None)),
        2: ("cute", (32, 4, 4, 8, None)),
    },
    (16896, 7168): {1: ("cute", (224, 3, 4, 8, None))},  # dense_gate_up_proj
    (20480, 7168): {  # lm_head
        1: ("cute", (224, 4, 2, 8, None)),
        2: ("cute", (64, 4, 2, 8, None)),
        3: ("cute", (64, 2, 2, 8, None)),
        4: ("cute", (64, 4, 1, 8, None)),
    },
    (40960, 7168): {  # lm_head
        1: ("cute", (128, 4, 2, 8, None)),
        2: ("cute", (64, 4, 2, 8, None)),
        3: ("cute", (64, 4, 1, 8, None)),
        4: ("cute", (64, 4, 1, 8, None)),
    },
    (10240, 7168): {  # lm_head
        1: ("cute", (224, 4, 2, 8, None)),
        2: ("cute", (32, 2, 4, 8, None)),
        3: ("cute", (64, 4, 1, 8, None)),
        4: ("cute", (64, 4, 1, 8, None)),
    },
    # dsv3 wins M2..8 here on B300 but loses to cuBLAS on B200.
    (3584, 7168): {  # routed_expert_down_proj
        1: ("cute", (224, 2, 4, 8, None)),
        2: ("cute", (128, 2, 1, 8, None)),
        3: ("cute", (128, 2, 1, 8, None)),
    },
    # TP16 shapes.
    (768, 7168): {  # mla_g_proj / shared_gate_up_proj
        1: ("cute", (224, 2, 4, 8, None)),
        2: ("cute", (224, 2, 2, 8, None)),
        3: ("cute", (224, 2, 2, 8, None)),
        4: ("cute", (224, 2, 2, 8, None)),
    },
    (1152, 1536): {1: ("cute", (192, 3, 4, 8, None))},  # q_b_proj
    (3216, 7168): {  # in_proj_qkvgfab
        1: ("cute", (224, 3, 4, 8, None)),
        2: ("cute", (128, 4, 2, 8, None)),
    },
    (4224, 7168): {  # dense_gate_up_proj
        1: ("cute", (224, 3, 4, 8, None)),
        2: ("cute", (128, 2, 1, 8, None)),
        3: ("cute", (64, 2, 2, 8, None)),
    },
    # SM100 has no eh_proj (7168, 14336) row: vLLM v0.29.0 did not measure it on B200.
}

SM100_RESIDUAL_ROWS = {}
