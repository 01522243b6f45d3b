"""The overlay's shape, read from its files (no vLLM needed): backends, sizes, imports.

* A GPU backend is named (as a string the code compares or passes) only in its own module
  under ``gemm_backends/`` and in the table data, so adding one is adding its module.
* No overlay module over 600 lines, but the generated SM90 table.
* No import cycle between overlay modules.
* Every overlay file is listed in ``overlay.json`` and every listed file exists.
"""

from __future__ import annotations

import ast
import json
from pathlib import Path

import pytest

from k3overlay.project import ROOT

OVERLAY = ROOT / "overlay"
PACKAGE = OVERLAY / "vllm" / "models" / "kimi_k3" / "nvidia"
BACKENDS_DIR = PACKAGE / "gemm_backends"
TABLE_DATA = {PACKAGE / "low_latency_gemm_tables.py", PACKAGE / "low_latency_gemm_sm90.py",
              PACKAGE / "low_latency_fused_sm90.py"}  # fmt: skip
GENERATED = {PACKAGE / "low_latency_gemm_sm90.py"}  # rendered by the lab's table renderer
MAX_LINES = 600
SHIPPED = sorted((OVERLAY / "vllm").rglob("*.py"))


def _backend_names() -> dict[str, Path]:
    """``{name: module}`` of every backend module (its class's ``name = "..."``)."""
    names = {}
    for path in sorted(BACKENDS_DIR.glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text("utf-8"))):
            targets = [getattr(t, "id", None) for t in getattr(node, "targets", ())]
            if isinstance(node, ast.Assign) and targets == ["name"]:
                names[node.value.value] = path
    return names


def _strings(path: Path) -> set[str]:
    return {node.value for node in ast.walk(ast.parse(path.read_text("utf-8")))
            if isinstance(node, ast.Constant) and isinstance(node.value, str)}


def test_the_registry_has_the_five_gemm_backends() -> None:
    assert set(_backend_names()) >= {"cute", "swap_ab", "ll_bf16", "tinygemm", "dsv3_fused_a"}


def test_the_registry_has_a_backend_per_fused_op() -> None:
    """Each fused op (its ``op = "..."``) has a module of its own under gemm_backends/."""
    ops = {}
    for name, path in _backend_names().items():
        for node in ast.walk(ast.parse(path.read_text("utf-8"))):
            if isinstance(node, ast.AnnAssign) and getattr(node.target, "id", None) == "op":
                ops[node.value.value] = name
    assert set(ops) >= {"rmsnorm_gemm", "add_rmsnorm_gemm", "rmsnorm", "act_mul", "sigmoid_mul",
                        "mtp_input"}  # fmt: skip


@pytest.mark.parametrize("name", sorted(_backend_names()))
def test_a_backend_is_named_only_in_its_module_and_the_table_data(name) -> None:
    own = _backend_names()[name]
    naming = [str(p.relative_to(OVERLAY)) for p in SHIPPED if name in _strings(p)]
    allowed = {str(p.relative_to(OVERLAY)) for p in {own, *TABLE_DATA}}
    assert str(own.relative_to(OVERLAY)) in naming
    assert set(naming) <= allowed


def test_the_check_sees_a_backend_named_elsewhere(tmp_path) -> None:
    """The check above reads string constants: a dispatch naming a backend is caught."""
    chain = tmp_path / "dispatch.py"
    chain.write_text('def launch(call):\n    if call.backend == "tinygemm":\n        return 1\n')
    assert "tinygemm" in _strings(chain)


@pytest.mark.parametrize("path", SHIPPED, ids=lambda p: str(p.relative_to(OVERLAY)))
def test_no_overlay_module_is_over_600_lines(path) -> None:
    lines = len(path.read_text("utf-8").splitlines())
    assert path in GENERATED or lines <= MAX_LINES, f"{lines} lines"


def _module_name(path: Path) -> str:
    parts = path.relative_to(OVERLAY).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imports(path: Path, name: str) -> set[str]:
    """Absolute names of the modules ``path`` (module ``name``) imports, at any depth."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text("utf-8"))):
        if isinstance(node, ast.Import):
            found |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom):
            base = package.split(".")
            base = base[: len(base) - node.level + 1] if node.level else []
            module = ".".join([*base, *([node.module] if node.module else [])])
            found.add(module)
            found |= {f"{module}.{alias.name}" for alias in node.names}
    return found


def test_no_import_cycle_between_overlay_modules() -> None:
    modules = {_module_name(p): p for p in SHIPPED}
    graph = {name: _imports(path, name) & set(modules) - {name} for name, path in modules.items()}
    assert graph["vllm.models.kimi_k3.nvidia.kda_projection"] >= {
        "vllm.models.kimi_k3.nvidia.low_latency_gemm_dispatch"}
    done: set[str] = set()

    def visit(name: str, path: tuple[str, ...]) -> None:
        assert name not in path, " -> ".join([*path[path.index(name):], name])
        if name in done:
            return
        for child in sorted(graph[name]):
            visit(child, (*path, name))
        done.add(name)

    for name in sorted(graph):
        visit(name, ())


def test_overlay_json_lists_exactly_the_overlay_files() -> None:
    manifest = json.loads((ROOT / "overlay.json").read_text("utf-8"))
    listed = {entry["path"] for entry in manifest["files"]}
    present = {str(p.relative_to(OVERLAY)) for p in OVERLAY.rglob("*")
               if p.is_file() and "__pycache__" not in p.parts}
    assert listed == present
    assert "vllm/models/kimi_k3/nvidia/low_latency_gemm.py" not in listed  # upstream's own
