"""Crash consistency (issue 18, G): a run killed at any step it records, by SIGKILL or a
hang-up, is finished or undone by the next run, alone, with a one-line note; no git child
outlives the tool. Each kill is real: the run is a child process that SIGKILLs itself at
the named point (``journal.point``, a test-only hook)."""

from __future__ import annotations

import hashlib
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from k3overlay import claim, errors, job, journal, lock, recovery
from k3overlay.job import Options, run_apply
from k3overlay.lock import workdir_lock, workdir_lock_path

from .conftest import alive, as_in_a_terminal, g, killed_in_owned_scratch

ROOT = Path(__file__).resolve().parent.parent
RUNNER = ("import sys; from pathlib import Path; from k3overlay import cli; "
          "from k3overlay.project import Project; cli.Project = lambda: Project(Path(sys.argv[1])); "
          "sys.exit(cli.main(sys.argv[2:]))")
NOTE = "… note: the last run was killed; "
# Which run passes each point: a fresh workdir (clone), --check into a fresh workdir (its
# throwaway clone), or a new ref onto an existing checkout (fetch, worktree, publish).
SCENARIO = {"clone": "fresh", "clone.cloned": "fresh", "clone.done": "fresh", "fresh": "fresh",
            "fresh.done": "fresh", "check": "check", "check.done": "check"}
# Points at which the killed run leaves something the next run must finish or remove.
LEAVES_WORK = {"clone", "clone.cloned", "check", "worktree", "worktree.added", "publish",
               "publish.switched", "write", "write.staged", "write.done", "rename",
               "rename.done"}  # (write, rename: in a worktree)


def run_tool(project, env: dict[str, str], *args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", RUNNER, str(project.root), *args], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=timeout, preexec_fn=as_in_a_terminal)


def state(wd: Path) -> dict:
    """What a user sees of a checkout: refs, HEAD, index, status (untracked files too)."""
    return {"refs": g(wd, "for-each-ref", "--format=%(refname) %(objectname)"),
            "head": g(wd, "symbolic-ref", "-q", "HEAD"), "index": g(wd, "ls-files", "-s"),
            "status": g(wd, "status", "--porcelain", "--untracked-files=all", "--ignored"),
            "worktrees": g(wd, "worktree", "list", "--porcelain").count("worktree "),
            "record": g(wd, "config", "--local", "--get-regexp", "k3overlay")}


def leftovers(tmp_path: Path) -> list[str]:
    """Scratch folders of the tool's: temporary worktrees and --check clones (TMPDIR is
    tmp_path/t), clones beside the workdir."""
    return sorted([p.name for p in (tmp_path / "t").iterdir()]
                  + [p.name for p in tmp_path.glob(".wd.k3-clone-*")])


@pytest.fixture
def env(tmp_path) -> dict[str, str]:
    (tmp_path / "t").mkdir()
    return {**os.environ, "TMPDIR": str(tmp_path / "t")}


# Points only --rebase-to passes (test_a_rebase_to_killed_around_laying_the_overlay_...).
REBASE_TO = {"lay", "lay.committed", "lay.done"}


def test_every_point_is_passed_by_one_of_the_scenarios():
    plain = {"fetch", "fetch.done", "worktree", "worktree.added", "worktree.done", "publish",
             "publish.switched", "publish.done", "write", "write.staged", "write.done", "rename",
             "rename.done"}
    assert set(SCENARIO) | REBASE_TO | plain == set(journal.POINTS)


@pytest.mark.parametrize("point", [p for p in journal.POINTS if p not in REBASE_TO])
def test_a_run_killed_at_each_step_is_finished_or_undone_by_the_next(project, upstream, tmp_path,
                                                                      env, point):
    wd, scenario = tmp_path / "wd", SCENARIO.get(point, "existing")
    args = ["-q", "--vllm-repo", str(upstream), "--workdir", str(wd)]
    if scenario == "existing":
        assert run_apply(project, Options(vllm_repo=str(upstream), workdir=wd)).ok
        old = state(wd)
        args += ["--vllm-ref", "v1.1.0"]
    elif scenario == "check":
        args.append("--check")
    killed = run_tool(project, {**env, journal.KILL_AT: point}, *args)
    assert killed.returncode == -signal.SIGKILL, killed.stderr  # the point was reached
    if scenario == "existing":
        now = state(wd)  # the killed run's checkout: a user may look at it before running again
        assert now["refs"] == old["refs"] or point.startswith("publish")

    again = run_tool(project, env, *args)
    assert again.returncode == 0, again.stderr
    notes = [line for line in again.stderr.splitlines() if line.startswith(NOTE)]
    assert len(notes) == (1 if point in LEAVES_WORK else 0), again.stderr
    # (round 9: the steps that wrote in the run's own scratch tree were called another checkout's)
    assert not any("another checkout" in note for note in notes), notes
    assert leftovers(tmp_path) == []
    assert not workdir_lock_path(wd).with_suffix(".journal").exists()
    if scenario == "check":
        assert not wd.exists()
        return
    # the checkout is the one an uninterrupted run makes
    reference = tmp_path / "ref"
    assert run_apply(project, Options(vllm_repo=str(upstream), workdir=reference)).ok
    if scenario == "existing":
        assert run_apply(project, Options(vllm_repo=str(upstream), workdir=reference,
                                          ref="v1.1.0")).ok
    assert state(wd) == state(reference)
    assert run_tool(project, env, *args).stderr.count(NOTE) == 0  # said once, then done


def test_killed_between_the_switch_and_the_branch_record_is_not_locked_out(project, upstream,
                                                                          tmp_path, env):
    """The issue's case: today every later run refused "has commits apply.py did not write"."""
    wd = tmp_path / "wd"
    assert run_apply(project, Options(vllm_repo=str(upstream), workdir=wd)).ok
    args = ["-q", "--vllm-repo", str(upstream), "--workdir", str(wd), "--vllm-ref", "v1.1.0"]
    assert run_tool(project, {**env, journal.KILL_AT: "publish.switched"}, *args).returncode < 0
    again = run_tool(project, env, *args)
    assert again.returncode == 0, again.stderr
    assert [line for line in again.stderr.splitlines() if NOTE in line] == [
        f"{NOTE}it was switching {wd} to k3-overlay/9.9.9 "
        f"({g(wd, 'rev-parse', 'HEAD').strip()[:12]}): finished"]


def test_a_killed_run_is_finished_by_the_next_under_another_cache(project, upstream, tmp_path, env):
    """Round 8: the journal lived in the killed run's cache only, so a run under another cache
    (``sudo``, another ``HOME`` or ``XDG_CACHE_HOME``) refused the branch the killed run wrote
    as "not created by apply.py". The checkout's claim (``.git/k3overlay.lock``) names the
    journal: the next run finishes it from there, and a ``--check`` only says what is left."""
    wd = tmp_path / "wd"
    assert run_apply(project, Options(vllm_repo=str(upstream), workdir=wd)).ok
    args = ["-q", "--vllm-repo", str(upstream), "--workdir", str(wd), "--vllm-ref", "v1.1.0"]
    assert run_tool(project, {**env, journal.KILL_AT: "publish.switched"}, *args).returncode < 0
    other = {**env, "XDG_CACHE_HOME": str(tmp_path / "other-cache")}
    check = run_tool(project, other, *args, "--check")
    assert "left publish unfinished" in check.stderr, check.stderr
    again = run_tool(project, other, *args)
    assert again.returncode == 0, again.stderr
    assert [line for line in again.stderr.splitlines() if NOTE in line] == [
        f"{NOTE}it was switching {wd} to k3-overlay/9.9.9 "
        f"({g(wd, 'rev-parse', 'HEAD').strip()[:12]}): finished"]
    assert run_tool(project, env, *args).stderr.count(NOTE) == 0  # done: its own cache's run finds nothing


def test_a_switch_the_user_undid_by_hand_is_not_brought_back(project, upstream, tmp_path, env):
    """Round 8: killed after switching to brS; the user switched back and deleted brS. The next
    run, for another branch, "finished" the killed switch: it made brS again and checked it out."""
    wd = tmp_path / "wd"
    assert run_apply(project, Options(vllm_repo=str(upstream), workdir=wd)).ok
    args = ["-q", "--vllm-repo", str(upstream), "--workdir", str(wd), "--vllm-ref", "v1.1.0"]
    killed = run_tool(project, {**env, journal.KILL_AT: "publish.switched"}, *args, "--branch", "brS")
    assert killed.returncode < 0 and g(wd, "symbolic-ref", "HEAD").strip() == "refs/heads/brS"
    g(wd, "checkout", "-q", "k3-overlay/9.9.9")
    g(wd, "branch", "-q", "-D", "brS")
    again = run_tool(project, env, *args, "--branch", "brOther")
    assert again.returncode == 0, again.stderr
    assert [line for line in again.stderr.splitlines() if NOTE in line] == [
        f"{NOTE}it was switching {wd} to brS ({killed_sha(wd, 'brOther')}): the user left brS and deleted it "
        f"since; nothing of it is left to finish"]
    assert g(wd, "branch", "--list", "brS") == "" and g(wd, "symbolic-ref", "HEAD").strip() == "refs/heads/brOther"


def killed_sha(wd: Path, branch: str) -> str:
    """The killed run's result: the same series on the same ref gives the same sha on any branch."""
    return g(wd, "rev-parse", branch).strip()[:12]


def test_a_killed_runs_journal_that_cannot_be_read_stops_the_next_run_in_one_line(project, upstream,
                                                                                   tmp_path, env):
    wd = tmp_path / "wd"
    assert run_apply(project, Options(vllm_repo=str(upstream), workdir=wd)).ok
    before = state(wd)
    unreadable = tmp_path / "someone-elses-cache" / "x.journal"
    unreadable.mkdir(parents=True)  # (root reads any file: a folder stands for one it cannot)
    (wd / ".git" / claim.FILE).write_text(json.dumps({"journal": str(unreadable)}))
    run = run_tool(project, env, "-q", "--vllm-repo", str(upstream), "--workdir", str(wd))
    assert run.returncode == 2 and run.stderr.count("\n") == 1, run.stderr
    assert f"{wd / '.git' / claim.FILE} names {unreadable} as a killed run's journal, which is no regular " \
           f"file: not acted on" in run.stderr
    assert state(wd) == before


@pytest.mark.parametrize("forged", ["outside the cache", "another user's", "its folder writable by others",
                                    "keyed for another name", "reached through a link", "a folder above "
                                    "another user's"])
def test_a_forged_journal_named_by_the_claim_is_never_acted_on(project, upstream, tmp_path, env, forged):
    """Round 8b: the claim's journal was trusted like the run's own: whoever could write the
    checkout's .git (a shared checkout, a sudo run on another user's) had it remove any file
    whose sha256 they knew, and rename theirs anywhere. Only a journal of this user's tool,
    where it keeps them and keyed for a name of this checkout, is acted on."""
    wd = tmp_path / "wd"
    assert run_apply(project, Options(vllm_repo=str(upstream), workdir=wd)).ok
    victim = tmp_path / "victim"
    victim.mkdir()
    (victim / "important.txt").write_text("precious\n")
    digest = hashlib.sha256(b"precious\n").hexdigest()
    entry = {"step": "rename", "id": "1.1", "workdir": str(wd), "root": str(victim), "moves": [],
             "remove": [["important.txt", digest]]}
    locks = tmp_path / "cache2" / "vllm-k3-overlay" / "locks"
    folder = tmp_path / "elsewhere" if forged == "outside the cache" else locks
    folder.mkdir(parents=True)
    name = "0" * 32 if forged == "keyed for another name" else lock.journal_key(wd)
    forgery = folder / f"{name}.journal"
    forgery.write_text(json.dumps(entry) + "\n")
    if forged == "another user's":
        os.chown(forgery, 65534, 65534)
    if forged == "its folder writable by others":
        folder.chmod(0o777)
    if forged == "a folder above another user's":  # (who could swap the folders below it)
        os.chown(tmp_path / "cache2", 65534, 65534)
    named = forgery
    if forged == "reached through a link":  # (one another user could point elsewhere between looks)
        (tmp_path / "cache3").symlink_to(tmp_path / "cache2")
        named = tmp_path / "cache3" / forgery.relative_to(tmp_path / "cache2")
    (wd / ".git" / claim.FILE).write_text(json.dumps({"journal": str(named)}))
    run = run_tool(project, env, "-q", "--vllm-repo", str(upstream), "--workdir", str(wd))
    assert run.returncode == 2 and run.stderr.count("\n") == 1, run.stderr
    assert (victim / "important.txt").read_text() == "precious\n" and forgery.exists()


def test_rebase_to_killed_while_laying_the_overlay_leaves_no_half_written_file(project, upstream,
                                                                              tmp_path, env):
    """The overlay is staged beside its destinations, then renamed: a kill in between left
    ``.mod.py.1a2b3c4d.k3-tmp`` files in the checkout, and every later run said "has
    uncommitted changes"."""
    wd = tmp_path / "wd"
    assert run_apply(project, Options(vllm_repo=str(upstream), workdir=wd)).ok
    args = ["-q", "--vllm-repo", str(upstream), "--workdir", str(wd), "--rebase-to", "v1.1.0"]
    killed = run_tool(project, {**env, journal.KILL_AT: "write.staged"}, *args)
    assert killed.returncode == -signal.SIGKILL, killed.stderr
    assert sorted(p.name for p in (wd / "pkg").glob(".*.k3-tmp")) != []
    again = run_tool(project, env, *args)
    assert again.returncode == 0, again.stderr
    assert [line for line in again.stderr.splitlines() if NOTE in line] == [
        f"{NOTE}removed 2 half-written file(s) it left in {wd}"]
    assert list(wd.rglob("*.k3-tmp")) == [] and g(wd, "status", "--porcelain") == ""


def test_a_killed_export_leaves_no_temporary_file_in_the_projects_data(project, upstream, tmp_path, env):
    """Issue 25, 18: a killed --export left ``.X.<hex>.k3-tmp`` files in overlay/, patches/
    and the root: every other run refused ("files under overlay/ missing from the
    manifest") until one on the same workdir removed them, and ``git add -A`` would commit
    them. They are now staged in the project's ``.k3-tmp/`` (git-ignored), in a folder of
    the run's own that the next run removes; a file of someone else's named like one of
    ours is left alone. Since the export's writes are journalled in the project's own journal,
    the next run reading the project, on any checkout, removes them first."""
    wd = tmp_path / "wd"
    assert run_apply(project, Options(vllm_repo=str(upstream), workdir=wd)).ok
    root = project.root
    (root / ".gitignore").write_bytes((ROOT / ".gitignore").read_bytes())
    g(root, "init", "-q")
    g(root, "add", "-A")
    g(root, "commit", "-q", "-m", "the project")
    theirs = root / ".notes.deadbeef.k3-tmp"  # the user's, named like one of ours
    theirs.write_text("mine\n")
    killed = run_tool(project, {**env, journal.KILL_AT: "write.staged"}, "-q", "--export",
                      "--workdir", str(wd))
    assert killed.returncode == -signal.SIGKILL, killed.stderr
    assert list((root / ".k3-tmp").rglob("*.k3-tmp")) != []  # it was killed with its files staged
    assert sorted(str(p.relative_to(root)) for p in root.rglob("*.k3-tmp")
                  if ".k3-tmp" not in p.relative_to(root).parts[:1]) == [theirs.name]
    assert g(root, "status", "--porcelain", "--untracked-files=all") == f"?? {theirs.name}\n"
    other = run_tool(project, env, "-q", "--check", "--vllm-repo", str(upstream),
                     "--workdir", str(tmp_path / "w2"))
    assert other.returncode == 0, other.stderr  # another workdir's run reads the project as it was
    assert [line for line in other.stderr.splitlines() if NOTE in line] == [
        f"{NOTE}removed 5 half-written file(s) it left in {root}"]  # a patch, series, 2 overlay, manifest
    again = run_tool(project, env, "-q", "--export", "--workdir", str(wd))
    assert again.returncode == 0, again.stderr
    assert NOTE not in again.stderr
    assert not (root / ".k3-tmp").exists() and theirs.read_text() == "mine\n"
    assert [p for p in root.rglob("*.k3-tmp")] == [theirs]


def _renamed_patch(project, upstream, tmp_path) -> Path:
    """A published work branch whose patch commit has a new subject (so --export writes
    0002-model-a-new-subject.patch and removes 0001-model-line-4.patch), the project a
    clean git checkout."""
    wd = tmp_path / "wd"
    assert run_apply(project, Options(vllm_repo=str(upstream), workdir=wd)).ok
    (project.root / ".gitignore").write_bytes((ROOT / ".gitignore").read_bytes())
    g(project.root, "init", "-q")
    g(project.root, "add", "-A")
    g(project.root, "commit", "-q", "-m", "the project")
    patch = g(wd, "commit-tree", "HEAD~1^{tree}", "-p", "HEAD~2", "-m",
              "model: a new subject\n\nUpstream-Status: Pending\n").strip()
    tip = g(wd, "commit-tree", "HEAD^{tree}", "-p", patch, "-m", g(wd, "log", "-1", "--format=%B")).strip()
    g(wd, "reset", "-q", "--hard", tip)
    return wd


NEW_SERIES = ["0002-model-a-new-subject.patch", "series"]


def _whole(project, upstream, env, tmp_path, names: list[str]) -> None:
    """patches/ holds ``names``, its series lists exactly its patches, and a run on another
    checkout reads it."""
    assert sorted(p.name for p in project.patches_dir.iterdir()) == names
    assert (project.patches_dir / "series").read_text() == "".join(f"{n}\n" for n in names[:-1])
    other = run_tool(project, env, "-q", "--check", "--vllm-repo", str(upstream),
                     "--workdir", str(tmp_path / "w2"))
    assert other.returncode == 0, other.stderr


def _rename_by_hand(project, name: str) -> None:
    """What a run killed after its first rename leaves: one staged file already in place."""
    staged = next(p for p in (project.root / ".k3-tmp").rglob("*.k3-tmp") if f".{name}." in p.name)
    staged.rename(project.patches_dir / name)


@pytest.mark.parametrize("point", ["rename.done", "write.done"])
def test_an_export_killed_after_its_renames_leaves_no_patch_the_series_does_not_list(
        project, upstream, tmp_path, env, point):
    """An --export killed after its renames, before it removed the patch that left the series
    (a renamed or landed patch), left patches/ holding a file the series did not list:
    every run on any checkout refused ("patches not in series") and --export again refused
    the data as changed, for good. The removals are now part of the renames' step."""
    wd = _renamed_patch(project, upstream, tmp_path)
    args = ["-q", "--export", "--workdir", str(wd)]
    assert run_tool(project, {**env, journal.KILL_AT: point}, *args).returncode == -signal.SIGKILL
    _whole(project, upstream, env, tmp_path, NEW_SERIES)


def test_an_export_killed_part_way_through_its_renames_is_finished_by_the_next_run(
        project, upstream, tmp_path, env):
    """Killed after renaming the series into place and before the rest: patches/ was half
    old, half new (a series naming a patch file not there), and the recovery only removed
    the staged rest. The next run on that workdir now finishes the renames."""
    wd = _renamed_patch(project, upstream, tmp_path)
    args = ["-q", "--export", "--workdir", str(wd)]
    assert run_tool(project, {**env, journal.KILL_AT: "rename"}, *args).returncode == -signal.SIGKILL
    _rename_by_hand(project, "series")
    again = run_tool(project, env, *args)  # (the export is left for the user to commit)
    assert [line for line in again.stderr.splitlines() if NOTE in line] == [
        f"{NOTE}it was renaming 5 written file(s) into place in {project.root}: finished"], again.stderr
    _whole(project, upstream, env, tmp_path, NEW_SERIES)


@pytest.mark.parametrize("cache", ["its cache", "another cache"])
def test_an_export_killed_part_way_is_finished_by_a_run_on_another_checkout(project, upstream, tmp_path, env,
                                                                           cache):
    """Round 7's open list: the renames were journalled in the export's checkout only, so a run
    on another checkout read patches/ half old, half new (the series naming a patch not there:
    refused; or a mixed series applied). The project's own journal now has them: the first
    run that reads the project, on any checkout, even ``--check``, finishes them first; round
    8b: under any cache too (the journal is in the project's git folder)."""
    wd = _renamed_patch(project, upstream, tmp_path)
    assert run_tool(project, {**env, journal.KILL_AT: "rename"}, "-q", "--export", "--workdir",
                    str(wd)).returncode == -signal.SIGKILL
    _rename_by_hand(project, "series")
    env2 = env if cache == "its cache" else {**env, "XDG_CACHE_HOME": str(tmp_path / "other-cache")}
    other = run_tool(project, env2, "-q", "--check", "--vllm-repo", str(upstream),
                     "--workdir", str(tmp_path / "w3"))
    assert other.returncode == 0, other.stderr
    assert [line for line in other.stderr.splitlines() if NOTE in line] == [
        f"{NOTE}it was renaming 5 written file(s) into place in {project.root}: finished"], other.stderr
    _whole(project, upstream, env, tmp_path, NEW_SERIES)


def test_a_renamed_file_put_back_after_the_kill_leaves_every_rename_as_it_is(project, upstream,
                                                                           tmp_path, env):
    """Round 6 (F2): killed after renaming the new patch and the series into place, before
    removing the patch that left the series; the user then puts the committed series back
    (``git checkout -- patches/series``). The next run "finished": it removed the patch the
    restored series still lists, and every run refused patches/ from then on."""
    wd = _renamed_patch(project, upstream, tmp_path)
    args = ["-q", "--export", "--workdir", str(wd)]
    assert run_tool(project, {**env, journal.KILL_AT: "rename"}, *args).returncode == -signal.SIGKILL
    _rename_by_hand(project, "0002-model-a-new-subject.patch")
    _rename_by_hand(project, "series")
    g(project.root, "checkout", "--", "patches/series")
    before = {p.name: p.read_bytes() for p in project.patches_dir.iterdir()}
    assert "0001-model-line-4.patch" in before
    again = run_tool(project, env, *args)
    assert [line for line in again.stderr.splitlines() if NOTE in line] == [
        f"{NOTE}it was renaming 5 written file(s) into place in {project.root}: left as it is "
        f"(changed since); removed 3 half-written file(s) it left in {project.root}"], again.stderr
    assert {p.name: p.read_bytes() for p in project.patches_dir.iterdir()} == before


@pytest.mark.parametrize("mode", [["--rebase-to", "v1.2.0"], ["--vllm-ref", "v1.1.0"]])
@pytest.mark.parametrize("point", ["clone.done", "fetch", "fetch.done"])
def test_a_new_workdirs_clone_killed_before_the_switch_is_taken_up_by_the_next_run(
        project, upstream, tmp_path, env, point, mode):
    """The review of round 6: from a source of tags only (the release mirror), a new
    --workdir's clone checks nothing out; killed before the switch, every later run refused it
    as "a git repository with no commit yet". The next run takes it up as its own clone
    (round 8: it removed it, and a ``--shared`` clone of the user's lost its objects)."""
    tags = tmp_path / "tags.git"
    g(tmp_path, "clone", "-q", "--bare", str(upstream), str(tags))
    g(tags, "update-ref", "-d", "refs/heads/main")
    wd = tmp_path / "wd"
    args = ["-q", "--vllm-repo", str(tags), "--workdir", str(wd), *mode]
    assert run_tool(project, {**env, journal.KILL_AT: point}, *args).returncode == -signal.SIGKILL
    assert g(wd, "for-each-ref", "refs/heads/") == ""  # a clone with nothing checked out
    again = run_tool(project, env, *args)
    assert again.returncode == 0, again.stderr
    assert f"{NOTE}its clone {wd}, not yet switched to a branch, is kept for this run to take up" \
        in again.stderr
    assert g(wd, "status", "--porcelain") == "" and g(wd, "rev-parse", "HEAD").strip()
    assert not (wd / ".git/k3overlay-fresh").exists()  # switched: the user's checkout now


@pytest.mark.parametrize("ref", ["v1.1.0", "v1.3.0"])
def test_a_killed_runs_clone_another_repository_borrows_from_is_never_removed(project, upstream, tmp_path,
                                                                             env, ref):
    """Round 8: killed before its switch, the run left its clone; the user made a ``git clone
    --shared`` of it (objects borrowed through ``alternates``) and committed there. The next
    run removed the clone as its own, and the user's clone lost the objects it borrowed; with
    a run that publishes nothing (v1.3.0: a conflict), for good. The clone is now taken up."""
    wd, mine = tmp_path / "wd", tmp_path / "mine"
    args = ["-q", "--vllm-repo", str(_tags_only(upstream, tmp_path)), "--workdir", str(wd)]
    assert run_tool(project, {**env, journal.KILL_AT: "fetch.done"}, *args).returncode == -signal.SIGKILL
    g(tmp_path, "clone", "-q", "--shared", str(wd), str(mine))
    g(mine, "checkout", "-q", "-b", "work", "v1.0.0")
    (mine / "notes.txt").write_text("mine\n")
    g(mine, "add", "notes.txt")
    g(mine, "-c", "user.name=u", "-c", "user.email=u@invalid", "commit", "-q", "-m", "mine")
    again = run_tool(project, env, *args, "--vllm-ref", ref)
    assert again.returncode == (3 if ref == "v1.3.0" else 0), again.stderr
    assert (wd / ".git/objects").is_dir()
    assert subprocess.run(["git", "-C", str(mine), "fsck", "--no-dangling"], capture_output=True).returncode == 0
    assert g(mine, "show", "work:notes.txt") == "mine\n"


def test_a_clone_taken_up_under_another_cache_finishes_its_killed_runs_steps_first(
        project, upstream, tmp_path, env, monkeypatch, capsys):
    """Round 9: a run that took a killed run's clone up under another cache (it started before
    the clone was there, so its claim had not recovered the journal the clone's claim names)
    left that journal: a run under the first cache, days later, finished its stale switch over
    the user's newer one. Taking a clone up now settles that journal first."""
    wd, tags = tmp_path / "wd", _tags_only(upstream, tmp_path)
    args = ["-q", "--vllm-repo", str(tags), "--workdir", str(wd)]
    cache_a = {**env, "XDG_CACHE_HOME": str(tmp_path / "a")}
    assert run_tool(project, {**cache_a, journal.KILL_AT: "publish"}, *args).returncode == -signal.SIGKILL
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "a"))
    theirs = lock.journal_path(wd)
    assert theirs.exists()
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "b"))
    with job.fresh_clone(str(tags), wd):
        assert not theirs.exists()  # settled before the clone was this run's
    said = "".join(capsys.readouterr())
    assert "its new clone had nothing checked out yet; it is taken up as it is" in said, said
    again = run_tool(project, cache_a, *args)
    assert again.returncode == 0 and NOTE not in again.stderr, again.stderr


def _tags_only(upstream, tmp_path) -> Path:
    """A bare copy of ``upstream`` with tags and no branch, as the release mirror is."""
    tags = tmp_path / "tags.git"
    g(tmp_path, "clone", "-q", "--bare", str(upstream), str(tags))
    g(tags, "update-ref", "-d", "refs/heads/main")
    return tags


@pytest.mark.parametrize("point", ["fresh", "clone", "clone.cloned"])
def test_a_repository_the_user_made_at_a_killed_runs_new_workdir_is_never_removed(
        project, upstream, tmp_path, env, point):
    """Round 7: killed before its clone was in place, the run left a ``fresh`` step; the user
    then made a repository of their own at that path (``git init``, a remote, a fetch: no
    commit, no branch). The next run removed it whole as "its clone" (a normal run refuses it)."""
    wd = tmp_path / "wd"
    args = ["-q", "--vllm-repo", str(_tags_only(upstream, tmp_path)), "--workdir", str(wd)]
    assert run_tool(project, {**env, journal.KILL_AT: point}, *args).returncode == -signal.SIGKILL
    assert not wd.exists()
    g(tmp_path, "init", "-q", str(wd))
    g(wd, "remote", "add", "mine", str(upstream))
    g(wd, "fetch", "-q", "mine")
    fetched = g(wd, "for-each-ref")
    again = run_tool(project, env, *args)
    assert again.returncode == 2 and "is a git repository with no commit yet" in again.stderr, again.stderr
    assert "its clone" not in again.stderr
    assert g(wd, "remote").split() == ["mine"] and g(wd, "for-each-ref") == fetched


@pytest.mark.parametrize("use", ["a remote of mine, fetched", "a detached worktree, a commit there"])
def test_a_killed_runs_clone_the_user_took_up_is_never_removed(project, upstream, tmp_path, env, use):
    """Killed before the switch, the run left its clone (marked its own, no branch); the user
    took it up: fetched a remote of theirs into it, or made a detached worktree from it and
    committed there (no branch: the commit lives only in the clone's .git). The next run
    removed it whole, as its clone: the fetched refs, the worktree's repository and commit."""
    wd, mine = tmp_path / "wd", tmp_path / "mine"
    args = ["-q", "--vllm-repo", str(_tags_only(upstream, tmp_path)), "--workdir", str(wd)]
    assert run_tool(project, {**env, journal.KILL_AT: "fetch.done"}, *args).returncode == -signal.SIGKILL
    assert (wd / ".git/k3overlay-fresh").exists() and g(wd, "for-each-ref", "refs/heads/") == ""
    if use.startswith("a remote"):
        g(wd, "remote", "add", "mine", str(upstream))
        g(wd, "fetch", "-q", "mine")
    else:
        g(wd, "worktree", "add", "-q", "--detach", str(mine), "v1.0.0")
        (mine / "notes.txt").write_text("mine\n")
        g(mine, "add", "notes.txt")
        g(mine, "-c", "user.name=u", "-c", "user.email=u@invalid", "commit", "-q", "-m", "mine")
    kept = g(wd, "for-each-ref") + (g(mine, "rev-parse", "HEAD") if mine.exists() else "")
    again = run_tool(project, env, *args)
    assert "its clone" not in again.stderr and again.returncode == 2, again.stderr
    assert g(wd, "for-each-ref") + (g(mine, "rev-parse", "HEAD") if mine.exists() else "") == kept


@pytest.mark.parametrize("ref", ["v1.3.0", "v1.1.0"])
def test_a_new_workdirs_clone_the_run_did_not_switch_is_removed_at_its_end(project, upstream, tmp_path,
                                                                          env, ref):
    """Round 7: into a new --workdir from a source of tags only (the release mirror: every
    run without --vllm-repo), a run that publishes nothing (v1.3.0: a conflict, exit 3) left
    a clone with nothing checked out; every later run there refused it, "a git repository
    with no commit yet", until the user deleted it. A run that publishes keeps its clone."""
    wd = tmp_path / "wd"
    args = ["-q", "--vllm-repo", str(_tags_only(upstream, tmp_path)), "--workdir", str(wd)]
    first = run_tool(project, env, *args, "--vllm-ref", ref)
    assert first.returncode == (3 if ref == "v1.3.0" else 0), first.stderr
    assert wd.exists() == (ref != "v1.3.0") and not list(wd.glob(".git/k3overlay-fresh"))
    again = run_tool(project, env, *args)
    assert again.returncode == 0, again.stderr
    assert g(wd, "status", "--porcelain") == "" and g(wd, "rev-parse", "HEAD").strip()


def _rebase_to_and_tree(project, upstream, wd: Path, env) -> tuple[list[str], str]:
    """A checkout of v1.0.0's result in ``wd``; the args of --rebase-to v1.2.0 there (a target
    every patch of which landed), and the tree an uninterrupted run of it commits."""
    reference = wd.parent / "reference"
    for where in (wd, reference):
        assert run_apply(project, Options(vllm_repo=str(upstream), workdir=where)).ok
    args = ["-q", "--vllm-repo", str(upstream), "--rebase-to", "v1.2.0"]
    assert run_tool(project, env, *args, "--workdir", str(reference)).returncode == 0
    return [*args, "--workdir", str(wd)], g(reference, "rev-parse", "HEAD^{tree}").strip()


@pytest.mark.parametrize("point", ["lay", "rename.done", "lay.committed", "lay.done"])
def test_a_rebase_to_killed_around_laying_the_overlay_is_taken_up_by_the_next(project, upstream,
                                                                              tmp_path, env, point):
    """Round 6 (F5): killed once the overlay was laid into the checkout (rename.done), before
    committing it: the next --rebase-to said "has uncommitted changes; commit the resolution
    first" (the files were the tool's own) with no word of the kill, and a plain run refused
    too. The laid files are now put back, and the run lays and commits them again."""
    wd = tmp_path / "wd"
    args, tree = _rebase_to_and_tree(project, upstream, wd, env)
    assert run_tool(project, {**env, journal.KILL_AT: point}, *args).returncode == -signal.SIGKILL
    again = run_tool(project, env, *args)
    assert again.returncode == 0, again.stderr
    notes = [line for line in again.stderr.splitlines() if NOTE in line]
    if point == "rename.done":
        assert notes == [f"{NOTE}it was laying the overlay into {wd}, not yet committed: put back "
                         f"(2 file(s) as {g(wd, 'rev-parse', 'HEAD~1').strip()[:12]} has them)"], notes
    else:
        assert notes == []
    assert g(wd, "rev-parse", "HEAD^{tree}").strip() == tree and g(wd, "status", "--porcelain") == ""


@pytest.mark.parametrize("edit", ["content", "mode"])
def test_a_laid_file_edited_after_the_kill_is_the_users_and_is_kept(project, upstream, tmp_path, env, edit):
    wd = tmp_path / "wd"
    args, _tree = _rebase_to_and_tree(project, upstream, wd, env)
    assert run_tool(project, {**env, journal.KILL_AT: "rename.done"}, *args).returncode == -signal.SIGKILL
    mine = (wd / "pkg/mod.py").read_text() + ("# mine\n" if edit == "content" else "")
    (wd / "pkg/mod.py").write_text(mine)
    if edit == "mode":  # (the review of round 6: a chmod used to be undone)
        (wd / "pkg/mod.py").chmod(0o755)
    again = run_tool(project, env, *args)
    assert again.returncode == 2 and "left as it is (changed since)" in again.stderr, again.stderr
    assert (wd / "pkg/mod.py").read_text() == mine
    assert bool((wd / "pkg/mod.py").stat().st_mode & 0o100) == (edit == "mode")


@pytest.mark.parametrize("signame", ["SIGINT", "SIGTERM"])
def test_a_rebase_to_interrupted_between_laying_and_committing_puts_the_overlay_back(
        project, upstream, tmp_path, env, signame):
    """The review of round 6: Ctrl-C or SIGTERM there marked the step done and left the laid
    files, which the next run read as the maintainer's resolution."""
    wd = tmp_path / "wd"
    args, tree = _rebase_to_and_tree(project, upstream, wd, env)
    interrupt = {journal.KILL_AT: "rename.done", f"{journal.KILL_AT}_SIGNAL": signame}
    run = run_tool(project, {**env, **interrupt}, *args)
    assert run.returncode == 130, run.stderr
    assert g(wd, "status", "--porcelain") == ""  # put back at once
    again = run_tool(project, env, *args)
    assert again.returncode == 0 and NOTE not in again.stderr, again.stderr
    assert g(wd, "rev-parse", "HEAD^{tree}").strip() == tree


def test_a_lay_step_naming_a_git_file_is_never_acted_on(tmp_path):
    """The review of round 6: a forged or damaged journal entry named .git/config with its
    digest, and the recovery removed it. A journal is no licence to touch git's own files."""
    entry = {"step": "lay", "repo": str(tmp_path), "head": "0" * 40, "workdir": str(tmp_path)}
    assert recovery.readable({**entry, "files": [["pkg/mod.py", "ab", False]]})
    for path in (".git/config", "pkg/.GIT/hooks/x", "../x", "/etc/passwd"):
        assert not recovery.readable({**entry, "files": [[path, "ab", False]]}), path


def test_an_export_killed_before_its_first_rename_is_undone(project, upstream, tmp_path, env):
    """Nothing renamed yet: the staged files go and the data is as it was (the least change)."""
    wd = _renamed_patch(project, upstream, tmp_path)
    args = ["-q", "--export", "--workdir", str(wd)]
    assert run_tool(project, {**env, journal.KILL_AT: "rename"}, *args).returncode == -signal.SIGKILL
    again = run_tool(project, env, "-q", "--vllm-repo", str(upstream), "--workdir", str(wd))
    assert [line for line in again.stderr.splitlines() if NOTE in line] == [
        f"{NOTE}removed 5 half-written file(s) it left in {project.root}"], again.stderr
    _whole(project, upstream, env, tmp_path, ["0001-model-line-4.patch", "series"])


def test_an_export_killed_part_way_then_edited_is_left_alone(project, upstream, tmp_path, env):
    """The roll-forward is no stronger than a normal run: a data file the user changed since
    the kill is never written over; only the staged files are removed."""
    wd = _renamed_patch(project, upstream, tmp_path)
    args = ["-q", "--export", "--workdir", str(wd)]
    assert run_tool(project, {**env, journal.KILL_AT: "rename"}, *args).returncode == -signal.SIGKILL
    _rename_by_hand(project, "0002-model-a-new-subject.patch")
    (project.patches_dir / "series").write_text("0001-model-line-4.patch\n# mine\n")
    before = {p.name: p.read_bytes() for p in project.patches_dir.iterdir()}
    again = run_tool(project, env, *args)
    assert [line for line in again.stderr.splitlines() if NOTE in line] == [
        f"{NOTE}it was renaming 5 written file(s) into place in {project.root}: left as it is "
        f"(changed since); removed 4 half-written file(s) it left in {project.root}"], again.stderr
    assert again.returncode == 2 and "uncommitted changes" in again.stderr.splitlines()[-1]
    assert {p.name: p.read_bytes() for p in project.patches_dir.iterdir()} == before
    assert not (project.root / ".k3-tmp").exists()


def _stopped(pid: int) -> bool:
    with open(f"/proc/{pid}/stat") as f:
        return f.read().rsplit(")", 1)[1].split()[0] == "T"


def _stopped_at(point: str, args: list[str], env: dict[str, str]) -> subprocess.Popen:
    """The run ``args`` started and stopped (SIGSTOP) at the journal point ``point``; the
    caller sends SIGCONT."""
    run = subprocess.Popen(args, cwd=ROOT, text=True, stderr=subprocess.PIPE,
                           env={**env, journal.KILL_AT: point, journal.KILL_AT + "_SIGNAL": "SIGSTOP"})
    deadline = time.monotonic() + 60
    while not _stopped(run.pid):
        assert run.poll() is None and time.monotonic() < deadline
        time.sleep(0.1)
    return run


def test_two_exports_at_once_into_one_project_wait_for_each_other(project, upstream, tmp_path, env):
    """Two exports from two checkouts into one project took only their checkouts' locks:
    one stopped between staging and renaming while the other exported a renamed patch
    wrote its series and 0002 over the other's, or the other way round: patches/ ended
    with a file its series did not list, or with whichever came last. The project's own
    lock makes the second wait, saying so."""
    renamed = _renamed_patch(project, upstream, tmp_path)
    first = tmp_path / "wd1"
    assert run_apply(project, Options(vllm_repo=str(upstream), workdir=first)).ok
    start = [sys.executable, "-c", RUNNER, str(project.root), "-q", "--export", "--workdir"]
    one = _stopped_at("write.staged", [*start, str(first)], env)
    try:
        two = subprocess.Popen([*start, str(renamed)], cwd=ROOT, text=True, stderr=subprocess.PIPE,
                               env=env)
        try:
            two.wait(timeout=15)  # it waits for the first, which is stopped
        except subprocess.TimeoutExpired:
            pass
    finally:
        os.kill(one.pid, signal.SIGCONT)
    assert one.wait(timeout=120) == 0
    two.wait(timeout=120)
    said = two.stderr.read()
    assert f"waiting for apply.py (pid {one.pid}) to finish with {project.root}" in said, said
    # then, as after any export, it finds the first one's result uncommitted and says so
    assert two.returncode == 2 and "have uncommitted changes" in said.splitlines()[-1], said
    _whole(project, upstream, env, tmp_path, ["0001-model-line-4.patch", "series"])


@pytest.mark.parametrize("point", ["clone.done", "worktree", "publish"])
def test_a_run_into_a_new_workdir_under_another_cache_waits_for_the_one_making_it(
        project, upstream, tmp_path, env, point):
    """Round 9 of hostile input: a run under a second cache found the first one's clone in the
    new workdir (its claim not yet made: there was no git folder when it started), took it up
    as a killed run's and switched it; the user committed on it, and the first run, going on,
    reset the work branch over their commit. The clone is claimed before it is put in place."""
    wd = tmp_path / "wd"
    args = [sys.executable, "-c", RUNNER, str(project.root), "-q", "--vllm-repo", str(upstream),
            "--workdir", str(wd)]
    one = _stopped_at(point, args, {**env, "XDG_CACHE_HOME": str(tmp_path / "a")})
    try:
        two = subprocess.Popen(args, cwd=ROOT, text=True, stderr=subprocess.PIPE,
                               env={**env, "XDG_CACHE_HOME": str(tmp_path / "b")})
        with pytest.raises(subprocess.TimeoutExpired):
            two.wait(timeout=10)  # it waits for the first, which is stopped
    finally:
        os.kill(one.pid, signal.SIGCONT)
    assert one.wait(timeout=120) == 0, one.stderr.read()
    assert two.wait(timeout=120) == 0
    said = two.stderr.read()
    assert f"waiting for apply.py (pid {one.pid}) to finish with {wd}" in said, said
    assert g(wd, "status", "--porcelain") == "" and g(wd, "symbolic-ref", "HEAD").strip() == \
        "refs/heads/k3-overlay/9.9.9"


def test_a_checkout_copied_or_moved_after_a_kill_is_told_where_the_steps_belong(project, upstream,
                                                                              tmp_path, env):
    """Round 9: both were told "run again under that name", for a copy whose original is
    another checkout, and for a move, whose old name is gone."""
    wd = tmp_path / "wd"
    assert run_apply(project, Options(vllm_repo=str(upstream), workdir=wd)).ok
    args = ["-q", "--vllm-repo", str(upstream), "--vllm-ref", "v1.1.0", "--workdir"]
    assert run_tool(project, {**env, journal.KILL_AT: "publish.switched"}, *args, str(wd)).returncode < 0
    subprocess.run(["cp", "-a", str(wd), str(tmp_path / "copy")], check=True)
    copied = run_tool(project, env, *args, str(tmp_path / "copy"))
    claim_file = tmp_path / "copy" / ".git" / claim.FILE
    assert copied.returncode == 2 and copied.stderr.splitlines()[-1].endswith(
        f"recorded for {wd}, another checkout (this one a copy of it?): not acted on here; run again "
        f"with --workdir {wd} to finish them there, and remove {claim_file}"), copied.stderr
    os.rename(wd, tmp_path / "moved")
    moved = run_tool(project, env, *args, str(tmp_path / "moved"))
    claim_file = tmp_path / "moved" / ".git" / claim.FILE
    assert moved.returncode == 2 and moved.stderr.splitlines()[-1].endswith(
        f"recorded for {wd}, which is gone (moved here?): not acted on; check {tmp_path / 'moved'} with "
        f"git status, then remove {claim_file}"), moved.stderr


def test_a_killed_switch_is_not_forced_over_files_changed_since(project, upstream, tmp_path, env):
    wd = tmp_path / "wd"
    assert run_apply(project, Options(vllm_repo=str(upstream), workdir=wd)).ok
    args = ["-q", "--vllm-repo", str(upstream), "--workdir", str(wd), "--vllm-ref", "v1.1.0"]
    assert run_tool(project, {**env, journal.KILL_AT: "publish"}, *args).returncode < 0
    (wd / "pkg" / "user.py").write_text("a change of the user's, made after the crash\n")
    again = run_tool(project, env, *args)
    assert again.returncode == 2
    assert again.stderr.splitlines()[1:] == [
        f"apply.py: error: {wd} has uncommitted changes; commit or stash them first (or use --check)"]
    assert again.stderr.splitlines()[0].startswith(f"{NOTE}it was switching {wd} to k3-overlay/9.9.9 (")
    assert again.stderr.splitlines()[0].endswith("): left as it is")
    assert (wd / "pkg" / "user.py").read_text() == "a change of the user's, made after the crash\n"


def test_two_runs_at_once_after_a_crash_recover_once(project, upstream, tmp_path, env):
    wd = tmp_path / "wd"
    assert run_apply(project, Options(vllm_repo=str(upstream), workdir=wd)).ok
    args = ["-q", "--vllm-repo", str(upstream), "--workdir", str(wd), "--vllm-ref", "v1.1.0"]
    assert run_tool(project, {**env, journal.KILL_AT: "worktree.added"}, *args).returncode < 0
    runs = [subprocess.Popen([sys.executable, "-c", RUNNER, str(project.root), *args], cwd=ROOT,
                             env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
            for _ in range(2)]
    results = [(run.wait(timeout=120), run.stderr.read()) for run in runs]
    assert [code for code, _ in results] == [0, 0], results
    assert sum(err.count(NOTE) for _, err in results) == 1
    assert leftovers(tmp_path) == [] and g(wd, "status", "--porcelain") == ""


@pytest.mark.parametrize("signame", ["SIGHUP", "SIGTERM"])
def test_a_hang_up_or_terminate_mid_run_cleans_up_like_ctrl_c(project, upstream, tmp_path, env,
                                                              signame):
    wd = tmp_path / "wd"
    assert run_apply(project, Options(vllm_repo=str(upstream), workdir=wd)).ok
    before = state(wd)
    args = ["-q", "--vllm-repo", str(upstream), "--workdir", str(wd), "--vllm-ref", "v1.1.0"]
    run = run_tool(project, {**env, journal.KILL_AT: "worktree.added",
                             f"{journal.KILL_AT}_SIGNAL": signame}, *args)
    assert run.returncode == 130 and run.stderr.startswith("apply.py: interrupted; ")
    assert state(wd) == before and leftovers(tmp_path) == []
    assert not workdir_lock_path(wd).with_suffix(".journal").exists()  # nothing for the next run


HANGING_GIT = """import sys
from pathlib import Path
from k3overlay import git
from k3overlay.lock import workdir_lock
with workdir_lock(Path(sys.argv[1]), say=print):
    git._execute(["-c", "alias.hang=!echo $$ > started; exec sleep 300", "hang"], cwd=sys.argv[1])
"""


@pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="reads /proc to see processes")
def test_no_git_child_outlives_a_killed_tool_and_its_lock_waits_for_them(tmp_path, env):
    """A git child, and what git started (here a shell alias running ``sleep``), in a session
    of their own: today they went on after a SIGKILL of the tool."""
    work = tmp_path / "w"
    work.mkdir()
    tool = subprocess.Popen([sys.executable, "-c", HANGING_GIT, str(work)], cwd=ROOT, env=env)
    deadline = time.monotonic() + 30
    while not (work / "started").exists() or not (work / "started").read_text().strip():
        assert time.monotonic() < deadline and tool.poll() is None
        time.sleep(0.02)
    grandchild = int((work / "started").read_text())  # the shell, exec'd into sleep
    assert alive(grandchild)
    tool.kill()
    tool.wait()
    with workdir_lock(work, say=lambda _: None):  # the next run: its lock waits for them
        assert not alive(grandchild)


def test_a_killed_wheel_builds_scratch_folder_is_removed_by_the_next_build(tmp_path):
    """A SIGKILL'd --build-wheel left its half-written wheel (hundreds of MB) in a
    ``.k3-wheel-*`` folder in the wheel folder for good; a live build's is left alone."""
    from k3overlay.lock import STALE_AFTER_S, owned_scratch

    wheels = tmp_path / "wheels"
    wheels.mkdir()
    killed_in_owned_scratch(wheels, ".k3-wheel-", "vllm-half.whl", b"PK" * 1000)
    [left] = list(wheels.iterdir())
    old = time.time() - STALE_AFTER_S - 1
    os.utime(left, (old, old))
    live = subprocess.Popen([sys.executable, "-c",
                             "import sys; from pathlib import Path\n"
                             "from k3overlay.lock import owned_scratch\n"
                             "with owned_scratch(Path(sys.argv[1]), '.k3-wheel-') as tmp:\n"
                             "    print(tmp, flush=True); sys.stdin.read()\n", str(wheels)],
                            cwd=ROOT, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    theirs = Path(live.stdout.readline().strip())
    os.utime(theirs, (old, old))
    try:
        with owned_scratch(wheels, ".k3-wheel-") as ours:
            assert sorted(wheels.iterdir()) == sorted([ours, theirs])  # the killed one's is gone
    finally:
        live.communicate("")
    assert list(wheels.iterdir()) == []
