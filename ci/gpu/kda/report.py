"""Pure parts of the KDA benchmark: bytes and roofs, where the overlap pays, the markdown.

No GPU needed (the CPU tests import this). Shapes are the TP8 ones of
``kda_projection.py``: packed ``in_proj_qkvgfab`` ``[6288, 7168]`` (QKVG rows 0..6143,
F_A/beta rows 6144..6287) and ``f_b_proj`` ``[1536, 128]``, BF16 (2 bytes).
"""

from __future__ import annotations

PACKED_N, HIDDEN = 6288, 7168
QKVG_N = 6144
FAB_N = PACKED_N - QKVG_N  # F_A (128) + beta (12) + padding (4)
F_B_N, HEAD_DIM = 1536, 128
BYTES = 2
VARIANTS = ("A", "B", "C")  # stock v0.28.0 cuBLAS, our sequential path, our overlap
WITHIN_ROOF = 1.10  # "(C) at M <= 2 within 10% of the read roof of packed weight + F_B"


def weights_bytes() -> int:
    """Bytes of the packed weight plus F_B's: what every variant must read (bytes)."""
    return BYTES * (PACKED_N * HIDDEN + F_B_N * HEAD_DIM)


def bytes_moved(variant: str, m: int) -> int:
    """Fewest HBM bytes a variant moves at token count ``m`` (each operand read once).

    (A) and (B): packed GEMM (weight, x in, ``[M, 6288]`` out), F_B (weight, F_A in,
    ``[M, 1536]`` out). (C): QKVG and F_A/beta each read x, write their own outputs.
    """
    f_b = BYTES * m * (HEAD_DIM + F_B_N)
    if variant in ("A", "B"):
        return weights_bytes() + BYTES * m * (HIDDEN + PACKED_N) + f_b
    if variant == "C":
        return weights_bytes() + BYTES * m * (2 * HIDDEN + QKVG_N + FAB_N) + f_b
    raise ValueError(f"unknown variant {variant!r}")


def roof_us(nbytes: int, read_bw_Bps: float) -> float:
    """µs to move ``nbytes`` at the measured read bandwidth (bytes/s)."""
    return nbytes / read_bw_Bps * 1e6


def overlap_tokens(rows: list[dict]) -> list[int]:
    """The M at which (C) beat (B) in every timing pass, sorted.

    ``rows``: the benchmark's rows, each ``{"M": m, "us": {"B": [..], "C": [..]}}`` (one
    figure per pass). A tie is not a win.
    """
    return sorted(
        r["M"] for r in rows
        if all(c < b for b, c in zip(r["us"]["B"], r["us"]["C"], strict=True))
    )  # fmt: skip


def derive(res: dict) -> dict:
    """The benchmark's conclusions from its rows and roof (updates and returns ``res``).

    ``overlap_tokens``: where the overlap measured faster (what ``kda_projection`` enables);
    ``c_over_roof_weights_m_le_2``: (C)'s last-pass figure over the read roof of the packed
    weight + F_B, at M <= 2; ``c_within_10pct_of_roof_m_le_2``: all of those <= 1.10.
    """
    res["overlap_tokens"] = overlap_tokens(res["rows"])
    near = [r["us"]["C"][-1] / res["roof_weights_us"] for r in res["rows"] if r["M"] <= 2]
    res["c_over_roof_weights_m_le_2"] = [round(v, 4) for v in near]
    res["c_within_10pct_of_roof_m_le_2"] = bool(near) and max(near) <= WITHIN_ROOF
    return res


def markdown(res: dict, ms: tuple[int, ...] = (1, 2, 4, 8, 14, 16)) -> str:
    """README table of a benchmark JSON at token counts ``ms`` (pass-2 medians, µs)."""
    p = res["provenance"]
    head = (
        f"{p['gpu']}, {p['date']}, torch {p['torch']}, nvidia-cutlass-dsl {p['cutlass_dsl']}, "
        f"run {p['run_id']}; read bandwidth {res['read_bw_TBps']} TB/s in the same run. "
        f"{res['method']}. µs per layer call; roof = bytes moved / read bandwidth; "
        f"(C)/roof_w = (C) over the read roof of the packed weight + F_B ({res['roof_weights_us']} µs)."
    )
    out = [head, "", "| M | (A) v0.28.0 cuBLAS | (B) ours sequential | (C) ours overlap | roof A/B | roof C "
           "| C vs B | (C)/roof_w |", "|--:|--:|--:|--:|--:|--:|--:|--:|"]
    for r in res["rows"]:
        if r["M"] not in ms:
            continue
        a, b, c = (r["us"][v][-1] for v in VARIANTS)
        out.append(f"| {r['M']} | {a:.2f} | {b:.2f} | {c:.2f} | {r['roof_us']['B']:.2f} | "
                   f"{r['roof_us']['C']:.2f} | {b / c:.3f}x | {c / res['roof_weights_us']:.3f} |")
    out += ["", f"Overlap enabled at M = {', '.join(map(str, res['overlap_tokens'])) or 'none'}: "
            "where (C) was faster than (B) in both timing passes."]
    return "\n".join(out) + "\n"
