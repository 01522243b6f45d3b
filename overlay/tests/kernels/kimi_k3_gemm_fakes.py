# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-k3-overlay project
"""Fixtures, fakes and expectations shared by the Kimi-K3 decode GEMM CPU tests.

No tests here. The device capability is monkeypatched per test (each test names the
architecture it runs as), the CuTe kernel and the dsv3 op are replaced by fakes that
record their calls and compute the product on CPU, and the guard's device type is
pointed at "cpu" where a test needs the fast path to be reachable. Expectations of the
plan, routing and installation tests come from the data modules, read here without the
module under test.
"""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace
from typing import NamedTuple

import pytest
import regex as re
import torch
from torch import nn

from vllm.model_executor.kernels.linear.cute_dsl.skinny_gemm import SkinnyGemmConfig
from vllm.models.kimi_k3.nvidia import gemm_backends
from vllm.models.kimi_k3.nvidia import low_latency_gemm_dispatch as k3
from vllm.models.kimi_k3.nvidia import low_latency_gemm_sm90 as sm90_data
from vllm.models.kimi_k3.nvidia import low_latency_gemm_spec as gemm_spec
from vllm.models.kimi_k3.nvidia import low_latency_gemm_tables as blackwell_data
from vllm.models.kimi_k3.nvidia import swap_ab_gemm
from vllm.models.kimi_k3.nvidia.gemm_backends import cute_skinny, dsv3_fused_a, tinygemm
from vllm.models.kimi_k3.nvidia.gemm_backends import ll_bf16 as llb
from vllm.models.kimi_k3.nvidia.gemm_backends import swap_ab as sab_backend
from vllm.models.kimi_k3.nvidia.gemm_backends.ll_bf16 import LLBf16Config
from vllm.models.kimi_k3.nvidia.gemv_pdl import GemvPdlConfig
from vllm.models.kimi_k3.nvidia.skinny_pdl_gemm import SkinnyPdlConfig
from vllm.models.kimi_k3.nvidia.swap_ab_gemm import SwapAbConfig
from vllm.platforms.interface import DeviceCapability

SM103, SM107, SM100, SM90 = (10, 3), (10, 7), (10, 0), (9, 0)
NO_TABLE = [None, (8, 0), (8, 9), (12, 0), (10, 1)]
EH_PROJ = (7168, 14336)
ALL_TABLES = {
    "SM103": k3.KIMI_K3_PROJECTIONS,
    "SM100": k3.KIMI_K3_PROJECTIONS_SM100,
    "SM90": k3.KIMI_K3_PROJECTIONS_SM90,
}
BF16 = torch.bfloat16


# ---------------------------------------------------------------------- fixtures


def pin_capability(monkeypatch: pytest.MonkeyPatch, capability) -> None:
    """Make the module believe it runs on ``capability`` (None: no CUDA device)."""
    monkeypatch.setattr(k3, "_device_capability", lambda: capability)


class FakeSkinnyGemm:
    """Stands in for vLLM's CuTe skinny GEMM singleton; records every call."""

    def __init__(self, available: bool = True) -> None:
        self.available = available
        self.calls: list[tuple[int, SkinnyGemmConfig | None, bool]] = []
        self.warmups: list[tuple[torch.dtype, frozenset, bool]] = []

    def is_available(self) -> bool:
        return self.available

    def __call__(self, a, b, config=None, residual=None):
        self.calls.append((a.shape[0], config, residual is not None))
        out = a.float() @ b.float().t()
        if residual is not None:
            out += residual.float()
        return out.to(a.dtype)

    def request_warmup_configs(self, dtype, configs, *, has_residual=False):
        self.warmups.append((dtype, frozenset(configs), has_residual))

    def warmed(self, has_residual: bool) -> set[SkinnyGemmConfig]:
        return {
            config
            for _, configs, residual in self.warmups
            if residual == has_residual
            for config in configs
        }


@pytest.fixture
def fake_cute(monkeypatch: pytest.MonkeyPatch) -> FakeSkinnyGemm:
    fake = FakeSkinnyGemm()
    monkeypatch.setattr(cute_skinny, "shape_dynamic_skinny_gemm", fake)
    return fake


class FakeDsv3Ops:
    """Stands in for vllm._custom_ops: ``dsv3_fused_a_gemm`` on CPU."""

    def __init__(self) -> None:
        self.calls: list[tuple[int, tuple[int, ...]]] = []

    def dsv3_fused_a_gemm(self, output, mat_a, mat_b, enable_pdl=False):
        # mat_b must be the (K, N) column-major view of the (N, K) weight.
        self.calls.append((mat_a.shape[0], tuple(mat_b.stride())))
        output.copy_((mat_a.float() @ mat_b.float()).to(output.dtype))


@pytest.fixture
def fake_dsv3(monkeypatch: pytest.MonkeyPatch) -> FakeDsv3Ops:
    fake = FakeDsv3Ops()
    monkeypatch.setattr(dsv3_fused_a, "ops", fake)
    monkeypatch.setattr(dsv3_fused_a, "_built", lambda: True)
    monkeypatch.setattr(dsv3_fused_a, "_use_pdl", lambda: False)
    return fake


@pytest.fixture
def cpu_fast_path(monkeypatch: pytest.MonkeyPatch) -> None:
    """Let CPU tensors pass the device check so the fast path can be driven."""
    monkeypatch.setattr(k3, "_FAST_PATH_DEVICE_TYPE", "cpu")
    monkeypatch.delenv("VLLM_BATCH_INVARIANT", raising=False)


@pytest.fixture
def base_apply(monkeypatch: pytest.MonkeyPatch) -> list:
    """Replace the unquantized base methods with recorders returning a sentinel."""
    calls: list = []

    def fake(self, layer, x, bias=None):
        calls.append(x)
        return "base"

    monkeypatch.setattr(k3.UnquantizedLinearMethod, "apply", fake)
    monkeypatch.setattr(k3.UnquantizedEmbeddingMethod, "apply", fake)
    return calls


def bf16(*shape: int) -> torch.Tensor:
    return torch.randn(*shape).to(BF16)


def product(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """x @ weight.T in float32, rounded to BF16 like the kernels' output."""
    return (x.float() @ weight.float().t()).to(BF16)


def cfg(m, block, outputs, unroll=1, width=8, static_k=None) -> SkinnyGemmConfig:
    return SkinnyGemmConfig(m, block, outputs, unroll, width, static_k)


def cute_configs(spec) -> tuple:
    """``((M, config), ...)`` of the token counts CuTe won in ``spec``."""
    return tuple((m, call.config) for m, call in spec.winners if call.backend == "cute")


def cute_config(spec, m):
    """CuTe config of ``spec`` at M = ``m``; None if CuTe did not win there."""
    return dict(cute_configs(spec)).get(m)


# The data modules, read here without the module under test: expectations of the
# plan, routing and installation tests come from them, not from the tables built.
DATA = {
    SM103: (blackwell_data.SM103_ROWS, blackwell_data.SM103_RESIDUAL_ROWS),
    SM100: (blackwell_data.SM100_ROWS, blackwell_data.SM100_RESIDUAL_ROWS),
    SM90: (sm90_data.ROWS, {}),
}


def config_of(m: int, fields, backend: str = "cute"):
    """A data-module config tuple -> the config object ``backend`` takes at M = ``m``:
    cute (block, outputs, unroll, width, static_k), swap_ab (block_n, block_k, split_k,
    num_warps, num_stages), skinny_pdl (block_n, block_k, split_k, num_warps, num_stages),
    gemv_pdl (threads, rows, prefetch), ll_bf16 ("splitk", split_k, stages) / ("dotprod", block)."""
    if backend == "swap_ab":
        return SwapAbConfig(*fields)
    if backend == "skinny_pdl":
        return SkinnyPdlConfig(*fields)
    if backend == "gemv_pdl":
        return GemvPdlConfig(*fields)
    if backend == "ll_bf16":
        if fields[0] == "splitk":
            return LLBf16Config("splitk", split_k=fields[1], num_stages=fields[2])
        return LLBf16Config("dotprod", block_size=fields[1])
    return cfg(m, *fields)


def data_plan(capability, shape, backends=k3.BACKENDS) -> dict:
    """``{M: PlannedCall}`` the data module lists for ``shape``, keeping ``backends``."""
    row = DATA[capability][0][shape]
    return {
        m: k3.PlannedCall(backend, None if fields is None else config_of(m, fields, backend))
        for m, (backend, fields) in row.items()
        if backend in backends
    }


def data_residual_plan(capability, shape) -> dict:
    row = DATA[capability][1].get(shape, {})
    return {m: config_of(m, fields) for m, fields in row.items()}


def routed_tokens(capability, n: int, k: int) -> set[int]:
    """Token counts the data module of ``capability`` routes for (n, k)."""
    return set(DATA[capability][0].get((n, k), {}))


# (M, K) x (N, K)^T at N=64, K=256 with one CuTe entry at M=2.
N, K = 64, 256
PLAN = {2: k3.PlannedCall("cute", cfg(2, 32, 2))}
WEIGHT = bf16(N, K)


def linear_layer(weight: torch.Tensor = WEIGHT):
    return SimpleNamespace(weight=weight)
