"""Transports: only https, ssh, git, file and local paths; nothing waits on a terminal or a descriptor."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from k3overlay import cli, errors, gitconfig, gitproc

ROOT = Path(__file__).resolve().parent.parent


def _apply(project: Path, *args: str, env: dict | None = None, timeout: int = 60):
    """apply.py on ``project`` in a child process (a hang is a timeout, not a stuck suite)."""
    code = ("import sys; from pathlib import Path; from k3overlay import cli, project\n"
            "cli.Project = lambda: project.Project(Path(sys.argv[1]))\n"
            "sys.exit(cli.main(sys.argv[2:]))")
    return subprocess.run([sys.executable, "-c", code, str(project), *args], cwd=ROOT, env=env,
                          stdin=subprocess.PIPE, capture_output=True, text=True, timeout=timeout)


def test_fd_transport_is_refused_at_once_not_a_hang(project, tmp_path):
    # stdin is an open pipe nobody writes to: git's fd::0 used to wait on it for ever
    proc = _apply(project.root, "-q", "--vllm-repo", "fd::0", "--workdir", str(tmp_path / "wd"),
                  "--json", str(tmp_path / "r.json"), timeout=30)
    assert proc.returncode == errors.USAGE, proc.stderr
    assert proc.stderr.splitlines() == ["apply.py: error: --vllm-repo 'fd::0': the 'fd::' transport "
                                        "is not allowed; give an https, ssh or git URL or a local path"]
    assert not (tmp_path / "wd").exists() and "fd::" in (tmp_path / "r.json").read_text()
    # Refused before any work, the report still names the base and the ref the run was for
    # (the pinned base: no --vllm-ref was given), never an empty one.
    data = json.loads((tmp_path / "r.json").read_text())
    base = json.loads((project.root / "overlay.json").read_text())["base"]
    assert data["base_ref"] == data["ref"] == base and base


@pytest.mark.parametrize("source, said", [
    ("ext::sh -c touch% {pwned}", "the 'ext::' transport"),
    ("fd::3,4", "the 'fd::' transport"),
    ("gcrypt::https://127.0.0.1:9/x", "the 'gcrypt::' transport"),
    ("https+evil::x", "the 'https+evil::' transport"),
    ("http://127.0.0.1:9/up.git", "the 'http' transport"),
    ("ftp://127.0.0.1:9/up.git", "the 'ftp' transport"),
    ("rsync://127.0.0.1:9/up.git", "the 'rsync' transport"),
    ("evil://127.0.0.1:9/up.git", "the 'evil' transport"),  # would run git-remote-evil
    ("-oProxyCommand=touch {pwned}", "starts with '-'"),
    ("https://h/x\nevil", "control character"),
])
def test_other_transports_are_refused_in_one_line_before_git_runs(project, tmp_path, monkeypatch,
                                                                  capsys, source, said):
    monkeypatch.setattr(cli, "Project", lambda: project)
    pwned = tmp_path / "pwned"
    code = cli.main(["-q", "--vllm-repo", source.format(pwned=pwned), "--workdir", str(tmp_path / "wd")])
    err = capsys.readouterr().err
    assert code == errors.USAGE and said in err and len(err.splitlines()) == 1
    assert not pwned.exists() and not (tmp_path / "wd").exists()


@pytest.mark.parametrize("prefix", ["", "file://"])
def test_a_fifo_as_the_source_is_refused_not_waited_on(project, tmp_path, prefix):
    fifo = tmp_path / "up.git"
    os.mkfifo(fifo)
    proc = _apply(project.root, "-q", "--check", "--vllm-repo", prefix + str(fifo), "--workdir",
                  str(tmp_path / "wd"), timeout=30)
    assert proc.returncode == errors.USAGE and "neither a folder nor a file" in proc.stderr


@pytest.mark.parametrize("target", ["ext::sh -c touch% {pwned}", "http://127.0.0.1:9/up.git"])
def test_an_insteadof_of_the_users_cannot_reach_a_refused_transport(project, tmp_path, monkeypatch,
                                                                    capsys, target):
    pwned = tmp_path / "pwned"
    config = tmp_path / "gitconfig"
    config.write_text(f'[url "{target.format(pwned=pwned)}"]\n\tinsteadOf = https://mirror.invalid/\n')
    monkeypatch.setenv("GIT_CONFIG_GLOBAL", str(config))
    monkeypatch.setenv("GIT_CONFIG_NOSYSTEM", "1")
    monkeypatch.setattr(cli, "Project", lambda: project)
    code = cli.main(["-q", "--vllm-repo", "https://mirror.invalid/up.git", "--workdir",
                     str(tmp_path / "wd")])
    err = capsys.readouterr().err
    assert code in (errors.USAGE, errors.SOURCE) and "not allowed" in err and len(err.splitlines()) == 1
    assert not pwned.exists() and not (tmp_path / "wd").exists()


def test_no_git_asks_anyone_for_a_password(tmp_path, monkeypatch):
    asked = tmp_path / "asked"
    askpass = tmp_path / "askpass"
    askpass.write_text(f"#!/bin/sh\ntouch {asked}\nsleep 30\necho secret\n")
    askpass.chmod(0o755)
    config = tmp_path / "gitconfig"
    config.write_text(f"[core]\n\taskPass = {askpass}\n")
    for key, value in {"GIT_ASKPASS": askpass, "SSH_ASKPASS": askpass, "GIT_TERMINAL_PROMPT": "1",
                       "GIT_CONFIG_GLOBAL": config, "GIT_CONFIG_NOSYSTEM": "1",
                       "GIT_ALLOW_PROTOCOL": "ext:http", "DISPLAY": ":0"}.items():
        monkeypatch.setenv(key, str(value))
    status, _, err = gitproc._execute(["credential", "fill"], cwd=tmp_path,
                                      stdin=b"protocol=https\nhost=example.invalid\n\n")
    assert status != 0 and b"terminal prompts disabled" in err and not asked.exists()
    env = gitproc._environment(None)
    assert env["GIT_ALLOW_PROTOCOL"] == "https:ssh:git:file" and env["GIT_PROTOCOL_FROM_USER"] == "0"
    assert "SSH_ASKPASS" not in env and "GIT_ASKPASS" not in env
    assert env["GIT_SSH_COMMAND"] == "ssh -o BatchMode=yes" and env["SSH_ASKPASS_REQUIRE"] == "never"


@pytest.mark.parametrize("entry", ["[http]\n\tsslVerify\n",
                                   '[http "https://example.invalid"]\n\tsslVerify\n'])
def test_a_carried_boolean_without_a_value_stays_true(tmp_path, monkeypatch, entry):
    """Round 7: ``[http] sslVerify`` with no ``=`` is true for the user's git; carried over as an
    empty value (GIT_CONFIG_VALUE_N=), it was false for the tool's: certificates went unverified."""
    config = tmp_path / "gitconfig"
    config.write_text(entry)
    monkeypatch.setenv("GIT_CONFIG_GLOBAL", str(config))
    key = "http.sslverify" if entry.startswith("[http]") else "http.https://example.invalid.sslverify"
    status, out, _ = gitproc._execute(["config", "--bool", key], cwd=tmp_path)
    assert status == 0 and out.strip() == b"true"


def test_a_valueless_safe_directory_still_empties_the_list(tmp_path, monkeypatch):
    """A valueless ``safe.directory`` in the global config empties the list the system's ``*``
    began, as an empty one does (the user's git then trusts no other user's repository);
    carried as ``true`` (a path that matches nothing) it revoked nothing for the tool's git."""
    (tmp_path / "system").write_text("[safe]\n\tdirectory = *\n")
    (tmp_path / "global").write_text("[safe]\n\tdirectory\n")
    monkeypatch.delenv("GIT_CONFIG_NOSYSTEM", raising=False)
    monkeypatch.setenv("GIT_CONFIG_SYSTEM", str(tmp_path / "system"))
    monkeypatch.setenv("GIT_CONFIG_GLOBAL", str(tmp_path / "global"))
    status, out, _ = gitproc._execute(["config", "--get-all", "safe.directory"], cwd=tmp_path)
    assert status == 0 and out.decode().split("\n")[:2] == ["*", ""]


def test_a_setting_the_global_config_includes_for_a_folder_is_carried_in_its_repositories(tmp_path,
                                                                                          monkeypatch):
    """``[includeIf "gitdir:~/work/"]`` (an email, a credential helper for the work folder): the
    user's git reads it in the repositories there, and so does the tool's, not elsewhere. It was
    read in ``/``, where such a condition matches nothing: the helper never ran."""
    work, other = tmp_path / "work" / "vllm", tmp_path / "other"
    clean = {"PATH": os.environ["PATH"], "GIT_CONFIG_NOSYSTEM": "1", "GIT_CONFIG_GLOBAL": os.devnull}
    for repo in (work, other):
        subprocess.run(["git", "init", "-q", str(repo)], check=True, env=clean)
    (tmp_path / "work.inc").write_text("[credential]\n\thelper = work-helper\n")
    include = f'[includeIf "gitdir:{tmp_path}/work/"]\n\tpath = {tmp_path}/work.inc\n'
    (tmp_path / "global").write_text(include)
    monkeypatch.setenv("GIT_CONFIG_GLOBAL", str(tmp_path / "global"))
    status, out, _ = gitproc._execute(["config", "--get-all", "credential.helper"], cwd=work)
    assert status == 0 and out.strip() == b"work-helper"
    status, out, _ = gitproc._execute(["config", "--get-all", "credential.helper"], cwd=other)
    assert out.strip() == b""


def test_a_users_own_ssh_command_is_kept(monkeypatch):
    monkeypatch.setenv("GIT_SSH_COMMAND", "ssh -i /keys/ci")
    assert gitproc._environment(None)["GIT_SSH_COMMAND"] == "ssh -i /keys/ci"


def test_git_reads_nothing_from_the_tools_stdin(tmp_path):
    # a git that reads its stdin (an alias here; a remote helper, ssh) gets /dev/null, never ours
    proc = subprocess.run(
        [sys.executable, "-c", "import sys; from k3overlay import gitproc; "
         "print(gitproc._execute(['-c', 'alias.rd=!cat', 'rd'], cwd=sys.argv[1])[1])", str(tmp_path)],
        cwd=ROOT, stdin=subprocess.PIPE, capture_output=True, text=True, timeout=30)
    assert proc.returncode == 0 and proc.stdout.strip() == "b''"


@pytest.mark.parametrize("kind", ["sparse 20 GB, no newline", "empty", "a text file",
                                  "a bundle cut after its line"])
def test_a_file_that_is_no_bundle_is_refused_at_once_not_read_whole(project, upstream, tmp_path, monkeypatch,
                                                                    capsys, kind):
    # git reads a file's first line whole, byte by byte, to tell a bundle: a 20 GB sparse file
    # held the run past 5 minutes (and its size in memory)
    monkeypatch.setattr(cli, "Project", lambda: project)
    path = tmp_path / "up.bundle"
    if kind.startswith("sparse"):
        with open(path, "wb") as f:
            f.truncate(20 << 30)
    elif kind == "a bundle cut after its line":
        path.write_bytes(b"# v2 git bundle\n")
    else:
        path.write_bytes(b"" if kind == "empty" else b"not a bundle\n")
    escaped = f"file://localhost{path.parent}/%75p.bundle"  # git drops the host, decodes %75 (u)
    for source in (str(path), f"file://{path}", escaped):
        code = cli.main(["--vllm-repo", source, "--vllm-ref", "v1.1.0", "--workdir", str(tmp_path / "wd")])
        err = capsys.readouterr().err.strip().splitlines()
        if kind == "a bundle cut after its line":  # a bundle to the check: git says what is wrong
            assert code in (errors.USAGE, errors.SOURCE) and err[-1].startswith("apply.py: error: "), err
        else:
            assert code == errors.USAGE and "is a file but not a git bundle" in err[-1], err
        assert not (tmp_path / "wd").exists()


def test_a_real_bundle_is_taken(project, upstream, tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(cli, "Project", lambda: project)
    bundle = tmp_path / "up.bundle"
    subprocess.run(["git", "bundle", "create", str(bundle), "--all"], cwd=upstream, check=True,
                   capture_output=True)
    assert cli.main(["--vllm-repo", str(bundle), "--vllm-ref", "v1.1.0",
                     "--workdir", str(tmp_path / "wd")]) == errors.OK


def _config_files(tmp_path: Path) -> dict[str, tuple[dict[str, str | None], str]]:
    """Each file git reads the user's config from made a FIFO (or a folder, a device): the
    variables that point git at it (None: unset), and what the refusal names."""
    fifo, home, xdg_home, xdg = tmp_path / "fifo", tmp_path / "home", tmp_path / "xdg-home", tmp_path / "xdg"
    os.mkfifo(fifo)
    for path in (home / ".gitconfig", xdg_home / ".config" / "git" / "config", xdg / "git" / "config"):
        path.parent.mkdir(parents=True, exist_ok=True)
        os.mkfifo(path)
    (tmp_path / "link").symlink_to(fifo)
    (tmp_path / "folder").mkdir()
    wait = "is a FIFO, not a file; git would wait on it forever"
    global_files = {"GIT_CONFIG_GLOBAL": None, "XDG_CONFIG_HOME": None}
    return {
        "GIT_CONFIG_GLOBAL a FIFO": ({"GIT_CONFIG_GLOBAL": str(fifo)}, f"GIT_CONFIG_GLOBAL {fifo} {wait}"),
        "GIT_CONFIG_GLOBAL a link to a FIFO": ({"GIT_CONFIG_GLOBAL": str(tmp_path / "link")},
                                               f"GIT_CONFIG_GLOBAL {tmp_path / 'link'} {wait}"),
        "~/.gitconfig a FIFO": (global_files | {"HOME": str(home)},
                                f"the global config {home}/.gitconfig {wait}"),
        "~/.config/git/config a FIFO": (global_files | {"HOME": str(xdg_home)},
                                        f"the global config {xdg_home}/.config/git/config {wait}"),
        "$XDG_CONFIG_HOME/git/config a FIFO": (
            global_files | {"HOME": str(tmp_path), "XDG_CONFIG_HOME": str(xdg)},
            f"the global config ($XDG_CONFIG_HOME/git/config) {xdg}/git/config {wait}"),
        "GIT_CONFIG_SYSTEM a FIFO": ({"GIT_CONFIG_NOSYSTEM": None, "GIT_CONFIG_SYSTEM": str(fifo)},
                                    f"GIT_CONFIG_SYSTEM {fifo} {wait}"),
        "GIT_CONFIG_GLOBAL a folder": ({"GIT_CONFIG_GLOBAL": str(tmp_path / "folder")},
                                       f"GIT_CONFIG_GLOBAL {tmp_path / 'folder'} is a folder, not a file; "
                                       f"git cannot read it"),
        "GIT_CONFIG_GLOBAL a device": ({"GIT_CONFIG_GLOBAL": "/dev/zero"},
                                       "GIT_CONFIG_GLOBAL /dev/zero is a device, not a file; git would read "
                                       "it as config, or wait on it"),
    }


CONFIG_CASES = ["GIT_CONFIG_GLOBAL a FIFO", "GIT_CONFIG_GLOBAL a link to a FIFO", "~/.gitconfig a FIFO",
                "~/.config/git/config a FIFO", "$XDG_CONFIG_HOME/git/config a FIFO",
                "GIT_CONFIG_SYSTEM a FIFO", "GIT_CONFIG_GLOBAL a folder", "GIT_CONFIG_GLOBAL a device"]


@pytest.mark.parametrize("case", CONFIG_CASES)
def test_a_config_file_git_would_wait_on_is_refused_at_once(project, upstream, tmp_path, case):
    """``GIT_CONFIG_GLOBAL=/tmp/fifo apply.py``: nothing was said for minutes. GitPython's import
    ran ``git version`` as the user runs git, which opened the FIFO and waited for a writer
    forever; past that, each read of the user's config waited 30 s, again in ``/``, folder
    after folder. A folder or a device there is no config either."""
    variables, said = _config_files(tmp_path)[case]
    env = {**os.environ, **{k: v for k, v in variables.items() if v is not None}}
    for key in [k for k, v in variables.items() if v is None]:
        env.pop(key, None)
    proc = _apply(project.root, "-q", "--check", "--vllm-repo", str(upstream), "--workdir",
                  str(tmp_path / "wd"), env=env, timeout=20)
    assert proc.returncode == errors.USAGE and proc.stderr == f"apply.py: error: {said}\n", proc.stderr
    assert not (tmp_path / "wd").exists()


def test_the_rebase_job_refuses_a_fifo_as_the_config_at_once(upstream, tmp_path):
    os.mkfifo(tmp_path / "fifo")
    env = {**os.environ, "GIT_CONFIG_GLOBAL": str(tmp_path / "fifo")}
    proc = subprocess.run([sys.executable, "-m", "ci.rebase", "--onto", "v1.1.0", "--no-tests", "--vllm-repo",
                           str(upstream)], cwd=ROOT, env=env, capture_output=True, text=True, timeout=20)
    assert proc.returncode == errors.USAGE and proc.stderr == (
        f"rebase.py: error: GIT_CONFIG_GLOBAL {tmp_path / 'fifo'} is a FIFO, not a file; git would wait "
        f"on it forever\n"), proc.stderr


def test_dev_null_a_link_to_a_file_or_nothing_is_config_git_reads(tmp_path, monkeypatch):
    """Only what git would wait on or cannot read is refused: ``/dev/null`` (git reads it as
    empty: the tool's own gits are run so), a link to a file, a path with nothing there, an
    empty variable, and a system file with ``GIT_CONFIG_NOSYSTEM`` (git reads none) are config."""
    config = tmp_path / "gitconfig"
    config.write_text("[credential]\n\thelper = mine\n")
    (tmp_path / "link").symlink_to(config)
    os.mkfifo(tmp_path / "fifo")
    monkeypatch.setenv("GIT_CONFIG_SYSTEM", str(tmp_path / "fifo"))  # GIT_CONFIG_NOSYSTEM=1 here
    for given in (os.devnull, str(tmp_path / "missing"), "", str(tmp_path / "link")):
        monkeypatch.setenv("GIT_CONFIG_GLOBAL", given)
        gitproc.refuse_unreadable_config()
    assert ("credential.helper", "mine") in gitproc._carried_config(gitproc._config_location(), str(tmp_path))
    monkeypatch.setenv("GIT_CONFIG_NOSYSTEM", "0")  # git's false: the system file is read
    with pytest.raises(errors.UsageError, match=r"^GIT_CONFIG_SYSTEM \S+/fifo is a FIFO, not a file"):
        gitproc.refuse_unreadable_config()


def test_a_config_read_that_stalls_stops_the_run_once_not_folder_after_folder(project, upstream, tmp_path,
                                                                              monkeypatch, capsys):
    """A FIFO git finds only by reading the config (an include of one; a file on a stalled mount)
    cost 30 s per read, each tried again in ``/``, for every folder a git ran in: minutes of
    silence. The first read that stalls now stops the run, in one line; none is tried again."""
    monkeypatch.setattr(cli, "Project", lambda: project)
    os.mkfifo(tmp_path / "fifo")
    (tmp_path / "gitconfig").write_text(f"[include]\n\tpath = {tmp_path / 'fifo'}\n")
    monkeypatch.setenv("GIT_CONFIG_GLOBAL", str(tmp_path / "gitconfig"))  # a file: only git finds the FIFO
    monkeypatch.setattr(gitproc, "_CONFIG_WAIT_S", 2)
    monkeypatch.setattr(gitproc, "_stalled", set())
    # (an include of a FIFO is now refused before any read: this stands for what no look at the
    # files finds, a stalled mount)
    monkeypatch.setattr(gitconfig, "refuse_unreadable_includes", lambda name, config: None)
    stalled, run = [], subprocess.run

    def counted(*args, **kwargs):
        try:
            return run(*args, **kwargs)
        except subprocess.TimeoutExpired:
            stalled.append(args[0])
            raise

    monkeypatch.setattr(subprocess, "run", counted)
    code = cli.main(["-q", "--check", "--vllm-repo", str(upstream), "--workdir", str(tmp_path / "wd")])
    assert code == errors.USAGE and capsys.readouterr().err == (
        "apply.py: error: git took over 2 s to read your git config: does it include a FIFO, or a file "
        "on a stalled mount? Fix that, or point GIT_CONFIG_GLOBAL at another file\n")
    assert len(stalled) == 1 and not (tmp_path / "wd").exists()
    assert not gitproc.user_has_identity()  # (asked by a report's next commands: no wait there either)


CHECKOUT_CASES = {  # how the checkout's config reaches the FIFO (``{fifo}``), in git config lines
    "include.path": "[include]\n\tpath = {fifo}\n",
    "a relative include": "[include]\n\tpath = ../../fifo\n",
    "includeIf gitdir": '[includeIf "gitdir:/nowhere/"]\n\tpath = {fifo}\n',
    "an include of a file including it": "[include]\n\tpath = {tmp}/second\n",
    "~/ from HOME": "[include]\n\tpath = ~/fifo\n",
    "~USER/ from their home": "[include]\n\tpath = ~{user}/{home_rel}/fifo\n",  # (round 10b: a hang)
}


@pytest.mark.parametrize("case", sorted(CHECKOUT_CASES))
def test_a_checkout_whose_config_includes_a_fifo_is_refused_at_once(project, upstream, tmp_path, case):
    """Round 9's open point: a checkout whose ``.git/config`` includes a FIFO (at any depth,
    under any condition: git is not asked which apply) hung the run before it said a word,
    GitPython's read of the config waiting for a writer forever; then each git there."""
    wd = tmp_path / "wd"
    subprocess.run(["git", "clone", "-q", str(upstream), str(wd)], check=True, capture_output=True)
    os.mkfifo(tmp_path / "fifo")
    (tmp_path / "second").write_text(f"[include]\n\tpath = {tmp_path / 'fifo'}\n")
    import pwd

    user = pwd.getpwuid(os.geteuid())
    home_rel = os.path.relpath(tmp_path, user.pw_dir)
    with open(wd / ".git" / "config", "a") as config:
        config.write(CHECKOUT_CASES[case].format(fifo=tmp_path / "fifo", tmp=tmp_path, user=user.pw_name,
                                                 home_rel=home_rel))
    before = (wd / ".git" / "config").read_bytes()
    for extra in (["--check"], []):
        proc = _apply(project.root, "-q", *extra, "--vllm-repo", str(upstream), "--workdir", str(wd),
                      env={**os.environ, "HOME": str(tmp_path)}, timeout=20)
        assert proc.returncode == errors.USAGE, proc.stderr
        via = tmp_path / "second" if case.startswith("an include of a file") else wd / ".git" / "config"
        shown = {"a relative include": wd / ".git" / "../../fifo",
                 "~USER/ from their home": Path(user.pw_dir) / home_rel / "fifo"}.get(case, tmp_path / "fifo")
        assert proc.stderr == (f"apply.py: error: the config of {wd}, {via} includes {shown}, "
                               f"which is a FIFO, not a file; git would wait on it forever\n"), proc.stderr
    assert (wd / ".git" / "config").read_bytes() == before


def test_a_global_config_including_a_fifo_is_refused_at_once_not_after_30_s(project, upstream, tmp_path):
    os.mkfifo(tmp_path / "fifo")
    (tmp_path / "gitconfig").write_text(f"[include]\n\tpath = {tmp_path / 'fifo'}\n")
    env = {**os.environ, "GIT_CONFIG_GLOBAL": str(tmp_path / "gitconfig")}
    proc = _apply(project.root, "-q", "--check", "--vllm-repo", str(upstream), "--workdir", str(tmp_path / "wd"),
                  env=env, timeout=20)
    assert proc.returncode == errors.USAGE and proc.stderr == (
        f"apply.py: error: GIT_CONFIG_GLOBAL {tmp_path / 'gitconfig'} includes {tmp_path / 'fifo'}, which is "
        f"a FIFO, not a file; git would wait on it forever\n"), proc.stderr


@pytest.mark.parametrize("shape", ["file://{at}/up.git", "file://localhost{at}/up.git",
                                   "https://vllm.invalid/a/up.git@other.invalid/x"])
def test_an_at_in_the_source_path_is_kept_in_the_stored_origin(project, upstream, tmp_path, monkeypatch,
                                                              capsys, shape):
    """Round 10: the user info of a source was taken as everything up to its last @, so a
    folder named ``at@dir`` was shown as masked credentials ("cloning file://***@dir/…") and
    the checkout's ``remote.origin.url`` became ``file://dir/up.git`` (a later ``git fetch
    origin`` failed), and ``https://host/a.git@other/x`` was stored as ``https://other/x``
    (the user's next fetch went to another host). git reads user info from the authority
    only (up to the first / after ``scheme://``): the tool now reads it so too."""
    from .test_redact import _user_git_config

    at = tmp_path / "at@dir"
    at.mkdir()
    subprocess.run(["git", "clone", "-q", "--bare", str(upstream), str(at / "up.git")], check=True,
                   capture_output=True)
    url = shape.format(at=at)
    _user_git_config(tmp_path, monkeypatch, f'[url "{at / "up.git"}"]\n\tinsteadOf = {url}\n'
                     if url.startswith("https") else "")
    monkeypatch.setattr(cli, "Project", lambda: project)
    wd = tmp_path / "wd"
    assert cli.main(["--vllm-repo", url, "--vllm-ref", "v1.1.0", "--workdir", str(wd)]) == errors.OK
    err = capsys.readouterr().err
    assert f"cloning {url} into" in err and "***" not in err, err
    assert gitproc.run(gitproc.open_repo(wd), "config", "remote.origin.url").strip() == url
    fetch = subprocess.run(["git", "-C", str(wd), "fetch", "-q", "origin", "v1.2.0"], capture_output=True,
                           text=True)
    assert fetch.returncode == 0, fetch.stderr


@pytest.mark.parametrize("name", ["HEAD", "packed-refs", "commondir"])
def test_a_git_folder_file_git_reads_at_start_that_is_a_fifo_is_refused_at_once(project, upstream, tmp_path, name):
    """Round 10b: ``.git/packed-refs`` (or ``HEAD``, ``commondir``) a FIFO hung the run, silently."""
    wd = tmp_path / "wd"
    subprocess.run(["git", "clone", "-q", str(upstream), str(wd)], check=True, capture_output=True)
    (wd / ".git" / name).unlink(missing_ok=True)
    os.mkfifo(wd / ".git" / name)
    proc = _apply(project.root, "-q", "--check", "--vllm-repo", str(upstream), "--workdir", str(wd), timeout=20)
    assert proc.returncode == errors.USAGE and proc.stderr == (
        f"apply.py: error: {wd / '.git' / name}, a file of the git folder of {wd}, is a FIFO, not a file; git "
        f"would wait on it forever\n"), proc.stderr
