# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-k3-overlay project
"""CPU tests of the Kimi-K3 low-latency decode GEMM dispatch (vllm-k3-overlay).

No GPU needed: the device capability is monkeypatched per test (each test names the
architecture it runs as), the CuTe kernel and the dsv3 op are replaced by fakes that
record their calls and compute the product on CPU, and the guard's device type is
pointed at "cpu" where a test needs the fast path to be reachable. GPU numerics
against cuBLAS live in test_kimi_k3_low_latency_gemm_gpu.py.
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
    num_warps, num_stages), ll_bf16 ("splitk", split_k, stages) / ("dotprod", block)."""
    if backend == "swap_ab":
        return SwapAbConfig(*fields)
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


# ------------------------------------------------------------- table invariants


@pytest.mark.parametrize("arch", ALL_TABLES)
def test_table_keys_match_specs(arch: str) -> None:
    table = ALL_TABLES[arch]
    assert len(table) > 0
    for (n, k), spec in table.items():
        assert (spec.n, spec.k) == (n, k)


@pytest.mark.parametrize("arch", ALL_TABLES)
def test_every_cute_config_fits_its_shape(arch: str) -> None:
    for spec in ALL_TABLES[arch].values():
        configs = [*cute_configs(spec), *spec.residual_configs]
        for m, config in configs:
            assert config.num_rows == m
            assert spec.k % (config.block_size * config.vector_width) == 0, (spec, m)
            assert spec.n % config.outputs_per_block == 0, (spec, m)
            assert config.static_k in (None, spec.k)


@pytest.mark.parametrize("arch", ALL_TABLES)
def test_token_counts_are_decode_sized_and_routed_once(arch: str) -> None:
    for spec in ALL_TABLES[arch].values():
        token_counts = [m for m, _ in spec.winners]
        assert set(token_counts) <= set(range(1, 17))
        assert len(token_counts) == len(set(token_counts)), spec
        cute = {m for m, _ in cute_configs(spec)}
        assert not cute & spec.tokens_of("dsv3_fused_a")
        assert cute == {m for m, call in spec.winners if call.backend == "cute"}
        dsv3 = {m for m, c in spec.winners if c.backend == "dsv3_fused_a"}
        assert spec.tokens_of("dsv3_fused_a") == dsv3
        assert {m for m, _ in spec.residual_configs} <= set(range(1, 17))


@pytest.mark.parametrize("arch", ALL_TABLES)
def test_every_row_names_its_source(arch: str) -> None:
    table = ALL_TABLES[arch]
    assert table.arch == arch
    for shape in table:
        source = table.source_of(shape)
        assert source["gpu"] and source["source"] and source["date"]
        assert arch in source["gpu"]


def test_eh_proj_row_cites_its_own_source() -> None:
    table = k3.KIMI_K3_PROJECTIONS
    assert "v0.29.0" in table.source_of(EH_PROJ)["source"]
    assert "v0.28.0" in table.source_of((6288, 7168))["source"]
    with pytest.raises(KeyError):
        table.source_of((1, 1))


SOURCES = {  # (arch, table provenance, row provenance) of each data module
    SM103: ("SM103", blackwell_data.SM103_PROVENANCE, blackwell_data.SM103_ROW_PROVENANCE),
    SM100: ("SM100", blackwell_data.SM100_PROVENANCE, blackwell_data.SM100_ROW_PROVENANCE),
    SM90: ("SM90", sm90_data.PROVENANCE, sm90_data.ROW_PROVENANCE),
}


@pytest.mark.parametrize("capability", list(DATA))
def test_a_table_built_now_holds_every_data_row_and_its_source(capability) -> None:
    """The tables are built at import; this builds one again inside the test, so a fault in
    the building (not only in its result at import) fails here."""
    rows, residual_rows = DATA[capability]
    arch, provenance, row_provenance = SOURCES[capability]
    table = gemm_spec._table_from_rows(arch, rows, provenance, residual_rows, row_provenance)
    assert table.arch == arch and set(table) == set(rows) and len(table) == len(rows)
    for shape in rows:
        spec = table[shape]
        assert (spec.n, spec.k) == shape
        assert dict(spec.winners) == data_plan(capability, shape)
        assert [m for m, _ in spec.winners] == sorted(rows[shape])
        assert dict(spec.residual_configs) == data_residual_plan(capability, shape)
        assert dict(table.source_of(shape)) == dict(row_provenance.get(shape, provenance))
    assert dict(table.provenance) == dict(provenance)


def test_sm90_data_module_keeps_the_tuner_format() -> None:
    assert set(sm90_data.PROVENANCE) == {
        "gpu", "source", "date", "torch", "cutlass_dsl", "run_id"
    }  # fmt: skip
    assert re.fullmatch(r"\d{4}-\d{2}-\d{2}", sm90_data.PROVENANCE["date"])
    for (n, k), row in sm90_data.ROWS.items():
        assert isinstance(n, int) and isinstance(k, int)
        for m, (backend, config) in row.items():
            assert backend in k3.BACKENDS
            assert (config is None) == (backend in ("dsv3_fused_a", "tinygemm"))
            if backend in ("cute", "swap_ab"):
                # swap_ab may carry a sixth field, the rows a CTA owns (ragged tiles).
                assert len(config) == 5 or (backend == "swap_ab" and len(config) == 6)
                assert all(isinstance(v, int | None) for v in config)
            if backend == "ll_bf16":
                assert config[0] in ("splitk", "dotprod")


@pytest.mark.parametrize(
    "rows,residual_rows,capability",
    [
        (sm90_data.ROWS, {}, SM90),
        (blackwell_data.SM103_ROWS, blackwell_data.SM103_RESIDUAL_ROWS, SM103),
        (blackwell_data.SM100_ROWS, blackwell_data.SM100_RESIDUAL_ROWS, SM100),
    ],
)
def test_selector_reads_each_data_row(rows, residual_rows, capability) -> None:
    table = k3.table_for_capability(capability)
    assert set(table) == set(rows)
    for shape, row in rows.items():
        for m in range(0, 18):
            entry = row.get(m)
            expected = None if entry is None else entry[0]
            assert k3.select_kimi_k3_backend(m, *shape, capability=capability) == (
                expected
            )
            if entry is not None and entry[0] == "cute":
                block, outputs, unroll, width, static_k = entry[1]
                assert cute_config(table[shape], m) == SkinnyGemmConfig(
                    m, block, outputs, unroll, width, static_k
                )
    for shape, row in residual_rows.items():
        for m in range(1, 17):
            picked = k3.select_kimi_k3_backend(
                m, *shape, has_residual=True, capability=capability
            )
            assert picked == ("cute" if m in row else None)


def test_every_dsv3_routed_shape_is_compiled_into_the_op() -> None:
    """dsv3_fused_a_gemm is instantiated per (K, N); an unlisted shape raises."""
    source = (
        Path(__file__).resolve().parents[2]
        / "csrc/libtorch_stable/dsv3_fused_a_gemm.cu"
    ).read_text(encoding="utf-8")
    # Shapes behind VLLM_K3_BENCH_SHAPES are not in a default build.
    default_build = re.sub(
        r"#ifdef VLLM_K3_BENCH_SHAPES.*?#endif", "", source, flags=re.DOTALL
    )
    compiled = {
        (int(k), int(n))
        for k, n in re.findall(r"DISPATCH_DSV3_SHAPE\((\d+),\s*(\d+)\)", default_build)
    }
    compiled |= {
        (int(k), int(n))
        for k, n in re.findall(r"hd_in == (\d+) && hd_out == (\d+)", default_build)
    }
    assert (7168, 1536) in compiled
    missing = {
        (arch, spec.n, spec.k)
        for arch, table in ALL_TABLES.items()
        for spec in table.values()
        if spec.tokens_of("dsv3_fused_a") and (spec.k, spec.n) not in compiled
    }
    assert not missing


@pytest.mark.parametrize(
    "winners,residual,message",
    [
        (((0, k3.PlannedCall("dsv3_fused_a", None)),), (), "outside"),
        (((17, k3.PlannedCall("dsv3_fused_a", None)),), (), "outside"),
        (
            (
                (1, k3.PlannedCall("dsv3_fused_a", None)),
                (1, k3.PlannedCall("cute", cfg(1, 32, 2))),
            ),
            (),
            "twice",
        ),
        (((1, k3.PlannedCall("cute", None)),), (), "needs a SkinnyGemmConfig"),
        (((1, k3.PlannedCall("cute", cfg(2, 32, 2))),), (), "num_rows"),
        (((1, k3.PlannedCall("cute", cfg(1, 96, 2))),), (), "block_size"),
        (((1, k3.PlannedCall("cute", cfg(1, 32, 5))),), (), "N not a multiple"),
        (((1, k3.PlannedCall("cute", cfg(1, 32, 2, static_k=512))),), (), "static_k"),
        (((1, k3.PlannedCall("dsv3_fused_a", cfg(1, 32, 2))),), (), "no config"),
        (((1, k3.PlannedCall("cublas", None)),), (), "unknown backend"),
        (((1, k3.PlannedCall("swap_ab", None)),), (), "needs a SwapAbConfig"),
        (((1, k3.PlannedCall("swap_ab", cfg(1, 32, 2))),), (), "needs a SwapAbConfig"),
        (((1, k3.PlannedCall("swap_ab", SwapAbConfig(48, 128, 1, 4, 4))),), (), "block_n"),
        (((1, k3.PlannedCall("swap_ab", SwapAbConfig(64, 128, 3, 4, 4))),), (), "split_k"),
        (((1, k3.PlannedCall("ll_bf16", None)),), (), "needs an LLBf16Config"),
        (((1, k3.PlannedCall("ll_bf16", LLBf16Config("other"))),), (), "LLBf16Config"),
        (((1, k3.PlannedCall("tinygemm", LLBf16Config("splitk", 2, 4))),), (), "no config"),
        ((), ((1, cfg(1, 96, 2)),), "block_size"),
        ((), ((1, cfg(1, 32, 2)), (1, cfg(1, 64, 2))), "twice"),
    ],
)
def test_spec_rejects_configs_that_cannot_run(winners, residual, message) -> None:
    # (N, K) = (64, 256): 32 x 8 divides K, 2 divides N; 96 x 8 and 5 do not; two
    # K tiles of 128 cannot be split three ways.
    with pytest.raises(ValueError, match=message):
        k3.ProjectionSpec(64, 256, winners, residual)


@pytest.mark.parametrize(
    "winners,message",
    [
        (((17, k3.PlannedCall("dsv3_fused_a", None)),), "(64, 256): M=17 is outside range(1, 17)"),
        (((3, k3.PlannedCall("cublas", None)),), "(64, 256) at M=3: unknown backend 'cublas'"),
    ],
)
def test_a_rejection_names_the_shape_and_m(winners, message) -> None:
    with pytest.raises(ValueError) as err:
        k3.ProjectionSpec(64, 256, winners)
    assert str(err.value) == message


@pytest.mark.parametrize(
    "n,k,message",
    [(64, 96, "tinygemm needs K % 64"), (72, 256, "tinygemm needs K % 64 == 0 and N % 16")],
)
def test_spec_rejects_tinygemm_shapes_it_cannot_run(n, k, message) -> None:
    with pytest.raises(ValueError, match=message):
        k3.ProjectionSpec(n, k, ((1, k3.PlannedCall("tinygemm", None)),))


def test_spec_rejects_ll_bf16_on_unaligned_k() -> None:
    call = k3.PlannedCall("ll_bf16", LLBf16Config("splitk", 2, 4))
    with pytest.raises(ValueError, match="K % 8"):
        k3.ProjectionSpec(64, 260, ((1, call),))


@pytest.mark.parametrize("k,split_k,ok", [(128, 2, False), (256, 2, False), (512, 2, True),
                                          (7168, 28, True), (7168, 29, False)])
def test_spec_rejects_ll_bf16_splits_without_k_tiles(k, split_k, ok) -> None:
    # A split with no 256-wide K tile hung the H200 (K = 128, split_k = 2).
    call = k3.PlannedCall("ll_bf16", LLBf16Config("splitk", split_k, 4))
    if ok:
        k3.ProjectionSpec(64, k, ((1, call),))
    else:
        with pytest.raises(ValueError, match="> K tiles"):
            k3.ProjectionSpec(64, k, ((1, call),))


def test_new_backends_build_valid_specs() -> None:
    winners = (
        (1, k3.PlannedCall("swap_ab", SwapAbConfig(64, 128, 2, 4, 4))),
        (2, k3.PlannedCall("ll_bf16", LLBf16Config("splitk", 2, 4))),
        (3, k3.PlannedCall("ll_bf16", LLBf16Config("dotprod", block_size=256))),
        (4, k3.PlannedCall("tinygemm", None)),
    )
    spec = k3.ProjectionSpec(64, 512, winners)
    assert [spec.winner(m).backend for m in (1, 2, 3, 4)] == [
        "swap_ab", "ll_bf16", "ll_bf16", "tinygemm"
    ]  # fmt: skip
    assert cute_configs(spec) == () and cute_config(spec, 1) is None


@pytest.mark.parametrize(
    "backend,data,expected",
    [
        ("swap_ab", (64, 256, 4, 4, 4), SwapAbConfig(64, 256, 4, 4, 4)),
        ("ll_bf16", ("splitk", 2, 4), LLBf16Config("splitk", split_k=2, num_stages=4)),
        ("ll_bf16", ("dotprod", 256), LLBf16Config("dotprod", block_size=256)),
        ("cute", (32, 2, 1, 8, None), SkinnyGemmConfig(3, 32, 2, 1, 8, None)),
        ("tinygemm", None, None),
    ],
)
def test_config_from_data(backend, data, expected) -> None:
    assert k3.config_from_data(backend, 3, data) == expected


def test_config_from_data_rejects_unknown_ll_bf16_forms() -> None:
    with pytest.raises(ValueError, match="neither splitk nor dotprod"):
        k3.config_from_data("ll_bf16", 1, ("splitk", 2))


def test_valid_spec_is_frozen() -> None:
    spec = k3.ProjectionSpec(64, 256, ((1, k3.PlannedCall("cute", cfg(1, 32, 2))),))
    with pytest.raises(AttributeError):
        spec.n = 128  # type: ignore[misc]


def test_tables_are_read_only() -> None:
    with pytest.raises(TypeError):
        k3.KIMI_K3_PROJECTIONS[(1, 1)] = None  # type: ignore[index]
    with pytest.raises(TypeError):
        k3.TABLES_BY_CAPABILITY[(8, 0)] = k3.KIMI_K3_PROJECTIONS  # type: ignore[index]


def test_residual_rows_need_a_table_row() -> None:
    with pytest.raises(ValueError, match="no row"):
        gemm_spec._table_from_rows("SMX", {}, {}, {(64, 256): {1: (32, 2, 1, 8, None)}})


# ---------------------------------------------------------- capability routing


@pytest.mark.parametrize(
    "capability,arch",
    [(SM103, "SM103"), (SM107, "SM103"), (SM100, "SM100"), (SM90, "SM90")],
)
def test_device_table_per_capability(monkeypatch, capability, arch) -> None:
    pin_capability(monkeypatch, capability)
    assert k3.device_table() is ALL_TABLES[arch]


@pytest.mark.parametrize("capability", NO_TABLE)
def test_other_capabilities_have_no_table(monkeypatch, capability) -> None:
    pin_capability(monkeypatch, capability)
    assert k3.device_table() is None
    assert k3.select_kimi_k3_backend(1, *EH_PROJ) is None
    assert k3.routed_rows() == ()


def test_tables_are_never_merged() -> None:
    tables = [k3.table_for_capability(c) for c in (SM103, SM100, SM90)]
    assert len({id(t) for t in tables}) == 3
    # The parts really disagree, which is why they stay apart.
    assert k3.select_kimi_k3_backend(2, 3584, 7168, capability=SM103) == "dsv3_fused_a"
    assert k3.select_kimi_k3_backend(2, 3584, 7168, capability=SM100) == "cute"


@pytest.mark.parametrize(
    "is_cuda,reported,expected",
    [
        (True, DeviceCapability(9, 0), SM90),
        (True, DeviceCapability(10, 3), SM103),
        (True, None, None),
        # ROCm reports gfx90a as (9, 0); it must not pick the H200 table.
        (False, DeviceCapability(9, 0), None),
    ],
)
def test_capability_probe(monkeypatch, is_cuda, reported, expected) -> None:
    platform = SimpleNamespace(
        is_cuda=lambda: is_cuda, get_device_capability=lambda: reported
    )
    monkeypatch.setattr(k3, "current_platform", platform)
    assert k3._device_capability() == expected


def routed_tokens(capability, n: int, k: int) -> set[int]:
    """Token counts the data module of ``capability`` routes for (n, k)."""
    return set(DATA[capability][0].get((n, k), {}))


@pytest.mark.parametrize("capability", [SM103, SM90])
def test_eh_proj_routes_as_its_table_says(monkeypatch, capability) -> None:
    pin_capability(monkeypatch, capability)
    if capability == SM103:  # the two rows this overlay adds to v0.28.0's table
        assert k3.select_kimi_k3_backend(1, *EH_PROJ) == "cute"
        assert k3.select_kimi_k3_backend(2, *EH_PROJ) == "cute"
    rows = DATA[capability][0][EH_PROJ]
    for m in range(1, 17):
        want = rows[m][0] if m in rows else None
        assert k3.select_kimi_k3_backend(m, *EH_PROJ) == want, f"M={m}"


def test_eh_proj_sm103_stops_at_m2() -> None:
    # SM103 = v0.28.0's table plus exactly the two eh_proj rows this overlay adds.
    assert routed_tokens(SM103, *EH_PROJ) == {1, 2}


def test_eh_proj_configs_on_sm103() -> None:
    spec = k3.KIMI_K3_PROJECTIONS[EH_PROJ]
    assert cute_config(spec, 1) == SkinnyGemmConfig(
        1, 256, 2, vector_width=4, static_k=14336
    )
    assert cute_config(spec, 2) == SkinnyGemmConfig(
        2, block_size=224, outputs_per_block=4, k_unroll=2, vector_width=8
    )


def test_select_without_gpu_is_none_and_capability_overrides(monkeypatch) -> None:
    pin_capability(monkeypatch, None)
    assert k3.select_kimi_k3_backend(1, *EH_PROJ) is None
    assert k3.select_kimi_k3_backend(1, *EH_PROJ, capability=SM90) == "cute"
    assert k3.select_kimi_k3_backend(1, *EH_PROJ, capability=(8, 0)) is None


@pytest.mark.parametrize("capability", [SM103, SM100, SM90])
def test_routed_rows_are_the_data_rows(monkeypatch, capability) -> None:
    pin_capability(monkeypatch, capability)
    rows, residual_rows = DATA[capability]
    expected = [
        k3.RoutedRow(n, k, m, backend, None if f is None else config_of(m, f, backend), False)
        for (n, k), row in rows.items()
        for m, (backend, f) in row.items()
    ]
    expected += [
        k3.RoutedRow(n, k, m, "cute", config_of(m, f), True)
        for (n, k), row in residual_rows.items()
        for m, f in row.items()
    ]
    routed = k3.routed_rows()
    assert routed == k3.routed_rows(capability)
    assert len(routed) == len(expected) and set(routed) == set(expected)
    order = [(r.has_residual, r.n, r.k, r.num_tokens) for r in routed]
    assert order == sorted(order)


def test_routed_rows_include_residual_epilogue_on_sm103() -> None:
    residual = [r for r in k3.routed_rows(SM103) if r.has_residual]
    assert {(r.n, r.k, r.num_tokens) for r in residual} == {
        (7168, 3584, m) for m in (1, 2, 3, 4)
    }
    assert not [r for r in k3.routed_rows(SM90) if r.has_residual]


# ---------------------------------------------------------------------- registry

BACKEND_MODULES = Path(gemm_backends.__file__).parent


def test_every_backend_module_is_registered_under_its_table_name() -> None:
    modules = sorted(p.stem for p in BACKEND_MODULES.glob("*.py") if p.stem not in
                     ("__init__", "base"))  # fmt: skip
    all_ops = [b for op in gemm_backends._BY_OP for b in gemm_backends.backends_for(op).values()]
    assert len(modules) == len(all_ops) == len(k3.BACKENDS) >= 5
    assert dict(gemm_backends.backends_for("gemm")) == dict(gemm_backends.BACKENDS)
    assert dict(gemm_backends.backends_for("no such op")) == {}
    for name, backend in gemm_backends.BACKENDS.items():
        assert isinstance(backend, gemm_backends.base.GemmBackend) and backend.op == "gemm"
        assert backend.name == name and gemm_backends.get(name) is backend
        assert type(backend).__module__.rpartition(".")[2] in modules
    with pytest.raises(KeyError):
        gemm_backends.get("cublas")


def test_every_table_names_only_registered_backends() -> None:
    named = {backend for rows, _ in DATA.values() for row in rows.values()
             for backend, _ in row.values()}  # fmt: skip
    assert named <= set(gemm_backends.BACKENDS)
    for table in ALL_TABLES.values():
        assert table.backends() <= set(gemm_backends.BACKENDS)


def test_one_backend_fuses_the_residual_and_owns_the_residual_rows() -> None:
    fusing = [b for b in gemm_backends.BACKENDS.values() if b.fuses_residual]
    assert fusing == [gemm_backends.residual_backend()]
    assert gemm_backends.residual_backend().name == "cute"
    with pytest.raises(NotImplementedError):
        gemm_backends.get("swap_ab").launch_residual(None, bf16(1, K), WEIGHT, bf16(1, N))


@pytest.mark.parametrize("capability,supported", [(None, False), ((8, 9), False), (SM90, True),
                                                  (SM100, True), ((12, 0), True)])
def test_backends_run_from_sm90(capability, supported) -> None:
    assert all(b.is_supported(capability) is supported for b in gemm_backends.BACKENDS.values())


def test_a_table_routing_an_unsupported_backend_fails_at_import() -> None:
    table = gemm_spec._table_from_rows("SM80", {(64, 256): {1: ("dsv3_fused_a", None)}}, {})
    with pytest.raises(ValueError, match="SM80 table routes dsv3_fused_a, unsupported on"):
        gemm_spec._by_capability({(8, 0): table})
    assert dict(gemm_spec._by_capability({SM90: table})) == {SM90: table}


def test_tables_by_capability_are_the_four_tables() -> None:
    assert dict(k3.TABLES_BY_CAPABILITY) == {
        SM103: k3.KIMI_K3_PROJECTIONS, SM107: k3.KIMI_K3_PROJECTIONS,
        SM100: k3.KIMI_K3_PROJECTIONS_SM100, SM90: k3.KIMI_K3_PROJECTIONS_SM90,
    }  # fmt: skip


@pytest.mark.parametrize("capability", [SM103, SM107, SM100, SM90])
def test_every_route_of_every_row_is_the_data_row(monkeypatch, capability) -> None:
    """Every (N, K) of the data and every M 0..17, each way the dispatch answers: the
    selector, the plan, the plan with every backend built, and the routed rows. Written
    before the backend registry existed and kept, so that the registry routes exactly
    what the if/elif dispatch it replaced did."""
    data_cap = SM103 if capability == SM107 else capability
    rows, residual_rows = DATA[data_cap]
    for backend in gemm_backends.BACKENDS.values():
        monkeypatch.setattr(type(backend), "is_available", lambda self: True)
    table = k3.table_for_capability(capability)
    routed = {(r.n, r.k, r.num_tokens, r.has_residual): (r.backend, r.config)
              for r in k3.routed_rows(capability)}  # fmt: skip
    expected_routed = {}
    for shape, row in rows.items():
        plan = data_plan(data_cap, shape)
        residual = data_residual_plan(data_cap, shape)
        assert k3._build_plan(table[shape]) == plan
        assert k3._runnable_plan(table[shape]) == plan
        assert k3._runnable_residual_plan(table[shape]) == residual
        for m in range(0, 18):
            picked = k3.select_kimi_k3_backend(m, *shape, capability=capability)
            assert picked == (row[m][0] if m in row else None), (shape, m)
            with_residual = k3.select_kimi_k3_backend(m, *shape, has_residual=True,
                                                      capability=capability)  # fmt: skip
            assert with_residual == ("cute" if m in residual else None), (shape, m)
        expected_routed.update({(*shape, m, False): tuple(c) for m, c in plan.items()})
        expected_routed.update({(*shape, m, True): ("cute", c) for m, c in residual.items()})
    assert set(residual_rows) <= set(rows)
    assert routed == expected_routed


def test_sm103_table_keeps_upstreams_figures() -> None:
    """Our SM103 rows are those of upstream's own module (which the tree keeps, unused by
    the model since patches 0002 and 0004) plus the MTP eh_proj row: a release that re-measures
    upstream's SM103 table fails here, naming the shapes to take again."""
    from vllm.models.kimi_k3.nvidia import low_latency_gemm as upstream

    ours = k3.KIMI_K3_PROJECTIONS
    differ = [
        shape
        for shape, spec in upstream.KIMI_K3_PROJECTIONS.items()
        if shape not in ours
        or {m: tuple(c) for m, c in upstream._build_plan(spec).items()}
        != {m: tuple(c) for m, c in k3._build_plan(ours[shape]).items()}
        or upstream._build_residual_plan(spec) != k3._build_residual_plan(ours[shape])
    ]
    assert not differ
    assert set(ours) - set(upstream.KIMI_K3_PROJECTIONS) <= {EH_PROJ}


# -------------------------------------------------------------------------- plans


@pytest.mark.parametrize("capability", [SM103, SM100, SM90])
def test_build_plan_is_the_data_row(capability) -> None:
    table = k3.table_for_capability(capability)
    for shape in DATA[capability][0]:
        assert k3._build_plan(table[shape]) == data_plan(capability, shape)
        assert k3._build_residual_plan(table[shape]) == data_residual_plan(
            capability, shape
        )


def test_runnable_plan_drops_backends_not_built(monkeypatch, fake_cute) -> None:
    spec = k3.KIMI_K3_PROJECTIONS[(768, 7168)]  # CuTe M1..4, dsv3 M5..16
    monkeypatch.setattr(dsv3_fused_a, "_built", lambda: False)
    assert set(k3._runnable_plan(spec)) == {1, 2, 3, 4}
    monkeypatch.setattr(dsv3_fused_a, "_built", lambda: True)
    assert set(k3._runnable_plan(spec)) == set(range(1, 17))
    fake_cute.available = False
    assert set(k3._runnable_plan(spec)) == set(range(5, 17))
    assert k3._runnable_residual_plan(k3.KIMI_K3_PROJECTIONS[(7168, 3584)]) == {}


# ------------------------------------------------------------------- installation


class FakeLinear(nn.Module):
    """Stands in for LinearBase: a weight and a quant_method, nothing else."""

    def __init__(self, n: int, k: int, method: object | None = None) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(n, k, dtype=BF16, device="meta"))
        if method is None:
            method = k3.UnquantizedLinearMethod()
        self.quant_method = method


class FakeEmbedding(nn.Module):
    """Stands in for VocabParallelEmbedding (the input embedding)."""

    def __init__(self, n: int, k: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(n, k, dtype=BF16, device="meta"))
        self.quant_method = k3.UnquantizedEmbeddingMethod()


class FakeHead(FakeEmbedding):
    """Stands in for ParallelLMHead, a VocabParallelEmbedding subclass."""


class QuantizedLike(k3.UnquantizedLinearMethod):
    """A subclass of the unquantized method: must not be taken for it."""


@pytest.fixture
def fake_layers(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(k3, "LinearBase", FakeLinear)
    monkeypatch.setattr(k3, "ParallelLMHead", FakeHead)


def tp8_model() -> nn.Module:
    root = nn.Module()
    root.attn = nn.Module()
    root.attn.o_proj = FakeLinear(7168, 3072)  # cute M1, M2
    root.attn.fused_qkv_a_proj = FakeLinear(2112, 7168)  # dsv3 only on SM103
    root.mlp = FakeLinear(7168, 3584)  # cute + residual epilogue
    root.eh_proj = FakeLinear(*EH_PROJ)
    root.lm_head = FakeHead(20480, 7168)
    root.embed_tokens = FakeEmbedding(20480, 7168)
    root.quantized = FakeLinear(6288, 7168, object())
    root.subclassed = FakeLinear(6288, 7168, QuantizedLike())
    root.unlisted = FakeLinear(1234, 5678)
    root.bad_weight = FakeLinear(8, 8)
    root.bad_weight.weight = nn.Parameter(torch.empty(8, device="meta"))
    return root


TP8_INSTALLED = ["attn.o_proj", "attn.fused_qkv_a_proj", "mlp", "eh_proj", "lm_head"]


@pytest.mark.usefixtures("fake_layers")
def test_installs_by_type_exact_method_and_shape(monkeypatch, fake_cute) -> None:
    pin_capability(monkeypatch, SM103)
    model = tp8_model()
    untouched = {
        name: m.quant_method
        for name, m in model.named_modules()
        if name not in TP8_INSTALLED and hasattr(m, "quant_method")
    }

    assert k3.enable_kimi_k3_low_latency_gemm(model, BF16) == len(TP8_INSTALLED)

    modules = dict(model.named_modules())
    for name in TP8_INSTALLED[:-1]:
        assert type(modules[name].quant_method) is k3.KimiK3LowLatencyLinearMethod
    assert type(model.lm_head.quant_method) is k3.KimiK3LowLatencyEmbeddingMethod
    for name, method in untouched.items():
        assert modules[name].quant_method is method, name


@pytest.mark.usefixtures("fake_layers")
def test_installed_plans_are_the_runnable_table_rows(monkeypatch, fake_cute) -> None:
    pin_capability(monkeypatch, SM103)
    monkeypatch.setattr(dsv3_fused_a, "_built", lambda: False)
    model = tp8_model()
    k3.enable_kimi_k3_low_latency_gemm(model, BF16)
    for layer in (model.attn.o_proj, model.mlp, model.eh_proj, model.lm_head):
        shape = tuple(layer.weight.shape)
        assert layer.quant_method._plan == data_plan(SM103, shape, ("cute",))
    assert model.mlp.quant_method._residual_plan == data_residual_plan(
        SM103, (7168, 3584)
    )
    # dsv3 was not built: its rows stay on the normal path.
    assert model.attn.fused_qkv_a_proj.quant_method._plan == {}


@pytest.mark.usefixtures("fake_layers")
def test_module_name_plays_no_role(monkeypatch, fake_cute) -> None:
    pin_capability(monkeypatch, SM103)
    root = nn.Module()
    root.anything = FakeLinear(7168, 3072)
    root.o_proj = FakeLinear(7168, 1234)
    k3.enable_kimi_k3_low_latency_gemm(root, BF16)
    assert type(root.anything.quant_method) is k3.KimiK3LowLatencyLinearMethod
    assert type(root.o_proj.quant_method) is k3.UnquantizedLinearMethod


@pytest.mark.usefixtures("fake_layers")
def test_installation_uses_the_device_table(monkeypatch, fake_cute) -> None:
    # dense_down_proj (7168, 4224): the two tables route it differently, so the
    # installed plan shows which table was read.
    monkeypatch.setattr(dsv3_fused_a, "_built", lambda: True)
    # Only CuTe (faked) and dsv3 are built here: rows of other backends stay on cuBLAS.
    built = ("cute", "dsv3_fused_a")
    monkeypatch.setattr(k3, "_backend_available", lambda backend: backend in built)
    plans = {}
    for capability in (SM103, SM90):
        pin_capability(monkeypatch, capability)
        root = nn.Module()
        root.down = FakeLinear(7168, 4224)
        k3.enable_kimi_k3_low_latency_gemm(root, BF16)
        assert root.down.quant_method._plan == data_plan(capability, (7168, 4224), built)
        plans[capability] = root.down.quant_method._plan
    assert set(plans[SM103]) == routed_tokens(SM103, 7168, 4224) == {1}
    assert set(plans[SM90]) == set(data_plan(SM90, (7168, 4224), built)) != set()
    assert plans[SM90] != plans[SM103]


@pytest.mark.usefixtures("fake_layers")
def test_second_call_changes_nothing(monkeypatch, fake_cute) -> None:
    pin_capability(monkeypatch, SM103)
    model = tp8_model()
    k3.enable_kimi_k3_low_latency_gemm(model, BF16)
    first = {name: m.quant_method for name, m in model.named_modules()
             if hasattr(m, "quant_method")}  # fmt: skip
    assert k3.enable_kimi_k3_low_latency_gemm(model, BF16) == 0
    for name, m in model.named_modules():
        if name in first:
            assert m.quant_method is first[name]


@pytest.mark.usefixtures("fake_layers")
@pytest.mark.parametrize(
    "capability,dtype",
    [(SM103, torch.float16), (SM90, torch.float32), *[(c, BF16) for c in NO_TABLE]],
)
def test_no_installation_without_bf16_and_table(
    monkeypatch, fake_cute, capability, dtype
) -> None:
    pin_capability(monkeypatch, capability)
    model = tp8_model()
    assert k3.enable_kimi_k3_low_latency_gemm(model, dtype) == 0
    assert type(model.eh_proj.quant_method) is k3.UnquantizedLinearMethod
    assert type(model.lm_head.quant_method) is k3.UnquantizedEmbeddingMethod
    assert not fake_cute.warmups


# ------------------------------------------------------------------------ warm-up


@pytest.mark.usefixtures("fake_layers")
def test_warmup_covers_only_installed_shapes(monkeypatch, fake_cute) -> None:
    pin_capability(monkeypatch, SM103)
    model = tp8_model()
    k3.enable_kimi_k3_low_latency_gemm(model, BF16)

    table = k3.KIMI_K3_PROJECTIONS
    installed = [(7168, 3072), (2112, 7168), (7168, 3584), EH_PROJ, (20480, 7168)]
    expected = {c for s in installed for _, c in cute_configs(table[s])}
    assert fake_cute.warmed(has_residual=False) == expected
    assert fake_cute.warmed(has_residual=True) == {
        c for _, c in table[(7168, 3584)].residual_configs
    }
    assert all(dtype is BF16 for dtype, _, _ in fake_cute.warmups)
    # A TP8 model must not compile configs only TP16 shapes use.
    tp16_only = {
        c
        for shape in [(3216, 7168), (768, 7168), (1152, 1536), (4224, 7168)]
        for _, c in cute_configs(table[shape])
    } - {c for spec in table.values() if (spec.n, spec.k) in installed
         for _, c in cute_configs(spec)}  # fmt: skip
    assert tp16_only
    assert not tp16_only & fake_cute.warmed(has_residual=False)


@pytest.mark.usefixtures("fake_layers")
def test_no_warmup_without_cute(monkeypatch, fake_cute) -> None:
    pin_capability(monkeypatch, SM103)
    fake_cute.available = False
    model = tp8_model()
    assert k3.enable_kimi_k3_low_latency_gemm(model, BF16) == len(TP8_INSTALLED)
    assert not fake_cute.warmups
    assert model.eh_proj.quant_method._plan == {}


def test_request_warmup_for_an_unowned_weight(monkeypatch, fake_cute) -> None:
    pin_capability(monkeypatch, SM90)
    weight = torch.empty(6288, 7168, dtype=BF16, device="meta")
    assert k3.request_low_latency_warmup(weight) is True
    assert fake_cute.warmed(has_residual=False) == {
        c for _, c in cute_configs(k3.KIMI_K3_PROJECTIONS_SM90[(6288, 7168)])
    }
    assert fake_cute.warmed(has_residual=True) == set()


@pytest.mark.parametrize(
    "capability,shape,dtype",
    [
        (SM90, (6288, 7168), torch.float16),  # not BF16
        (SM90, (1234, 7168), BF16),  # no row
        (SM100, (1536, 128), BF16),  # dsv3-only row: nothing to compile
        (None, (6288, 7168), BF16),  # no GPU
        ((8, 0), (6288, 7168), BF16),  # no table
    ],
)
def test_request_warmup_refuses(monkeypatch, fake_cute, capability, shape, dtype):
    pin_capability(monkeypatch, capability)
    weight = torch.empty(*shape, dtype=dtype, device="meta")
    assert k3.request_low_latency_warmup(weight) is False
    assert not fake_cute.warmups


def test_request_warmup_without_cute(monkeypatch, fake_cute) -> None:
    pin_capability(monkeypatch, SM90)
    fake_cute.available = False
    weight = torch.empty(6288, 7168, dtype=BF16, device="meta")
    assert k3.request_low_latency_warmup(weight) is False
    assert not fake_cute.warmups


def test_request_warmup_counts_a_compiled_non_cute_call(monkeypatch, fake_cute) -> None:
    """No CuTe warm-up to ask for, but the row's other kernels were compiled: True."""
    pin_capability(monkeypatch, SM90)
    fake_cute.available = False
    compiled = []

    def warm_up(self, calls, dtype, *, residual=False):
        compiled.extend((call.n, call.k, call.num_tokens, call.device) for call in calls)
        return len(calls)

    monkeypatch.setattr(sab_backend, "HAS_TRITON", True)
    monkeypatch.setattr(sab_backend.SwapAb, "warm_up", warm_up)
    weight = torch.empty(6288, 7168, dtype=BF16, device="meta")
    assert k3.request_low_latency_warmup(weight) is True
    assert compiled == [(6288, 7168, m, weight.device) for m in range(4, 17)]


# ----------------------------------------------------------------- runtime guard


def test_packed_row_major_rejects_one_row_slice() -> None:
    sliced = torch.empty(1, 144)[:, :128]
    assert sliced.is_contiguous()
    assert not k3._is_packed_row_major(sliced)
    assert k3._is_packed_row_major(torch.empty(1, 128))
    assert not k3._is_packed_row_major(torch.empty(4, 128).t())
    assert not k3._is_packed_row_major(torch.empty(128))


# (M, K) x (N, K)^T at N=64, K=256 with one CuTe entry at M=2.
N, K = 64, 256
PLAN = {2: k3.PlannedCall("cute", cfg(2, 32, 2))}
WEIGHT = bf16(N, K)


def linear_layer(weight: torch.Tensor = WEIGHT):
    return SimpleNamespace(weight=weight)


@pytest.mark.usefixtures("cpu_fast_path")
def test_fast_path_runs_the_planned_kernel(fake_cute, base_apply) -> None:
    x = bf16(2, K)
    out = k3.KimiK3LowLatencyLinearMethod(PLAN).apply(linear_layer(), x)
    assert fake_cute.calls == [(2, PLAN[2].config, False)]
    assert not base_apply
    torch.testing.assert_close(out, product(x, WEIGHT))


@pytest.mark.usefixtures("cpu_fast_path")
@pytest.mark.parametrize(
    "case",
    [
        "1-D x",
        "3-D x",
        "row stride off vector width",
        "overlapping rows",
        "transposed x",
        "misaligned x",
        "x 8-byte aligned, config wants 16",
        "misaligned weight",
        "transposed weight",
        "fp16 x",
        "fp16 weight",
        "fp32 both",
        "K mismatch",
        "other device",
        "bias",
        "batch invariant",
        "M not planned",
        "M above 16",
    ],
)
def test_unsupported_input_falls_back(monkeypatch, fake_cute, base_apply, case):
    x, weight, bias, plan = bf16(2, K), WEIGHT, None, PLAN
    if case == "1-D x":
        x = bf16(K)
    elif case == "3-D x":
        x = bf16(1, 2, K)
    elif case == "row stride off vector width":
        x = bf16(2, K + 4)[:, :K]  # rows 260 apart; the config loads 8 at a time
    elif case == "overlapping rows":
        x = bf16(K + 8).as_strided((2, K), (8, 1))
    elif case == "transposed x":
        x = bf16(K, 2).t()
    elif case == "misaligned x":
        x = bf16(2 * K + 1)[1:].view(2, K)
    elif case == "x 8-byte aligned, config wants 16":
        x = bf16(2 * K + 4)[4:].view(2, K)
    elif case == "misaligned weight":
        weight = bf16(N * K + 8)[8 - 1 : N * K + 8 - 1].view(N, K)
    elif case == "transposed weight":
        weight = bf16(K, N).t()
    elif case == "fp16 x":
        x = x.half()
    elif case == "fp16 weight":
        weight = weight.half()
    elif case == "fp32 both":
        x, weight = x.float(), weight.float()
    elif case == "K mismatch":
        x = bf16(2, K // 2)
    elif case == "other device":
        weight = weight.to("meta")
    elif case == "bias":
        bias = bf16(N)
    elif case == "batch invariant":
        monkeypatch.setenv("VLLM_BATCH_INVARIANT", "1")
    elif case == "M not planned":
        x = bf16(3, K)
    elif case == "M above 16":
        x = bf16(17, K)
    method = k3.KimiK3LowLatencyLinearMethod(plan)

    assert method.apply(linear_layer(weight), x, bias) == "base"
    assert len(base_apply) == 1 and base_apply[0] is x
    assert not fake_cute.calls


@pytest.mark.usefixtures("cpu_fast_path")
def test_a_fallback_hands_the_bias_to_the_base_method(monkeypatch, fake_cute) -> None:
    got = []

    def base(self, layer, x, bias=None):
        got.append(bias)
        return "base"

    monkeypatch.setattr(k3.UnquantizedLinearMethod, "apply", base)
    bias = bf16(N)
    method = k3.KimiK3LowLatencyLinearMethod(PLAN)
    assert method.apply(linear_layer(), bf16(2, K), bias) == "base"
    assert len(got) == 1 and got[0] is bias
    assert not fake_cute.calls


@pytest.mark.usefixtures("cpu_fast_path")
def test_guard_is_what_blocks_each_case(fake_cute, base_apply) -> None:
    # Control for the test above: the same method and plan do take the fast path
    # for a well-formed input, so each fallback there comes from its one defect.
    method = k3.KimiK3LowLatencyLinearMethod(PLAN)
    assert isinstance(method.apply(linear_layer(), bf16(2, K)), torch.Tensor)
    assert len(fake_cute.calls) == 1


class FakeCompiledSkinnyGemm(FakeSkinnyGemm):
    """Also has the compiled entry point v0.28.0's wrapper calls, with its signature."""

    def __init__(self) -> None:
        super().__init__()
        self._compiled: dict = {}
        self.compiles: list = []
        self.launches: list = []

    def _compile(self, dtype, config, has_residual) -> None:
        self.compiles.append(config)

        def entry(a, b, residual, out, stream):
            self.launches.append((tuple(a.shape), a.stride(), residual is out, stream))
            out.copy_((a.float() @ b.float().t()).to(out.dtype))

        self._compiled[(dtype, config, has_residual)] = entry

    @staticmethod
    def _stream():
        return "current stream"


@pytest.mark.usefixtures("cpu_fast_path")
@pytest.mark.parametrize("m", [1, 2])
def test_row_strided_x_takes_the_compiled_kernel(monkeypatch, base_apply, m) -> None:
    # KDA's F_A: [M, 128] columns of a wider output. The kernel takes a row stride that
    # is a multiple of vector_width; the wrapper (and a packed copy) are bypassed.
    fake = FakeCompiledSkinnyGemm()
    monkeypatch.setattr(cute_skinny, "shape_dynamic_skinny_gemm", fake)
    plan = {m: k3.PlannedCall("cute", cfg(m, 32, 2))}
    x = bf16(m, K + 16)[:, :K]
    method = k3.KimiK3LowLatencyLinearMethod(plan)
    for _ in range(2):
        out = method.apply(linear_layer(), x)
        torch.testing.assert_close(out, product(x, WEIGHT))
    assert fake.compiles == [plan[m].config]  # compiled once, then reused
    assert fake.launches == [((m, K), (K + 16, 1), True, "current stream")] * 2
    assert not fake.calls and not base_apply


@pytest.mark.usefixtures("cpu_fast_path")
def test_row_strided_x_falls_back_without_the_compiled_entry_point(fake_cute, base_apply):
    method = k3.KimiK3LowLatencyLinearMethod(PLAN)
    assert method.apply(linear_layer(), bf16(2, K + 16)[:, :K]) == "base"
    assert not fake_cute.calls


@pytest.mark.usefixtures("cpu_fast_path")
@pytest.mark.parametrize("case", ["row-strided x", "x 8-byte aligned", "weight 8-byte aligned"])
def test_dsv3_wants_packed_16_byte_aligned_operands(fake_dsv3, base_apply, case) -> None:
    plan = {2: k3.PlannedCall("dsv3_fused_a", None)}
    x, weight = bf16(2, K), WEIGHT
    if case == "row-strided x":
        x = bf16(2, K + 16)[:, :K]
    elif case == "x 8-byte aligned":
        x = bf16(2 * K + 4)[4:].view(2, K)
    else:
        weight = bf16(N * K + 4)[4:].view(N, K)
    assert k3.KimiK3LowLatencyLinearMethod(plan).apply(linear_layer(weight), x) == "base"
    assert not fake_dsv3.calls


@pytest.mark.usefixtures("cpu_fast_path")
def test_4_wide_cute_config_accepts_8_byte_alignment(fake_cute, base_apply) -> None:
    # vector_width 4 loads 8 bytes: an x 8 bytes off a 16-byte boundary is legal for it.
    plan = {2: k3.PlannedCall("cute", cfg(2, 32, 2, width=4))}
    x = bf16(2 * K + 4)[4:].view(2, K)
    out = k3.KimiK3LowLatencyLinearMethod(plan).apply(linear_layer(), x)
    torch.testing.assert_close(out, product(x, WEIGHT))
    assert len(fake_cute.calls) == 1


@pytest.mark.usefixtures("fake_cute")
def test_cuda_only_by_default(base_apply) -> None:
    # Without cpu_fast_path, a CPU tensor is never sent to a kernel.
    assert not k3._runtime_ok(bf16(2, K), WEIGHT)
    assert k3.KimiK3LowLatencyLinearMethod(PLAN).apply(linear_layer(), bf16(2, K)) == (
        "base"
    )


@pytest.mark.usefixtures("cpu_fast_path")
def test_dsv3_call_gets_the_column_major_weight(fake_dsv3, base_apply) -> None:
    plan = {4: k3.PlannedCall("dsv3_fused_a", None)}
    x = bf16(4, K)
    out = k3.KimiK3LowLatencyLinearMethod(plan).apply(linear_layer(), x)
    assert fake_dsv3.calls == [(4, (1, K))]
    torch.testing.assert_close(out, product(x, WEIGHT))


class FakeLLBf16:
    """Stands in for vLLM's LLBf16Gemm: fp32 output, records the compile keys asked for."""

    keys: list = []

    class CompileKey(NamedTuple):
        backend: str
        M: int = 0
        K: int = 0
        bs: int = 0
        split_k: int = 0
        num_stages: int = 0

    def __call__(self, x, weight):
        m, k = x.shape
        FakeLLBf16.keys.append(self.dispatch(M=m, K=k, N=weight.shape[0]))
        return x.float() @ weight.float().t()


@pytest.mark.usefixtures("cpu_fast_path")
@pytest.mark.parametrize(
    "config,key",
    [
        (LLBf16Config("splitk", 2, 4), ("splitk", 0, 0, 0, 2, 4)),
        (LLBf16Config("dotprod", block_size=256), ("dotprod", 4, K, 256, 0, 0)),
    ],
)
def test_ll_bf16_runs_its_pinned_config_and_casts(monkeypatch, base_apply, config, key):
    monkeypatch.setattr(llb.ll_bf16, "LLBf16Gemm", FakeLLBf16)
    llb.runner.cache_clear()
    FakeLLBf16.keys = []
    x = bf16(4, K)
    plan = {4: k3.PlannedCall("ll_bf16", config)}
    out = k3.KimiK3LowLatencyLinearMethod(plan).apply(linear_layer(), x)
    llb.runner.cache_clear()
    assert [tuple(key_) for key_ in FakeLLBf16.keys] == [key]
    assert out.dtype is BF16
    torch.testing.assert_close(out, product(x, WEIGHT))


@pytest.mark.usefixtures("cpu_fast_path")
def test_swap_ab_and_tinygemm_calls(monkeypatch, base_apply) -> None:
    seen = []

    def fake_swap_ab(x, weight, config, residual=None, *, pdl=None):
        seen.append(("swap_ab", x.shape[0], config))
        return product(x, weight)

    def fake_tinygemm(x, weight, out, use_pdl=False):
        seen.append(("tinygemm", x.shape[0], use_pdl))
        out.copy_(product(x, weight))

    monkeypatch.setattr(sab_backend.swap_ab_gemm, "swap_ab_gemm", fake_swap_ab)
    monkeypatch.setattr(tinygemm, "_op", lambda: fake_tinygemm)
    config = SwapAbConfig(64, 128, 2, 4, 4)
    plan = {1: k3.PlannedCall("swap_ab", config), 2: k3.PlannedCall("tinygemm", None)}
    method = k3.KimiK3LowLatencyLinearMethod(plan)
    for m in (1, 2):
        x = bf16(m, K)
        torch.testing.assert_close(method.apply(linear_layer(), x), product(x, WEIGHT))
    # tinygemm without PDL: FlashInfer's kernel hangs unless everything before it uses PDL.
    assert seen == [("swap_ab", 1, config), ("tinygemm", 2, False)]
    assert not base_apply


def test_availability_of_the_new_backends(monkeypatch) -> None:
    monkeypatch.setattr(sab_backend, "HAS_TRITON", False)
    assert not k3._backend_available("swap_ab")
    monkeypatch.setattr(sab_backend, "HAS_TRITON", True)
    assert k3._backend_available("swap_ab")
    monkeypatch.setattr(tinygemm, "_op", lambda: None)
    assert not k3._backend_available("tinygemm")
    monkeypatch.setattr(llb.ll_bf16, "is_available", lambda: False)
    assert not k3._backend_available("ll_bf16")
    monkeypatch.setattr(llb.ll_bf16, "is_available", lambda: True)
    monkeypatch.setattr(dsv3_fused_a, "_built", lambda: False)  # ll_bf16's own answer counts
    assert k3._backend_available("ll_bf16")


def test_warm_up_compiles_only_on_cuda(monkeypatch) -> None:
    warmed = []
    monkeypatch.setattr(sab_backend.swap_ab_gemm, "warmup", lambda *a, **kw: warmed.append(a))
    monkeypatch.setattr(sab_backend, "HAS_TRITON", True)
    config = SwapAbConfig(64, 128, 2, 4, 4)
    spec = k3.ProjectionSpec(N, K, ((1, k3.PlannedCall("swap_ab", config)),))
    assert k3._warm_up([(spec, torch.device("cpu"))], BF16) == 0
    assert k3._warm_up([(spec, torch.device("meta"))], BF16) == 0
    assert not warmed
    assert k3._warm_up([(spec, torch.device("cuda", 0))], BF16) == 1
    assert warmed == [(config, N, K, torch.device("cuda", 0))]


def test_swap_ab_module_is_the_one_dispatched() -> None:
    assert sab_backend.swap_ab_gemm is swap_ab_gemm


@pytest.mark.usefixtures("cpu_fast_path")
def test_lm_head_method_runs_plan_then_falls_back(fake_cute, base_apply) -> None:
    method = k3.KimiK3LowLatencyEmbeddingMethod(PLAN)
    x = bf16(2, K)
    torch.testing.assert_close(method.apply(linear_layer(), x), product(x, WEIGHT))
    assert method.apply(linear_layer(), bf16(5, K)) == "base"
    assert len(fake_cute.calls) == 1 and len(base_apply) == 1


# ------------------------------------------------------------ residual epilogue

RESIDUAL_PLAN = {1: cfg(1, 32, 2)}


@pytest.mark.usefixtures("cpu_fast_path")
def test_residual_fast_path(fake_cute) -> None:
    x, residual = bf16(1, K), bf16(1, N)
    method = k3.KimiK3LowLatencyLinearMethod({}, RESIDUAL_PLAN)
    out = method.apply_with_residual(linear_layer(), x, residual)
    assert fake_cute.calls == [(1, RESIDUAL_PLAN[1], True)]
    expected = x.float() @ WEIGHT.float().t() + residual.float()
    torch.testing.assert_close(out.float(), expected, rtol=2e-2, atol=2e-2)


@pytest.mark.usefixtures("cpu_fast_path")
@pytest.mark.parametrize(
    "case",
    [
        "shape",
        "dtype",
        "device",
        "not packed",
        "M not planned",
        "bad x",
        "misaligned x",
        "batch invariant",
    ],
)
def test_bad_residual_falls_back_to_addmm(monkeypatch, fake_cute, case) -> None:
    x, residual = bf16(1, K), bf16(1, N)
    if case == "batch invariant":  # vLLM's own GEMM, so results do not depend on M
        monkeypatch.setenv("VLLM_BATCH_INVARIANT", "1")
    elif case == "shape":
        residual = bf16(2, N)
    elif case == "dtype":
        residual = residual.half()
    elif case == "device":
        residual = residual.to("meta")
    elif case == "not packed":
        residual = bf16(1, 2 * N)[:, N:]
    elif case == "M not planned":
        x, residual = bf16(2, K), bf16(2, N)
    elif case == "bad x":
        x = bf16(1, 2 * K)[:, :K]  # the residual epilogue goes through the wrapper: packed x
    elif case == "misaligned x":
        x = bf16(K + 1)[1:].view(1, K)
    sentinel = torch.zeros(1)
    seen = []
    monkeypatch.setattr(torch, "addmm", lambda *args: seen.append(args) or sentinel)
    method = k3.KimiK3LowLatencyLinearMethod({}, RESIDUAL_PLAN)

    assert method.apply_with_residual(linear_layer(), x, residual) is sentinel
    assert not fake_cute.calls
    assert seen[0][0] is residual and seen[0][1] is x


def test_residual_fallback_is_the_real_sum() -> None:
    x, weight, residual = torch.randn(3, 8), torch.randn(5, 8), torch.randn(3, 5)
    method = k3.KimiK3LowLatencyLinearMethod({}, {})
    out = method.apply_with_residual(SimpleNamespace(weight=weight), x, residual)
    torch.testing.assert_close(out, x @ weight.t() + residual)


# ---------------------------------------------------------- try_low_latency_gemm


@pytest.mark.usefixtures("cpu_fast_path")
def test_try_low_latency_gemm_routes_by_table(monkeypatch, fake_cute, fake_dsv3):
    pin_capability(monkeypatch, SM100)
    weight = bf16(1536, 128)  # SM100 (vLLM v0.29.0's table): dsv3 at M1 and M16 only
    assert routed_tokens(SM100, 1536, 128) == {1, 16}
    x = bf16(16, 128)
    out = k3.try_low_latency_gemm(x, weight)
    assert fake_dsv3.calls == [(16, (1, 128))]
    torch.testing.assert_close(out, product(x, weight))
    assert k3.try_low_latency_gemm(bf16(9, 128), weight) is None
    assert not fake_cute.calls


@pytest.mark.usefixtures("cpu_fast_path")
def test_try_low_latency_gemm_residual(monkeypatch, fake_cute) -> None:
    pin_capability(monkeypatch, SM103)
    weight = torch.zeros(7168, 3584, dtype=BF16)
    x, residual = torch.zeros(4, 3584, dtype=BF16), bf16(4, 7168)
    out = k3.try_low_latency_gemm(x, weight, residual)
    config = k3.KIMI_K3_PROJECTIONS[(7168, 3584)].residual_config(4)
    assert fake_cute.calls == [(4, config, True)]
    torch.testing.assert_close(out, residual)
    assert k3.try_low_latency_gemm(bf16(5, 3584), weight, bf16(5, 7168)) is None
    assert k3.try_low_latency_gemm(x, weight, residual.half()) is None


@pytest.mark.usefixtures("cpu_fast_path")
def test_try_low_latency_gemm_batch_invariant(monkeypatch, fake_cute, fake_dsv3):
    pin_capability(monkeypatch, SM103)
    weight, x = bf16(7168, 3584), bf16(2, 3584)  # SM103 routes M2 with and without residual
    assert k3.try_low_latency_gemm(x, weight) is not None  # control: routed otherwise
    assert k3.try_low_latency_gemm(x, weight, bf16(2, 7168)) is not None
    calls = len(fake_cute.calls) + len(fake_dsv3.calls)
    monkeypatch.setenv("VLLM_BATCH_INVARIANT", "1")
    assert k3.try_low_latency_gemm(x, weight) is None
    assert k3.try_low_latency_gemm(x, weight, bf16(2, 7168)) is None
    assert len(fake_cute.calls) + len(fake_dsv3.calls) == calls


@pytest.mark.usefixtures("cpu_fast_path")
@pytest.mark.parametrize("capability", [None, (8, 0)])
def test_try_low_latency_gemm_without_table(monkeypatch, fake_cute, capability):
    pin_capability(monkeypatch, capability)
    assert k3.try_low_latency_gemm(bf16(1, 7168), bf16(3072, 7168)) is None
    assert not fake_cute.calls


@pytest.mark.usefixtures("cpu_fast_path")
def test_try_low_latency_gemm_skips_unbuilt_backend(monkeypatch, fake_cute) -> None:
    pin_capability(monkeypatch, SM100)
    monkeypatch.setattr(dsv3_fused_a, "_built", lambda: False)
    assert k3.try_low_latency_gemm(bf16(1, 128), bf16(1536, 128)) is None


# ------------------------------------------------------------------------ callers


def test_no_kimi_k3_module_calls_upstreams_dispatch() -> None:
    """The model reaches our dispatch, not upstream's ``low_latency_gemm.py`` (left as
    upstream has it): a module of the tree that imports upstream's (v0.29.0's ``mla.py``
    does) fails here until a patch routes it to ours, instead of silently running
    upstream's tables."""
    root = Path(__file__).resolve().parents[2] / "vllm" / "models" / "kimi_k3"
    pattern = re.compile(r"\blow_latency_gemm\s+import\b|\bimport\s+low_latency_gemm\b")
    callers = sorted(
        str(path.relative_to(root))
        for path in root.rglob("*.py")
        if path.name != "low_latency_gemm.py" and pattern.search(path.read_text("utf-8"))
    )
    assert callers == []


def test_v0_28_callers_still_import_the_entry_point() -> None:
    from vllm.models.kimi_k3.nvidia import model, mtp

    assert model.enable_kimi_k3_low_latency_gemm is k3.enable_kimi_k3_low_latency_gemm
    assert mtp.enable_kimi_k3_low_latency_gemm is k3.enable_kimi_k3_low_latency_gemm


class FakeCudaDevice:
    """A hashable stand-in for a CUDA device: only its ``type`` is read."""

    type = "cuda"


def test_warm_up_on_cuda_compiles_each_non_cute_call_once(monkeypatch) -> None:
    """The CUDA branch, driven on CPU: a device that says it is CUDA, every backend said
    to be built, and each backend's compile step replaced by a recorder."""
    cuda = FakeCudaDevice()
    seen = []
    monkeypatch.setattr(sab_backend, "HAS_TRITON", True)
    monkeypatch.setattr(llb.ll_bf16, "is_available", lambda: True)
    monkeypatch.setattr(tinygemm, "_op", lambda: object())
    monkeypatch.setattr(dsv3_fused_a, "_built", lambda: True)
    monkeypatch.setattr(
        sab_backend.swap_ab_gemm, "warmup",
        lambda config, n, k, device: seen.append(("swap_ab", config, n, k, device)),
    )

    class Runner(NamedTuple):
        config: LLBf16Config

        def warmup(self, *, shapes, m_values):
            seen.append(("ll_bf16", self.config, shapes, m_values))

    monkeypatch.setattr(llb, "runner", Runner)
    zeros = torch.zeros

    def cpu_zeros(shape, *, dtype, device):
        assert device is cuda
        return zeros(shape, dtype=dtype)

    monkeypatch.setattr(tinygemm.torch, "zeros", cpu_zeros)
    monkeypatch.setattr(
        tinygemm.TinyGemm, "launch",
        lambda self, config, x, w: seen.append(("tinygemm", tuple(x.shape), tuple(w.shape),
                                                 x.dtype)),
    )
    swap = SwapAbConfig(64, 128, 2, 4, 4)
    splitk = LLBf16Config("splitk", 2, 4)
    dotprod = LLBf16Config("dotprod", block_size=256)
    spec = k3.ProjectionSpec(64, 512, (
        (1, k3.PlannedCall("swap_ab", swap)),
        (2, k3.PlannedCall("ll_bf16", splitk)),
        (3, k3.PlannedCall("ll_bf16", dotprod)),
        (4, k3.PlannedCall("tinygemm", None)),
        (5, k3.PlannedCall("dsv3_fused_a", None)),  # compiled into vllm._C: nothing to do
    ))
    assert k3._warm_up([(spec, cuda), (spec, cuda)], BF16) == 4  # one weight twice: once
    assert seen == [
        ("swap_ab", swap, 64, 512, cuda),
        ("ll_bf16", splitk, [(512, 64)], [2]),
        ("ll_bf16", dotprod, [(512, 64)], [3]),
        ("tinygemm", (4, 512), (16, 512), BF16),
    ]
