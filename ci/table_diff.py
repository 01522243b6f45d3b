"""Ours-vs-upstream diff of the Kimi-K3 low-latency GEMM tables on a rebase target.

Both sides are read by importing the module (``table_dump.py`` in a subprocess: the
target environment's Python, PYTHONPATH at the tree, as ``cpu_tier.py`` runs vLLM's
tests): upstream's from the pristine target tree, ours from the patched tree, or from
our overlay files ahead of that tree where the 3-way merge of our module conflicted
(the tree then still holds upstream's file).

A row is ``(N, K, M)`` plus whether it is a fused-residual row; its choice is the
backend and, for CuTe, the ``SkinnyGemmConfig`` (without ``num_rows``, which is M).
Per architecture the diff lists rows only upstream routes, rows only ours routes, rows
both route to a different backend or config, and counts the rows where they agree.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

from k3overlay.stages import Section

CI_DIR = Path(__file__).resolve().parent

DUMP = CI_DIR / "table_dump.py"
KINDS = ("upstream_only", "ours_only", "different")


class TableReadError(Exception):
    """Importing the module or reading its tables failed (message: the dump's last line)."""


def read_tables(tree: Path, python: str, prefer: Path | None = None) -> dict:
    """``table_dump.py``'s JSON for ``tree`` (see there). Raises TableReadError."""
    with tempfile.TemporaryDirectory(prefix="k3-tables-") as tmp:
        out = Path(tmp) / "tables.json"
        cmd = [python, str(DUMP), "--out", str(out)]
        if prefer is not None:
            cmd += ["--prefer", str(prefer.resolve())]
        env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(tree), str(CI_DIR)]),
                   PYTHONDONTWRITEBYTECODE="1")  # leave the tree as we found it
        proc = subprocess.run(cmd, cwd=tree, env=env, stdout=subprocess.DEVNULL,
                              stderr=subprocess.PIPE, text=True)
        if proc.returncode != 0 or not out.is_file():
            lines = [line for line in proc.stderr.splitlines() if line.strip()]
            raise TableReadError(lines[-1] if lines else f"table_dump exited {proc.returncode}")
        return json.loads(out.read_text())


def _choices(arch_tables: dict) -> dict[tuple, dict]:
    """``{(N, K, M, residual): {"backend", "config"}}`` of one architecture."""
    rows = {(n, k, m, False): {"backend": b, "config": c}
            for n, k, m, b, c in arch_tables.get("rows", [])}
    rows.update({(n, k, m, True): {"backend": "cute", "config": c}
                 for n, k, m, c in arch_tables.get("residual", [])})
    return rows


def diff(upstream: dict, ours: dict) -> dict[str, dict]:
    """Per architecture: ``upstream_only``, ``ours_only``, ``different`` rows and ``same``.

    ``upstream``/``ours`` are ``table_dump`` outputs. Each listed row is ``{"N", "K",
    "M", "residual", "upstream", "ours"}`` (a side's choice, or None where it has no row),
    sorted by (residual, N, K, M).
    """
    result = {}
    for arch in sorted(set(upstream["archs"]) | set(ours["archs"])):
        up = _choices(upstream["archs"].get(arch, {}))
        us = _choices(ours["archs"].get(arch, {}))
        section = {kind: [] for kind in KINDS}
        same = 0
        for key in sorted(set(up) | set(us), key=lambda t: (t[3], t[0], t[1], t[2])):
            a, b = up.get(key), us.get(key)
            if a == b:
                same += 1
                continue
            kind = "ours_only" if a is None else "upstream_only" if b is None else "different"
            n, k, m, residual = key
            section[kind].append({"N": n, "K": k, "M": m, "residual": residual,
                                  "upstream": a, "ours": b})
        section["same"] = same
        result[arch] = section
    return result


def section(upstream: dict, ours: dict, pristine: Path, patched: Path,
            ours_from: Path | None) -> dict:
    """The report's ``tables`` section for one target.

    Args:
        upstream: ``read_tables`` of the target tree as released (upstream's module).
        ours: ``read_tables`` of the tree the job built, with ``prefer=ours_from``.
        pristine, patched: those two trees (to name the modules read).
        ours_from: our overlay's package folder when the tree does not hold our module
            (its merge conflicted), else None.

    Returns:
        ``{"upstream": {"module", "accessor"}, "ours": {"module", "accessor"},
        "archs": diff(...)}``.
    """
    return {"upstream": _where(upstream, pristine),
            "ours": _where(ours, patched, ours_from and ours_from.resolve()),
            "archs": diff(upstream, ours)}


def _where(dump: dict, tree: Path, prefer: Path | None = None) -> dict:
    """The module a dump read, as the maintainer finds it: tree-relative, or under overlay/."""
    module = Path(dump["module"])
    for root, label in ((prefer, "overlay/vllm/models/kimi_k3/nvidia"), (tree, "")):
        if root is not None and module.is_relative_to(root):
            module = Path(label) / module.relative_to(root)
            break
    return {"module": module.as_posix(), "accessor": dump["accessor"]}


def summary(tables: dict) -> dict[str, dict[str, int]]:
    """``{arch: {kind: row count, "same": n}}`` of a ``tables`` section."""
    return {arch: {**{kind: len(s[kind]) for kind in KINDS}, "same": s["same"]}
            for arch, s in tables.get("archs", {}).items()}


DETAIL_ROWS = 40  # rows listed in the report's collapsed table; the JSON report has them all


def as_section(tables: dict, ref: str) -> Section:
    """The report's section for ``section()``'s result (or ``{"error": why}``): a line per
    architecture, the counts and the rows that differ (clipped) as collapsed markdown."""
    if tables.get("error"):
        return Section("tables", "table diff", [f"not read: {tables['error']}"], tables,
                       error=tables["error"])
    parts = [f"{arch} {s['same']} same" if not any(s[kind] for kind in KINDS) else
             f"{arch} {len(s['upstream_only'])} upstream only, {len(s['ours_only'])} ours only, "
             f"{len(s['different'])} different, {s['same']} same"
             for arch, s in tables["archs"].items()]
    lines = ["; ".join(parts)]  # one line: the first screen is short
    rows = [f"| {arch} | {kind.replace('_', ' ')} | {d['N']}x{d['K']} M{d['M']}"
            f"{' +residual' if d['residual'] else ''} | {choice(d['upstream'])} | {choice(d['ours'])} |"
            for arch, s in tables["archs"].items() for kind in KINDS for d in s[kind]]
    details = [f"Upstream's `{tables['upstream']['module']}` as {ref} released it vs ours, "
               f"`{tables['ours']['module']}`. Rows are (N, K, M); config = block_size, "
               f"outputs_per_block, k_unroll, vector_width, static_k.", ""]
    if rows:
        details += ["| arch | kind | row | upstream | ours |", "|---|---|---|---|---|",
                    *rows[:DETAIL_ROWS]]
        if len(rows) > DETAIL_ROWS:
            details.append(f"\n{len(rows) - DETAIL_ROWS} more rows in the JSON report's `tables`.")
    return Section("tables", "table diff", lines, tables, "\n".join(details))


def choice(side: dict | None) -> str:
    """A side's choice for a row: ``cuBLAS`` (no row), the backend, or backend + CuTe config."""
    if side is None:
        return "cuBLAS"
    config = side.get("config")
    if not config:
        return side["backend"]
    cfg = ",".join("-" if config.get(k) is None else str(config[k])
                   for k in ("block_size", "outputs_per_block", "k_unroll", "vector_width",
                             "static_k"))
    return f"{side['backend']} {cfg}"


def main(argv: list[str] | None = None) -> None:
    """``python -m ci.table_diff PRISTINE PATCHED [OURS_DIR]``: the diff's JSON summary on stdout."""
    p = argparse.ArgumentParser(prog="python -m ci.table_diff", description=__doc__.splitlines()[0])
    p.add_argument("pristine", type=Path, help="the target's vLLM tree as released (upstream's tables)")
    p.add_argument("patched", type=Path, help="the same tree with the series and overlay laid (ours)")
    p.add_argument("ours_dir", type=Path, nargs="?",
                   help="our overlay files, read ahead of PATCHED (where our module's merge conflicted)")
    args = p.parse_args(argv)
    up = read_tables(args.pristine, sys.executable)
    us = read_tables(args.patched, sys.executable, args.ours_dir)
    print(json.dumps(summary(section(up, us, args.pristine, args.patched, args.ours_dir)), indent=1))


if __name__ == "__main__":
    main()
