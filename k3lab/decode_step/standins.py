"""Each stand-in of the replay's stock variant, timed once against the closest real kernel.

The stock variant runs a stand-in only where v0.28.0's kernel is a compiled vLLM op the GPU
bundle cannot load (``_C``'s ``rms_norm``, ``fused_add_rms_norm``, ``situ_and_mul``) or a
multi-GPU op (flashinfer's all-reduce + RMSNorm: the replay runs its norm). Each is timed
here, same harness as the replay's per-op figures (one CUDA graph of ``CALLS`` calls on
distinct inputs, median of ``reps`` replays, µs per call), beside the closest kernel that
does run on the machine: torch's own RMSNorm, and for SITU-and-mul and the MLA output
gate the same expression compiled by Inductor (the output gate is exactly v0.28.0's
``torch.compile``'d ``_gate_sigmoid_mul``, so that row checks the stand-in against the real
kernel). Written into the replay's JSON as ``stand_ins``.
"""

from __future__ import annotations

from k3lab import timing
from k3lab.decode_step.layers import EPS, H, HV, LAT, SI, SITU_BETA

CALLS = 16
MS = (1, 8, 16)


def _situ_ref(gu, beta=SITU_BETA):
    g, u = gu.float().chunk(2, dim=-1)
    return (beta * (g / beta).tanh() * g.sigmoid() * u).to(gu.dtype)


def _gate_ref(x, gate):
    return x * gate.sigmoid()


def rows(torch, kn) -> list[tuple[str, str, int, object, object, str]]:
    """(stand-in, for, K, stand-in fn(M) -> call, closest fn(M) -> call, closest's name)."""
    f = torch.nn.functional
    compiled_situ, compiled_gate = torch.compile(_situ_ref), torch.compile(_gate_ref)

    def norm(k):
        return lambda x, w: kn.norm.rms_norm(x, w, EPS, pdl=False), lambda x, w: f.rms_norm(x, (k,), w, EPS)

    def add_norm():
        def ours(x, w, r):
            return kn.norm.add_rms_norm(x, r, w, EPS, pdl=False)

        def real(x, w, r):
            r.add_(x)
            return f.rms_norm(r, (H,), w, EPS)

        return ours, real

    return [
        ("rms_norm", "_C rms_norm (input / head norms)", H, *norm(H), "torch.nn.functional.rms_norm"),
        ("rms_norm", "flashinfer all-reduce + RMSNorm (latent, norm part)", LAT, *norm(LAT),
         "torch.nn.functional.rms_norm"),
        ("add_rms_norm", "_C fused_add_rms_norm", H, *add_norm(), "torch add_ + torch.nn.functional.rms_norm"),
        ("situ_and_mul", "_C situ_and_mul", 2 * SI, lambda gu: kn.stock.situ_and_mul(gu, SITU_BETA),
         compiled_situ, "the same math compiled by Inductor"),
        ("sigmoid_mul", "MLA _gate_sigmoid_mul (torch.compile): the 2026-12-02 replay's stand-in; the mode "
         "replays run the real kernel", HV, kn.stock.sigmoid_mul, compiled_gate,
         "v0.28.0's expression compiled by Inductor (the real kernel)"),
    ]  # fmt: skip


def _args(torch, name: str, m: int, k: int):
    gen = torch.Generator(device="cuda").manual_seed(m * 1000 + k)

    def rnd(*shape):
        return torch.randn(*shape, generator=gen, device="cuda").to(torch.bfloat16)

    if name in ("rms_norm", "add_rms_norm"):
        w = 1 + 0.1 * rnd(k)
        return [(rnd(m, k), w, rnd(m, k)) if name == "add_rms_norm" else (rnd(m, k), w) for _ in range(CALLS)]
    if name == "situ_and_mul":
        return [(rnd(m, k),) for _ in range(CALLS)]
    return [(rnd(m, k), rnd(m, k)) for _ in range(CALLS)]


def check(torch, kn, reps: int) -> list[dict]:
    """Every stand-in row at M = 1, 8, 16: µs per call of the stand-in and of the closest kernel."""
    out = []
    for name, stands_for, k, mine, real, real_name in rows(torch, kn):
        for m in MS:
            args = _args(torch, name, m, k)
            rec = {"stand_in": name, "for": stands_for, "K": k, "M": m, "closest": real_name}
            for key, fn in (("stand_in_us", mine), ("closest_us", real)):

                def body(fn=fn):
                    for a in args:
                        fn(*a)

                try:
                    rec[key] = round(timing.graph_replay_us(body, body, CALLS, reps), 2)
                except Exception as e:  # noqa: BLE001 - a closest kernel that cannot run (Inductor) is a finding
                    rec[key] = f"error: {type(e).__name__}: {str(e)[:200]}"
            out.append(rec)
    return out
