"""Synthetic upstream repositories and overlay projects for the apply job's tests.

The upstream repo has one file per concern and four tags, each built so one
patch lands in a known state:

  v1.0.0  base
  v1.1.0  line 1 of pkg/model.txt changed  -> patch needs 3-way; overlay file unchanged
  v1.2.0  upstream made our change itself  -> patch landed upstream; pkg/mod.py drift that
          3-way merges cleanly
  v1.3.0  line 4 changed another way       -> patch conflicts; pkg/mod.py drift that conflicts
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from k3overlay import progress
from k3overlay.project import Project

IDENT = {
    "GIT_AUTHOR_NAME": "Upstream Dev", "GIT_AUTHOR_EMAIL": "dev@upstream.invalid",
    "GIT_COMMITTER_NAME": "Upstream Dev", "GIT_COMMITTER_EMAIL": "dev@upstream.invalid",
    "GIT_AUTHOR_DATE": "2026-01-01T00:00:00+00:00", "GIT_COMMITTER_DATE": "2026-01-01T00:00:00+00:00",
}

MODEL = [f"line {i}" for i in range(1, 13)]
MOD_BASE = "def old():\n    return 1\n\n\nVALUE = 1\n"
USER = "from pkg.mod import VALUE\nfrom .mod import old\n"
MOD_V12 = '"""Upstream docstring."""\n' + MOD_BASE  # merges cleanly with our overlay
MOD_V13 = MOD_BASE + "\n\ndef theirs():\n    return 4\n"  # same place as ours: conflicts


def g(repo: Path, *args: str) -> str:
    """Run git in ``repo`` with a fixed test identity; return stdout."""
    env = {**os.environ, **IDENT}
    return subprocess.run(["git", *args], cwd=repo, env=env, check=True,
                          capture_output=True, text=True).stdout


def write(root: Path, files: dict[str, str]) -> None:
    for rel, text in files.items():
        path = root / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)


def model(changes: dict[int, str]) -> str:
    lines = list(MODEL)
    for number, text in changes.items():
        lines[number - 1] = text
    return "\n".join(lines) + "\n"


def commit_tag(repo: Path, files: dict[str, str], tag: str) -> None:
    write(repo, files)
    g(repo, "add", "-A")
    g(repo, "commit", "-q", "-m", f"release {tag}")
    g(repo, "tag", tag)


def as_in_a_terminal() -> None:
    """Child setup (``preexec_fn``) for a run a test interrupts with SIGINT: SIGINT at its
    default, as a shell gives a foreground command. A test run started in the background
    (``cmd &`` in a script, as CI runners and nohup do) ignores SIGINT, and Python then keeps
    ignoring it in every child: the interrupt tests would see runs finish with exit 0."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


@pytest.fixture(scope="session")
def upstream(tmp_path_factory) -> Path:
    """A small upstream repository with tags v1.0.0 .. v1.3.0 (see module docstring)."""
    repo = tmp_path_factory.mktemp("upstream")
    g(repo, "init", "-q", "-b", "main")
    commit_tag(repo, {"pkg/__init__.py": "", "pkg/mod.py": MOD_BASE, "pkg/user.py": USER,
                      "pkg/model.txt": model({})}, "v1.0.0")
    commit_tag(repo, {"pkg/model.txt": model({1: "line 1 (upstream)"})}, "v1.1.0")
    commit_tag(repo, {"pkg/model.txt": model({1: "line 1 (upstream)", 4: "line 4 (ours)"}),
                      "pkg/mod.py": MOD_V12}, "v1.2.0")
    commit_tag(repo, {"pkg/model.txt": model({1: "line 1 (upstream)", 4: "line 4 (theirs)"}),
                      "pkg/mod.py": MOD_V13}, "v1.3.0")
    return repo


def make_patch(upstream: Path, out_dir: Path, name: str, changes: dict[int, str],
               status: str = "Upstream-Status: Pending") -> Path:
    """A format-patch of ``changes`` to pkg/model.txt on v1.0.0, saved as ``out_dir/name``."""
    work = out_dir.parent / f"_mk_{name}"
    g(upstream, "worktree", "add", "-q", "--detach", str(work), "v1.0.0")
    try:
        (work / "pkg/model.txt").write_text(model(changes))
        g(work, "commit", "-q", "-am", f"model: change lines {sorted(changes)}\n\nWhy: a test.\n\n{status}")
        out = g(work, "format-patch", "-1", "--zero-commit", "--no-signature", "--full-index",
                "--stdout", "HEAD")
    finally:
        g(upstream, "worktree", "remove", "--force", str(work))
    (out_dir / name).write_text(out)
    return out_dir / name


@pytest.fixture
def project(tmp_path, upstream) -> Project:
    """An overlay project: one patch (line 4 of model.py), pkg/mod.py replaced, pkg/new.py added."""
    root = tmp_path / "project"
    (root / "patches").mkdir(parents=True)
    make_patch(upstream, root / "patches", "0001-model-line-4.patch", {4: "line 4 (ours)"})
    (root / "patches" / "series").write_text("0001-model-line-4.patch\n")
    write(root / "overlay", {"pkg/mod.py": MOD_BASE + "\n\ndef ours():\n    return 3\n",
                             "pkg/new.py": "from pkg.mod import ours\n"})
    base_blob = g(upstream, "rev-parse", "v1.0.0:pkg/mod.py").strip()
    (root / "overlay.json").write_text(json.dumps({"base": "v1.0.0", "files": [
        {"path": "pkg/mod.py", "base_blob": base_blob},
        {"path": "pkg/new.py", "base_blob": "new"}]}))
    (root / "VERSION").write_text("9.9.9\n")
    return Project(root)


# The suite's own git identity: every git a test starts (directly or through the tool) commits
# as this, never as the person running the tests.
TEST_IDENTITY = {
    "GIT_AUTHOR_NAME": "k3 test suite", "GIT_AUTHOR_EMAIL": "tests@vllm-k3-overlay.invalid",
    "GIT_COMMITTER_NAME": "k3 test suite", "GIT_COMMITTER_EMAIL": "tests@vllm-k3-overlay.invalid",
}


@pytest.fixture(scope="session", autouse=True)
def hermetic_git(tmp_path_factory):
    """No test depends on the git config or ``GIT_*`` variables of whoever runs it.

    For the whole session (session fixtures such as ``upstream`` included, and every
    subprocess a test starts): the global config is an empty file, the system config is
    off, no inherited ``GIT_*`` variable is left, and author and committer are the suite's
    own (``TEST_IDENTITY``). A machine without a git identity (README command 2 on a fresh
    clone, ``.ci/run``) then runs the suite exactly as a developer's machine does.
    """
    empty = tmp_path_factory.mktemp("git-home") / "gitconfig"
    empty.write_text("")
    with pytest.MonkeyPatch.context() as mp:
        for key in [k for k in os.environ if k.startswith("GIT_")]:
            mp.delenv(key)
        mp.setenv("GIT_CONFIG_GLOBAL", str(empty))
        mp.setenv("GIT_CONFIG_NOSYSTEM", "1")
        for key, value in TEST_IDENTITY.items():
            mp.setenv(key, value)
        yield empty


@pytest.fixture(autouse=True)
def isolated_cache(request, tmp_path, monkeypatch):
    """No synthetic test touches the real cache, reads pip's config or ``PIP_*`` variables, or
    picks up $VLLM_REPO by accident.

    End-to-end tests (marked ``e2e``) keep the real cache (the release mirror there is what
    saves them from downloading vLLM again) and pip's config (it says where this machine's
    package index is; they build environments from it).
    """
    if request.node.get_closest_marker("e2e") is None:
        monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
        for key in [k for k in os.environ if k.startswith("PIP_")]:
            monkeypatch.delenv(key)
        monkeypatch.setenv("PIP_CONFIG_FILE", os.devnull)  # pip then reads no config file
    monkeypatch.delenv("VLLM_REPO", raising=False)


@pytest.fixture(autouse=True)
def progress_said(monkeypatch):
    """Progress messages on, as apply.py says them without -q: a test that ran apply.py's
    main with -q must not silence the ones after it (``progress.quiet`` is module state)."""
    monkeypatch.setattr(progress, "quiet", False)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    """Life in a CI log: an e2e test (one can take minutes, and -q prints nothing until it
    ends) says when it starts and how long it took, on lines of its own. Off with -qq, and
    with -v (pytest names every test itself). A test running longer says so every minute."""
    reporter = item.config.pluginmanager.get_plugin("terminalreporter")
    verbosity = item.config.get_verbosity()
    if reporter is None or verbosity > 0 or verbosity < -1 or item.get_closest_marker("e2e") is None:
        yield
        return
    _own_line(reporter, f"{item.nodeid} …")
    start = time.monotonic()
    done = threading.Event()

    def heartbeat() -> None:  # building a target's environment takes minutes: say it still runs
        while not done.wait(HEARTBEAT_S):
            _past_capture(reporter, f"{item.nodeid}: still running, {time.monotonic() - start:.0f} s")

    beat = threading.Thread(target=heartbeat, daemon=True)
    beat.start()
    try:
        yield
    finally:
        done.set()
        beat.join()
    _own_line(reporter, f"{item.nodeid}: done in {time.monotonic() - start:.0f} s")


HEARTBEAT_S = float(os.environ.get("K3_TEST_HEARTBEAT_S", "60"))  # a line at least this often in an e2e test


_TERMINAL: list = []  # pytest's own stdout, kept before any test's capture redirects fd 1


def pytest_configure(config):
    """Keep a copy of stdout's descriptor while pytest's capture is suspended (as it is while
    plugins configure): during a test, fd 1 is pytest's capture file, and a heartbeat written
    there came out only when the test ended (eleven at once at +1196 s), or not at all."""
    with contextlib.suppress(OSError, ValueError, AttributeError):
        _TERMINAL.append(os.fdopen(os.dup(sys.stdout.fileno()), "w", buffering=1))


def _past_capture(reporter, text: str) -> None:
    """``text`` on a line of its own on pytest's stdout, now, whatever captures the test."""
    if _TERMINAL:
        _TERMINAL[0].write(("\n" if reporter._tw.width_of_current_line else "") + f"{text}\n")
        _TERMINAL[0].flush()


def _own_line(reporter, text: str) -> None:
    """``text`` on a line of its own, after -q's dots (which ``write_line`` does not end)."""
    if reporter._tw.width_of_current_line:
        reporter.write("\n")
    reporter.write_line(text)


def snapshot(repo: Path) -> dict:
    """Everything about a checkout a user could lose: refs, HEAD, status, worktrees, stash."""
    return {
        "refs": g(repo, "for-each-ref", "--format=%(refname) %(objectname)"),
        "head": g(repo, "rev-parse", "HEAD"),
        "symbolic": subprocess.run(["git", "symbolic-ref", "-q", "HEAD"], cwd=repo,
                                   capture_output=True, text=True).stdout,
        "status": g(repo, "status", "--porcelain", "--untracked-files=all"),
        "diff": g(repo, "diff", "HEAD"),
        "worktrees": g(repo, "worktree", "list", "--porcelain"),
        "config": (repo / ".git" / "config").read_text(),
    }


@pytest.fixture
def fake_index(monkeypatch):
    """A package index on 127.0.0.1 (``tests/fake_index.py``), set as ``$PIP_INDEX_URL``."""
    from .fake_index import FakeIndex, serve

    index = FakeIndex()
    server = serve(index)
    monkeypatch.setenv("PIP_INDEX_URL", index.url)
    yield index
    server.shutdown()
    server.server_close()


def killed_in_owned_scratch(parent: Path, prefix: str, name: str, data: bytes) -> None:
    """A process SIGKILLed inside ``lock.owned_scratch(parent, prefix)`` after writing ``data``
    to ``name`` there: the folder a killed run leaves, its lock free."""
    killed = subprocess.run([sys.executable, "-c",
                             "import os, signal, sys; from pathlib import Path\n"
                             "from k3overlay.lock import owned_scratch\n"
                             "with owned_scratch(Path(sys.argv[1]), sys.argv[2]) as tmp:\n"
                             "    (tmp / sys.argv[3]).write_bytes(bytes.fromhex(sys.argv[4]))\n"
                             "    os.kill(os.getpid(), signal.SIGKILL)\n",
                             str(parent), prefix, name, data.hex()],
                            cwd=Path(__file__).resolve().parent.parent)
    assert killed.returncode == -signal.SIGKILL


def alive(pid: int) -> bool:
    """Whether process ``pid`` runs (is there and no zombie)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False
