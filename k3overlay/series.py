"""The patch series: ``patches/series`` (quilt-style order) and mailbox patch files.

Each patch says in an ``Upstream-Status:`` trailer why it exists (Yocto's
vocabulary): ``Pending``, ``Submitted [link]``, ``Backport [link]`` or
``Inappropriate [reason]``. A series with a patch lacking one is refused.
"""

from __future__ import annotations

import email
import email.policy
import re
from dataclasses import dataclass, field
from pathlib import Path

from . import git
from .errors import UsageError

STATUS_LINE = re.compile(
    r"^Upstream-Status: (?:Pending|(?:Submitted|Backport|Inappropriate) \[[^\]]+\])\s*$", re.M
)
_DIFF_FILE = re.compile(r"^diff --git a/(\S+) b/(\S+)$", re.M)

APPLIED = "applied"
APPLIED_3WAY = "applied-3way"
LANDED = "landed-upstream"
CONFLICT = "conflict"


@dataclass(frozen=True)
class Patch:
    """One patch file of the series."""

    name: str
    path: Path
    subject: str
    upstream_status: str
    files: tuple[str, ...]

    @property
    def diff(self) -> str:
        text = self.path.read_bytes().decode("utf-8", errors="replace")
        start = text.find("\ndiff --git ")
        return text[start + 1:] if start >= 0 else ""


@dataclass
class PatchResult:
    """What happened to one patch on one ref. ``files``/``hunks`` only for a conflict."""

    name: str
    status: str
    files: list[str] = field(default_factory=list)
    hunks: list[str] = field(default_factory=list)


def load(patches_dir: Path) -> list[Patch]:
    """Read ``patches_dir/series`` and each patch it names, in order.

    Raises UsageError if the series file is missing or unreadable, names a
    missing file or anything but a file name in ``patches_dir``, a ``.patch``
    file is not in the series, or a patch lacks a valid ``Upstream-Status:`` line.
    """
    series_file = patches_dir / "series"
    if not series_file.is_file():
        raise UsageError(f"no series file at {series_file}")
    try:
        text = series_file.read_text(encoding="utf-8")
    except UnicodeDecodeError as err:
        raise UsageError(f"{series_file} is not UTF-8 text") from err
    except OSError as err:
        raise UsageError(f"cannot read {series_file}: {err.strerror}") from err
    names = [line.strip() for line in text.splitlines()
             if line.strip() and not line.lstrip().startswith("#")]
    for name in names:  # a series names files beside it, nothing elsewhere
        if "/" in name or "\0" in name or name in (".", "..", "series") or not name.isprintable():
            raise UsageError(f"{series_file.name} names {name!r}: only patch file names in "
                             f"{patches_dir.name}/ may be listed")
    twice = sorted({name for name in names if names.count(name) > 1})
    if twice:
        raise UsageError(f"{series_file.name} lists {twice[0]} more than once")
    unlisted = sorted({p.name for p in patches_dir.glob("*.patch")} - set(names))
    if unlisted:
        raise UsageError(f"patches not in {series_file.name}: {', '.join(unlisted)}")
    return [read_patch(patches_dir / name) for name in names]


def read_patch(path: Path) -> Patch:
    """Read one mailbox patch file. Raises UsageError if it is missing or lacks Upstream-Status."""
    if not path.is_file():
        raise UsageError(f"series names {path.name}, which does not exist in {path.parent}")
    # Mail headers may carry any encoding; nothing we read from them needs exact bytes.
    try:
        text = path.read_bytes().decode("utf-8", errors="replace")
    except OSError as err:
        raise UsageError(f"cannot read {path.name}: {err.strerror}") from err
    if "\ndiff --git " not in text:
        raise UsageError(f"{path.name} holds no diff")
    status = STATUS_LINE.search(text.split("\n---\n", 1)[0])
    if status is None:
        raise UsageError(
            f"{path.name} lacks an 'Upstream-Status: Pending|Submitted [link]|Backport [link]"
            f"|Inappropriate [reason]' line"
        )
    message = email.message_from_string(text, policy=email.policy.default)
    subject = re.sub(r"^\[PATCH[^\]]*\]\s*", "", str(message["Subject"] or path.stem))
    files = tuple(dict.fromkeys(b for _, b in _DIFF_FILE.findall(text)))
    return Patch(path.name, path, subject, status.group(0).split(": ", 1)[1].strip(), files)


def apply(repo: git.Repo, patches: list[Patch], *, env: dict[str, str],
          upstream_range: str | None = None) -> list[PatchResult]:
    """Apply ``patches`` in order onto ``repo``'s work tree, one commit each.

    Each patch is classified: ``landed-upstream`` when its change is already
    there (it reverse-applies cleanly, or an upstream commit in
    ``upstream_range`` has the same patch-id) and is skipped; ``applied``
    when it applies as is; ``applied-3way`` when only ``git am --3way``
    takes it; ``conflict`` otherwise, with the files and hunks that failed.
    A conflicting patch is aborted and skipped, and the rest are still tried,
    so one run classifies the whole series.
    """
    return [apply_one(repo, patch, env=env, upstream_range=upstream_range) for patch in patches]


def apply_one(repo: git.Repo, patch: Patch, *, env: dict[str, str],
              upstream_range: str | None = None, keep_conflict: bool = False) -> PatchResult:
    """Apply and classify one patch (see ``apply``). With ``keep_conflict`` a
    conflicting am is left in progress for a maintainer to resolve."""
    if git.apply_check(repo, patch.path, reverse=True):
        return PatchResult(patch.name, LANDED)
    if upstream_range and _same_patch_upstream(repo, patch, upstream_range):
        return PatchResult(patch.name, LANDED)
    clean = git.apply_check(repo, patch.path)
    before = git.resolve(repo, "HEAD")
    ok, output = git.am(repo, patch.path, env=env)
    if ok and git.resolve(repo, "HEAD") == before:
        return PatchResult(patch.name, LANDED)  # 3-way merge found nothing left to change
    if ok:
        return PatchResult(patch.name, APPLIED if clean else APPLIED_3WAY)
    unmerged = git.unmerged_paths(repo)
    if not unmerged and not git.staged_changes(repo) and "already applied" in output:
        git.am_skip(repo)
        return PatchResult(patch.name, LANDED)
    hunks = _conflict_regions(Path(repo.working_tree_dir), unmerged) + _failed_hunks(output)
    if not keep_conflict:
        git.am_abort(repo)
    return PatchResult(patch.name, CONFLICT, unmerged or list(patch.files), hunks)


def _conflict_regions(tree: Path, paths: list[str]) -> list[str]:
    """``path:first-last`` for each region a 3-way merge left between conflict markers."""
    regions = []
    for path in paths:
        try:
            lines = (tree / path).read_text(errors="replace").splitlines()
        except OSError:
            continue
        start = None
        for number, line in enumerate(lines, 1):
            if line.startswith("<<<<<<< "):
                start = number
            elif line.startswith(">>>>>>> ") and start is not None:
                regions.append(f"{path}:{start}-{number}")
                start = None
    return regions


def _same_patch_upstream(repo: git.Repo, patch: Patch, rev_range: str) -> bool:
    ours = git.patch_id(repo, patch.diff)
    return ours is not None and ours in git.patch_ids(repo, rev_range, list(patch.files))


def _failed_hunks(am_output: str) -> list[str]:
    """The lines where git names what did not apply ("patch failed: FILE:LINE", "CONFLICT …")."""
    keep = ("patch failed:", "CONFLICT", "does not exist in index", "does not match index")
    return [line.strip() for line in am_output.splitlines() if any(k in line for k in keep)]
