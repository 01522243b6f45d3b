"""Where a work tree's git folder is, as git finds it (``git_folder``), and which config files
git reads there (``config_files``), found without running git: a git run there reads the
repository's config, includes and all, and one including a FIFO waits forever.
"""

from __future__ import annotations

import os
import stat
from pathlib import Path

from .errors import UsageError


def git_folder(top: Path) -> Path | None:
    """The git folder of the work tree ``top``, as git finds it: its ``.git`` folder, or the one
    its ``.git`` file names (``gitdir: …``: a linked worktree's, a ``clone --separate-git-dir``'s,
    a submodule's), links followed on the way, where that is one git would take: it holds
    ``HEAD`` and ``commondir``, or ``HEAD``, ``objects/`` and ``refs/`` (a hostile line must
    not have the claim made in ``/etc``). None where there is none (git refuses the checkout
    then), or a name the system refuses. UsageError for one reached through a link or a
    ``.git`` file that is another user's (``_refuse_others``)."""
    dot = top / ".git"
    try:
        if dot.is_dir() and not dot.is_symlink():
            return dot
        real = Path(os.path.realpath(dot))  # (git follows links, to the folder or to a .git file)
        if real.is_dir():
            folder = real
        else:
            named = _head_of(real)
            if not named.startswith(b"gitdir: "):
                return None
            # (git strips only the line's end, and reads a relative path from the checkout, ``top``,
            # wherever a link to the .git file leads)
            folder = Path(os.path.realpath(top / os.fsdecode(named[len(b"gitdir: "):].rstrip(b"\r\n"))))
        whole = (folder / "objects").is_dir() and (folder / "refs").is_dir()
        if not (folder / "HEAD").is_file() or not ((folder / "commondir").is_file() or whole):
            return None
    except (OSError, ValueError):  # a name too long, a NUL: no git folder of anyone's
        return None
    _refuse_others(folder, top)
    return folder


def _refuse_others(folder: Path, top: Path) -> None:
    """UsageError where the git folder ``folder`` of ``top`` (reached through a link or a ``.git``
    file) is not this user's (root's runs: nor the ``sudo`` user's, ``SUDO_UID``), as git
    wants it: its owner could hold a claim made there for ever, and a run without the claim
    is not kept apart from another cache's (``safe.directory`` lets git take it all the same)."""
    owner, me = os.stat(folder).st_uid, os.geteuid()
    if owner != me and not (me == 0 and str(owner) == os.environ.get("SUDO_UID")):
        raise UsageError(f"the git folder of {top}, {folder}, is another user's (uid {owner}): no run of "
                         f"this tool is kept apart from another there; run as its owner")


def _head_of(file: Path) -> bytes:
    """The first 4 kB of the regular file ``file`` (a ``.git`` file is one line); b"" else."""
    try:
        fd = os.open(file, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError:
        return b""
    try:
        return os.read(fd, 4096) if stat.S_ISREG(os.fstat(fd).st_mode) else b""
    finally:
        os.close(fd)


def config_files(folder: Path) -> list[Path]:
    """The repository config files git reads for the work tree whose git folder is ``folder``:
    the common folder's ``config`` (a linked worktree's ``commondir`` names it) and the
    worktree's own ``config.worktree`` (read where ``extensions.worktreeConfig`` is on: listed
    where it is there). Absent ones are left out."""
    return _there([_common(folder) / "config", folder / "config.worktree"])


def git_files(folder: Path) -> list[Path]:
    """The files other than config that git (and GitPython) read in the git folder ``folder``
    before any command's own work, where they are there: ``HEAD``, ``commondir`` and the
    common folder's ``packed-refs``. (``git_folder`` took only a ``HEAD`` that is a file.)"""
    return _there([folder / "HEAD", folder / "commondir", _common(folder) / "packed-refs"])


def _common(folder: Path) -> Path:
    """The common git folder of git folder ``folder``: the one its ``commondir`` names (a
    linked worktree's), else itself."""
    named = _head_of(folder / "commondir").rstrip(b"\r\n")
    return folder / os.fsdecode(named) if named else folder


def _there(paths: list[Path]) -> list[Path]:
    """``paths`` that are there (a dangling link too: it is git's to read), each once."""
    return [path for path in dict.fromkeys(paths) if os.path.lexists(path)]
