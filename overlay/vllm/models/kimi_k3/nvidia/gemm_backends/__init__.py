# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-k3-overlay project
"""Registry of the Kimi-K3 decode GEMM backends (vllm-k3-overlay).

One module per backend in this package, each exporting ``BACKEND``, an instance of
:class:`~.base.KernelBackend` (the interfaces, in ``base.py``). The registry is every such
module found here, grouped by ``BACKEND.op`` and keyed by ``BACKEND.name``, the string the
tables' data use; nothing else lists them, so adding a backend is adding its module (and
its entry among the kernel lab's candidates, which measure it for the tables). The GEMM
dispatch reads :data:`BACKENDS`, the backends of op ``"gemm"``; a backend of another op
(a fused kernel with its own launch) is found by :func:`backends_for`.

Which backend runs for a (shape, M) is the tables' decision, not an order of preference
here: see ``low_latency_gemm_dispatch``.
"""

from __future__ import annotations

import importlib
import pkgutil
from collections.abc import Mapping
from types import MappingProxyType

from .base import GemmBackend, KernelBackend

_INTERFACE_MODULES = frozenset({"base"})
GEMM = GemmBackend.op


def _discover() -> dict[str, dict[str, KernelBackend]]:
    """``{op: {name: backend}}`` of every module of this package but the interfaces,
    in module-name order.

    Raises:
        TypeError: a module's ``BACKEND`` is not a :class:`KernelBackend`.
        ValueError: two backends of one op claim one name, or two GEMM backends fuse the
            residual (the tables' residual rows name no backend).
    """
    found: dict[str, dict[str, KernelBackend]] = {}
    for info in sorted(pkgutil.iter_modules(__path__), key=lambda i: i.name):
        if info.name in _INTERFACE_MODULES or info.name.startswith("_"):
            continue
        module = importlib.import_module(f"{__name__}.{info.name}")
        backend = getattr(module, "BACKEND", None)
        if not isinstance(backend, KernelBackend):
            raise TypeError(f"{module.__name__}.BACKEND is not a KernelBackend: {backend!r}")
        of_op = found.setdefault(backend.op, {})
        if backend.name in of_op:
            raise ValueError(f"two {backend.op} backends are named {backend.name!r}")
        of_op[backend.name] = backend
    gemm = found.get(GEMM, {})
    fusing = [name for name, backend in gemm.items() if backend.fuses_residual]
    if len(fusing) > 1:
        raise ValueError(f"more than one backend fuses the residual: {fusing}")
    return found


_BY_OP = _discover()

#: ``{name: backend}`` of the GEMM dispatch's op, read-only.
BACKENDS: Mapping[str, GemmBackend] = MappingProxyType(_BY_OP.get(GEMM, {}))


def backends_for(op: str) -> Mapping[str, KernelBackend]:
    """``{name: backend}`` of ``op`` (empty for an op no module implements), read-only."""
    return MappingProxyType(_BY_OP.get(op, {}))


def get(name: str) -> GemmBackend:
    """The GEMM backend the tables call ``name``.

    Raises:
        KeyError: no backend has that name.
    """
    return BACKENDS[name]


def residual_backend() -> GemmBackend | None:
    """The backend with a fused ``+ residual`` epilogue (the tables' residual rows), if any."""
    return next((backend for backend in BACKENDS.values() if backend.fuses_residual), None)
