"""Where this repository keeps its data: VERSION, patches/, overlay/ and overlay.json.

Policy lives in those files; this module only finds and reads them.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

from .errors import UsageError
from .files import read_regular
from .outputs import inside, refuse_overlap, resolvable, same

ROOT = Path(__file__).resolve().parent.parent
CACHE_NAME = "vllm-k3-overlay"  # the cache's folder, under XDG_CACHE_HOME

# Commits the tool writes (patch applications, the overlay commit) carry this
# identity, so the same series on the same ref gives the same shas on any machine.
IDENTITY = {
    "GIT_COMMITTER_NAME": "vllm-k3-overlay",
    "GIT_COMMITTER_EMAIL": "k3-overlay@users.noreply.localhost",
    "GIT_AUTHOR_NAME": "vllm-k3-overlay",
    "GIT_AUTHOR_EMAIL": "k3-overlay@users.noreply.localhost",
}
# For applying patches: the tool commits, each patch keeps its own author.
COMMITTER = {k: v for k, v in IDENTITY.items() if k.startswith("GIT_COMMITTER_")}
# The identity the report's next commands give git where it knows none (CI, a fresh
# machine) for a maintainer's own commits (a resolved conflict): never the tool's, so the
# branch then counts as the maintainer's work until --export saved it.
MAINTAINER = {"name": "vllm-k3-overlay maintainer",
              "email": "k3-overlay-maintainer@users.noreply.localhost"}


@dataclass(frozen=True)
class Project:
    """The data of one checkout of this repository (``root`` is its top)."""

    root: Path = ROOT

    @property
    def version(self) -> str:
        """Overlay version, the one line of VERSION (e.g. ``0.1.0``). Raises UsageError if
        VERSION is missing, not a regular file (a FIFO is not waited on), empty or not UTF-8."""
        path = self.root / "VERSION"
        data = read_regular(path)
        try:
            version = data.decode().strip() if data is not None else None
        except UnicodeDecodeError:
            version = None
        if not version:
            raise UsageError(f"{path} is missing, empty, not UTF-8 text or not a regular file; it "
                             f"holds the overlay version (restore it with git)")
        return version

    @property
    def patches_dir(self) -> Path:
        return self.root / "patches"

    @property
    def overlay_dir(self) -> Path:
        return self.root / "overlay"

    @property
    def manifest_path(self) -> Path:
        return self.root / "overlay.json"

    @property
    def default_branch(self) -> str:
        """Work branch name when none is given: ``k3-overlay/<version>``."""
        return f"k3-overlay/{self.version}"

    @property
    def default_workdir(self) -> Path:
        """Patched checkout when none is given: ``work/vllm`` under this repo (git-ignored)."""
        return self.root / "work" / "vllm"

    @property
    def default_wheel_dir(self) -> Path:
        """Where ``--build-wheel`` puts wheels when not told: ``work/wheels`` (git-ignored)."""
        return self.root / "work" / "wheels"

    @property
    def data_paths(self) -> tuple[Path, ...]:
        """What the tool reads as its input: VERSION, overlay.json, patches/ (the series
        file and each patch) and overlay/."""
        return (self.root / "VERSION", self.manifest_path, self.patches_dir, self.overlay_dir)

    def refuse_as_output(self, path: Path, option: str) -> None:
        """Raise UsageError (one line, exit 2) if ``path``, a file or folder the user named
        for ``option`` to write (a report, the wheel folder, the work directory), is one of
        ``data_paths`` or inside one, or inside a ``.git`` folder (this repository's, a
        linked worktree's or the vLLM checkout's) or any other git folder (a bare repository
        such as the release mirror, a separate git folder), or inside the tool's cache
        (``cache_dir``: a report over a lock file let a second run in). Links are followed: the
        file written is the one they lead to; a path that cannot be resolved (a folder on the
        way the user may not search, a link loop) is refused too (``outputs.resolvable``)."""
        target = resolvable(path, option)
        for data in self.data_paths:
            data = data.resolve()
            what = f"{data.name}/" if data.is_dir() else data.name
            refuse_overlap(target, option, path, data, f"this repository's {what}", "refusing to write there")
        gitdirs = [p for p in (target, *target.parents) if p.name.casefold() == ".git"]
        if gitdirs:
            raise UsageError(f"{option} {path} is inside a .git folder ({gitdirs[-1]}); refusing "
                             f"to write there")
        repos = [p for p in (target, *target.parents) if _is_git_dir(p)]
        if repos:
            raise UsageError(f"{option} {path} is inside the git repository {repos[-1]} (a bare "
                             f"or separate git folder); refusing to write there")
        cache = _cache_or_none()
        if cache is not None and (same(target, cache) or inside(target, cache)):
            raise UsageError(f"{option} {path} is inside the tool's cache {cache}; refusing to "
                             f"write there (its locks, journals and downloads would be replaced: "
                             f"a lock replaced lets two runs at once)")


def _is_git_dir(path: Path) -> bool:
    """True if ``path`` is a git folder by its layout (a bare repository, a ``--separate-git-dir``,
    the release mirror), whatever its name: HEAD, objects/ and refs/ in it."""
    return (path / "HEAD").is_file() and (path / "objects").is_dir() and (path / "refs").is_dir()


def _cache_or_none() -> Path | None:
    """``cache_dir()`` as the file system resolves it, or None where there is none (no home:
    the run that needs one says so itself)."""
    try:
        return cache_dir().resolve()
    except UsageError:
        return None


def cache_dir() -> Path:
    """``$XDG_CACHE_HOME/vllm-k3-overlay`` (default ``~/.cache/vllm-k3-overlay``). A relative
    ``$XDG_CACHE_HOME`` is ignored, as the XDG spec says: it would put the cache (locks, the
    release mirror) in whatever folder the tool runs from, a checkout among them. UsageError
    if there is no absolute home either (``HOME=`` or a relative one)."""
    base = os.environ.get("XDG_CACHE_HOME", "")
    if not os.path.isabs(base):
        base = os.path.join(os.path.expanduser("~"), ".cache")  # "~" itself if there is no home
    if not os.path.isabs(base):
        raise UsageError(f"no folder for the cache: $HOME is {os.environ.get('HOME')!r}; set "
                         f"XDG_CACHE_HOME (or HOME) to an absolute path")
    return Path(base) / CACHE_NAME
