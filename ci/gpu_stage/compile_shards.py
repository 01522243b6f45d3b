"""pytest plugin: run one of N shards of a test run, all tests of one kernel config in one.

``-p gpu_stage.compile_shards`` with ``$K3_SHARD`` = ``i/N``: N pytest processes side by
side, each collecting every test and keeping its share. Why: vLLM's CuTe skinny GEMM is
JIT-compiled once per process per (dtype, config, residual), and its config holds the
token count M (``num_rows``), so the SM90 table of the first runs (144 CuTe rows, 120
distinct (M, config)) cost ~240 compiles per process that met them all, 0.2-0.7 s each
with CuTe DSL 4.6.2 (median 0.42 s over 1456 compiles in ``ci/gpu/results/tune_cache``):
the bulk of our numerics file (one process on the H200: 301 of ~470 tests in 150 s,
2026-11-30; the table rendered later routes 73 rows to CuTe, 346 to swap-AB). Our
file runs ~3 tests per row (plain and CUDA graph: the same kernel; fused residual), and
pytest-xdist's load distribution hands them to whichever worker is free, so a kernel
compiles in more than one worker and each worker also pays its own CuTe DSL start-up
(2026-11-30: 3 workers per target beside vLLM's suites did not finish in 140 s).
xdist's ``--dist loadgroup`` would keep a group together, but with pytest 9 it silently
does not (it renames ``item._nodeid``, which pytest 9 no longer reads), so the grouping
is done here, by deselection.

A test's group is the CuTe config (a ``SkinnyGemmConfig``) of its first parameter that
has one: a parameter named ``config`` or a parameter value with a ``config`` attribute
(a routed row); any other test is a group of its own. Triton kernels (swap-AB) are left
ungrouped: Triton keeps compiled kernels on disk, shared by every process, and their
configs are few and shared by hundreds of rows (one group would fill a shard). Groups go
to shards largest first, each to the shard with the fewest tests so far (the same in
every process: the collection is).
"""

from __future__ import annotations

import os

ENV = "K3_SHARD"
CUTE_CONFIG = "SkinnyGemmConfig"  # vLLM's CuTe skinny-GEMM config class


def compile_key(item) -> str | None:
    """``repr`` of the CuTe config ``item`` compiles, or None."""
    params = getattr(getattr(item, "callspec", None), "params", {})
    for name, value in params.items():
        config = value if name == "config" else getattr(value, "config", None)
        if type(config).__name__ == CUTE_CONFIG:
            return repr(config)
    return None


def assign(items: list, shards: int) -> list[int]:
    """The shard of each item (index into ``items``)."""
    groups: dict[str, list[int]] = {}
    for i, item in enumerate(items):
        groups.setdefault(compile_key(item) or f"test:{item.nodeid}", []).append(i)
    load, shard_of = [0] * shards, [0] * len(items)
    for members in sorted(groups.values(), key=len, reverse=True):  # stable: collection order
        target = load.index(min(load))
        load[target] += len(members)
        for i in members:
            shard_of[i] = target
    return shard_of


def pytest_collection_modifyitems(config, items) -> None:
    if not os.environ.get(ENV):
        return
    index, shards = (int(x) for x in os.environ[ENV].split("/"))
    shard_of = assign(items, shards)
    keep = [item for item, s in zip(items, shard_of) if s == index]
    dropped = [item for item, s in zip(items, shard_of) if s != index]
    if dropped:
        config.hook.pytest_deselected(items=dropped)
    items[:] = keep
