"""The rebase job's targets as data: ``ci/targets.toml`` (its comment says who reads it).

``load() -> {ref: Target}`` in the file's order. ``python -m ci.targets refs [--gpu-stage]``
prints the refs, space-separated, for shell scripts. Raises ValueError naming the file and
the field when an entry is malformed.
"""

from __future__ import annotations

import argparse
import sys
import tomllib
from dataclasses import dataclass, field
from pathlib import Path

FILE = Path(__file__).resolve().with_name("targets.toml")


@dataclass(frozen=True)
class E2E:
    """What the end-to-end tier must find when the job rebases onto this target."""

    landed: tuple[str, ...] = ()  # patch numbers ("0001") whose change the release holds
    sm107_table: bool = False  # upstream's SM107 table is SM103's


@dataclass(frozen=True)
class Target:
    ref: str
    torch: str  # the CUDA torch release the target pins (requirements/cuda.txt)
    cute_dsl: str  # nvidia-cutlass-dsl release it pins
    flashinfer: str
    quack_kernels: str
    base: bool = False  # the pinned base: the base bundle carries its wheels
    gpu_stage: bool = False  # the GPU stage's add-on carries its tree
    gpu_wheels: tuple[str, ...] = ()  # requirement lines the add-on downloads for it
    e2e: E2E | None = field(default=None)  # None: not checked by the end-to-end tier


def load(path: Path = FILE) -> dict[str, Target]:
    with open(path, "rb") as f:
        data = tomllib.load(f)
    out = {}
    for ref, entry in data.get("targets", {}).items():
        entry = dict(entry)
        try:
            e2e = entry.pop("e2e", None)
            out[ref] = Target(ref=ref, gpu_wheels=tuple(entry.pop("gpu_wheels", ())),
                              e2e=E2E(landed=tuple(e2e.get("landed", ())),
                                      sm107_table=bool(e2e.get("sm107_table", False)))
                              if e2e is not None else None, **entry)
        except TypeError as err:
            raise ValueError(f"{path}: target {ref}: {err}") from err
    return out


def gpu_stage_refs() -> list[str]:
    return [ref for ref, t in load().items() if t.gpu_stage]


def e2e_refs() -> list[str]:
    return [ref for ref, t in load().items() if t.e2e is not None]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description="Print the rebase targets' refs.")
    ap.add_argument("what", choices=("refs",))
    ap.add_argument("--gpu-stage", action="store_true", help="only those the GPU stage runs on")
    args = ap.parse_args(argv)
    print(" ".join(gpu_stage_refs() if args.gpu_stage else load()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
