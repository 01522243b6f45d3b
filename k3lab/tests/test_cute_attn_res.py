"""CPU check of the cluster attn-res kernel (overlay/.../nvidia/attn_res_cluster.py): it is
compiled for sm_90a without a GPU and its PTX read. Skips where nvidia-cutlass-dsl is not
importable (CI's venv does not carry it; the GPU tests run it on the H200)."""

from __future__ import annotations

import re

import pytest

from k3lab.tests.cute_ptx import sm90a_ptx
from k3overlay.project import ROOT

MODULE = ROOT / "overlay/vllm/models/kimi_k3/nvidia/attn_res_cluster.py"


@pytest.fixture(scope="module")
def ptx(tmp_path_factory) -> str:
    build = "mod.Build(7168, 8, 8, True, False, True, True)"
    return sm90a_ptx(tmp_path_factory.mktemp("cute_attn_res"), MODULE, build)


def test_the_weights_load_before_the_wait_and_the_activations_after(ptx) -> None:
    lines = ptx.splitlines()
    wait = next(i for i, line in enumerate(lines) if "griddepcontrol.wait" in line)
    loads = [i for i, line in enumerate(lines) if re.search(r"ld\.global(\.\w+)*\.v4", line)]
    assert sum(i < wait for i in loads) == 3  # norm, qk and output-norm weights, 16 bytes each
    assert sum(i > wait for i in loads) == 8 + 2  # NB = 8 blocks, prefix, delta
    assert "griddepcontrol.launch_dependents" in ptx


def test_the_row_sums_go_through_dsmem_and_nothing_spills(ptx) -> None:
    assert ptx.count("st.async.shared::cluster.mbarrier::complete_tx::bytes") == 8 + 1  # 8 CTAs; the norm
    assert "barrier.cluster.wait" in ptx and "mbarrier.try_wait" in ptx
    assert not re.search(r"\b(ld|st)\.local\b", ptx)
