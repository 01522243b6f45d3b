# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-k3-overlay project
"""CPU tests of the swap-AB split-K decode GEMM (vllm-k3-overlay).

The kernel itself runs here, on Triton's interpreter (``TRITON_INTERPRET=1``, set in a
subprocess because Triton reads it when it is first imported): every program of the
grid executes on the CPU, split-K counters and partials included, so indexing, masks,
the split-K reduction and the residual epilogue are checked against float64 without a
GPU. The interpreter mishandles bf16 dot products (numpy has no bf16), so these runs
use fp16 operands; the kernel is dtype-generic and the GPU tests cover bf16.
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

from vllm.models.kimi_k3.nvidia import swap_ab_gemm as sab  # noqa: E402

# (M, N, K, config, residual): split-K with an uneven last split, K not a multiple
# of block_k, N not a multiple of block_n, one and sixteen tokens, 16-row tiles.
CASES = [
    (1, 96, 256, (64, 128, 1, 4, 2), False),
    (16, 100, 320, (32, 64, 3, 4, 2), True),
    (3, 64, 264, (64, 128, 2, 4, 2), False),
    (5, 128, 576, (64, 64, 3, 4, 2), True),
    (16, 48, 512, (16, 128, 4, 2, 2), False),
    (7, 40, 192, (16, 64, 3, 1, 2), True),
    # Ragged tiles (rows < block_n): 23-row CTAs in 32-row tiles, N not a multiple of
    # the rows, with split-K, an uneven K and a residual; 5-row CTAs in 16-row tiles.
    (4, 100, 320, (32, 64, 3, 4, 2, 23), True),
    (9, 37, 256, (16, 128, 1, 4, 2, 5), False),
    # 20 splits: the last CTA sums the partials in five rounds of four.
    (2, 40, 1280, (16, 64, 20, 1, 2), True),
]
# x as a slice of wider rows (KDA's F_A in its projection's output): (M, N, K, config,
# residual, row width, column offset); one token reads a single row, the stride unused.
STRIDED = [
    (16, 96, 128, (64, 128, 1, 4, 2), False, 400, 272),
    (5, 100, 320, (32, 64, 3, 4, 2), True, 352, 16),
    (1, 64, 128, (64, 128, 1, 4, 2), False, 400, 272),
]

_SCRIPT = textwrap.dedent(
    """
    import json, sys, torch
    from vllm.models.kimi_k3.nvidia import swap_ab_gemm as sab
    out = []
    for m, n, k, cfg, res, seed, width, at in json.loads(sys.argv[1]):
        g = torch.Generator().manual_seed(seed)
        rows = torch.randn(m, width or k, generator=g).half()
        x = rows[:, at:at + k]
        w = (torch.randn(n, k, generator=g) / k ** 0.5).half()
        r = torch.randn(m, n, generator=g).half() if res else None
        y = sab.swap_ab_gemm(x, w, sab.SwapAbConfig(*cfg), r, pdl=False)
        ref = x.double() @ w.double().t() + (r.double() if res else 0)
        out.append({"finite": bool(torch.isfinite(y).all()), "shape": list(y.shape),
                    "err": float((y.double() - ref).norm() / ref.norm())})
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
    cases = [[m, n, k, list(c), r, i, 0, 0] for i, (m, n, k, c, r) in enumerate(CASES)]
    cases += [[m, n, k, list(c), r, 50 + i, w, at] for i, (m, n, k, c, r, w, at) in enumerate(STRIDED)]
    for (m, n, k, cfg, *_), got in zip(CASES + STRIDED, _interpret(cases)):
        assert got["finite"], f"{cfg} M={m} {n}x{k}: NaN/Inf or unwritten output"
        assert got["shape"] == [m, n]
        # fp16 operands, fp32 accumulation: ~3e-4 expected; a wrong index is O(1).
        assert got["err"] < 2e-3, f"{cfg} M={m} {n}x{k}: rel err {got['err']:.2e}"


@pytest.mark.parametrize(
    "config,n,k,reason",
    [
        ((64, 256, 1, 4, 4), 7168, 7170, "multiple of 8"),
        ((48, 256, 1, 4, 4), 7168, 7168, "block_n"),
        ((64, 96, 1, 4, 4), 7168, 7168, "power of two"),
        ((64, 256, 0, 4, 4), 7168, 7168, "split_k=0"),
        ((64, 256, 29, 4, 4), 7168, 7168, "split_k=29"),
        ((64, 256, 11, 4, 4), 7168, 7168, "without K tiles"),
        ((64, 256, 1, 3, 4), 7168, 7168, "num_warps"),
        ((32, 256, 1, 4, 4, 33), 7168, 7168, "rows=33"),
        ((32, 256, 1, 4, 4, -1), 7168, 7168, "rows=-1"),
    ],
)
def test_config_error_names_the_problem(config, n, k, reason) -> None:
    assert reason in sab.config_error(sab.SwapAbConfig(*config), n, k)


def test_legal_configs_and_grid() -> None:
    cfg = sab.SwapAbConfig(64, 256, 4, 4, 4)
    assert sab.config_error(cfg, 7168, 7168) is None
    # 28 K tiles of 256 in 4 splits of 7; 112 N tiles of 64.
    assert sab.grid_of(cfg, 7168, 7168) == (112, 4, 7)
    # 3216 rows: the last N tile is partial (clamped loads, masked store).
    assert sab.grid_of(sab.SwapAbConfig(64, 256, 1, 4, 4), 3216, 7168) == (51, 1, 28)
    # 55-row CTAs in 64-row tiles: 7168 rows over 131 CTAs instead of 112.
    assert sab.grid_of(sab.SwapAbConfig(64, 256, 1, 4, 4, 55), 7168, 1536) == (131, 1, 6)


@pytest.mark.parametrize("m", [0, 17])
def test_token_count_outside_decode_is_refused(m) -> None:
    x = torch.empty(m, 64, dtype=torch.bfloat16)
    w = torch.empty(64, 64, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="outside 1..16"):
        sab.swap_ab_gemm(x, w, sab.SwapAbConfig(64, 64, 1, 4, 2))


@pytest.mark.parametrize("width, k, ok", [(64, 64, True), (256, 64, True), (136, 64, False), (72, 64, False),
                                         (264, 264, True), (280, 264, True), (288, 264, False)])
def test_x_rows_may_be_strided_as_k_is(width, k, ok) -> None:
    """The warm-up compiles with the row stride K; a stride of K's divisibility by 16 reuses it."""
    x = torch.empty(4, width, dtype=torch.bfloat16)[:, 8 if width > k else 0:][:, :k]
    assert (sab.x_error(x) is None) == ok, sab.x_error(x)
    if not ok:
        with pytest.raises(ValueError, match="row stride"):
            sab.swap_ab_gemm(x, torch.empty(64, k, dtype=torch.bfloat16), sab.SwapAbConfig(64, 64, 1, 4, 2))
    assert "column stride" in sab.x_error(torch.empty(64, 4, dtype=torch.bfloat16).t())
    assert "2-D" in sab.x_error(torch.empty(64, dtype=torch.bfloat16))
    huge = torch.empty_strided((2, 64), (2**31, 1), dtype=torch.bfloat16, device="meta")  # no storage
    assert "2^31" in sab.x_error(huge)
    assert sab.x_error(huge[:1]) is None  # one row: its stride is never used


def test_mismatched_k_is_refused() -> None:
    x = torch.empty(2, 64, dtype=torch.bfloat16)
    w = torch.empty(64, 128, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="K=64"):
        sab.swap_ab_gemm(x, w, sab.SwapAbConfig(64, 64, 1, 4, 2))
