# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-k3-overlay project
"""CPU tests of the Kimi-K3 decode GEMM tables, their routing and the backend registry.

Fakes, fixtures and expectations: ``kimi_k3_gemm_fakes``. GPU numerics against cuBLAS
live in test_kimi_k3_low_latency_gemm_gpu.py.
"""

from __future__ import annotations

from .kimi_k3_gemm_fakes import *  # noqa: F403 (fixtures and fakes)


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
    # csrc/libtorch_stable/ in v0.28.0 and v0.29.0, csrc/ in v0.33.0.
    (path,) = (Path(__file__).resolve().parents[2] / "csrc").rglob("dsv3_fused_a_gemm.cu")
    source = path.read_text(encoding="utf-8")
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
    sm90_rows, _ = DATA[SM90]
    assert k3.select_kimi_k3_backend(1, *EH_PROJ, capability=SM90) == sm90_rows[EH_PROJ][1][0]
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
    assert len(modules) == len(all_ops)  # every module, of whatever op, is found
    assert len(k3.BACKENDS) >= 5 and set(k3.BACKENDS) < {b.name for b in all_ops}
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
    selector, the plan, the plan with every backend built, and the routed rows, all from
    the data modules (which the registry did not change): the registry routes what the
    if/elif dispatch it replaced did (the same answers were also compared, run against
    run, before and after the change)."""
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
