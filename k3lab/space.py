"""CuTe skinny-GEMM config space and the legality rules that prune it.

A config is the 5-tuple ``(block_size, outputs_per_block, k_unroll,
vector_width, static_k)`` used by the SM90 table (``static_k`` is None or K).
Together with ``num_rows = M`` it is vLLM v0.28.0's ``SkinnyGemmConfig``.

:func:`illegal_reason` encodes the checks v0.28.0's kernel makes before it
launches (``ShapeDynamicSkinnyGemm.__call__`` and ``CuteSkinnyGemm.__init__``)
so nothing that would raise is ever compiled or timed, plus two documented
"cannot win" prunes (register spills, k_unroll beyond the K-tile count).
"""

from __future__ import annotations

import itertools
from typing import Iterable, Optional

Cfg = tuple  # (block_size, outputs_per_block, k_unroll, vector_width, static_k)

WARP = 32
BLOCK_SIZES = (32, 64, 96, 128, 192, 224, 256)
OUTPUTS_PER_BLOCK = (1, 2, 3, 4, 6, 7, 8)
K_UNROLLS = (1, 2, 4)
VECTOR_WIDTHS = (4, 8)
PREFETCH_TILES = 2  # static-K path prefetches two K tiles (kernel constant)
# -maxrregcount=64 in v0.28.0's compile options: accumulators alone past this
# many fp32 registers spill to local memory, which no memory-bound kernel wins.
MAX_ACC_REGS = 48


def illegal_reason(cfg: Cfg, n: int, k: int, m: int) -> Optional[str]:
    """Why ``cfg`` cannot run (or cannot win) for ``[m,k] x [n,k]^T``; None if ok."""
    bs, opb, ku, vw, sk = cfg
    if bs % WARP or not 0 < bs <= 1024:
        return "block_size not a warp multiple"
    if vw not in (2, 4, 8):
        return "vector_width must give a 32/64/128-bit load"
    if n % opb:
        return "N % outputs_per_block"
    tile = bs * vw
    if k % tile:
        return "K % (block_size*vector_width)"
    if sk is not None and (sk != k or sk < PREFETCH_TILES * tile):
        return "static_k must equal K and hold two tiles"
    if not 1 <= m <= 16:
        return "M outside 1..16"
    if m * opb > MAX_ACC_REGS:
        return "accumulators spill (M*outputs_per_block > 48)"
    if ku > 1 and ku > k // tile:
        return "k_unroll beyond K-tile count"
    if sk is not None and ku != 1:
        return "static_k unrolls fully; k_unroll unused"
    return None


def full_space(n: int, k: int, m: int) -> list[Cfg]:
    """Every legal config for one (N, K, M), deterministic order.

    vector_width 2 is included only where no 4/8-wide config is legal (K=2112),
    since it halves the load width of a memory-bound kernel.
    """
    out = []
    for vws in (VECTOR_WIDTHS, (2,)):
        for bs, opb, ku, vw in itertools.product(
            BLOCK_SIZES, OUTPUTS_PER_BLOCK, K_UNROLLS, vws
        ):
            for sk in (None, k):
                cfg = (bs, opb, ku, vw, sk)
                if illegal_reason(cfg, n, k, m) is None:
                    out.append(cfg)
        if out:
            break
    return out


def coarse_grid(n: int, k: int, m: int) -> list[Cfg]:
    """A small first-pass grid: dynamic K, widest legal vector, spread of sizes."""
    grid = []
    for vw in (8, 4, 2):
        for bs, opb, ku in itertools.product((64, 128, 224, 32, 96), (1, 2, 4), (1, 2)):
            cfg = (bs, opb, ku, vw, None)
            if illegal_reason(cfg, n, k, m) is None:
                grid.append(cfg)
        if grid:
            break
    return grid


def neighbours(cfg: Cfg, n: int, k: int, m: int) -> list[Cfg]:
    """Legal configs one step away in one parameter (including static_k on/off)."""

    def steps(values, v):
        if v not in values:
            return list(values)
        i = values.index(v)
        return [values[j] for j in (i - 1, i + 1) if 0 <= j < len(values)]

    bs, opb, ku, vw, sk = cfg
    cands = [(b, opb, ku, vw, sk) for b in steps(BLOCK_SIZES, bs)]
    cands += [(bs, o, ku, vw, sk) for o in steps(OUTPUTS_PER_BLOCK, opb)]
    cands += [(bs, opb, u, vw, sk) for u in steps(K_UNROLLS, ku)]
    cands += [(bs, opb, ku, w, sk) for w in (2, 4, 8) if w != vw]
    cands.append((bs, opb, 1, vw, None if sk is not None else k))
    return [c for c in dict.fromkeys(cands) if illegal_reason(c, n, k, m) is None]


def uniq(cfgs: Iterable[Cfg]) -> list[Cfg]:
    """Configs de-duplicated, first occurrence kept."""
    return list(dict.fromkeys(tuple(c) for c in cfgs))
