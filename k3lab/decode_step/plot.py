"""Where the decode step's time goes: a PNG from a replay JSON (needs matplotlib; no GPU).

``python -m k3lab.decode_step.plot RUN.json OUT.png [--m 8]``: one row per layer; left,
per op of the patched model (``ours`` in a run of the old replay that timed it) at token
count ``--m``: its µs, the stock µs of the stock ops it covers (their per-op graphs summed;
a stock op it shares with another, e.g. the shared experts' fork when the stacked front
takes their ``gate_up``, counted by the share of its ops this one covers) and the roof of
those ops; right, the whole layer against M = 1..16 (stock, patched, roof; ours where timed).
The title names the deployment mode of a ``--mode`` run. Exit 2 for a file that is not a
replay JSON or a token count it has no per-op records for.
"""

from __future__ import annotations

import argparse
import io
import json
import pathlib
import sys


def per_op_rows(doc: dict, layer: str, m: int) -> list[tuple[str, float, float, float]]:
    """(op, µs, stock µs of the ops it covers, roof µs) in the order the patched model (or
    ours, in an old run) runs them."""
    recs = [r for r in doc["per_op"] if r["layer"] == layer and r["M"] == m]
    variant = "ours" if any(r["variant"] == "ours" for r in recs) else "patched"
    stock = [r for r in recs if r["variant"] == "stock"]
    out = []
    for r in (r for r in recs if r["variant"] == variant):
        mine = set(r["covers"] or [r["op"]])
        us = 0.0
        for s in stock:
            theirs = set(s["covers"] or [s["op"]])
            if theirs & mine:
                us += s["us"] * len(theirs & mine) / len(theirs)
        out.append((r["op"], r["us"], round(us, 2), r["roof_us"]))
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
        mine = "ours" if any(r["variant"] == "ours" for r in doc["per_op"]) else "patched"
        ys = range(len(ops))
        h = 0.27
        row[0].barh([y - h for y in ys], [o[2] for o in ops], h, label="stock (ops replaced)",
                    color="#c44e52")
        row[0].barh(list(ys), [o[1] for o in ops], h, label=mine, color="#4c72b0")
        row[0].barh([y + h for y in ys], [o[3] for o in ops], h, label="roof", color="#999999")
        row[0].set_yticks(list(ys), [o[0] for o in ops], fontsize=8)
        row[0].invert_yaxis()
        row[0].set_xlabel("µs")
        step = next(r for r in doc["steps"] if r["layer"] == layer and r["M"] == args.m)
        parts = [f"{k[:-3]} {step[k]:.1f} µs" for k in ("stock_us", "ours_us", "patched_us", "roof_us") if k in step]
        graphs = step.get("graphs_per_step", 1)
        row[0].set_title(f"{layer.upper()} at M={args.m}: {', '.join(parts)} (whole layer; "
                         f"{'one graph' if graphs == 1 else 'one graph per segment'})", fontsize=10)  # fmt: skip
        row[0].legend(fontsize=8, loc="lower right")
        steps = sorted((r for r in doc["steps"] if r["layer"] == layer), key=lambda r: r["M"])
        ms = [r["M"] for r in steps]
        lines = [(k, c) for k, c in (("stock_us", "#c44e52"), ("patched_us", "#dd8452"), ("ours_us", "#4c72b0"),
                                     ("roof_us", "#999999")) if all(k in r for r in steps)]  # fmt: skip
        for key, color in lines:
            row[1].plot(ms, [r[key] for r in steps], marker="o", ms=3, color=color, label=key[:-3])
        row[1].set_ylim(bottom=0)
        row[1].set_xlabel("M (tokens)")
        row[1].set_ylabel("µs per step")
        row[1].legend(fontsize=8)
    mode = f"mode {doc['mode']}, " if "mode" in doc else ""
    fig.suptitle(f"Kimi-K3 decode step, dense path, TP8, {mode}({doc['gpu']}, {doc['date']}, torch {doc['torch']}, "
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
