# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-k3-overlay project
"""CPU tests of the Kimi-K3 decode GEMM dispatch: plans, installation, warm-up, callers.

Fakes, fixtures and expectations: ``kimi_k3_gemm_fakes``. GPU numerics against cuBLAS
live in test_kimi_k3_low_latency_gemm_gpu.py.
"""

from __future__ import annotations

from .kimi_k3_gemm_fakes import *  # noqa: F403 (fixtures and fakes)


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
    # CuTe (faked), dsv3 and swap-AB count as built here (nothing is launched): rows of
    # other backends stay on cuBLAS.
    built = ("cute", "dsv3_fused_a", "swap_ab")
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
    # The KDA QKVG row view (6144, 7168), a weight no linear module owns; its SM90 rows
    # at small M are CuTe's (the KDA figures' rows).
    pin_capability(monkeypatch, SM90)
    weight = torch.empty(6144, 7168, dtype=BF16, device="meta")
    want = {c for _, c in cute_configs(k3.KIMI_K3_PROJECTIONS_SM90[(6144, 7168)])}
    assert want
    assert k3.request_low_latency_warmup(weight) is True
    assert fake_cute.warmed(has_residual=False) == want
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
    swap_ab = [m for m, call in k3.KIMI_K3_PROJECTIONS_SM90[(6288, 7168)].winners
               if call.backend == "swap_ab"]  # fmt: skip
    assert swap_ab and compiled == [(6288, 7168, m, weight.device) for m in swap_ab]


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


# The patch that points each caller at our dispatch: 0004 (model.py), 0002 (mtp.py).
CALLERS = {"model": "0004", "mtp": "0002"}


@pytest.mark.parametrize("caller", sorted(CALLERS))
def test_v0_28_callers_import_the_entry_point_from_our_dispatch(caller) -> None:
    import importlib

    module = importlib.import_module(f"vllm.models.kimi_k3.nvidia.{caller}")
    source = Path(module.__file__).read_text("utf-8")
    if "low_latency_gemm_dispatch import" not in source:  # a rebase target where it conflicted
        pytest.skip(f"patch {CALLERS[caller]} is not applied to {caller}.py in this tree")
    assert module.enable_kimi_k3_low_latency_gemm is k3.enable_kimi_k3_low_latency_gemm


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
