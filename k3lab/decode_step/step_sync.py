"""The replay's stock ops against what v0.28.0 runs, per capture mode: every difference, by kind.

Reads a modes document (``results/decode_step/h200_modes_from_code.json``: per mode and layer,
v0.28.0's ops in launch order, each with the replay's stock op that stands for it, its stream,
graph segment and tier) and the replay's stock op lists (:data:`k3lab.decode_step.layers.LAYERS`),
and lists where they part:

* ``missing``: a stock op of the replay that v0.28.0 does not run in that mode, or one v0.28.0
  runs that the replay names but does not have;
* ``order``: a stock op the replay runs out of v0.28.0's order (outside their longest common
  order);
* ``stream``: v0.28.0 runs it off the main stream, the replay on one stream;
* ``break``: v0.28.0 starts a new graph segment before it (an eager core ran in between; no PDL
  overlap crosses it), the replay captures one graph;
* ``kernel``: the replay runs another kind of kernel than v0.28.0's tier, and not as a named
  stand-in for a compiled (``_C``) op.

Pure Python; ``k3lab/tests/test_decode_step_sync.py`` holds the lists and their explanations in
step.
"""

from __future__ import annotations

from k3lab.decode_step import layers

KINDS = ("missing", "order", "stream", "break", "kernel")


def replay_stock_ops(layer: str) -> list:
    """The replay's stock ops of ``layer`` (their ``run`` closures are never called here)."""
    kn = layers.Kernels(*([None] * 9))
    return layers.LAYERS[layer](kn)[0]


def model_ops(doc: dict, mode: str, layer: str) -> list[dict]:
    """v0.28.0's ops that the replay stands for, in order, consecutive repeats merged (one replay
    op may stand for two of v0.28.0's, e.g. ``routed_up`` and the add after it)."""
    out: list[dict] = []
    for op in doc["modes"][mode]["layers"][layer]:
        if op.get("replay") is None:
            continue
        if out and out[-1]["replay"] == op["replay"]:
            continue
        out.append(op)
    return out


def _lcs(a: list[str], b: list[str]) -> set[str]:
    n, m = len(a), len(b)
    t = [[0] * (m + 1) for _ in range(n + 1)]
    for i in range(n - 1, -1, -1):
        for j in range(m - 1, -1, -1):
            t[i][j] = t[i + 1][j + 1] + 1 if a[i] == b[j] else max(t[i + 1][j], t[i][j + 1])
    i = j = 0
    keep = set()
    while i < n and j < m:
        if a[i] == b[j]:
            keep.add(a[i])
            i, j = i + 1, j + 1
        elif t[i + 1][j] >= t[i][j + 1]:
            i += 1
        else:
            j += 1
    return keep


_KINDS = (("cute dsl", "CuTe DSL"), ("ll_bf16", "CuTe DSL"), ("cublas", "cuBLAS"), ("flashinfer", "flashinfer"),
          ("torch.compile", "torch.compile"), ("inductor", "torch.compile"), ("_c", "_C"), ("triton", "Triton"),
          ("eager", "torch eager"))  # fmt: skip


def _kind(text: str) -> str:
    """The kind of kernel a tier or a replay op's ``runs`` names (first keyword that matches)."""
    t = text.lower()
    return next((k for word, k in _KINDS if word in t), text)


def _kernel_differs(tier: str, runs: str) -> bool:
    """Whether the replay's kernel is not v0.28.0's kind (a named stand-in counts only for ``_C``)."""
    if "stand-in" in runs.lower():
        return not tier.startswith("_C")
    return _kind(tier) != _kind(runs)


def differences(doc: dict, mode: str, layer: str) -> set[tuple[str, str]]:
    """``(kind, replay op name)`` for every way the replay's stock ``layer`` parts from ``mode``."""
    model = model_ops(doc, mode, layer)
    stock = {op.name: op for op in replay_stock_ops(layer)}
    names = [op["replay"] for op in model]
    diff = {("missing", n) for n in stock if n not in names}
    diff |= {("missing", n) for n in names if n not in stock}
    common = [n for n in names if n in stock]
    in_order = _lcs(common, [n for n in stock if n in names])
    diff |= {("order", n) for n in common if n not in in_order}
    prev = None
    for op in model:
        n = op["replay"]
        if op["stream"] != "main":
            diff.add(("stream", n))
        if prev is not None and op["segment"] != prev:
            diff.add(("break", n))
        prev = op["segment"]
    for op in doc["modes"][mode]["layers"][layer]:  # every op, also the second one a replay op stands for
        n = op.get("replay")
        if n in stock and _kernel_differs(op["tier"], stock[n].runs):
            diff.add(("kernel", n))
    return diff


def explained(doc: dict, mode: str, layer: str) -> dict[tuple[str, str], str]:
    """The differences the document explains for ``mode`` and ``layer``: ``(kind, op) -> why``."""
    out = {}
    for d in doc.get("replay_differences", {}).get(mode, []):
        if layer in d["layers"]:
            out[(d["kind"], d["op"])] = d["why"]
    return out


# ------------------------------------------------- the model check's run against the code read

#: What the model check labels a kernel with (v0.28.0's submodule or function; ``mtp_block.``
#: dropped) -> the op of the code-read list (``h200_modes_from_code.json``) it is.
MEASURED_LABELS = {
    "attn_res": "attn_res (pre-attn)", "attn_res#2": "attn_res (post-attn)",
    "self_attn.in_proj_qkvgfab": "in_proj_qkvgfab", "self_attn.f_b_proj": "f_b_proj",
    "self_attn.o_proj": "o_proj", "self_attn.fused_qkv_a_proj": "fused_qkv_a_proj",
    "fused_q_kv_rmsnorm": "fused_q_kv_rmsnorm", "self_attn.q_b_proj": "q_b_proj",
    "self_attn.g_proj": "g_proj", "_gate_sigmoid_mul": "gate_sigmoid_mul",
    "fused_mtp_input": "fused_mtp_input", "eh_proj": "eh_proj", "input_layernorm": "input_layernorm",
    "post_attention_layernorm": "post_attention_layernorm", "shared_head.norm": "shared_head.norm",
    "block_sparse_moe.gate": "router_gate", "block_sparse_moe.routed_expert_down_proj": "routed_down",
    "block_sparse_moe.shared_experts.gate_up_proj": "shared_gate_up",
    "block_sparse_moe.shared_experts.act_fn": "situ_and_mul",
    "block_sparse_moe.shared_experts.down_proj": "shared_down",
    "block_sparse_moe.routed_expert_norm": "latent all-reduce + routed_expert_norm (fused)",
    "_overlap_allreduce_tail": "routed_up",
}  # fmt: skip


def _main_or_aux(stream: str) -> str:
    return "main" if stream == "main" else "aux"


def measured_ops(check: dict, layer: str, m: int) -> list[tuple[str, str]]:
    """``(op, "main" | "aux")`` in launch order of one layer of a model-check run at ``m`` tokens;
    a label with no op of the code read stays ``"?label"``."""
    return [(op, stream) for op, stream, _ in _measured(check, layer, m)]


def _measured(check: dict, layer: str, m: int) -> list[tuple[str, str, object]]:
    out = []
    for op in check["layers"][layer]["per_m"][str(m)]["ops"]:
        label = op["label"].removeprefix("mtp_block.")
        out.append((MEASURED_LABELS.get(label, "?" + label), _main_or_aux(op["stream"]), op["segment"]))
    return out


def _breaks(ops: list[tuple[str, object]]) -> set[str]:
    """The ops a new graph segment starts at (after the first op)."""
    return {op for (op, seg), (_, before) in zip(ops[1:], ops) if seg != before}


def measured_differences(code: dict, check: dict, mode: str, layer: str, m: int) -> set[tuple[str, str]]:
    """``(kind, op)`` for every way v0.28.0's own layer, run and profiled on the GPU (``check``,
    :mod:`k3lab.decode_step.model_check`), parts from the code read of ``mode`` (``code``):
    ``unlabelled`` (a kernel the run launched under no op of the code read), ``missing`` (an op
    of the code read that launches kernels on one GPU and did not run), ``order``, ``stream``,
    ``break`` (a graph segment starts before the op in one and not in the other)."""
    wanted = set(MEASURED_LABELS.values())
    read = [(op["op"], _main_or_aux(op["stream"])) for op in code["modes"][mode]["layers"][layer]
            if op["op"] in wanted]  # fmt: skip
    ran = measured_ops(check, layer, m)
    diff = {("unlabelled", op[1:]) for op, _ in ran if op.startswith("?")}
    ran = [r for r in ran if not r[0].startswith("?")]
    ran_names = [op for op, _ in ran]
    diff |= {("missing", op) for op, _ in read if op not in ran_names}
    common = [op for op, _ in read if op in ran_names]
    in_order = _lcs(common, [op for op in ran_names if op in common])
    diff |= {("order", op) for op in common if op not in in_order}
    streams = dict(ran)
    diff |= {("stream", op) for op, stream in read if op in streams and streams[op] != stream}
    # graph breaks: where each list starts a new segment, over the ops both have
    read_seg = [(op["op"], op["segment"]) for op in code["modes"][mode]["layers"][layer]
                if op["op"] in common and op["segment"] != "eager"]  # fmt: skip
    ran_seg = [(op, seg) for op, _, seg in _measured(check, layer, m) if op in common]
    diff |= {("break", op) for op in _breaks(read_seg) ^ _breaks(ran_seg)}
    return diff
