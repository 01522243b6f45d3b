"""The patch series: ``patches/series`` (quilt-style order) and mailbox patch files.

Each patch says in an ``Upstream-Status:`` trailer why it exists (Yocto's
vocabulary): ``Pending``, ``Submitted [link]``, ``Backport [link]`` or
``Inappropriate [reason]``. A series with a patch lacking one is refused.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path

from . import git
from .errors import UsageError
from .files import read_regular

STATUS_LINE = re.compile(
    r"^Upstream-Status: (?:Pending|(?:Submitted|Backport|Inappropriate) \[[^\]]+\])\s*$", re.M
)

APPLIED = "applied"
APPLIED_3WAY = "applied-3way"
LANDED = "landed-upstream"
CONFLICT = "conflict"
REDUNDANT = "redundant"
_UNCHANGED = "unchanged"  # git am found nothing to change; which of the two above is proven after


@dataclass(frozen=True)
class Patch:
    """One patch file of the series."""

    name: str
    path: Path
    subject: str  # the commit subject ``git am --keep-non-patch`` gives it, verbatim
    upstream_status: str


@dataclass
class PatchResult:
    """What happened to one patch on one ref. ``files``/``hunks`` only for a conflict
    (``hunks``: ``path:first-last`` regions between conflict markers, then git's own lines)."""

    name: str
    status: str
    files: list[str] = field(default_factory=list)
    hunks: list[str] = field(default_factory=list)
    upstream_commit: str = ""  # landed-upstream by patch-id: the upstream commit that has it


def load(patches_dir: Path) -> list[Patch]:
    """Read ``patches_dir/series`` and each patch it names, in order.

    Raises UsageError if the series file is missing or unreadable, names a
    missing file or anything but a file name in ``patches_dir``, a ``.patch``
    file is not in the series, a patch lacks a valid ``Upstream-Status:`` line, or
    two patches share a subject.
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
    patches = [read_patch(patches_dir / name) for name in names]
    first: dict[str, str] = {}
    for patch in patches:  # --rebase-to and --export find a patch's commit by its subject
        other = first.setdefault(patch.subject, patch.name)
        if other != patch.name:
            raise UsageError(f"{other} and {patch.name} share the subject {patch.subject!r}; "
                             f"reword one (--rebase-to and --export tell patches apart by subject)")
    return patches


def read_patch(path: Path) -> Patch:
    """Read one mailbox patch file the way ``git am`` will (``git mailinfo -b``).

    Raises UsageError if it is missing, has CRLF line endings (its first line ends in CR:
    a whole file converted on checkout, whose every hunk would fail), holds more than one
    mail (``_refuse_more_than_one_mail``), holds no diff, or its commit message (what
    ``git am`` keeps: the text before a ``---`` line) lacks Upstream-Status.
    """
    if not path.is_file():
        raise UsageError(f"series names {path.name}, which does not exist in {path.parent}")
    try:
        if path.read_bytes().partition(b"\n")[0].endswith(b"\r"):
            raise UsageError(f"{path.name} has CRLF line endings (converted on checkout, e.g. by "
                             f"core.autocrlf=true?): check patches/ out again with LF endings")
        _refuse_more_than_one_mail(path)
        headers, message, has_diff = git.mailinfo(path)
    except OSError as err:
        raise UsageError(f"cannot read {path.name}: {err.strerror}") from err
    if not has_diff:
        raise UsageError(f"{path.name} holds no diff")
    _refuse_subject_am_reads_otherwise(path.name, headers.get("Subject", ""))
    status = STATUS_LINE.search(message)
    if status is None:
        raise UsageError(
            f"{path.name} lacks an 'Upstream-Status: Pending|Submitted [link]|Backport [link]"
            f"|Inappropriate [reason]' line in its commit message"
        )
    return Patch(path.name, path, headers.get("Subject", ""), status.group(0).split(": ", 1)[1].strip())


# A diffstat as format-patch writes it, at the end of the text between ``---`` and the diff.
_DIFFSTAT = re.compile(rb"(?:^ [^\n]*\|[^\n]*\n)+^ \d+ files? changed[^\n]*\n\n?\Z", re.M)


def split_notes(data: bytes) -> tuple[bytes, bytes, bytes]:
    """A mailbox patch as ``(head, notes, rest)``, ``head + notes + rest == data``.

    ``head`` ends with the ``---`` line that ends the commit message (``git am`` keeps
    nothing after it); ``notes`` is what a person wrote below it (version notes,
    measurements), before the diffstat; ``rest`` is the diffstat and the diff. A patch
    without a ``---`` line has no notes (``(data, b"", b"")``).
    """
    sep = data.find(b"\n---\n")
    if sep < 0:
        return data, b"", b""
    body = sep + len(b"\n---\n")
    diff = data.find(b"\ndiff ", body - 1)
    diff = len(data) if diff < 0 else diff + 1
    between = data[body:diff]
    stat = _DIFFSTAT.search(between)
    end = body + (stat.start() if stat else len(between))
    return data[:body], data[body:end], data[end:]


def with_notes(data: bytes, notes: bytes) -> bytes:
    """``data`` (a mailbox patch) with its notes below ``---`` replaced by ``notes``."""
    head, _, rest = split_notes(data)
    return head + notes + rest if head != data else data


def notes_in_message(patch: Patch, folder: Path) -> Patch:
    """A copy of ``patch`` in ``folder`` whose notes are in its commit message, indented
    under ``Notes:`` (as ``git log --notes`` shows them): applied, its commit then
    carries them, so a range-diff tells a change in them apart from none."""
    data = patch.path.read_bytes()
    head, notes, rest = split_notes(data)
    if not notes.strip():
        return patch
    indented = b"".join(b"    " + line if line.strip() else line
                        for line in notes.splitlines(keepends=True))
    message = head[:-len(b"---\n")]
    copy = folder / patch.name
    copy.write_bytes(message + b"\nNotes:\n" + indented.rstrip(b"\n") + b"\n---\n" + rest)
    return Patch(patch.name, copy, patch.subject, patch.upstream_status)


def _refuse_subject_am_reads_otherwise(name: str, subject: str) -> None:
    """UsageError unless ``subject`` is what ``git am`` commits and prints for the mail: an
    empty one makes am take the message's first line instead, and one that is not UTF-8 (a
    raw Latin-1 byte, no charset declared) is printed undecodable; either way the result was
    charged to no patch ("a mail … which is no patch of the series")."""
    if not subject.strip():
        raise UsageError(f"{name} has an empty subject: git am would take its first message "
                         f"line for one; give it a subject line")
    if any("\udc80" <= c <= "\udcff" for c in subject):
        shown = subject.encode("utf-8", "surrogateescape").decode("utf-8", "replace")
        raise UsageError(f"{name}'s subject is not UTF-8 ({shown[:60]!r}): declare its charset "
                         f"(=?iso-8859-1?q?...?=) or save it as UTF-8")


def _refuse_more_than_one_mail(path: Path) -> None:
    """UsageError, naming the file and the line, if ``git am`` would make more than one commit
    of ``path``: a second mail appended (another author, another change, never reported),
    or a message line git takes for the start of a mail (``From <sha> Mon Sep 17 00:00:00
    2001``: the mail is cut there and am fails with "Patch is empty")."""
    extra = _second_mail(path)
    if extra:
        raise UsageError(extra)


def _second_mail(path: Path) -> str | None:
    """Why ``path`` is more than one mail to ``git am`` (file, count, line), or None."""
    try:
        starts = git.mail_starts(path)
    except git.GitError as err:
        raise UsageError(str(err)) from err
    if len(starts) < 2:
        return None
    line = path.read_bytes().splitlines()[starts[1] - 1].decode(errors="replace")
    return (f"{path.name} holds {len(starts)} mails: line {starts[1]} starts another "
            f"({line[:60]!r}); one patch file must be one commit (split it, or write a message "
            f"line like that as '>From ...')")


def apply(repo: git.Repo, patches: list[Patch], *, env: dict[str, str],
          ref_sha: str, base_sha: str | None = None) -> list[PatchResult]:
    """Apply ``patches`` in order onto ``repo``'s work tree (HEAD at REF, ``ref_sha``), one
    commit each, in one ``git am --3way`` run.

    Each patch is classified: ``applied`` when it applies as is;
    ``applied-3way`` when only the 3-way fallback takes it;
    ``landed-upstream`` when it changes nothing and REF's own tree provably
    holds its result (see ``landed``), and it is skipped; ``redundant`` when it
    changes nothing only because patches before it already made its change;
    ``conflict`` otherwise, with the files and hunks that failed. A
    conflicting patch is skipped and the rest are still tried, so one run
    classifies the whole series. No commit is left that changes nothing.

    With ``base_sha`` (upstream at our base) and history from it to REF (a git
    clone, not a release mirror), a patch whose patch-id equals an upstream
    commit's there is ``landed-upstream`` first of all, naming that commit, and
    is not applied: upstream took it, whatever it did to those lines later
    (``git rebase`` drops such a commit the same way).
    """
    return _by_patch_id(repo, patches, base_sha, ref_sha,
                        lambda rest: _run(repo, rest, env, ref_sha, keep_conflict=False))


def apply_one(repo: git.Repo, patch: Patch, *, env: dict[str, str], ref_sha: str,
              keep_conflict: bool = False, base_sha: str | None = None) -> PatchResult:
    """Apply and classify one patch (see ``apply``). With ``keep_conflict`` a
    conflicting am is left in progress for a maintainer to resolve."""
    return _by_patch_id(repo, [patch], base_sha, ref_sha,
                        lambda rest: _run(repo, rest, env, ref_sha, keep_conflict))[0]


def landed_by_patch_id(repo: git.Repo, patches: list[Patch], base_sha: str | None,
                       ref_sha: str) -> dict[str, str]:
    """``{patch name: upstream commit}`` for each patch an upstream commit in
    ``base_sha..ref_sha`` carries, by ``git patch-id --stable``; empty without
    ``base_sha`` or without history between the two."""
    if not base_sha or base_sha == ref_sha or not git.is_ancestor(repo, base_sha, ref_sha):
        return {}
    found = {}
    for patch in patches:
        mine = git.patch_ids(repo, patch=patch.path)
        if not mine:
            continue  # no diff git can id (a mode change alone, say): the tree rule decides
        theirs = git.patch_ids(repo, rev_range=f"{base_sha}..{ref_sha}",
                               paths=git.patch_paths(repo, patch.path))
        commit = next((theirs[pid] for pid in mine if pid in theirs), None)
        if commit:
            found[patch.name] = commit
    return found


def _by_patch_id(repo, patches, base_sha, ref_sha, run) -> list[PatchResult]:
    """``run`` on the patches upstream has not taken by patch-id; the results in series order."""
    taken = landed_by_patch_id(repo, patches, base_sha, ref_sha)
    rest = iter(run([p for p in patches if p.name not in taken]) if len(taken) < len(patches)
                else [])
    results = []
    for patch in patches:
        result = (PatchResult(patch.name, LANDED, upstream_commit=taken[patch.name])
                  if patch.name in taken else next(rest, None))
        if result is None:
            break  # a conflict left in progress (``keep_conflict``): nothing after it ran
        results.append(result)
    return results


def _run(repo: git.Repo, patches: list[Patch], env: dict[str, str], ref_sha: str,
         keep_conflict: bool) -> list[PatchResult]:
    """The series in one ``git am`` run (one process for the whole series: fast on long
    ones), each result charged to the patch whose subject git am printed as it applied it,
    each commit to the patch whose subject it carries: never by position. Anything else
    (a mail no file of the series is, a second commit of one file) undoes the run."""
    unfinished = git.operation_in_progress(repo)
    if unfinished:  # someone else's: never ours to skip or abort
        raise git.GitError(f"{repo.working_tree_dir} has a {unfinished} in progress")
    start = git.resolve(repo, "HEAD")
    by_subject = {p.subject: p for p in patches}
    results: dict[str, PatchResult] = {}  # by patch name, in the order git am went
    ok, out, err = git.am(repo, [p.path for p in patches], env=env)
    while True:
        tried = _am_outcomes(out)
        for subject, outcome in tried if ok else tried[:-1]:
            patch = _charged(repo, start, by_subject, results, subject)
            if outcome == _UNCHANGED:
                outcome = LANDED if landed(repo, patch.path, ref_sha) else REDUNDANT
            results[patch.name] = PatchResult(patch.name, outcome)
        if ok:
            break
        if not tried:  # am stopped before it could apply a mail: name the file and the reason
            stuck = _stuck_patch(repo, by_subject)
            _undo(repo, start)
            raise git.GitError(_am_refused(stuck, out + "\n" + err))
        patch = _charged(repo, start, by_subject, results, tried[-1][0])
        results[patch.name] = _failed(repo, patch, ref_sha, out + "\n" + err)
        if keep_conflict and results[patch.name].status == CONFLICT:
            return list(results.values())
        ok, out, err = git.am_skip(repo, env=env)
    _drop_empty_commits(repo, start, _commits(repo, start, by_subject, results), ref_sha)
    return list(results.values())


def _charged(repo: git.Repo, start: str, by_subject: dict[str, Patch],
             results: dict[str, PatchResult], subject: str) -> Patch:
    """The patch git am applied as ``subject``; the run undone and GitError if it is no patch
    of the series, or one already applied (a file holding another mail)."""
    patch = by_subject.get(subject)
    if patch is None or patch.name in results:
        _undo(repo, start)
        why = next(filter(None, (_second_mail(p.path) for p in by_subject.values())),
                   "one patch file must be one commit")  # the files changed since they were read
        raise git.GitError(f"git am applied a mail with subject {subject!r}, which is no patch of "
                           f"the series: {why}")
    return patch


def _commits(repo: git.Repo, start: str, by_subject: dict[str, Patch],
             results: dict[str, PatchResult]) -> list[tuple[PatchResult, Patch, str]]:
    """(result, patch, commit) of each commit git am made since ``start``, matched by subject;
    the run undone and GitError if a commit is no applied patch's."""
    commits = git.log_subjects(repo, f"{start}..HEAD")
    applied = [name for name, r in results.items() if r.status in (APPLIED, APPLIED_3WAY)]
    matched = [(by_subject.get(subject), sha) for sha, subject in commits]
    if [patch.name if patch else None for patch, _ in matched] != applied:
        _undo(repo, start)
        raise git.GitError(f"git am made {len(commits)} commit(s) for {len(applied)} applied "
                           f"patch(es): one patch file must be one commit")
    return [(results[patch.name], patch, sha) for patch, sha in matched]


def _stuck_patch(repo: git.Repo, by_subject: dict[str, Patch]) -> Patch | None:
    """The patch of the mail an in-progress ``git am`` stopped at (read from its own split
    mails, ``rebase-apply/NNNN``), or None if that cannot be told."""
    state = Path(repo.working_tree_dir) / git.run(repo, "rev-parse", "--git-path", "rebase-apply").strip()
    try:
        mail = state / f"{int((state / 'next').read_text()):04d}"
        return by_subject.get(git.mailinfo(mail)[0].get("Subject", ""))
    except (OSError, ValueError):
        return None


def _undo(repo: git.Repo, start: str) -> None:
    """End the am and put HEAD, index and work tree back at ``start`` (what am made goes)."""
    git.am_abort(repo)
    git.run(repo, "reset", "--quiet", "--keep", start)  # --keep: a user edit since the start stays


def _am_refused(patch: Patch | None, output: str) -> str:
    """One line naming the patch git am could not apply and why."""
    if patch is None:
        return f"git am failed: {git.first_line(output)}"
    why = _second_mail(patch.path)  # changed since the series was read
    if why:
        return f"git am could not apply {patch.name} as one commit: {why}"
    return f"git am could not apply {patch.name}: {git.first_line(output)}"


def _am_outcomes(stdout: str) -> list[tuple[str, str]]:
    """(subject, outcome) per mail git am tried, read from its progress lines (C locale)."""
    outcomes: list[tuple[str, str]] = []
    for line in stdout.splitlines():
        if line.startswith("Applying: "):
            outcomes.append((line.removeprefix("Applying: "), APPLIED))
        elif line.startswith("Falling back to patching base and 3-way merge") and outcomes:
            outcomes[-1] = (outcomes[-1][0], APPLIED_3WAY)
        elif line.startswith("No changes -- Patch already applied") and outcomes:
            outcomes[-1] = (outcomes[-1][0], _UNCHANGED)
    return outcomes


def _failed(repo: git.Repo, patch: Patch, ref_sha: str, output: str) -> PatchResult:
    """The verdict on a patch git am could not apply: landed upstream (when provable; am
    cannot 3-way a deletion or rename that upstream already made), else a conflict."""
    if landed(repo, patch.path, ref_sha):
        return PatchResult(patch.name, LANDED)
    unmerged = git.unmerged_paths(repo)
    if unmerged:  # a 3-way merge ran and left markers
        hunks = _conflict_regions(Path(repo.working_tree_dir), unmerged) + _failed_hunks(output)
        return PatchResult(patch.name, CONFLICT, unmerged, hunks)
    # No 3-way was possible (am's direct attempt is silent then): ask git apply which hunks fail.
    hunks = _failed_hunks(output + "\n" + git.apply_errors(repo, patch.path))
    return PatchResult(patch.name, CONFLICT, _named(git.patch_paths(repo, patch.path), hunks), hunks)


def _named(paths: list[str], hunks: list[str]) -> list[str]:
    """Those of ``paths`` a failed hunk names (``patch failed: PATH:LINE``, ``PATH: does not
    exist in index``): the files to resolve, not every file the patch touches (0006 on
    v0.29.0: ``mla.py`` alone, its ``mtp.py`` hunks apply). All of them if none is named."""
    named = [p for p in paths if any(f"{p}:" in line for line in hunks)]
    return named or paths


def _drop_empty_commits(repo: git.Repo, start: str,
                        committed: list[tuple[PatchResult, Patch, str]], ref_sha: str) -> None:
    """git am commits a patch that applies directly yet changes nothing (a ``chmod +x``
    the file already has): classify such a patch like an unchanged one and drop its commit.
    ``committed`` is (result, patch, the commit am made of it), oldest first."""
    trees = dict(git.commit_trees(repo, f"{start}..HEAD"))
    parent_tree, kept = git.tree_of(repo, start), []
    for result, patch, sha in committed:
        if trees[sha] == parent_tree:
            result.status = LANDED if landed(repo, patch.path, ref_sha) else REDUNDANT
        else:
            kept.append(sha)
        parent_tree = trees[sha]
    if len(kept) < len(committed):
        git.reparent(repo, start, kept)


def landed(repo: git.Repo, patch: Path, ref_sha: str) -> bool:
    """True if REF's tree provably already holds the patch's result: a trial application
    onto REF's tree, in a throwaway index, leaves every blob and mode as REF has them.

    Two trials, either is proof: a 3-way apply (upstream changed the lines
    around the patch too), and un-applying then re-applying (upstream deleted or
    renamed the file as the patch does, or the patch's base blobs are not in this
    repository). A check that the patch merely reverse-applies is no proof: a
    ``chmod +x`` patch reverse-applies to its own base.
    """
    want = git.tree_of(repo, ref_sha)
    with git.diff_of(patch) as diff:
        return (git.trial_tree(repo, ref_sha, ["--3way", str(diff)]) == want
                or git.trial_tree(repo, ref_sha, ["--reverse", str(diff)], [str(diff)]) == want)


def _conflict_regions(tree: Path, paths: list[str]) -> list[str]:
    """``path:first-last`` for each region a 3-way merge left between conflict markers."""
    regions = []
    for path in paths:
        data = read_regular(tree / path)  # a link git left there is not followed
        if data is not None:
            regions += conflict_regions(path, data)
    return regions


def conflict_regions(path: str, data: bytes) -> list[str]:
    """``path:first-last`` (1-based lines, markers included) for each conflict region in
    ``data``, the text of ``path`` as a 3-way merge left it."""
    regions, start = [], None
    for number, line in enumerate(data.decode(errors="replace").splitlines(), 1):
        if line.startswith("<<<<<<< "):
            start = number
        elif line.startswith(">>>>>>> ") and start is not None:
            regions.append(f"{path}:{start}-{number}")
            start = None
    return regions


def _failed_hunks(am_output: str) -> list[str]:
    """The lines where git names what did not apply ("patch failed: FILE:LINE", "CONFLICT …")."""
    keep = ("patch failed:", "CONFLICT", "does not exist in index", "does not match index",
            "invalid path")
    return list(dict.fromkeys(line.strip() for line in am_output.splitlines()
                              if any(k in line for k in keep)))  # am and apply may both say it
