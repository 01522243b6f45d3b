"""Where the decode step's time goes: a PNG from a replay JSON (needs matplotlib; no GPU).

``python -m k3lab.decode_step.plot RUN.json OUT.png [--m 8]``: one row per layer; left,
per op of ours at token count ``--m``: our µs, the stock µs of the stock ops it
replaces (their per-op graphs summed) and the roof of those ops; right, the whole
step against M = 1..16 (stock, ours, roof, and the patched model's call sites where the
run timed them). Exit 2 for a file that is not a replay
JSON or a token count it has no per-op records for.
"""

from __future__ import annotations

import argparse
import io
import json
import pathlib
import sys


def per_op_rows(doc: dict, layer: str, m: int) -> list[tuple[str, float, float, float]]:
    """(ours op, ours µs, stock µs of the ops it covers, roof µs) in the order ours runs them."""
    recs = [r for r in doc["per_op"] if r["layer"] == layer and r["M"] == m]
    stock = {r["op"]: r["us"] for r in recs if r["variant"] == "stock"}
    out = []
    for r in (r for r in recs if r["variant"] == "ours"):
        out.append((r["op"], r["us"], sum(stock.get(c, 0.0) for c in r["covers"]), r["roof_us"]))
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m k3lab.decode_step.plot")
    ap.add_argument("run", type=pathlib.Path)
    ap.add_argument("png", type=pathlib.Path)
    ap.add_argument("--m", type=int, default=8)
    args = ap.parse_args(argv)
    try:
        doc = json.loads(args.run.read_text())
        layers = sorted({r["layer"] for r in doc["steps"]}, key=["mtp", "kda", "mla"].index)
    except (OSError, ValueError, KeyError) as e:
        print(f"error: {args.run}: not a replay JSON ({e})", file=sys.stderr)
        return 2
    if not any(r["M"] == args.m for r in doc["per_op"]):
        print(f"error: {args.run} has no per-op records at M={args.m}", file=sys.stderr)
        return 2
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from PIL import Image

    fig, axes = plt.subplots(len(layers), 2, figsize=(15, 5.2 * len(layers)),
                             gridspec_kw={"width_ratios": [3, 1]})  # fmt: skip
    for row, layer in zip(axes, layers):
        ops = per_op_rows(doc, layer, args.m)
        ys = range(len(ops))
        h = 0.27
        row[0].barh([y - h for y in ys], [o[2] for o in ops], h, label="stock (ops replaced)",
                    color="#c44e52")
        row[0].barh(list(ys), [o[1] for o in ops], h, label="ours", color="#4c72b0")
        row[0].barh([y + h for y in ys], [o[3] for o in ops], h, label="roof", color="#999999")
        row[0].set_yticks(list(ys), [o[0] for o in ops], fontsize=8)
        row[0].invert_yaxis()
        row[0].set_xlabel("µs")
        step = next(r for r in doc["steps"] if r["layer"] == layer and r["M"] == args.m)
        patched = f", patched {step['patched_us']} µs" if "patched_us" in step else ""
        row[0].set_title(f"{layer.upper()} at M={args.m}: stock {step['stock_us']} µs, "
                         f"ours {step['ours_us']} µs{patched}, roof {step['roof_us']} µs "
                         f"(whole step, one graph)", fontsize=10)  # fmt: skip
        row[0].legend(fontsize=8, loc="lower right")
        steps = sorted((r for r in doc["steps"] if r["layer"] == layer), key=lambda r: r["M"])
        ms = [r["M"] for r in steps]
        lines = [("stock_us", "#c44e52"), ("ours_us", "#4c72b0"), ("roof_us", "#999999")]
        if all("patched_us" in r for r in steps):  # the patched model's call sites (--patched)
            lines.insert(1, ("patched_us", "#dd8452"))
        for key, color in lines:
            row[1].plot(ms, [r[key] for r in steps], marker="o", ms=3, color=color, label=key[:-3])
        row[1].set_ylim(bottom=0)
        row[1].set_xlabel("M (tokens)")
        row[1].set_ylabel("µs per step")
        row[1].legend(fontsize=8)
    fig.suptitle(f"Kimi-K3 decode step, dense path, TP8 ({doc['gpu']}, {doc['date']}, torch {doc['torch']}, "
                 f"Triton {doc['triton']}, read roof {doc['read_bw_TBps']} TB/s)", fontsize=11)  # fmt: skip
    fig.tight_layout()
    buffer = io.BytesIO()
    fig.savefig(buffer, dpi=100)
    buffer.seek(0)
    # A palette of 32 colours: the plot has five, plus anti-aliasing; a third of the bytes,
    # which keeps results/ inside its 2 MB (tests/test_layout.py).
    Image.open(buffer).quantize(colors=32).save(args.png, optimize=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
