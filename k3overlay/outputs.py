"""Every path a run writes checked against every path it reads, before any work.

A report or a wheel folder named inside an input would destroy it or dirty it: ``--json``
over the ``--vllm-repo`` bundle replaced the bundle, ``--json work/vllm/r.json`` left an
untracked file in the checkout, refused as dirty by every later run. Paths are compared
as the file system resolves them (links and ``..`` followed), then by inode (a hard link,
a bind mount, a name in another case on a case-insensitive file system); a stream
(``/dev/stdout``) is no path and may take any report.
"""

from __future__ import annotations

import errno
import os
import stat
from pathlib import Path

from .errors import UsageError
from .files import stream_target

Named = list[tuple[Path | None, str]]  # (path or None when not given, the option naming it)


def refuse_aliases(outputs: Named, inputs: Named) -> None:
    """Raise UsageError (one line, exit 2) if an output is an input or lies inside one (an
    input folder: a checkout, a source repository), or two outputs are one path."""
    seen: dict[Path, tuple[Path, str]] = {}
    for path, option in outputs:
        if path is None or stream_target(path) is not None:
            continue
        real = _real(path)
        for source, source_option in inputs:
            if source is None:
                continue
            refuse_overlap(real, option, path, source, f"{source_option} {source}, which this run reads",
                           "give a path outside it")
        first = seen.setdefault(real, (path, option))
        if first[1] != option:
            raise UsageError(f"{option} {path} is the path {first[1]} {first[0]} names; give each "
                             f"its own")


def refuse_unresolvable(named: Named) -> None:
    """Raise UsageError (one line, exit 2, ``resolvable``) for the first path of ``named`` (each
    path the run was given, with the option naming it) that cannot be resolved: run first, so
    no later check or the job itself meets such a path as a traceback."""
    for path, option in named:
        if path is not None:
            resolvable(path, option)


def resolvable(path: Path, option: str) -> Path:
    """``path`` (given for ``option``) as the file system resolves it (links and ``..``
    followed). Raises UsageError (one line: "--workdir X cannot be resolved: Permission
    denied") where it cannot be resolved or looked at: a folder on the way the user may not
    search (``/proc/1/root`` as a user), a link loop, a name too long, an I/O error; or, for
    a folder, one that cannot be searched (nothing in it can be looked at). Nothing there yet
    (an output) or a file on the way is no error here: each option's own check names those."""
    try:
        # stat, not only resolve: resolving does not look at every name on the way (Python
        # 3.11 ignores most errors there), but the checks after it do (``is_file``), and raise
        info = os.stat(path)
    except (FileNotFoundError, NotADirectoryError):
        info = None
    except OSError as err:
        raise _unresolvable(path, option, err.strerror) from err
    if info is not None and stat.S_ISDIR(info.st_mode):
        try:  # a folder without search permission: every look inside it (its .git, HEAD) fails
            os.stat(os.path.join(path, os.curdir))
        except OSError as err:
            raise UsageError(f"{option} {path} is a folder that cannot be searched: {err.strerror}") from err
    try:
        return path.resolve()
    except RuntimeError as err:  # a link loop, as Python before 3.13 says it
        raise _unresolvable(path, option, os.strerror(errno.ELOOP)) from err
    except OSError as err:
        raise _unresolvable(path, option, err.strerror) from err


def _unresolvable(path: Path, option: str, reason: str | None) -> UsageError:
    return UsageError(f"{option} {path} cannot be resolved: {reason or 'unknown error'}")


def refuse_overlap(target: Path, option: str, path: Path, base: Path, name: str, advice: str) -> None:
    """Raise UsageError (one line) if ``target`` (``path`` resolved, given for ``option``) is
    ``base`` or lies inside it; ``name`` says what ``base`` is, ``advice`` what to do instead."""
    if same(target, base):
        raise UsageError(f"{option} {path} is {name}; refusing to write over it")
    if inside(target, base):
        raise UsageError(f"{option} {path} is inside {name}; {advice}")


def _real(path: Path) -> Path:
    return Path(os.path.realpath(path))


def _identity(path: Path) -> tuple[int, int] | None:
    """(device, inode) of what ``path`` names (links followed), None if nothing is there."""
    try:
        info = os.stat(path)
    except OSError:
        return None
    return info.st_dev, info.st_ino


def same(path: Path, other: Path) -> bool:
    """Whether ``path`` and ``other`` name one file or folder: one path once links and
    ``..`` are resolved, or one inode under two names resolving cannot join (a hard link,
    a bind mount, another case of the name on a case-insensitive file system)."""
    if _real(path) == _real(other):
        return True
    mine = _identity(path)
    return mine is not None and mine == _identity(other)


def inside(path: Path, folder: Path) -> bool:
    """Whether ``path`` lies inside ``folder`` (``same`` applied to each folder above it)."""
    real, top = _real(path), _real(folder)
    if top in real.parents:
        return True
    mine = _identity(top)
    return mine is not None and any(_identity(above) == mine for above in real.parents)
