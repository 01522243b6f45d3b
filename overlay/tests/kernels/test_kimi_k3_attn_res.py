# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-k3-overlay project
"""CPU tests of our one-launch attn-res kernel and its dispatch (vllm-k3-overlay).

* the kernel (``nvidia/attn_res.py``) runs on Triton's interpreter (``TRITON_INTERPRET=1``,
  in a subprocess: Triton reads it when first imported) against float64 of the math, for
  every flag combination (delta, block write, output norm), NB in {0, 1, 2, 8, 15}, M in
  {1, 3, 16}, one and two source tiles, the mix kept or reloaded, row-strided ``prefix``
  and a strided ``[M, R, H]`` blocks buffer, H = 7168 once. The output is poisoned (NaN)
  before the launch, so an unwritten element fails. The interpreter rounds to bf16 by
  truncation (numpy has no bf16), so bit-equality of the prefix and block writes is
  checked on fp16 (the kernel is dtype-generic; the GPU file checks bf16 bit for bit);
  bf16 cases check the math within bf16 accuracy;
* the ``loop`` variant (column chunks) likewise, for every flag combination, NB in
  {0, 1, 8, 15}, M in {1, 3}, H not a multiple of the chunk, H = 7168 once;
* the launcher raises ``ValueError`` on bad shapes, dtypes, NB or write slot, or bad
  loop meta-parameters;
* ``try_attn_res`` routes the SM90 table's row to the backend and answers None (launching
  nothing) off the table: switch off, CPU tensors, fp32, M > 16, no SM90 table, NB > 15,
  a write into a source slot, batch-invariant mode; and the routed entry runs the real
  kernel under the interpreter;
* ``fused_decode.attn_res`` runs the stock function unless routed, and patch 0010 makes
  the decoder layer's two attn-res sites call it with v0.28.0's ``attn_res``.
"""

from __future__ import annotations

import ast
import json
import os
import subprocess
import sys
import textwrap

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("triton")

from vllm.models.kimi_k3.nvidia import attn_res as ar  # noqa: E402
from vllm.models.kimi_k3.nvidia import fused_decode, gemm_backends  # noqa: E402
from vllm.models.kimi_k3.nvidia import low_latency_fused_dispatch as fd  # noqa: E402
from vllm.models.kimi_k3.nvidia import low_latency_fused_sm90 as sm90_data  # noqa: E402

BF16 = torch.bfloat16
SM90 = (9, 0)
FLAGS = [(d, w, o) for d in (False, True) for w in (False, True) for o in (False, True)]

_SCRIPT = textwrap.dedent(
    """
    import json, sys, torch
    from vllm.models.kimi_k3.nvidia import attn_res as ar
    from vllm.models.kimi_k3.nvidia import low_latency_fused_dispatch as fd

    _empty = torch.empty
    def poisoned(*a, **k):  # every output element the kernel leaves unwritten stays NaN
        return _empty(*a, **k).fill_(float("nan"))
    torch.empty = poisoned

    def reference(prefix, delta, blocks, nw, qw, ow, nb, eps, oeps):
        u = prefix.double() if delta is None else (prefix.float() + delta.float()).to(prefix.dtype).double()
        v = torch.stack([blocks[:, s].double() for s in range(nb)] + [u], 1)  # M, S, H
        logit = (v * (nw.double() * qw.double())).sum(-1) * torch.rsqrt((v * v).mean(-1) + eps)
        mixed = (logit.softmax(-1)[..., None] * v).sum(1)
        if ow is not None:
            mixed = mixed * torch.rsqrt((mixed * mixed).mean(-1, keepdim=True) + oeps) * ow.double()
        return mixed

    out = []
    for case in json.loads(sys.argv[1]):
        m, h, nb, has_delta, write, out_norm, dtype, meta, seed, routed = case
        dt = getattr(torch, dtype)
        g = torch.Generator().manual_seed(seed)
        rnd = lambda *s: torch.randn(*s, generator=g)
        # row-strided prefix; blocks a [M, R, H] slice of a wider buffer, R > NB + 1
        prefix = rnd(m, h + 8).to(dt)[:, :h]
        delta = rnd(m, h).to(dt) if has_delta else None
        r = nb + 3
        blocks = rnd(m, r + 1, h + 16).to(dt)[:, 1:, 8:8 + h]
        nw, qw = rnd(h).to(dt), (rnd(h) * 4 / h ** 0.5).to(dt)
        ow = rnd(h).to(dt) if out_norm else None
        widx = nb + 1 if write else -1
        want = reference(prefix, delta, blocks, nw, qw, ow, nb, 1e-6, 1e-5)
        p0, b0 = prefix.clone(), blocks.clone()
        args = (prefix, delta, blocks, nw, qw, ow, nb, widx, 1e-6, 1e-5)
        if routed:
            y = fd.try_attn_res(*args)
        else:
            y = ar.attn_res(*args, pdl=False, **meta)
        u = p0 if delta is None else (p0.float() + delta.float()).to(dt)
        others = [s for s in range(r) if s != widx]
        out.append({
            "routed": y is not None,
            "finite": bool(torch.isfinite(y).all()) if y is not None else False,
            "shape": list(y.shape) if y is not None else None,
            "err": float((y.double() - want).abs().max() / want.abs().max()) if y is not None else 1.0,
            "prefix_exact": bool(torch.equal(prefix, u)),
            "prefix_ulp": float(((prefix.double() - u.double()).abs() / u.double().abs().clamp_min(1e-3)).max()),
            "block_exact": (not write) or bool(torch.equal(blocks[:, widx], prefix)),
            "others_kept": bool(torch.equal(blocks[:, others], b0[:, others])),
        })
    print(json.dumps(out))
    """
)

_ROUTE_PRELUDE = textwrap.dedent(
    """
    from vllm.models.kimi_k3.nvidia import low_latency_fused_dispatch as fd
    fd._device_capability = lambda: (9, 0)
    fd._FAST_PATH_DEVICE_TYPE = "cpu"
    fd._enabled = True
    """
)


def _interpret(cases, prelude: str = "") -> list[dict]:
    # vLLM disables Triton when it finds no active GPU driver, unless the visible
    # devices are set and empty (vllm/triton_utils/importing.py): set them so.
    env = dict(os.environ, TRITON_INTERPRET="1", CUDA_VISIBLE_DEVICES="")
    proc = subprocess.run([sys.executable, "-c", prelude + _SCRIPT, json.dumps(cases)],
                          capture_output=True, text=True, env=env, timeout=900)  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def _cases():
    cases = []
    seed = 0
    # every flag combination at every NB (M = 3, fp16: bit-exact writes)
    for nb in (0, 1, 2, 8, 15):
        for d, w, o in FLAGS:
            seed += 1
            cases.append([3, 96, nb, d, w, o, "float16", {}, seed, False])
    # M = 1 and 16, two tiles (block_s = 8) and the reloaded mix, other warps
    for m, nb, meta in [(1, 2, {}), (16, 8, {"block_s": 4}), (16, 15, {"block_s": 8, "reload": True}),
                        (1, 15, {"num_warps": 32, "reload": False}), (3, 8, {"reload": True, "num_warps": 8}),
                        (3, 5, {"block_s": 4, "reload": False})]:  # fmt: skip
        for d, w, o in [(True, True, True), (True, False, True), (False, False, False)]:
            seed += 1
            cases.append([m, 64, nb, d, w, o, "float16", meta, seed, False])
    # bf16 (the model's dtype) and the model's width once
    cases.append([3, 160, 8, True, True, True, "bfloat16", {}, 101, False])
    cases.append([16, 64, 15, True, False, True, "bfloat16", {"block_s": 8}, 102, False])
    cases.append([1, 7168, 8, True, True, True, "float16", {}, 103, False])
    return cases


def test_interpreted_kernel_matches_float64_and_writes_exactly() -> None:
    cases = _cases()
    for case, got in zip(cases, _interpret(cases)):
        m, h, nb, d, w, o, dtype = case[:7]
        what = f"M={m} H={h} NB={nb} delta={d} write={w} out_norm={o} {dtype} {case[7]}"
        assert got["finite"], f"{what}: NaN/Inf or an unwritten output element"
        assert got["shape"] == [m, h], what
        # fp16 output rounding ~5e-4 of the largest element, bf16 ~4e-3; a wrong source
        # or weight is O(1)
        assert got["err"] < (2e-3 if dtype == "float16" else 1.6e-2), f"{what}: err {got['err']:.2e}"
        if dtype == "float16":
            assert got["prefix_exact"], f"{what}: prefix is not fp16(prefix + delta) bit for bit"
        else:  # the interpreter truncates to bf16: within one bf16 ulp
            assert got["prefix_ulp"] <= 2 ** -7, f"{what}: prefix off by {got['prefix_ulp']}"
        assert got["block_exact"], f"{what}: block slot is not the new prefix bit for bit"
        assert got["others_kept"], f"{what}: a block slot other than the write slot changed"


def _loop_cases():
    cases = []
    seed = 200
    loop = {"variant": "loop", "chunk": 32, "num_stages": 3}
    # every flag combination at NB 0, 1, 8, 15; H = 100: three full chunks of 32 and a
    # masked one (fp16: bit-exact writes)
    for nb in (0, 1, 8, 15):
        for d, w, o in FLAGS:
            seed += 1
            cases.append([3, 100, nb, d, w, o, "float16", loop, seed, False])
    # M = 1, one chunk wider than H, other warps and stages
    for m, h, nb, meta in [(1, 100, 8, loop), (1, 40, 15, {**loop, "chunk": 64, "num_warps": 4}),
                           (1, 48, 1, {**loop, "chunk": 16, "num_stages": 8, "num_warps": 8})]:  # fmt: skip
        for d, w, o in [(True, True, True), (False, False, True), (True, False, False)]:
            seed += 1
            cases.append([m, h, nb, d, w, o, "float16", meta, seed, False])
    # the model's width and chunk once; bf16 once
    cases.append([1, 7168, 8, True, True, True, "float16", {**loop, "chunk": 1024}, 301, False])
    cases.append([3, 160, 8, True, True, True, "bfloat16", {**loop, "chunk": 64}, 302, False])
    return cases


def test_interpreted_loop_variant_matches_float64_and_writes_exactly() -> None:
    """The ``loop`` variant (column chunks, elementwise accumulators, the mix and the
    output norm re-read): the same checks as the tile variant's."""
    cases = _loop_cases()
    results = _interpret(cases)
    assert len(results) == len(cases)
    for case, got in zip(cases, results):
        m, h, nb, d, w, o, dtype = case[:7]
        what = f"loop M={m} H={h} NB={nb} delta={d} write={w} out_norm={o} {dtype} {case[7]}"
        assert got["finite"], f"{what}: NaN/Inf or an unwritten output element"
        assert got["shape"] == [m, h], what
        assert got["err"] < (2e-3 if dtype == "float16" else 1.6e-2), f"{what}: err {got['err']:.2e}"
        if dtype == "float16":
            assert got["prefix_exact"], f"{what}: prefix is not fp16(prefix + delta) bit for bit"
        else:
            assert got["prefix_ulp"] <= 2 ** -7, f"{what}: prefix off by {got['prefix_ulp']}"
        assert got["block_exact"], f"{what}: block slot is not the new prefix bit for bit"
        assert got["others_kept"], f"{what}: a block slot other than the write slot changed"


@pytest.mark.parametrize("meta", [dict(variant="rows"), dict(variant="loop", chunk=1000),
                                  dict(variant="loop", chunk=8),
                                  dict(variant="loop", num_stages=0)])  # fmt: skip
def test_the_launcher_raises_value_error_on_bad_loop_meta(meta) -> None:
    with pytest.raises(ValueError):
        ar.attn_res(*_operands(), pdl=False, **meta)


def test_a_loop_config_over_the_shared_memory_is_refused_not_launched() -> None:
    """H200, 2026-12-04: chunk 1024 x 8 stages with 15 blocks (a 16-row tile) wanted 280 KB of
    shared memory and Triton refused the launch; the launcher says so first, and the backend
    leaves such a call to v0.28.0's kernel."""
    args = _operands(m=1, h=2048, nb=15, r=16)
    assert ar.loop_smem_bytes(ar.block_s_for(15), 1024, 8) > ar.MAX_SMEM_BYTES
    with pytest.raises(ValueError, match="shared memory"):
        ar.attn_res(*args, pdl=False, variant="loop", chunk=1024, num_stages=8)
    (backend,) = gemm_backends.backends_for("attn_res").values()
    assert not backend.operands_ok(("loop", 16, 1024, 8), *args[:8])
    assert backend.operands_ok(("loop", 16, 1024, 4), *args[:8])  # 4 stages fit
    small = _operands(m=1, h=2048, nb=8, r=9)  # an 8-row tile fits at 8 stages
    assert backend.operands_ok(("loop", 16, 1024, 8), *small[:8])


def test_the_routed_entry_runs_the_kernel_under_the_interpreter() -> None:
    (h,) = next(iter(sm90_data.FUSED_SM90["attn_res"]))
    cases = [[2, h, 8, True, True, True, "bfloat16", {}, 7, True],
             [16, h, 2, False, False, True, "bfloat16", {}, 8, True]]
    for case, got in zip(cases, _interpret(cases, _ROUTE_PRELUDE)):
        assert got["routed"], case
        assert got["finite"] and got["err"] < 1.6e-2, (case, got)
        assert got["block_exact"] and got["others_kept"], (case, got)


# ---------------------------------------------------------------------- launcher errors


def _operands(m=2, h=64, nb=2, dtype=BF16, r=None):
    x = torch.zeros(m, h, dtype=dtype)
    blocks = torch.zeros(m, r or nb + 2, h, dtype=dtype)
    w = torch.ones(h, dtype=dtype)
    return [x, x.clone(), blocks, w, w, w, nb, -1, 1e-6, 1e-6]


@pytest.mark.parametrize("why,edit", [
    ("prefix not 2-D", lambda a: a.__setitem__(0, a[0][0])),
    ("prefix column stride", lambda a: a.__setitem__(0, torch.zeros(64, 2, dtype=BF16).t())),
    ("fp32 prefix", lambda a: a.__setitem__(0, a[0].float())),
    ("delta shape", lambda a: a.__setitem__(1, a[1][:1])),
    ("delta dtype", lambda a: a.__setitem__(1, a[1].half())),
    ("blocks width", lambda a: a.__setitem__(2, a[2][:, :, :32])),
    ("blocks too few slots", lambda a: a.__setitem__(6, 5)),
    ("NB 16", lambda a: (a.__setitem__(6, 16), a.__setitem__(2, torch.zeros(2, 18, 64, dtype=BF16)))),
    ("NB negative", lambda a: a.__setitem__(6, -1)),
    ("write into a source", lambda a: a.__setitem__(7, 1)),
    ("write past R", lambda a: a.__setitem__(7, 4)),
    ("norm weight length", lambda a: a.__setitem__(3, a[3][:32])),
    ("out weight strided", lambda a: a.__setitem__(5, torch.ones(128, dtype=BF16)[::2])),
])  # fmt: skip
def test_the_launcher_raises_value_error_on_bad_operands(why, edit) -> None:
    args = _operands()
    edit(args)
    with pytest.raises(ValueError):
        ar.attn_res(*args, pdl=False)


@pytest.mark.parametrize("nb,block_s", [(8, 2), (15, 4), (2, 3), (9, 4)])
def test_block_s_must_hold_the_blocks_in_two_power_of_two_tiles(nb, block_s) -> None:
    with pytest.raises(ValueError):
        ar.block_s_for(nb, block_s)


def test_block_s_default_is_one_tile() -> None:
    assert [ar.block_s_for(nb) for nb in (0, 1, 2, 8, 15)] == [1, 1, 2, 8, 16]
    assert ar.block_s_for(15, 8) == 8 and ar.block_s_for(8, 4) == 4


# ---------------------------------------------------------------------- dispatch


class Recorder:
    def __init__(self) -> None:
        self.calls: list[tuple] = []

    def __call__(self, _self, config, *operands):
        self.calls.append((config, *operands))
        return "out"


@pytest.fixture
def routed(monkeypatch: pytest.MonkeyPatch) -> Recorder:
    """Switch on, an SM90 device, CPU tensors let through, the backend's launch recorded."""
    monkeypatch.setattr(fd, "_device_capability", lambda: SM90)
    monkeypatch.setattr(fd, "_FAST_PATH_DEVICE_TYPE", "cpu")
    monkeypatch.setattr(fd, "_enabled", True)
    monkeypatch.delenv("VLLM_BATCH_INVARIANT", raising=False)
    rec = Recorder()
    (backend,) = gemm_backends.backends_for("attn_res").values()
    monkeypatch.setattr(type(backend), "launch", rec)
    monkeypatch.setattr(type(backend), "is_available", lambda self: True)
    return rec


def _row():
    ((h,), (name, cfg, ms)), = sm90_data.FUSED_SM90["attn_res"].items()
    return h, name, ms


def test_the_sm90_table_routes_attn_res_at_every_decode_m(routed) -> None:
    h, name, ms = _row()
    assert name == "pdl_attn_res" and list(ms) == list(range(1, 17))
    table = fd.TABLES_BY_CAPABILITY[SM90]
    assert all(table.call("attn_res", (h,), m).backend == name for m in ms)
    for m in (1, 16):
        args = _operands(m=m, h=h, nb=8)
        assert fd.try_attn_res(*args) == "out"
    assert len(routed.calls) == 2
    config, prefix, *_rest, eps, out_eps = routed.calls[0]
    assert prefix is not None and (eps, out_eps) == (1e-6, 1e-6)


def _refusals():
    h = _row()[0]
    def edited(**kw):
        args = _operands(h=h, nb=kw.pop("nb", 2), dtype=kw.pop("dtype", BF16), m=kw.pop("m", 2))
        for i, v in kw.items():
            args[int(i[1:])] = v
        return args
    return {
        "fp32": edited(dtype=torch.float32),
        "M = 17": edited(m=17),
        "NB = 16": edited(nb=16),
        "write into a source": edited(a7=0),
        "blocks not 3-D": edited(a2=torch.zeros(2, h, dtype=BF16)),
        "delta not a tensor": edited(a1="x"),
        "NB not an int": edited(a6=2.0),
        "fp32 norm weight": edited(a3=torch.ones(h)),
        "width without a row": edited(a0=torch.zeros(2, 64, dtype=BF16)),
    }


@pytest.mark.parametrize("why", sorted(_refusals()))
def test_try_attn_res_answers_none_on_each_precondition(routed, why) -> None:
    assert fd.try_attn_res(*_refusals()[why]) is None
    assert not routed.calls


@pytest.mark.parametrize("state", ["switch off", "CPU tensors", "no CUDA device",
                                   "a GPU without a table", "batch invariant", "not built"])  # fmt: skip
def test_try_attn_res_answers_none_off_the_table(routed, monkeypatch, state) -> None:
    if state == "switch off":
        fd.disable_kimi_k3_fused_decode()
    elif state == "CPU tensors":
        monkeypatch.setattr(fd, "_FAST_PATH_DEVICE_TYPE", "cuda")
    elif state == "no CUDA device":
        monkeypatch.setattr(fd, "_device_capability", lambda: None)
    elif state == "a GPU without a table":
        monkeypatch.setattr(fd, "_device_capability", lambda: (10, 0))
    elif state == "batch invariant":
        monkeypatch.setenv("VLLM_BATCH_INVARIANT", "1")
    elif state == "not built":
        (backend,) = gemm_backends.backends_for("attn_res").values()
        monkeypatch.setattr(type(backend), "is_available", lambda self: False)
    assert fd.try_attn_res(*_operands(h=_row()[0], nb=8)) is None
    assert not routed.calls


@pytest.mark.parametrize("config,ok", [(None, True), ((16, 0, False), True), ((32, 8, True), True),
                                       ((8, 4, True), True), ((12, 0, False), False), ((16, 2, False), False),
                                       ((16, 0, 1), False), ((16, 0), False),
                                       (("loop", 8, 1024, 4), True), (("loop", 16, 2048, 8), True),
                                       (("loop", 4, 512, 1), True), (("loop", 32, 1024, 4), False),
                                       (("loop", 8, 1000, 4), False), (("loop", 8, 1024, 0), False),
                                       (("loop", 8, 1024, True), False),
                                       (("loop", 8, 1024), False)])  # fmt: skip
def test_backend_config_error(config, ok) -> None:
    (backend,) = gemm_backends.backends_for("attn_res").values()
    assert (backend.config_error(7168, 7168, 1, config) is None) is ok


def test_backend_loop_config_launches_the_loop_variant(monkeypatch) -> None:
    (backend,) = gemm_backends.backends_for("attn_res").values()
    seen = []
    monkeypatch.setattr(ar, "attn_res", lambda *a, **k: seen.append(k) or "out")
    args = _operands(h=64, nb=2)
    assert backend.launch(("loop", 8, 1024, 4), *args) == "out"
    assert backend.launch((16, 0, True), *args) == "out"
    assert seen == [dict(variant="loop", num_warps=8, chunk=1024, num_stages=4),
                    dict(num_warps=16, block_s=None, reload=True)]  # fmt: skip


def test_the_call_site_runs_the_stock_function_unless_routed(monkeypatch) -> None:
    args = _operands()
    kw = dict(num_blocks=2, block_write_idx=-1, eps=1e-6, output_norm_eps=1e-5)
    stock_calls = []

    def stock(*a, **k):
        stock_calls.append((a, k))
        return "stock"

    monkeypatch.setattr(fused_decode, "try_attn_res", lambda *a: None)
    assert fused_decode.attn_res(stock, *args[:6], **kw) == "stock"
    assert stock_calls == [(tuple(args[:6]), kw)]
    seen = []
    monkeypatch.setattr(fused_decode, "try_attn_res", lambda *a: seen.append(a) or "ours")
    assert fused_decode.attn_res(stock, *args[:6], **kw) == "ours"
    assert len(stock_calls) == 1
    assert seen[0][6:] == (2, -1, 1e-6, 1e-5)


def _decoder_layer_calls(method: str) -> list:
    from pathlib import Path

    tree = ast.parse(Path(fused_decode.__file__).with_name("model.py").read_text("utf-8"))
    layer = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "KimiDecoderLayer")
    fn = next(n for n in layer.body if isinstance(n, ast.FunctionDef) and n.name == method)
    return [n for n in ast.walk(fn) if isinstance(n, ast.Call) and isinstance(n.func, ast.Name)]


@pytest.mark.parametrize("method", ["_pre_attn_norm", "_post_attn_norm"])
def test_patch_0010_routes_the_decoder_layers_attn_res_through_fused_decode(method) -> None:
    """The tree's model.py (patched): each decoder-layer site calls ``fused_attn_res`` with
    v0.28.0's ``attn_res`` as its stock function, and no bare ``attn_res`` call is left."""
    calls = _decoder_layer_calls(method)
    fused = [c for c in calls if c.func.id == "fused_attn_res"]
    assert len(fused) == 1, method
    assert isinstance(fused[0].args[0], ast.Name) and fused[0].args[0].id == "attn_res"
    assert not [c for c in calls if c.func.id == "attn_res"], "a stock attn_res call is left"
    kw = {k.arg for k in fused[0].keywords}
    assert kw == {"num_blocks", "block_write_idx", "eps", "output_norm_eps"}



# ---------------------------------------------------------------------- the cluster variant


@pytest.mark.parametrize("config,ok", [(("cluster", 8), True), (("cluster", 4), True), (("cluster", 2), True),
                                       (("cluster", 16), False), (("cluster", 3), False)])  # fmt: skip
def test_backend_cluster_config_error(config, ok) -> None:
    (backend,) = gemm_backends.backends_for("attn_res").values()
    assert (backend.config_error(7168, 7168, 1, config) is None) is ok


def test_the_cluster_split_needs_whole_16_byte_columns_per_thread() -> None:
    from vllm.models.kimi_k3.nvidia import attn_res_cluster as arc

    assert arc.shape_error(7168, 8) is None and arc.threads_of(7168, 8) == 128  # 112 active
    assert arc.threads_of(7168, 4) == 224 and arc.threads_of(7168, 2) == 448
    assert "cluster = 64" in arc.shape_error(7000, 8)
    assert "threads" in arc.shape_error(8 * 2 * 2048, 2)


def test_a_cluster_config_runs_the_tile_fallback_where_the_cluster_build_cannot(monkeypatch) -> None:
    """CPU tensors (no cluster there): the tile kernel at TILE_FALLBACK; operands the cluster
    build takes: the cluster variant."""
    from vllm.models.kimi_k3.nvidia import attn_res_cluster as arc
    from vllm.models.kimi_k3.nvidia.gemm_backends import pdl_attn_res

    (backend,) = gemm_backends.backends_for("attn_res").values()
    seen = []
    monkeypatch.setattr(ar, "attn_res", lambda *a, **k: seen.append(("tile", k)) or "out")
    monkeypatch.setattr(arc, "launch", lambda *a, **k: seen.append(("cluster", k)) or "out")
    args = _operands(h=7168, nb=8)
    assert "SM90" in arc.operands_error(*args[:8], 8, True)
    assert backend.launch(("cluster", 8), *args) == "out"
    monkeypatch.setattr(arc, "operands_error", lambda *a: None)
    assert backend.launch(("cluster", 4), *args) == "out"
    assert pdl_attn_res.TILE_FALLBACK == (8, 0, True)
    assert seen == [("tile", dict(num_warps=8, block_s=None, reload=True)),
                    ("cluster", dict(cluster=4, pdl=True))]  # fmt: skip


def test_the_cluster_launcher_refuses_a_cpu_tensor_with_value_error() -> None:
    from vllm.models.kimi_k3.nvidia.attn_res_cluster import attn_res_cluster

    with pytest.raises(ValueError, match="SM90"):
        attn_res_cluster(*_operands(h=7168, nb=8), cluster=8)
