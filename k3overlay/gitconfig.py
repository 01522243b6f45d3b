"""The config files git reads, found without running git, and the refusal of one it would wait
on: a FIFO (git opens it and waits for a writer forever), a device, a folder, at the top level
or included at any depth, the user's own (system, global) and a checkout's.

A git run reads its config before anything else, includes and all; so does GitPython's read of
a repository's config. One FIFO there and every run of the tool hung before it said a word.
"""

from __future__ import annotations

import os
import stat
import subprocess
from pathlib import Path

from .errors import UsageError
from .gitfolder import config_files, git_files, git_folder
from .regular import kind_of

INCLUDES_WAIT_S = 30  # one ``git config --file`` read of a single file (a slow network home)


def refuse_unreadable_config() -> None:
    """Raise UsageError (one line) if a file git reads the user's own config from
    (``_config_files``) is there but is no file: a FIFO (git opens it and waits for a writer
    forever: each read of their config then took 30 s, and was tried again folder after
    folder), a device (``/dev/null`` is fine: git reads it as empty), a socket or a folder.
    A link to a file is a file; a path that cannot be looked at is git's to skip or name."""
    for name, path in _config_files():
        try:  # (an empty variable names no file: git reads none)
            info = os.stat(path)
        except OSError:  # absent, or git says why itself: it waits on nothing it cannot open
            continue
        if stat.S_ISREG(info.st_mode) or _is_devnull(info):
            continue
        raise UsageError(f"{name} {path} is {_no_file(path)}")
    for name, path in _config_files():
        refuse_unreadable_includes(name, Path(path))


def refuse_unreadable_repo_config(top: Path) -> None:
    """Raise UsageError (one line) if a config file of the repository whose work tree is ``top``
    is there but is no file, or includes one at any depth: every git run there, and GitPython's
    own read of it, would wait on a FIFO forever (a checkout's ``.git/config`` with
    ``include.path`` naming one hung the run before it said a word)."""
    folder = git_folder(top)
    for path in git_files(folder) if folder is not None else []:
        if not path.is_file():  # HEAD, packed-refs: git opens them at every start, a FIFO too
            raise UsageError(f"{path}, a file of the git folder of {top}, is {_no_file(path)}")
    for path in config_files(folder) if folder is not None else []:
        name = f"the config of {top},"
        if not path.is_file():
            raise UsageError(f"{name} {path} is {_no_file(path)}")
        refuse_unreadable_includes(name, path)


# git stops following includes this deep (config.c's MAX_INCLUDE_DEPTH)
_MAX_INCLUDE_DEPTH = 10


def refuse_unreadable_includes(name: str, config: Path) -> None:
    """Raise UsageError (one line) if the config file ``config`` (a regular one, what ``name``
    calls it) includes, at any depth, by ``include.path`` or ``includeIf.*.path`` (whatever the
    condition), a path that is there but is no file. Relative paths are read from the
    including file's folder, ``~/`` from $HOME, as git reads them."""
    left = [(config, 1)]
    while left:
        current, depth = left.pop()
        for included in _includes_of(current):
            # (``~/`` and ``~USER/`` as git expands them; else from the including file's folder)
            path = Path(os.path.expanduser(included) if included.startswith("~")
                        else current.parent / included)
            try:
                info = os.stat(path)
            except OSError:  # absent, or git's to skip or name: it waits on nothing it cannot open
                continue
            if stat.S_ISREG(info.st_mode):
                if depth < _MAX_INCLUDE_DEPTH:
                    left.append((path, depth + 1))
            elif not _is_devnull(info):
                raise UsageError(f"{name} {current} includes {path}, which is {_no_file(path)}")


def _includes_of(config: Path) -> list[str]:
    """The paths ``config`` includes (``include.path``, ``includeIf.*.path``), its includes not
    read: read by git with no other config file (so none of them can stall it)."""
    env = {"PATH": os.environ.get("PATH", os.defpath), "HOME": os.environ.get("HOME", ""),
           "GIT_CONFIG_NOSYSTEM": "1", "GIT_CONFIG_GLOBAL": os.devnull, "LC_ALL": "C"}
    try:
        proc = subprocess.run(["git", "config", "--file", str(config), "--no-includes", "--null",
                               "--get-regexp", r"^include(if\..*)?\.path$"], env=env, cwd=os.sep,
                              stdin=subprocess.DEVNULL, capture_output=True, timeout=INCLUDES_WAIT_S)
    except (OSError, subprocess.TimeoutExpired):
        return []  # (git's own read then says what is wrong, or times out as it would have)
    records = (record.partition("\n") for record in proc.stdout.decode("utf-8", errors="surrogateescape").split("\0"))
    return [value for key, newline, value in records if key and newline and value]


def _no_file(path: Path | str) -> str:
    """What ``path`` is instead of a file, and what git would do with it."""
    kind = kind_of(path, follow=True)
    why = {"FIFO": "git would wait on it forever",
           "device": "git would read it as config, or wait on it"}.get(kind, "git cannot read it")
    return f"a {kind}, not a file; {why}"


def _is_devnull(info: os.stat_result) -> bool:
    try:
        null = os.stat(os.devnull)
    except OSError:
        return False
    return stat.S_ISCHR(info.st_mode) and info.st_rdev == null.st_rdev


def _config_files() -> list[tuple[str, str]]:
    """(what names it, path) of each file git reads the user's config from at the top level
    (``git help config``, FILES), as the tool runs git as the user (``gitproc._users_environment``): the system file where not
    ``GIT_CONFIG_NOSYSTEM`` (``GIT_CONFIG_SYSTEM``, else ``/etc/gitconfig``, where the git
    of Linux distributions keeps it), then ``GIT_CONFIG_GLOBAL`` or, where it is not set,
    ``$XDG_CONFIG_HOME/git/config`` (``~/.config/git/config``) and ``~/.gitconfig``.
    (``GIT_CONFIG``, which ``git config`` would read alone, is not passed to it.)"""
    env, files = os.environ, []
    if not git_true(env.get("GIT_CONFIG_NOSYSTEM", "")):
        files.append(("GIT_CONFIG_SYSTEM", env["GIT_CONFIG_SYSTEM"]) if "GIT_CONFIG_SYSTEM" in env
                     else ("the system config", "/etc/gitconfig"))
    if "GIT_CONFIG_GLOBAL" in env:  # git reads it alone
        return files + [("GIT_CONFIG_GLOBAL", env["GIT_CONFIG_GLOBAL"])]
    home, xdg = env.get("HOME"), env.get("XDG_CONFIG_HOME")
    if xdg:
        files.append(("the global config ($XDG_CONFIG_HOME/git/config)", os.path.join(xdg, "git", "config")))
    elif home:
        files.append(("the global config", os.path.join(home, ".config", "git", "config")))
    if home:
        files.append(("the global config", os.path.join(home, ".gitconfig")))
    return files


def git_true(value: str) -> bool:
    """Whether git reads the variable's ``value`` as true (``git_env_bool``: a number other than 0)."""
    value = value.strip().lower()
    if value in ("true", "yes", "on"):
        return True
    try:
        return int(value) != 0
    except ValueError:
        return False
