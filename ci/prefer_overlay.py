"""Import our overlay's Kimi-K3 modules ahead of the tree's: a finder, and a pytest plugin.

On a rebase target where the 3-way merge of ``low_latency_gemm.py`` conflicted, the job's
tree keeps upstream's file there. To read *our* tables (``table_dump.py``) or run *our*
GPU numerics (the GPU stage) against that target's vLLM, the modules of one package folder
of the overlay (``overlay/vllm/models/kimi_k3/nvidia``) must win the import, while the
rest of vLLM comes from the tree. A meta-path finder does that without touching the tree;
it must be installed before anything imports the package (vLLM's ``kimi_k3/__init__.py``
imports ``nvidia.model``, which imports ``low_latency_gemm``).

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
    """Finds ``PACKAGE.<leaf>`` in ``folder/<leaf>.py`` when that file exists."""

    def __init__(self, folder: str) -> None:
        self.folder = os.path.abspath(folder)

    def find_spec(self, name, path=None, target=None):
        head, _, leaf = name.rpartition(".")
        if head != PACKAGE:
            return None
        file = os.path.join(self.folder, f"{leaf}.py")
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
