# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-k3-overlay project
"""CPU tests of the Kimi-K3 decode GEMM guards: the dispatch falls back, never raises.

Fakes, fixtures and expectations: ``kimi_k3_gemm_fakes``. GPU numerics against cuBLAS
live in test_kimi_k3_low_latency_gemm_gpu.py.
"""

from __future__ import annotations

from .kimi_k3_gemm_fakes import *  # noqa: F403 (fixtures and fakes)


# ----------------------------------------------------------------- runtime guard


def test_packed_row_major_rejects_one_row_slice() -> None:
    sliced = torch.empty(1, 144)[:, :128]
    assert sliced.is_contiguous()
    assert not k3._is_packed_row_major(sliced)
    assert k3._is_packed_row_major(torch.empty(1, 128))
    assert not k3._is_packed_row_major(torch.empty(4, 128).t())
    assert not k3._is_packed_row_major(torch.empty(128))


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
