# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-k3-overlay project
"""CPU tests of the Kimi-K3 KDA decode projections on two streams (vllm-k3-overlay).

No GPU needed: the device capability is pinned per test, CUDA-graph capture is
monkeypatched where a test needs "capturing", FlashInfer is absent, old or a stub
module, and the aux stream is None (``maybe_execute_in_parallel`` then runs both
branches on the current stream; which callable goes to which stream is checked with
a recorder). GPU numerics and the two real streams: test_kimi_k3_kda_projection_gpu.py.
"""

from __future__ import annotations

import os
import sys
from types import ModuleType, SimpleNamespace

import pytest
import torch
from torch import nn

from vllm.models.kimi_k3.nvidia import kda_projection as kp
from vllm.models.kimi_k3.nvidia import low_latency_gemm_dispatch as llg

# The capability pin and the CPU fast-path fixture of the low-latency GEMM tests.
from .kimi_k3_gemm_fakes import cpu_fast_path, pin_capability  # noqa: F401

SM103, SM107, SM100, SM90 = (10, 3), (10, 7), (10, 0), (9, 0)
BF16 = torch.bfloat16
PACKED, F_B = kp.KDA_PACKED_SHAPE, kp.KDA_F_B_SHAPE


def pin_tokens(monkeypatch: pytest.MonkeyPatch, capability, tokens) -> None:
    """Give ``capability`` the measured set ``tokens`` (and no other architecture any)."""
    where = kp.OverlapTokens(frozenset(tokens), "test figure")
    monkeypatch.setattr(kp, "KDA_OVERLAP_TOKENS", {capability: where})


@pytest.fixture(autouse=True)
def breakable_flag_off(monkeypatch: pytest.MonkeyPatch) -> None:
    """The opt-out, whatever this machine's environment says; a test of the default sets
    ``VLLM_USE_BREAKABLE_CUDAGRAPH=1`` itself."""
    monkeypatch.setenv("VLLM_USE_BREAKABLE_CUDAGRAPH", "0")


@pytest.fixture
def warmups(monkeypatch: pytest.MonkeyPatch) -> list:
    """Record the weights whose CuTe warm-up is requested."""
    seen: list = []
    monkeypatch.setattr(
        llg, "request_low_latency_warmup", lambda w: seen.append(tuple(w.shape)) or True
    )
    return seen


# ------------------------------------------------------------------ FlashInfer


class FakeMmBf16:
    """``flashinfer.mm_bf16`` of a release whose cute-dsl backend serves ``ccs``."""

    def __init__(self, ccs: tuple[int, ...] | None) -> None:
        self.ccs = ccs
        self.calls: list = []
        self.tuning: list[bool] = []

    def is_backend_supported(self, backend, cc=None):
        if self.ccs is None or backend != "cute-dsl":
            return False
        return cc is None or cc in self.ccs

    def __call__(self, a, b, backend="cudnn", **kwargs):
        self.calls.append((tuple(a.shape), tuple(b.shape), b.stride(), backend))
        return (a.float() @ b.float()).to(a.dtype)


def install_flashinfer(monkeypatch, mm_bf16) -> ModuleType:
    """Put a stand-in ``flashinfer`` module (with ``mm_bf16`` and ``autotune``) in place."""
    module = ModuleType("flashinfer")
    state = {"tuning": False}

    class Autotune:
        def __init__(self, tune_mode=False):
            self.tune_mode = tune_mode

        def __enter__(self):
            state["tuning"] = self.tune_mode

        def __exit__(self, *exc):
            state["tuning"] = False

    if mm_bf16 is not None:
        module.mm_bf16 = mm_bf16
        original = type(mm_bf16).__call__

        def call(self, *args, **kwargs):
            self.tuning.append(state["tuning"])
            return original(self, *args, **kwargs)

        monkeypatch.setattr(type(mm_bf16), "__call__", call)
    module.autotune = Autotune
    monkeypatch.setitem(sys.modules, "flashinfer", module)
    return module


def test_flashinfer_absent(monkeypatch) -> None:
    pin_capability(monkeypatch, SM100)
    monkeypatch.setitem(sys.modules, "flashinfer", None)  # import raises ImportError
    assert kp._kda_qkvg_flashinfer_backend() is None


@pytest.mark.parametrize(
    "mm_bf16",
    [None, SimpleNamespace(), FakeMmBf16(ccs=None)],
    ids=["no mm_bf16", "mm_bf16 without backends", "mm_bf16 without cute-dsl"],
)
def test_old_flashinfer_has_no_qkvg_backend(monkeypatch, mm_bf16) -> None:
    # v0.28.0 pins 0.6.16.post3: mm_bf16 exists there but offers no cute-dsl backend.
    pin_capability(monkeypatch, SM100)
    module = install_flashinfer(monkeypatch, None)
    if mm_bf16 is not None:
        module.mm_bf16 = mm_bf16
    assert kp._kda_qkvg_flashinfer_backend() is None


@pytest.mark.parametrize(
    "capability,expected",
    [(SM100, "cute-dsl"), (SM103, "cute-dsl"), (SM107, None), (SM90, None), (None, None)],
)
def test_new_flashinfer_offers_cute_dsl_where_it_says(monkeypatch, capability, expected):
    pin_capability(monkeypatch, capability)
    install_flashinfer(monkeypatch, FakeMmBf16(ccs=(100, 103)))
    assert kp._kda_qkvg_flashinfer_backend() == expected


def test_a_flashinfer_that_raises_on_the_query_is_absent(monkeypatch) -> None:
    pin_capability(monkeypatch, SM100)

    class Raising(FakeMmBf16):
        def is_backend_supported(self, backend, cc=None):
            raise ValueError("no backend choices")

    install_flashinfer(monkeypatch, Raising(ccs=(100,)))
    assert kp._kda_qkvg_flashinfer_backend() is None


# ---------------------------------------------------------------- where it runs


@pytest.mark.parametrize("capability", [SM103, SM107, SM100, (8, 0), (12, 0), None])
def test_unmeasured_architectures_keep_the_overlap_off(capability) -> None:
    # B300's upstream limit (14) is not reused: no figure of ours, no overlap.
    assert kp.overlap_tokens(capability) == kp.NOT_MEASURED
    assert kp.NOT_MEASURED.tokens == frozenset()


def test_every_measured_set_is_decode_sized_with_a_source() -> None:
    assert SM90 in kp.KDA_OVERLAP_TOKENS
    for capability, where in kp.KDA_OVERLAP_TOKENS.items():
        assert where.tokens <= set(range(1, 17)), capability
        assert where.source
        assert kp.overlap_tokens(capability) is where


@pytest.mark.parametrize("flag, capability, want", [("1", SM90, "flag"), ("0", SM90, "measured"),
                                                     (None, SM90, "measured"), ("1", SM100, "none")])
def test_the_process_set_is_the_measured_one_unless_the_breakable_flag_is_on(monkeypatch, flag, capability,
                                                                              want) -> None:  # fmt: skip
    """What the layers get and the decode-step replay of a mode runs (the mode's environment)."""
    if flag is None:
        monkeypatch.delenv("VLLM_USE_BREAKABLE_CUDAGRAPH", raising=False)
    else:
        monkeypatch.setenv("VLLM_USE_BREAKABLE_CUDAGRAPH", flag)
    expected = {"flag": kp.FLAG_DEFAULT, "measured": kp.overlap_tokens(SM90), "none": kp.NOT_MEASURED}[want]
    assert kp.deployment_overlap_tokens(capability) is expected


@pytest.mark.parametrize("in_config, want", [(True, "flag"), (False, "measured"), (None, "measured"),
                                              ("no config", "measured")])
def test_a_release_that_keeps_the_flag_in_the_compilation_config_is_read_there(monkeypatch, in_config,
                                                                                want) -> None:  # fmt: skip
    """v0.34.0: ``is_breakable_cudagraph_enabled(compilation_config)``, the config's value first and
    the environment variable (off here) only where the config leaves it None."""
    import vllm.config
    from vllm.compilation import breakable_cudagraph

    def enabled(compilation_config=None) -> bool:
        value = getattr(compilation_config, "use_breakable_cudagraph", None)
        return bool(int(os.environ["VLLM_USE_BREAKABLE_CUDAGRAPH"])) if value is None else value

    config = SimpleNamespace(compilation_config=SimpleNamespace(use_breakable_cudagraph=in_config))
    monkeypatch.setattr(breakable_cudagraph, "is_breakable_cudagraph_enabled", enabled)
    # outside a config's context (the decode-step replay): None, the variable decides
    monkeypatch.setattr(vllm.config, "get_current_vllm_config_or_none",
                        lambda: None if in_config == "no config" else config)
    expected = {"flag": kp.FLAG_DEFAULT, "measured": kp.overlap_tokens(SM90)}[want]
    assert kp.deployment_overlap_tokens(SM90) is expected


def test_sm90_set_names_the_h200_run() -> None:
    where = kp.overlap_tokens(SM90)
    assert where.tokens == frozenset(kp.SM90_OVERLAP_TOKENS)
    assert "H200" in where.source and "kda_bench_sm90.json" in where.source


# ----------------------------------------------------------- layers and gating


class FakeLinear(nn.Module):
    """A linear layer stand-in: a weight and an exact quant method."""

    def __init__(self, n, k, dtype=BF16, method=None) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(n, k, dtype=dtype), requires_grad=False)
        self.quant_method = method if method is not None else llg.UnquantizedLinearMethod()


class FakeKDA(nn.Module):
    """What patch 0003 gives a KimiK3DeltaAttention: attributes only, no forward."""

    def __init__(self, tp_size=8, packed=PACKED, f_b=F_B, aux=True, events=True) -> None:
        super().__init__()
        self.tp_size = tp_size
        self.in_proj_qkvgfab = FakeLinear(*packed)
        self.f_b_proj = FakeLinear(*f_b)
        self.aux_stream = object() if aux else None
        self.kda_overlap_events = (object(), object()) if events else None
        self.kda_overlap_tokens = frozenset()
        self.kda_qkvg_backend = None


def _model(**kda_kwargs) -> nn.Module:
    root = nn.Module()
    root.layers = nn.ModuleList([FakeKDA(**kda_kwargs), nn.Linear(4, 4)])
    return root


def _unpatched_layer() -> nn.Module:
    layer = FakeKDA()
    del layer.kda_overlap_tokens  # v0.28.0's kda.py without patch 0003
    return layer


DISQUALIFIED = {
    "TP16": lambda: FakeKDA(tp_size=16),
    "TP8 with TP16 shapes": lambda: FakeKDA(packed=(3216, 7168), f_b=(768, 128)),
    "no aux stream": lambda: FakeKDA(aux=False),
    "no events": lambda: FakeKDA(events=False),
    "unpatched kda.py": _unpatched_layer,
}


@pytest.mark.usefixtures("cpu_fast_path")
def test_tp8_bf16_layer_with_stream_and_events_qualifies() -> None:
    model = _model()
    assert list(kp.qualifying_layers(model)) == [model.layers[0]]


@pytest.mark.usefixtures("cpu_fast_path")
@pytest.mark.parametrize("case", DISQUALIFIED)
def test_disqualified_layers(case) -> None:
    root = nn.Module()
    root.layer = DISQUALIFIED[case]()
    assert list(kp.qualifying_layers(root)) == []


@pytest.mark.usefixtures("cpu_fast_path")
@pytest.mark.parametrize("what", ["fp16 packed", "fp16 f_b", "quantized", "sliced weight"])
def test_weights_must_be_plain_packed_bf16(what) -> None:
    layer = FakeKDA()
    if what == "fp16 packed":
        layer.in_proj_qkvgfab = FakeLinear(*PACKED, dtype=torch.float16)
    elif what == "fp16 f_b":
        layer.f_b_proj = FakeLinear(*F_B, dtype=torch.float16)
    elif what == "quantized":
        layer.in_proj_qkvgfab.quant_method = type("Quantized", (llg.UnquantizedLinearMethod,), {})()
    else:
        layer.f_b_proj.weight = nn.Parameter(torch.empty(F_B[0], 2 * F_B[1], dtype=BF16)[:, : F_B[1]])
    assert not kp._qualifies(layer)


def test_weights_off_the_gpu_do_not_qualify() -> None:
    # Without cpu_fast_path, CPU weights are not on the fast path's device.
    assert list(kp.qualifying_layers(_model())) == []


@pytest.mark.usefixtures("cpu_fast_path")
def test_our_planned_method_still_counts_as_plain_bf16() -> None:
    layer = FakeKDA()
    layer.in_proj_qkvgfab.quant_method = llg.KimiK3LowLatencyLinearMethod({})
    assert kp._qualifies(layer)


# --------------------------------------------------------------------- autotune


@pytest.mark.usefixtures("cpu_fast_path")
def test_sm90_uses_the_table_and_its_measured_set(monkeypatch, warmups) -> None:
    pin_capability(monkeypatch, SM90)
    pin_tokens(monkeypatch, SM90, {5, 6})
    monkeypatch.setitem(sys.modules, "flashinfer", None)
    model = _model()
    assert kp.autotune_kda_qkvg(model) == 1
    layer = model.layers[0]
    assert (layer.kda_overlap_tokens, layer.kda_qkvg_backend) == ({5, 6}, None)
    # QKVG rows, F_A/beta rows (views of the packed weight) and F_B.
    assert warmups == [(6144, 7168), (144, 7168), (1536, 128)]


@pytest.mark.usefixtures("cpu_fast_path")
def test_the_breakable_flag_keeps_the_overlap_off_and_says_so(monkeypatch, warmups) -> None:
    """v0.28.0's default for Kimi-K3 (the breakable flag on; a decode batch is one full graph
    where the overlap measured no faster than the packed GEMM): nothing of the two-stream
    path is set up, not even where this GPU measured it alone, and the log says so once;
    the packed GEMM and f_b keep their own (planned) linear methods."""
    pin_capability(monkeypatch, SM90)
    pin_tokens(monkeypatch, SM90, {5, 6})
    monkeypatch.setenv("VLLM_USE_BREAKABLE_CUDAGRAPH", "1")
    asked: list = []
    monkeypatch.setattr(kp, "_kda_qkvg_flashinfer_backend", lambda: asked.append(1) or "cute-dsl")
    lines: list = []
    monkeypatch.setattr(kp.logger, "info", lambda msg, *args: lines.append(msg % args))
    model = _model()
    model.layers.append(FakeKDA())
    streams = [layer.aux_stream for layer in model.layers[::2]]
    assert kp.autotune_kda_qkvg(model) == 2
    for layer, stream in zip(model.layers[::2], streams):
        assert (layer.kda_overlap_tokens, layer.kda_qkvg_backend) == (frozenset(), None)
        assert layer.aux_stream is stream
    assert warmups == [] and asked == [], "nothing to warm or tune for a path that never runs"
    assert len(lines) == 1 and "VLLM_USE_BREAKABLE_CUDAGRAPH" in lines[0]


def test_the_sm90_gemm_table_plans_both_packed_kda_projections() -> None:
    """What serves the KDA projections off the overlap (a breakable capture, an M outside
    the measured set): the table's rows for the packed in_proj and for f_b (on the strided
    F_A slice), so the planned methods ``enable_kimi_k3_low_latency_gemm`` installs run our
    kernels there."""
    table = llg.TABLES_BY_CAPABILITY[SM90]
    packed, f_b = table[PACKED], table[F_B]
    assert {m for m, _ in packed.winners} == set(range(1, 17))
    assert len(f_b.winners) >= 12


@pytest.mark.usefixtures("cpu_fast_path")
@pytest.mark.parametrize(
    "tokens,high,moved",
    [({5}, True, True), ({5}, False, False), (set(), True, False)],
    ids=["measured faster there", "model's stream measured faster", "overlap off"],
)
def test_chain_moves_to_the_high_priority_stream_only_where_measured(
    monkeypatch, warmups, tokens, high, moved
) -> None:
    pin_capability(monkeypatch, SM90)
    where = kp.OverlapTokens(frozenset(tokens), "test figure", high_priority_aux=high)
    monkeypatch.setattr(kp, "KDA_OVERLAP_TOKENS", {SM90: where})
    monkeypatch.setitem(sys.modules, "flashinfer", None)
    asked: list = []
    monkeypatch.setattr(kp, "high_priority_aux_stream", lambda dev: asked.append(dev) or "high")
    model = _model()
    model.layers.append(FakeKDA())
    models_stream = [layer.aux_stream for layer in model.layers[::2]]
    kp.autotune_kda_qkvg(model)
    streams = [layer.aux_stream for layer in model.layers[::2]]
    assert streams == (["high", "high"] if moved else models_stream)
    # One stream per device, asked for with the layer's weight device.
    assert asked == ([torch.device("cpu")] * 2 if moved else [])


def test_sm90_stream_choice_is_the_committed_runs() -> None:
    where = kp.overlap_tokens(SM90)
    assert where.high_priority_aux is kp.SM90_HIGH_PRIORITY_AUX


@pytest.mark.usefixtures("cpu_fast_path")
def test_new_flashinfer_is_warmed_and_tuned_where_the_overlap_runs(monkeypatch, warmups):
    pin_capability(monkeypatch, SM100)
    pin_tokens(monkeypatch, SM100, {3, 1, 2})
    mm = FakeMmBf16(ccs=(100, 103))
    install_flashinfer(monkeypatch, mm)
    model = _model()
    assert kp.autotune_kda_qkvg(model) == 1
    layer = model.layers[0]
    assert (layer.kda_overlap_tokens, layer.kda_qkvg_backend) == ({1, 2, 3}, "cute-dsl")
    # One call per M, on the QKVG rows as a column-major (K, N) operand, all tuning.
    assert [c[0] for c in mm.calls] == [(1, 7168), (2, 7168), (3, 7168)]
    assert {c[1:] for c in mm.calls} == {((7168, 6144), (1, 7168), "cute-dsl")}
    assert mm.tuning == [True, True, True]
    assert warmups == []


@pytest.mark.usefixtures("cpu_fast_path")
@pytest.mark.parametrize("flashinfer", ["absent", "old"])
def test_without_new_flashinfer_sm100_falls_back_to_the_table(monkeypatch, warmups, flashinfer):
    pin_capability(monkeypatch, SM100)
    pin_tokens(monkeypatch, SM100, {2})
    if flashinfer == "absent":
        monkeypatch.setitem(sys.modules, "flashinfer", None)
    else:
        install_flashinfer(monkeypatch, FakeMmBf16(ccs=None))
    model = _model()
    kp.autotune_kda_qkvg(model)
    assert model.layers[0].kda_qkvg_backend is None
    assert model.layers[0].kda_overlap_tokens == {2}
    assert warmups == [(6144, 7168), (144, 7168), (1536, 128)]


@pytest.mark.usefixtures("cpu_fast_path")
def test_unmeasured_architecture_tunes_nothing(monkeypatch, warmups) -> None:
    pin_capability(monkeypatch, SM103)
    mm = FakeMmBf16(ccs=(100, 103))
    install_flashinfer(monkeypatch, mm)
    model = _model()
    kp.autotune_kda_qkvg(model)
    assert model.layers[0].kda_overlap_tokens == frozenset()
    assert not mm.calls and not warmups


@pytest.mark.usefixtures("cpu_fast_path")
def test_enable_step_runs_after_the_low_latency_enable(monkeypatch, warmups) -> None:
    """The model's order (patch 0004): the dispatch's enable, then the KDA enable."""
    pin_capability(monkeypatch, SM90)
    pin_tokens(monkeypatch, SM90, {5})
    monkeypatch.setitem(sys.modules, "flashinfer", None)
    monkeypatch.setattr(llg, "LinearBase", FakeLinear)  # let the table plan the fakes
    model = _model()
    llg.enable_kimi_k3_low_latency_gemm(model, BF16)
    assert model.layers[0].kda_overlap_tokens == frozenset()  # the dispatch leaves KDA alone
    assert kp.enable_kda_projection_overlap(model, BF16) == 1
    assert model.layers[0].kda_overlap_tokens == {5}
    # The packed GEMM and F_B also got the table's planned method for their own forward.
    assert type(model.layers[0].in_proj_qkvgfab.quant_method) is llg.KimiK3LowLatencyLinearMethod


@pytest.mark.usefixtures("cpu_fast_path")
@pytest.mark.parametrize("capability,dtype", [(SM90, torch.float16), (None, BF16), ((8, 0), BF16)])
def test_enable_step_is_a_no_op_off_bf16_or_without_a_table(monkeypatch, capability, dtype):
    pin_capability(monkeypatch, capability)
    pin_tokens(monkeypatch, SM90, {5})
    model = _model()
    llg.enable_kimi_k3_low_latency_gemm(model, dtype)
    assert kp.enable_kda_projection_overlap(model, dtype) == 0
    assert model.layers[0].kda_overlap_tokens == frozenset()


# ------------------------------------------------------------- capture gating


@pytest.mark.parametrize(
    "num_tokens,tokens,capturing,expected",
    [
        (5, {5, 6, 16}, True, True),
        (16, {5, 6, 16}, True, True),
        (7, {5, 6, 16}, True, False),  # between measured wins: not one of them
        (1, {5, 6, 16}, True, False),
        (0, {5, 6, 16}, True, False),  # an empty batch
        (2, set(), True, False),  # nothing measured: off
        (5, {5, 6, 16}, False, False),  # eager
        (4096, set(range(1, 17)), True, False),  # prefill-sized
    ],
)
def test_overlap_only_at_measured_decode_sizes_under_capture(
    monkeypatch, num_tokens, tokens, capturing, expected
) -> None:
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: capturing)
    assert kp.use_kda_projection_overlap(num_tokens, frozenset(tokens)) is expected


def test_no_overlap_under_breakable_capture(monkeypatch) -> None:
    from vllm.compilation.breakable_cudagraph import BreakableCUDAGraphCapture

    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: True)
    monkeypatch.setattr(BreakableCUDAGraphCapture, "is_active", classmethod(lambda cls: True))
    monkeypatch.setattr(kp, "_breakable_refusal_logged", [])
    lines: list = []
    monkeypatch.setattr(kp.logger, "info", lambda msg, *args: lines.append(msg % args))
    assert not kp.use_kda_projection_overlap(1, frozenset({1}))
    assert not kp.use_kda_projection_overlap(1, frozenset({1}))
    assert len(lines) == 1 and "breakable" in lines[0], "said once"
    monkeypatch.setattr(BreakableCUDAGraphCapture, "is_active", classmethod(lambda cls: False))
    assert kp.use_kda_projection_overlap(1, frozenset({1})), "a decode batch's full graph: on"
    assert not kp.use_kda_projection_overlap(2, frozenset({1})) and len(lines) == 1


# -------------------------------------------------------------- the projections

# A scaled-down KDA layer: P = H * D with D = 8, H = 4; packed = 4P + D + H + 4 padding.
D, H, K_SMALL = 8, 4, 64
P = D * H
PAD = 4


def _small_weights(seed=0):
    g = torch.Generator().manual_seed(seed)
    packed = torch.randn(4 * P + D + H + PAD, K_SMALL, generator=g).to(BF16)
    packed[-PAD:] = 0  # the layer zeroes its padding rows
    f_b = torch.randn(P, D, generator=g).to(BF16)
    return packed, f_b


def _sequential(x, packed, f_b):
    """v0.28.0's path written out: packed GEMM, split, F_B on the strided F_A slice."""
    out = (x.float() @ packed.float().t()).to(BF16)
    f_a, beta = out[:, 4 * P : 4 * P + D], out[:, 4 * P + D : 4 * P + D + H]
    return out[:, : 4 * P], (f_a.float() @ f_b.float().t()).to(BF16), beta


@pytest.mark.parametrize("m", [1, 3, 16])
def test_overlap_computes_the_sequential_projections(m) -> None:
    packed, f_b = _small_weights(m)
    x = torch.randn(m, K_SMALL).to(BF16)
    qkvg, f_b_out, beta = kp.run_kda_projection_overlap(x, packed, f_b, None, (None, None))
    want = _sequential(x, packed, f_b)
    for got, ref in zip((qkvg, f_b_out, beta), want):
        torch.testing.assert_close(got, ref, rtol=2e-2, atol=2e-2)
    # What kda.py and the fused decode kernel ask of them: unit column stride, packed
    # QKVG and F_B, beta a view into the F_A/beta output.
    assert qkvg.stride() == (4 * P, 1) and f_b_out.stride() == (P, 1)
    assert beta.shape == (m, H) and beta.stride() == (D + H + PAD, 1)


def test_qkvg_runs_here_and_the_f_a_chain_on_the_aux_stream(monkeypatch) -> None:
    packed, f_b = _small_weights()
    x = torch.randn(2, K_SMALL).to(BF16)
    log: list = []
    monkeypatch.setattr(kp, "_table_gemm", lambda a, w: log.append(tuple(w.shape)) or a @ w.t())

    class Event:
        def __init__(self, name):
            self.name = name

        def record(self):
            log.append(f"{self.name}.record")

        def wait(self):
            log.append(f"{self.name}.wait")

    class StreamContext:
        def __init__(self, stream):
            self.stream = stream

        def __enter__(self):
            log.append(f"enter {self.stream}")

        def __exit__(self, *exc):
            log.append(f"exit {self.stream}")

    monkeypatch.setattr(torch.cuda, "stream", StreamContext)
    out = kp.run_kda_projection_overlap(x, packed, f_b, "aux", (Event("fork"), Event("join")))
    assert log == [
        "fork.record", (4 * P, K_SMALL),  # QKVG on the current stream
        "enter aux", "fork.wait", (D + H + PAD, K_SMALL), (P, D), "join.record", "exit aux",
        "join.wait",  # the current stream waits for F_B before anyone reads it
    ]  # fmt: skip
    for got, ref in zip(out, _sequential(x, packed, f_b)):
        torch.testing.assert_close(got, ref, rtol=2e-2, atol=2e-2)


def test_qkvg_on_flashinfer_when_the_layer_says_so(monkeypatch) -> None:
    mm = FakeMmBf16(ccs=(100,))
    install_flashinfer(monkeypatch, mm)
    packed, f_b = _small_weights()
    x = torch.randn(2, K_SMALL).to(BF16)
    qkvg, _, _ = kp.run_kda_projection_overlap(x, packed, f_b, None, (None, None),
                                               qkvg_backend="cute-dsl")  # fmt: skip
    assert mm.calls == [((2, K_SMALL), (K_SMALL, 4 * P), (1, K_SMALL), "cute-dsl")]
    torch.testing.assert_close(qkvg, _sequential(x, packed, f_b)[0], rtol=2e-2, atol=2e-2)


@pytest.mark.usefixtures("cpu_fast_path")
def test_each_gemm_asks_the_table_first(monkeypatch) -> None:
    asked: list = []

    def table(x, w, residual=None):
        asked.append((tuple(x.shape), x.stride(), tuple(w.shape)))
        return None  # no row: cuBLAS

    monkeypatch.setattr(llg, "try_low_latency_gemm", table)
    packed, f_b = _small_weights()
    kp.run_kda_projection_overlap(torch.randn(3, K_SMALL).to(BF16), packed, f_b, None, (None, None))
    # F_B is asked with the strided F_A view itself: no packed copy is made.
    assert asked == [
        ((3, K_SMALL), (K_SMALL, 1), (4 * P, K_SMALL)),
        ((3, K_SMALL), (K_SMALL, 1), (D + H + PAD, K_SMALL)),
        ((3, D), (D + H + PAD, 1), (P, D)),
    ]


# ------------------------------------------------------- patched kda.py forward

kda = pytest.importorskip("vllm.models.kimi_k3.nvidia.kda")
# On a rebase target where patch 0003 conflicted, kda.py is upstream's: nothing to test.
needs_patch_0003 = pytest.mark.skipif(
    not hasattr(kda, "run_kda_projection_overlap"), reason="kda.py without patch 0003 here"
)


class Linear:
    """``layer(x) -> (x @ weight.T, None)`` as vLLM's linear layers return."""

    def __init__(self, weight):
        self.weight = weight
        self.calls = 0

    def __call__(self, x):
        self.calls += 1
        return (x.float() @ self.weight.float().t()).to(x.dtype), None


def _fake_kda(tokens):
    """An object with what KimiK3DeltaAttention.forward reads, at the small shapes."""
    packed, f_b = _small_weights(7)
    fed: list = []
    layer = SimpleNamespace(
        in_proj_qkvgfab=Linear(packed),
        f_b_proj=Linear(f_b),
        local_projection_size=P,
        head_dim=D,
        local_num_heads=H,
        in_proj_padding=PAD,
        aux_stream=None,
        kda_overlap_events=(None, None),
        kda_overlap_tokens=frozenset(tokens),
        kda_qkvg_backend=None,
        run_gemm_rs=False,
        o_proj=lambda t: (t, None),
    )
    layer._forward = lambda **kw: fed.append(kw)
    return layer, fed


def _forward(layer, x):
    return kda.KimiK3DeltaAttention.forward(layer, x, positions=None)


@pytest.mark.parametrize(
    "num_tokens,capturing",
    [(2, False), (64, True), (64, False)],
    ids=["eager decode", "prefill under capture", "prefill"],
)
@needs_patch_0003
def test_patched_forward_keeps_prefill_and_eager_on_the_packed_gemm(monkeypatch, num_tokens, capturing):
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: capturing)
    monkeypatch.setattr(kda, "run_kda_projection_overlap", pytest.fail)
    layer, fed = _fake_kda(tokens=[2])
    _forward(layer, torch.randn(num_tokens, K_SMALL).to(BF16))
    assert (layer.in_proj_qkvgfab.calls, layer.f_b_proj.calls) == (1, 1)
    assert len(fed) == 1


@needs_patch_0003
def test_patched_forward_under_breakable_capture_runs_the_packed_layers(monkeypatch) -> None:
    from vllm.compilation.breakable_cudagraph import BreakableCUDAGraphCapture

    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: True)
    monkeypatch.setattr(BreakableCUDAGraphCapture, "is_active", classmethod(lambda cls: True))
    monkeypatch.setattr(kda, "run_kda_projection_overlap", pytest.fail)
    layer, fed = _fake_kda(tokens=[2])
    _forward(layer, torch.randn(2, K_SMALL).to(BF16))
    assert (layer.in_proj_qkvgfab.calls, layer.f_b_proj.calls) == (1, 1)
    assert len(fed) == 1


@needs_patch_0003
def test_patched_forward_overlaps_at_captured_decode_with_the_same_inputs(monkeypatch) -> None:
    x = torch.randn(3, K_SMALL).to(BF16)
    layer, fed = _fake_kda(tokens=[3])
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: False)
    _forward(layer, x)  # eager: the packed path, for reference
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: True)
    calls = []
    real = kda.run_kda_projection_overlap
    monkeypatch.setattr(kda, "run_kda_projection_overlap",
                        lambda *a, **kw: calls.append((a[1:], kw)) or real(*a, **kw))  # fmt: skip
    _forward(layer, x)
    assert (layer.in_proj_qkvgfab.calls, layer.f_b_proj.calls) == (1, 1)  # not again
    (args, kwargs), = calls
    assert args[0] is layer.in_proj_qkvgfab.weight and args[1] is layer.f_b_proj.weight
    assert args[2:] == (layer.aux_stream, layer.kda_overlap_events)
    assert kwargs == {"qkvg_backend": None}
    packed_path, overlap_path = fed
    assert packed_path.keys() == overlap_path.keys()
    for name in packed_path:
        want, got = packed_path[name], overlap_path[name]
        assert got.shape == want.shape, name
        if name != "core_attn_out":  # an empty output buffer
            torch.testing.assert_close(got, want, rtol=2e-2, atol=2e-2, msg=name)
