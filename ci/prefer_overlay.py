"""Import our overlay's Kimi-K3 modules ahead of the tree's: a finder, and a pytest plugin.

Every file of ours under ``vllm/models/kimi_k3/nvidia`` is new to v0.28.0, but a rebase
target may add a file at one of our paths (upstream landing its own version of our work).
The job's 3-way merge then conflicts and the built tree keeps upstream's file. To read
*our* tables (``table_dump.py``) or run *our* GPU numerics (the GPU stage) against that
target's vLLM, the overlay's modules in that package and its subpackages
(``gemm_backends/``) must win the import while the rest of vLLM, and any module we do
not have, comes from the tree. A meta-path finder does that without touching the tree;
it must be installed before anything imports the package (vLLM's ``kimi_k3/__init__.py``
imports ``nvidia.model``, which imports the dispatch).

As a pytest plugin (``-p prefer_overlay``, this folder on PYTHONPATH) it installs the
finder when ``$K3_PREFER_OVERLAY`` names a folder, and does nothing otherwise.
"""

from __future__ import annotations

import importlib.abc
import importlib.util
import os
import sys

PACKAGE = "vllm.models.kimi_k3.nvidia"
ENV = "K3_PREFER_OVERLAY"


class PreferFinder(importlib.abc.MetaPathFinder):
    """Finds ``PACKAGE.<a>[.<b>...]`` in ``folder/<a>/<b>.py`` (or the folder's
    ``__init__.py``) when ours has it; anything else falls through to the tree."""

    def __init__(self, folder: str) -> None:
        self.folder = os.path.abspath(folder)

    def find_spec(self, name, path=None, target=None):
        if not name.startswith(PACKAGE + "."):
            return None
        parts = name[len(PACKAGE) + 1 :].split(".")
        if not all(part.isidentifier() for part in parts):
            return None  # "", "a..b", "./x": no module name; never a path out of the folder
        base = os.path.join(self.folder, *parts)
        init = os.path.join(base, "__init__.py")
        if os.path.isfile(init):
            # Our subpackage, searched first; the tree's folder of the same name after it,
            # so a module only upstream has there still imports.
            theirs = [os.path.join(p, parts[-1]) for p in (path or ()) if p != os.path.dirname(base)]
            where = [base] + [p for p in theirs if os.path.isdir(p)]
            return importlib.util.spec_from_file_location(name, init, submodule_search_locations=where)
        file = base + ".py"
        return importlib.util.spec_from_file_location(name, file) if os.path.isfile(file) else None


def install(folder: str) -> None:
    """Put our folder's modules first for every later import of ``PACKAGE.*``.

    Raises RuntimeError if one of them was imported already (it would stay upstream's).
    """
    early = [n for n in sys.modules if n.startswith(PACKAGE + ".")]
    if early:
        raise RuntimeError(f"{early[0]} was imported before the overlay finder was installed")
    sys.meta_path.insert(0, PreferFinder(folder))


def pytest_configure(config) -> None:
    if os.environ.get(ENV):
        install(os.environ[ENV])
