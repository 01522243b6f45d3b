"""How every git process is started: the same footing whoever runs it.

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
still opens repositories. Each git runs in a session of its own, with stdin
``/dev/null``, no terminal prompt, no askpass program and ssh in BatchMode:
nothing waits on a person or a descriptor (a private repository needs an ssh
agent or a credential helper). Only the transports in ``TRANSPORTS`` are allowed,
whatever a config says (``GIT_ALLOW_PROTOCOL``). On an interrupt the child's whole process group is terminated and
waited for before the interrupt goes on, so no git keeps writing after the tool
has cleaned up.
"""

from __future__ import annotations

import contextlib
import functools
import importlib
import os
import re
import signal
import subprocess
import tempfile
from pathlib import Path

from .errors import OverlayError, UsageError
from . import reaper
from .gitconfig import git_true, refuse_unreadable_config, refuse_unreadable_repo_config
from .interrupts import deferred
from .redact import redact, url_without_credentials


def _gitpython():
    """GitPython, imported with the user's git config files shut out: on import it runs ``git
    version`` as the user would, and git reads their config files first, so a FIFO among them
    held the import, and the tool before it said a word, forever (``refuse_unreadable_config``
    names such a file, once the tool runs). Git's version is no setting of theirs."""
    shut = {"GIT_CONFIG_NOSYSTEM": "1", "GIT_CONFIG_GLOBAL": os.devnull}
    saved = {key: os.environ.get(key) for key in shut}
    os.environ.update(shut)
    try:
        return importlib.import_module("git")
    finally:
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


gitpython = _gitpython()
Repo = gitpython.Repo
InvalidGitRepositoryError = gitpython.exc.InvalidGitRepositoryError
NoSuchPathError = gitpython.exc.NoSuchPathError


# The transports a vLLM source may use (git's names): https, ssh, git, and file for local
# paths. Every other (http, ftp, ext::, fd::, any git-remote-<name> helper) is off.
TRANSPORTS = ("https", "ssh", "git", "file")

# Settings the tool relies on, whatever any config file says (``-c`` beats them all,
# the checkout's own .git/config included): what git prints is what we parse, what it
# commits is reproducible, and nothing of the user's runs inside the tool's git.
PINNED = {
    # the user's hooks, fsmonitor and signing never run (and would break reproducible shas)
    "core.hooksPath": "/dev/null", "core.fsmonitor": "false",
    "commit.gpgSign": "false", "tag.gpgSign": "false", "log.showSignature": "false",
    "submodule.recurse": "false", "fetch.recurseSubmodules": "false",
    # transports: only what a vLLM source can be (``TRANSPORTS``; GIT_ALLOW_PROTOCOL in
    # ``_environment`` says the same and beats any config); nothing prompts for a password
    "protocol.allow": "never",
    **{f"protocol.{name}.allow": "always" for name in TRANSPORTS},
    **{f"protocol.{name}.allow": "never" for name in ("ext", "fd", "http", "ftp", "ftps")},
    "core.askPass": "",
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


# The pins above are for what the tool writes (objects, commits, checkouts of its own):
# byte for byte whatever the user's config. Whether a file of the user's checkout holds an
# index entry's content is their git's question, though: a checkout whose own config says
# ``core.autocrlf=true`` holds CRLF files that its git stores as LF, and a file merely touched
# (stat-dirty) re-hashed without that conversion looked changed, so the tool refused a
# checkout the user's `git status` called clean. The line-ending settings of the checkout's
# own config (``checkouts_eol``) go after the pins for those looks: every ``status``
# (``_EOL_VERBS``: it only compares, and refreshes the index's stat data as the user's own
# would) and the callers that hash work-tree files (``eol=True``). Their attributes file
# too: ``* text eol=crlf`` there makes CRLF files their git calls clean (a filter it names
# runs only where a driver is configured, and the tool carries none).
_EOL_KEYS = ("core.autocrlf", "core.eol", "core.safecrlf", "core.attributesFile")
_EOL_VERBS = ("status",)


# Carried over from the user's own (global/system) config: reaching a repository, who
# they are, and what they ignore. Canonical key names, as ``git config --get-regexp`` prints them.
_CARRIED = re.compile(r"^(user\.(name|email)|credential\..+|http\..+|url\..+\.(insteadof|pushinsteadof)"
                      r"|core\.(sshcommand|excludesfile)|safe\.directory)$")


# Inherited variables kept: identity (reflog lines in the user's checkout stay theirs)
# and transport (ssh, proxies, certificates). Every other GIT_* variable is dropped:
# GIT_DIR, GIT_INDEX_FILE, GIT_CONFIG_PARAMETERS, … would redirect or reconfigure us.
_KEPT_VARIABLES = re.compile(r"^GIT_((AUTHOR|COMMITTER)_(NAME|EMAIL)|SSH|SSH_COMMAND|SSH_VARIANT"
                             r"|SSL_CAINFO|SSL_CAPATH|SSL_NO_VERIFY|PROXY_COMMAND"
                             r"|PROXY_SSL_.+|HTTP_.+|EXEC_PATH)$")
# Nothing may wait on a person: no terminal prompt, no askpass program (git's or ssh's),
# no interactive credential manager. A private source needs a credential helper or an ssh agent.
_NO_PROMPT = {"GIT_TERMINAL_PROMPT": "0", "SSH_ASKPASS_REQUIRE": "never", "GCM_INTERACTIVE": "never",
              "GIT_PROTOCOL_FROM_USER": "0", "GIT_ALLOW_PROTOCOL": ":".join(TRANSPORTS)}


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
             env: dict[str, str] | None = None, stdin: bytes | None = None,
             eol: bool = False) -> tuple[int, bytes, bytes]:
    """Run git with the tool's pinned settings in ``cwd``; return (status, stdout, stderr).

    ``env`` adds variables (identity, dates, an index file) on top of the
    isolated environment. With ``eol`` (always for a verb in ``_EOL_VERBS``) the line-ending
    settings of the repository at ``cwd``'s own config replace the pinned ones
    (``checkouts_eol``): for a read-only look at a user's work tree, never for what writes
    objects. The child runs in its own process group, so a terminal's Ctrl-C reaches only
    us; on any interrupt we terminate that group, wait for it, and re-raise. Raises GitError
    if git cannot be started (no git, or ``cwd`` is gone: never silently run somewhere else).
    """
    own = checkouts_eol(cwd) if eol or (args and args[0] in _EOL_VERBS) else ()
    # stdin is /dev/null unless data is given, then a file, not a pipe (git may stop reading
    # early): nothing git starts (a remote helper, ssh, a credential helper) can wait on it.
    with open(os.devnull, "rb") if stdin is None else tempfile.TemporaryFile() as given:
        if stdin is not None:
            given.write(stdin)
            given.seek(0)
        try:
            proc = subprocess.Popen(
                [*GIT, *own, *args], cwd=cwd, env=_environment(env, cwd), start_new_session=True,
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


def checkouts_eol(cwd: str | Path) -> tuple[str, ...]:
    """``-c`` arguments (to follow ``GIT``'s pins: the last wins) giving the ``_EOL_KEYS`` that
    the user's own git reads for the repository at ``cwd``: their system and global config
    (``core.autocrlf=true`` set once for every checkout: Windows, WSL), then the repository's
    own, each as given; none where none is set (git's defaults, on which the pins agree:
    autocrlf false, eol lf on this system, safecrlf matters to object writes only) or cannot
    be read. Read by git as the user runs it, in ``cwd``: an ``includeIf "gitdir:…"`` of their
    global config is for the checkout it names (read elsewhere it matches nothing). Raises
    GitError if git cannot be started, UsageError if their config cannot be read
    (``_users_entries``)."""
    keys = "|".join(re.escape(key) for key in _EOL_KEYS)
    try:
        entries = _users_entries(cwd, f"^({keys})$")
    except OSError as err:
        raise GitError(f"cannot run git config in {cwd}: {err.strerror}") from err
    given = []
    for key, value in entries or ():
        if key == "core.attributesfile" and not _a_file(value, cwd):
            continue  # (none, or a FIFO git would wait on: then the pin, and a refusal at worst)
        if key in {k.lower() for k in _EOL_KEYS}:  # (git names keys in lower case)
            # ``[core] autocrlf`` with no value is true, as ``-c core.autocrlf``
            given += ["-c", key if value is None else f"{key}={value}"]
    return tuple(given)


def _a_file(path: str | None, cwd: str | Path) -> bool:
    """Whether ``path`` (a config value: ``~`` expanded, relative to ``cwd``) is a regular file."""
    return path is not None and os.path.isfile(os.path.join(cwd, os.path.expanduser(path)))


_CONFIG_WAIT_S = 30  # how long one read of the user's config may take (a slow network home)

# The ``_config_location``s whose config took over ``_CONFIG_WAIT_S`` to read: said once, as the
# run's error (``_users_entries``); what runs while it unwinds (a cleanup's git) waits no more.
_stalled: set[tuple[str, ...]] = set()


def _users_entries(cwd: str | Path, pattern: str, *scope: str) -> tuple[tuple[str, str | None], ...] | None:
    """The entries of the user's config whose keys match ``pattern`` (of ``scope``: ``--global``,
    ``--system``; none, every scope), as their git reads them in ``cwd`` (``_users_environment``,
    includes followed): ``(key, value)`` in order, ``None`` for an entry written without a
    value; ``()`` where none matches, or once a read of this config has stalled; None where
    git will not read there (a repository another user owns). Raises OSError if git cannot
    be started in ``cwd``, UsageError (one line) if one of their config files is no file
    (``refuse_unreadable_config``) or the read takes over ``_CONFIG_WAIT_S``: an include of a
    FIFO or of a stalled mount would stall every later read too, folder after folder."""
    where = _config_location()
    if where in _stalled:  # said already: stopping rather than carry a part of their settings
        return ()
    refuse_unreadable_config()
    try:
        proc = subprocess.run(["git", "config", *scope, "--includes", "--null", "--get-regexp", pattern],
                              env=_users_environment(), cwd=cwd, stdin=subprocess.DEVNULL,
                              capture_output=True, timeout=_CONFIG_WAIT_S)
    except subprocess.TimeoutExpired as err:
        # Stop, not go on without them: a run without the user's safe.directory, autocrlf or
        # excludes refuses their checkout for reasons that are not so, without their
        # credentials it cannot reach their source; and every later read waits as long.
        _stalled.add(where)
        raise UsageError(f"git took over {_CONFIG_WAIT_S} s to read your git config: does it include "
                         f"a FIFO, or a file on a stalled mount? Fix that, or point GIT_CONFIG_GLOBAL "
                         f"at another file") from err
    if proc.returncode not in (0, 1):  # 1: nothing matches
        return None
    records = (record.partition("\n") for record in _text(proc.stdout).split("\0"))
    return tuple((key, value if newline else None) for key, newline, value in records if key)


def _users_environment() -> dict[str, str]:
    """The environment git reads the user's own config in: theirs, less every ``GIT_*`` variable
    but those that locate the config files (a ``GIT_DIR`` or ``GIT_CONFIG_PARAMETERS`` of the
    shell would point it elsewhere, or add to what it reads), in English."""
    kept = ("GIT_CONFIG_GLOBAL", "GIT_CONFIG_SYSTEM", "GIT_CONFIG_NOSYSTEM")
    return {**{k: v for k, v in os.environ.items() if not k.startswith("GIT_") or k in kept},
            "LC_ALL": "C"}


def _config_location() -> tuple[str, ...]:
    """What locates the user's own global and system config files (the key of ``_users_config``)."""
    return tuple(os.environ.get(k, "") for k in (
        "HOME", "XDG_CONFIG_HOME", "GIT_CONFIG_GLOBAL", "GIT_CONFIG_SYSTEM", "GIT_CONFIG_NOSYSTEM"))


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


def _environment(extra: dict[str, str] | None, cwd: str | Path = os.sep) -> dict[str, str]:
    """The environment of every git child run in ``cwd``: the user's, less their git config
    and GIT_* state, with the entries of their config it carries as read in ``cwd``."""
    env = {k: v for k, v in os.environ.items()
           if (not k.startswith("GIT_") or _KEPT_VARIABLES.match(k)) and k != "SSH_ASKPASS"}
    env.update(GIT_CONFIG_NOSYSTEM="1", GIT_CONFIG_GLOBAL=os.devnull, GIT_ATTR_NOSYSTEM="1",
               LC_ALL="C", LANGUAGE="C")
    env.update(_NO_PROMPT)
    carried = _carried_config(_config_location(), os.path.abspath(cwd))
    if not ({"GIT_SSH", "GIT_SSH_COMMAND"} & env.keys()
            or any(key == "core.sshcommand" for key, _ in carried)):
        env["GIT_SSH_COMMAND"] = "ssh -o BatchMode=yes"  # ssh asks nothing either
    env["GIT_CONFIG_COUNT"] = str(len(carried))  # not -c: a token in http.extraHeader stays off ps
    for i, (key, value) in enumerate(carried):
        env[f"GIT_CONFIG_KEY_{i}"], env[f"GIT_CONFIG_VALUE_{i}"] = key, value
    env.update(extra or {})
    return env


def _carried_config(where: tuple[str, ...], cwd: str) -> tuple[tuple[str, str], ...]:
    """(key, value) of the user's global and system config entries in ``_CARRIED``, in order,
    as their git reads them in ``cwd`` (``_users_config``).
    An entry without a value (``[http] sslVerify``) is a boolean's true: carried as an empty
    value (``GIT_CONFIG_VALUE_N=``), git would read it as false, and verify no certificate.
    But a valueless ``safe.directory`` empties the list as an empty one does (a global one
    revoking the system's ``*``): as ``true`` it would revoke nothing."""
    return tuple((key, _valueless(key) if value is None else value)
                 for key, value in _users_config(where, cwd) if _CARRIED.match(key))


def _valueless(key: str) -> str:
    """The value git reads an entry of ``key`` written without ``=`` as (``_carried_config``)."""
    return "" if key == "safe.directory" else "true"


@functools.lru_cache(maxsize=64)
def _users_config(where: tuple[str, ...], cwd: str) -> tuple[tuple[str, str | None], ...]:
    """(key, value) of every entry of the user's system, then global config, in order (an
    entry without a value, ``[core] autocrlf``, has ``None``), read in ``cwd`` as their git
    reads it there: an ``includeIf "gitdir:…"`` (a credential helper, an email for the work
    folder) applies in the repositories it names. Where git refuses to read in ``cwd`` (a
    repository another user owns), as read in ``/``, where such conditions match nothing.
    Raises UsageError where their config cannot be read (``_users_entries``): a read that
    stalled is not tried again in ``/``, nor in the next folder.

    ``where`` is what locates those files (HOME, …), so a changed one is read afresh. No
    system config under ``GIT_CONFIG_NOSYSTEM``, as their git reads none (``git config
    --system`` reads it all the same).
    """
    entries: list[tuple[str, str | None]] = []
    nosystem = git_true(os.environ.get("GIT_CONFIG_NOSYSTEM", ""))
    for scope in ("--global",) if nosystem else ("--system", "--global"):  # global wins, as in git
        for folder in dict.fromkeys((cwd, os.path.abspath(os.sep))):
            with contextlib.suppress(OSError):
                read = _users_entries(folder, ".", scope)
                if read is not None:
                    entries += read
                    break
    return tuple(entries)


def user_has_identity() -> bool:
    """True if git, run as the user runs it (their config and variables), knows who commits:
    where it does not (a CI runner, a fresh machine) ``git am --continue`` dies with
    "Committer identity unknown", so the commands the tool suggests must name one. False,
    at once, where their config would stall git (``refuse_unreadable_config``)."""
    if _config_location() in _stalled:
        return False
    try:
        refuse_unreadable_config()
    except UsageError:  # (asked for a report's next commands: never an error of its own)
        return False
    try:
        proc = subprocess.run(["git", "var", "GIT_COMMITTER_IDENT"], cwd=os.path.abspath(os.sep),
                              stdin=subprocess.DEVNULL, capture_output=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return False
    return proc.returncode == 0


def environ(**extra: str) -> dict[str, str]:
    """Variables for one git call (identity, dates), set on top of the tool's own
    environment for git (see ``_environment``); not a whole environment."""
    return dict(extra)


def open_repo(path: Path) -> Repo:
    """Open the repository whose work tree is ``path``. Raises GitError if it is none,
    UsageError if its config would stall git (``refuse_unreadable_repo_config``)."""
    refuse_unreadable_repo_config(path)
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
    stored = url_without_credentials(source)
    if stored != source:  # the clone's config keeps no password or token (git stores it as given)
        status, _, err = _execute(["config", "--local", "remote.origin.url", stored], cwd=dest)
        if status != 0:
            raise GitError(f"git config failed: {first_line(_text(err))}")
        _redact_reflogs(dest / ".git" / "logs")
    return Repo(dest)


def _redact_reflogs(logs: Path) -> None:
    """Pass a fresh clone's reflogs through ``redact``: git takes the user info out of its
    "clone: from URL" line, but not a token in the URL's query (``?private_token=``)."""
    for path in logs.rglob("*"):
        if path.is_file() and not path.is_symlink():
            data = path.read_bytes()
            clean = redact(data.decode("utf-8", "surrogateescape")).encode("utf-8", "surrogateescape")
            if clean != data:
                path.write_bytes(clean)


def _z(listing: str) -> list[str]:
    """The paths of a ``-z`` listing: NUL-terminated, never quoted (spaces, non-ASCII kept)."""
    return [path for path in listing.split("\0") if path]


def literal(paths: list[str]) -> list[str]:
    """Pathspecs that match exactly these paths (a ``*`` or ``[`` in a name is no pattern)."""
    return [f":(literal){path}" for path in paths]
