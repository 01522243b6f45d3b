"""Git verbs, one small function each, run the same way whoever runs them.

Project agnostic: nothing here knows about vLLM, Kimi-K3 or this repo's
layout. Arguments are built as explicit lists. Every failure is turned into a
``GitError`` here, so a message a user sees is ours: one line naming the git
verb and git's own first line of complaint.

Every git process gets the same footing (``_environment``, ``GIT``): the
user's global and system config and ``GIT_*`` variables are shut out and the
settings the tool parses or records are pinned, so ``color.ui=always``, a DCO
hook or ``diff.noprefix`` cannot change a verdict or a sha. What a user needs
to *reach* a repository (credential helpers, proxies, ``url.*.insteadOf``,
``safe.directory``), their identity (their reflog lines stay theirs; the
tool's own commits carry a fixed one) and what they ignore (``core.excludesFile``:
a checkout their ``git status`` calls clean is clean here too) is carried over
from their config.

Processes are started here rather than through GitPython's ``execute``, which
can neither drop an inherited variable nor stop its child on Ctrl-C; GitPython
still opens repositories. Each git runs in a session of its own (no terminal:
nothing prompts; a private repository needs an ssh agent or a credential
helper). On an interrupt the child's whole process group is terminated and
waited for before the interrupt goes on, so no git keeps writing after the tool
has cleaned up; if the tool is killed outright, its watchdog (``reaper``) stops them.
"""

from __future__ import annotations

import contextlib
import fcntl
import functools
import hashlib
import os
import re
import shutil
import signal
import subprocess
import tempfile
from collections.abc import Iterator
from pathlib import Path

import git as gitpython
from git.exc import InvalidGitRepositoryError, NoSuchPathError

from . import journal, reaper
from .errors import OverlayError
from .files import read_regular
from .interrupts import deferred
from .lock import flock

Repo = gitpython.Repo

# Settings the tool relies on, whatever any config file says (``-c`` beats them all,
# the checkout's own .git/config included): what git prints is what we parse, what it
# commits is reproducible, and nothing of the user's runs inside the tool's git.
PINNED = {
    # the user's hooks, fsmonitor and signing never run (and would break reproducible shas)
    "core.hooksPath": "/dev/null", "core.fsmonitor": "false",
    "commit.gpgSign": "false", "tag.gpgSign": "false", "log.showSignature": "false",
    "protocol.ext.allow": "never", "submodule.recurse": "false",
    "fetch.recurseSubmodules": "false",
    # output we parse: no colour, plain a/ b/ prefixes, unquoted paths, English
    "color.ui": "never", "color.diff": "never", "color.status": "never", "color.branch": "never",
    "color.decorate": "never", "color.advice": "never", "color.remote": "never",
    "color.interactive": "never", "color.grep": "never", "color.showBranch": "never",
    "core.quotePath": "false", "diff.noprefix": "false", "diff.mnemonicPrefix": "false",
    "diff.srcPrefix": "a/", "diff.dstPrefix": "b/", "diff.relative": "false",
    "log.decorate": "false", "log.abbrevCommit": "false", "log.showRoot": "true",
    "advice.detachedHead": "false",
    # diffs and patch-ids comparable with upstream's: git's default algorithm and context
    "diff.algorithm": "myers", "diff.context": "3", "diff.interHunkContext": "0",
    "diff.indentHeuristic": "true", "diff.suppressBlankEmpty": "false",
    # patches applied exactly as written: whitespace, line ends, message, conflicts
    "apply.whitespace": "nowarn", "apply.ignoreWhitespace": "no",
    "core.whitespace": "blank-at-eol,blank-at-eof,space-before-tab",
    "core.autocrlf": "false", "core.safecrlf": "false", "core.eol": "lf",
    "am.messageId": "false", "am.keepcr": "false", "am.threeWay": "false",
    "mailinfo.scissors": "false", "merge.conflictStyle": "merge", "merge.renormalize": "false",
    "rerere.enabled": "false", "rerere.autoUpdate": "false",
    "commit.cleanup": "strip", "core.commentChar": "#",
    "i18n.commitEncoding": "UTF-8", "i18n.logOutputEncoding": "UTF-8",
    "user.useConfigOnly": "false", "init.defaultBranch": "main",
    # what is filtered is decided by the tree alone, not by the user's files (what is
    # ignored is the user's, as in their own `git status`: overlay files are staged by
    # exact path whatever ignores them, and an ignored file is never overwritten)
    "core.attributesFile": "/dev/null",
    # format-patch writes the same file for the same commit on every machine
    "format.signOff": "false", "format.coverLetter": "false", "format.numbered": "auto",
    "format.subjectPrefix": "PATCH", "format.suffix": ".patch", "format.useAutoBase": "false",
    "format.thread": "false", "format.forceInBodyFrom": "false",
    "format.encodeEmailHeaders": "true", "format.noprefix": "false", "format.notes": "false",
    "format.filenameMaxLength": "64",
    # nothing left running behind us in the user's checkout
    "gc.auto": "0", "gc.autoDetach": "false", "maintenance.auto": "false",
    # paths git itself refuses on other systems are refused here too
    "core.protectNTFS": "true", "core.protectHFS": "true",
}
GIT = ("git", *(arg for key, value in PINNED.items() for arg in ("-c", f"{key}={value}")))

# Carried over from the user's own (global/system) config: reaching a repository, who
# they are, and what they ignore. Canonical key names, as ``git config --get-regexp`` prints them.
_CARRIED = re.compile(r"^(user\.(name|email)|credential\..+|http\..+|url\..+\.(insteadof|pushinsteadof)"
                      r"|core\.(sshcommand|askpass|excludesfile)|safe\.directory)$")
# Inherited variables kept: identity (reflog lines in the user's checkout stay theirs)
# and transport (ssh, proxies, certificates). Every other GIT_* variable is dropped:
# GIT_DIR, GIT_INDEX_FILE, GIT_CONFIG_PARAMETERS, … would redirect or reconfigure us.
_KEPT_VARIABLES = re.compile(r"^GIT_((AUTHOR|COMMITTER)_(NAME|EMAIL)|SSH|SSH_COMMAND|SSH_VARIANT"
                             r"|ASKPASS|SSL_CAINFO|SSL_CAPATH|SSL_NO_VERIFY|PROXY_COMMAND"
                             r"|PROXY_SSL_.+|HTTP_.+|TERMINAL_PROMPT|EXEC_PATH)$")
_STOP_WAIT_S = 5  # a terminated git gets this long to remove its own half-made files


class GitError(OverlayError):
    """A git command failed; ``str()`` is one line (verb and git's reason)."""


def first_line(text: str) -> str:
    """The line of git's output that says what went wrong (``fatal:``/``error:`` first).

    A line ending in ``:`` followed by tab-indented paths (``error: The following untracked
    working tree files would be overwritten by checkout:``) gets those paths appended, so
    the one line still names them."""
    pairs = [(line, _unquote(line.strip().removeprefix("stderr: ")))
             for line in (text or "").splitlines()]
    pairs = [(line, clean) for line, clean in pairs if clean and not clean.startswith("hint:")]
    raw, lines = [line for line, _ in pairs], [clean for _, clean in pairs]
    chosen = next((i for i, line in enumerate(lines) if line.startswith(("fatal:", "error:"))), 0)
    if not lines:
        return "no message"
    listed = []
    for line in raw[chosen + 1:] if lines[chosen].endswith(":") else []:
        if not line.startswith("\t"):
            break
        listed.append(line.strip())
    return " ".join([lines[chosen], ", ".join(listed)]) if listed else lines[chosen]


def _unquote(line: str) -> str:
    """Drop the quote GitPython wraps stderr in, not the quotes inside git's message."""
    line = line.removeprefix("'") if line.startswith("'") and line.count("'") % 2 else line
    return line.strip()


def run(repo: Repo, *args: str, env: dict[str, str] | None = None) -> str:
    """Run ``git ARGS`` in ``repo``; return stdout. Raises GitError on failure."""
    status, out, err = _execute(args, cwd=_cwd(repo), env=env)
    if status != 0:
        raise GitError(f"git {args[0]} failed: {first_line(_text(err))}")
    return _text(out)


def attempt(repo: Repo, *args: str, env: dict[str, str] | None = None) -> tuple[bool, str]:
    """Run ``git ARGS``; return (succeeded, stdout + stderr). Raises only when git cannot start."""
    status, out, err = _execute(args, cwd=_cwd(repo), env=env)
    return status == 0, _text(out) + _text(err)


def _cwd(repo: Repo) -> str:
    return repo.working_tree_dir or repo.git_dir


def _text(data: bytes) -> str:
    # surrogateescape: a file name that is not UTF-8 goes back to git byte for byte
    return data.decode("utf-8", errors="surrogateescape")


def _execute(args: tuple[str, ...] | list[str], *, cwd: str | Path,
             env: dict[str, str] | None = None, stdin: bytes | None = None) -> tuple[int, bytes, bytes]:
    """Run git with the tool's pinned settings in ``cwd``; return (status, stdout, stderr).

    ``env`` adds variables (identity, dates, an index file) on top of the
    isolated environment. The child runs in its own process group, so a
    terminal's Ctrl-C reaches only us; on any interrupt we terminate that group,
    wait for it, and re-raise. Raises GitError if git cannot be started (no
    git, or ``cwd`` is gone: never silently run somewhere else).
    """
    with tempfile.TemporaryFile() as given:  # a file, not a pipe: git may stop reading early
        given.write(stdin or b"")
        given.seek(0)
        try:
            proc = subprocess.Popen(
                [*GIT, *args], cwd=cwd, env=_environment(env), start_new_session=True,
                stdin=given, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        except OSError as err:
            raise GitError(f"cannot run git {args[0]} in {cwd}: {err.strerror}") from err
        reaper.watch(proc.pid)  # if the tool is killed, its watchdog stops this group
        try:
            out, err = proc.communicate()
        except BaseException:
            _stop(proc)
            raise
        finally:
            reaper.forget(proc.pid)
    return proc.returncode, out, err


def _stop(proc: subprocess.Popen) -> None:
    """Terminate a git child and everything it started, and wait until they are gone."""
    with deferred(then_raise=False):  # a second Ctrl-C must not cut the wait short
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(_STOP_WAIT_S)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)  # a grandchild that outlived git itself


def _environment(extra: dict[str, str] | None) -> dict[str, str]:
    """The environment of every git child: the user's, less their git config and GIT_* state."""
    env = {k: v for k, v in os.environ.items()
           if not k.startswith("GIT_") or _KEPT_VARIABLES.match(k)}
    env.update(GIT_CONFIG_NOSYSTEM="1", GIT_CONFIG_GLOBAL=os.devnull, GIT_ATTR_NOSYSTEM="1",
               LC_ALL="C", LANGUAGE="C")
    env.setdefault("GIT_TERMINAL_PROMPT", "0")  # nobody is there to answer a prompt
    carried = _carried_config(*(os.environ.get(k, "") for k in (
        "HOME", "XDG_CONFIG_HOME", "GIT_CONFIG_GLOBAL", "GIT_CONFIG_SYSTEM", "GIT_CONFIG_NOSYSTEM")))
    env["GIT_CONFIG_COUNT"] = str(len(carried))  # not -c: a token in http.extraHeader stays off ps
    for i, (key, value) in enumerate(carried):
        env[f"GIT_CONFIG_KEY_{i}"], env[f"GIT_CONFIG_VALUE_{i}"] = key, value
    env.update(extra or {})
    return env


@functools.lru_cache(maxsize=8)
def _carried_config(*where: str) -> tuple[tuple[str, str], ...]:
    """(key, value) of the user's global and system config entries in ``_CARRIED``, in order.

    ``where`` is what locates those files (HOME, …), so a changed one is read afresh.
    """
    env = {k: v for k, v in os.environ.items() if k not in ("GIT_DIR", "GIT_CONFIG_PARAMETERS",
                                                            "GIT_CONFIG_COUNT")}
    entries = []
    for scope in ("--system", "--global"):  # system first: global wins, as in git
        try:
            proc = subprocess.run(["git", "config", scope, "--includes", "--null", "--get-regexp",
                                   "."], env={**env, "LC_ALL": "C"}, cwd=os.path.abspath(os.sep),
                                  stdin=subprocess.DEVNULL, capture_output=True, timeout=30)
        except (OSError, subprocess.TimeoutExpired):
            continue
        for record in _text(proc.stdout).split("\0"):
            key, _, value = record.partition("\n")
            if _CARRIED.match(key):
                entries.append((key, value))
    return tuple(entries)


def open_repo(path: Path) -> Repo:
    """Open the repository whose work tree is ``path``. Raises GitError if it is none."""
    try:
        repo = Repo(path)
    except (InvalidGitRepositoryError, NoSuchPathError) as err:
        raise GitError(f"{path} is not a git repository") from err
    if repo.bare or Path(repo.working_tree_dir).resolve() != path.resolve():
        raise GitError(f"{path} is not the top of a git work tree")
    return repo


def init_bare(path: Path) -> Repo:
    """Open the bare repository at ``path``, creating it if missing."""
    if not (path / "HEAD").exists():
        path.mkdir(parents=True, exist_ok=True)
        status, _, err = _execute(["init", "--quiet", "--bare", "--", str(path)], cwd=path)
        if status != 0:
            raise GitError(f"git init failed: {first_line(_text(err))}")
    return Repo(path)


def clone(source: str, dest: Path) -> Repo:
    """Clone ``source`` (a URL or a path) into ``dest``. Raises GitError on failure."""
    status, _, err = _execute(["clone", "--quiet", "--", source, str(dest)], cwd=dest.parent)
    if status != 0:
        raise GitError(f"git clone {source} failed: {first_line(_text(err))}")
    return Repo(dest)


def resolve(repo: Repo, ref: str) -> str | None:
    """The commit sha ``ref`` names in ``repo``, or None if it names no commit."""
    ok, out = attempt(repo, "rev-parse", "--verify", "--quiet", f"{ref}^{{commit}}")
    return out.strip() if ok else None


def tags(repo: Repo) -> list[str]:
    """Every tag name in ``repo``."""
    return [t.name for t in repo.tags]


def tag(repo: Repo, name: str, sha: str) -> None:
    """Create lightweight tag ``name`` at ``sha``."""
    run(repo, "tag", name, sha)


def is_branch_name(name: str) -> bool:
    """True if git takes ``name`` as a new branch's name (``git check-ref-format --branch``,
    run outside any repository, so ``@{-1}`` and the like expand to nothing)."""
    with tempfile.TemporaryDirectory(prefix="k3-refname-") as tmp:
        return _execute(["check-ref-format", "--branch", name], cwd=tmp)[0] == 0


def current_branch(repo: Repo) -> str | None:
    """The checked-out branch's short name, or None when HEAD is detached or unborn."""
    ok, out = attempt(repo, "symbolic-ref", "--quiet", "--short", "HEAD")
    return out.strip() if ok else None


def branch_tip(repo: Repo, name: str) -> str | None:
    """The sha branch ``name`` points at, or None if there is no such branch."""
    return resolve(repo, f"refs/heads/{name}")


def operation_in_progress(repo: Repo) -> str | None:
    """Name of an unfinished am/rebase/merge/cherry-pick/revert/bisect in ``repo``, or None."""
    markers = {
        "rebase-apply/applying": "git am",
        "rebase-apply": "git rebase",
        "rebase-merge": "git rebase",
        "MERGE_HEAD": "git merge",
        "CHERRY_PICK_HEAD": "git cherry-pick",
        "REVERT_HEAD": "git revert",
        "BISECT_LOG": "git bisect",
        "sequencer": "git cherry-pick/revert sequence",
    }
    for marker, name in markers.items():
        path = run(repo, "rev-parse", "--git-path", marker).strip()
        if (Path(repo.working_tree_dir) / path).exists():
            return name
    return None


def untracked_in_the_way(repo: Repo, paths: list[str]) -> list[str]:
    """Those of ``paths`` where something git does not track sits in the work tree (a file,
    link or folder; with a clean status, one git ignores): what a checkout, ``git am
    --3way`` or laying a file there would destroy."""
    top = Path(repo.working_tree_dir)
    present = [path for path in paths if os.path.lexists(top / path)]
    tracked = set(_z(run(repo, "ls-files", "-z", "--", *literal(present)))) if present else set()
    return [path for path in present
            if path not in tracked and not any(t.startswith(path + "/") for t in tracked)]


def is_dirty(repo: Repo) -> bool:
    """True if ``repo`` has staged, unstaged or untracked (not ignored) changes."""
    return bool(run(repo, "status", "--porcelain", "--untracked-files=normal").strip())


_WORKTREE_PREFIX = "k3-worktree-"


@contextlib.contextmanager
def temporary_worktree(repo: Repo, sha: str) -> Iterator[Repo]:
    """A detached linked worktree of ``repo`` at ``sha``, removed on exit.

    The worktree lives in a fresh temporary folder holding ``owner.lock``, which
    this process keeps locked while the worktree exists: a leftover of a run that
    was killed (lock free) is removed first, one of a run still working (lock
    held) is left alone. Only our own entries are ever removed: never ``git
    worktree prune``, which would also drop a user's entries for moved folders.
    Removal is not cut short by Ctrl-C (it is finished, then the interrupt goes on).
    """
    _remove_stale_worktrees(repo)
    parent = Path(tempfile.mkdtemp(prefix=_WORKTREE_PREFIX))
    owner = os.open(parent / "owner.lock", os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
    try:
        flock(owner, parent / "owner.lock", fcntl.LOCK_EX, moved_by="TMPDIR")
        with journal.step("worktree", repo=_cwd(repo), parent=str(parent)):  # for a killed run's
            try:
                run(repo, "worktree", "add", "--quiet", "--detach", str(parent / "tree"), sha)
                journal.point("worktree.added")
                yield Repo(parent / "tree")
            finally:
                with deferred():
                    _remove_worktree(repo, parent)
    finally:
        with deferred():
            if parent.exists():  # the journal could not be written
                _remove_worktree(repo, parent)
            os.close(owner)


def _remove_stale_worktrees(repo: Repo) -> None:
    """Remove our temporary worktrees of ``repo`` whose owning process is gone."""
    admin = Path(run(repo, "rev-parse", "--path-format=absolute", "--git-common-dir").strip())
    for gitdir_file in sorted(admin.glob("worktrees/*/gitdir")):
        with contextlib.suppress(OSError):
            tree = _tree_of(gitdir_file)
            parent = tree.parent
            if tree.name != "tree" or not parent.name.startswith(_WORKTREE_PREFIX):
                continue  # not ours
            with _owner_gone(parent) as gone:
                if gone:
                    with deferred():
                        _remove_worktree(repo, parent)


def _tree_of(gitdir_file: Path) -> Path:
    """The linked worktree a ``worktrees/NAME/gitdir`` file names; ``Path()`` if it is not a
    regular file (a link is not followed, a FIFO not waited on)."""
    data = read_regular(gitdir_file)
    return Path(os.fsdecode(data.strip())).parent if data else Path()


@contextlib.contextmanager
def _owner_gone(parent: Path) -> Iterator[bool]:
    """True (and the owner lock, held for the block) if no live process owns ``parent``.

    A folder without ``owner.lock`` was never ours (a run makes the lock before the worktree):
    a user's own worktree at ``…/k3-worktree-x/tree`` is left alone, files and all."""
    try:
        fd = os.open(parent / "owner.lock", os.O_RDWR | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except FileNotFoundError:
        yield not os.path.lexists(parent)  # folder gone (a cleaned /tmp): only git's entry is left
        return
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            yield False
            return
        yield True
    finally:
        os.close(fd)


def _remove_worktree(repo: Repo, parent: Path) -> None:
    """Remove our worktree at ``parent/tree``: git's entry for it, and the folder.

    If ``git worktree remove`` cannot (the folder is half made or already gone),
    the entry is deleted from ``$GIT_COMMON_DIR/worktrees`` by hand, ours only.
    """
    tree = parent / "tree"
    attempt(repo, "worktree", "remove", "--force", "--force", str(tree))
    ok, admin = attempt(repo, "rev-parse", "--path-format=absolute", "--git-common-dir")
    if ok:
        for gitdir_file in Path(admin.strip()).glob("worktrees/*/gitdir"):
            with contextlib.suppress(OSError):
                if _tree_of(gitdir_file) == tree:
                    shutil.rmtree(gitdir_file.parent)
    shutil.rmtree(parent, ignore_errors=True)


def am(repo: Repo, patches: list[Path], *, env: dict[str, str]) -> tuple[bool, str, str]:
    """``git am --3way`` mailbox patches in order, one commit each; committer date = author date.

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
        headers = dict(line.split(": ", 1) for line in out.decode(errors="replace").splitlines()
                       if ": " in line)
        text = message.read_bytes().decode(errors="replace") if message.exists() else ""
        return headers, text, diff.exists() and diff.stat().st_size > 0


def patch_paths(repo: Repo, patch: Path) -> list[str]:
    """The paths ``patch`` leaves changed (a rename: its new name), from ``git apply --numstat -z``."""
    listing = run(repo, "apply", "--numstat", "-z", str(patch))
    return [entry.split("\t", 2)[2] for entry in listing.split("\0") if entry]


def apply_errors(repo: Repo, patch: Path) -> str:
    """What ``git apply --check`` says against the work tree: empty when ``patch`` applies,
    else git's reasons (``error: patch failed: PATH:LINE`` ...)."""
    return attempt(repo, "apply", "--check", str(patch))[1]


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


def tree_of(repo: Repo, rev: str) -> str:
    """The tree sha of commit ``rev``."""
    return run(repo, "rev-parse", f"{rev}^{{tree}}").strip()


def commit_trees(repo: Repo, rev_range: str) -> list[tuple[str, str]]:
    """(commit sha, tree sha) of each commit in ``rev_range``, oldest first."""
    out = run(repo, "log", "-z", "--reverse", "--topo-order", "--format=%H %T", rev_range)
    return [tuple(entry.split(" ")) for entry in out.split("\0") if entry]


def reparent(repo: Repo, onto: str, commits: list[str]) -> str:
    """Copy ``commits`` (a linear chain, oldest first) onto ``onto`` and move HEAD (and its
    branch) to the copy; return the new tip.

    Each copy keeps its tree, message, author and committer byte for byte, so it
    is the commit ``git am`` would have made on that parent. The index and work
    tree are left as they are: the new tip has the old tip's tree.
    """
    tip = onto
    for sha in commits:
        header, _, message = _execute(["cat-file", "commit", sha], cwd=_cwd(repo))[1].partition(b"\n\n")
        lines = [line for line in header.split(b"\n") if not line.startswith(b"parent ")]
        lines.insert(1, b"parent " + tip.encode())
        commit = b"\n".join(lines) + b"\n\n" + message
        tip = _text(_execute(["hash-object", "-t", "commit", "-w", "--stdin"], cwd=_cwd(repo),
                             stdin=commit)[1]).strip()
    run(repo, "reset", "--soft", tip)
    return tip


def unmerged_paths(repo: Repo) -> list[str]:
    """Paths left with conflict markers by a merge or 3-way am."""
    return sorted(set(_z(run(repo, "diff", "--name-only", "-z", "--diff-filter=U"))))


def stage_exact(repo: Repo, files: dict[str, tuple[bytes, bool]]) -> None:
    """Stage each ``path: (bytes, executable)`` exactly: those bytes, mode 100755 or 100644.

    Written as blobs without filters and put in the index by hand, so no ignore
    rule (``.gitignore``, ``info/exclude``, ``core.excludesFile``), attribute
    (eol, ``ident``, a filter) or ``core.fileMode`` can leave a file out or change it.
    """
    for path, (data, executable) in files.items():
        blob = write_blob(repo, data)
        run(repo, "update-index", "--add", "--cacheinfo",
            f"{'100755' if executable else '100644'},{blob},{path}")


def write_blob(repo: Repo, data: bytes) -> str:
    """Write ``data`` into ``repo``'s object store as a blob, byte for byte (no filters);
    return its id. To only compute an id, without writing: ``blob_id``."""
    status, out, err = _execute(["hash-object", "-w", "--no-filters", "--stdin"], cwd=_cwd(repo),
                                stdin=data)
    if status != 0:
        raise GitError(f"git hash-object failed: {first_line(_text(err))}")
    return _text(out).strip()


def tree_entries(repo: Repo, ref: str, paths: list[str]) -> dict[str, tuple[str, str]]:
    """``path: (mode, sha)`` at commit ``ref`` for each of ``paths`` that exists there.

    Modes as git writes them: 100644/100755 file, 120000 link, 040000 folder,
    160000 submodule. A path below something that is not a folder is absent.
    """
    return _ls_tree(repo, ref, "--", *paths) if paths else {}


def _ls_tree(repo: Repo, *args: str) -> dict[str, tuple[str, str]]:
    """``path: (mode, sha)`` of each entry ``git ls-tree ARGS`` lists."""
    entries = {}
    for record in run(repo, "ls-tree", "-z", "--full-tree", *args).split("\0"):
        meta, tab, path = record.partition("\t")
        if tab:
            mode, _, sha = meta.split(" ")
            entries[path] = (mode, sha)
    return entries


def object_type(repo: Repo, ref: str) -> str | None:
    """What ``ref`` names: ``commit``, ``tree``, ``blob`` or ``tag``; None if nothing."""
    ok, sha = attempt(repo, "rev-parse", "--verify", "--quiet", "--end-of-options", ref)
    ok, out = attempt(repo, "cat-file", "-t", sha.strip()) if ok else (False, "")
    return out.strip() if ok else None


def reachable_from_refs(repo: Repo, sha: str) -> bool:
    """True if some branch, tag or other ref (not HEAD, not a reflog) holds commit ``sha``."""
    return bool(run(repo, "for-each-ref", "--count=1", "--format=%(refname)", f"--contains={sha}")
                .strip())


def staged_changes(repo: Repo) -> bool:
    """True if the index differs from HEAD."""
    return not attempt(repo, "diff", "--cached", "--quiet")[0]


def blob_at(repo: Repo, ref: str, path: str) -> str | None:
    """The blob sha of ``path`` at ``ref``, or None if ``ref`` has no such file."""
    ok, out = attempt(repo, "rev-parse", "--verify", "--quiet", f"{ref}:{path}")
    return out.strip() if ok else None


def read_blob(repo: Repo, sha: str) -> bytes:
    """The bytes of blob ``sha``. Raises GitError if ``repo`` lacks it."""
    status, out, _ = _execute(["cat-file", "blob", sha], cwd=_cwd(repo))
    if status != 0:
        raise GitError(f"blob {sha[:8]} is not in {repo.git_dir}")
    return out


def tree_files(repo: Repo, sha: str, folder: str) -> dict[str, str]:
    """``{path: blob sha}`` of every regular file under ``folder`` at commit ``sha``
    (links and submodules left out)."""
    return {path: blob for path, (mode, blob) in _ls_tree(repo, "-r", sha, "--", folder).items()
            if mode in ("100644", "100755")}


def blob_id(data: bytes, *, width: int = 40) -> str:
    """The blob id git gives ``data`` (``width`` 40: SHA-1 repositories, 64: SHA-256 ones),
    computed here; nothing is written (that is ``write_blob``)."""
    digest = hashlib.sha1 if width == 40 else hashlib.sha256
    return digest(b"blob %d\0" % len(data) + data).hexdigest()


def commit_time(repo: Repo, sha: str) -> int:
    """Committer date of commit ``sha``, seconds since the epoch."""
    return int(run(repo, "show", "-s", "--format=%ct", sha).strip())


def archive(repo: Repo, sha: str, dest: Path) -> None:
    """Write commit ``sha``'s tree as a tar file ``dest`` (``git archive``)."""
    run(repo, "archive", "--format=tar", "-o", str(dest), sha)


def read_files(repo: Repo, rev: str, paths: list[str]) -> dict[str, bytes]:
    """The bytes at commit ``rev`` of each of ``paths`` that is a file there (one ``git
    cat-file --batch``); a path missing at ``rev`` (or holding a newline) is left out."""
    paths = [path for path in paths if "\n" not in path]
    query = "".join(f"{rev}:{path}\n" for path in paths).encode()
    out = _execute(["cat-file", "--batch"], cwd=_cwd(repo), stdin=query)[1]
    files, pos = {}, 0
    for path in paths:  # "<sha> <type> <size>\n<bytes>\n", or "<query> missing\n"
        end = out.index(b"\n", pos)
        header, pos = out[pos:end].split(b" "), end + 1
        if header[-1] != b"missing":
            size = int(header[2])
            if header[1] == b"blob":
                files[path] = out[pos:pos + size]
            pos += size + 1
    return files


def commit_paths(repo: Repo, sha: str) -> set[str]:
    """Paths commit ``sha`` changes against its first parent."""
    return set(_z(run(repo, "diff-tree", "-z", "--no-commit-id", "--name-only", "-r", "--root",
                      "--no-renames", sha)))


def changed_paths(repo: Repo, old: str, new: str) -> list[str]:
    """Paths that differ between commits ``old`` and ``new`` (a rename: both names)."""
    return sorted(_z(run(repo, "diff", "--name-only", "-z", "--no-renames", old, new)))


def _z(listing: str) -> list[str]:
    """The paths of a ``-z`` listing: NUL-terminated, never quoted (spaces, non-ASCII kept)."""
    return [path for path in listing.split("\0") if path]


def literal(paths: list[str]) -> list[str]:
    """Pathspecs that match exactly these paths (a ``*`` or ``[`` in a name is no pattern)."""
    return [f":(literal){path}" for path in paths]


def diff(repo: Repo, old: str, new: str, path: str) -> str:
    """Unified diff of ``path`` between commits ``old`` and ``new``."""
    return run(repo, "diff", "--no-color", "--no-ext-diff", "--no-textconv", "--no-renames",
               old, new, "--", *literal([path]))


def commit_staged(repo: Repo, message: str, *, env: dict[str, str]) -> str:
    """Commit what is staged; return HEAD's sha after.

    Nothing to commit is not an error: HEAD stays where it was.
    """
    if staged_changes(repo):
        run(repo, "commit", "--quiet", "-m", message, env=env)  # no hooks: core.hooksPath pinned
    return run(repo, "rev-parse", "HEAD").strip()


def merge_file(ours: Path, base: Path, theirs: Path) -> tuple[bool, bytes]:
    """3-way merge of three files with ``git merge-file``; return (clean, merged bytes)."""
    status, out, _ = _execute(["merge-file", "-p", "-L", "ours", "-L", "base", "-L", "theirs",
                               str(ours), str(base), str(theirs)], cwd=base.parent)
    if status < 0:
        raise GitError(f"git merge-file failed on {ours}")
    return status == 0, out


def set_branch(repo: Repo, name: str, sha: str) -> None:
    """Point branch ``name`` at ``sha`` and check it out (the work tree must be clean).

    An ignored file where ``sha`` has a file is never overwritten (git's default would):
    GitError naming it, and nothing changes."""
    run(repo, "checkout", "--quiet", "--no-overwrite-ignore", "-B", name, sha)


def config_get(repo: Repo, key: str) -> str | None:
    """A local config value, or None."""
    ok, out = attempt(repo, "config", "--local", "--get", key)
    return out.strip() if ok else None


def config_set(repo: Repo, key: str, value: str) -> None:
    """Set a local config value."""
    run(repo, "config", "--local", key, value)


def log_subjects(repo: Repo, rev_range: str) -> list[tuple[str, str]]:
    """(sha, subject) of each commit in ``rev_range``, oldest first."""
    out = run(repo, "log", "-z", "--reverse", "--topo-order", "--format=%H %s", rev_range)
    return [tuple(entry.split(" ", 1)) for entry in out.split("\0") if entry]


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
        text = patch.read_bytes()
    else:
        status, text, _ = _execute(["log", "--no-merges", "--no-color", "-p", "--full-diff",
                                    rev_range, "--", *literal(paths or [])], cwd=_cwd(repo))
        if status != 0:
            return {}
    out = _text(_execute(["patch-id", "--stable"], cwd=_cwd(repo), stdin=text)[1])
    return {pid: commit for pid, commit in (line.split() for line in out.splitlines())}


def is_ancestor(repo: Repo, old: str, new: str) -> bool:
    """True if commit ``old`` is in ``new``'s history."""
    return _execute(["merge-base", "--is-ancestor", old, new], cwd=_cwd(repo))[0] == 0


def environ(**extra: str) -> dict[str, str]:
    """Variables for one git call (identity, dates), set on top of the tool's own
    environment for git (see ``_environment``); not a whole environment."""
    return dict(extra)


def snapshot(repo: Repo, directory: Path, message: str, *, env: dict[str, str]) -> str:
    """Commit the whole content of ``directory`` as one new root commit; return its sha.

    Works on a bare ``repo`` through a throwaway index; no branch is moved.
    ``env`` carries the identity and dates, so equal input gives an equal sha.
    """
    with tempfile.TemporaryDirectory(prefix="k3-index-") as tmp:
        env = {**env, "GIT_INDEX_FILE": str(Path(tmp) / "index"), "GIT_WORK_TREE": str(directory)}
        run(repo, "add", "--all", "--force", ".", env=env)
        tree = run(repo, "write-tree", env=env).strip()
        return run(repo, "commit-tree", tree, "-m", message, env=env).strip()


