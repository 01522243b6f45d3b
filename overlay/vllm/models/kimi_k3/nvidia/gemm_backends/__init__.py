# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-k3-overlay project
"""Registry of the Kimi-K3 decode GEMM backends (vllm-k3-overlay).

One module per backend in this package, each exporting ``BACKEND``, an instance of
:class:`~.base.GemmBackend` (the interface, in ``base.py``). The registry is every such
module found here, keyed by ``BACKEND.name``, the string the tables' data use; nothing
else lists them, so adding a backend is adding its module (and its entry among the
kernel lab's candidates, which measure it for the tables).

Which backend runs for a (shape, M) is the tables' decision, not an order of preference
here: see ``low_latency_gemm_dispatch``.
"""

from __future__ import annotations

import importlib
import pkgutil
from collections.abc import Mapping
from types import MappingProxyType

from .base import GemmBackend

_INTERFACE_MODULES = frozenset({"base"})


def _discover() -> dict[str, GemmBackend]:
    """``{name: backend}`` of every module of this package but the interface, by module name.

    Raises:
        TypeError: a module's ``BACKEND`` is not a :class:`GemmBackend`.
        ValueError: two modules claim one name, or two fuse the residual (the tables'
            residual rows name no backend).
    """
    found: dict[str, GemmBackend] = {}
    for info in sorted(pkgutil.iter_modules(__path__), key=lambda i: i.name):
        if info.name in _INTERFACE_MODULES or info.name.startswith("_"):
            continue
        module = importlib.import_module(f"{__name__}.{info.name}")
        backend = getattr(module, "BACKEND", None)
        if not isinstance(backend, GemmBackend):
            raise TypeError(f"{module.__name__}.BACKEND is not a GemmBackend: {backend!r}")
        if backend.name in found:
            raise ValueError(f"two backends are named {backend.name!r}")
        found[backend.name] = backend
    fusing = [name for name, backend in found.items() if backend.fuses_residual]
    if len(fusing) > 1:
        raise ValueError(f"more than one backend fuses the residual: {fusing}")
    return found


#: ``{name: backend}``, read-only.
BACKENDS: Mapping[str, GemmBackend] = MappingProxyType(_discover())


def get(name: str) -> GemmBackend:
    """The backend the tables call ``name``.

    Raises:
        KeyError: no backend has that name.
    """
    return BACKENDS[name]


def residual_backend() -> GemmBackend | None:
    """The backend with a fused ``+ residual`` epilogue (the tables' residual rows), if any."""
    return next((backend for backend in BACKENDS.values() if backend.fuses_residual), None)
