# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-k3-overlay project
"""CPU tests of the PDL-aware skinny (GEMV-style) decode GEMM (vllm-k3-overlay).

The kernel runs here on Triton's interpreter (``TRITON_INTERPRET=1``, set in a
subprocess because Triton reads it when it is first imported): every program of the
grid, the split-K atomics, counters and the last arriver's re-zeroing included, checked
against float64 on fresh random inputs, with the output buffer poisoned (NaN) first so
that an unwritten element shows. Operands are fp16 as in the swap-AB tests (numpy has
no bf16; the kernel is dtype-generic, the GPU tests cover bf16). PDL is off here (the
interpreter has no grid dependency); its order in the compiled PTX is checked in
``test_kimi_k3_fused_ptx.py``.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("triton")

from vllm.models.kimi_k3.nvidia import skinny_pdl_gemm as sk  # noqa: E402

# (M, N, K, config, residual). N not a multiple of block_n (clamped rows), K not a
# multiple of block_k (masked tail), the whole slice in one chunk (block_k >= K), several
# chunks, split-K even and uneven, M = 1..4 and beyond (3 and 5..7 run a padded token
# loop), 1-row blocks.
CASES = [
    (1, 7, 200, (2, 64, 1, 4, 1), False),
    (2, 33, 128, (4, 128, 1, 4, 1), True),
    (3, 9, 264, (4, 128, 2, 4, 1), True),
    (4, 5, 1280, (1, 256, 5, 2, 1), False),
    (4, 24, 376, (8, 512, 1, 4, 1), True),  # whole slice, K < block_k
    (1, 19, 1000, (2, 128, 3, 1, 2), True),  # 8 chunks in 3 splits (3, 3, 2)
    (2, 6, 128, (16, 256, 1, 4, 1), False),
    (3, 40, 704, (1, 64, 1, 2, 2), False),  # 11 chunks, one CTA per row
    (7, 12, 512, (2, 128, 2, 4, 1), True),
    (16, 10, 256, (8, 64, 4, 4, 1), False),
]

_SCRIPT = textwrap.dedent(
    """
    import json, sys, torch
    from vllm.models.kimi_k3.nvidia import skinny_pdl_gemm as sk
    out = []
    real_empty = torch.empty
    def poisoned(*a, **k):  # the kernel's output buffer starts as NaN
        return real_empty(*a, **k).fill_(float("nan"))
    sk.torch.empty = poisoned
    for m, n, k, cfg, res, seed in json.loads(sys.argv[1]):
        g = torch.Generator().manual_seed(seed)
        config = sk.SkinnyPdlConfig(*cfg)
        errs = []
        for rep in range(2):  # twice: split-K must leave its workspace zeroed
            x = torch.randn(m, k, generator=g).half()
            w = (torch.randn(n, k, generator=g) / k ** 0.5).half()
            r = torch.randn(m, n, generator=g).half() if res else None
            y = sk.skinny_pdl_gemm(x, w, config, r, pdl=False)
            ref = x.double() @ w.double().t() + (r.double() if res else 0)
            errs.append(float((y.double() - ref).norm() / ref.norm()))
        out.append({"finite": bool(torch.isfinite(y).all()), "shape": list(y.shape),
                    "dtype": str(y.dtype), "err": max(errs)})
    print(json.dumps(out))
    """
)


def _interpret(cases) -> list[dict]:
    # vLLM disables Triton when it finds no active GPU driver, unless the visible
    # devices are set and empty (vllm/triton_utils/importing.py): set them so.
    env = dict(os.environ, TRITON_INTERPRET="1", CUDA_VISIBLE_DEVICES="")
    proc = subprocess.run(
        [sys.executable, "-c", _SCRIPT, json.dumps(cases)],
        capture_output=True, text=True, env=env, timeout=600,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_interpreted_kernel_matches_float64() -> None:
    cases = [[m, n, k, list(c), r, i] for i, (m, n, k, c, r) in enumerate(CASES)]
    for (m, n, k, cfg, _), got in zip(CASES, _interpret(cases)):
        assert got["finite"], f"{cfg} M={m} {n}x{k}: NaN/Inf or unwritten output"
        assert got["shape"] == [m, n] and got["dtype"] == "torch.float16"
        # fp16 operands, fp32 accumulation: ~2e-4 expected; a wrong index is O(1).
        assert got["err"] < 2e-3, f"{cfg} M={m} {n}x{k}: rel err {got['err']:.2e}"


@pytest.mark.parametrize(
    "config,n,k,reason",
    [
        ((1, 256, 1, 4, 1), 7168, 7170, "multiple of 8"),
        ((3, 256, 1, 4, 1), 7168, 7168, "block_n"),
        ((32, 256, 1, 4, 1), 7168, 7168, "block_n"),
        ((1, 96, 1, 4, 1), 7168, 7168, "power of two"),
        ((1, 32, 1, 4, 1), 7168, 7168, "power of two"),
        ((1, 32768, 1, 4, 1), 7168, 7168, "power of two"),
        ((1, 256, 0, 4, 1), 7168, 7168, "split_k=0"),
        ((1, 256, 29, 4, 1), 7168, 7168, "split_k=29"),
        ((1, 256, 11, 4, 1), 7168, 7168, "without K chunks"),
        ((1, 256, 1, 3, 1), 7168, 7168, "num_warps"),
        ((1, 256, 1, 4, 0), 7168, 7168, "num_stages"),
        ((1, 256, 1, 4, 1), 0, 7168, "empty"),
    ],
)
def test_config_error_names_the_problem(config, n, k, reason) -> None:
    assert reason in sk.config_error(sk.SkinnyPdlConfig(*config), n, k)


def test_a_config_of_another_length_is_refused() -> None:
    assert "5 fields" in sk.config_error((1, 256, 1, 4, 1, 0), 7168, 7168)


def test_legal_configs_and_grid() -> None:
    cfg = sk.SkinnyPdlConfig(2, 8192)
    assert sk.config_error(cfg, 768, 7168) is None
    # 768 rows in 2-row blocks, the whole K in one chunk: 384 CTAs, one split.
    assert sk.grid_of(cfg, 768, 7168) == (384, 1, 8192)
    # 144 rows, 4 chunks of 2048 in 4 splits; and with 150 rows, not a multiple of block_n, 19 blocks of 8.
    assert sk.grid_of(sk.SkinnyPdlConfig(8, 2048, 4), 144, 7168) == (18, 4, 2048)
    assert sk.grid_of(sk.SkinnyPdlConfig(8, 2048, 1), 150, 7168) == (19, 1, 8192)
    # 8 chunks in 3 splits: 3, 3 and 2 chunks.
    assert sk.grid_of(sk.SkinnyPdlConfig(1, 128, 3), 19, 1000) == (19, 3, 384)


@pytest.mark.parametrize("n,k", [(768, 7168), (144, 7168), (7168, 14336), (1536, 128),
                                 (7168, 384), (7168, 2112)])  # fmt: skip
def test_sweep_grid_holds_runnable_configs(n, k) -> None:
    configs = sk.sweep_configs(n, k)
    assert 4 <= len(configs) <= 12 and len(set(configs)) == len(configs)
    for cfg in configs:
        assert sk.config_error(cfg, n, k) is None
        assert cfg.block_n * cfg.block_k * 2 <= sk.SWEEP_BYTES_PER_THREAD * 32 * cfg.num_warps
    # The whole slice preloaded (block_k >= K) is always among them.
    assert any(cfg.block_k >= k for cfg in configs)
    if n // 8 < sk.SWEEP_MIN_CTAS and k > 2048:
        assert any(cfg.split_k > 1 for cfg in configs)


@pytest.mark.parametrize("m", [0, 17])
def test_token_count_outside_decode_is_refused(m) -> None:
    x = torch.empty(m, 64, dtype=torch.bfloat16)
    w = torch.empty(64, 64, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="outside 1..16"):
        sk.skinny_pdl_gemm(x, w, sk.SkinnyPdlConfig(1, 64))


def test_mismatched_k_is_refused() -> None:
    x = torch.empty(2, 64, dtype=torch.bfloat16)
    w = torch.empty(64, 128, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="K=64"):
        sk.skinny_pdl_gemm(x, w, sk.SkinnyPdlConfig(1, 64))


def test_a_bad_config_is_refused_by_the_entry_point() -> None:
    x = torch.empty(2, 7168, dtype=torch.bfloat16)
    w = torch.empty(64, 7168, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="block_n=3"):
        sk.skinny_pdl_gemm(x, w, sk.SkinnyPdlConfig(3, 256))


def test_the_backend_validates_its_rows_at_table_construction() -> None:
    from vllm.models.kimi_k3.nvidia import gemm_backends
    from vllm.models.kimi_k3.nvidia import low_latency_gemm_spec as spec

    backend = gemm_backends.get("skinny_pdl")
    assert not backend.fuses_residual and backend.is_supported((9, 0))
    assert backend.config_from_data(1, (2, 8192, 1, 4, 1)) == sk.SkinnyPdlConfig(2, 8192)
    assert backend.config_error(768, 7168, 1, sk.SkinnyPdlConfig(2, 8192)) is None
    assert "SkinnyPdlConfig" in backend.config_error(768, 7168, 1, (2, 8192, 1, 4, 1))
    assert "M=17" in backend.config_error(768, 7168, 17, sk.SkinnyPdlConfig(2, 8192))
    table = spec._table_from_rows("SM90", {(768, 7168): {1: ("skinny_pdl", (2, 8192, 1, 4, 1))}},
                                  {})  # fmt: skip
    assert table[(768, 7168)].winner(1).config == sk.SkinnyPdlConfig(2, 8192)
    with pytest.raises(ValueError, match="block_n=3"):
        spec._table_from_rows("SM90", {(768, 7168): {1: ("skinny_pdl", (3, 8192, 1, 4, 1))}}, {})
