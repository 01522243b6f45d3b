"""Dump a vLLM tree's Kimi-K3 low-latency GEMM tables as JSON, by importing the module.

Runs inside the tree's own environment (PYTHONPATH = the tree, the tier's Python), so
upstream's tables come out of upstream's own ``ProjectionSpec``/``SkinnyGemmConfig``
dataclasses and upstream's own plan builder, never out of parsing text. The module read
is our dispatch (``low_latency_gemm_dispatch``, which the overlay adds and the model
uses) where the tree has it, else upstream's ``low_latency_gemm``:

* for each probed CUDA capability, vLLM's ``current_platform`` (as the module sees it) is
  replaced by a stand-in reporting that capability, and the module's own table accessor
  answers which table the capability routes with: ``device_table()`` (ours),
  ``_low_latency_table()`` (upstream v0.29.0 and later) or ``_is_sm103()`` gating
  ``KIMI_K3_PROJECTIONS`` (upstream v0.28.0);
* every row of that table goes through the module's ``_build_plan`` (``{M: (backend,
  config)}``) and ``_build_residual_plan`` (``{M: config}``).

``--prefer DIR`` imports the package's modules from ``DIR`` first (DIR mirrors the tree's
``vllm/models/kimi_k3/nvidia``): how our overlay module is read on a target where the
3-way merge of it conflicted and the tree still holds upstream's file.

Output (stdout or ``--out``)::

    {"module": PATH, "accessor": NAME,
     "archs": {"SM90": {"rows": [[N, K, M, backend, config|null], ...],
                        "residual": [[N, K, M, config], ...]}, ...}}

``config`` is the ``SkinnyGemmConfig`` as a dict without ``num_rows`` (which equals M);
other backends' configs as their dataclass or named-tuple fields.
Exit 1 with a one-line message on stderr if the module has no accessor we know.
Only the standard library and the tree are imported here.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib
import json
import sys
from collections import namedtuple

# The Kimi-K3 model's dispatch: ours where the overlay added it (patches 0002/0004 point the
# model at it), else upstream's.
MODULES = ("vllm.models.kimi_k3.nvidia.low_latency_gemm_dispatch",
           "vllm.models.kimi_k3.nvidia.low_latency_gemm")
# Every capability any Kimi-K3 table has been keyed on so far, and its neighbours.
CAPABILITIES = ((8, 0), (8, 9), (9, 0), (10, 0), (10, 3), (10, 7), (11, 0), (12, 0), (12, 1))


class _Capability(namedtuple("_Capability", "major minor")):
    def to_int(self) -> int:
        return self.major * 10 + self.minor

    def as_version_str(self) -> str:
        return f"{self.major}.{self.minor}"


class FakePlatform:
    """A CUDA platform that reports one compute capability, nothing else."""

    def __init__(self, capability: tuple[int, int]) -> None:
        self._cap = _Capability(*capability)

    def is_cuda(self) -> bool:
        return True

    def is_rocm(self) -> bool:
        return False

    def get_device_capability(self, device_id: int = 0) -> _Capability:
        return self._cap

    def _as_int(self, capability) -> int:
        return capability if isinstance(capability, int) else capability[0] * 10 + capability[1]

    def is_device_capability(self, capability, device_id: int = 0) -> bool:
        return self._as_int(capability) == self._cap.to_int()

    def has_device_capability(self, capability, device_id: int = 0) -> bool:
        return self._cap.to_int() >= self._as_int(capability)

    def is_device_capability_family(self, capability: int, device_id: int = 0) -> bool:
        return self._cap.to_int() // 10 == capability // 10

    def is_arch_support_pdl(self) -> bool:
        return self._cap.major >= 9


def _config(config) -> dict | list | str | None:
    """A backend's config as JSON: a dataclass (``SkinnyGemmConfig``) or named tuple as a
    dict without ``num_rows`` (which is M), another tuple as a list, anything else its repr."""
    if config is None:
        return None
    if dataclasses.is_dataclass(config):
        data = dataclasses.asdict(config)
    elif hasattr(config, "_asdict"):
        data = dict(config._asdict())
    elif isinstance(config, (tuple, list)):
        return list(config)
    else:
        return repr(config)
    data.pop("num_rows", None)
    return data


def _accessor(module):
    """(name, fn() -> table or None under the platform in force)."""
    if hasattr(module, "device_table"):
        return "device_table", module.device_table
    if hasattr(module, "_low_latency_table"):
        return "_low_latency_table", module._low_latency_table
    if hasattr(module, "_is_sm103") and hasattr(module, "KIMI_K3_PROJECTIONS"):
        return "_is_sm103", lambda: module.KIMI_K3_PROJECTIONS if module._is_sm103() else None
    raise LookupError(f"{module.__file__}: no table accessor (device_table, _low_latency_table, "
                      f"_is_sm103) to read the tables with")


def _table_json(module, table) -> dict:
    rows, residual = [], []
    for (n, k), spec in sorted(table.items()):
        for m, (backend, config) in sorted(module._build_plan(spec).items()):
            rows.append([n, k, m, backend, _config(config)])
        for m, config in sorted(module._build_residual_plan(spec).items()):
            residual.append([n, k, m, _config(config)])
    return {"rows": rows, "residual": residual}


def _import_dispatch():
    """The first of :data:`MODULES` the tree has (an error inside it is raised, not skipped)."""
    for name in MODULES[:-1]:
        try:
            return importlib.import_module(name)
        except ModuleNotFoundError as err:
            if err.name != name:
                raise
    return importlib.import_module(MODULES[-1])


def dump(prefer: str | None = None) -> dict:
    """The tables of the importable module, per architecture (see the module docstring)."""
    if prefer:
        import prefer_overlay  # next to this file

        prefer_overlay.install(prefer)
    module = _import_dispatch()
    name, accessor = _accessor(module)
    real = module.current_platform
    archs = {}
    try:
        for capability in CAPABILITIES:
            module.current_platform = FakePlatform(capability)
            for fn in vars(module).values():  # a cached answer would be the real device's
                if callable(getattr(fn, "cache_clear", None)):
                    fn.cache_clear()
            table = accessor()
            if table is not None:
                archs[f"SM{capability[0]}{capability[1]}"] = _table_json(module, table)
    finally:
        module.current_platform = real
    return {"module": module.__file__, "accessor": name, "archs": archs}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prefer", help="import the package's modules from this folder first")
    parser.add_argument("--out", help="write the JSON here instead of stdout")
    args = parser.parse_args(argv)
    try:
        data = dump(args.prefer)
    except Exception as exc:  # anything the import raises is the answer to report
        print(f"table_dump: {type(exc).__name__}: {exc}", file=sys.stderr)
        return 1
    text = json.dumps(data, sort_keys=True)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text)
    else:
        print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
