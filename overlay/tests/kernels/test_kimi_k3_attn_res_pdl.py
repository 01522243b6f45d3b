# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-k3-overlay project
"""Our multi-CTA attn_res (``attn_res_pdl.py``) against float64, on the CPU and on a GPU.

CPU: Triton's interpreter (``TRITON_INTERPRET=1``, in a subprocess) runs both launches,
the per-row counter and the last-CTA normalization included, over several column
chunks: with and without ``delta`` (the prefix written back), a block write, no earlier
blocks, no output norm. GPU (skipped without one): Kimi-K3's shapes (H = 7168, 8 earlier
blocks, M = 1 and 16) captured in a CUDA graph and replayed on fresh inputs twice (the
counters must be back at zero). The reference is written here from the op's definition.
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

# (M, H, blocks R, num_blocks, block_write_idx, delta, output norm)
CASES = [(3, 2500, 6, 4, -1, True, True), (2, 300, 2, 0, -1, False, False), (4, 1100, 5, 3, 3, True, True),
         (1, 2048, 3, 2, -1, False, True)]  # fmt: skip

_REF = textwrap.dedent(
    """
    def reference(prefix, delta, blocks, nw, qw, ow, nb, wi, eps, oeps):
        D = torch.float64
        p = prefix.to(D) if delta is None else (prefix.float() + delta.float()).to(prefix.dtype).to(D)
        srcs = [blocks[:, i].to(D) for i in range(nb)] + [p]
        v = torch.stack(srcs, 1)  # [M, S, H]
        rstd = torch.rsqrt(v.pow(2).mean(-1) + eps)
        logits = (v * (nw.to(D) * qw.to(D))).sum(-1) * rstd
        mix = (torch.softmax(logits, 1)[..., None] * v).sum(1)
        if ow is not None:
            mix = mix * torch.rsqrt(mix.pow(2).mean(-1, keepdim=True) + oeps) * ow.to(D)
        return mix, p
    """
)

_SCRIPT = _REF + textwrap.dedent(
    """
    import json, sys, torch
    from vllm.models.kimi_k3.nvidia import attn_res_pdl as ar
    out = []
    for m, h, r, nb, wi, has_d, has_n in json.loads(sys.argv[1]):
        g = torch.Generator().manual_seed(m * h + nb)
        rnd = lambda *s: torch.randn(*s, generator=g).half()
        prefix, delta, blocks = rnd(m, h), (rnd(m, h) if has_d else None), rnd(m, r, h)
        nw = (1 + 0.1 * torch.randn(h, generator=g)).half()
        qw = (torch.randn(h, generator=g) / h ** 0.5).half()
        ow = (1 + 0.1 * torch.randn(h, generator=g)).half() if has_n else None
        ref, p = reference(prefix, delta, blocks, nw, qw, ow, nb, wi, 1e-6, 1e-6)
        y = ar.attn_res(prefix, delta, blocks, nw, qw, ow, nb, wi, 1e-6, 1e-6, pdl=False)
        rec = {"err": float((y.double() - ref).norm() / ref.norm()), "finite": bool(torch.isfinite(y).all()),
               "prefix_err": float((prefix.double() - p).norm() / p.norm())}
        if wi >= 0:
            rec["block_err"] = float((blocks[:, wi].double() - p).norm() / p.norm())
        # a second call on the same workspace: the counters must have been reset
        y2 = ar.attn_res(prefix, None, blocks, nw, qw, ow, nb, -1, 1e-6, 1e-6, pdl=False)
        ref2, _ = reference(prefix, None, blocks, nw, qw, ow, nb, -1, 1e-6, 1e-6)
        rec["err2"] = float((y2.double() - ref2).norm() / ref2.norm())
        out.append(rec)
    print(json.dumps(out))
    """
)


def test_interpreted_attn_res_matches_float64() -> None:
    env = dict(os.environ, TRITON_INTERPRET="1", CUDA_VISIBLE_DEVICES="")
    proc = subprocess.run([sys.executable, "-c", _SCRIPT, json.dumps(CASES)], capture_output=True, text=True,
                          env=env, timeout=900)  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    for case, rec in zip(CASES, json.loads(proc.stdout.strip().splitlines()[-1])):
        assert rec["finite"], case
        assert rec["err"] < 2e-3 and rec["err2"] < 2e-3, (case, rec)
        assert rec["prefix_err"] == 0.0, (case, "prefix not written back as bf16(prefix + delta)")
        assert rec.get("block_err", 0.0) == 0.0, (case, "block write")


@pytest.mark.gpu
@pytest.mark.parametrize("m", [1, 16])
def test_attn_res_in_a_cuda_graph_matches_float64(m) -> None:
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    from vllm.models.kimi_k3.nvidia import attn_res_pdl as ar

    ns: dict = {"torch": torch}
    exec(_REF, ns)
    gen = torch.Generator(device="cuda").manual_seed(m)
    h, nb = 7168, 8

    def rnd(*s):
        return torch.randn(*s, generator=gen, device="cuda").to(torch.bfloat16)

    prefix, delta, blocks = rnd(m, h), rnd(m, h), rnd(m, nb + 1, h)
    nw, qw, ow = 1 + 0.1 * rnd(h), rnd(h) / h**0.5, 1 + 0.1 * rnd(h)
    start = prefix.clone()
    ar.attn_res(prefix, delta, blocks, nw, qw, ow, nb, -1, 1e-6, 1e-6)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        y = ar.attn_res(prefix, delta, blocks, nw, qw, ow, nb, -1, 1e-6, 1e-6)
    for _ in range(2):
        for t in (start, delta, blocks):
            t.copy_(torch.randn(t.shape, generator=gen, device="cuda"))
        prefix.copy_(start)
        graph.replay()
        torch.cuda.synchronize()
        ref, p = ns["reference"](start, delta, blocks, nw, qw, ow, nb, -1, 1e-6, 1e-6)
        assert torch.isfinite(y).all()
        assert float((y.double() - ref).norm() / ref.norm()) < 5e-3
        assert torch.equal(prefix, p.to(torch.bfloat16))
