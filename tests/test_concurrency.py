"""Issue 8, items 5 and 6, with real processes: two runs at once on one checkout or one fresh
workdir, stale temporary worktrees, and Ctrl-C / SIGTERM mid-clone, mid-``git am`` and at
start-up. Each test asserts the state left behind, not only the exit code."""

from __future__ import annotations

import json
import os
import signal
import ssl
import subprocess
import sys
import tempfile
import threading
import time
from functools import partial
from http.server import SimpleHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

from k3overlay import lock
from k3overlay.job import Options, run_apply
from k3overlay.lock import workdir_lock
from k3overlay.project import Project

from .conftest import as_in_a_terminal, g, snapshot, write

ROOT = Path(__file__).resolve().parent.parent
# apply.py's own main, on a synthetic project (argv[1]) instead of this repository
RUNNER = ("import sys; from pathlib import Path; from k3overlay import cli; "
          "from k3overlay.project import Project; cli.Project = lambda: Project(Path(sys.argv[1])); "
          "sys.exit(cli.main(sys.argv[2:]))")
INTERRUPTED = "apply.py: interrupted; "


@pytest.fixture
def tmpdir_env(tmp_path) -> dict[str, str]:
    """The environment for child runs: temporary folders under tmp_path/t (checked empty after)."""
    (tmp_path / "t").mkdir()
    return {**os.environ, "TMPDIR": str(tmp_path / "t")}


def spawn(project: Project, env: dict[str, str], *args: str) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-c", RUNNER, str(project.root), *args], cwd=ROOT,
                            env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            preexec_fn=as_in_a_terminal)


def wait_for(condition, timeout: float = 30.0, what: str = "condition") -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.02)


def worktree_entries(wd: Path) -> list[str]:
    admin = wd / ".git" / "worktrees"
    return sorted(os.listdir(admin)) if admin.is_dir() else []


# -- 5. one run at a time per checkout --------------------------------------------------------

def test_two_checks_at_once_on_one_checkout(project, upstream, tmp_path, tmpdir_env):
    wd = tmp_path / "wd"
    g(upstream, "clone", "-q", str(upstream), str(wd))
    before = snapshot(wd)
    runs = [spawn(project, tmpdir_env, "-q", "--check", "--vllm-repo", str(upstream), "--workdir",
                  str(wd), "--vllm-ref", "v1.1.0", "--json", str(tmp_path / f"r{i}.json"))
            for i in range(2)]
    outputs = [run.communicate(timeout=120) for run in runs]
    assert [run.returncode for run in runs] == [0, 0], outputs
    reports = [json.loads((tmp_path / f"r{i}.json").read_text()) for i in range(2)]
    for data in reports:  # both saw a clean ref: no conflict, no drift
        assert data["ok"] and [p["status"] for p in data["patches"]] == ["applied-3way"]
        assert [f["status"] for f in data["overlay"]] == ["replaced", "added"]
    assert snapshot(wd) == before and worktree_entries(wd) == []
    assert os.listdir(tmp_path / "t") == []


def test_two_runs_into_one_fresh_workdir(project, upstream, tmp_path, tmpdir_env):
    wd = tmp_path / "work" / "vllm"
    runs = [spawn(project, tmpdir_env, "-q", "--vllm-repo", str(upstream), "--workdir", str(wd))
            for _ in range(2)]
    outputs = [run.communicate(timeout=120) for run in runs]
    assert [run.returncode for run in runs] == [0, 0], outputs
    assert os.listdir(wd.parent) == ["vllm"]  # no half clone, no temporary folder left
    assert g(wd, "symbolic-ref", "--short", "HEAD").strip() == "k3-overlay/9.9.9"
    assert g(wd, "status", "--porcelain") == "" and worktree_entries(wd) == []


def test_a_second_run_waits_for_the_first_and_says_so(project, upstream, tmp_path, tmpdir_env):
    wd = tmp_path / "wd"
    said = []
    with workdir_lock(wd, say=said.append):  # this test is "the first run"
        run = spawn(project, tmpdir_env, "-q", "--vllm-repo", str(upstream), "--workdir", str(wd))
        line = run.stderr.readline()
        assert line.startswith("… waiting for apply.py (pid ") and line.rstrip().endswith(f"with {wd}")
        time.sleep(1.0)
        assert run.poll() is None and not wd.exists()  # still waiting, nothing done
    assert run.wait(timeout=120) == 0 and said == []
    assert g(wd, "symbolic-ref", "--short", "HEAD").strip() == "k3-overlay/9.9.9"


OWNER = ("import sys; from pathlib import Path; from k3overlay import git\n"
         "with git.temporary_worktree(git.open_repo(Path(sys.argv[1])), 'v1.0.0') as tree:\n"
         "    print(tree.working_tree_dir, flush=True); sys.stdin.read()")


def test_stale_worktree_removed_only_when_its_owner_is_gone(project, upstream, tmp_path, tmpdir_env,
                                                             monkeypatch):
    wd = tmp_path / "wd"
    g(upstream, "clone", "-q", str(upstream), str(wd))
    owner = subprocess.Popen([sys.executable, "-c", OWNER, str(wd)], cwd=ROOT, env=tmpdir_env,
                             stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    theirs = Path(owner.stdout.readline().strip())
    try:
        assert run_apply(project, Options(vllm_repo=str(upstream), workdir=wd, check=True)).ok
        assert (theirs / "pkg/mod.py").is_file()  # a live owner's worktree is left alone
        assert worktree_entries(wd) == []  # a scratch repository: never registered in the checkout
    finally:
        owner.kill()  # SIGKILL: no cleanup runs, the kernel drops its lock
        owner.wait()
    assert theirs.is_dir()
    monkeypatch.setattr(tempfile, "tempdir", tmpdir_env["TMPDIR"])  # the next run, in the same TMPDIR
    assert run_apply(project, Options(vllm_repo=str(upstream), workdir=wd, check=True)).ok
    assert not theirs.parent.exists() and worktree_entries(wd) == []


# -- 6. interrupts ----------------------------------------------------------------------------

class _SlowHandler(SimpleHTTPRequestHandler):
    """Serves a repository over git's dumb HTTP protocol, a fraction of a second per file."""

    def do_GET(self):  # noqa: N802 (http.server's name)
        time.sleep(0.4)
        super().do_GET()

    def log_message(self, *args):
        pass


@pytest.fixture
def slow_source(upstream, tmp_path, tmpdir_env):
    """An HTTPS URL of the synthetic upstream that takes seconds to clone (loose objects,
    one slow request each): a clone can be interrupted half-way. (Plain http is a transport
    apply.py refuses; the child runs trust the server's self-signed certificate.)"""
    served = tmp_path / "served"
    bare = served / "up.git"
    g(upstream, "clone", "-q", "--bare", "--no-local", str(upstream), str(bare))
    for pack in (bare / "objects" / "pack").glob("*.pack"):
        data = pack.read_bytes()
        pack.unlink()
        pack.with_suffix(".idx").unlink()
        subprocess.run(["git", "unpack-objects", "-q"], cwd=bare, input=data, check=True)
    g(bare, "update-server-info")
    server = ThreadingHTTPServer(("127.0.0.1", 0), partial(_SlowHandler, directory=str(served)))
    tmpdir_env["GIT_SSL_CAINFO"] = _serve_tls(server, tmp_path)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    # git hangs up on the server when interrupted; an in-process cli.main() earlier in the
    # session may have left SIGPIPE at its default, which would end pytest itself.
    previous = signal.signal(signal.SIGPIPE, signal.SIG_IGN)
    yield f"https://127.0.0.1:{server.server_address[1]}/up.git"
    signal.signal(signal.SIGPIPE, previous)
    server.shutdown()


def _serve_tls(server: ThreadingHTTPServer, tmp_path: Path) -> str:
    """Wrap ``server`` in TLS with a fresh self-signed certificate for 127.0.0.1; its path."""
    cert, key = tmp_path / "cert.pem", tmp_path / "key.pem"
    made = subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1",
                           "-keyout", str(key), "-out", str(cert), "-subj", "/CN=127.0.0.1",
                           "-addext", "subjectAltName=IP:127.0.0.1"], capture_output=True)
    if made.returncode != 0:
        pytest.skip(f"openssl cannot make a test certificate: {made.stderr[-200:]!r}")
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    context.load_cert_chain(cert, key)
    server.socket = context.wrap_socket(server.socket, server_side=True)
    return str(cert)


@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGTERM])
def test_interrupt_mid_clone_leaves_no_half_checkout(project, upstream, slow_source, tmp_path,
                                                     tmpdir_env, signum):
    parent = tmp_path / "work"
    wd = parent / "vllm"
    run = spawn(project, tmpdir_env, "-q", "--vllm-repo", slow_source, "--workdir", str(wd))
    wait_for(lambda: any(parent.glob(".vllm.k3-clone-*/vllm/.git/HEAD")), what="the clone to start")
    time.sleep(0.3)  # git is now fetching objects
    run.send_signal(signum)
    _, err = run.communicate(timeout=60)
    assert run.returncode == 130 and err.splitlines() == [
        INTERRUPTED + "the checkout's branches, HEAD and files were left as they were"], err
    for _ in range(2):  # and nothing keeps writing after we are gone
        assert os.listdir(parent) == [] and os.listdir(tmp_path / "t") == []
        time.sleep(0.5)
    rerun = run_apply(project, Options(vllm_repo=str(upstream), workdir=wd))  # not refused
    assert rerun.ok and rerun.published


@pytest.fixture
def long_series(project, upstream, tmp_path):
    """``project`` with 60 patches, so applying takes long enough to interrupt."""
    src = tmp_path / "series-src"
    g(upstream, "clone", "-q", "--branch", "v1.0.0", str(upstream), str(src))
    for i in range(60):
        write(src, {f"gen/file{i:02d}.txt": f"generated {i}\n"})
        g(src, "add", "-A")
        g(src, "commit", "-qm", f"gen: file {i:02d}\n\nWhy: a long series.\n\nUpstream-Status: Pending")
    for old in project.patches_dir.glob("*.patch"):
        old.unlink()
    g(src, "format-patch", "-q", "--zero-commit", "--no-signature", "-o", str(project.patches_dir),
      "v1.0.0..HEAD")
    names = sorted(p.name for p in project.patches_dir.glob("*.patch"))
    (project.patches_dir / "series").write_text("\n".join(names) + "\n")
    return project


def applied(tmp: Path) -> int:
    """The files the series wrote so far in the run's temporary worktree (in its own folder under
    TMPDIR ``tmp``, ``scratch``); 0 while a folder on the way comes or goes."""
    try:
        return len(list(tmp.glob("k3overlay-*/run-*/k3-worktree-*/tree/gen/*")))
    except FileNotFoundError:
        return 0


@pytest.mark.parametrize("check", [True, False])
def test_interrupt_mid_am_leaves_the_checkout_and_no_worktree(long_series, upstream, tmp_path,
                                                              tmpdir_env, check):
    wd = tmp_path / "wd"
    g(upstream, "clone", "-q", str(upstream), str(wd))
    before = snapshot(wd)
    run = spawn(long_series, tmpdir_env, "-q", "--vllm-repo", str(upstream), "--workdir", str(wd),
                *(["--check"] if check else []))
    tmp = tmp_path / "t"
    wait_for(lambda: applied(tmp) >= 3, what="patches to apply")
    run.send_signal(signal.SIGINT)
    _, err = run.communicate(timeout=60)
    expected = "the checkout was left as it was" if check else \
        "the checkout's branches, HEAD and files were left as they were"
    assert run.returncode == 130 and err.splitlines() == [INTERRUPTED + expected], err
    assert snapshot(wd) == before and worktree_entries(wd) == [] and os.listdir(tmp) == []


REBASE_INTERRUPTED = "rebase.py: interrupted; no checkout was touched (the job works in throwaway clones)"


@pytest.mark.parametrize("script", ["apply.py", "ci/rebase.py"])
def test_interrupt_while_starting_up_prints_no_traceback(tmp_path, upstream, script):
    # "ready" is printed just before the script's own code runs: the interrupt lands in its imports.
    path = str(ROOT / script)
    argv = (["apply.py", "--check", "-q"] if script == "apply.py" else
            ["rebase.py", "--onto", "v1.1.0", "--vllm-repo", str(upstream), "--no-tests", "-q"])
    expected = INTERRUPTED + "the checkout was left as it was" if script == "apply.py" else \
        REBASE_INTERRUPTED
    script = (f"import sys; sys.argv = {argv!r}; path = {path!r}; "
              "code = compile(open(path).read(), path, 'exec'); print('ready', flush=True); "
              "exec(code, {'__name__': '__main__', '__file__': path})")
    for delay in (0.0, 0.05, 0.15):
        for _ in range(3):
            run = subprocess.Popen([sys.executable, "-c", script], cwd=tmp_path,
                                   stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                   preexec_fn=as_in_a_terminal,
                                   env={**os.environ, "XDG_CACHE_HOME": str(tmp_path / "cache"),
                                        "PYTHONPATH": str(ROOT)})  # ci.rebase imports ci.*
            assert run.stdout.readline() == "ready\n"
            time.sleep(delay)
            run.send_signal(signal.SIGINT)
            _, err = run.communicate(timeout=60)
            # On a loaded machine the interrupt can land in this harness, between "ready" and
            # the exec (its only frame is then the harness's own line), or in a callback of
            # Python's import machinery, which swallows it ("Exception ignored in"): either
            # way it never reached the script. Again.
            in_harness = err.rstrip().endswith('File "<string>", line 1, in <module>\nKeyboardInterrupt')
            if not (in_harness or err.startswith("Exception ignored in")):
                break
        assert "Traceback" not in err and run.returncode == 130, (delay, err)
        assert err.splitlines() == [expected]


def test_rebase_job_interrupted_while_writing_its_reports_is_one_line(monkeypatch, capsys, tmp_path):
    """After the refs are done, the reports are printed and written: Ctrl-C there too is one line."""
    from k3overlay.report import Report

    from .test_rebase import load_ci_rebase

    job = load_ci_rebase()
    monkeypatch.setattr(job, "run_rebase", lambda *a, **k: [Report("9.9.9", "v1.0.0", "v1.1.0")])

    def interrupted(*_args):
        raise KeyboardInterrupt

    monkeypatch.setattr(job, "write_human", interrupted)
    assert job.main(["-q", "--no-tests", "--onto", "v1.1.0", "--json", str(tmp_path / "r.json")]) == 130
    assert capsys.readouterr().err.splitlines() == [REBASE_INTERRUPTED]



def test_an_interrupt_during_a_git_command_stops_git_and_what_it_started(tmp_path, monkeypatch):
    """In this process: Ctrl-C while waiting for git terminates git's process group (git and
    a grandchild it started) and waits for it, then goes on as an interrupt."""
    from k3overlay import git

    started = []
    real = subprocess.Popen.communicate

    def interrupted(self, *args, **kwargs):
        if "nap" not in self.args:  # git config, read before: let it be
            return real(self, *args, **kwargs)
        started.append(self)
        deadline = time.monotonic() + 10
        while not (tmp_path / "napping").exists() and time.monotonic() < deadline:
            time.sleep(0.05)  # the grandchild is running
        raise KeyboardInterrupt

    monkeypatch.setattr(subprocess.Popen, "communicate", interrupted)
    nap = f"!touch {tmp_path / 'napping'} && exec sleep 60"  # git's own child, which git reaps
    with pytest.raises(KeyboardInterrupt):
        git._execute(["-c", f"alias.nap={nap}", "nap"], cwd=tmp_path)
    monkeypatch.setattr(subprocess.Popen, "communicate", real)
    [proc] = started
    assert proc.returncode == -signal.SIGTERM  # waited for, ended by our SIGTERM
    assert _live_members(proc.pid) == []  # nothing of its group runs on (the sleep included)


def _live_members(group: int) -> list[int]:
    """Pids of the process group that are not zombies (waiting for init to reap them)."""
    live = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rpartition(")")[2].split()
        except OSError:
            continue  # gone meanwhile
        if int(fields[2]) == group and fields[0] != "Z":
            live.append(int(stat.parent.name))
    return live


@pytest.mark.parametrize("damage", ["folder gone", "git folder gone"])
def test_a_damaged_temporary_worktree_leaves_no_entry(upstream, tmp_path, damage):
    """A cleaned /tmp took our worktree's folder while we worked, or its ``.git`` (a half-made
    one): no entry is left in the checkout either way, nor the folder."""
    from k3overlay import git

    wd = tmp_path / "wd"
    g(upstream, "clone", "-q", str(upstream), str(wd))
    repo = git.open_repo(wd)
    with git.temporary_worktree(repo, git.resolve(repo, "v1.0.0")) as tree:
        parent = Path(tree.working_tree_dir).parent
        if damage == "folder gone":
            subprocess.run(["rm", "-rf", str(parent)], check=True)
        else:
            subprocess.run(["rm", "-rf", str(parent / "tree" / ".git")], check=True)
    assert worktree_entries(wd) == [] and not parent.exists()
    assert g(wd, "worktree", "list", "--porcelain").count("worktree ") == 1  # git agrees


# Found by the second adversarial pass: ``apply.py 2>&1 | head -1``. Progress goes to stderr
# while the job runs; once the reader had gone, the next progress line killed the tool on the
# spot (SIGPIPE at its default), leaving a whole scratch clone beside the work directory, or
# a temporary worktree registered in the user's checkout. A closed pipe now cleans up like
# Ctrl-C, then ends quietly (killed by SIGPIPE, as ``| head`` expects).

def run_with_stderr_read_once(project, env, *args):
    """apply.py whose stderr reader goes away after the first line; (exit status, stdout)."""
    run = subprocess.Popen([sys.executable, "-c", RUNNER, str(project.root), *args], cwd=ROOT,
                           env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                           preexec_fn=as_in_a_terminal)
    assert run.stderr.readline().startswith("…".encode())  # the first progress line
    run.stderr.close()
    out = run.stdout.read()
    return run.wait(60), out


def test_a_reader_gone_mid_clone_leaves_no_scratch_clone(project, upstream, tmp_path, tmpdir_env):
    parent = tmp_path / "work"
    wd = parent / "vllm"
    code, out = run_with_stderr_read_once(project, tmpdir_env, "--vllm-repo", str(upstream),
                                          "--workdir", str(wd))
    assert code == -signal.SIGPIPE and out == b""
    assert os.listdir(parent) == [] and os.listdir(tmp_path / "t") == []
    assert run_apply(project, Options(vllm_repo=str(upstream), workdir=wd)).published


def test_a_reader_gone_mid_am_leaves_the_checkout_and_no_worktree(long_series, upstream, tmp_path,
                                                                  tmpdir_env):
    wd = tmp_path / "wd"
    g(upstream, "clone", "-q", str(upstream), str(wd))
    before = snapshot(wd)
    code, out = run_with_stderr_read_once(long_series, tmpdir_env, "--vllm-repo", str(upstream),
                                          "--workdir", str(wd))
    assert code == -signal.SIGPIPE and out == b""
    assert snapshot(wd) == before and worktree_entries(wd) == [] and os.listdir(tmp_path / "t") == []
    assert run_apply(long_series, Options(vllm_repo=str(upstream), workdir=wd)).published


REBASE_RUNNER = ("import sys, importlib.util; from pathlib import Path; "
                 "from k3overlay.project import Project; "
                 "spec = importlib.util.spec_from_file_location('ci_rebase', 'ci/rebase.py'); "
                 "job = importlib.util.module_from_spec(spec); spec.loader.exec_module(job); "
                 "job.Project = lambda: Project(Path(sys.argv[1])); sys.exit(job.main(sys.argv[2:]))")


@pytest.mark.parametrize("runner", [RUNNER, REBASE_RUNNER])
def test_a_reader_of_stdout_gone_early_still_gets_the_report_files(project, upstream, tmp_path,
                                                                   tmpdir_env, runner):
    """``apply.py --json out.json | head -1``: the text report is cut short, the file is not
    (it used to be written after the text, and the closed pipe ended the tool first)."""
    out = tmp_path / "out.json"
    args = (["--vllm-repo", str(upstream), "--workdir", str(tmp_path / "wd"), "--json", str(out)]
            if runner == RUNNER else
            ["--onto", "v1.1.0", "--vllm-repo", str(upstream), "--no-tests", "--json", str(out),
             "--markdown", str(tmp_path / "out.md")])
    run = subprocess.Popen([sys.executable, "-c", runner, str(project.root), "-q", *args], cwd=ROOT,
                           env=tmpdir_env, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
                           preexec_fn=as_in_a_terminal)
    run.stdout.close()  # the reader is gone before the first line
    assert run.wait(60) == -signal.SIGPIPE
    report = json.loads(out.read_text())
    assert (report if runner == RUNNER else report[0])["ok"] is True
    assert runner == RUNNER or (tmp_path / "out.md").read_text().startswith("## vllm-k3-overlay")


def test_one_checkout_reached_by_two_names_takes_one_run_at_a_time(tmp_path, tmpdir_env, monkeypatch):
    # A bind mount gives one folder a second absolute path, hence a second path lock: the
    # folder's own lock (device, inode) still makes the second run wait.
    wd = tmp_path / "wd"
    wd.mkdir()
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    names = iter(["first-name", "second-name"])
    real_path = lock.workdir_lock_path
    monkeypatch.setattr(lock, "workdir_lock_path", lambda w: real_path(w).with_name(f"{next(names)}.lock"))
    said, order = [], []

    def second_run() -> None:
        with lock.workdir_lock(wd, say=said.append):
            order.append("second")

    with lock.workdir_lock(wd, say=said.append):
        thread = threading.Thread(target=second_run)
        thread.start()
        deadline = time.monotonic() + 10
        while not said and time.monotonic() < deadline:
            time.sleep(0.02)
        order.append("first")
    thread.join(timeout=10)
    assert order == ["first", "second"]
    assert said == [f"waiting for apply.py (pid {os.getpid()}) to finish with {wd}"]


def test_runs_read_the_project_together_and_an_export_waits_for_them(tmp_path):
    """Round 7's open list: a run on another checkout read patches/ and overlay/ while an
    export renamed them into place, unlocked. Readers now share the project's lock; the
    export's exclusive one waits until the last reader is done (and readers wait for it)."""
    from k3overlay import projectlock

    project = Project(tmp_path / "project")
    project.root.mkdir()
    said: list[str] = []
    events: list[str] = []
    with projectlock.reading(project, said.append), projectlock.reading(project, said.append):
        assert said == []  # two readers at once: neither waits

        def export() -> None:
            with projectlock.writing(project, said.append):
                events.append("export")

        writer = threading.Thread(target=export)
        writer.start()
        writer.join(1.0)
        assert writer.is_alive() and events == []  # it waits for the readers
        assert said and said[0].startswith("waiting for apply.py (pid ")
        events.append("readers done")
    writer.join(10)
    assert events == ["readers done", "export"]


def test_a_fresh_workdir_and_the_folder_it_becomes_share_the_lock_of_their_place(tmp_path):
    """Round 8: two runs into one new workdir under two names (a bind-mounted parent) did not
    wait for each other: the first locked no folder (none was there yet), so the second went
    on into its half-made clone. Both now lock the workdir's places (each existing folder above
    it by device and inode, then the names below it), before and after it exists; round 8b:
    also once the first run made the folders on its way (a place below the topmost only)."""
    new = tmp_path / "a" / "b" / "vllm"
    st = os.stat(tmp_path)
    before = lock._places(new)
    assert before[-1] == f"{st.st_dev}-{st.st_ino}/a/b/vllm" and len(before) == len(tmp_path.parents) + 1
    new.mkdir(parents=True)
    after = lock._places(new)
    st = os.stat(new.parent)
    assert after[-1] == f"{st.st_dev}-{st.st_ino}/vllm" and set(before) < set(after)
    said: list[str] = []
    with workdir_lock(new, said.append):
        held = sorted(p.name for p in (lock.cache_dir() / "locks").glob("place-*"))
        assert len(held) == len(after)
    assert said == []


def test_a_linked_worktree_is_claimed_in_its_own_git_folder(tmp_path):
    """Round 8b: a checkout that is a linked worktree (``.git`` a file) had no claim, so two
    runs under two caches both published to it. It is claimed in its own git folder."""
    from k3overlay import claim

    main, tree = tmp_path / "main", tmp_path / "wt"
    g(tmp_path, "init", "-q", str(main))
    g(main, "-c", "user.name=u", "-c", "user.email=u@invalid", "commit", "-q", "--allow-empty", "-m", "x")
    g(main, "worktree", "add", "-q", "--detach", str(tree))
    own = main / ".git" / "worktrees" / "wt"
    assert claim.git_folder(tree) == own and claim.git_folder(main) == main / ".git"
    said: list[str] = []
    events: list[str] = []
    with claim.claimed(tree, tmp_path / "a.journal", said.append, lambda _: None):
        assert (own / claim.FILE).exists()

        def second() -> None:  # another cache's run: its own journal path, the same claim
            with claim.claimed(tree, tmp_path / "b.journal", said.append, lambda _: None):
                events.append("second")

        other = threading.Thread(target=second)
        other.start()
        other.join(1.0)
        assert other.is_alive() and events == [] and said == [f"waiting for apply.py (pid {os.getpid()}) to "
                                                               f"finish with {tree}"]
        events.append("first done")
    other.join(10)
    assert events == ["first done", "second"]



@pytest.mark.parametrize("line", ["gitdir: {target}", "gitdir: ../..", "gitdir: " + "a/" * 3000,
                                  "gitdir: a\0b"])
def test_a_git_file_naming_no_git_folder_gets_no_claim(tmp_path, line):
    """Round 8b: a ``.git`` file whose ``gitdir:`` names any folder (``/etc`` as root) had the
    claim made there before the checkout was refused; a name too long was a traceback."""
    from k3overlay import claim

    target = tmp_path / "target"
    target.mkdir()
    top = tmp_path / "w" / "h1"
    top.mkdir(parents=True)
    (top / ".git").write_text(line.format(target=target) + "\n")
    assert claim.git_folder(top) is None
    with claim.claimed(top, tmp_path / "a.journal", print, lambda _: None):
        pass
    assert not list(tmp_path.rglob(claim.FILE))


@pytest.mark.parametrize("layout", ["separate-git-dir", "linked"])
def test_a_checkout_whose_git_folder_is_apart_is_claimed_and_runs_again(project, upstream, tmp_path, layout):
    """Round 9: a ``clone --separate-git-dir`` checkout (and a submodule's) had no claim, and
    every run after the first refused "branch k3 is checked out in the worktree …/sep.git"
    (git 2.39 lists the git folder as the main worktree's path)."""
    from k3overlay import claim

    wd, sep = tmp_path / "wd", tmp_path / "sep.git"
    if layout == "separate-git-dir":
        g(tmp_path, "clone", "-q", f"--separate-git-dir={sep}", str(upstream), str(wd))
        own = sep
    else:
        g(tmp_path, "clone", "-q", str(upstream), str(tmp_path / "main"))
        g(tmp_path / "main", "worktree", "add", "-q", "--detach", str(wd), "v1.0.0")
        own = tmp_path / "main" / ".git" / "worktrees" / "wd"
    assert claim.git_folder(wd) == own
    for _ in range(2):
        report = run_apply(project, Options(vllm_repo=str(upstream), workdir=wd, branch="k3"))
        assert report.ok, report.notes
    assert (own / claim.FILE).is_file() and g(wd, "symbolic-ref", "HEAD").strip() == "refs/heads/k3"


def test_a_checkout_whose_git_is_a_link_is_claimed_where_the_link_leads(tmp_path):
    """Round 9: ``.git`` a link to the git folder got no claim, so two runs under two caches
    both switched the checkout (and one reset the branch over the user's commit)."""
    from k3overlay import claim

    wd = tmp_path / "wd"
    g(tmp_path, "init", "-q", str(wd))
    (wd / ".git").rename(tmp_path / "wd.gitdir")
    (wd / ".git").symlink_to(tmp_path / "wd.gitdir")
    assert claim.git_folder(wd) == tmp_path / "wd.gitdir"


def test_a_git_folder_reached_by_any_mix_of_links_and_git_files_is_claimed(tmp_path):
    """Round 9c: a ``.git`` link to a ``.git`` file, and a ``.git`` file naming a link to the
    git folder (git follows both), got no claim: the commit loss of round 9b again."""
    from k3overlay import claim

    wd, real = tmp_path / "wd", tmp_path / "wd.gitdir"
    g(tmp_path, "init", "-q", str(wd))
    (wd / ".git").rename(real)
    (tmp_path / "gitfile").write_text(f"gitdir: {real}\n")
    (wd / ".git").symlink_to(tmp_path / "gitfile")
    assert claim.git_folder(wd) == real
    (wd / ".git").unlink()
    (tmp_path / "gd.link").symlink_to(real)
    (wd / ".git").write_text(f"gitdir: {tmp_path / 'gd.link'}\n")
    assert claim.git_folder(wd) == real
    # (9d) a link to a .git file naming the folder relative to the checkout, as git reads it;
    # a name with a leading space, which git keeps
    (wd / ".git").unlink()
    (tmp_path / "meta").mkdir()
    (tmp_path / "meta" / "gitfile").write_text("gitdir: ../wd.gitdir\n")
    (wd / ".git").symlink_to(tmp_path / "meta" / "gitfile")
    assert claim.git_folder(wd) == real
    (wd / ".git").unlink()
    real.rename(wd / " g")
    (wd / ".git").write_text("gitdir:  g\n")
    assert claim.git_folder(wd) == wd / " g"


def test_a_claim_naming_a_journal_no_file_can_be_is_refused_in_one_line(tmp_path):
    """Round 9d: a claim naming ``/x\\u0000y`` (or a lone surrogate) as its journal: a traceback on
    every run, ``--check`` too, from the lstat 109f920 put in lexists' place."""
    from k3overlay import claim, errors as errors_

    wd = tmp_path / "wd"
    g(tmp_path, "init", "-q", str(wd))
    for name in ("/x\0y", "/x\ud800y"):
        with pytest.raises(errors_.UsageError, match="which cannot be read"):
            claim._recover_elsewhere(Path(name), wd, lambda _: None)
    (wd / ".git" / claim.FILE).write_text("apply.py (pid 1)\n" + "[" * 30_000 + "\n")  # past the parser's depth
    with claim.claimed(wd, tmp_path / "j.journal", print, lambda _: None):
        pass


def test_a_refused_run_leaves_its_claim_naming_no_journal(project, upstream, tmp_path):
    """Round 9d: a run ending in a refusal left the claim naming its journal, removed by then:
    where that journal was root's (a sudo run), the user's next run was refused, "cannot be
    read", with nothing killed."""
    from k3overlay import claim, errors as errors_

    wd = tmp_path / "wd"
    assert run_apply(project, Options(vllm_repo=str(upstream), workdir=wd)).ok
    (wd / "pkg" / "user.py").write_text("mine\n")
    with pytest.raises(errors_.UsageError, match="uncommitted changes"):
        run_apply(project, Options(vllm_repo=str(upstream), workdir=wd, ref="v1.1.0"))
    assert (wd / ".git" / claim.FILE).read_text() == ""


def test_a_new_workdirs_claim_names_no_journal_once_the_run_ended(project, upstream, tmp_path):
    """Round 9d: the clone of a new workdir is claimed inside its journal's life, so after a
    clean run the claim still named the removed journal (a sudo run's: the user's next run
    was refused, "cannot be read")."""
    from k3overlay import claim

    wd = tmp_path / "wd"
    assert run_apply(project, Options(vllm_repo=str(upstream), workdir=wd)).ok
    assert (wd / ".git" / claim.FILE).read_text() == ""


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to give a folder to another user")
def test_a_git_folder_of_another_users_is_refused_in_one_line_not_claimed(tmp_path):
    """Round 9b: a ``.git`` file naming a folder of root's that anyone can write in had the
    user's claim made there, and the folder's owner, holding a claim file made first, kept the
    run waiting for ever; then (9c) such a folder got no claim, and two caches' runs switched
    the checkout at once. A folder another user owns is refused (git wants it the user's too)."""
    from k3overlay import claim, errors as errors_

    wd, other = tmp_path / "wd", tmp_path / "other"
    for sub in ("objects", "refs"):
        (other / sub).mkdir(parents=True)
    (other / "HEAD").write_text("ref: refs/heads/main\n")
    wd.mkdir()
    (wd / ".git").write_text(f"gitdir: {other}\n")
    other.chmod(0o777)
    assert claim.git_folder(wd) == other  # the user's own, shared with everyone: claimed
    os.chown(other, 65534, 65534)
    with pytest.raises(errors_.UsageError, match=r"is another user's \(uid 65534\): no run of this tool"):
        claim.git_folder(wd)


def test_a_branch_in_the_main_worktree_of_a_separate_git_folder_is_not_named_by_that_folder(
        project, upstream, tmp_path):
    """Round 9: from a linked worktree of a ``clone --separate-git-dir`` checkout, a work
    branch checked out in the main one was said to be "in the worktree …/sep.git", and the
    advice, ``--workdir …/sep.git``, was refused in turn (a git folder)."""
    from k3overlay import errors as errors_

    main, sep, linked = tmp_path / "main", tmp_path / "sep.git", tmp_path / "linked"
    g(tmp_path, "clone", "-q", f"--separate-git-dir={sep}", str(upstream), str(main))
    assert run_apply(project, Options(vllm_repo=str(upstream), workdir=main, branch="k3")).ok
    g(main, "worktree", "add", "-q", "--detach", str(linked), "v1.0.0")
    with pytest.raises(errors_.UsageError) as refused:
        run_apply(project, Options(vllm_repo=str(upstream), workdir=linked, branch="k3"))
    assert str(refused.value) == (
        f"branch k3 is checked out in the main worktree of {sep} (git does not record where its files "
        f"are); moving it from here would leave that worktree on the old files; run apply.py in that "
        f"worktree, or choose another with --branch")


def test_a_claims_journal_this_user_cannot_look_at_is_refused_not_taken_for_ended(tmp_path, monkeypatch):
    """Round 9c: a claim of root's naming a journal under /root/.cache, which the user cannot
    look at: ``lexists`` said no such file (any error is False), and the run went on as if that
    run had ended clean; a killed one's steps were then never finished or undone."""
    from k3overlay import claim, errors as errors_

    wd = tmp_path / "wd"
    g(tmp_path, "init", "-q", str(wd))
    hidden = tmp_path / "root-cache" / "vllm-k3-overlay" / "locks" / ("0" * 32 + ".journal")
    real_lstat = os.lstat

    def lstat(path, *args, **kwargs):
        if str(path) == str(hidden):
            raise PermissionError(13, "Permission denied", str(path))
        return real_lstat(path, *args, **kwargs)

    monkeypatch.setattr(claim.os, "lstat", lstat)
    with pytest.raises(errors_.UsageError, match=r"which cannot be read \(Permission denied\): not acted on"):
        claim._recover_elsewhere(hidden, wd, lambda _: None)


# -- Round 10: two runs at once on two worktrees of one repository (each claimed in its own git
# folder) both switched to the work branch: one branch checked out in two worktrees, and the
# user's next commit in one showed as a staged revert in the other (committing there undid it).


def two_worktrees(upstream: Path, tmp_path: Path) -> tuple[Path, Path]:
    main, linked = tmp_path / "main", tmp_path / "linked"
    g(tmp_path, "clone", "-q", str(upstream), str(main))
    g(main, "worktree", "add", "-q", "--detach", str(linked), "v1.0.0")
    return main, linked


def test_a_branch_another_worktrees_run_switched_to_meanwhile_is_refused_not_checked_out_twice(
        project, upstream, tmp_path, monkeypatch):
    from k3overlay import errors, job

    main, linked = two_worktrees(upstream, tmp_path)
    real = job.publish

    def another_run_switched_first(repo, branch, sha, ref):  # after this run's start-of-run check
        g(main, "checkout", "-q", "-B", branch, "v1.0.0")
        real(repo, branch, sha, ref)

    monkeypatch.setattr(job, "publish", another_run_switched_first)
    head = g(linked, "rev-parse", "HEAD")
    with pytest.raises(errors.UsageError) as err:
        run_apply(project, Options(vllm_repo=str(upstream), workdir=linked, branch="k3"))
    assert str(err.value).startswith(f"branch k3 is checked out in the worktree {main}; ")
    assert g(linked, "rev-parse", "HEAD") == head and g(linked, "status", "--porcelain") == ""
    assert g(main, "symbolic-ref", "HEAD").strip() == "refs/heads/k3"


def test_a_switch_waits_for_one_in_another_worktree_of_the_repository(project, upstream, tmp_path):
    import fcntl

    from k3overlay.publish import SWITCH_LOCK

    main, linked = two_worktrees(upstream, tmp_path)
    fd = os.open(main / ".git" / SWITCH_LOCK, os.O_RDWR | os.O_CREAT, 0o644)
    fcntl.flock(fd, fcntl.LOCK_EX)  # the main worktree's run, switching
    reports: list = []
    other = threading.Thread(target=lambda: reports.append(
        run_apply(project, Options(vllm_repo=str(upstream), workdir=linked, branch="k3"))))
    other.start()
    other.join(3.0)
    try:
        assert other.is_alive() and g(linked, "rev-parse", "--abbrev-ref", "HEAD").strip() == "HEAD"
    finally:
        fcntl.flock(fd, fcntl.LOCK_UN)
        os.close(fd)
    other.join(30)
    assert reports and reports[0].ok and g(linked, "symbolic-ref", "HEAD").strip() == "refs/heads/k3"


def test_a_new_workdir_another_cache_run_placed_first_is_said_so(project, upstream, tmp_path, monkeypatch):
    """Round 10: two runs into one new ``--workdir`` under two caches (their locks apart) each
    cloned beside it; the one that placed its clone second ended "cannot put the clone at
    --workdir X: Directory not empty", as if the folder were the user's doing."""
    from k3overlay import errors, git

    wd, clone = tmp_path / "wd", git.clone

    def the_other_run_placed_first(origin, dest):
        repo = clone(origin, dest)
        g(tmp_path, "clone", "-q", str(upstream), str(wd))  # the other cache's run, meanwhile
        return repo

    monkeypatch.setattr(git, "clone", the_other_run_placed_first)
    with pytest.raises(errors.UsageError) as err:
        run_apply(project, Options(vllm_repo=str(upstream), workdir=wd))
    assert str(err.value) == f"{wd} was made by another run while this one cloned it: run again"
    assert g(wd, "status", "--porcelain") == "" and g(wd, "rev-parse", "--abbrev-ref", "HEAD").strip() == "main"
    assert [p.name for p in tmp_path.iterdir() if ".k3-clone-" in p.name] == []  # its own clone: gone
