"""Patches: ``git am``, ``git mailinfo``, ``git apply`` trials, ``format-patch``, ``range-diff``."""

from __future__ import annotations

import contextlib
import functools
import tempfile
from collections.abc import Iterator
from pathlib import Path

from .gitproc import GitError, Repo, _cwd, _execute, _text, attempt, first_line, literal, run


def am(repo: Repo, patches: list[Path], *, env: dict[str, str]) -> tuple[bool, str, str]:
    """``git am --3way`` mailbox patches in order, one commit per mail; committer date = author date.

    Subjects are kept as ``git mailinfo -b`` reads them (``--keep-non-patch``: a
    ``[PATCH ...]`` prefix goes, ``[Kernel]`` stays). Returns (every patch
    applied, stdout, stderr); git's messages are in English (C locale), one
    ``Applying: SUBJECT`` line per patch tried. On failure the am is left in
    progress at the failed patch for the caller to inspect, then ``am_skip``
    (go on with the rest) or leave to a maintainer.
    """
    return _am(repo, ["--3way", "--keep-cr", "--keep-non-patch", "--committer-date-is-author-date",
                      *map(str, patches)], env)


def am_skip(repo: Repo, *, env: dict[str, str]) -> tuple[bool, str, str]:
    """Drop the failed patch of an in-progress ``git am`` and go on with the rest (as ``am``)."""
    return _am(repo, ["--skip"], env)


def am_abort(repo: Repo) -> None:
    """End an in-progress ``git am``, HEAD and work tree back where it started (nothing if none)."""
    _execute(["am", "--abort"], cwd=_cwd(repo))


def mail_starts(patch: Path) -> list[int]:
    """The line (1-based) where each mail of mailbox ``patch`` begins, as ``git am`` splits it
    (``git mailsplit -b --keep-cr``: a body line like ``From <sha> Mon Sep 17 00:00:00 2001``
    starts a mail of its own). Raises GitError if mailsplit fails."""
    with tempfile.TemporaryDirectory(prefix="k3-mailsplit-") as tmp:
        status, out, err = _execute(["mailsplit", "-b", "--keep-cr", f"-o{tmp}", "--", str(patch)],
                                    cwd=tmp)
        if status != 0:
            raise GitError(f"git mailsplit failed on {patch.name}: {first_line(_text(err))}")
        starts, line = [], 1
        for piece in sorted(Path(tmp).iterdir()):
            starts.append(line)
            line += piece.read_bytes().count(b"\n")
        return starts


def _am(repo: Repo, args: list[str], env: dict[str, str]) -> tuple[bool, str, str]:
    # Our caller reads am's progress lines: _environment keeps them untranslated (C locale).
    status, out, err = _execute(["am", *args], cwd=_cwd(repo), env=env)
    return status == 0, _text(out), _text(err)


def mailinfo(patch: Path) -> tuple[dict[str, str], str, bool]:
    """What ``git am --keep-non-patch`` reads from one mailbox patch, read by ``git mailinfo -b``.

    Returns the headers (``Author``, ``Email``, ``Subject``, ``Date``; UTF-8),
    the commit message after the subject line (cut where git cuts it: at a
    ``---`` line, a ``diff -`` line, ...), and whether a diff follows.
    """
    mail = patch.read_bytes()
    with tempfile.TemporaryDirectory(prefix="k3-mailinfo-") as tmp:
        message, diff = Path(tmp) / "msg", Path(tmp) / "patch"
        # Exit 1 for a mail without a diff ("empty patch"): the empty diff file says so.
        _, out, _ = _execute(["mailinfo", "-b", str(message), str(diff)], cwd=tmp, stdin=mail)
        # decoded as git am's own output is (``_text``): a subject compares equal to its
        # "Applying:" line even when it is not UTF-8 (the reader refuses that, naming it)
        headers = dict(line.split(": ", 1) for line in _text(out).splitlines() if ": " in line)
        text = message.read_bytes().decode(errors="replace") if message.exists() else ""
        return headers, text, diff.exists() and diff.stat().st_size > 0


@contextlib.contextmanager
def diff_of(patch: Path) -> Iterator[Path]:
    """A file holding the diff ``git am`` applies of mailbox ``patch`` (``git mailinfo``: a
    base64 or quoted-printable body decoded, as am decodes it), for the block: git apply,
    patch-id and their trials read no diff in an encoded body, and called a patch that
    applies unreadable (or never landed)."""
    with tempfile.TemporaryDirectory(prefix="k3-diff-") as tmp:
        diff = Path(tmp) / "diff"
        diff.write_bytes(_decoded(patch.read_bytes()))
        yield diff


@functools.lru_cache(maxsize=512)
def _decoded(mail: bytes) -> bytes:
    """The diff of the mail ``mail``, decoded once per content (a run reads each patch's diff
    for its paths, its trials and its patch id: one ``git mailinfo`` each, before). Read in
    an empty folder no repository holds."""
    with tempfile.TemporaryDirectory(prefix="k3-diff-") as tmp:
        diff = Path(tmp) / "diff"
        _execute(["mailinfo", "-b", str(Path(tmp) / "msg"), str(diff)], cwd=tmp,
                 env={"GIT_CEILING_DIRECTORIES": str(Path(tmp).parent)}, stdin=mail)
        return diff.read_bytes() if diff.exists() else b""


def patch_paths(repo: Repo, patch: Path) -> list[str]:
    """The paths ``patch`` leaves changed (a rename: its new name), from ``git apply --numstat -z``."""
    with diff_of(patch) as diff:
        listing = run(repo, "apply", "--numstat", "-z", str(diff))
    return [entry.split("\t", 2)[2] for entry in listing.split("\0") if entry]


def paths_touched(patch: Path) -> set[str]:
    """Every path mailbox ``patch`` changes, read before any repository is at hand: the names
    its diff (``diff_of``) leaves (``git apply --numstat``) and those it takes from (the same
    of the diff reversed: a rename's or copy's source, a deleted file). Run in an empty
    folder no repository holds (in one, git apply reads only the paths below the current
    folder). GitError if git cannot read it."""
    paths: set[str] = set()
    with diff_of(patch) as diff:
        env = {"GIT_CEILING_DIRECTORIES": str(diff.parent.parent)}
        for reverse in ([], ["-R"]):
            status, out, err = _execute(["apply", "--numstat", "-z", *reverse, str(diff)],
                                        cwd=diff.parent, env=env)
            if status != 0:
                raise GitError(f"git apply cannot read {patch.name}: {first_line(_text(err))}")
            paths |= {entry.split("\t", 2)[2] for entry in _text(out).split("\0") if entry.count("\t") >= 2}
    return paths


def links_made(patch: Path) -> set[str]:
    """The paths mailbox ``patch`` makes symbolic links (``create mode 120000`` in ``git apply
    --summary``), read as ``paths_touched`` reads its paths. GitError if git cannot read it."""
    with diff_of(patch) as diff:
        status, out, err = _execute(["apply", "--summary", str(diff)], cwd=diff.parent,
                                    env={"GIT_CEILING_DIRECTORIES": str(diff.parent.parent)})
    if status != 0:
        raise GitError(f"git apply cannot read {patch.name}: {first_line(_text(err))}")
    made = (line.strip().partition(" 120000 ")[2] for line in _text(out).splitlines()
            if line.strip().startswith("create mode 120000 "))
    return {_unquoted(name) for name in made if name}


def _unquoted(name: str) -> str:
    """A path as git prints it: C-quoted (``"a\\tb"``, octal bytes) where core.quotePath wants it."""
    if not (len(name) > 1 and name.startswith('"') and name.endswith('"')):
        return name
    raw = name[1:-1].encode("latin-1", "backslashreplace").decode("unicode_escape")
    return raw.encode("latin-1", "surrogateescape").decode("utf-8", "surrogateescape")


def apply_errors(repo: Repo, patch: Path) -> str:
    """What ``git apply --check`` says against the work tree: empty when ``patch`` applies,
    else git's reasons (``error: patch failed: PATH:LINE`` ...)."""
    with diff_of(patch) as diff:
        return attempt(repo, "apply", "--check", str(diff))[1]


def trial_tree(repo: Repo, tree_ish: str, *steps: list[str]) -> str | None:
    """The tree ``git apply --cached STEP`` leaves, one step after another, starting from
    ``tree_ish``, in a throwaway index (work tree, index and refs untouched); None if a step fails."""
    with tempfile.TemporaryDirectory(prefix="k3-trial-") as tmp:
        env = {"GIT_INDEX_FILE": str(Path(tmp) / "index")}
        run(repo, "read-tree", tree_ish, env=env)
        for step in steps:
            if not attempt(repo, "apply", "--cached", *step, env=env)[0]:
                return None
        return run(repo, "write-tree", env=env).strip()


def format_patch(repo: Repo, sha: str, outdir: Path, number: int = 1) -> Path:
    """Write commit ``sha`` as one mailbox patch, file name prefixed ``NNNN-``.

    Headers that would churn on every export are fixed: the From line's
    commit id is zeroed and no git version signature is added; the Date is
    the commit's author date, which ``git am`` preserves.
    """
    out = run(repo, "format-patch", "-1", "--zero-commit", "--no-signature", "--full-index",
              "--no-attach", "--no-thread", "--no-to", "--no-cc", "--no-add-header", "--no-from",
              "--no-notes",
              f"--start-number={number}", "-o", str(outdir), sha)
    return Path(out.strip().splitlines()[-1])


def range_diff(repo: Repo, old: str, new: str) -> str:
    """``git range-diff`` of two commit ranges (``A..B`` strings)."""
    return run(repo, "range-diff", "--no-color", old, new)


def patch_ids(repo: Repo, *, patch: Path | None = None, rev_range: str = "",
              paths: list[str] | None = None) -> dict[str, str]:
    """``{patch-id: commit}`` by ``git patch-id --stable`` (whitespace and line numbers
    ignored): of one mailbox ``patch`` file (commit all zeros), or of each non-merge
    commit in ``rev_range`` that touches ``paths`` (its whole diff counts, as for
    ``git cherry``). Empty when ``rev_range`` does not resolve."""
    if patch is not None:
        with diff_of(patch) as diff:
            text = diff.read_bytes()
    else:
        status, text, _ = _execute(["log", "--no-merges", "--no-color", "-p", "--full-diff",
                                    rev_range, "--", *literal(paths or [])], cwd=_cwd(repo))
        if status != 0:
            return {}
    out = _text(_execute(["patch-id", "--stable"], cwd=_cwd(repo), stdin=text)[1])
    return {pid: commit for pid, commit in (line.split() for line in out.splitlines())}
