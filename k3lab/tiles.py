"""Swap-AB configs worth timing, per weight shape (pure; no GPU).

A config is ``swap_ab_gemm.SwapAbConfig(block_n, block_k, split_k, num_warps,
num_stages[, rows])``; here it is a plain tuple so the data stays JSON. The tiles below
were chosen to keep 48-160 KB of weight in flight per CTA (H200: ~40 KB per SM
covers the ~1 µs HBM latency at 4.8 TB/s / 132 SMs) and to fit one or two CTAs in
the 227 KB of shared memory an SM90 CTA can take. The split is picked so that the
grid ``ceil(N / block_n) * split_k`` lands near a small multiple of the SM count,
with no split left without K tiles.
"""

from __future__ import annotations

import math

SMS = 132  # H200 (SM90) multiprocessors
# (block_n, block_k, num_warps, num_stages)
TILES: tuple[tuple[int, int, int, int], ...] = (
    (16, 512, 4, 6),
    (16, 256, 2, 8),
    (64, 256, 4, 4),
    (64, 128, 4, 6),
    (64, 256, 4, 2),
    (32, 256, 4, 4),
    (32, 512, 4, 3),
    (128, 128, 8, 4),
    (128, 256, 8, 3),
)
WAVES = (1, 2, 3, 4)
MAX_GRID = 8 * SMS


def valid_split(k: int, block_k: int, split: int) -> bool:
    """True if ``split`` CTAs along K each get at least one ``block_k`` tile."""
    tiles = math.ceil(k / block_k)
    if not 1 <= split <= tiles:
        return False
    per = math.ceil(tiles / split)
    return math.ceil(tiles / per) == split


def reachable_splits(k: int, block_k: int) -> list[int]:
    """Split counts that give every CTA the same number of K tiles but the last."""
    tiles = math.ceil(k / block_k)
    return sorted({math.ceil(tiles / per) for per in range(1, tiles + 1)})


def splits_for(n: int, k: int, block_n: int, block_k: int) -> list[int]:
    """Splits whose grid is nearest ``WAVES`` x ``SMS`` CTAs (1 always included)."""
    n_tiles = math.ceil(n / block_n)
    reach = [s for s in reachable_splits(k, block_k) if n_tiles * s <= MAX_GRID]
    out = {1}
    for waves in WAVES if reach else ():
        out.add(min(reach, key=lambda s: (abs(n_tiles * s - waves * SMS), s)))
    return sorted(out)


def candidates(n: int, k: int) -> list[tuple[int, int, int, int, int]]:
    """Every ``(block_n, block_k, split_k, num_warps, num_stages)`` to time for ``n x k``.

    Tiles whose ``block_k`` exceeds K by more than one tile's worth of padding are
    dropped (a K = 128 weight gains nothing from a 512-wide stage).
    """
    out = []
    for bn, bk, warps, stages in TILES:
        if bk > max(64, 2 ** math.ceil(math.log2(k))):
            continue
        for s in splits_for(n, k, bn, bk):
            out.append((bn, bk, s, warps, stages))
    return out


def seeded(n: int, k: int, seeds: list, new_tiles=TILES[:2]) -> list[tuple[int, int, int, int, int]]:
    """``seeds`` (configs an earlier sweep ranked best for this shape) plus every split of
    ``new_tiles`` (tiles that sweep did not have), de-duplicated, order kept."""
    out = [tuple(c) for c in seeds]
    for bn, bk, warps, stages in new_tiles:
        for s in splits_for(n, k, bn, bk):
            out.append((bn, bk, s, warps, stages))
    return list(dict.fromkeys(out))


def ragged(n: int, k: int) -> list[tuple[int, int, int, int, int, int]]:
    """Configs whose CTAs own ``rows`` < ``block_n`` weight rows, so the grid fills the SMs.

    For one and two CTAs per SM and every reachable split: ``SMS * waves // split`` row
    groups of ``rows = ceil(n / groups)`` rows each, in the smallest tile that holds them
    (a tile over twice ``rows`` would only waste MMA work; 16-row tiles take any ``rows``).
    A 7168-row weight in 64-row tiles is 112 CTAs on 132 SMs; in 55-row groups, 131.
    """
    out = []
    for bn, bk, warps, stages in TILES:
        if bk > max(64, 2 ** math.ceil(math.log2(k))):
            continue
        for split in reachable_splits(k, bk):
            for waves in (1, 2):
                groups = waves * SMS // split
                if groups < 1:
                    continue
                rows = math.ceil(n / groups)
                if rows < bn and (2 * rows > bn or bn == 16):
                    out.append((bn, bk, split, warps, stages, rows))
    return list(dict.fromkeys(out))
