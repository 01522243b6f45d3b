"""Kimi-K3 decode GEMM shapes the GPU tier tunes and checks.

Each entry is a local ``(N, K)`` weight shape (``weight`` is ``[N, K]`` bf16,
the activation ``x`` is ``[M, K]``) with the projection(s) it serves and the
tensor-parallel layout it comes from. Source of the list: the shapes keyed in
vLLM v0.28.0's ``vllm/models/kimi_k3/nvidia/low_latency_gemm.py`` (its first block
holds TP8 and TP4 shapes, a TP4 one twice its TP8 one in N or K; its second TP16) plus the MTP ``eh_proj`` (7168x14336) that our patch 0001 makes a
``ReplicatedLinear``, and the two row views of the TP8 packed KDA weight that
``kda_projection.py`` runs as GEMMs of their own. Names are labels only; nothing
dispatches on them.
"""

from __future__ import annotations

# Token counts a decode step sees; the CuTe kernel accepts 1 <= M <= 16.
M_RANGE: tuple[int, ...] = tuple(range(1, 17))

# (N, K) -> (label, layouts). Replicated projections keep their shape at TP16.
SHAPES: dict[tuple[int, int], tuple[str, str]] = {
    (1536, 128): ("f_b_proj", "TP8"),
    (3072, 128): ("f_b_proj", "TP4"),
    (1536, 7168): ("shared_gate_up_proj/mla_g_proj", "TP8"),
    (3072, 7168): ("shared_gate_up_proj", "TP4"),
    (2112, 7168): ("fused_qkv_a_proj", "TP8+TP16"),
    # Patch 0013: MLA's fused_qkv_a_proj (2112 rows, replicated) and g_proj (1536 at TP8)
    # as row views of one weight, one GEMM at decode (upstream stacks them from v0.29.0).
    (3648, 7168): ("mla fused_qkv_a_proj+g_proj (stacked)", "TP8"),
    (2304, 1536): ("q_b_proj", "TP8"),
    (4608, 1536): ("q_b_proj", "TP4"),
    (3584, 7168): ("routed_expert_down_proj", "TP8+TP16"),
    (6288, 7168): ("in_proj_qkvgfab", "TP8"),
    # KDA decode projections on two streams (kda_projection.py): row views of the packed
    # in_proj_qkvgfab weight.
    (6144, 7168): ("kda_qkvg (in_proj_qkvgfab rows 0..6143)", "TP8"),
    (144, 7168): ("kda_f_a_beta (in_proj_qkvgfab rows 6144..6287)", "TP8"),
    (12448, 7168): ("in_proj_qkvgfab", "TP4"),
    (7168, 768): ("shared_down_proj / o_proj", "TP8+TP16"),
    (7168, 1536): ("o_proj", "TP8"),
    (7168, 3072): ("o_proj", "TP4"),
    (7168, 3584): ("routed_expert_up_proj", "TP8+TP16"),
    (7168, 4224): ("dense_down_proj", "TP8"),
    (7168, 8448): ("dense_down_proj", "TP4"),
    (8448, 7168): ("dense_gate_up_proj", "TP8"),
    (16896, 7168): ("dense_gate_up_proj", "TP4"),
    (20480, 7168): ("lm_head", "TP8"),
    (40960, 7168): ("lm_head", "TP4"),
    (7168, 14336): ("mtp eh_proj", "TP8+TP16"),
    (3216, 7168): ("in_proj_qkvgfab", "TP16"),
    (768, 7168): ("mla_g_proj/shared_gate_up_proj", "TP16"),
    (1152, 1536): ("q_b_proj", "TP16"),
    (768, 128): ("f_b_proj", "TP16"),
    (7168, 384): ("shared_down_proj", "TP16"),
    (4224, 7168): ("dense_gate_up_proj", "TP16"),
    (10240, 7168): ("lm_head", "TP16"),
    (7168, 2112): ("dense_down_proj", "TP16"),
}

EH_PROJ: tuple[int, int] = (7168, 14336)
KDA_SHAPES: tuple[tuple[int, int], ...] = ((6144, 7168), (144, 7168))
MLA_FRONT: tuple[int, int] = (3648, 7168)  # patch 0013's stack; added after the sweep of 2026-11-30


def weight_bytes(n: int, k: int) -> int:
    """Bytes of one bf16 ``[N, K]`` weight."""
    return 2 * n * k


def min_bytes_moved(n: int, k: int, m: int) -> int:
    """Fewest HBM bytes one ``[M,K] x [N,K]^T -> [M,N]`` bf16 call moves.

    Weight and activation read once, output written once (bytes).
    """
    return 2 * (n * k + m * k + m * n)


def roof_us(n: int, k: int, m: int, read_Bps: float) -> float:
    """The read roof of one call (µs): :func:`min_bytes_moved` over a read bandwidth (bytes/s)."""
    return min_bytes_moved(n, k, m) / read_Bps * 1e6


def parse(text: str) -> tuple[int, int]:
    """``"NxK"`` -> ``(N, K)`` (an argparse type: a ValueError is reported as a bad value)."""
    n, k = text.lower().split("x")
    return int(n), int(k)
