"""Read vLLM's Kimi-K3 dispatch tables out of a release's source, as data.

Used at bundle time (CPU, no vLLM import) to give the tuner its seed configs
and the benchmark v0.29.0's SM90 table to compare against. Only the dict
literals named ``KIMI_K3_PROJECTIONS*`` are evaluated, with local stand-ins for
``ProjectionSpec``/``_cute``/``_sm90_spec``/``SkinnyGemmConfig``; no upstream code is executed or copied.

Output rows: ``{"N", "K", "cute": {M: cfg}, "residual": {M: cfg}, "dsv3": [M...]}``
with ``cfg = [block_size, outputs_per_block, k_unroll, vector_width, static_k]``.
"""

from __future__ import annotations

import ast
import json
import sys


def _spec(n, k, dsv3_tokens=frozenset(), cute_configs=(), residual_configs=(), name=""):
    return {
        "N": n,
        "K": k,
        "cute": {m: list(c) for m, c in cute_configs},
        "residual": {m: list(c) for m, c in residual_configs},
        "dsv3": sorted(dsv3_tokens),
    }


def _cute(num_tokens, block_size, outputs_per_block, k_unroll, vector_width=8):
    return (block_size, outputs_per_block, k_unroll, vector_width, None)


def _skinny_cfg(num_rows, block_size, outputs_per_block, k_unroll=1, vector_width=8, static_k=None):
    return (block_size, outputs_per_block, k_unroll, vector_width, static_k)


def _sm90_spec(n, k, dsv3_tokens=frozenset(), configs=()):
    # v0.29.0's SM90 helper lists one config per M starting at M=1.
    cute = tuple((m, _cute(m, *c)) for m, c in enumerate(configs, start=1))
    return _spec(n, k, dsv3_tokens, cute)


def extract(path: str) -> dict[str, list[dict]]:
    """``{table_name: [row, ...]}`` for every ``KIMI_K3_PROJECTIONS*`` in ``path``.

    Raises ``ValueError`` if the file holds no such table.
    """
    tree = ast.parse(open(path).read())
    env = {
        "ProjectionSpec": _spec,
        "_cute": _cute,
        "_sm90_spec": _sm90_spec,
        "SkinnyGemmConfig": _skinny_cfg,
        "frozenset": frozenset,
        "range": range,
        "_M1_TO_16": frozenset(range(1, 17)),
        "_M1": frozenset({1}),
    }
    tables = {}
    for node in tree.body:
        target = value = None
        if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            target, value = node.target.id, node.value
        elif isinstance(node, ast.Assign) and len(node.targets) == 1:
            if isinstance(node.targets[0], ast.Name):
                target, value = node.targets[0].id, node.value
        if target and target.startswith("KIMI_K3_PROJECTIONS") and value is not None:
            expr = ast.Expression(body=value)
            table = eval(compile(expr, path, "eval"), {"__builtins__": {}}, env)
            tables[target] = sorted(table.values(), key=lambda r: (r["N"], r["K"]))
    if not tables:
        raise ValueError(f"no KIMI_K3_PROJECTIONS* table in {path}")
    return tables


def main(argv: list[str]) -> int:
    """``upstream_tables.py OUT.json TAG=PATH ...``: write ``{TAG: tables}``."""
    out, pairs = argv[0], argv[1:]
    result = {}
    for pair in pairs:
        tag, path = pair.split("=", 1)
        result[tag] = extract(path)
    with open(out, "w") as f:
        json.dump(result, f, indent=1, sort_keys=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
