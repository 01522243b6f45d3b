# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-k3-overlay project
"""Backend ``"pdl_attn_res"`` of op ``"attn_res"``: our one-launch attn-res mix.

:func:`vllm.models.kimi_k3.nvidia.attn_res.attn_res`: the decoder layer's attention
residual (prefix update, optional block write, softmax mix of the row's sources, output
RMSNorm), what v0.28.0's ``ops.attn_res`` computes, one CTA per row loading the whole
row's sources in one round trip, PDL-aware (the three weight vectors load before
``griddepcontrol.wait``). v0.28.0's kernel costs 7.6-8.2 µs per call on the H200
(``docs/decode-step-2026-12-02.md``); ours 5.56-6.05 µs at M = 1..16 against its 7.72-8.15
in the same run, at config ``(8, 0, True)``, NB = 8 (H200, 2026-12-04,
``python -m k3lab.decode_step.attn_res_bench``: ``results/decode_step/attn_res_bench_2026-12-04.json``;
the ``loop`` variant's best, 9.07 µs, lost). The cluster config, the SM90 table's row since:
3.03-3.55 µs at M = 1..15 and 4.21 at M = 16 against v0.28.0's 7.72-8.35 in the same run
(H200, 2026-12-04: ``results/decode_step/attn_res_bench_2026-12-04_cluster.json``).

Rows of op ``"attn_res"`` are keyed by ``(H,)``. Config: None (the launcher's defaults:
16 warps, all blocks in one tile, the mix from a second, cached read), or
``(num_warps, block_s, reload)`` (the ``tile`` variant) with ``block_s`` 0 for one tile,
or ``("loop", num_warps, chunk, num_stages)`` (the ``loop`` variant: the row in
pipelined column chunks of ``chunk``, 512/1024/2048, ``num_stages`` 1..8), or
``("cluster", C)`` (the CuTe DSL variant, :mod:`attn_res_cluster`: the row over a
cluster of C = 2/4/8 CTAs). A call the cluster variant does not take (no CuTe DSL, not
SM90+, a misaligned row, or a build not yet compiled while the stream captures a CUDA
graph: see ``attn_res_cluster.operands_error``) runs the tile kernel at
:data:`TILE_FALLBACK` instead, whose builds :meth:`PdlAttnRes.compile_for` made.
Operands (:meth:`PdlAttnRes.operands_ok`): ``prefix`` (1..16, H) BF16
with unit column stride; ``delta`` None or the same shape; ``blocks`` (M, R, H) BF16
with unit last stride; ``num_blocks`` 0..15; ``block_write_idx`` -1 or a slot past the
sources; weights contiguous BF16 (H,); one device (the kernel's own ``check_operands``).
"""

from __future__ import annotations

from typing import Any, ClassVar

import torch

from vllm.models.kimi_k3.nvidia import attn_res as kernel
from vllm.models.kimi_k3.nvidia import attn_res_cluster as cluster_kernel

from .base import WarmupCall, bf16_on
from .pdl_rmsnorm import PdlKernel, token_rows_ok

WARPS = (4, 8, 16, 32)
LOOP_CHUNKS = (512, 1024, 2048)
LOOP_STAGES = range(1, 9)
#: The tile config a cluster config falls back to: the tile kernel's best on the H200
#: (attn_res_bench_2026-12-04.json, 5.56-6.05 us at M = 1..16).
TILE_FALLBACK = (8, 0, True)


class PdlAttnRes(PdlKernel):
    """Our one-launch, PDL-aware attn-res mix."""

    name = "pdl_attn_res"
    op: ClassVar[str] = "attn_res"

    def config_error(self, n: int, k: int, num_tokens: int, config: Any) -> str | None:
        """None, ``(num_warps in 4/8/16/32, block_s 0 or 4/8/16, reload)``,
        ``("loop", num_warps in 4/8/16, chunk, num_stages)`` or ``("cluster", C)``; a
        block_s too small for a call's NB makes :meth:`operands_ok` refuse that call."""
        if config is None:
            return None
        if len(config) == 2 and config[0] == "cluster":
            why = cluster_kernel.shape_error(k, config[1])
            return f"{self.name}: {why}" if why else None
        if len(config) == 4 and config[0] == "loop":
            _, warps, chunk, stages = config
            if warps not in WARPS[:3]:
                return f"{self.name}: loop num_warps={warps} not in {WARPS[:3]}"
            if chunk not in LOOP_CHUNKS:
                return f"{self.name}: loop chunk={chunk} not in {LOOP_CHUNKS}"
            if isinstance(stages, bool) or stages not in LOOP_STAGES:
                return f"{self.name}: loop num_stages={stages!r} not in 1..8"
            return None
        if len(config) != 3:
            return f"{self.name}: config (num_warps, block_s, reload), got {config!r}"
        warps, block_s, reload = config
        if warps not in WARPS:
            return f"{self.name}: num_warps={warps} not in {WARPS}"
        if block_s not in (0, 4, 8, 16):
            return f"{self.name}: block_s={block_s} not 0, 4, 8 or 16"
        if not isinstance(reload, bool):
            return f"{self.name}: reload={reload!r} not a bool"
        return None

    @staticmethod
    def _meta(config: Any) -> dict:
        if config is None:
            return {}
        if config[0] == "loop":
            _, warps, chunk, stages = config
            return dict(variant="loop", num_warps=warps, chunk=chunk, num_stages=stages)
        if config[0] == "cluster":
            return dict(cluster=config[1])
        warps, block_s, reload = config
        return dict(num_warps=warps, block_s=block_s or None, reload=reload)

    def operands_ok(self, config: Any, prefix, delta, blocks, norm_weight, qk_weight,
                    output_norm_weight, num_blocks, block_write_idx) -> bool:  # fmt: skip
        """Whether :meth:`launch` takes these operands (module docstring)."""
        if not isinstance(prefix, torch.Tensor) or prefix.dim() != 2:
            return False
        if not token_rows_ok(prefix, prefix.shape[1]):
            return False
        if not bf16_on(prefix.device, prefix, delta, blocks, norm_weight, qk_weight,
                       output_norm_weight):  # fmt: skip
            return False
        try:
            kernel.check_operands(prefix, delta, blocks, norm_weight, qk_weight, output_norm_weight,
                                  num_blocks, block_write_idx)  # fmt: skip
            meta = self._meta(config)
            bs = kernel.block_s_for(num_blocks, meta.get("block_s"))
        except (ValueError, TypeError, AttributeError):
            return False
        # the loop variant's pipelined chunks of every source must fit one CTA's shared memory
        return meta.get("variant") != "loop" or (
            kernel.loop_smem_bytes(bs, meta["chunk"], meta["num_stages"]) <= kernel.MAX_SMEM_BYTES)

    def launch(self, config: Any, prefix, delta, blocks, norm_weight, qk_weight, output_norm_weight,
               num_blocks, block_write_idx, eps, output_norm_eps) -> torch.Tensor:  # fmt: skip
        """A new packed BF16 (M, H); ``prefix`` (and ``blocks[:, block_write_idx]``) updated."""
        meta = self._meta(config)
        args = (prefix, delta, blocks, norm_weight, qk_weight, output_norm_weight, num_blocks,
                block_write_idx)  # fmt: skip
        if "cluster" in meta:
            if cluster_kernel.operands_error(*args, meta["cluster"], True) is None:
                return cluster_kernel.launch(*args, eps, output_norm_eps, cluster=meta["cluster"], pdl=True)
            meta = self._meta(TILE_FALLBACK)  # compiled by compile_for
        return kernel.attn_res(prefix, delta, blocks, norm_weight, qk_weight, output_norm_weight,
                               num_blocks, block_write_idx, eps, output_norm_eps, **meta)  # fmt: skip

    def compile_for(self, call: WarmupCall, dtype: torch.dtype) -> None:
        """Every NB 0..15 with and without ``delta`` and the block write, with the output
        norm (the decoder layers' calls): NB is a compile-time constant, and the model's
        NB per layer is not known here; 64 builds, none left for graph capture. A cluster
        config warms the tile kernel it falls back to: its own builds (1-4 s each on the
        host) compile at a layer's first eager call: v0.28.0 makes one per capture size before
        capturing it (``cudagraph_num_of_warmups`` = 1 with CUDA graphs on,
        ``config/vllm.py:1539``; ``gpu_model_runner.py:7067-7088``)."""
        m, h = call.num_tokens, call.k
        x = torch.zeros(m, h, dtype=dtype, device=call.device)
        w = x.new_ones(h)
        config = TILE_FALLBACK if "cluster" in self._meta(call.config) else call.config
        for nb in range(kernel.MAX_SOURCES):
            blocks = torch.zeros(m, nb + 1, h, dtype=dtype, device=call.device)
            for delta in (None, x):
                for write in (-1, nb):
                    self.launch(config, x.clone(), delta, blocks, w, w, w, nb, write, 1e-6, 1e-6)


BACKEND = PdlAttnRes()
