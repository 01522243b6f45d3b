"""Compile our Triton kernels (swap-AB) into Triton's on-disk cache, launching nothing.

    python warm_triton.py TABLES.json INDEX COUNT

``TABLES.json``: our tables as ``table_dump`` read them; this process compiles every
``INDEX``-th of ``COUNT`` distinct (N, K, config) swap-AB rows of this GPU's architecture,
with and without the fused residual, through the module's own ``warmup``. Why: Triton
compiles a kernel on its first launch and keeps it on disk for every later process, but
the GPU stage starts a suite's pytest shards (and three targets) at once, and they meet
the same few configs first: without this each would compile them itself. Run with the
target tree on PYTHONPATH. Prints a line per config that failed to compile; exits 0.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "gpu"))


def variants(dump: dict, arch: str) -> list[tuple[int, int, dict]]:
    """Distinct ``(N, K, config)`` of the swap-AB rows of ``arch``, in a fixed order."""
    found = {(n, k, json.dumps(cfg, sort_keys=True))
             for n, k, _m, backend, cfg in dump["archs"].get(arch, {}).get("rows", [])
             if backend == "swap_ab"}
    return [(n, k, json.loads(cfg)) for n, k, cfg in sorted(found)]


def main(argv: list[str]) -> int:
    import torch
    from decode_gemm import candidates

    if not torch.cuda.is_available():
        print("[warm_triton] no CUDA GPU: nothing to compile for")
        return 0
    dump = json.loads(Path(argv[0]).read_text())
    index, count = int(argv[1]), int(argv[2])
    cap = torch.cuda.get_device_capability(0)
    mod = candidates.swap_ab_module()
    for n, k, cfg in variants(dump, f"SM{cap[0]}{cap[1]}")[index::count]:
        for residual in (False, True):
            try:
                mod.warmup(mod.SwapAbConfig(**cfg), n, k, torch.device("cuda"),
                           has_residual=residual)
            except Exception as exc:  # the tests will say it again, with context
                print(f"[warm_triton] {n}x{k} {cfg} residual={residual}: "
                      f"{type(exc).__name__}: {exc}"[:300])
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
