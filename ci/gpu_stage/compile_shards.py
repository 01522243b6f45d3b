"""pytest plugin: run one of N shards of a test run, all tests of one kernel config in one.

``-p gpu_stage.compile_shards`` with ``$K3_SHARD`` = ``i/N``: N pytest processes side by
side, each collecting every test and keeping its share. Why: vLLM's CuTe skinny GEMM is
JIT-compiled once per process per (dtype, config, residual), and its config holds the
token count M (``num_rows``), so the SM90 table of the first runs (144 CuTe rows, 120
distinct (M, config)) cost ~240 compiles per process that met them all, 0.2-0.7 s each
with CuTe DSL 4.6.2 (median 0.42 s over 1456 compiles in ``results/tune_cache``):
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
(a routed row); any other test is a group of its own. Groups go to shards by estimated
cost, largest first, each to the cheapest shard so far (the same in every process: the
collection is). Cost per test, from the H200 run of 2026-11-30 (per-test records of
~1040 tests per target): a CuTe test 1 (it compiles: 0.8 s plain, 0.6 s residual,
0.01 s graph), a test with another config 0.05 (swap-AB: Triton keeps compiled kernels
on disk for every process, 0.02 s), any other 1 (the KDA overlap tests compile: ~1.3 s).
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


def cost(item) -> float:
    """Estimated cost of ``item`` (see the module docstring)."""
    if compile_key(item) is not None:
        return 1.0
    params = getattr(getattr(item, "callspec", None), "params", {})
    configured = any(name == "config" or getattr(value, "config", None) is not None
                     for name, value in params.items())
    return 0.05 if configured else 1.0


def assign(items: list, shards: int) -> list[int]:
    """The shard of each item (index into ``items``)."""
    groups: dict[str, list[int]] = {}
    for i, item in enumerate(items):
        groups.setdefault(compile_key(item) or f"test:{item.nodeid}", []).append(i)
    weight = {key: sum(cost(items[i]) for i in members) for key, members in groups.items()}
    load, shard_of = [0.0] * shards, [0] * len(items)
    for key in sorted(groups, key=lambda g: -weight[g]):  # stable: collection order
        target = load.index(min(load))
        load[target] += weight[key]
        for i in groups[key]:
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
