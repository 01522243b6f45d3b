"""CPU checks of the PDL-aware CuTe DSL GEMV (overlay/.../nvidia/gemv_pdl.py): its configs'
rules, and its PTX compiled for sm_90a without a GPU. The PTX part skips where
nvidia-cutlass-dsl is not importable (CI's venv does not carry it; the GPU tests run the
kernel on the H200)."""

from __future__ import annotations

import importlib.util
import re

import pytest

from k3lab.tests.cute_ptx import sm90a_ptx
from k3overlay.project import ROOT

MODULE = ROOT / "overlay/vllm/models/kimi_k3/nvidia/gemv_pdl.py"


def _module():
    spec = importlib.util.spec_from_file_location("gemv_pdl_cpu", MODULE)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)  # imports nothing of torch, vLLM or the CuTe DSL at load
    return mod


gv = _module()


@pytest.mark.parametrize("cfg, n, k, why", [
    ((128, 1, 7), 768, 7168, None),
    ((100, 1, 1), 768, 7168, "whole number of warps"),
    ((128, 3, 1), 768, 7168, "rows=3"),
    ((128, 8, 5), 768, 7168, "registers"),
    ((128, 1, 0), 768, 7168, "registers"),
    ((128, 1, 1), 768, 1536, "not a multiple of threads x 8"),
    ((128, 1, 8), 768, 7168, "fewer than prefetch=8 tiles"),
    ((128, 4, 1), 770, 7168, "N=770 not a multiple of rows=4"),
])  # fmt: skip
def test_config_error_names_the_rule_broken(cfg, n, k, why) -> None:
    got = gv.config_error(gv.GemvPdlConfig(*cfg), n, k)
    assert got is None if why is None else why in got


def test_every_swept_config_is_legal_and_fills_half_the_chip() -> None:
    shapes = [(144, 7168), (768, 7168), (1152, 1536), (7168, 3072), (7168, 768), (7168, 14336)]
    for n, k in shapes:
        cfgs = gv.sweep_configs(n, k)
        assert cfgs, (n, k)
        for cfg in cfgs:
            assert gv.config_error(cfg, n, k) is None
            assert n // cfg.rows >= 66
            tiles = k // (cfg.threads * gv.VEC)
            assert cfg.prefetch == min(tiles, gv.MAX_PREFETCH_REGS // (4 * cfg.rows))
    assert gv.sweep_configs(768, 128) == []  # K = 128 is a sixteenth of a warp's tile
    assert gv.sweep_configs(7168, 2112) == []  # 264 vectors: no whole-warp tile divides it


@pytest.fixture(scope="module")
def ptx(tmp_path_factory) -> str:
    build = "mod.Build(4, mod.GemvPdlConfig(128, 2, 5), True)"
    return sm90a_ptx(tmp_path_factory.mktemp("cute_gemv_pdl"), MODULE, build)


def test_trigger_first_then_the_weight_slice_then_the_wait(ptx) -> None:
    lines = ptx.splitlines()
    trigger = next(i for i, line in enumerate(lines) if "griddepcontrol.launch_dependents" in line)
    wait = next(i for i, line in enumerate(lines) if "griddepcontrol.wait" in line)
    loads = [i for i, line in enumerate(lines) if re.search(r"ld\.global(\.\w+)*\.v4", line)]
    assert trigger < min(loads)
    assert sum(i < wait for i in loads) == 2 * 5  # rows x prefetch, 16 bytes each
    # After the wait: x's 4 rows for each prefetched tile, then per streamed tile 2 + 4.
    assert sum(i > wait for i in loads) == 4 * 5 + (2 + 4)
    assert not re.search(r"\b(ld|st)\.local\b", ptx)
