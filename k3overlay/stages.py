"""The rebase job's stages: the one typed interface between the tool and what CI plugs in.

``rebase.run_rebase`` builds each target and hands a ``Target`` (the tree as
released, the tree it built, what of ours did not go in) to one ``Stages``
callable; the callable returns ``StageResults``: test runs (``TestRun``) and
report sections (``Section``). The report renders both without knowing what
they measured: a section brings its own lines and markdown. ``ci/rebase.py``
is the one caller that passes stages (environments, CPU tier, table diff, GPU
stage); this package never imports ``ci/``.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from . import errors


@dataclass(frozen=True)
class Target:
    """One rebase target, as the stages see it.

    ``released``: the tree of ``ref_sha`` as upstream released it (nothing applied).
    ``built``: the tree the job built there (every patch and overlay file that went in;
    committed, so ``git rev-parse HEAD`` there names it). ``missing``: what of ours did
    not go in, by kind (``"patches 0002, 0003 conflict"``, ``"overlay PATH conflicts"``);
    empty when ``built`` holds the whole series and overlay.
    ``overlay_conflicts``: overlay paths where ``built`` holds upstream's file, not ours.
    """

    ref: str
    ref_sha: str
    released: Path
    built: Path
    missing: tuple[str, ...] = ()
    overlay_conflicts: tuple[str, ...] = ()


@dataclass(frozen=True)
class Problem:
    """One test that did not pass, and the first line of why (the exception, usually)."""

    test: str
    first_line: str
    kind: str = "failed"  # "failed", "error", or "environment" (the environment's fault)

    def to_json(self) -> dict:
        return {"test": self.test, "kind": self.kind, "first_line": self.first_line}


COUNTS = ("passed", "failed", "skipped", "errors")


@dataclass
class TestRun:
    """A test tier's outcome on one tree: counts, each problem explained, what was left out.

    ``key``: its name in the JSON report (``tests`` for the CPU tier, ``gpu``);
    ``name``: in every other rendering. ``env_errors``: failures pinned on the
    environment (``problems`` says which). ``not_run``: test files left out, each
    ``"FILE: why"``. ``env_error``: why the tier could not run at all. ``env``:
    where it ran (``{"python": "3.12", "torch": "2.13.0+cpu", ...}``). ``suites``:
    per-suite runs (the GPU stage's), their counts already in the totals; ``note``
    (a suite cut at its deadline, say); ``extra``: anything else the stage recorded.
    """

    __test__ = False  # not a pytest class, whatever its name

    key: str = "tests"
    name: str = "cpu tests"
    passed: int = 0
    failed: int = 0
    skipped: int = 0
    errors: int = 0
    env_errors: int = 0
    problems: list[Problem] = field(default_factory=list)
    not_run: list[str] = field(default_factory=list)
    env_error: str = ""
    env: dict = field(default_factory=dict)
    suites: dict[str, TestRun] = field(default_factory=dict)
    note: str = ""
    extra: dict = field(default_factory=dict)  # what else the stage recorded, for the JSON as is

    @property
    def exit_code(self) -> int:
        """5 when a test failed or errored, 7 when only the environment did, else 0."""
        if self.failed or self.errors:
            return errors.VERIFY
        return errors.ENVIRONMENT if self.env_errors or self.env_error else errors.OK

    def line(self) -> str:
        """``"3 passed, 0 failed, 1 skipped, 0 errors"`` (+ environment errors, files left out)."""
        if self.env_error:
            return f"not run: environment error: {self.env_error}"
        line = ", ".join(f"{getattr(self, k)} {k}" for k in COUNTS)
        if self.env_errors:
            line += f", {self.env_errors} environment errors"
        if self.note:
            line += f"; {self.note}"
        if self.not_run:
            line += f"; {len(self.not_run)} file(s) not run"
        return line

    def to_json(self) -> dict:
        data = {**self.extra, **{k: getattr(self, k) for k in COUNTS}}
        for key in ("env_errors", "env_error", "note", "env"):
            if getattr(self, key):
                data[key] = getattr(self, key)
        if self.problems:
            data["problems"] = [p.to_json() for p in self.problems]
        if self.not_run:
            data["not_run"] = self.not_run
        if self.suites:
            data["suites"] = {name: run.to_json() for name, run in self.suites.items()}
        return data


@dataclass
class Section:
    """A part of the report a stage renders itself (the table diff, the GPU A/B).

    ``key``: its name in the JSON report, ``data`` what goes there. ``lines``: its
    summary, a line or a few (console, JUnit, the markdown's first screen).
    ``details``: markdown shown collapsed. ``error``: it could not be produced (a
    JUnit error, never a failure). ``exit_code``: what it adds to the verdict (0: nothing).
    """

    key: str
    title: str
    lines: list[str]
    data: dict
    details: str = ""
    error: str = ""
    exit_code: int = errors.OK


@dataclass
class StageResults:
    runs: list[TestRun] = field(default_factory=list)
    sections: list[Section] = field(default_factory=list)


Stages = Callable[[Target], StageResults]
