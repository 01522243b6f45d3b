"""Render the SM90 table data module from a tuner results JSON (pure, no GPU).

``render(results) -> str`` is a pure function of the JSON: rows with status
``routed`` become ``ROWS[(N, K)][M] = (backend, cfg)``, keys sorted, one M per
line, so re-running it on the committed JSON reproduces the committed module
byte for byte. Shapes with no winner at an M are simply absent for that M.

A later run that tuned only some shapes (``tune.py --shape``) is added with
``--add RUN.json``: every shape it covers takes its rows from that run, and the
module's ``ROW_PROVENANCE`` names that run for those shapes (``PROVENANCE`` stays the
first run's). ``--add RUN.json@NxK,NxK`` takes only the named shapes from that run (e.g.
the GEMV sweep's shapes but one).

Usage: ``python -m k3lab.render_table RESULTS.json [--add RUN.json[@NxK,...] ...] [OUT.py]``
(default OUT: ``overlay/vllm/models/kimi_k3/nvidia/low_latency_gemm_sm90.py``);
``--check`` exits 1 if OUT differs from what the JSONs render to.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys

DEFAULT_OUT = "overlay/vllm/models/kimi_k3/nvidia/low_latency_gemm_sm90.py"
PROV_KEYS = ("gpu", "source", "date", "torch", "cutlass_dsl", "run_id", "token_counts")


def _cfg_text(cfg) -> str:
    return "None" if cfg is None else repr(tuple(cfg))


def _backend_comment(table: dict) -> list[str]:
    """The comment above ``ROWS`` naming the config form of each backend it uses."""
    used = {backend for per_m in table.values() for backend, _, _ in per_m.values()}
    if used <= {"cute", "dsv3_fused_a"}:
        return [
            "# (N, K) -> {M: (backend, cfg)}; backend \"cute\" or \"dsv3_fused_a\"; cfg for cute =",
            "# (block_size, outputs_per_block, k_unroll, vector_width, static_k) and None for",
            "# dsv3_fused_a.",
        ]
    lines = [
        "# (N, K) -> {M: (backend, cfg)}. cfg per backend: cute (block_size,",
        "# outputs_per_block, k_unroll, vector_width, static_k); swap_ab (block_n, block_k,",
        "# split_k, num_warps, num_stages[, rows]); ll_bf16 (\"splitk\", split_k, num_stages) or",
        "# (\"dotprod\", block_size); tinygemm and dsv3_fused_a None.",
    ]
    if "skinny_pdl" in used:  # only then: the modules rendered before it stay byte for byte
        lines.append("# skinny_pdl (block_n, block_k, split_k, num_warps, num_stages).")
    if "gemv_pdl" in used:
        lines.append("# gemv_pdl (threads, rows, prefetch).")
    return lines


def _item(key: str, value: str, indent: str, width: int = 100) -> list[str]:
    """``key: value,`` lines of a dict literal; a long value split into adjacent string
    literals at " -> ", " (" and after "; " (ruff's 110)."""
    line = f"{indent}{key!r}: {value!r},"
    pieces = [p for p in re.split(r"(?= -> )|(?= \()|(?<=; )", value) if p]
    if len(line) <= width or len(pieces) < 2:
        return [line]
    chunks = [pieces[0]]
    for piece in pieces[1:]:  # as few literals as fit the width
        if len(f"{indent}    {chunks[-1] + piece!r}") <= width:
            chunks[-1] += piece
        else:
            chunks.append(piece)
    return [f"{indent}{key!r}: (", *(f"{indent}    {c!r}" for c in chunks), f"{indent}),"]


def _provenance(results: dict, results_path: str) -> dict:
    p = results["provenance"]
    tool = p.get("tool", "k3lab/tune.py")
    arch = "SM" + p["capability"].replace(".", "") if p.get("capability") else ""
    return {
        "gpu": f"{p['gpu']} ({arch})" if arch else p["gpu"],
        "source": f"{tool} run {p['run_id']} -> {results_path}",
        "date": p["date"],
        "torch": p["torch"],
        "cutlass_dsl": p["cutlass_dsl"],
        "run_id": p["run_id"],
    }


def _routed(results: dict) -> dict:
    """``{(N, K): {M: (backend, cfg, speedups)}}`` of a run's routed rows."""
    table: dict = {}
    for r in results["rows"]:
        if r.get("status") == "routed" and r.get("winner"):
            w = r["winner"]
            table.setdefault((r["N"], r["K"]), {})[r["M"]] = (w["backend"], w["cfg"], w["speedup"])
    return table


def render(
    results: dict,
    results_path: str = "results/sm90/tune_sm90.json",
    added: tuple[tuple, ...] = (),
) -> str:
    """Module source for ``results`` (the tuner's JSON) plus ``added`` runs, each
    ``(JSON, path)`` (every shape it covers) or ``(JSON, path, shapes)`` (only ``shapes``,
    a set of ``(N, K)``).

    Raises KeyError if a JSON is malformed.
    """
    p = results["provenance"]
    tool = p.get("tool", "k3lab/tune.py")
    prov = _provenance(results, results_path)
    table = _routed(results)
    row_prov: dict = {}
    # Per shape: the run whose rows it took whole (the main one unless an added run covered
    # the shape), and the later runs of some M only that replaced rows of it, in order.
    origin: dict = dict.fromkeys(table, results_path)
    partial: dict = {}
    for run, path, *only in added:
        covered = {(r["N"], r["K"]) for r in run["rows"]}
        if only:
            covered &= set(only[0])
        if run.get("covers") == "rows":
            # A run of some M only (k3lab/bench/skinny_pdl_sweep.py): its (shape, M) replace
            # the table's where it routed, or where it timed the table's entry ("today") and
            # found cuBLAS faster; an entry it never timed (the table it ran against had
            # none there) stays. The shape's other M stay.
            rows = {(r["N"], r["K"], r["M"]): r for r in run["rows"]}
            new = _routed(run)
            for shape in covered:
                row = {m: e for m, e in table.get(shape, {}).items()
                       if not _judged(rows.get((*shape, m)), e)}
                row.update(new.get(shape, {}))
                table[shape] = row
            table = {shape: row for shape, row in table.items() if row}
        else:
            table = {shape: row for shape, row in table.items() if shape not in covered}
            table.update({shape: row for shape, row in _routed(run).items() if shape in covered})
            origin.update(dict.fromkeys(covered, path))
            for shape in covered:
                partial.pop(shape, None)
        prov_run = _provenance(run, path)
        if run.get("covers") != "rows":
            row_prov.update(dict.fromkeys(covered, prov_run))
            continue
        # Say which M it gave, and where the shape's other M come from: the earlier runs of
        # some M, then the run that gave the shape whole.
        ms = sorted({r["M"] for r in run["rows"]})
        for shape in covered:
            earlier = "".join(f"M {a}..{b}: {src}; " for a, b, src in partial.get(shape, ()))
            other = f"other M: {origin.get(shape, results_path)}"
            row_prov[shape] = {**prov_run, "token_counts": f"M {ms[0]}..{ms[-1]} ({earlier}{other})"}
            partial.setdefault(shape, []).append((ms[0], ms[-1], path))
    row_prov = {shape: src for shape, src in row_prov.items() if shape in table}
    crit = results.get("criteria", {})
    lines = [
        '"""SM90 (H200) table for low_latency_gemm: measured, not hand-written.',
        "",
        f"Generated by k3lab/render_table.py from {results_path}",
        f"(tuner {tool}, run {p['run_id']}, {p['gpu']}, {p['date']},",
        f"torch {p['torch']}, nvidia-cutlass-dsl {p['cutlass_dsl']}). Each entry beat",
        f"cuBLAS (torch.mm) by >= {int(round((crit.get('win_both_passes', 1.05) - 1) * 100))}% "
        "in two independent CUDA-graph timing passes;",
        "the trailing comment gives the two measured speedups. Do not edit by hand:",
        "re-run the tuner (docs/gpu-lab.md) and re-render.",
        '"""',
        "",
        "PROVENANCE = {",
    ]
    lines += [line for k in PROV_KEYS if k in prov for line in _item(k, prov[k], "    ")]
    lines += ["}", ""]
    if row_prov:
        lines += ["# Shapes taken from another run: (N, K) -> the provenance of that run.",
                  "ROW_PROVENANCE = {"]
        for shape in sorted(row_prov):
            lines.append(f"    {shape}: {{")
            lines += [line for k in PROV_KEYS if k in row_prov[shape] for line in _item(k, row_prov[shape][k], "        ")]
            lines.append("    },")
        lines += ["}", ""]
    lines += [
        *_backend_comment(table),
        "ROWS = {",
    ]
    for (n, k) in sorted(table):
        lines.append(f"    ({n}, {k}): {{")
        for m in sorted(table[(n, k)]):
            backend, cfg, sp = table[(n, k)][m]
            lines.append(
                f"        {m}: ({backend!r}, {_cfg_text(cfg)}),  # {sp[0]:.2f}x / {sp[1]:.2f}x"
            )
        lines.append("    },")
    lines.append("}")
    return "\n".join(lines).replace("'", '"') + "\n"


def _repo_path(path: str) -> str:
    # The module names each JSON by its repo path, whatever path it was read from.
    return "results/sm90/" + os.path.basename(path)


def _judged(row: dict | None, entry: tuple) -> bool:
    """Whether a run of some M only decided over ``entry`` (``(backend, cfg)``): it routed
    that (shape, M), or timed the same backend there as the table's entry ("today")."""
    if row is None:
        return False
    today = (row.get("today") or [None])[0]
    return row.get("status") == "routed" or today == entry[0]


def _added(spec: str) -> tuple:
    """``PATH`` or ``PATH@NxK,NxK`` -> the ``added`` entry :func:`render` takes."""
    path, _, shapes = spec.partition("@")
    run = json.load(open(path))
    if not shapes:
        return run, _repo_path(path)
    return run, _repo_path(path), {tuple(map(int, s.split("x"))) for s in shapes.split(",")}


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(description="Render the SM90 table module from tuner JSON.")
    ap.add_argument("results", help="the run the table is rendered from (tuner or figures JSON)")
    ap.add_argument("out", nargs="?", default=DEFAULT_OUT, help=f"default {DEFAULT_OUT}")
    ap.add_argument("--add", action="append", default=[], metavar="RUN.json[@NxK,...]",
                    help="rows of a later run on top (only the named shapes with @)")
    ap.add_argument("--check", action="store_true", help="exit 1 if OUT differs, write nothing")
    # intermixed: OUT may follow the --add options (argparse alone would refuse it there)
    args = ap.parse_intermixed_args(argv)
    runs = tuple(_added(spec) for spec in args.add)
    with open(args.results) as f:
        text = render(json.load(f), _repo_path(args.results), runs)
    if args.check:
        same = os.path.exists(args.out) and open(args.out).read() == text
        print("up to date" if same else f"{args.out} differs from {args.results}")
        return 0 if same else 1
    with open(args.out, "w") as f:
        f.write(text)
    print(f"wrote {args.out}: {text.count('),  # ')} entries")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
