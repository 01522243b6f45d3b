"""Getting a vLLM checkout that holds a given ref.

The source is a git repository (URL or path: ``--vllm-repo`` or
``$VLLM_REPO``) or, when none is given, the local release mirror built from
vLLM's published sdists (see ``mirror``).
"""

from __future__ import annotations

import errno
import os
import re
import shutil
import stat
import tempfile
import urllib.parse
from collections.abc import Callable
from pathlib import Path

from . import git, journal, pipconfig, redact
from .downloads import ReleaseFiles
from .errors import SourceError, UsageError
from .interrupts import deferred
from .mirror import MIRROR_NAME, ReleaseMirror, release_of
from .progress import step
from .project import cache_dir
from .publish import TIP_KEY
from .releases import Resolved, unknown_ref_hint, upstream_release

# A file in a fresh clone's git folder holding the run's token (``clone``'s ``mark``): what tells
# the run's own clone from a repository the user made at that path after a kill (``recovery.fresh``).
FRESH_MARK = "k3overlay-fresh"
_FULL_SHA = re.compile(r"^[0-9a-f]{40}(?:[0-9a-f]{24})?$")  # SHA-1 or SHA-256
_HEX = re.compile(r"[0-9a-f]{4,64}")
_ANCESTRY = re.compile(r"(?:~[0-9]*|\^[0-9]*|\^\{(?:commit)?\})*")
_PSEUDO_REF = re.compile(r"[A-Z_]*HEAD|AUTO_MERGE")
# What git says when the remote answered but has no such ref (bad input, not a network fault).
_NOT_FOUND = ("couldn't find remote ref", "not our ref", "no such ref", "invalid refspec",
              "does not appear to be a git repository", "does not exist", "not allowed")


def check_ref(ref: str, what: str = "ref") -> None:
    """Refuse a ref that does not name exactly one commit of the source (UsageError, one line).

    Taken: a tag, a branch (``main``, ``refs/heads/main``), ``HEAD``, a commit sha (full or
    abbreviated), each optionally followed by ancestry steps (``~N``, ``^N``, ``^{commit}``).
    Refused, each with its reason: empty; a leading ``-`` (git would read an option);
    whitespace or control characters; a negative ref (``^v1.0.0``); a forced refspec
    (``+a``); ranges (``a..b``, ``a...b``, ``a^@``, ``a^!``, ``a^-``); ``@{…}`` (reflog,
    upstream, push, ``@{-1}``: this machine's history, not the source's); ``:`` (a refspec
    ``a:b``, a path ``rev:path``, a message search ``:/text``); wildcards (``*``, ``?``,
    ``[``); a peel to anything but a commit (``rev^{tree}``, ``rev^{/text}``); a
    pseudo-ref of this machine (``FETCH_HEAD``, ``ORIG_HEAD``, …); any name
    ``git check-ref-format`` refuses.
    """
    reason = _ref_refusal(ref)
    if reason:
        raise UsageError(f"bad {what} {ref!r}: {reason}; give a tag, branch or commit sha "
                         f"(optionally followed by ~N or ^N)")


def split_ref(ref: str) -> tuple[str, str]:
    """(name, ancestry suffix) of a ref ``check_ref`` takes: ``v1.0.0~2`` -> (``v1.0.0``, ``~2``)."""
    cut = min([i for i in (ref.find("~"), ref.find("^")) if i >= 0], default=len(ref))
    return ref[:cut], ref[cut:]


def _ref_refusal(ref: str) -> str | None:
    """Why ``ref`` names no single commit of the source, or None when it may."""
    if not ref:
        return "it is empty"
    if ref.startswith("-"):
        return "git would read it as an option"
    if not ref.isprintable() or any(c.isspace() for c in ref):
        return "it holds whitespace or a control character"
    if ref.startswith("^"):
        return "a negative ref (^REF) excludes commits, it names none"
    if ref.startswith("+"):
        return "'+' makes a forced refspec"
    if ".." in ref or any(form in ref for form in ("^@", "^!", "^-")):
        return "a range names many commits"
    if "@{" in ref:
        return "@{...} (reflog, upstream, push, @{-N}) reads this machine's history, not the source's"
    if ":" in ref:
        return "':' makes a refspec (A:B), a path (REV:PATH) or a message search (:/TEXT)"
    if any(c in ref for c in "*?[\\"):
        return "a wildcard matches any number of refs"
    name, suffix = split_ref(ref)
    if not _ANCESTRY.fullmatch(suffix):
        return f"only ~N, ^N or ^{{commit}} may follow a name, not {suffix!r}"
    if _PSEUDO_REF.fullmatch(name) and name != "HEAD":
        return f"{name} is this machine's, not the source's"
    if not _HEX.fullmatch(name) and not git.is_ref_name(name):
        return "git check-ref-format refuses the name"
    return None


def release_files() -> ReleaseFiles:
    """vLLM's release files, cached under the cache directory, from the package indexes
    pip's own configuration names (``pipconfig``); their user info is masked from here on."""
    settings = pipconfig.settings()
    for url in settings.indexes:
        redact.remember(url)
    return ReleaseFiles(cache_dir(), settings)


def default_mirror() -> ReleaseMirror:
    """The release mirror under the cache directory, fed from ``release_files()``."""
    return ReleaseMirror(cache_dir() / MIRROR_NAME, release_files())


def locate(vllm_repo: str | None, refs: list[str]) -> str:
    """The URL or path to fetch ``refs`` from.

    Without ``vllm_repo`` (or ``$VLLM_REPO``), every release tag among
    ``refs`` is first materialized in the release mirror, whose path is returned.
    A relative path is made absolute from the current folder.
    """
    for ref in refs:
        check_ref(ref)
    chosen = vllm_repo or os.environ.get("VLLM_REPO")
    if chosen:
        check_source(chosen, "--vllm-repo" if vllm_repo else "$VLLM_REPO")
        return _absolute(chosen)
    mirror = default_mirror()
    mirror.ensure(v for v in (release_of(split_ref(ref)[0]) for ref in refs) if v is not None)
    return str(mirror.path)


# ``scheme://`` and git's ``<transport>::<address>`` remote-helper syntax (``ext::``, ``fd::``)
_SCHEME = re.compile(r"^([A-Za-z0-9][A-Za-z0-9+.\-]*)://")
_HELPER = re.compile(r"^([A-Za-z0-9][A-Za-z0-9+.\-]*)::")
_SCHEMES = {"https", "ssh", "git+ssh", "ssh+git", "git", "file"}


def check_source(source: str, what: str = "--vllm-repo") -> None:
    """Refuse, before git runs, a vLLM source that is not an https, ssh or git URL, an
    scp-like ``host:path``, a ``file://`` URL or a local folder or bundle (UsageError).

    Refused: a leading ``-`` (git would read an option), control characters, any
    ``<transport>::`` helper (``ext::`` runs a command, ``fd::0`` waits on a descriptor), any
    other scheme (``http://`` sends credentials in the clear; ``foo://`` runs a
    git-remote-foo), user info git would read otherwise than meant (``redact.userinfo_problem``:
    a password holding ``@ / ? #`` unescaped, which must be written ``%40 %2F %3F %23``), and
    a local path that is a FIFO, a device or a socket (git would wait on it as a bundle). Git
    refuses the same transports on its own (``TRANSPORTS``), also after a ``url.*.insteadOf``
    rewrite. Each refusal names ``what`` (``--vllm-repo``, ``$VLLM_REPO``) and quotes the
    source with its user info masked, before it is escaped (``!r``), so no escape hides it.
    """
    redact.remember(source)  # its user info is masked from here on, whatever it holds
    bad = f"{what} {redact.redact(source)!r}"
    if source.startswith("-") or not source.isprintable():
        raise UsageError(f"{bad} is not a URL or a path (it starts with '-' or holds a control "
                         f"character)")
    helper, scheme = _HELPER.match(source), _SCHEME.match(source)
    if helper and not scheme:
        raise UsageError(f"{bad}: the '{helper[1]}::' transport is not allowed; give an https, "
                         f"ssh or git URL or a local path")
    if scheme and scheme[1].lower() not in _SCHEMES:
        raise UsageError(f"{bad}: the '{scheme[1]}' transport is not allowed; give an https, ssh "
                         f"or git URL or a local path")
    problem = redact.userinfo_problem(source)
    if problem:
        raise UsageError(f"{bad}: {problem}")
    path = local_path(source)
    if path is None:
        return  # a remote; git reaches it (scp-like host:path is ssh)
    try:
        mode = path.stat().st_mode
    except OSError:
        return  # missing: git says so
    if not (stat.S_ISDIR(mode) or stat.S_ISREG(mode)):
        raise UsageError(f"{bad} is neither a folder nor a file (a FIFO, device or socket); "
                         f"give a repository folder, a bundle or a URL")
    if stat.S_ISREG(mode) and not _starts_as_a_bundle(path):
        raise UsageError(f"{bad} is a file but not a git bundle (it does not start with '# v2 git "
                         f"bundle' or '# v3 git bundle'); give a repository folder, a bundle or a URL")


def local_path(source: str) -> Path | None:
    """The local folder or bundle a ``--vllm-repo`` names (a path, or a ``file://`` URL read
    as git reads it), absolute from the current folder; None for a remote (a URL of
    another scheme, an scp-like ``host:path``)."""
    scheme = _SCHEME.match(source)
    if scheme and scheme[1].lower() != "file" or not scheme and ":" in source.split("/", 1)[0]:
        return None
    return Path(os.path.abspath(_file_url_path(source[len(scheme[0]):]) if scheme else source))


# A bundle's first line. git reads a file's whole first line to tell, byte by byte: a large
# file without a newline (a disk image, a sparse file) held it for minutes and its size in memory.
_BUNDLE_SIGNATURES = (b"# v2 git bundle\n", b"# v3 git bundle\n")


def _starts_as_a_bundle(path: Path) -> bool:
    try:
        with open(path, "rb") as f:
            head = f.read(len(_BUNDLE_SIGNATURES[0]))
    except OSError:
        return True  # unreadable: git says why
    return head in _BUNDLE_SIGNATURES


def _file_url_path(rest: str) -> str:
    """The path git reads a ``file://`` URL's ``rest`` as: a host (``localhost``) dropped,
    percent-escapes decoded (``file://localhost/srv/%76llm`` is ``/srv/vllm``)."""
    if not rest.startswith("/") and "/" in rest:
        rest = rest[rest.index("/"):]
    return urllib.parse.unquote(rest)


def _absolute(source: str) -> str:
    """``source`` as git will be given it: a path made absolute from the current folder (git
    runs elsewhere: beside the work directory, in the checkout); a URL (``scheme://``) or an
    scp-like ``host:path`` as it is."""
    if "://" in source or ":" in source.split("/", 1)[0]:
        return source
    return os.path.abspath(source)


def open_existing(workdir: Path) -> git.Repo | None:
    """The checkout at ``workdir``, or None if the folder is missing or empty.

    Raises UsageError if it is a file, or a non-empty folder that is not the
    top of a git work tree.
    """
    if not workdir.exists():
        return None
    if not workdir.is_dir():
        raise UsageError(f"--workdir {workdir} is a file, not a folder")
    if not any(workdir.iterdir()):
        return None
    try:
        repo = git.open_repo(workdir)
    except git.GitError as err:
        raise UsageError(f"--workdir {workdir} exists and is not a git checkout") from err
    refuse_object_format(repo, f"--workdir {workdir}")
    return repo


def refuse_foreign_checkout(repo: git.Repo, workdir: Path, folders: set[str]) -> None:
    """UsageError if the git checkout at ``workdir`` is of another project: its HEAD lacks one
    of ``folders`` (the top folders the overlay's files live in: ``vllm``, ``tests``) and no
    branch there was written by apply.py. The tool would fetch vLLM into it and check vLLM
    out over its files. A repository with no commit yet (``git init``) is refused too: a
    failed switch from it could not be undone (there is no old tree to go back to)."""
    recorded = "^" + re.escape(TIP_KEY).replace(re.escape("{}"), ".*") + "$"  # any branch's record
    if git.attempt(repo, "config", "--get-regexp", recorded)[0]:
        return
    head = git.resolve(repo, "HEAD")
    if head is None:
        raise UsageError(f"--workdir {workdir} is a git repository with no commit yet: give a clone of "
                         f"vLLM, a checkout apply.py made, or a new folder")
    missing = sorted(f for f in folders if f not in git.tree_entries(repo, head, sorted(folders)))
    if missing:
        raise UsageError(f"--workdir {workdir} is a git checkout of something else (its HEAD has no "
                         f"{', '.join(m + '/' for m in missing)}): give a clone of vLLM, a checkout "
                         f"apply.py made, or a new folder")


def refuse_object_format(repo: git.Repo, what: str) -> None:
    """UsageError unless ``repo`` stores SHA-1 objects, as vLLM's repository does: the
    manifest's blob ids, the release commit ids and every sha the tool records are SHA-1's,
    so in a SHA-256 repository every overlay file would read as drift and no ref as a
    release (the tool's scratch repositories failed on it: "invalid reference")."""
    form = git.run(repo, "rev-parse", "--show-object-format").strip()
    if form != "sha1":
        raise UsageError(f"{what} is a {form.upper()} repository; vLLM's and this overlay's ids are "
                         f"SHA-1: use a SHA-1 clone of vLLM")


def clone(origin: str, workdir: Path, *, mark: str | None = None,
          before_placed: Callable[[Path], None] = lambda git_dir: None) -> git.Repo:
    """Clone ``origin`` into ``workdir`` (missing, or an empty folder); with ``mark``, the
    clone's git folder holds it in ``FRESH_MARK`` before the clone is put in place, after
    which ``before_placed`` is called with that git folder (the run claims it there).

    The clone is made in a temporary folder beside ``workdir`` and renamed into
    place when complete, so an interrupted or failed clone leaves no half-made
    checkout (the temporary folder is removed, after git has stopped).
    Raises UsageError if ``workdir`` cannot be made or ``origin`` is no
    repository, SourceError if ``origin`` cannot be reached.
    """
    try:
        workdir.parent.mkdir(parents=True, exist_ok=True)
        scratch = Path(tempfile.mkdtemp(prefix=f".{workdir.name}.k3-clone-", dir=workdir.parent))
    except OSError as err:
        blocking = next((p for p in workdir.parents if p.exists() and not p.is_dir()), None)
        why = f"{blocking} is a file, not a folder" if blocking else err.strerror
        raise UsageError(f"cannot create --workdir {workdir}: {why}") from err
    try:
        with journal.step("clone", scratch=str(scratch), prefix=f".{workdir.name}.k3-clone-"):
            try:
                with step(f"cloning {origin} into {workdir}"):
                    try:
                        cloned = git.clone(origin, scratch / "vllm")
                    except git.GitError as err:
                        raise _classify(str(err)) from err
                    refuse_object_format(cloned, f"--vllm-repo {origin}")
                if mark is not None:
                    (scratch / "vllm" / ".git" / FRESH_MARK).write_text(mark)
                before_placed(scratch / "vllm" / ".git")
                journal.point("clone.cloned")
                try:
                    os.replace(scratch / "vllm", workdir)  # an empty folder there is replaced too
                except OSError as err:
                    if err.errno in (errno.ENOTEMPTY, errno.EEXIST) and workdir.is_dir():
                        # another run (under another cache: this one's lock is not its) put its
                        # clone there first; what it does with it now is its own
                        raise UsageError(f"{workdir} was made by another run while this one cloned "
                                         f"it: run again") from err
                    raise UsageError(f"cannot put the clone at --workdir {workdir}: "
                                     f"{err.strerror}") from err
            finally:
                with deferred():
                    shutil.rmtree(scratch, ignore_errors=True)
    finally:
        with deferred():
            shutil.rmtree(scratch, ignore_errors=True)  # (the journal could not be written)
    return git.open_repo(workdir)


def settled_locally(repo: git.Repo, ref: str) -> str | None:
    """The commit ``ref`` names in ``repo`` when the source cannot make it name another: a
    full sha, or a release tag ``repo`` already has (each with its ancestry steps). None for
    anything else (``HEAD``, a branch, an abbreviated sha, a tag not here): that is read from
    the source (``ensure_ref``), never from ``repo``, whose own ``HEAD`` or branch of that
    name may be anything (a checkout's ``HEAD`` is the patched work branch)."""
    check_ref(ref)
    name, _ = split_ref(ref)
    if not (_FULL_SHA.match(name.lower()) or (release_of(name) and git.resolve(repo, f"refs/tags/{name}"))):
        return None
    return git.resolve(repo, ref)


def fallback(repo: git.Repo, ref: str) -> str | None:
    """What ``repo`` itself says ``ref`` is, where a run takes that when the source cannot
    answer (it lacks the name, or is out of reach): a local branch, an abbreviated sha. Never
    for ``HEAD``: a checkout's own HEAD is the patched work branch, not the source's."""
    return None if split_ref(ref)[0] == "HEAD" else git.resolve(repo, ref)


def ensure_ref(repo: git.Repo, source: str, ref: str) -> str:
    """The commit sha of ``ref``, fetched fresh from ``source`` unless it cannot move.

    What ``settled_locally`` answers is used as is. Anything else (a branch, a tag not yet
    here) is fetched first, so a branch is never read from a stale local copy; a release tag
    is fetched as that tag only, never ``--tags``, so a user's own tags of the same names are
    left alone. When ``source`` cannot answer, ``fallback`` (a local branch, never HEAD).
    Raises UsageError for a bad or unknown ref, SourceError when ``source`` cannot be reached.
    """
    settled = settled_locally(repo, ref)
    if settled:
        return settled
    name, suffix = split_ref(ref)
    local = git.resolve(repo, ref)
    if local is None:
        _refuse_non_commit(repo, ref, ref)
    spec = f"refs/tags/{name}:refs/tags/{name}" if release_of(name) else name
    ok, output = git.attempt(repo, "fetch", "--quiet", "--no-tags", "--", source, spec)
    if ok:
        fetched = (f"refs/tags/{name}" if release_of(name) else "FETCH_HEAD") + suffix
        _refuse_non_commit(repo, fetched, ref)
        sha = git.resolve(repo, fetched)
        if sha is None:  # fetched, yet no commit there (~N past the root): never a sha-less run
            raise UsageError(f"ref {ref!r} names no commit in {source}")
        return sha
    if fallback(repo, ref):
        return local
    if Path(source) == default_mirror().path:  # the user's sha is likely upstream's: say what works
        raise _classify(output, what=unknown_ref_hint(ref))
    raise _classify(output, what=f"ref {ref!r} not found in {source}")


def _refuse_non_commit(repo: git.Repo, name: str, ref: str) -> None:
    """Raise UsageError if ``name`` in ``repo`` names something other than a commit
    (a tree, a blob, or a tag of one); nothing at all is left to the caller."""
    kind = git.object_type(repo, name)
    if kind is not None and git.resolve(repo, name) is None:
        if kind == "tag":
            kind = f"tag of a {git.object_type(repo, f'{name}^{{}}') or 'non-commit'}"
        raise UsageError(f"ref {ref!r} names a {kind}, not a commit: give a tag, branch or "
                         f"commit sha")


def _classify(git_output: str, what: str | None = None) -> UsageError | SourceError:
    """A git failure as bad input (the remote has no such thing) or an unreachable source."""
    reason = git.first_line(git_output)
    if any(marker in git_output for marker in _NOT_FOUND):
        return UsageError(what or reason)
    return SourceError(f"cannot reach the vLLM source: {reason}")


def release_for_ref(ref: str | None, vllm_repo: str | None, option: str = "--vllm-ref") -> Resolved | None:
    """``ref`` as upstream's commit id of a release, when the source is the release mirror
    (no ``vllm_repo``/``$VLLM_REPO``: a git clone's own shas are upstream's already); None
    for any other ref. ``option`` names the flag in the note. Raises what ``check_ref``
    and ``releases.upstream_release`` raise (UsageError, SourceError)."""
    if not ref or vllm_repo or os.environ.get("VLLM_REPO"):
        return None
    check_ref(ref)
    return upstream_release(ref, default_mirror(), option)
