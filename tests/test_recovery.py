"""A recovery no stronger than a normal run (issue 25, items 1-5, 7, 20): between a killed run
and the next the user edits, stages, commits, stashes, switches branches or runs git; the
next run finishes the killed switch only where a normal run could make it, acts only on its
own checkout's journal, under that checkout's lock, and never deletes a lock it did not take.
Every kill is real (``test_crash``'s harness: the run SIGKILLs itself at a recorded step)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
from pathlib import Path

import pytest

from k3overlay import cli, errors, journal
from k3overlay.downloads import ReleaseFiles
from k3overlay.export import export
from k3overlay.job import Options, run_apply
from k3overlay.lock import workdir_lock_path
from k3overlay.mirror import ReleaseMirror
from k3overlay.rebase import rebase_to

from .conftest import MOD_BASE, USER, commit_tag, g, model, snapshot
from .test_crash import NOTE, run_tool

REF = ["--vllm-ref", "v1.1.0"]
EDIT = "an edit of the user's, made after the crash\n"
DIRTY = "has uncommitted changes; commit or stash them first (or use --check)"
FOREIGN = "has commits apply.py did not write"


@pytest.fixture
def env(tmp_path) -> dict[str, str]:
    """The harness's environment (``test_crash``): TMPDIR of the test's own."""
    (tmp_path / "t").mkdir()
    return {**os.environ, "TMPDIR": str(tmp_path / "t")}


def killed(project, upstream, wd: Path, env, point: str, *extra: str) -> list[str]:
    """Publish at v1.0.0 into ``wd``, then a run onto v1.1.0 killed at ``point``; its args."""
    if not wd.exists():
        assert run_apply(project, Options(vllm_repo=str(upstream), workdir=wd)).ok
    args = ["-q", "--vllm-repo", str(upstream), "--workdir", str(wd), *REF, *extra]
    assert run_tool(project, {**env, journal.KILL_AT: point}, *args).returncode == -signal.SIGKILL
    return args


def refused(run: subprocess.CompletedProcess, wd: Path, message: str) -> None:
    """The rerun stopped as a normal run would (exit 2, its one-line error) after one note
    naming what the killed run left."""
    lines = run.stderr.splitlines()
    assert run.returncode == errors.USAGE, run.stderr
    assert len(lines) == 2 and lines[0].startswith(f"{NOTE}it was switching {wd} to "), lines
    assert lines[0].endswith(": left as it is") and lines[1].startswith("apply.py: error: ")
    assert message in lines[1], lines


@pytest.mark.parametrize("point", ["publish", "publish.switched"])
@pytest.mark.parametrize("how", ["edited", "staged"])
def test_a_file_the_switch_writes_edited_since_is_never_forced_over(project, upstream, tmp_path,
                                                                   env, point, how):
    """Item 1: pkg/model.txt differs between the two results; the rerun used to check it out
    by force and the edit was gone (a normal run refuses a dirty checkout)."""
    wd = tmp_path / "wd"
    args = killed(project, upstream, wd, env, point)
    (wd / "pkg/model.txt").write_text(EDIT)
    if how == "staged":
        g(wd, "add", "pkg/model.txt")
    before = snapshot(wd)
    refused(run_tool(project, env, *args), wd, DIRTY)
    assert snapshot(wd) == before and (wd / "pkg/model.txt").read_text() == EDIT
    assert workdir_lock_path(wd).with_suffix(".journal").exists()  # the next run still knows


def _new_content(wd: Path, path: str) -> bytes:
    """``path`` as the commit the killed switch was checking out has it (its journal says which)."""
    lines = workdir_lock_path(wd).with_suffix(".journal").read_text().splitlines()
    [sha] = [entry["sha"] for entry in map(json.loads, lines) if entry.get("step") == "publish"]
    return subprocess.run(["git", "show", f"{sha}:{path}"], cwd=wd, check=True, capture_output=True).stdout


def _first_lines(data: bytes) -> bytes:
    return b"".join(data.splitlines(keepends=True)[:2])


def names(run: subprocess.CompletedProcess, path: str) -> None:
    """The refusal names ``path`` as the file the switch would overwrite, and how to drop it."""
    error = run.stderr.splitlines()[-1]
    assert f"would overwrite {path}, which holds neither its old nor its new content" in error, error
    assert "`git checkout -- FILE` drops that" in error, error


@pytest.mark.parametrize("how", ["emptied", "cut to its first lines"])
def test_a_file_emptied_or_cut_short_after_a_kill_before_git_wrote_is_the_users_and_is_kept(
        project, upstream, tmp_path, env, how):
    """The tester's case: killed at 'publish', before git's checkout wrote anything; the user
    then empties pkg/model.txt (or cuts it to its first two lines, "line 1 (upstream)" and
    "line 2": the start of the new content). The rerun took any prefix of the new content for the file git was
    writing, forced the checkout over it and said "finished": the edit was gone. The journal
    cannot tell git's write from the user's, so a normal run's refusal, the file named."""
    wd = tmp_path / "wd"
    args = killed(project, upstream, wd, env, "publish")
    full = _new_content(wd, "pkg/model.txt")
    mine = b"" if how == "emptied" else _first_lines(full)
    assert full.startswith(mine) and mine != full and mine != (wd / "pkg/model.txt").read_bytes()
    (wd / "pkg/model.txt").write_bytes(mine)
    assert g(wd, "status", "--porcelain") == " M pkg/model.txt\n"
    before = snapshot(wd)
    run = run_tool(project, env, *args)
    refused(run, wd, DIRTY)
    names(run, "pkg/model.txt")
    assert snapshot(wd) == before and (wd / "pkg/model.txt").read_bytes() == mine
    assert workdir_lock_path(wd).with_suffix(".journal").exists()  # the next run still knows


def test_a_file_git_was_writing_when_killed_is_named_and_the_switch_goes_on_once_dropped(
        project, upstream, tmp_path, env):
    """Round 5 (F5), made safe: killed inside git's checkout, git leaves its index.lock and the
    file it was writing holds the start of the new content (HEAD and index the old ones). That
    file used to be taken for git's and forced over, which also forced over a user's edit
    that looked the same (above). Now: the run stops at the lock; once the user removed it,
    at the file, named, never overwritten; `git checkout -- FILE` drops it and the switch
    finishes. (The kill's state is made by hand after a kill at 'publish'.)"""
    wd = tmp_path / "wd"
    args = killed(project, upstream, wd, env, "publish")
    full = _new_content(wd, "pkg/model.txt")
    (wd / "pkg/model.txt").write_bytes(full[: len(full) // 2])
    lock = wd / ".git" / "index.lock"
    lock.write_bytes(b"")  # what git's SIGKILLed checkout leaves
    first = run_tool(project, env, *args)
    assert first.returncode == errors.USAGE
    assert first.stderr.splitlines()[-1].startswith(f"apply.py: error: {lock} exists"), first.stderr
    lock.unlink()  # "remove the file if no git runs there"
    second = run_tool(project, env, *args)
    refused(second, wd, DIRTY)
    names(second, "pkg/model.txt")
    assert (wd / "pkg/model.txt").read_bytes() == full[: len(full) // 2]
    g(wd, "checkout", "--", "pkg/model.txt")
    again = run_tool(project, env, *args)
    assert again.returncode == 0 and ": finished" in again.stderr, again.stderr
    assert (wd / "pkg/model.txt").read_bytes() == full and g(wd, "status", "--porcelain") == ""


def test_a_file_cut_short_after_git_wrote_the_index_is_the_users_and_is_kept(project, upstream,
                                                                              tmp_path, env):
    """The reviewer's case: killed once git's checkout was done (the index holds the new
    entries); the user then deletes the file's last lines, a prefix of the new content. Git
    writes the index after every file, so this is an edit: refused, kept."""
    wd = tmp_path / "wd"
    args = killed(project, upstream, wd, env, "publish.switched")
    mine = (wd / "pkg/model.txt").read_bytes()[:-3]
    (wd / "pkg/model.txt").write_bytes(mine)
    refused(run_tool(project, env, *args), wd, DIRTY)
    assert (wd / "pkg/model.txt").read_bytes() == mine


def test_an_untracked_file_where_the_switch_adds_one_is_never_forced_over(project, upstream,
                                                                          tmp_path, env):
    """The switch from upstream's own tree adds pkg/new.py: the user's untracked file there
    (made after the kill) used to be overwritten by the forced checkout."""
    wd = tmp_path / "wd"
    g(tmp_path, "clone", "-q", str(upstream), str(wd))
    g(wd, "checkout", "-q", "v1.0.0")
    args = ["-q", "--vllm-repo", str(upstream), "--workdir", str(wd)]
    assert run_tool(project, {**env, journal.KILL_AT: "publish"}, *args).returncode < 0
    (wd / "pkg/new.py").write_text(EDIT)
    refused(run_tool(project, env, *args), wd, DIRTY)
    assert (wd / "pkg/new.py").read_text() == EDIT


IGNORED_IN_THE_WAY = "files git ignores are where k3-overlay/"


@pytest.mark.parametrize("what", ["a file", "a folder"])
def test_an_ignored_file_or_folder_where_the_switch_adds_a_file_is_never_forced_over(project, upstream,
                                                                                    tmp_path, env, what):
    """Round 6 (F1): as above, but git ignores what the user made there (vLLM's own .gitignore
    has ``*_hip*``), so status is clean; the finishing checkout is forced, and a forced
    checkout overwrites ignored files and removes ignored folders. A normal run refuses."""
    wd = tmp_path / "wd"
    g(tmp_path, "clone", "-q", str(upstream), str(wd))
    g(wd, "checkout", "-q", "v1.0.0")
    args = ["-q", "--vllm-repo", str(upstream), "--workdir", str(wd)]
    assert run_tool(project, {**env, journal.KILL_AT: "publish"}, *args).returncode < 0
    (wd / ".git/info/exclude").write_text("new.py\nmine/\n")
    mine = wd / "pkg/new.py" / "mine/notes.txt" if what == "a folder" else wd / "pkg/new.py"
    mine.parent.mkdir(parents=True, exist_ok=True)
    mine.write_text(EDIT)
    assert g(wd, "status", "--porcelain") == ""
    refused(run_tool(project, env, *args), wd, IGNORED_IN_THE_WAY)
    assert mine.read_text() == EDIT


@pytest.mark.parametrize("how", ["empty", "its first half"])
@pytest.mark.parametrize("what", ["untracked", "ignored"])
def test_a_file_of_the_users_holding_the_start_of_one_the_switch_adds_is_never_forced_over(
        project, upstream, tmp_path, env, what, how):
    """The neighbour: where the switch adds pkg/new.py, the user makes one after the kill,
    empty (`touch`) or holding the first half of the new file, untracked or ignored (status then
    clean). Neither is git's (git had not started), yet each was taken for the file git was
    writing and the forced checkout wrote over it. A normal run refuses either."""
    wd = tmp_path / "wd"
    g(tmp_path, "clone", "-q", str(upstream), str(wd))
    g(wd, "checkout", "-q", "v1.0.0")
    args = ["-q", "--vllm-repo", str(upstream), "--workdir", str(wd)]
    assert run_tool(project, {**env, journal.KILL_AT: "publish"}, *args).returncode < 0
    full = _new_content(wd, "pkg/new.py")
    mine = b"" if how == "empty" else full[: len(full) // 2]  # (it is one line)
    assert full.startswith(mine) and mine != full
    if what == "ignored":
        (wd / ".git/info/exclude").write_text("new.py\n")
    (wd / "pkg/new.py").write_bytes(mine)
    run = run_tool(project, env, *args)
    if what == "ignored":
        refused(run, wd, IGNORED_IN_THE_WAY)
    else:
        refused(run, wd, DIRTY)
        names(run, "pkg/new.py")
    assert (wd / "pkg/new.py").read_bytes() == mine


@pytest.fixture(scope="module")
def upstream_ignoring(tmp_path_factory):
    """An upstream whose .gitignore has ``gen/``, and whose v1.1.0 tracks pkg/gen/sub/b.py
    in that ignored folder (vLLM tracks files under names it ignores, force-added)."""
    repo = tmp_path_factory.mktemp("upstream-ignoring")
    g(repo, "init", "-q", "-b", "main")
    commit_tag(repo, {"pkg/__init__.py": "", "pkg/mod.py": MOD_BASE, "pkg/user.py": USER,
                      "pkg/model.txt": model({}), ".gitignore": "gen/\n"}, "v1.0.0")
    (repo / "pkg/gen/sub").mkdir(parents=True)
    (repo / "pkg/gen/sub/b.py").write_text("B = 1\n")
    g(repo, "add", "-f", "pkg/gen/sub/b.py")
    commit_tag(repo, {"pkg/model.txt": model({1: "line 1 (upstream)"})}, "v1.1.0")
    return repo


@pytest.mark.parametrize("what", ["a file", "a link"])
def test_a_file_or_link_where_the_switch_makes_a_folder_inside_an_ignored_folder_is_kept(
        project, upstream_ignoring, tmp_path, env, what):
    """The review of round 6: pkg/gen/ is ignored and the switch writes pkg/gen/sub/b.py; the
    user's file (or link) pkg/gen/sub is on its way. Only written paths that existed were
    looked at, so the forced checkout replaced the file by a folder (a normal run refuses)."""
    wd = tmp_path / "wd"
    args = killed(project, upstream_ignoring, wd, env, "publish")
    (wd / "pkg/gen").mkdir()
    mine = tmp_path / "mine.txt"
    mine.write_text(EDIT)
    if what == "a link":
        (wd / "pkg/gen/sub").symlink_to(mine)
    else:
        (wd / "pkg/gen/sub").write_text(EDIT)
    refused(run_tool(project, env, *args), wd, IGNORED_IN_THE_WAY)
    kept = wd / "pkg/gen/sub"
    assert kept.is_symlink() == (what == "a link") and kept.read_text() == EDIT


def test_check_never_recovers_and_says_truly_that_it_wrote_nothing(project, upstream, tmp_path, env):
    """Item 2: --check used to run the recovery: switched the branch, discarded the edit,
    then said "--check: nothing was written to the checkout"."""
    wd = tmp_path / "wd"
    args = killed(project, upstream, wd, env, "publish")
    (wd / "pkg/model.txt").write_text(EDIT)
    before = snapshot(wd)
    check = run_tool(project, env, *args, "--check")
    assert check.returncode == 0, check.stderr
    assert snapshot(wd) == before and (wd / "pkg/model.txt").read_text() == EDIT
    assert "--check leaves that as it is" in check.stderr and check.stderr.count(NOTE) == 1
    assert workdir_lock_path(wd).with_suffix(".journal").exists()
    g(wd, "checkout", "--", "pkg/model.txt")  # the user drops the edit: the next run finishes
    again = run_tool(project, env, *args)
    assert again.returncode == 0 and ": finished" in again.stderr, again.stderr


def test_a_commit_on_the_work_branch_after_the_kill_is_never_reset(project, upstream, tmp_path, env):
    """Item 3: killed after `checkout -B`, before the record; the user commits on the work
    branch; the rerun's `checkout -B` reset the branch (the commit only in the reflog)."""
    wd = tmp_path / "wd"
    args = killed(project, upstream, wd, env, "publish.switched")
    (wd / "pkg/user.py").write_text(EDIT)
    g(wd, "commit", "-qam", "mine")
    before = snapshot(wd)
    refused(run_tool(project, env, *args), wd, FOREIGN)
    assert snapshot(wd) == before


@pytest.mark.parametrize("act", ["stash", "switch back", "commit elsewhere"])
def test_what_leaves_the_checkout_clean_lets_the_switch_go_on(project, upstream, tmp_path, env, act):
    """Neighbours that hold: a stash entry survives; a user back on their old branch, or on
    another with a commit, gets the switch a normal run makes, their commit kept."""
    wd = tmp_path / "wd"
    args = killed(project, upstream, wd, env, "publish.switched")
    if act == "stash":
        (wd / "pkg/model.txt").write_text(EDIT)
        g(wd, "stash", "-q")
    elif act == "switch back":
        g(wd, "checkout", "-q", "--detach", "HEAD@{1}")
    else:
        g(wd, "checkout", "-q", "-b", "mine")
        (wd / "pkg/user.py").write_text(EDIT)
        g(wd, "commit", "-qam", "mine")
    kept = g(wd, "for-each-ref", "--format=%(refname) %(objectname)", "refs/stash", "refs/heads/mine")
    again = run_tool(project, env, *args)
    assert again.returncode == 0, again.stderr
    assert g(wd, "for-each-ref", "--format=%(refname) %(objectname)", "refs/stash",
             "refs/heads/mine") == kept
    assert g(wd, "symbolic-ref", "--short", "HEAD").strip() == "k3-overlay/9.9.9"
    assert g(wd, "status", "--porcelain") == ""


@pytest.mark.parametrize("point", ["fetch", "worktree.added", "write.staged"])
@pytest.mark.parametrize("act", ["edit", "commit"])
def test_a_kill_at_another_step_then_the_users_work_is_refused_as_a_normal_run_does(
        project, upstream, tmp_path, env, point, act):
    """Neighbours that hold: a kill before the switch (a fetch, a temporary worktree, the
    overlay being laid in it), then an edit or a commit on the work branch: the rerun
    removes only the tool's leftovers, then refuses as a normal run does."""
    wd = tmp_path / "wd"
    args = killed(project, upstream, wd, env, point)
    (wd / "pkg/user.py").write_text(EDIT)
    if act == "commit":
        g(wd, "commit", "-qam", "mine")
    before = snapshot(wd)
    run = run_tool(project, env, *args)
    assert run.returncode == errors.USAGE, run.stderr
    assert ("uncommitted changes" if act == "edit" else FOREIGN) in run.stderr.splitlines()[-1]
    assert snapshot(wd) == before


def test_the_work_branch_checked_out_in_another_worktree_is_not_moved(project, upstream, tmp_path,
                                                                      env):
    """Item 4: a run on a second linked worktree moved the branch; the first then showed
    staged changes nobody made."""
    wd, second = tmp_path / "wd", tmp_path / "second"
    assert run_apply(project, Options(vllm_repo=str(upstream), workdir=wd)).ok
    g(wd, "worktree", "add", "-q", "--detach", str(second), "v1.0.0")
    before = snapshot(wd)
    run = run_tool(project, env, "-q", "--vllm-repo", str(upstream), "--workdir", str(second), *REF)
    assert run.returncode == errors.USAGE and run.stderr.splitlines() == [
        f"apply.py: error: branch k3-overlay/9.9.9 is checked out in the worktree {wd}; moving "
        f"it from here would leave that worktree on the old files; run apply.py with --workdir "
        f"{wd}, or choose another with --branch"]
    assert snapshot(wd) == before and g(second, "status", "--porcelain") == ""


@pytest.mark.parametrize("copy", ["as is", "workdir rewritten"])
def test_a_journal_naming_another_checkout_is_left_alone(project, upstream, tmp_path, env, copy):
    """Item 5: a copied or restored cache: B's run switched A, without A's lock, losing A's
    edit (also when the entry names B as its work directory but A as the checkout)."""
    a, b = tmp_path / "a", tmp_path / "b"
    killed(project, upstream, a, env, "publish")
    (a / "pkg/model.txt").write_text(EDIT)
    before = snapshot(a)
    assert run_apply(project, Options(vllm_repo=str(upstream), workdir=b)).ok
    text = workdir_lock_path(a).with_suffix(".journal").read_text()
    if copy == "workdir rewritten":
        text = text.replace(f'"workdir": "{a}"', f'"workdir": "{b}"')
    workdir_lock_path(b).with_suffix(".journal").write_text(text)
    run = run_tool(project, env, "-q", "--vllm-repo", str(upstream), "--workdir", str(b), *REF)
    assert run.returncode == 0, run.stderr
    assert f"name another checkout ({a}: a copied cache?) and were left alone" in run.stderr
    assert snapshot(a) == before and (a / "pkg/model.txt").read_text() == EDIT


@pytest.mark.parametrize("point", ["publish", "publish.switched", "fetch", "worktree.added"])
def test_a_live_index_lock_of_the_users_git_is_never_deleted(project, upstream, tmp_path, env, point):
    """Item 5: the user's `git commit` (editor open) holds .git/index.lock; the rerun's
    recovery deleted it (any lock newer than the killed step)."""
    wd = tmp_path / "wd"
    args = killed(project, upstream, wd, env, point)
    lock = wd / ".git" / "index.lock"
    lock.write_bytes(b"the user's git commit is writing this\n")
    run = run_tool(project, env, *args)
    assert run.returncode == errors.USAGE
    assert run.stderr.splitlines()[-1] == (
        f"apply.py: error: {lock} exists: a git command is running in {wd} (or one was killed); "
        f"let it finish, or remove the file if no git runs there, then run again")
    assert lock.read_bytes() == b"the user's git commit is writing this\n"


def test_a_config_lock_left_in_the_checkout_is_named_not_git_s_raw_error(project, upstream, tmp_path, env):
    """Round 5 (F7): a killed `git config` (the tool records its branch with one) leaves
    .git/config.lock; the next run said only git's 'could not lock config file'."""
    wd = tmp_path / "wd"
    assert run_tool(project, env, "--vllm-repo", str(upstream), "--workdir", str(wd)).returncode == 0
    lock = wd / ".git" / "config.lock"
    lock.write_bytes(b"")
    run = run_tool(project, env, "--vllm-repo", str(upstream), "--workdir", str(wd), "--vllm-ref", "v1.1.0")
    assert run.returncode == errors.USAGE
    assert run.stderr.splitlines()[-1] == (
        f"apply.py: error: {lock} exists: a git command is running in {wd} (or one was killed); "
        f"let it finish, or remove the file if no git runs there, then run again")
    assert lock.exists()


@pytest.fixture
def conflicting_upstream(upstream, tmp_path) -> Path:
    """upstream plus v1.4.0: line 4 changed their way (the patch conflicts), pkg/mod.py as at
    the base (the overlay lays cleanly)."""
    repo = tmp_path / "up"
    g(tmp_path, "clone", "-q", str(upstream), str(repo))
    g(repo, "checkout", "-q", "v1.3.0")
    commit_tag(repo, {"pkg/mod.py": MOD_BASE}, "v1.4.0")
    return repo


@pytest.mark.parametrize("extra", [[], ["--build-wheel"]])
def test_a_rebase_holding_the_maintainers_resolution_is_never_reset(project, conflicting_upstream,
                                                                    tmp_path, monkeypatch, extra):
    """Item 7: --rebase-to ended with "now run apply.py --export" after the maintainer resolved a
    conflict; a plain apply.py (or --build-wheel) exited 0 and reset the branch to the old
    base's result, the resolution left only in the reflog."""
    monkeypatch.setattr(cli, "Project", lambda: project)
    wd, up = tmp_path / "wd", str(conflicting_upstream)
    assert run_apply(project, Options(vllm_repo=up, workdir=wd)).ok
    opts = Options(ref="v1.4.0", vllm_repo=up, workdir=wd)
    assert rebase_to(project, opts).exit_code == errors.CONFLICT
    (wd / "pkg/model.txt").write_text(model({1: "line 1 (upstream)", 4: "line 4 (both)"}))
    g(wd, "add", "pkg/model.txt")
    g(wd, "am", "--continue")
    done = rebase_to(project, opts)
    assert done.ok and "now run apply.py --export" in done.notes[-1]
    before = snapshot(wd)
    assert cli.main(["--vllm-repo", up, "--workdir", str(wd), *extra]) == errors.USAGE
    assert snapshot(wd) == before


@pytest.mark.parametrize("folder", ["locks", "sdists", "wheels", "mirror"])
@pytest.mark.parametrize("kind", ["link to a folder", "dangling link", "file"])
def test_a_cache_folder_that_is_a_link_or_no_folder_is_refused(project, upstream, tmp_path, folder,
                                                               kind):
    """Item 20: locks/ a symlink: lock and journal files were created through it."""
    cache, elsewhere = tmp_path / "cache" / "vllm-k3-overlay", tmp_path / "elsewhere"
    cache.mkdir(parents=True)
    elsewhere.mkdir()
    path = cache / folder
    if kind == "file":
        path.write_text("")
    else:
        path.symlink_to(elsewhere if kind == "link to a folder" else tmp_path / "gone")
    message = f"{path} is a {'file' if kind == 'file' else 'symbolic link'}, not a folder; refusing"
    with pytest.raises(errors.UsageError, match=message):
        if folder == "locks":
            run_apply(project, Options(vllm_repo=str(upstream), workdir=tmp_path / "wd"))
        elif folder == "mirror":
            ReleaseMirror(path, ReleaseFiles(cache)).ensure([])
        else:
            ReleaseFiles(cache)._path(type("Pkg", (), {"filename": "x.whl", "package_type":
                                                       folder[:-1]})())
    assert list(elsewhere.iterdir()) == [] and not (tmp_path / "gone").exists()


@pytest.mark.parametrize("step", ["--rebase-to, continued after a resolution", "--export"])
def test_a_git_lock_of_the_users_stops_rebase_to_and_export_too(project, conflicting_upstream,
                                                                tmp_path, step):
    """A --rebase-to continued on its own branch skips the normal run's checks (the branch holds
    the maintainer's resolutions), and took git's locks for one of them: with the user's `git
    commit` holding index.lock, it laid the overlay into the work tree, then died in `git
    update-index`. --export did not look either (`git commit --amend`, its editor open)."""
    wd, up = tmp_path / "wd", str(conflicting_upstream)
    assert run_apply(project, Options(vllm_repo=up, workdir=wd)).ok
    opts = Options(ref="v1.4.0", vllm_repo=up, workdir=wd)
    if step.startswith("--rebase-to"):
        assert rebase_to(project, opts).exit_code == errors.CONFLICT
        (wd / "pkg/model.txt").write_text(model({1: "line 1 (upstream)", 4: "line 4 (both)"}))
        g(wd, "add", "pkg/model.txt")
        g(wd, "am", "--continue")
    lock = wd / ".git" / "index.lock"
    lock.write_bytes(b"the user's git commit is writing this\n")
    before, data = snapshot(wd), {p: p.read_bytes() for p in project.root.rglob("*") if p.is_file()}
    with pytest.raises(errors.UsageError) as err:
        rebase_to(project, opts) if step.startswith("--rebase-to") else export(project, wd)
    assert str(err.value).startswith(f"{lock} exists: a git command is running in {wd}")
    assert lock.read_bytes() == b"the user's git commit is writing this\n"
    lock.unlink()  # (git status needs it gone to compare)
    assert snapshot(wd) == before
    assert {p: p.read_bytes() for p in project.root.rglob("*") if p.is_file()} == data
