"""SM90 (H200) table for low_latency_gemm: Kimi-K3 decode GEMM winners per local (N, K) and M.

Figures: vLLM v0.29.0 (released 2026-09-09; table merged in PR #53942, 2026-08-27),
``KIMI_K3_PROJECTIONS_SM90``, measured by the vLLM authors on H200 against cuBLAS.
Carried here as data until our own tuner (ci/gpu/tune.py) regenerates this file from
measurements on our H200.

Check on our side: every CuTe row below was re-run on one lent H200 on 2026-11-29 with
vLLM v0.28.0's skinny-GEMM kernel (torch 2.11.0+cu130), one run against cuBLAS:
geo-mean speedup 1.243x, no row slower than cuBLAS (slowest 1.074x); see
shared/reference/h200/sm90_upstream_v0.29.0_table.json. The dsv3_fused_a rows were
*not* re-measured (no compiled vllm._C there); at run time they are used only when
torch.ops._C.dsv3_fused_a_gemm was built, else those M fall back to cuBLAS.
"""

PROVENANCE = {"gpu": "NVIDIA H200 (SM90)", "source": "vLLM v0.29.0 KIMI_K3_PROJECTIONS_SM90 (PR #53942), measured by vLLM authors", "date": "2026-09-09", "torch": "2.13.0 (vLLM v0.29.0 pin)", "cutlass_dsl": "4.6.2 (vLLM v0.29.0 pin)", "run_id": "upstream-v0.29.0"}

# (N, K) -> {M: (backend, cfg)}; backend "cute" or "dsv3_fused_a"; cfg for cute =
# (block_size, outputs_per_block, k_unroll, vector_width, static_k) and None for dsv3_fused_a.
ROWS = {
    (1536, 128): {
        1: ("dsv3_fused_a", None),
        2: ("dsv3_fused_a", None),
        3: ("dsv3_fused_a", None),
        4: ("dsv3_fused_a", None),
        5: ("dsv3_fused_a", None),
        6: ("dsv3_fused_a", None),
        7: ("dsv3_fused_a", None),
        8: ("dsv3_fused_a", None),
    },
    (3072, 128): {
        1: ("dsv3_fused_a", None),
        2: ("dsv3_fused_a", None),
        5: ("dsv3_fused_a", None),
        6: ("dsv3_fused_a", None),
        7: ("dsv3_fused_a", None),
        8: ("dsv3_fused_a", None),
        9: ("dsv3_fused_a", None),
    },
    (1536, 7168): {
        1: ("cute", (224, 2, 4, 8, None)),
        2: ("cute", (128, 3, 2, 8, None)),
        3: ("cute", (128, 2, 1, 8, None)),
        4: ("cute", (128, 2, 1, 8, None)),
        5: ("cute", (128, 3, 1, 8, None)),
        6: ("cute", (128, 3, 1, 8, None)),
        7: ("dsv3_fused_a", None),
        8: ("dsv3_fused_a", None),
        9: ("dsv3_fused_a", None),
        10: ("dsv3_fused_a", None),
        11: ("dsv3_fused_a", None),
        12: ("dsv3_fused_a", None),
        13: ("dsv3_fused_a", None),
        14: ("dsv3_fused_a", None),
        15: ("dsv3_fused_a", None),
        16: ("dsv3_fused_a", None),
    },
    (3072, 7168): {
        1: ("cute", (224, 2, 4, 8, None)),
        2: ("cute", (128, 2, 2, 8, None)),
        3: ("cute", (64, 4, 1, 8, None)),
        4: ("cute", (128, 6, 1, 8, None)),
    },
    (2112, 7168): {
        1: ("cute", (224, 2, 4, 8, None)),
        2: ("cute", (128, 4, 2, 8, None)),
        3: ("cute", (128, 2, 1, 8, None)),
        4: ("cute", (128, 2, 1, 8, None)),
        5: ("dsv3_fused_a", None),
        6: ("dsv3_fused_a", None),
        7: ("dsv3_fused_a", None),
        8: ("dsv3_fused_a", None),
        9: ("dsv3_fused_a", None),
        10: ("dsv3_fused_a", None),
        11: ("dsv3_fused_a", None),
        12: ("dsv3_fused_a", None),
        13: ("dsv3_fused_a", None),
        14: ("dsv3_fused_a", None),
        15: ("dsv3_fused_a", None),
        16: ("dsv3_fused_a", None),
    },
    (2304, 1536): {
        1: ("cute", (96, 4, 2, 8, None)),
        2: ("cute", (96, 4, 1, 8, None)),
        3: ("dsv3_fused_a", None),
        4: ("dsv3_fused_a", None),
        5: ("dsv3_fused_a", None),
        6: ("dsv3_fused_a", None),
        7: ("dsv3_fused_a", None),
        8: ("dsv3_fused_a", None),
    },
    (4608, 1536): {
        1: ("cute", (96, 4, 2, 4, None)),
        2: ("cute", (96, 4, 1, 8, None)),
        3: ("cute", (64, 4, 1, 8, None)),
    },
    (3584, 7168): {
        1: ("cute", (224, 2, 4, 8, None)),
        2: ("cute", (128, 4, 2, 8, None)),
        3: ("cute", (128, 2, 1, 8, None)),
    },
    (6288, 7168): {
        1: ("cute", (224, 2, 4, 8, None)),
        2: ("cute", (128, 4, 2, 8, None)),
        3: ("cute", (64, 4, 1, 8, None)),
    },
    (12448, 7168): {
        1: ("cute", (224, 2, 4, 8, None)),
        2: ("cute", (224, 4, 2, 8, None)),
        3: ("cute", (128, 2, 1, 8, None)),
    },
    (7168, 768): {
        1: ("cute", (96, 4, 2, 4, None)),
        2: ("cute", (96, 4, 1, 8, None)),
    },
    (7168, 1536): {
        1: ("cute", (96, 4, 2, 8, None)),
        2: ("cute", (96, 4, 1, 8, None)),
    },
    (7168, 3072): {
        1: ("cute", (96, 2, 4, 8, None)),
        2: ("cute", (64, 4, 2, 8, None)),
        3: ("cute", (64, 2, 2, 8, None)),
    },
    (7168, 3584): {
        1: ("cute", (224, 4, 2, 8, None)),
        2: ("cute", (64, 4, 2, 8, None)),
        3: ("cute", (64, 4, 2, 8, None)),
    },
    (7168, 4224): {
        1: ("cute", (96, 4, 2, 4, None)),
        2: ("cute", (32, 4, 2, 4, None)),
    },
    (7168, 8448): {
        1: ("cute", (96, 2, 4, 8, None)),
        2: ("cute", (32, 4, 2, 8, None)),
    },
    (7168, 14336): {
        1: ("cute", (224, 2, 4, 8, None)),
        2: ("cute", (128, 2, 2, 8, None)),
    },
    (20480, 7168): {
        1: ("cute", (224, 4, 2, 8, None)),
        2: ("cute", (224, 4, 2, 8, None)),
        3: ("cute", (128, 2, 1, 8, None)),
    },
}
