"""Verify a patched tree without importing it.

Three checks, all static (``ast``), so no vLLM dependency is needed:
1. every touched ``.py`` byte-compiles (in memory; nothing is written);
2. for every touched module, each ``from <module> import <name>`` anywhere
   in the tree still resolves to a name the module defines at top level; and
   every import of a module the tree no longer has (deleted, or renamed: git
   lists a rename as a deletion and an addition) fails, whether written
   ``import pkg.mod``, ``from pkg.mod import x`` or ``from pkg import mod``;
3. no touched module defines a function or class twice in one body (the module's,
   or a class's) where the change made it so: Python keeps the later one, so the
   earlier is dead code that compiles, imports and fails nothing. A patch that
   applies cleanly beside a method upstream added since (a 3-way merge, or a
   conflict resolved by keeping both sides) does exactly that (vLLM v0.34.0
   added ``process_weights_after_loading`` to the Kimi-K3 classes patch 0007 hooks).
Only regular files are read: a link (dangling, or pointing out of the tree), a
FIFO or an unreadable file is skipped, never followed or waited on.
"""

from __future__ import annotations

import ast
import contextlib
import os
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

from .files import read_regular

_SKIP_DIRS = {".git", "__pycache__", "node_modules", "build", "dist"}


OK, FAILED, NOT_RUN = "ok", "failed", "not run"


@dataclass
class VerifyResult:
    """``verify``, with one meaning everywhere (apply.py, the rebase job, every report):
    the static checks of the tree holding the whole series and overlay.

    ``ok``: that tree passed; ``failed``: it did not (``errors``); ``not run``
    (``not_run`` says why): there was no such tree, because a patch or overlay
    file did not go in (conflict, refused drift) or the job stopped before.
    The rebase job's tree of "what applied" is never verified: an ``ok`` there
    would vouch for a tree nobody will ship.
    """

    ok: bool = True
    errors: list[str] = field(default_factory=list)
    not_run: str = ""

    @classmethod
    def skipped(cls, reason: str) -> VerifyResult:
        return cls(False, [], reason)

    @property
    def status(self) -> str:
        return NOT_RUN if self.not_run else OK if self.ok else FAILED

    def line(self) -> str:
        """``ok``, ``failed: N error(s)`` or ``not run: REASON`` (one line, for any report)."""
        if self.status == FAILED:
            return f"failed: {len(self.errors)} error(s)"
        return f"not run: {self.not_run}" if self.not_run else OK

    def to_json(self) -> dict:
        data = {"ok": self.ok, "status": self.status, "errors": self.errors}
        return {**data, "not_run": self.not_run} if self.not_run else data

    def fail(self, message: str) -> None:
        self.ok = False
        self.errors.append(message)


# What ast.parse raises on a file Python cannot compile: a syntax error, a NUL byte
# (ValueError), nesting deeper than the parser's stack (RecursionError, MemoryError).
_UNPARSABLE = (SyntaxError, ValueError, RecursionError, MemoryError)


def verify(tree: Path, touched: list[str], before: Mapping[str, bytes] | None = None) -> VerifyResult:
    """Check ``touched`` paths (relative to ``tree``); return every error found.

    ``before``: the touched files as the change found them (path -> bytes; files
    it added are absent). With it, imports outside the touched files are checked
    only where the change can have broken them (names a touched module no longer
    binds, modules now gone), so only the files that mention those are parsed.
    Without it, every import of a touched module is checked.
    """
    result = VerifyResult()
    modules: dict[str, ast.Module] = {}  # by module name
    parsed_files: dict[str, ast.Module] = {}  # by path
    lost: dict[str, set[str] | None] = {}  # module -> names to look for elsewhere (None: all)
    gone: set[str] = set()
    for path in sorted(p for p in touched if p.endswith(".py")):
        source = read_regular(tree / path)
        if source is None:  # deleted by a patch, or a link: nothing of ours to compile
            if not os.path.lexists(tree / path) and not _exists(tree, module_name(path)):
                gone.add(module_name(path))  # pkg/mod.py gone, and no pkg/mod/ instead
            continue
        try:
            parsed = ast.parse(source, filename=path)
            compile(parsed, path, "exec", dont_inherit=True)  # what parsing alone lets through
        except SyntaxError as err:
            result.fail(f"{path}:{err.lineno}: does not compile: {err.msg}")
            continue
        except (ValueError, RecursionError, MemoryError) as err:  # a NUL byte; nesting too deep
            result.fail(f"{path}: does not compile: {str(err) or type(err).__name__}")
            continue
        modules[module_name(path)] = parsed_files[path] = parsed
        lost[module_name(path)] = _lost_names(_top_level_names(parsed), before, path)
        for problem in _new_redefinitions(parsed, before, path):
            result.fail(problem)
    exported = {name: _top_level_names(mod) for name, mod in modules.items()}
    ours = set(touched)
    for importer, lineno, module, name in _imports_of(tree, lost, gone, ours, parsed_files):
        if importer not in ours and not _may_break(lost, gone, module, name):
            continue  # upstream's import, and nothing it needs was changed by us
        problem = _unresolved(tree, exported, gone, module, name)
        if problem:
            result.fail(f"{importer}:{lineno}: {problem}")
    return result


def _lost_names(now: set[str] | None, before: Mapping[str, bytes] | None,
                path: str) -> set[str] | None:
    """Names of a touched module that other files may now miss: those it bound before
    and binds no more; None when every name counts (no ``before``, or unknowable)."""
    if now is None:
        return set()  # ``__getattr__`` or ``import *``: any name may resolve
    if before is None:
        return None
    if path not in before:
        return set()  # a new module: nothing imported it before us
    try:
        old = _top_level_names(ast.parse(before[path]))
    except _UNPARSABLE:
        return None
    return None if old is None else old - now


def _may_break(lost: dict[str, set[str] | None], gone: set[str], module: str,
               name: str | None) -> bool:
    """Whether our change can have broken this import (of a file we did not touch)."""
    if any(module == g or module.startswith(g + ".") or f"{module}.{name}" == g for g in gone):
        return True
    if module not in lost:
        return False
    return lost[module] is None or name in lost[module]


def _unresolved(tree: Path, exported: dict[str, set[str] | None], gone: set[str],
                module: str, name: str | None) -> str | None:
    """Why ``from module import name`` (``import module`` when ``name`` is None) fails, or None."""
    deleted = next((g for g in sorted(gone) if module == g or module.startswith(g + ".")), None)
    if deleted:
        return f"cannot import {module}: {deleted} no longer exists"
    if name is None:
        return None
    bound = _package_names(tree, module) if f"{module}.{name}" in gone else None
    if bound is not None and name not in bound:
        return f"cannot import name {name!r} from {module}: {module}.{name} no longer exists"
    names = exported.get(module)
    if names is not None and name not in names and not _is_submodule(tree, module, name):
        return f"cannot import name {name!r} from {module}"
    return None


def _new_redefinitions(parsed: ast.Module, before: Mapping[str, bytes] | None, path: str) -> list[str]:
    """One error per function or class of ``parsed`` that a later one of the same name in the
    same body replaces, where the file had fewer of that name there ``before`` (an upstream
    file's own redefinitions are not ours to judge; without ``before``, every one counts)."""
    old: dict[str, list[int]] = {}  # a file the change added: each redefinition is the change's
    if before is not None and path in before:
        with contextlib.suppress(*_UNPARSABLE):
            old = _definitions(ast.parse(before[path]))
    problems = []
    for key, lines in sorted(_definitions(parsed).items()):
        if len(lines) > 1 and len(lines) > len(old.get(key, ())):
            name = re.sub(r"#\d+", "", key)  # (the body's key: which of a class's definitions)
            problems += [f"{path}:{line}: {name} is defined again at line {lines[-1]}; Python keeps "
                         f"the later one, so this one never runs" for line in lines[:-1]]
    return problems


def _definitions(module: ast.Module) -> dict[str, list[int]]:
    """The name of each body's definitions (``Class#1.method``: the first definition of
    ``Class``'s body; a module-level name as it is) -> the lines of its ``def``/``class``
    statements, for each name defined in the module's body or a class's body (the statements
    directly in it: one under ``if``/``try`` is a choice, not a redefinition). Left out: ``_``
    (a name meant to be thrown away), ``@overload`` stubs, and definitions registered by their
    decorator (``@x.setter``, ``@f.register``, torch's ``@op.register_fake``), which Python or
    the decorator means to be redefined."""
    found: dict[str, list[int]] = {}

    def walk(body: list[ast.stmt], scope: str) -> None:
        for node in body:
            if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                continue
            if node.name != "_" and not _meant_to_redefine(node):
                found.setdefault(scope + node.name, []).append(node.lineno)
            if isinstance(node, ast.ClassDef):
                walk(node.body, f"{scope}{node.name}#{len(found.get(scope + node.name, ()))}.")

    walk(module.body, "")
    return found


def _meant_to_redefine(node: ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef) -> bool:
    for decorator in node.decorator_list:
        target = decorator.func if isinstance(decorator, ast.Call) else decorator
        name = target.id if isinstance(target, ast.Name) else getattr(target, "attr", "")
        if name == "overload" or name.startswith("register"):
            return True
        if isinstance(target, ast.Attribute) and isinstance(target.value, ast.Name) \
                and target.value.id == node.name:
            return True
    return False


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


def _imports_of(tree: Path, lost: dict[str, set[str] | None], gone: set[str], touched: set[str],
                parsed_files: dict[str, ast.Module]):
    """(file, line, module, name) for each import in the files worth parsing: the touched
    ones (``parsed_files`` already), and those whose text mentions a module of ``lost``
    (dotted, or its last part in a relative import) and one of its lost names, or the last
    part of a ``gone`` module. ``from M import name`` gives (M, name), ``import M`` (M, None)."""
    wanted = [(m.encode(), m.rsplit(".", 1)[-1].encode(), None if names is None else
               {n.encode() for n in names}) for m, names in lost.items() if names != set()]
    gone_leaves = {m.rsplit(".", 1)[-1].encode() for m in gone}
    for dirpath, dirnames, filenames in os.walk(tree):
        dirnames[:] = sorted(d for d in dirnames if d not in _SKIP_DIRS)  # errors in a stable order
        for filename in sorted(filenames):
            if not filename.endswith(".py"):
                continue
            file = Path(dirpath) / filename
            rel = file.relative_to(tree).as_posix()
            parsed = parsed_files.get(rel)
            if parsed is None:
                source = read_regular(file)
                if source is None or (rel not in touched
                                      and not _mentions(source, wanted, gone_leaves)):
                    continue  # cheap filter: most files never mention what changed
                try:
                    parsed = ast.parse(source, filename=rel)
                except _UNPARSABLE:
                    continue  # not ours to judge; touched files are compiled above
            for node in _statements(parsed.body):
                if isinstance(node, ast.ImportFrom):
                    target = _absolute(rel, node)
                    for alias in node.names:
                        if alias.name != "*":
                            yield rel, node.lineno, target, alias.name
                elif isinstance(node, ast.Import):
                    for alias in node.names:
                        yield rel, node.lineno, alias.name, None


def _mentions(source: bytes, wanted, gone_leaves: set[bytes]) -> bool:
    if any(leaf in source for leaf in gone_leaves):
        return True
    relative = b"from ." in source
    return any((dotted in source or (relative and leaf in source))
               and (names is None or any(n in source for n in names))
               for dotted, leaf, names in wanted)


def _statements(body: list):
    """Every statement in ``body``, nested ones too (imports are statements: no need to
    visit the far more numerous expression nodes, as ``ast.walk`` would)."""
    for node in body:
        yield node
        for block in ("body", "orelse", "finalbody", "handlers", "cases"):
            inner = getattr(node, block, None)
            if isinstance(inner, list):
                yield from _statements(inner)


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


def _exists(tree: Path, module: str) -> bool:
    """True if ``module`` can still be imported from ``tree``: a ``.py`` file, or a package
    folder (with ``__init__.py`` or without: a namespace package)."""
    path = tree.joinpath(*module.split("."))
    return path.with_suffix(".py").is_file() or path.is_dir()


def _package_names(tree: Path, package: str) -> set[str] | None:
    """Top-level names of ``package``'s ``__init__.py`` (empty without one; None: unknowable)."""
    source = read_regular(tree.joinpath(*package.split("."), "__init__.py"))
    try:
        return _top_level_names(ast.parse(source or b""))
    except _UNPARSABLE:
        return set()
