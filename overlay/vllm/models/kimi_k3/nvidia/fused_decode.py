# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-k3-overlay project
"""The Kimi-K3 model's call sites of the fused decode ops (vllm-k3-overlay).

Patches 0005 (``nvidia/model.py``) and 0006 (``nvidia/mla.py``, ``nvidia/mtp.py``)
replace lines of v0.28.0 with one call each of this module; each call takes the vLLM
module (or function) the stock line used, tries the fused path
(``low_latency_fused_dispatch``) and otherwise runs that very module, so the model
computes what v0.28.0 computes wherever the fused path does not apply:

=======================  ============================================  ==================
function                 stock line it wraps                           fused op
=======================  ============================================  ==================
:func:`rms_norm`         ``self.input_layernorm(h[, residual])``,      ``rmsnorm``
                         ``self.post_attention_layernorm(h, residual)``,
                         MTP: ``self.shared_head.norm(h, residual)``
:func:`act_and_mul`      ``KimiMLP``: ``self.act_fn(gate_up)``          ``act_mul``
:func:`routed_output`    ``KimiRoutedOutputTransform``: norm, then      ``rmsnorm_gemm``
                         ``up_proj`` (or ``residual.addmm_``)
:func:`mla_q_and_kv_c`   MLA: ``fused_q_kv_rmsnorm`` then ``q_b_proj``  ``rmsnorm_gemm``,
                                                                       ``rmsnorm``
:func:`output_gate`      MLA: ``_gate_sigmoid_mul(attn_out, gate)``     ``sigmoid_mul``
:func:`mtp_input`        MTP: ``fused_mtp_input(...)``                  ``mtp_input``
:func:`attn_res`         ``KimiDecoderLayer``: ``attn_res(...)`` in      ``attn_res``
                         ``_pre_attn_norm``, ``_post_attn_norm``
                         (patch 0010)
:func:`embed_tokens`     MTP: ``self.embed_tokens(input_ids)``          ``embed_rows``
                         (patch 0011); ``KimiLinearModel.embed_input_ids``
                         (patch 0012)
=======================  ============================================  ==================

Patch 0007 adds one more: :func:`moe_input_projections` (op ``gate_gemm``) replaces
``KimiMoE``'s router gate, ``routed_expert_down_proj`` and the shared experts'
``gate_up_proj``, three GEMMs of one input, by one. It needs the three weights as row
views of one tensor: the patch's model-level post-load hook calls
:func:`stack_moe_input_weights` once, after every quant method has finalized its layer.
On the FusedMoE branch (the H200's) the runner calls the shared experts itself: patch
0008 leaves their ``gate_up`` for that call (:func:`hand_shared_gate_up`,
:func:`take_shared_gate_up`), and patch 0009 replaces ``LatentMoERunner``'s small-M
tail by :func:`latent_moe_tail` (op ``rmsnorm_gemm`` with the shared output added in
its epilogue). Both MoE paths run only in the deployment modes (MoE branch, capture
mode) they were measured in (``low_latency_fused_dispatch.path_enabled``).

Patch 0013 stacks MLA's two projections of the layer's input, ``fused_qkv_a_proj`` and
``g_proj``, the same way (:func:`stack_mla_front_weights`, at the end of the layer's own
post-load hook) and runs them as one decode GEMM (:func:`mla_front`; the GEMM table's row
for the stacked shape), as upstream does from v0.29.0 (``fused_qkv_a_g_proj``).

A module is taken only when it is exactly the vLLM class the model builds
(``type(...) is``, as the GEMM dispatch does for methods: a subclass may compute
something else) with the attributes that class documents; none of these functions
raises where the stock line would not.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

import torch
from torch import nn

from vllm.model_executor.layers.activation import SiluAndMul, SituAndMul
from vllm.model_executor.layers.fused_moe.router.gate_linear import GateLinear
from vllm.model_executor.layers.layernorm import RMSNorm
from vllm.model_executor.layers.linear import (
    ColumnParallelLinear,
    MergedColumnParallelLinear,
    UnquantizedLinearMethod,
)
from vllm.model_executor.layers.vocab_parallel_embedding import (
    UnquantizedEmbeddingMethod,
    VocabParallelEmbedding,
)
from vllm.models.kimi_k3.nvidia import low_latency_gemm_dispatch as llg
from vllm.models.kimi_k3.nvidia.stacked_weights import offloaded, stack_rows, stackable, views_of
from vllm.models.kimi_k3.nvidia.low_latency_fused_dispatch import (
    path_enabled,
    path_measured,
    rmsnorm_gemm_routes,
    routes_any,
    try_act_mul,
    try_attn_res,
    try_embed_rows,
    try_gate_gemm,
    try_mtp_input,
    try_rms_norm,
    try_rmsnorm_gemm,
    try_sigmoid_mul,
)


def _norm_weight(norm: nn.Module) -> torch.Tensor | None:
    """The weight of a plain vLLM ``RMSNorm`` (weighted, no variance override), else None."""
    if type(norm) is not RMSNorm or not getattr(norm, "has_weight", False):
        return None
    if getattr(norm, "variance_size_override", None) is not None:
        return None
    return norm.weight


def rms_norm(norm: nn.Module, x: torch.Tensor, residual: torch.Tensor | None = None):
    """``norm(x)`` or ``norm(x, residual)`` (the same return forms: a tensor, or
    ``(out, new_residual)``), on our PDL-aware kernel where the device's table has a row."""
    weight = _norm_weight(norm)
    fused = None if weight is None else try_rms_norm(x, weight, norm.variance_epsilon, residual)
    if fused is None:
        return norm(x) if residual is None else norm(x, residual)
    return fused[0] if residual is None else fused


def act_and_mul(act_fn: nn.Module, gate_up: torch.Tensor) -> torch.Tensor:
    """``act_fn(gate_up)`` for vLLM's ``SiluAndMul`` / ``SituAndMul``, on our PDL-aware
    kernel where the device's table has a row. ``gate_up`` may be a row-strided view (the
    shared experts' columns of :func:`moe_input_projections`' output): ours reads it in
    place; vLLM's CUDA kernels index rows as packed, so the stock path gets a packed copy."""
    out = None
    if type(act_fn) is SiluAndMul:
        out = try_act_mul(gate_up)
    elif type(act_fn) is SituAndMul:
        out = try_act_mul(gate_up, situ_beta=act_fn.beta, situ_linear_beta=act_fn.linear_beta)
    if out is None:
        return act_fn(gate_up if gate_up.is_contiguous() else gate_up.contiguous())
    return out


def _plain_linear_weight(linear: nn.Module) -> torch.Tensor | None:
    """The weight of an unquantized, bias-free linear layer (the GEMM dispatch's method
    included: it subclasses the unquantized one), else None."""
    if not isinstance(getattr(linear, "quant_method", None), UnquantizedLinearMethod):
        return None
    if getattr(linear, "bias", None) is not None:
        return None
    return getattr(linear, "weight", None)


def routed_output(
    transform: nn.Module, hidden_states: torch.Tensor, residual: torch.Tensor | None
) -> torch.Tensor | None:
    """``up_proj(norm(hidden_states)) (+ residual)`` in one launch, or None for the stock lines.

    Args:
        transform: v0.28.0's ``KimiRoutedOutputTransform`` (``norm``, ``up_proj``).
        hidden_states: the routed experts' latent output, (M, K).
        residual: None or the (M, N) tensor the stock path accumulates into.

    Returns:
        A new (M, N) tensor, or None: no norm, a norm or projection of another kind,
        or any precondition of ``try_rmsnorm_gemm``.
    """
    norm = getattr(transform, "norm", None)
    norm_weight = None if norm is None else _norm_weight(norm)
    weight = _plain_linear_weight(getattr(transform, "up_proj", None))
    if norm_weight is None or weight is None:
        return None
    fused = try_rmsnorm_gemm(
        hidden_states, norm_weight, norm.variance_epsilon, weight, add_to=residual
    )
    return None if fused is None else fused[0]


def mla_q_and_kv_c(
    attn: nn.Module, q_c: torch.Tensor, kv_c: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor] | None:
    """MLA's q-LoRA front end after ``fused_qkv_a_proj``, or None for the stock lines.

    The stock lines normalize both latents in one launch (``fused_q_kv_rmsnorm``), then
    run ``q_b_proj``; here ``q_a_layernorm`` rides in ``q_b_proj``'s prologue (op
    ``rmsnorm_gemm``) and ``kv_a_layernorm`` runs on our PDL-aware norm (op ``rmsnorm``).

    Args:
        attn: v0.28.0's ``MultiHeadLatentAttention`` with a q-LoRA (``q_a_layernorm``,
            ``kv_a_layernorm``: vLLM ``RMSNorm``; ``q_b_proj``: an unquantized, bias-free
            ``ColumnParallelLinear`` that gathers nothing; ``rms_norm_eps``,
            ``num_local_heads``, ``qk_head_dim``).
        q_c: (M, q_lora_rank) view of ``fused_qkv_a_proj``'s output.
        kv_c: (M, kv_lora_rank) view of the same output.

    Returns:
        ``(q, kv_c_normed)`` as the stock lines give them: ``q`` (M, num_local_heads,
        qk_head_dim), ``kv_c_normed`` a packed (M, kv_lora_rank); or None (nothing
        launched) where ``q_b_proj``'s fused path does not apply. Once that one ran, a
        ``kv_c`` our norm refuses goes through ``attn.kv_a_layernorm`` itself (vLLM's
        RMSNorm: the same norm as the stock kernel's second half).
    """
    q_norm = getattr(attn, "q_a_layernorm", None)
    kv_norm = getattr(attn, "kv_a_layernorm", None)
    q_b_proj = getattr(attn, "q_b_proj", None)
    q_norm_weight = None if q_norm is None else _norm_weight(q_norm)
    if q_norm_weight is None or kv_norm is None or _norm_weight(kv_norm) is None:
        return None
    if type(q_b_proj) is not ColumnParallelLinear or getattr(q_b_proj, "gather_output", True):
        return None
    weight = _plain_linear_weight(q_b_proj)
    heads, head_dim = getattr(attn, "num_local_heads", 0), getattr(attn, "qk_head_dim", 0)
    eps = getattr(attn, "rms_norm_eps", None)
    if weight is None or weight.dim() != 2 or weight.shape[0] != heads * head_dim or eps is None:
        return None
    fused = try_rmsnorm_gemm(q_c, q_norm_weight, eps, weight)
    if fused is None:
        return None
    kv_c_normed = rms_norm(kv_norm, kv_c)
    return fused[0].view(-1, heads, head_dim), kv_c_normed


def output_gate(stock: Callable, attn_out: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
    """``stock(attn_out, gate)``, i.e. v0.28.0's ``_gate_sigmoid_mul``: ``attn_out *
    sigmoid(gate)``, on our PDL-aware kernel where the device's table has a row (BF16
    both: the stock result's dtype is then BF16 too)."""
    out = try_sigmoid_mul(attn_out, gate)
    if out is not None:
        return out
    # Packed as v0.28.0 hands it over: the stock expression is torch.compile'd, and a gate
    # of other strides (the column view patch 0013's stacked GEMM gives) would recompile
    # it, maybe inside a CUDA-graph capture.
    return stock(attn_out, gate if gate.is_contiguous() else gate.contiguous())


def mtp_input(
    stock: Callable,
    positions: torch.Tensor,
    inputs_embeds: torch.Tensor,
    previous_hidden_states: torch.Tensor,
    enorm_weight: torch.Tensor,
    hnorm_weight: torch.Tensor,
    eps: float,
) -> torch.Tensor:
    """``stock(positions, ..., eps)``, i.e. v0.28.0's ``fused_mtp_input`` with the same
    arguments, on our PDL-aware kernel where the device's table has a row: (M, 2H)
    ``[enorm(inputs_embeds) | hnorm(previous_hidden_states)]``, the embedding half 0
    where ``positions == 0``."""
    args = (positions, inputs_embeds, previous_hidden_states, enorm_weight, hnorm_weight, eps)
    out = try_mtp_input(*args)
    return stock(*args) if out is None else out


def _vocab_shard(embedding: nn.Module) -> tuple[int, int] | None:
    """``[start, end)`` of this rank's vocabulary in a vLLM ``VocabParallelEmbedding`` our
    lookup takes: the exact class, the unquantized method, TP > 1 (at TP 1 stock is one
    gather already), no added (LoRA) vocabulary; else None."""
    if type(embedding) is not VocabParallelEmbedding or getattr(embedding, "tp_size", 1) <= 1:
        return None
    shard = getattr(embedding, "shard_indices", None)
    if shard is None or type(getattr(embedding, "quant_method", None)) is not UnquantizedEmbeddingMethod:
        return None
    if shard.added_vocab_end_index != shard.added_vocab_start_index:
        return None
    return shard.org_vocab_start_index, shard.org_vocab_end_index


def embed_tokens(embedding: nn.Module, input_ids: torch.Tensor) -> torch.Tensor:
    """``embedding(input_ids)``, i.e. v0.28.0's ``VocabParallelEmbedding.forward``, with this
    rank's lookup in one launch (op ``embed_rows``) where the device's table has a row: the
    shard's rows, zeros for ids outside it, then the same all-reduce. Taken only for a
    shard :func:`_vocab_shard` takes; otherwise the stock call. (M, H) BF16."""
    shard = _vocab_shard(embedding)
    rows = None if shard is None else try_embed_rows(input_ids, embedding.weight, *shard)
    if rows is None:
        return embedding(input_ids)
    from vllm.distributed import tensor_model_parallel_all_reduce

    return tensor_model_parallel_all_reduce(rows)


class _InputStack(NamedTuple):
    """One MoE layer's stacked weight and the parameters that are row views of it."""

    weight: torch.Tensor  # (E + L + G, H): gate rows, routed_down rows, shared gate_up rows
    gate_rows: int  # E
    latent_rows: int  # L
    params: tuple[nn.Parameter, nn.Parameter, nn.Parameter]  # gate, routed_down, gate_up


def _branch(moe: nn.Module) -> str:
    """The MoE branch v0.28.0's ``KimiMoE`` takes (``use_mega_moe``)."""
    return "mega_moe" if getattr(moe, "use_mega_moe", False) else "fused_moe"


def _moe_input_params(moe: nn.Module) -> tuple[nn.Parameter, nn.Parameter, nn.Parameter] | None:
    """(gate, routed_down, shared gate_up) weights of a ``KimiMoE`` whose three
    projections can be one GEMM of :func:`moe_input_projections`, else None.

    The path must have been measured on the MoE's branch (``path_measured``; each call
    then asks ``path_enabled`` for its capture); the gate vLLM's ``GateLinear`` without
    bias and with fp32 logits (what the stacked GEMM gives), the other two unquantized and bias-free, the
    shared experts without sequence-parallel sharding (that branch all-gathers x before
    ``gate_up``); all three packed BF16 weights of one K on one device.
    """
    if not path_measured("moe_front", _branch(moe)):
        return None
    gate, shared = getattr(moe, "gate", None), getattr(moe, "shared_experts", None)
    if type(gate) is not GateLinear or gate.bias is not None or gate.out_dtype is not torch.float32:
        return None
    if shared is None or getattr(shared, "shard_sequence_parallel", True):
        return None
    params = (
        gate.weight,
        _plain_linear_weight(getattr(moe, "routed_expert_down_proj", None)),
        _plain_linear_weight(getattr(shared, "gate_up_proj", None)),
    )
    return params if stackable(params) else None


def stack_moe_input_weights(model: nn.Module, moe_cls: type) -> int:
    """Load time: for each ``moe_cls`` module of ``model`` (v0.28.0's ``KimiMoE``) whose
    router gate, ``routed_expert_down_proj`` and shared ``gate_up_proj`` can run as one
    GEMM (:func:`_moe_input_params`) where the device's table routes op ``gate_gemm`` for
    the stacked shape, copy the three weights into one packed ``(E + L + G, H)`` tensor,
    gate rows first, and re-point each parameter's data to its row view.

    The parameters stay what they were (same objects, shapes, values, names), so the stock
    lines, weight loaders and state dicts see no difference; their old storages are freed,
    so once done the model holds no extra memory (one layer's stack in flight: 79 MB at
    TP8). Nothing is touched where the fused path could not run or vLLM offloads weights;
    a second call keeps each stack where it is (:func:`stacked_weights.stack_rows`).

    Returns:
        How many modules were stacked.
    """
    stacked = 0
    for module in model.modules():
        if type(module) is not moe_cls:
            continue
        params = _moe_input_params(module)
        if params is None:
            continue
        rows = [p.shape[0] for p in params]
        if not routes_any("gate_gemm", (sum(rows), params[0].shape[1])) or offloaded(params):
            continue
        old = getattr(module, "_k3_input_stack", None)
        weight = stack_rows(old.weight if isinstance(old, _InputStack) else None, params)
        module._k3_input_stack = _InputStack(weight, rows[0], rows[1], params)
        stacked += 1
    return stacked


def moe_input_projections(
    moe: nn.Module, hidden_states: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
    """The router logits, the routed latent and the shared experts' ``gate_up`` of one
    input in one GEMM (op ``gate_gemm``), or None for the stock lines.

    Args:
        moe: v0.28.0's ``KimiMoE``, stacked by :func:`stack_moe_input_weights`.
        hidden_states: (M, H) BF16, the MoE's input.

    Returns:
        ``(router_logits, routed_hidden_states, shared_gate_up)``: fp32 (M, E), and BF16
        (M, L) and (M, G) row-strided column views of one new (M, L + G) tensor; or None:
        not stacked, the path not measured in this call's capture (``path_enabled``), a
        parameter no longer a view of the stack (a weight reload that replaced its
        storage), or any precondition of ``try_gate_gemm``.
    """
    stack = getattr(moe, "_k3_input_stack", None)
    if not isinstance(stack, _InputStack) or not path_enabled("moe_front", _branch(moe)):
        return None
    if not views_of(stack.weight, stack.params):
        return None
    fused = try_gate_gemm(hidden_states, stack.weight, stack.gate_rows)
    if fused is None:
        return None
    logits, rest = fused
    return logits, rest[:, : stack.latent_rows], rest[:, stack.latent_rows :]


# ------------------------------------------------------------ MLA's front end (patch 0013)


class _FrontStack(NamedTuple):
    """One MLA layer's stacked front weight and the parameters that are row views of it."""

    weight: torch.Tensor  # (Q + KV + R + G, H): fused_qkv_a_proj rows, then g_proj rows
    qkv_rows: int  # Q + KV + R: q_lora_rank + kv_lora_rank + qk_rope_head_dim
    params: tuple[nn.Parameter, nn.Parameter]  # fused_qkv_a_proj, g_proj


def _mla_front_params(attn: nn.Module) -> tuple[nn.Parameter, nn.Parameter] | None:
    """(fused_qkv_a_proj, g_proj) weights of a ``MultiHeadLatentAttention`` whose two
    projections of its input can be one GEMM of :func:`mla_front`, else None.

    The path must have been measured on this device (``path_measured``; each call then asks
    ``path_enabled`` for its capture). The layer has a q-LoRA and an output gate;
    ``fused_qkv_a_proj`` is vLLM's ``MergedColumnParallelLinear`` of the q-LoRA's three
    latents (replicated: ``disable_tp``), ``g_proj`` a ``ColumnParallelLinear`` that gathers
    nothing; both unquantized and bias-free, packed BF16 of one K on one device.
    """
    if not path_measured("mla_front", "mla"):
        return None
    qkv_a, g_proj = getattr(attn, "fused_qkv_a_proj", None), getattr(attn, "g_proj", None)
    if type(qkv_a) is not MergedColumnParallelLinear or type(g_proj) is not ColumnParallelLinear:
        return None
    if getattr(g_proj, "gather_output", True):
        return None
    ranks = [getattr(attn, name, None) for name in ("q_lora_rank", "kv_lora_rank", "qk_rope_head_dim")]
    params = (_plain_linear_weight(qkv_a), _plain_linear_weight(g_proj))
    if not stackable(params) or None in ranks or params[0].shape[0] != sum(ranks):
        return None
    return params


def stack_mla_front_weights(attn: nn.Module) -> bool:
    """Load time, after every quant method's finalize (patch 0013 calls it at the end of
    ``MultiHeadLatentAttention.process_weights_after_loading``, which vLLM's loader runs
    after them): where :func:`_mla_front_params` takes the layer and the device's GEMM
    table routes the stacked shape (2112 + 1536 = 3648 x 7168 at TP8), copy
    ``fused_qkv_a_proj``'s and ``g_proj``'s weights into one packed tensor, q-LoRA rows
    first, re-point each parameter's data to its row view, and warm the stacked GEMM's
    kernels up (graph capture must not compile).

    As :func:`stack_moe_input_weights`: the parameters stay the same objects, shapes and
    values, their old storages are freed (52 MB in flight at TP8), nothing is touched
    where the path could not run or vLLM offloads weights, and a second call (vLLM's
    layerwise reload runs this hook again) keeps the stack where it is (:func:`stacked_weights.stack_rows`).

    Returns:
        Whether the layer was stacked.
    """
    params = _mla_front_params(attn)
    if params is None:
        return False
    rows = [p.shape[0] for p in params]
    if not llg.routes_any((sum(rows), params[0].shape[1])) or offloaded(params):
        return False
    old = getattr(attn, "_k3_front_stack", None)
    weight = stack_rows(old.weight if isinstance(old, _FrontStack) else None, params)
    attn._k3_front_stack = _FrontStack(weight, rows[0], params)
    llg.request_low_latency_warmup(weight)
    return True


def mla_front(attn: nn.Module, hidden_states: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor] | None:
    """MLA's ``fused_qkv_a_proj(hidden_states)`` and ``g_proj(hidden_states)`` in one GEMM of
    the stack :func:`stack_mla_front_weights` made, or None for the stock lines.

    Args:
        attn: v0.28.0's ``MultiHeadLatentAttention``.
        hidden_states: (M, H) BF16, the layer's input.

    Returns:
        ``(qkv_lora, gate)``: (M, Q + KV + R) and (M, G) column views of one new (M, Q + KV +
        R + G) BF16 tensor (row stride Q + KV + R + G), as upstream's split of its stacked
        output gives them from v0.29.0; or None: not stacked, the path not measured in this
        call's capture (``path_enabled``), a parameter no longer a view of the stack (a
        weight reload that replaced its storage), or no routed kernel for M (M > 16
        included) or for these operands (``try_low_latency_gemm``).
    """
    stack = getattr(attn, "_k3_front_stack", None)
    if not isinstance(stack, _FrontStack) or not path_enabled("mla_front", "mla"):
        return None
    if not views_of(stack.weight, stack.params):
        return None
    out = llg.try_low_latency_gemm(hidden_states, stack.weight)
    if out is None:
        return None
    return out[:, : stack.qkv_rows], out[:, stack.qkv_rows :]


# --------------------------------------- the FusedMoE branch: the runner's shared experts


def hand_shared_gate_up(
    shared_experts: nn.Module | None, hidden_states: torch.Tensor, gate_up: torch.Tensor | None
) -> None:
    """FusedMoE branch (patch 0008): leave ``gate_up`` (the shared experts' ``gate_up_proj``
    of ``hidden_states``, from :func:`moe_input_projections`) for the runner's call of the
    shared experts, which :func:`take_shared_gate_up` picks up. ``None`` clears what an
    earlier forward left, so a stale one is never read. The runner calls the shared
    experts through its custom op and maybe on its aux stream, after it waited for the
    current stream, where ``gate_up`` was written."""
    if shared_experts is not None:
        shared_experts._k3_gate_up = None if gate_up is None else (hidden_states, gate_up)


def _same_tensor(a: torch.Tensor, b: torch.Tensor) -> bool:
    # The custom op may hand the runner another Python object of the same tensor.
    return (a.data_ptr(), a.shape, a.stride(), a.device) == (b.data_ptr(), b.shape, b.stride(), b.device)


def take_shared_gate_up(mlp: nn.Module, x: torch.Tensor) -> torch.Tensor | None:
    """The ``gate_up`` :func:`hand_shared_gate_up` left on ``mlp`` for exactly this input
    ``x`` (same data, shape, strides, device), once; else None: ``KimiMLP`` then runs its
    own ``gate_up_proj`` (a runner that gathered, padded or copied the input, a forward
    the fused front did not run)."""
    left = getattr(mlp, "_k3_gate_up", None)
    if left is None or not isinstance(x, torch.Tensor):
        return None
    mlp._k3_gate_up = None
    hidden_states, gate_up = left
    return gate_up if _same_tensor(hidden_states, x) else None


def latent_moe_tail(
    runner: nn.Module, fused_output: torch.Tensor, shared_output: torch.Tensor
) -> torch.Tensor | None:
    """v0.28.0's ``LatentMoERunner`` small-M tail at TP > 1 (patch 0009), fully reduced,
    with one GEMM: ``up_proj(norm(AR(latent))) + AR(shared)``, or None (nothing launched)
    for the stock tail.

    The latent norm cannot run before the all-reduce (each rank holds a partial sum of
    the experts' output and the norm is not linear), so the latent is all-reduced plain
    and the norm rides in the GEMM's prologue; the reduced shared output is added in its
    epilogue (op ``rmsnorm_gemm``), in place of v0.28.0's fused all-reduce + norm, GEMM
    and add. Both all-reduces stay: merging them needs one buffer for the experts' and
    the shared experts' partials, which the runner does not give.

    Args:
        runner: the ``LatentMoERunner`` (``routed_output_transform``: v0.28.0's
            ``KimiRoutedOutputTransform`` with an RMSNorm and an unquantized up_proj).
        fused_output: the routed experts' un-reduced latent, (M, L) BF16.
        shared_output: the shared experts' un-reduced output, (M, H) BF16.

    Returns:
        A new (M, H) BF16 tensor, reduced; or None where ``path_enabled`` refuses this
        mode, the transform is of another kind, or the GEMM's row, M or operands do not
        route (checked before any all-reduce runs). Never raises where the stock tail
        would not.
    """
    from vllm.distributed import tensor_model_parallel_all_reduce

    transform = getattr(runner, "routed_output_transform", None)
    norm = getattr(transform, "norm", None)
    norm_weight = None if norm is None else _norm_weight(norm)
    weight = _plain_linear_weight(getattr(transform, "up_proj", None))
    if norm_weight is None or weight is None or not path_enabled("moe_tail", "fused_moe"):
        return None
    if not rmsnorm_gemm_routes(fused_output, norm_weight, weight, add_to=shared_output):
        return None
    latent = tensor_model_parallel_all_reduce(fused_output)
    shared = tensor_model_parallel_all_reduce(shared_output)
    fused = try_rmsnorm_gemm(latent, norm_weight, norm.variance_epsilon, weight, add_to=shared)
    if fused is not None:
        return fused[0]
    # Routed above, refused now: only a reduced tensor's layout could differ. v0.28.0's
    # sequence on the reduced operands.
    return torch.mm(norm(latent), weight.t()).add_(shared)


def latent_up_proj(latent: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """v0.28.0's tail tier 1 up projection ``latent @ weight.T`` (latent_moe_runner.py:224,
    patch 0009) where the fused tail does not run: on the kernel the device's decode GEMM
    table picks, else ``torch.mm`` as v0.28.0 does. The runner keeps its fork, so the
    shared experts' all-reduce still runs beside this GEMM on the aux stream.

    Args:
        latent: the reduced, normed latent, (M, L) BF16 (L = 3584 at TP8).
        weight: ``up_proj``'s (H, L) BF16 weight, packed row-major (H = 7168).

    Returns:
        A new (M, H) tensor of ``latent``'s dtype. Never raises where ``torch.mm`` would not.
    """
    out = llg.try_low_latency_gemm(latent, weight)
    return torch.mm(latent, weight.t()) if out is None else out


def attn_res(
    stock: Callable,
    prefix: torch.Tensor,
    delta: torch.Tensor | None,
    blocks: torch.Tensor,
    norm_weight: torch.Tensor,
    qk_weight: torch.Tensor,
    output_norm_weight: torch.Tensor | None,
    *,
    num_blocks: int,
    block_write_idx: int,
    eps: float,
    output_norm_eps: float,
) -> torch.Tensor:
    """``stock(...)`` (v0.28.0's ``ops.attn_res``, same arguments) on our one-launch
    kernel where the device's table has a row (``try_attn_res``); else ``stock`` itself.
    Either updates ``prefix`` (and the written block) in place and returns a new tensor."""
    out = try_attn_res(prefix, delta, blocks, norm_weight, qk_weight, output_norm_weight,
                       num_blocks, block_write_idx, eps, output_norm_eps)  # fmt: skip
    if out is not None:
        return out
    return stock(prefix, delta, blocks, norm_weight, qk_weight, output_norm_weight,
                 num_blocks=num_blocks, block_write_idx=block_write_idx, eps=eps,
                 output_norm_eps=output_norm_eps)  # fmt: skip
