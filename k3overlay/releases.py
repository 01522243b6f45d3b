"""Upstream vLLM's commit ids of its releases: ``--vllm-ref <upstream sha>`` and ``--list-releases``.

A user's sha is upstream's (the commit a release was tagged on), not the release
mirror's: the mirror commits each sdist as a root commit of its own, so its shas are
ours alone. Each release sdist records its upstream commit, abbreviated, in
``vllm/_version.py`` (``__commit_id__ = 'g2cf0a6915'``). ``releases.json`` keeps,
per known release, that record and, where a public source gives it, the full sha,
each with where it was read: so the release to fetch is known offline, from an
empty cache. After the download, the sdist's own record is checked against it.

A ref matches a release when it is 7 to 40 hex digits (any case, optionally peeled:
``^{commit}``, ``^{}``, ``^0``, ``~0``) and a prefix of the full sha;
for a release whose full sha is not known, when it and the sdist's record agree as
far as both go (a full sha is then matched by the record's 9 digits alone, and the
note says so). Releases already in the mirror but not in the file match by their
sdist's record too.
"""

from __future__ import annotations

import ast
import json
import re
from dataclasses import dataclass
from pathlib import Path

from packaging.version import Version

from . import git
from .errors import SourceError, UsageError
from .mirror import ReleaseMirror, release_of, tag_of

DATA = Path(__file__).with_name("releases.json")
VERSION_PY = "vllm/_version.py"
_HEX = re.compile(r"^[0-9a-f]{7,40}$")
# Suffixes that name the commit itself (git's peel to a commit, zero steps back): taken on an
# upstream id as on a tag (``v0.29.0^{commit}``). Any other step (``~1``, ``^2``) names a
# commit of upstream's history, which the release mirror (one root commit per sdist) lacks.
_PEELS = re.compile(r"(?:\^\{(?:commit)?\}|\^0+|~0+)+$")
_RECORD = re.compile(r"^g([0-9a-f]{7,40})$")
_NAMES = ("__commit_id__", "commit_id")
LIST_COMMAND = "python apply.py --list-releases"


@dataclass(frozen=True)
class Release:
    """One release: its tag, the commit its sdist records (hex, no ``g``), upstream's full
    sha (None where no source gave it) and where they were read."""

    tag: str
    recorded: str
    commit: str | None = None
    source: str = ""


@dataclass(frozen=True)
class Resolved:
    """A ref found to be upstream's commit of ``release``; ``by_record``: only the sdist's
    abbreviation was there to match a longer ref against."""

    ref: str
    release: Release
    by_record: bool

    option: str = "--vllm-ref"  # the flag the ref came with, for the note

    def note(self) -> str:
        head = f"{self.option} {self.ref}: upstream's commit of vLLM {self.release.tag}"
        if self.by_record:
            return (f"{head}, matched by the abbreviation its sdist records (g{self.release.recorded}); "
                    f"its full sha is not known here, so the rest of the ref was not checked")
        return f"{head} (its sdist records g{self.release.recorded}, checked)"


def known(path: Path | None = None) -> list[Release]:
    """The releases of ``path`` (default: ``releases.json``), in file order."""
    rows = json.loads((path or DATA).read_text())["releases"]
    return [Release(r["tag"], _RECORD.match(r["sdist_commit_id"]).group(1), r["commit"], r["source"])
            for r in rows]


def recorded_commit(text: str) -> str | None:
    """The hex digits of ``__commit_id__ = 'g…'`` in a ``vllm/_version.py``, or None."""
    try:
        body = ast.parse(text).body
    except SyntaxError:
        return None
    for node in body:
        if (isinstance(node, ast.Assign) and any(isinstance(t, ast.Name) and t.id in _NAMES
                                                 for t in node.targets)
                and isinstance(node.value, ast.Constant) and isinstance(node.value.value, str)):
            match = _RECORD.match(node.value.value)
            return match.group(1) if match else None
    return None


def with_commit(text: str, sha: str) -> str:
    """``vllm/_version.py`` text whose ``__commit_id__`` (and ``commit_id``) name commit
    ``sha`` (``'g'`` + its first 12 hex digits); every other byte is kept. A file that
    assigns neither gets the assignment appended."""
    value = repr(f"g{sha[:12]}").encode()
    data = text.encode()
    starts = [0]
    for line in data.splitlines(keepends=True):
        starts.append(starts[-1] + len(line))
    for node in ast.parse(text).body:  # ast offsets are UTF-8 byte columns
        if isinstance(node, ast.Assign) and any(isinstance(t, ast.Name) and t.id in _NAMES
                                                for t in node.targets):
            v = node.value
            begin, stop = starts[v.lineno - 1] + v.col_offset, starts[v.end_lineno - 1] + v.end_col_offset
            return (data[:begin] + value + data[stop:]).decode()
    sep = "" if not text or text.endswith("\n") else "\n"
    return text + sep + f"\n__commit_id__ = commit_id = {value.decode()}\n"


def in_mirror(mirror: ReleaseMirror) -> dict[str, tuple[str, str | None]]:
    """``{tag: (mirror sha, recorded hex or None)}`` of every release already in ``mirror``."""
    if not (mirror.path / "HEAD").exists():
        return {}
    repo = git.init_bare(mirror.path)
    found = {}
    for version in mirror.releases():
        tag = tag_of(version)
        found[tag] = (git.resolve(repo, tag), _recorded_at(repo, tag))
    return found


def _recorded_at(repo: git.Repo, tag: str) -> str | None:
    blob = git.blob_at(repo, tag, VERSION_PY)
    return recorded_commit(git.read_blob(repo, blob).decode(errors="replace")) if blob else None


def resolve(ref: str, releases: list[Release], option: str = "--vllm-ref") -> Resolved | None:
    """The release whose upstream commit ``ref`` (given with ``option``) is, or None if it
    is none of them.

    Raises UsageError when it is a prefix of two releases' commits."""
    sha = peeled(ref).lower()
    if not _HEX.match(sha):
        return None
    hits = {}
    for r in releases:
        if r.commit:
            if r.commit.startswith(sha):
                hits[r.tag] = Resolved(ref, r, False, option)
        elif r.recorded.startswith(sha) or sha.startswith(r.recorded):
            hits[r.tag] = Resolved(ref, r, len(sha) > len(r.recorded), option)
    if len(hits) > 1:
        raise UsageError(f"{option} {ref} is the start of the upstream commits of "
                         f"{', '.join(sorted(hits))}: give more of it (`{LIST_COMMAND}`)")
    return next(iter(hits.values()), None)


def peeled(ref: str) -> str:
    """``ref`` without a suffix that names the commit itself (``abc1234^{commit}`` ->
    ``abc1234``); any other ref as it is."""
    return _PEELS.sub("", ref)


def upstream_release(ref: str, mirror: ReleaseMirror, option: str = "--vllm-ref") -> Resolved | None:
    """``ref`` as upstream's commit of a release (``releases.json``, then the releases
    already in ``mirror``), with that release fetched into ``mirror`` and its sdist's
    record checked; None if ``ref`` is no such commit (a tag, a mirror sha, …).

    Raises SourceError (exit 6) when the fetched sdist records another commit than the
    file says, UsageError for an ambiguous ref, and what ``mirror.ensure`` raises."""
    releases = known()
    listed = {r.tag for r in releases}
    if release_of(ref) is not None or not _HEX.match(peeled(ref).lower()):
        return None
    found = resolve(ref, releases, option)
    if found is None:  # a release fetched before, and not in the file: its sdist's own record
        extra = [Release(tag, recorded) for tag, (_, recorded) in in_mirror(mirror).items()
                 if tag not in listed and recorded]
        found = resolve(ref, extra, option)
        if found is None:
            return None
    mirror.ensure([release_of(found.release.tag)])
    recorded = _recorded_at(git.init_bare(mirror.path), found.release.tag)
    if recorded is None or not (recorded.startswith(found.release.recorded)
                                or found.release.recorded.startswith(recorded)):
        said = f"g{recorded}" if recorded else f"no commit id in {VERSION_PY}"
        raise SourceError(f"the vLLM {found.release.tag} sdist records {said}, not "
                          f"g{found.release.recorded} as {DATA.name} says: it is not the release "
                          f"{ref} was taken for")
    return found


# A release version written the way pip, PyPI or a habit writes it: 0.29.0, V0.29.0, vllm-0.29.0,
# vllm==0.29.0, or without its patch number, v0.29 (the tag is v0.29.0)
_NEAR_TAG = re.compile(r"(?:vllm(?:-|==)|[vV])?(\d+\.\d+)(\.\d+)?")


def meant_tag(ref: str) -> str | None:
    """The release tag ``ref`` most likely means (``0.29.0``, ``v0.29`` -> ``v0.29.0``), None
    if none."""
    match = _NEAR_TAG.fullmatch(ref.strip())
    tag = match and f"v{match.group(1)}{match.group(2) or '.0'}"
    return tag if tag and ref != tag else None


def unknown_ref_hint(ref: str) -> str:
    """The one line for a ref the release mirror cannot resolve (with a "did you mean" for a
    release version written without its ``v``)."""
    tag = meant_tag(ref)
    meant = f"; did you mean {tag}?" if tag else ""
    return (f"ref {ref!r} is not in the release mirror{meant}: without --vllm-repo, give a release tag "
            f"(v0.29.0), upstream's commit id of a release (full, or at least 7 hex digits), or a "
            f"release-mirror sha; `{LIST_COMMAND}` lists them (any other commit: --vllm-repo "
            f"with a vLLM git clone)")


def listing(mirror: ReleaseMirror) -> list[str]:
    """``--list-releases``: one line per known release, then those only in the mirror:
    tag, upstream commit (or the sdist's record), release-mirror sha. Offline."""
    fetched = in_mirror(mirror)
    rows = [("release", "upstream commit", "its sdist records", "release-mirror sha")]
    releases = known()
    for r in releases:
        sha = fetched.get(r.tag, (None, None))[0]
        rows.append((r.tag, r.commit or "(full sha unknown)", f"g{r.recorded}", sha or "(not fetched yet)"))
    listed = {r.tag for r in releases}
    for tag, (sha, recorded) in sorted(fetched.items(), key=lambda kv: Version(kv[0][1:])):
        if tag not in listed:
            rows.append((tag, "(full sha unknown)", f"g{recorded}" if recorded else "-", sha))
    widths = [max(len(row[i]) for row in rows) for i in range(3)]
    lines = ["  ".join(cell.ljust(w) for cell, w in zip(row[:3], widths)) + "  " + row[3]
             for row in rows]
    return lines + [f"(sources of the upstream ids: {DATA}; --vllm-ref takes a tag, an upstream "
                    f"commit id, full or >= 7 hex digits, or a release-mirror sha; a release tag "
                    f"not listed here works too when the package index has its sdist)"]
