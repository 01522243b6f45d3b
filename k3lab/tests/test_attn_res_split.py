"""CPU checks of the issue-21 attn-res experiment (k3lab/experiments/attn_res_split.py).

The ``last`` and ``row`` kernels run on Triton's interpreter (``TRITON_INTERPRET=1``, in a
subprocess as Triton reads it on first import), every program of the grid on the CPU,
against float64 of the math in the module's docstring: the output, the prefix written in
place (bit-exact: one rounding of an fp32 sum), the per-row counters back at 0 after each
call (so a CUDA graph can replay it) and a second call on the same inputs. fp16 operands:
the interpreter has no bf16 dot (numpy has no bf16). ``spin`` cannot run there (programs
run one after another, the first would spin for ever): only its refusal is checked.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest

from k3overlay.project import ROOT

torch = pytest.importorskip("torch")
pytest.importorskip("triton")

# (kind, options, M, H, num_blocks, block rows in the buffer): uneven last chunk, one
# block only, the decode shape's 8 blocks with a spare row, chunk counts 1..8.
CASES = [
    ("last", {"chunk": 256}, 3, 1000, 8, 9),
    ("last", {"chunk": 128, "gsplit": 4}, 2, 512, 1, 3),
    ("last", {"chunk": 1024}, 1, 640, 8, 8),
    ("row", {"chunk": 256}, 3, 1000, 8, 9),
    ("row", {"chunk": 128, "unroll": True, "gsplit": 2}, 2, 384, 5, 7),
]

_SCRIPT = textwrap.dedent(
    """
    import json, sys, torch
    from k3lab.experiments import attn_res_split as ar
    D = torch.float64
    def ref(prefix, delta, blocks, nw, qw, ow, nb, eps):
        u = (prefix.to(D) + delta.to(D)).to(prefix.dtype)
        src = torch.cat([blocks[:, :nb].to(D), u.to(D)[:, None]], 1)
        logit = (src * (nw.to(D) * qw.to(D))).sum(-1) * torch.rsqrt(src.pow(2).mean(-1) + eps)
        mixed = (torch.softmax(logit, -1)[..., None] * src).sum(1)
        return mixed * torch.rsqrt(mixed.pow(2).mean(-1, keepdim=True) + eps) * ow.to(D), u
    out = []
    for i, (kind, opts, m, h, nb, rows) in enumerate(json.loads(sys.argv[1])):
        g = torch.Generator().manual_seed(i)
        rnd = lambda *s: torch.randn(*s, generator=g).half()
        prefix, delta, blocks = rnd(m, h), rnd(m, h), rnd(m, rows, h)
        nw, qw, ow = [(1 + 0.1 * torch.randn(h, generator=g)).half() for _ in range(3)]
        rec = {"err": [], "prefix_exact": [], "counters_zero": []}
        outs = []
        for call in range(2):
            p = prefix.clone()
            r, u = ref(p, delta, blocks, nw, qw, ow, nb, 1e-6)
            y = ar.KINDS[kind](p, delta, blocks, nw, qw, ow, nb, 1e-6, 1e-6, **opts)
            outs.append(y)
            rec["err"].append(float((y.to(D) - r).norm() / r.norm()) if torch.isfinite(y).all() else 1e9)
            rec["prefix_exact"].append(bool(torch.equal(p, u)))
            ws = ar._WORKSPACES.get(("cpu", None))
            rec["counters_zero"].append(ws is None or not bool(ws.counters.any()))
        rec["calls_equal"] = bool(torch.equal(outs[0], outs[1]))
        rec["shape"] = list(outs[0].shape)
        out.append(rec)
    print(json.dumps(out))
    """
)


def _interpret(cases) -> list[dict]:
    env = dict(os.environ, TRITON_INTERPRET="1", CUDA_VISIBLE_DEVICES="")
    proc = subprocess.run(
        [sys.executable, "-c", _SCRIPT, json.dumps(cases)],
        capture_output=True, text=True, env=env, timeout=600, cwd=ROOT,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_interpreted_kernels_match_float64_and_leave_counters_at_zero() -> None:
    got = _interpret([list(c) for c in CASES])
    for (kind, opts, m, h, nb, _), rec in zip(CASES, got):
        what = f"{kind} {opts} M={m} H={h} NB={nb}"
        assert rec["shape"] == [m, h], what
        # fp16 sources, fp32 math: ~2e-4 expected; a wrong source, weight or scale is O(1).
        assert max(rec["err"]) < 1e-3, f"{what}: rel err {rec['err']}"
        assert all(rec["prefix_exact"]), f"{what}: prefix write is not bf16(prefix + delta)"
        assert all(rec["counters_zero"]), f"{what}: a per-row counter was left non-zero"
        assert rec["calls_equal"], f"{what}: the second call on the same inputs differs"


def test_bad_operands_and_the_spin_kernel_on_a_cpu_are_refused() -> None:
    from k3lab.experiments import attn_res_split as ar

    p = torch.zeros(2, 64, dtype=torch.float16)
    b = torch.zeros(2, 9, 64, dtype=torch.float16)
    w = torch.ones(64, dtype=torch.float16)
    with pytest.raises(ValueError, match="num_blocks 16 outside"):
        ar.attn_res_row(p, p, torch.zeros(2, 17, 64, dtype=torch.float16), w, w, w, 16, 1e-6, 1e-6)
    with pytest.raises(ValueError, match="norm_weight"):
        ar.attn_res_row(p, p, b, w[:32], w, w, 8, 1e-6, 1e-6)
    with pytest.raises(ValueError, match="delta"):
        ar.attn_res_split_last(p, p[:1], b, w, w, w, 8, 1e-6, 1e-6)
    with pytest.raises(ValueError, match="spin barrier needs a GPU"):
        ar.attn_res_split_spin(p, p, b, w, w, w, 8, 1e-6, 1e-6)
