"""A Python environment built from a rebase target's own requirements, cached per hash.

The CPU tier and the table diff import the target's vLLM tree, so they must run in what
that tree asks for, not in the base's environment: v0.30.0's own tests import the
``cuda`` bindings that come with the CuTe DSL it pins, which v0.28.0 does not install.

An environment is a venv under ``~/.cache/vllm-k3-overlay/envs/<hash>`` holding:

* the tree's ``requirements/common.txt``;
* the CuTe DSL line(s) of its ``requirements/cuda.txt`` (``nvidia-cutlass-dsl[...]==X``):
  what vLLM's skinny-GEMM code and tests import; the rest of cuda.txt (FlashInfer,
  tilelang, video codecs, ...) serves other models and is left out;
* torch: the CPU build of the release the tree pins (``torch==X+cpu``) when the package
  indexes serve it, else the torch the job itself runs with. The second case is
  recorded (``torch``, ``torch_pinned`` in the result): on a runner without a CPU
  wheel index, v0.33.0's 2.14.0 exists only as a CUDA build of several GB, which this
  tier (Python-level routing and table tests) does not need. README "The rebase job";
* pytest and tblib, which vLLM's tests import.

The hash covers the Python version and every requirement line above, so two targets with
the same requirements share one environment and a changed pin builds a new one. A build
writes ``env.json`` last (one without it is rebuilt); an flock keeps two jobs from building
the same one at once.
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import json
import re
import shutil
import subprocess
import sys
from dataclasses import asdict, dataclass
from pathlib import Path

from packaging.requirements import InvalidRequirement, Requirement

from k3overlay.files import read_regular
from k3overlay.lock import held
from k3overlay.project import cache_dir

FORMAT = 1  # bump when what goes into an environment changes
CUTE_DSL = "nvidia-cutlass-dsl"
TEST_TOOLS = ("pytest", "tblib")


class EnvError(Exception):
    """The environment could not be built (pip failed, requirements unreadable)."""


@dataclass(frozen=True)
class EnvSpec:
    """What a target asks for: ``common`` (common.txt text), ``cute_dsl`` lines, ``torch`` pin."""

    python: str
    common: str
    cute_dsl: tuple[str, ...]
    torch: str | None

    @property
    def key(self) -> str:
        text = json.dumps([FORMAT, asdict(self)], sort_keys=True)
        return hashlib.sha256(text.encode()).hexdigest()[:16]


@dataclass(frozen=True)
class Env:
    """A built environment: its interpreter and the torch it holds vs the target's pin."""

    python: str
    key: str
    torch: str
    torch_pinned: str | None
    cute_dsl: tuple[str, ...]

    def describe(self) -> dict:
        return {"key": self.key, "torch": self.torch, "torch_pinned": self.torch_pinned,
                "cute_dsl": list(self.cute_dsl)}


def _requirement_lines(text: str) -> list[Requirement]:
    found = []
    for line in text.splitlines():
        line = line.split(" #", 1)[0].strip()
        if not line or line.startswith(("#", "-")):
            continue
        try:
            found.append(Requirement(line))
        except InvalidRequirement:
            continue  # a URL or pip option line: not one of the pins read here
    return found


def torch_pin(tree: Path) -> str | None:
    """The torch release the tree pins (``2.14.0``), from requirements/cuda.txt, or None."""
    for req in _requirement_lines(_read(tree / "requirements" / "cuda.txt", missing_ok=True)):
        if req.name == "torch":
            match = re.fullmatch(r"==\s*([0-9][0-9.]*)", str(req.specifier))
            if match:
                return match.group(1)
    return None


def cute_dsl_lines(tree: Path) -> tuple[str, ...]:
    """The CuTe DSL requirement(s) of requirements/cuda.txt, e.g. ``nvidia-cutlass-dsl[cu13]==4.8.0``."""
    reqs = _requirement_lines(_read(tree / "requirements" / "cuda.txt", missing_ok=True))
    return tuple(str(r) for r in reqs if r.name == CUTE_DSL)


def spec_of(tree: Path) -> EnvSpec:
    """The target's requirements. Raises EnvError if requirements/common.txt is missing."""
    common = _read(tree / "requirements" / "common.txt")
    version = f"{sys.version_info.major}.{sys.version_info.minor}"
    return EnvSpec(version, common, cute_dsl_lines(tree), torch_pin(tree))


def _read(path: Path, missing_ok: bool = False) -> str:
    try:
        return path.read_text()
    except FileNotFoundError as err:
        if missing_ok:
            return ""
        raise EnvError(f"the target has no {path.parent.name}/{path.name}") from err


def ensure(tree: Path, root: Path | None = None) -> Env:
    """The environment for ``tree`` (built now unless cached). Raises EnvError; UsageError
    (k3overlay's, one line) if something other than a regular file is at its lock file.

    ``root`` is where environments live (default ``<cache>/envs``). An environment whose
    ``env.json`` is not a regular file (a link, a FIFO: never read) is built again.
    """
    spec = spec_of(tree)
    root = root or cache_dir() / "envs"
    home = root / spec.key
    with held(root / f"{spec.key}.lock"):
        record = read_regular(home / "env.json")
        if record is None:
            _build(spec, tree, home)
            record = read_regular(home / "env.json")
    if record is None:
        raise EnvError(f"{home / 'env.json'} is not a regular file after the build")
    info = json.loads(record)
    return Env(str(home / "bin" / "python"), spec.key, info["installed_torch"], spec.torch,
               spec.cute_dsl)


def _build(spec: EnvSpec, tree: Path, home: Path) -> None:
    """Build into ``home``; ``env.json`` is written last, so a half-built one is redone."""
    shutil.rmtree(home, ignore_errors=True)
    subprocess.run([sys.executable, "-m", "venv", str(home)], check=True)
    python = str(home / "bin" / "python")
    torch = None
    if spec.torch and _pip(python, f"torch=={spec.torch}+cpu", quiet_failure=True):
        torch = f"{spec.torch}+cpu"
    if torch is None:
        try:
            torch = importlib.metadata.version("torch")  # the job's own
        except importlib.metadata.PackageNotFoundError as err:
            raise EnvError(f"torch {spec.torch}+cpu is not installable and the job's Python "
                           f"has no torch to fall back to") from err
        if not _pip(python, f"torch=={torch}"):
            raise EnvError(f"pip could not install torch {torch} (target pins {spec.torch})")
    common = home / "common.txt"
    common.write_text(spec.common)
    if not _pip(python, "-r", str(common), *spec.cute_dsl, *TEST_TOOLS):
        raise EnvError(f"pip could not install {tree.name}'s requirements/common.txt "
                       f"{' '.join(spec.cute_dsl)} (see the log above)")
    (home / "env.json").write_text(json.dumps({**asdict(spec), "installed_torch": torch}, indent=1))


def _pip(python: str, *args: str, quiet_failure: bool = False) -> bool:
    """True if ``pip install ARGS`` succeeded; its log goes to stderr."""
    proc = subprocess.run([python, "-m", "pip", "install", "-q", "--disable-pip-version-check",
                           *args], stdout=sys.stderr,
                          stderr=subprocess.DEVNULL if quiet_failure else None)
    return proc.returncode == 0
