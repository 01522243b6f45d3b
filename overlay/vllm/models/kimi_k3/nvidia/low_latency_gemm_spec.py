# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-k3-overlay project
"""Kimi-K3 decode GEMM tables as objects: one :class:`ShapeTable` per GPU architecture.

The figures are pure data in two modules next to this one (``low_latency_gemm_tables``
for Blackwell, ``low_latency_gemm_sm90`` for Hopper, the latter rendered by the kernel
lab from one measured run), each ``(N, K) -> {M: (backend, cfg)}`` with its source; this
module turns them into checked, read-only tables:

=========  ===================  ============================================
capability GPU                  table
=========  ===================  ============================================
SM103      B300                 :data:`KIMI_K3_PROJECTIONS`
SM107      Rubin                same object as SM103 (no own figures yet)
SM100      B200                 :data:`KIMI_K3_PROJECTIONS_SM100`
SM90       H200                 :data:`KIMI_K3_PROJECTIONS_SM90`
other      -                    none: every call keeps the layer's normal path
=========  ===================  ============================================

A table is keyed by the *local* weight shape ``(N, K)`` (output features, input
features) that a tensor-parallel rank holds; a module's name never takes part in the
decision. For a shape, its :class:`ProjectionSpec` holds the winning backend per M and
its config. M without an entry means cuBLAS won. Backends are named by the strings of
the data; each name is looked up in the backend registry (``gemm_backends``), which
parses and checks its configs, so a table that names an unknown backend, or a config
its backend cannot run, fails at import.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any, NamedTuple

from vllm.models.kimi_k3.nvidia import gemm_backends
from vllm.models.kimi_k3.nvidia import low_latency_gemm_sm90 as _sm90_data
from vllm.models.kimi_k3.nvidia import low_latency_gemm_tables as _blackwell_data
from vllm.models.kimi_k3.nvidia.gemm_backends.base import Capability

Shape = tuple[int, int]  # local (N, K) of a weight

# Token counts the skinny kernels exist for; the CuTe kernel rejects M > 16.
DECODE_TOKEN_COUNTS = range(1, 17)


class PlannedCall(NamedTuple):
    """One resolved (shape, M) decision: the backend's name and its config (None if it has none)."""

    backend: str
    config: Any


def config_from_data(backend: str, m: int, cfg: Any) -> Any:
    """A data module's config tuple -> the config object ``backend`` takes at M = ``m``.

    Each backend module documents its tuple; None stays None. An unknown backend keeps
    the tuple, for :class:`ProjectionSpec` to reject with the shape and M named.

    Raises:
        ValueError: for a tuple the backend cannot read.
    """
    if cfg is None:
        return None
    backend_impl = gemm_backends.BACKENDS.get(backend)
    return tuple(cfg) if backend_impl is None else backend_impl.config_from_data(m, cfg)


def _call_error(shape: Shape, m: int, call: PlannedCall) -> str | None:
    backend = gemm_backends.BACKENDS.get(call.backend)
    if backend is None:
        return f"unknown backend {call.backend!r}"
    return backend.config_error(shape[0], shape[1], m, call.config)


def _residual_error(shape: Shape, m: int, config: Any) -> str | None:
    backend = gemm_backends.residual_backend()
    if backend is None:
        return "no backend fuses the residual"
    return backend.config_error(shape[0], shape[1], m, config)


@dataclass(frozen=True, slots=True)
class ProjectionSpec:
    """Measured decode winners for one local weight shape.

    Attributes:
        n: output features N of the local weight ``(N, K)``.
        k: input features K.
        winners: ``((M, PlannedCall), ...)`` sorted by M, one entry per M at which a
            fast kernel beat cuBLAS; any other M keeps the layer's normal path.
        residual_configs: ``((M, config), ...)`` for the backend with the fused
            ``+ residual`` epilogue (``gemm_backends.residual_backend()``).

    Raises:
        ValueError: on construction, if an M is outside 1..16 or listed twice, a
            backend is unknown, or a config cannot run this shape (each backend's
            ``config_error`` says why: see its module).
    """

    n: int
    k: int
    winners: tuple[tuple[int, PlannedCall], ...] = ()
    residual_configs: tuple[tuple[int, Any], ...] = ()

    def __post_init__(self) -> None:
        shape = (self.n, self.k)
        for entries in (self.winners, self.residual_configs):
            token_counts = [m for m, _ in entries]
            if len(set(token_counts)) != len(token_counts):
                raise ValueError(f"{shape}: an M is listed twice: {token_counts}")
        checks = [(m, _call_error, call) for m, call in self.winners]
        checks += [(m, _residual_error, config) for m, config in self.residual_configs]
        for m, error_of, entry in checks:
            if m not in DECODE_TOKEN_COUNTS:
                raise ValueError(f"{shape}: M={m} is outside {DECODE_TOKEN_COUNTS}")
            why = error_of(shape, m, entry)
            if why:
                raise ValueError(f"{shape} at M={m}: {why}")

    def winner(self, num_tokens: int) -> PlannedCall | None:
        """The call measured fastest at ``num_tokens``, or None for cuBLAS."""
        return dict(self.winners).get(num_tokens)

    def tokens_of(self, backend: str) -> frozenset[int]:
        """Token counts ``backend`` won."""
        return frozenset(m for m, call in self.winners if call.backend == backend)

    def residual_config(self, num_tokens: int) -> Any:
        """Residual-epilogue config at ``num_tokens``, or None."""
        return dict(self.residual_configs).get(num_tokens)


class ShapeTable(Mapping[Shape, ProjectionSpec]):
    """Read-only ``{(N, K): ProjectionSpec}`` for one GPU architecture, with sources.

    Attributes:
        arch: the architecture the figures were measured on, e.g. ``"SM90"``.
        provenance: source of the table's figures (keys include ``gpu``, ``source``,
            ``date``).
    """

    def __init__(
        self,
        arch: str,
        specs: Iterable[ProjectionSpec],
        provenance: Mapping[str, str],
        row_provenance: Mapping[Shape, Mapping[str, str]] | None = None,
    ) -> None:
        self.arch = arch
        self._specs = {(spec.n, spec.k): spec for spec in specs}
        self.provenance = MappingProxyType(dict(provenance))
        self._row_provenance = dict(row_provenance or {})

    def __getitem__(self, shape: Shape) -> ProjectionSpec:
        return self._specs[shape]

    def __iter__(self) -> Iterator[Shape]:
        return iter(self._specs)

    def __len__(self) -> int:
        return len(self._specs)

    def backends(self) -> frozenset[str]:
        """Names of the backends this table routes to (residual rows included)."""
        names = {call.backend for spec in self.values() for _, call in spec.winners}
        if any(spec.residual_configs for spec in self.values()):
            names.add(gemm_backends.residual_backend().name)
        return frozenset(names)

    def source_of(self, shape: Shape) -> Mapping[str, str]:
        """Provenance of one row (the table's, unless the row has its own).

        Raises:
            KeyError: if ``shape`` has no row.
        """
        if shape not in self._specs:
            raise KeyError(shape)
        return MappingProxyType(dict(self._row_provenance.get(shape, self.provenance)))

    def __repr__(self) -> str:
        return f"ShapeTable({self.arch}, {len(self)} shapes)"


# ------------------------------------------------------------------ data -> tables


def _spec_from_rows(
    shape: Shape,
    row: Mapping[int, tuple[str, Any]],
    residual_row: Mapping[int, Any],
) -> ProjectionSpec:
    winners = tuple(
        (m, PlannedCall(backend, config_from_data(backend, m, cfg)))
        for m, (backend, cfg) in sorted(row.items())
    )
    fusing = gemm_backends.residual_backend()
    residual = tuple(
        (m, fusing.config_from_data(m, cfg) if fusing else cfg)
        for m, cfg in sorted(residual_row.items())
    )
    return ProjectionSpec(shape[0], shape[1], winners, residual)


def _table_from_rows(
    arch: str,
    rows: Mapping[Shape, Mapping[int, tuple[str, Any]]],
    provenance: Mapping[str, str],
    residual_rows: Mapping[Shape, Mapping[int, Any]] | None = None,
    row_provenance: Mapping[Shape, Mapping[str, str]] | None = None,
) -> ShapeTable:
    """A :class:`ShapeTable` from a data module's rows (schema: ``low_latency_gemm_tables``).

    Raises:
        ValueError: residual rows for a shape without a row, or any row a
            :class:`ProjectionSpec` rejects.
    """
    residual_rows = residual_rows or {}
    unknown = set(residual_rows) - set(rows)
    if unknown:
        raise ValueError(f"{arch}: residual rows for shapes with no row: {unknown}")
    specs = (
        _spec_from_rows(shape, row, residual_rows.get(shape, {}))
        for shape, row in rows.items()
    )
    return ShapeTable(arch, specs, provenance, row_provenance)


def _by_capability(tables: Mapping[Capability, ShapeTable]) -> Mapping[Capability, ShapeTable]:
    """``tables``, read-only, once every backend each names runs on its capability.

    Raises:
        ValueError: a table routes a backend older than the backend's ``min_capability``.
    """
    for capability, table in tables.items():
        for name in sorted(table.backends()):
            if not gemm_backends.get(name).is_supported(capability):
                raise ValueError(f"{table.arch} table routes {name}, unsupported on {capability}")
    return MappingProxyType(dict(tables))


#: SM103 (B300). Figures: vLLM v0.28.0 (authors, B300, 2026-08-26) plus the MTP eh_proj
#: row (7168, 14336) from vLLM v0.29.0 (PR #53942, 2026-09-09); see ``source_of``.
KIMI_K3_PROJECTIONS: ShapeTable = _table_from_rows(
    "SM103",
    _blackwell_data.SM103_ROWS,
    _blackwell_data.SM103_PROVENANCE,
    _blackwell_data.SM103_RESIDUAL_ROWS,
    _blackwell_data.SM103_ROW_PROVENANCE,
)

#: SM100 (B200). Figures: vLLM v0.29.0 (authors, B200, 2026-09-09, PR #53942).
KIMI_K3_PROJECTIONS_SM100: ShapeTable = _table_from_rows(
    "SM100",
    _blackwell_data.SM100_ROWS,
    _blackwell_data.SM100_PROVENANCE,
    _blackwell_data.SM100_RESIDUAL_ROWS,
    _blackwell_data.SM100_ROW_PROVENANCE,
)

#: SM90 (H200). Figures: ``low_latency_gemm_sm90.PROVENANCE`` (one H200 run timing every
#: backend against cuBLAS, ``results/sm90/decode_gemm_sm90.json``), and
#: ``ROW_PROVENANCE`` for shapes a later run tuned, if any.
KIMI_K3_PROJECTIONS_SM90: ShapeTable = _table_from_rows(
    "SM90",
    _sm90_data.ROWS,
    _sm90_data.PROVENANCE,
    row_provenance=getattr(_sm90_data, "ROW_PROVENANCE", None),
)

#: Which table a compute capability uses. SM107 shares the SM103 object (not a copy,
#: not a merge) until Rubin has figures of its own.
TABLES_BY_CAPABILITY: Mapping[Capability, ShapeTable] = _by_capability(
    {
        (10, 3): KIMI_K3_PROJECTIONS,
        (10, 7): KIMI_K3_PROJECTIONS,
        (10, 0): KIMI_K3_PROJECTIONS_SM100,
        (9, 0): KIMI_K3_PROJECTIONS_SM90,
    }
)
