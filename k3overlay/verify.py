"""Verify a patched tree without importing it.

Two checks, both static (``ast``), so no vLLM dependency is needed:
1. every touched ``.py`` byte-compiles (in memory; nothing is written);
2. for every touched module, each ``from <module> import <name>`` anywhere
   in the tree still resolves to a name the module defines at top level.
Only regular files are read: a link (dangling, or pointing out of the tree), a
FIFO or an unreadable file is skipped, never followed or waited on.
"""

from __future__ import annotations

import ast
import os
from dataclasses import dataclass, field
from pathlib import Path

from .files import read_regular

_SKIP_DIRS = {".git", "__pycache__", "node_modules", "build", "dist"}


@dataclass
class VerifyResult:
    ok: bool = True
    errors: list[str] = field(default_factory=list)

    def fail(self, message: str) -> None:
        self.ok = False
        self.errors.append(message)


def verify(tree: Path, touched: list[str]) -> VerifyResult:
    """Check ``touched`` paths (relative to ``tree``); return every error found."""
    result = VerifyResult()
    modules: dict[str, ast.Module] = {}
    for path in sorted(p for p in touched if p.endswith(".py")):
        source = read_regular(tree / path)
        if source is None:
            continue  # deleted by a patch, or a link: nothing of ours to compile
        try:
            parsed = ast.parse(source, filename=path)
            compile(parsed, path, "exec", dont_inherit=True)  # what parsing alone lets through
            modules[module_name(path)] = parsed
        except SyntaxError as err:
            result.fail(f"{path}:{err.lineno}: does not compile: {err.msg}")
        except ValueError as err:  # e.g. a NUL byte
            result.fail(f"{path}: does not compile: {err}")
    exported = {name: _top_level_names(mod) for name, mod in modules.items()}
    for importer, lineno, module, name in _imports_of(tree, set(exported)):
        names = exported[module]
        if names is not None and name not in names and not _is_submodule(tree, module, name):
            result.fail(f"{importer}:{lineno}: cannot import name {name!r} from {module}")
    return result


def module_name(path: str) -> str:
    """Dotted module name of a tree-relative ``.py`` path (``pkg/__init__.py`` -> ``pkg``)."""
    parts = Path(path).with_suffix("").parts
    if parts[-1] == "__init__":
        parts = parts[:-1]
    return ".".join(parts)


def _top_level_names(module: ast.Module) -> set[str] | None:
    """Names bound at module top level; None when unknowable (``import *``, ``__getattr__``)."""
    names: set[str] = set()
    for node in _top_level_statements(module.body):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
            if node.name == "__getattr__":
                return None
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            for alias in node.names:
                if alias.name == "*":
                    return None
                names.add(alias.asname or alias.name.split(".")[0])
        elif isinstance(node, (ast.Assign, ast.AnnAssign, ast.AugAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            for target in targets:
                names.update(n.id for n in ast.walk(target) if isinstance(n, ast.Name))
    return names


def _top_level_statements(body: list[ast.stmt]):
    """Statements at module level, looking inside if/try/with blocks (still top level)."""
    for node in body:
        yield node
        for block in ("body", "orelse", "finalbody"):
            if isinstance(node, (ast.If, ast.Try, ast.With)) and hasattr(node, block):
                yield from _top_level_statements(getattr(node, block))
        if isinstance(node, ast.Try):
            for handler in node.handlers:
                yield from _top_level_statements(handler.body)


def _imports_of(tree: Path, modules: set[str]):
    """(file, line, module, name) for each ``from M import name`` of a module in ``modules``."""
    leaves = {m.rsplit(".", 1)[-1].encode() for m in modules}
    for dirpath, dirnames, filenames in os.walk(tree):
        dirnames[:] = [d for d in dirnames if d not in _SKIP_DIRS]
        for filename in filenames:
            if not filename.endswith(".py"):
                continue
            file = Path(dirpath) / filename
            source = read_regular(file)
            if source is None or not any(leaf in source for leaf in leaves):
                continue  # cheap filter: most files never mention a touched module
            rel = file.relative_to(tree).as_posix()
            try:
                parsed = ast.parse(source, filename=rel)
            except (SyntaxError, ValueError):
                continue  # not ours to judge; touched files are compiled above
            for node in ast.walk(parsed):
                if isinstance(node, ast.ImportFrom):
                    target = _absolute(rel, node)
                    if target in modules:
                        for alias in node.names:
                            if alias.name != "*":
                                yield rel, node.lineno, target, alias.name


def _absolute(importer: str, node: ast.ImportFrom) -> str:
    """The absolute module an ImportFrom names, resolving ``from .x import``."""
    if not node.level:
        return node.module or ""
    package = module_name(importer).split(".")
    if not importer.endswith("__init__.py"):
        package = package[:-1]
    base = package[: len(package) - (node.level - 1)] if node.level > 1 else package
    return ".".join([*base, *([node.module] if node.module else [])])


def _is_submodule(tree: Path, module: str, name: str) -> bool:
    folder = tree.joinpath(*module.split("."))
    return (folder / f"{name}.py").is_file() or (folder / name / "__init__.py").is_file()
