"""Build the GPU stage's targets add-on: each rebase target's tree and wheels, in parts.

    python -m ci.gpu_stage.addon --target-trees DIR --out DIR [--part-mib 25] [--python-version 3.12]

``--target-trees`` is what ``python -m ci.rebase --gpu-export DIR`` wrote. The payload
holds ``targets/<ref>/``: ``tree.tar.xz`` (the tree as the job built it, with its
dist-info), ``meta.json`` (the stage's inputs, ``stage.py``) and ``wheels/``: the target's
``gpu_wheels`` in ``ci/targets.toml`` (the CuTe DSL release it pins when that is not the
base bundle's, and imports the base bundle lacks). Parts and ``BUNDLE.json`` (``"kind":
"targets"``) are written as the lab's base bundle writes them (``k3lab/bundle.py``), so
``k3lab/device/install.sh`` installs both. Raises SystemExit with a message when a
target's tree is missing, when it pins a CuTe DSL release that neither the base bundle nor
its wheels carry, or when pip fails.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
import tarfile

from ci import targets
from k3lab.bundle import download_wheels, start_parts, write_parts


def cute_dsl_pin(lines: list[str]) -> str | None:
    """``4.8.0`` out of ``["nvidia-cutlass-dsl[cu13]==4.8.0"]``."""
    for line in lines:
        match = re.search(r"==\s*([0-9][0-9.]*)", line)
        if match:
            return match.group(1)
    return None


def add_targets(tar: tarfile.TarFile, trees: str, work: str, python_version: str) -> list[str]:
    """Add ``targets/<ref>/`` for each exported tree; returns the refs (see the module)."""
    refs = sorted(d for d in os.listdir(trees) if os.path.isfile(os.path.join(trees, d, "meta.json")))
    if not refs:
        raise SystemExit(f"--target-trees {trees}: no <ref>/meta.json (python -m ci.rebase --gpu-export)")
    known = targets.load()
    base_pin = next((t.cute_dsl for t in known.values() if t.base), None)
    for ref in refs:
        src = os.path.join(trees, ref)
        pin = cute_dsl_pin(json.load(open(os.path.join(src, "meta.json")))["cute_dsl"])
        wanted = known[ref].gpu_wheels if ref in known else ()
        if wanted:
            if pin and f"nvidia-cutlass-dsl=={pin}" not in wanted:
                raise SystemExit(f"{ref} pins CuTe DSL {pin}; its gpu_wheels in {targets.FILE} "
                                 f"do not carry it")
            wheels = os.path.join(work, "target-wheels", ref)
            os.makedirs(wheels)
            req = os.path.join(work, f"{ref}.txt")
            with open(req, "w") as f:
                f.write("\n".join(wanted) + "\n")
            download_wheels(wheels, python_version, req)
            for f in sorted(os.listdir(wheels)):
                tar.add(os.path.join(wheels, f), arcname=f"targets/{ref}/wheels/{f}")
        elif pin and pin != base_pin:
            raise SystemExit(f"{ref} pins CuTe DSL {pin}, the base bundle carries {base_pin}: "
                             f"list its wheels as gpu_wheels in {targets.FILE}")
        for f in ("tree.tar.xz", "meta.json"):
            tar.add(os.path.join(src, f), arcname=f"targets/{ref}/{f}")
    return refs


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--target-trees", required=True, help="python -m ci.rebase --gpu-export DIR")
    ap.add_argument("--out", required=True)
    ap.add_argument("--part-mib", type=float, default=60.0)
    ap.add_argument("--python-version", default="3.12")
    args = ap.parse_args(argv)
    work, payload = start_parts(args)
    try:
        with tarfile.open(payload, "w") as t:
            refs = add_targets(t, args.target_trees, work, args.python_version)
    except targets.TargetsError as err:  # the data file is malformed: one line, exit 2
        print(f"addon.py: error: {err}", file=sys.stderr)
        return err.exit_code
    return write_parts(args, work, payload, {"kind": "targets", "targets": refs})


if __name__ == "__main__":
    sys.exit(main())
