"""The op lists of a deployment mode (``modes.json``): what v0.28.0's decode layers run in it.

For each layer (KDA, MLA, MTP) and each variant (``stock``: v0.28.0; ``patched``: our patch
series laid on it), the ops in the order the model runs them, with the mode's streams and
graph breaks, built from the branches :mod:`k3lab.decode_step.modes` reads:

* ``capture=breakable``: a :func:`graph_break` where the KDA or MLA attention core runs
  eagerly (the replay leaves the cores out and captures one CUDA graph per segment between
  breaks: no PDL across a break); MLA's ``g_proj`` opens the segment after the core
  (``g_proj=after_core``); the router gate and ``routed_down`` run in line.
* ``capture=full``: one graph; ``g_proj`` on an aux stream beside the attention front end,
  the router gate beside ``routed_down`` (``gate_down=fork``) (:func:`fork`).
* ``moe_branch=fused_moe`` (the H200's): the router gate on GateLinear's tier 1 (CuTe DSL
  ``ll_bf16``), ``routed_down``, the routed experts (left out), the shared experts inside
  the LatentMoERunner on its aux stream (``shared_experts=runner_aux``: both captures), then
  tier 1 of the latent tail: the latent all-reduce + RMSNorm (flashinfer; the one-GPU replay
  runs the norm, the all-reduce is left out like every collective), ``up_proj`` as a plain
  ``torch.mm`` and ``add_`` of the shared output (its all-reduce left out).

Stand-ins, named in each op's ``runs`` (``stand-in for ...``) and timed against the closest
real kernel by :mod:`k3lab.decode_step.standins`: the ``_C`` norms and SITU-and-mul where the
breakable flag is on (``small_ops=c_kernels``: one Triton launch, no PDL,
:mod:`k3lab.decode_step.stock`), flashinfer's all-reduce + RMSNorm (the norm alone). With
the flag off (``small_ops=native``) the norms and SITU-and-mul are what v0.28.0 runs there
(eager PyTorch ops, one Inductor kernel); MLA's output gate in every mode its own
``torch.compile``'d expression: no stand-in.

Left out, and what that does to a fork: the KDA and MLA cores and the routed experts. In
v0.28.0 the MLA core is in the main arm of the ``g_proj`` fork and the routed experts in
the main arm of the shared experts' fork, so ``g_proj`` and the shared experts hide behind
them; here those arms are shorter (the shared experts' empty, unless ``routed="standin"``),
which overstates both variants and any gain on the aux arm.

Patched, on the FusedMoE branch: 0005's ``routed_output`` never fires there (the runner's
tail is its own); the shared experts take the GEMM dispatch and ``try_act_mul``; GateLinear's
tier 1 is untouched by the series. Patches 0008 and 0009 give the branch its own entries: the
front (gate + ``routed_down`` + shared ``gate_up`` as one GEMM, ``try_gate_gemm``; the runner's
shared experts then run only act-and-mul and ``down_proj``) and the tail (the latent's plain
all-reduce, then its RMSNorm in ``up_proj``'s prologue and the shared output in its epilogue:
``try_rmsnorm_gemm(add_to=)``), each where ``low_latency_fused_dispatch.path_enabled`` says
so for this branch and capture (a breakable one on the H200). Where the tail stays v0.28.0's,
0009 runs its ``up_proj`` on the GEMM table (``fused_decode.latent_up_proj``).

The MegaMoE branch (SM100 modes) is data only here: :class:`modes.NotReplayable`.
"""

from __future__ import annotations

import torch

from k3lab.decode_step import layers, modes, patched
from k3lab.decode_step.layers import EPS, H, LAT, NE, Op, _gemm_bytes

BREAK_PREFIX = "|| graph break: "
CORES = {"kda": "KDA core (kda.py:532)", "mla": "MLA attention core (mla.py:566)"}
_STREAMS: dict[str, torch.cuda.Stream] = {}  # one aux stream per name, made at first use


def graph_break(core: str) -> Op:
    """Where a breakable capture ends a graph and runs ``core`` eagerly (left out here)."""
    return Op(BREAK_PREFIX + CORES[core], "compilation/breakable_cudagraph.py:57", lambda st, w: None,
              "eager segment: the core is left out; the graph before it ends here")  # fmt: skip


def is_break(op: Op) -> bool:
    return op.name.startswith(BREAK_PREFIX)


def leaves(ops: list[Op]) -> list[Op]:
    """The ops with every fork replaced by its arms (main first), breaks dropped."""
    out = []
    for op in ops:
        if isinstance(getattr(op.run, "arms", None), tuple):
            out += leaves([*op.run.arms[0], *op.run.arms[1]])
        elif not is_break(op):
            out.append(op)
    return out


def _aux(name: str) -> torch.cuda.Stream:
    if name not in _STREAMS:
        _STREAMS[name] = torch.cuda.Stream()
    return _STREAMS[name]


def fork(name: str, stream: str, main: list[Op], aux: list[Op], where: str) -> Op:
    """``main`` on the current stream and ``aux`` on the aux stream ``stream``, forked and
    joined as vLLM's ``maybe_execute_in_parallel`` / ``SharedExperts`` do (events)."""

    def run(st, w):
        cur = torch.cuda.current_stream()
        side = _aux(stream)
        side.wait_stream(cur)
        for op in main:
            op.run(st, w)
        with torch.cuda.stream(side):
            for op in aux:
                op.run(st, w)
        cur.wait_stream(side)

    run.arms = (tuple(main), tuple(aux))
    covers = tuple(c for op in leaves([*main, *aux]) for c in (op.covers or (op.name,)))
    nb = [op.nbytes for op in leaves([*main, *aux])]
    nbytes = (lambda m: sum(f(m) for f in nb)) if all(nb) else None
    runs = f"main: {', '.join(o.name for o in main) or '-'} || {stream}: {', '.join(o.name for o in aux)}"
    return Op(name, where, run, runs, nbytes, covers)


def _shared_experts(br: dict, aux: list[Op], where: str) -> Op:
    """The runner's shared experts ``aux`` forked onto the aux stream; on the main stream
    beside them the routed experts' stand-in where the replay was asked for it
    (``br["routed_experts"]``), else nothing (left out)."""
    if br.get("routed_experts") == "standin":
        return fork("routed experts (stand-in) || shared experts (runner, aux stream)", "moe_aux",
                    [layers.routed_standin()], aux, where)  # fmt: skip
    return fork("shared experts (runner, aux stream)", "moe_aux", [], aux, where)


def _stock_moe(kn, src: str, br: dict) -> list[Op]:
    """v0.28.0's FusedMoE branch at decode (model.py:789-826, the runner, tier-1 tail)."""
    base = {op.name: op for op in layers._moe_stock(kn, src)}
    if br["small_ops"] == "native":
        base = _native(kn, base)

    def gate(st, w):
        st["logits"] = kn.gate_ll_bf16(st[src], w["gate"])

    def up(st, w):
        st["up_out"] = torch.mm(st["lat_n"], w["up"].t())

    def add(st, w):
        st["moe_out"] = st["up_out"].add_(st["shared"])

    router = Op("router_gate", "model_executor/layers/fused_moe/router/gate_linear.py:183-189", gate,
                "CuTe DSL ll_bf16_gemm (GateLinear tier 1; PDL-aware; fp32 out)", _gemm_bytes(NE, H, 4))
    down = base["routed_down"]._replace(where="nvidia/model.py:777-786", runs="cuBLAS")
    front = [router, down] if br["gate_down"] == "in_line" else [
        fork("router_gate || routed_down", "moe_aux", [router], [down], "nvidia/model.py:776-786")]
    shared = _shared_experts(br, [base["shared_gate_up"], base["situ_and_mul"], base["shared_down"]],
                             "fused_moe/runner/shared_experts.py:141-151")  # fmt: skip
    return [
        *front,
        shared,
        base["routed_expert_norm"]._replace(
            where="nvidia/latent_moe_runner.py:217",
            runs="stand-in for flashinfer's all-reduce + RMSNorm: the norm (one Triton launch, no PDL); "
                 "the all-reduce left out"),  # fmt: skip
        Op("routed_up", "nvidia/latent_moe_runner.py:224", up, "cuBLAS torch.mm (no beta-add)", _gemm_bytes(H, LAT)),
        Op("shared_add", "nvidia/latent_moe_runner.py:230", add, "torch add_ (one elementwise kernel)",
           lambda m: 6 * m * H),
    ]  # fmt: skip


def _mla_stock(kn, base: dict, br: dict, core_break: bool) -> list[Op]:
    front = [base["fused_qkv_a_proj"], base["fused_q_kv_rmsnorm"], base["q_b_proj"]]
    g = base["g_proj"]._replace(runs="cuBLAS")

    def gsm(st, w):  # the real kernel runs here: no stand-in needed
        st["a_gated"] = kn.stock.compiled_sigmoid_mul(st["attn_out"], st["gate_o"])

    gate = base["gate_sigmoid_mul"]._replace(where="nvidia/mla.py:555 (mla.py:111-114)", run=gsm,
                                             runs="v0.28.0's expression, torch.compile'd (Inductor)")  # fmt: skip
    back = [gate, base["o_proj"]]
    if br["g_proj"] == "after_core":
        return [*front, *([graph_break("mla")] if core_break else []), g, *back]
    return [fork("attention front end || g_proj", "mla_aux", front, [g], "nvidia/mla.py:534-550"), *back]


def _native(kn, base: dict[str, Op]) -> dict[str, Op]:
    """``small_ops=native``: the norms as eager PyTorch ops and SITU-and-mul compiled by
    Inductor, as v0.28.0 runs them when it compiles (:mod:`k3lab.decode_step.stock`)."""
    s = kn.stock

    def in_norm(st, w):
        st["hn"] = s.native_rms_norm(st["h0"], w["in_norm"], EPS)

    def post_norm(st, w):
        st["hn2"], st["r1"] = s.native_add_rms_norm(st["o_out"], st["h0"], w["post_norm"], EPS)

    def head_norm(st, w):
        st["logits_h"], st["r2"] = s.native_add_rms_norm(st["moe_out"], st["r1"], w["head_norm"], EPS)

    def situ(st, w):
        st["act"] = s.compiled_situ_and_mul(st["gu"], layers.SITU_BETA)

    eager = "eager PyTorch ops of ir.ops' native implementation (one kernel each)"
    swaps = {"input_layernorm": (in_norm, eager), "post_attention_layernorm": (post_norm, eager),
             "shared_head.norm": (head_norm, eager), "situ_and_mul": (situ, "torch.compile'd SituAndMul (Inductor)")}
    return {n: op._replace(run=swaps[n][0], runs=swaps[n][1]) if n in swaps else op for n, op in base.items()}


def stock_ops(kn, layer: str, br: dict) -> list[Op]:
    """v0.28.0's ops of ``layer`` in a mode whose branches are ``br`` (:func:`modes.branches`)."""
    _replayable(br)
    base = {op.name: op for op in layers.LAYERS[layer](kn)[0]}
    if br["small_ops"] == "native":
        base = _native(kn, base)
    brk = br["capture"] == "breakable"
    if layer == "kda":
        attn = [base["attn_res (pre-attn)"], base["in_proj_qkvgfab"], base["f_b_proj"],
                *([graph_break("kda")] if brk else []), base["o_proj"], base["attn_res (post-attn)"]]  # fmt: skip
    elif layer == "mla":
        attn = [base["attn_res (pre-attn)"], *_mla_stock(kn, base, br, brk), base["attn_res (post-attn)"]]
    else:
        attn = [base["embed_tokens"], base["fused_mtp_input"], base["eh_proj"], base["input_layernorm"],
                *_mla_stock(kn, base, br, brk), base["post_attention_layernorm"]]  # fmt: skip
    return [*attn, *_stock_moe(kn, "hn2", br), *([base["shared_head.norm"]] if layer == "mtp" else [])]


def path_branch(path: str, moe_branch: str) -> str:
    """The branch (``low_latency_fused_dispatch.BRANCHES``) a path of ours lives on in a mode
    whose MoE takes ``moe_branch``: MLA's front end for ``mla_front``, else the MoE's."""
    return "mla" if path == "mla_front" else moe_branch


def _path_on(pk, path: str) -> bool:
    """The tree's switch for one of its entries on the H200's branches (the FusedMoE's, MLA's),
    read when the op list is built (the replay sets the mode's capture first); a tree without
    the switch, or without the path (an older overlay): off."""
    fn = getattr(pk.fused, "path_enabled", None)
    if fn is None or path not in getattr(pk.fused, "PATHS", ()):
        return False
    return bool(fn(path, branch=path_branch(path, "fused_moe")))


def _patched_moe(pk, kn, src: str, stock: dict[str, Op], br: dict) -> list[Op]:
    """What patches 0001-0007 (and the FusedMoE entries where the tree has them) run on the
    FusedMoE branch; ``stock`` maps stock op names to ops (the fallbacks)."""

    def front(st, w):  # i27-wiring's moe_front: the stack of 0007's load, on this branch
        fused = pk.fused.try_gate_gemm(st[src], w["gate_down_sgu"], NE)
        patched._via(st, "moe_front", fused is not None)
        if fused is None:
            for name in ("router_gate", "routed_down", "shared_gate_up"):
                stock_moe[name].run(st, w)
            return
        st["logits"], rest = fused
        st["lat"], st["gu"] = rest[:, :LAT], rest[:, LAT:]

    def situ(st, w):
        out = pk.fused.try_act_mul(st["gu"], situ_beta=layers.SITU_BETA)
        patched._via(st, "situ_and_mul", out is not None)
        if out is None:  # fused_decode.act_and_mul: the stock kernel gets packed rows
            st["gu"] = st["gu"].contiguous()
            stock["situ_and_mul"].run(st, w)
        else:
            st["act"] = out

    def tail(st, w):
        # i27-wiring's moe_tail (patch 0009): the latent's plain all-reduce (left out), then one
        # launch: its RMSNorm in the prologue of up_proj, the reduced shared output added in
        # the epilogue; else v0.28.0's tier 1 (AR+norm, torch.mm, add_).
        fused = pk.fused.try_rmsnorm_gemm(st["lat_out"], w["lat_norm"], EPS, w["up"], add_to=st["shared"])
        patched._via(st, "moe_tail", fused is not None)
        if fused is None:
            for name in ("routed_expert_norm", "routed_up", "shared_add"):
                stock[name].run(st, w)
        else:
            st["moe_out"] = fused[0]

    stock_moe = {
        "router_gate": stock["router_gate"],
        "routed_down": patched._proj(pk, "routed_down", src, "lat", "down"),
        "shared_gate_up": patched._proj(pk, "shared_gate_up", src, "gu", "sgu"),
    }
    act = Op("situ_and_mul", "", situ, "try_act_mul (0005), else stock", covers=("situ_and_mul",))
    sdown = patched._proj(pk, "shared_down", "act", "shared", "sdown")
    if _path_on(pk, "moe_front"):
        head = [Op("router_gate+routed_down+shared_gate_up", "", front, "moe_front: try_gate_gemm, else stock",
                   covers=("router_gate", "routed_down", "shared_gate_up"))]  # fmt: skip
        shared = [act, sdown]
    else:
        pair = [stock_moe["router_gate"], stock_moe["routed_down"]]
        head = pair if br["gate_down"] == "in_line" else [
            fork("router_gate || routed_down", "moe_aux", pair[:1], pair[1:], "")]
        shared = [stock_moe["shared_gate_up"], act, sdown]
    if _path_on(pk, "moe_tail"):
        end = [Op("routed_expert_norm+routed_up+shared_add", "", tail,
                  "moe_tail: try_rmsnorm_gemm(norm prologue, add_to=shared), else stock",
                  covers=("routed_expert_norm", "routed_up", "shared_add"))]  # fmt: skip
    else:  # v0.28.0's tail; patch 0009 moves its up projection to the GEMM table where the tree has it
        up = stock["routed_up"]
        if getattr(getattr(pk, "decode", None), "latent_up_proj", None) is not None:
            up = patched._proj(pk, "routed_up", "lat_n", "up_out", "up")
        end = [stock["routed_expert_norm"], up, stock["shared_add"]]
    return [*head, _shared_experts(br, shared, ""), *end]


def _patched_mla(pk, kn, src: str, stock: dict, br: dict, core_break: bool) -> list[Op]:
    by = {op.name: op for op in patched._mla(pk, kn, src, stock)}
    back = [by["gate_sigmoid_mul"], by["o_proj"]]
    if _path_on(pk, "mla_front"):  # patch 0013: g_proj in the stacked GEMM, before the core; no fork
        front = [patched.mla_front(pk, src), by["fused_q_kv_rmsnorm+q_b_proj"]]
        return [*front, *([graph_break("mla")] if core_break else []), *back]
    front = [by["fused_qkv_a_proj"], by["fused_q_kv_rmsnorm+q_b_proj"]]
    if br["g_proj"] == "after_core":
        return [*front, *([graph_break("mla")] if core_break else []), by["g_proj"], *back]
    return [fork("attention front end || g_proj", "mla_aux", front, [by["g_proj"]], ""), *back]


def patched_ops(pk, kn, layer: str, br: dict) -> list[Op]:
    """The patched model's ops of ``layer`` in the mode ``br``; each call site through the
    entry point its patched line calls (:mod:`k3lab.decode_step.patched`), else stock."""
    _replayable(br)
    stock = {op.name: op for op in leaves(stock_ops(kn, layer, br))}
    brk = br["capture"] == "breakable"
    if layer == "kda":
        by = {op.name: op for op in patched.kda_ops(pk, kn)}
        # patch 0010: the two attn-res sites through try_attn_res, this mode's stock op behind
        attn = [patched.attn_res(pk, kn, "pre", stock), by["in_proj_qkvgfab+f_b_proj"],
                *([graph_break("kda")] if brk else []), by["o_proj"],
                patched.attn_res(pk, kn, "post", stock)]  # fmt: skip
    elif layer == "mla":
        attn = [patched.attn_res(pk, kn, "pre", stock), *_patched_mla(pk, kn, "hn", stock, br, brk),
                patched.attn_res(pk, kn, "post", stock)]  # fmt: skip
    else:
        by = {op.name: op for op in patched.mtp_ops(pk, kn)}
        # the norms' fallbacks: this mode's stock norms (c_kernels or native)
        by.update((a[0], patched._norm(pk, kn, *a, stock)) for a in (
            ("input_layernorm", "h0", "hn", "in_norm", None, None),
            ("post_attention_layernorm", "o_out", "hn2", "post_norm", "h0", "r1"),
            ("shared_head.norm", "moe_out", "logits_h", "head_norm", "r1", "r2")))  # fmt: skip
        attn = [by["embed_tokens"], by["fused_mtp_input"], by["eh_proj"], by["input_layernorm"],
                *_patched_mla(pk, kn, "hn", stock, br, brk), by["post_attention_layernorm"]]  # fmt: skip
    tail = [by["shared_head.norm"]] if layer == "mtp" else []
    return [*attn, *_patched_moe(pk, kn, "hn2", stock, br), *tail]


# The branches the op builders know: the H200's (SM90's kernels, the FusedMoE runner's tier-1 tail).
REPLAYED = {"moe_branch": "fused_moe", "moe_tokens": "M", "projections": "cublas",
            "shared_experts": "runner_aux", "latent_tail": "allreduce_overlap"}  # fmt: skip


def _replayable(br: dict) -> None:
    other = {f: br[f] for f, v in REPLAYED.items() if br[f] != v}
    if other:
        raise modes.NotReplayable(f"the replay builds the H200's branches only, not {other}")


def segments(ops: list[Op], copies: int) -> list[list[Op]]:
    """The step over ``copies`` layers as the capture cuts it: one list per CUDA graph, a new
    one after each break (a copy's last segment and the next copy's first share a graph, as
    consecutive layers of the model do). Each entry is ``(op, copy)``."""
    out: list[list] = [[]]
    for c in range(copies):
        for op in ops:
            if is_break(op):
                out.append([])
            else:
                out[-1].append((op, c))
    return [s for s in out if s]


def lists(kn, pk, layer: str, mode: str, routed: str = "none") -> dict[str, list[Op]]:
    """``{"stock": ops, "patched": ops}`` of ``layer`` in ``mode`` (patched only with ``pk``);
    ``routed="standin"`` puts :func:`layers.routed_standin` on the main stream beside the
    shared experts' fork in both."""
    br = {**modes.branches(mode, layer), "routed_experts": routed}
    out = {"stock": stock_ops(kn, layer, br)}
    if pk is not None:
        out["patched"] = patched_ops(pk, kn, layer, br)
    return out


def roof_bytes(ops: list[Op], m: int) -> int:
    """The fewest bytes of the stock ops ``ops`` at ``m`` tokens (weights, activations in/out)."""
    return sum(op.nbytes(m) for op in leaves(ops))
