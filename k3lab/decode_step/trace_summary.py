"""What a profiled forward ran, from ``torch.profiler``'s Chrome trace: kernels by op and segment.

:mod:`k3lab.decode_step.model_check` puts a ``record_function`` range named ``k3:<label>``
around every submodule and function of v0.28.0's layer, and one named
``k3seg:<i>:<graph|eager>`` around each segment of a replay. A kernel belongs to the
innermost range that holds the CPU call that launched it (matched through the trace's
correlation ids; every kernel of one CUDA-graph launch shares its launch's). Pure Python:
runs on the CPU on a saved trace.
"""

from __future__ import annotations

import json
from typing import Iterable

_KERNEL_CATS = ("kernel", "gpu_memset", "gpu_memcpy")
_LAUNCH_CATS = ("cuda_runtime", "cuda_driver")


def _innermost(ranges: list[dict], tid, t: float, prefix: str) -> dict | None:
    best = None
    for r in ranges:
        if r["tid"] == tid and r["name"].startswith(prefix) and r["ts"] <= t <= r["ts"] + r.get("dur", 0):
            if best is None or r["ts"] >= best["ts"]:
                best = r
    return best


def kernels(path: str) -> list[dict]:
    """The trace's GPU kernels in launch order: name, stream, label, segment, launching op, input dims."""
    with open(path) as f:
        events = json.load(f)["traceEvents"]
    return kernels_of(events)


def kernels_of(events: Iterable[dict]) -> list[dict]:
    events = [e for e in events if e.get("ph") == "X"]
    launch = {e["args"]["correlation"]: e for e in events
              if e.get("cat") in _LAUNCH_CATS and "correlation" in e.get("args", {})}  # fmt: skip
    ann = [e for e in events if e.get("cat") == "user_annotation"]
    ops = [e for e in events if e.get("cat") == "cpu_op"]
    out = []
    for k in (e for e in events if e.get("cat") in _KERNEL_CATS):
        r = launch.get(k.get("args", {}).get("correlation"))
        t, tid = (r["ts"], r["tid"]) if r else (k["ts"], None)
        label = _innermost(ann, tid, t, "k3:")
        seg = _innermost(ann, tid, t, "k3seg:")
        op = _innermost(ops, tid, t, "")
        out.append({
            "name": k["name"], "stream": k.get("args", {}).get("stream"), "launch": r["name"] if r else None,
            "label": label["name"][3:] if label else None,
            "segment": int(seg["name"].split(":")[1]) if seg else None,
            "op": op["name"] if op else None, "dims": op.get("args", {}).get("Input Dims") if op else None,
            "_t": (t, k["ts"]),
        })  # fmt: skip
    out.sort(key=lambda k: k.pop("_t"))
    return out


def short(name: str, n: int = 90) -> str:
    return name if len(name) <= n else name[: n - 3] + "..."


def summarize(eager: list[dict], graphed: list[dict], launches: list[dict], segs: list[str]) -> dict:
    """One forward: its ops in launch order with their kernels (from the eager run), the stream
    and segment each op was launched on while captured (``launches``: label, stream, segment as
    the capture saw them), and the replay's kernels by segment."""
    by_label: dict[str, list[dict]] = {}
    for k in eager:
        by_label.setdefault(k["label"] or "(unlabelled)", []).append(k)
    streams: dict = {launches[0]["stream"]: "main"} if launches else {}
    ops, seen = [], set()
    for rec in launches:
        lab = rec["label"]
        if lab in seen or lab not in by_label:
            continue  # a parent module, or an op that launched nothing
        seen.add(lab)
        s = streams.setdefault(rec["stream"], "main" if not streams else f"aux{len(streams)}")
        ks = by_label[lab]
        ops.append({"label": lab, "stream": s, "segment": rec["segment"],
                    "kernels": [short(k["name"]) for k in ks],
                    "dims": next((k["dims"] for k in ks if k["dims"]), None)})  # fmt: skip
    rest = [lab for lab in by_label if lab not in seen]
    return {
        "ops": ops,
        "unplaced": {lab: [short(k["name"]) for k in by_label[lab]] for lab in rest},
        "segments": segs,
        "graph_kernels": [{"name": short(k["name"]), "segment": k["segment"], "label": k["label"]}
                          for k in graphed],  # fmt: skip
        "n_eager_kernels": len(eager),
        "n_graph_kernels": len(graphed),
    }
