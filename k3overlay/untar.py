"""Extracting a tar archive safely on every Python ``requires-python`` admits.

tarfile's ``data`` filter (no absolute paths, nothing outside the destination,
no links out of it, no device files, no set-uid bits) came with Python 3.11.4;
Debian 12's own Python is 3.11.2, where ``extractall(filter=...)`` is a
TypeError. Where tarfile has the filter it is used as is; elsewhere each member
is checked here by the same rules, then extracted one by one.
"""

from __future__ import annotations

import copy
import os
import tarfile
from collections.abc import Iterable
from pathlib import Path


class UnsafeMember(tarfile.TarError):
    """A member the ``data`` filter would refuse (absolute, escaping, a device file)."""


def extract(archive: tarfile.TarFile, dest: Path, members: Iterable[tarfile.TarInfo] | None = None) -> None:
    """Extract ``members`` (default: all) of ``archive`` under ``dest`` by the ``data`` filter's rules.

    Raises a tarfile.TarError (tarfile's own FilterError, or UnsafeMember where
    tarfile has no filter) for a member that would land outside ``dest``, a link
    pointing out of it, or a device or FIFO; what was extracted before stays.
    """
    chosen = archive.getmembers() if members is None else list(members)
    if hasattr(tarfile, "data_filter"):
        archive.extractall(dest, members=chosen, filter="data")
        return
    dest = Path(os.path.realpath(dest))
    for member in chosen:  # checked just before it is written, so links made earlier count
        safe = _checked(member, dest)
        archive.extract(safe, dest, set_attrs=safe.mode is not None)


def _checked(member: tarfile.TarInfo, dest: Path) -> tarfile.TarInfo:
    """A copy of ``member`` safe to extract under ``dest``, as ``tarfile.data_filter`` makes it."""
    if not (member.isreg() or member.isdir() or member.issym() or member.islnk()):
        raise UnsafeMember(f"{member.name!r} is a special file")
    if member.name.startswith("/") or os.path.isabs(member.name):
        raise UnsafeMember(f"{member.name!r} is an absolute path")
    target = _inside(dest, dest / member.name, member.name)
    if member.issym():
        if os.path.isabs(member.linkname):
            raise UnsafeMember(f"{member.name!r} links to the absolute path {member.linkname!r}")
        _inside(dest, target.parent / member.linkname, member.name)
    elif member.islnk():
        _inside(dest, dest / member.linkname, member.name)
    safe = copy.copy(member)
    safe.uid, safe.gid = os.getuid(), os.getgid()  # never chown to the archive's owner, even as root
    safe.uname = safe.gname = ""
    # the filter's rule: no set-uid or group/other write; owner reads and writes; exec only if
    # the owner's; a folder's or link's mode is not set at all (None: skip its attributes)
    mode = member.mode & 0o755
    if member.isreg() or member.islnk():
        safe.mode = (mode if mode & 0o100 else mode & ~0o111) | 0o600
    else:
        safe.mode = None
    return safe


def _inside(dest: Path, path: Path, name: str) -> Path:
    """``path`` resolved, which must stay under ``dest``; UnsafeMember otherwise."""
    resolved = Path(os.path.realpath(path))
    if resolved != dest and dest not in resolved.parents:
        raise UnsafeMember(f"{name!r} would be extracted outside the destination")
    return resolved
