"""The rebase job's targets as data: ``ci/targets.toml`` (its comment says who reads it).

``load() -> {ref: Target}`` in the file's order. ``python -m ci.targets refs [--gpu-stage]``
prints the refs, space-separated, for shell scripts. The file is checked against the
dataclasses below, which are its schema (a field's type is what the key must hold, a field
without a default is a key each table must have): anything else is ``TargetsError``, one
line naming the file, the key and what is expected, exit 2.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
import tomllib
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path

from k3overlay.errors import UsageError

FILE = Path(__file__).resolve().with_name("targets.toml")


class TargetsError(UsageError):
    """``ci/targets.toml`` is not what the schema says (exit 2, one line)."""


@dataclass(frozen=True)
class E2E:
    """What the end-to-end tier must find when the job rebases onto this target."""

    landed: tuple[str, ...] = ()  # patch numbers ("0001") whose change the release holds
    conflict: tuple[str, ...] = ()  # patch numbers git am --3way stops on there
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
    """The targets of ``path``, by ref, in its order. Raises TargetsError (see the module):
    a file that cannot be read or is no TOML (a key declared twice: two tables of one ref),
    a key the schema lacks, a key missing, a value of another type, two targets ``base``."""
    try:
        with open(path, "rb") as f:
            data = tomllib.load(f)
    except OSError as err:
        raise TargetsError(f"{path}: cannot read it ({err.strerror or err})") from err
    except tomllib.TOMLDecodeError as err:
        raise TargetsError(f"{path}: not valid TOML: {err}") from err
    _keys(data, {"targets"}, {"targets"}, path, "")
    tables = data["targets"]
    if not isinstance(tables, dict):
        raise TargetsError(f"{path}: targets: expected a table of targets, got {_kind(tables)}")
    out = {ref: _record(Target, entry, path, f'targets."{ref}"', ref=ref) for ref, entry in tables.items()}
    bases = [ref for ref, t in out.items() if t.base]
    if len(bases) > 1:
        raise TargetsError(f"{path}: targets.\"{bases[1]}\".base: expected one base target, "
                           f"{bases[0]} is one already")
    return out


def _record(cls: type, table: object, path: Path, where: str, **given):
    """``cls`` (a dataclass of this module) from TOML table ``table`` at key ``where``."""
    if not isinstance(table, dict):
        raise TargetsError(f"{path}: {where}: expected a table, got {_kind(table)}")
    hints = typing.get_type_hints(cls)
    fields = [f for f in dataclasses.fields(cls) if f.name not in given]
    required = {f.name for f in fields if f.default is dataclasses.MISSING
                and f.default_factory is dataclasses.MISSING}
    _keys(table, {f.name for f in fields}, required, path, where, hints)
    return cls(**given, **{name: _value(hints[name], value, path, f"{where}.{name}")
                           for name, value in table.items()})


def _keys(table: dict, known: set[str], required: set[str], path: Path, where: str,
          hints: dict | None = None) -> None:
    prefix = f"{where}." if where else ""
    for key in table:
        if key not in known:
            raise TargetsError(f"{path}: {prefix}{key}: unknown key (expected one of "
                               f"{', '.join(sorted(known))})")
    for key in sorted(required - set(table)):
        wanted = _expected(hints[key]) if hints else "a table"
        raise TargetsError(f"{path}: {prefix}{key}: missing (expected {wanted})")


def _value(hint: object, value: object, path: Path, where: str) -> object:
    """``value`` as the field typed ``hint`` holds it; TargetsError if TOML gave another type."""
    nested = [a for a in typing.get_args(hint) if dataclasses.is_dataclass(a)]
    if typing.get_origin(hint) in (typing.Union, types.UnionType) and nested:
        return _record(nested[0], value, path, where)
    if typing.get_origin(hint) is tuple:
        if isinstance(value, list) and all(isinstance(v, str) for v in value):
            return tuple(value)
    elif type(value) is hint:  # (bool is no str, and an int is no bool)
        return value
    raise TargetsError(f"{path}: {where}: expected {_expected(hint)}, got {_kind(value)}")


def _expected(hint: object) -> str:
    if typing.get_origin(hint) is tuple:
        return 'a list of strings (["a", "b"])'
    if any(dataclasses.is_dataclass(a) for a in typing.get_args(hint)):
        return "a table"
    return {str: 'a string ("...")', bool: "true or false"}[hint]


def _kind(value: object) -> str:
    """What TOML value ``value`` is, in words (and the value, cut short)."""
    if isinstance(value, dict):
        return "a table"
    kinds = {str: "a string", bool: "a boolean", int: "an integer", float: "a number", list: "a list"}
    return f"{kinds.get(type(value), 'a date or time')} {str(value)[:40]!r}"


def gpu_stage_refs() -> list[str]:
    return [ref for ref, t in load().items() if t.gpu_stage]


def e2e_refs() -> list[str]:
    return [ref for ref, t in load().items() if t.e2e is not None]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description="Print the rebase targets' refs.")
    ap.add_argument("what", choices=("refs",))
    ap.add_argument("--gpu-stage", action="store_true", help="only those the GPU stage runs on")
    args = ap.parse_args(argv)
    try:
        print(" ".join(gpu_stage_refs() if args.gpu_stage else load()))
    except TargetsError as err:
        print(f"targets.py: error: {err}", file=sys.stderr)
        return err.exit_code
    return 0


if __name__ == "__main__":
    sys.exit(main())
