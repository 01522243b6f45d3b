"""Right verdicts for every kind of patch, on a synthetic upstream built for them.

Each patch is a ``git format-patch`` of one commit on ``v1``; expectations come
from git itself (``git apply --check``, ``ls-tree``, ``log``) or from how the
upstream refs were built, never from the code under test.

  v1        base: an executable-to-be script, a module and its user, a text file,
            a file to rename, a binary file, a 12-line model file
  v2        upstream made every patch's change itself, and changed line 1 of the
            model file too (so only a 3-way merge sees that patch landed)
  v3        upstream changed line 4 of the model file its own way (our model patch conflicts)
  v4        upstream made only our ``chmod +x``
"""

from __future__ import annotations

import base64
import json
import os
import shutil
import subprocess
from pathlib import Path

import pytest

from k3overlay import cli, errors, series
from k3overlay.export import export
from k3overlay.job import Options, run_apply
from k3overlay.project import Project, ROOT
from k3overlay.rebase import rebase_to, run_rebase
from k3overlay.stages import StageResults

from .conftest import IDENT, g, make_patch, model

BINARY = bytes(range(256)) * 4
BINARY_NEW = bytes(reversed(range(256))) * 4
R_TXT = "".join(f"r{i}\n" for i in range(20))
MOD = "VALUE = 1\n"
USER = "from pkg.mod import VALUE\n"
BASE = {"pkg/__init__.py": "", "pkg/tool.sh": "echo hi\n", "pkg/mod.py": MOD, "pkg/user.py": USER,
        "pkg/old.txt": "old\n", "pkg/r.txt": R_TXT, "pkg/model.txt": model({}),
        "pkg/naïve.py": "N = 1\n", "pkg/my mod.py": "M = 1\n"}

# name -> (subject, author, message body, change); each change is made on v1.
PATCHES = {
    "chmod": ("[Kernel] make tool.sh executable", "José Núñez <jose@example.invalid>",
              "Upstream-Status: Pending", {"chmod": "pkg/tool.sh"}),
    "delete": ("[Misc] remove old.txt", "Upstream Dev <dev@upstream.invalid>",
               "Upstream-Status: Pending", {"delete": "pkg/old.txt"}),
    "rename": ("[Misc] move r.txt", "Upstream Dev <dev@upstream.invalid>",
               "Upstream-Status: Pending", {"rename": ("pkg/r.txt", "pkg/moved.txt")}),
    "binary": ("[Data] new table bytes", "Upstream Dev <dev@upstream.invalid>",
               "Upstream-Status: Pending", {"bytes": ("pkg/data.bin", BINARY_NEW)}),
    "model": ("[Model] line 4", "Upstream Dev <dev@upstream.invalid>",
              "Why: decode.\n\nUpstream-Status: Pending\n---\nA note git am leaves out.",
              {"write": ("pkg/model.txt", model({4: "line 4 (ours)"}))}),
}


def run_git(repo: Path, *args: str, env: dict | None = None) -> str:
    return subprocess.run(["git", *args], cwd=repo, env={**os.environ, **IDENT, **(env or {})},
                          check=True, capture_output=True, text=True).stdout


def change(root: Path, what: dict) -> None:
    for kind, arg in what.items():
        if kind == "chmod":
            (root / arg).chmod(0o755)
        elif kind == "delete":
            run_git(root, "rm", "-q", "--", arg)
        elif kind == "rename":
            run_git(root, "mv", "--", *arg)
        elif kind == "bytes":
            (root / arg[0]).write_bytes(arg[1])
        else:
            (root / arg[0]).write_text(arg[1])


def commit(repo: Path, message: str, author: str | None = None) -> None:
    run_git(repo, "add", "-A")
    extra = ["--author", author] if author else []
    run_git(repo, "commit", "-q", *extra, "-m", message)


@pytest.fixture(scope="session")
def kinds(tmp_path_factory):
    """(upstream repo, {name: patch file}) — see the module docstring."""
    root = tmp_path_factory.mktemp("kinds")
    up = root / "up"
    up.mkdir()
    run_git(up, "init", "-q", "-b", "main")
    for rel, text in BASE.items():
        (up / rel).parent.mkdir(parents=True, exist_ok=True)
        (up / rel).write_text(text)
    (up / "pkg/data.bin").write_bytes(BINARY)
    commit(up, "release v1")
    run_git(up, "tag", "v1")
    for spec in PATCHES.values():
        change(up, spec[3])
    change(up, {"write": ("pkg/model.txt", model({1: "line 1 (upstream)", 4: "line 4 (ours)"}))})
    commit(up, "release v2")
    run_git(up, "tag", "v2")
    run_git(up, "checkout", "-q", "--detach", "v1")
    change(up, {"write": ("pkg/model.txt", model({4: "line 4 (theirs)"}))})
    commit(up, "release v3")
    run_git(up, "tag", "v3")
    run_git(up, "checkout", "-q", "--detach", "v1")
    change(up, {"chmod": "pkg/tool.sh"})
    commit(up, "release v4")
    run_git(up, "tag", "v4")
    patches = {name: patch_on_v1(up, root / "patches", subject, what, body, author)
               for name, (subject, author, body, what) in PATCHES.items()}
    return up, patches


def patch_on_v1(up: Path, out_dir: Path, subject: str, what: dict,
                body: str = "Upstream-Status: Pending", author: str | None = None) -> Path:
    """``git format-patch`` of one commit on v1 making change ``what``."""
    run_git(up, "checkout", "-q", "--detach", "v1")
    change(up, what)
    commit(up, f"{subject}\n\n{body}\n", author)
    out = run_git(up, "format-patch", "-1", "--zero-commit", "--no-signature", "--full-index",
                  "-o", str(out_dir), "HEAD").strip()
    run_git(up, "checkout", "-q", "--detach", "v1")
    return Path(out)


def make_project(root: Path, patch_files: list[Path], base: str = "v1") -> Project:
    """A project with these patches (in this order) and one new overlay file."""
    (root / "patches").mkdir(parents=True)
    for patch in patch_files:
        shutil.copyfile(patch, root / "patches" / patch.name)
    (root / "patches" / "series").write_text("".join(f"{p.name}\n" for p in patch_files))
    (root / "overlay" / "pkg").mkdir(parents=True)
    (root / "overlay" / "pkg" / "extra.py").write_text("from pkg.mod import VALUE\n")
    (root / "overlay.json").write_text(json.dumps(
        {"base": base, "files": [{"path": "pkg/extra.py", "base_blob": "new"}]}))
    (root / "VERSION").write_text("1.0.0\n")
    return Project(root)


def apply(project, up, wd, **kw):
    return run_apply(project, Options(vllm_repo=str(up), workdir=wd, **kw))


def statuses(report) -> list[str]:
    return [p.status for p in report.patches]


def mode(repo: Path, rev: str, path: str) -> str:
    return run_git(repo, "ls-tree", rev, "--", path).split()[0]


def git_applies(repo: Path, rev: str, patch: Path, *args: str) -> bool:
    """Whether git itself applies ``patch`` (with ``args``) to ``rev``'s tree, in a scratch index."""
    index = repo / ".git" / "scratch-index"
    env = {"GIT_INDEX_FILE": str(index)}
    run_git(repo, "read-tree", rev, env=env)
    proc = subprocess.run(["git", "apply", "--cached", *args, str(patch)], cwd=repo, capture_output=True,
                          env={**os.environ, **env})
    index.unlink()
    return proc.returncode == 0


# ----------------------------------------------------------------------------- verdicts


def test_mode_only_patch_applies_on_its_own_base_and_keeps_its_mode(kinds, tmp_path):
    up, patches = kinds
    # A reverse check alone would call it landed: git reverse-applies it to v1 without complaint.
    assert git_applies(up, "v1", patches["chmod"], "--reverse")
    wd = tmp_path / "wd"
    report = apply(make_project(tmp_path / "p", [patches["chmod"]]), up, wd)
    assert report.ok and statuses(report) == ["applied"]
    assert mode(up, "v1", "pkg/tool.sh") == "100644"
    assert mode(wd, "HEAD", "pkg/tool.sh") == "100755"
    assert run_git(wd, "log", "-1", "--format=%s", "HEAD~1").strip() == "[Kernel] make tool.sh executable"


def test_every_kind_of_patch_applies_on_the_base(kinds, tmp_path):
    up, patches = kinds
    wd = tmp_path / "wd"
    report = apply(make_project(tmp_path / "p", list(patches.values())), up, wd)
    assert report.ok, report.to_json()
    assert statuses(report) == ["applied"] * 5
    assert not (wd / "pkg/old.txt").exists() and not (wd / "pkg/r.txt").exists()
    assert (wd / "pkg/moved.txt").read_text() == R_TXT
    assert (wd / "pkg/data.bin").read_bytes() == BINARY_NEW
    # git am kept every subject verbatim, brackets and all, and the non-ASCII author
    log = run_git(wd, "log", "--reverse", "--format=%s|%an", "v1..HEAD~1").splitlines()
    assert log == [f"{s}|{a.split(' <')[0]}" for s, a, _, _ in PATCHES.values()]


def test_every_kind_landed_upstream_leaves_no_commit(kinds, tmp_path):
    up, patches = kinds
    wd = tmp_path / "wd"
    report = apply(make_project(tmp_path / "p", list(patches.values())), up, wd, ref="v2")
    assert statuses(report) == ["landed-upstream"] * 5, report.to_json()
    assert report.ok
    assert run_git(wd, "rev-list", "--count", "v2..HEAD").strip() == "1"  # the overlay commit only
    assert run_git(wd, "diff", "--stat", "v2", "HEAD~1") == ""


def test_landed_through_a_3way_trial_only(kinds, tmp_path):
    # v2 changed line 1 too, inside the model patch's context: git cannot reverse-apply
    # it there, only a 3-way merge shows the change is already made.
    up, patches = kinds
    assert not git_applies(up, "v2", patches["model"], "--reverse")
    assert not git_applies(up, "v2", patches["model"])
    report = apply(make_project(tmp_path / "p", [patches["model"]]), up, tmp_path / "wd", ref="v2")
    assert statuses(report) == ["landed-upstream"]


@pytest.mark.parametrize("kind", ["delete", "rename"])
def test_landed_through_an_unapply_reapply_trial_only(kinds, tmp_path, kind):
    # git's 3-way apply cannot work on a file that is gone: only un-applying and
    # re-applying the patch onto v2 shows upstream made the same deletion or rename.
    up, patches = kinds
    assert not git_applies(up, "v2", patches[kind], "--3way")
    assert git_applies(up, "v2", patches[kind], "--reverse")
    report = apply(make_project(tmp_path / "p", [patches[kind]]), up, tmp_path / "wd", ref="v2")
    assert report.to_json()["patches"] == [{"name": patches[kind].name, "status": "landed-upstream"}]


def foreign_upstream(tmp_path: Path, model_text: str) -> Path:
    """A repository with its own history (none of v1's blobs) tagged f1: our package,
    and pkg/model.txt as given."""
    foreign = tmp_path / "foreign"
    foreign.mkdir()
    run_git(foreign, "init", "-q", "-b", "main")
    for rel in ("pkg/__init__.py", "pkg/mod.py", "pkg/user.py"):
        (foreign / rel).parent.mkdir(parents=True, exist_ok=True)
        (foreign / rel).write_text(BASE[rel])
    (foreign / "pkg/model.txt").write_text(model_text)
    commit(foreign, "foreign release")
    run_git(foreign, "tag", "f1")
    return foreign


def test_landed_when_the_patch_base_blobs_are_unknown(kinds, tmp_path):
    # No 3-way is possible without the patch's base blob; un-apply and re-apply still proves it.
    up, patches = kinds
    foreign = foreign_upstream(tmp_path, model({4: "line 4 (ours)", 12: "line 12 (foreign)"}))
    blob = run_git(up, "rev-parse", "v1:pkg/model.txt").strip()
    assert subprocess.run(["git", "cat-file", "-e", blob], cwd=foreign).returncode != 0
    report = apply(make_project(tmp_path / "p", [patches["model"]], base="f1"), foreign, tmp_path / "wd")
    assert statuses(report) == ["landed-upstream"], report.to_json()


def test_conflict_without_a_3way_names_the_patch_files_and_failed_hunk(kinds, tmp_path):
    up, patches = kinds
    foreign = foreign_upstream(tmp_path, model({3: "line 3 (foreign)"}))
    report = apply(make_project(tmp_path / "p", [patches["model"]], base="f1"), foreign, tmp_path / "wd")
    [result] = report.to_json()["patches"]
    assert result["name"] == patches["model"].name
    assert result["status"] == "conflict" and result["files"] == ["pkg/model.txt"]
    assert result["hunks"] == ["error: patch failed: pkg/model.txt:1"]


def test_a_change_upstream_lacks_is_never_landed(kinds, tmp_path):
    # v4 made our chmod, nothing else: the other patches still apply there.
    up, patches = kinds
    report = apply(make_project(tmp_path / "p", list(patches.values())), up, tmp_path / "wd", ref="v4")
    assert statuses(report) == ["landed-upstream", "applied", "applied", "applied", "applied"]


def test_a_landed_patch_in_the_middle_leaves_the_commits_git_am_would_make_without_it(kinds, tmp_path):
    # The chmod applies directly on v4 yet changes nothing; git am commits that as an
    # empty commit, which must go, leaving exactly the commits of the series without it.
    up, patches = kinds
    with_it = [patches["delete"], patches["chmod"], patches["model"]]
    report = apply(make_project(tmp_path / "a", with_it), up, tmp_path / "wa", ref="v4")
    assert statuses(report) == ["applied", "landed-upstream", "applied"]
    wb = tmp_path / "wb"
    g(up, "clone", "-q", str(up), str(wb))
    g(wb, "checkout", "-q", "--detach", "v4")
    for patch in (patches["delete"], patches["model"]):
        run_git(wb, "am", "-q", "--3way", "--keep-non-patch", "--committer-date-is-author-date",
                str(patch), env={"GIT_COMMITTER_NAME": "vllm-k3-overlay",
                                 "GIT_COMMITTER_EMAIL": "k3-overlay@users.noreply.localhost"})
    assert run_git(tmp_path / "wa", "rev-parse", "HEAD~1") == run_git(wb, "rev-parse", "HEAD")


def test_a_patch_an_earlier_patch_already_made_is_redundant_not_landed(kinds, tmp_path):
    up, patches = kinds
    twin = tmp_path / "0009-twin.patch"
    text = patches["model"].read_text().replace("[Model] line 4", "[Model] line 4 again")
    twin.write_text(text)
    report = apply(make_project(tmp_path / "p", [patches["model"], twin]), up, tmp_path / "wd")
    assert statuses(report) == ["applied", "redundant"]
    assert report.ok  # the tree is right; the series has a patch that does nothing


def test_conflict_in_the_middle_and_later_patches_still_tried(kinds, tmp_path, monkeypatch, capsys):
    up, patches = kinds
    project = make_project(tmp_path / "p", [patches["delete"], patches["model"], patches["chmod"]])
    monkeypatch.setattr(cli, "Project", lambda: project)
    out = tmp_path / "r.json"
    code = cli.main(["-q", "--vllm-repo", str(up), "--workdir", str(tmp_path / "wd"), "--vllm-ref", "v3",
                     "--json", str(out)])
    assert code == errors.CONFLICT
    data = json.loads(out.read_text())
    assert [p["status"] for p in data["patches"]] == ["applied", "conflict", "applied"]
    assert data["patches"][1]["files"] == ["pkg/model.txt"]
    assert data["patches"][1]["hunks"] == ["pkg/model.txt:4-8",  # between the markers git left
                                           "CONFLICT (content): Merge conflict in pkg/model.txt"]
    assert data["ok"] is False and g(tmp_path / "wd", "branch", "--list", "k3-overlay/*") == ""

    seen = {}

    def look(target):  # the rebase job still builds what applied, and runs tests on it
        tree = target.built
        seen["mode"] = mode(tree, "HEAD", "pkg/tool.sh")
        seen["committers"] = set(run_git(tree, "log", "--format=%cn <%ce>", "v3..HEAD").splitlines())
        seen["old"] = (tree / "pkg/old.txt").exists()
        seen["overlay"] = (tree / "pkg/extra.py").exists()
        return StageResults()

    [report] = run_rebase(project, ["v3"], vllm_repo=str(up), stages=look)
    assert statuses(report) == ["applied", "conflict", "applied"]
    assert seen == {"mode": "100755", "old": False, "overlay": True,  # the patch after the
                    "committers": {"vllm-k3-overlay <k3-overlay@users.noreply.localhost>"}}  # conflict too
    assert report.verification.status == "not run" and report.exit_code == errors.CONFLICT


def test_rebase_to_never_calls_our_own_bracketed_patch_landed(kinds, tmp_path, monkeypatch, capsys):
    up, patches = kinds
    project = make_project(tmp_path / "p", [patches["chmod"], patches["model"]])
    wd = tmp_path / "wd"
    opts = Options(ref="v3", vllm_repo=str(up), workdir=wd)
    first = rebase_to(project, opts)
    assert statuses(first) == ["applied", "conflict"]
    assert first.to_json()["workdir"] == str(wd) and first.to_json()["branch"] == "k3-overlay/1.0.0"
    (wd / "pkg/model.txt").write_text(model({4: "line 4 (ours and theirs)"}))
    run_git(wd, "add", "pkg/model.txt")
    run_git(wd, "am", "--continue", env={"GIT_COMMITTER_NAME": "m", "GIT_COMMITTER_EMAIL": "m@m"})
    second = rebase_to(project, opts)
    assert statuses(second) == ["applied", "applied"] and second.ok, second.to_json()
    monkeypatch.setattr(cli, "Project", lambda: project)
    assert cli.main(["--export", "--workdir", str(wd)]) == errors.OK
    out = capsys.readouterr().out.splitlines()
    assert out[:3] == ["exported 2 patch(es) on base v3:", f"  {patches['chmod'].name}",
                       f"  {patches['model'].name}"]
    assert "overlay.json re-recorded at v3" in out and not any("dropped" in line for line in out)


def test_series_status_words_and_listing(kinds, tmp_path, monkeypatch, capsys):
    up, patches = kinds
    project = make_project(tmp_path / "p", [patches["chmod"]])
    monkeypatch.setattr(cli, "Project", lambda: project)
    args = ["-q", "--vllm-repo", str(up), "--workdir", str(tmp_path / "wd"), "--check"]
    series_file = project.patches_dir / "series"
    series_file.write_text(f"# our series\n\n  # indented comment\n{patches['chmod'].name}\n")
    assert cli.main(args) == errors.OK  # comments and blank lines are not patch names
    stray = project.patches_dir / "0099-stray.patch"
    shutil.copyfile(patches["model"], stray)
    assert cli.main(args) == errors.USAGE
    assert "patches not in series: 0099-stray.patch" in capsys.readouterr().err
    stray.unlink()
    patch = project.patches_dir / patches["chmod"].name
    patch.write_text(patch.read_text().replace("Upstream-Status: Pending", "Upstream-Status: Maybe"))
    assert cli.main(args) == errors.USAGE
    assert "lacks an 'Upstream-Status:" in capsys.readouterr().err


def test_upstream_status_after_a_dashes_line_is_not_in_the_commit(kinds, tmp_path):
    # git am cuts the message at a "---" line; a status below it would be lost on export.
    up, patches = kinds
    text = patches["delete"].read_text().replace("Upstream-Status: Pending\n",
                                                   "Intro.\n---\nUpstream-Status: Pending\n")
    path = tmp_path / "0001-x.patch"
    path.write_text(text)
    with pytest.raises(errors.UsageError, match="Upstream-Status"):
        series.read_patch(path)


# ----------------------------------------------------------------------------- verification


@pytest.mark.parametrize("path", ["pkg/naïve.py", "pkg/my mod.py"])
def test_syntax_error_in_a_file_with_an_odd_name_fails_verification(kinds, tmp_path, path):
    up, _ = kinds
    patch = patch_on_v1(up, tmp_path / "out", "break a file", {"write": (path, "def broken(:\n")})
    report = apply(make_project(tmp_path / "p", [patch]), up, tmp_path / "wd")
    assert report.exit_code == errors.VERIFY
    assert report.verify.errors == [f"{path}:1: does not compile: invalid syntax"]


@pytest.mark.parametrize("what", [{"delete": "pkg/mod.py"}, {"rename": ("pkg/mod.py", "pkg/core.py")}])
def test_importers_of_a_deleted_or_renamed_module_fail_verification(kinds, tmp_path, what):
    up, _ = kinds
    patch = patch_on_v1(up, tmp_path / "out", "drop pkg.mod", what)
    project = make_project(tmp_path / "p", [patch])
    (project.overlay_dir / "pkg/extra.py").write_text("X = 1\n")  # only upstream's user is left
    report = apply(project, up, tmp_path / "wd")
    assert report.exit_code == errors.VERIFY
    assert report.verify.errors == ["pkg/user.py:1: cannot import pkg.mod: pkg.mod no longer exists"]


# ----------------------------------------------------------------------------- round trip


def test_apply_export_apply_is_the_identity(kinds, tmp_path):
    up, patches = kinds
    project = make_project(tmp_path / "p", list(patches.values()))
    original = {p.name: p.read_bytes() for p in project.patches_dir.iterdir()}
    wd = tmp_path / "wd"
    assert apply(project, up, wd).ok
    tip = run_git(wd, "rev-parse", "HEAD")
    result = export(project, wd)
    assert result.dropped == [] and result.patches == [p.name for p in patches.values()]
    exported = {p.name: p.read_bytes() for p in project.patches_dir.iterdir()}
    assert set(exported) == set(original)
    again = apply(project, up, tmp_path / "wd2")
    assert again.ok and run_git(tmp_path / "wd2", "rev-parse", "HEAD") == tip  # same commits, same shas
    export(project, tmp_path / "wd2")
    assert {p.name: p.read_bytes() for p in project.patches_dir.iterdir()} == exported
    # what git am kept of the "---" message is what the exported patch says
    message = run_git(wd, "log", "-1", "--format=%B", "HEAD~1")
    assert "Upstream-Status: Pending" in message and "A note git am leaves out" not in message


def test_rebase_to_skips_a_patch_landed_through_a_failed_am(kinds, tmp_path):
    # git am cannot apply a rename upstream already made; the verdict is landed and the
    # maintainer's checkout is left with no am in progress.
    up, patches = kinds
    project = make_project(tmp_path / "p", [patches["rename"], patches["chmod"]])
    wd = tmp_path / "wd"
    report = rebase_to(project, Options(ref="v2", vllm_repo=str(up), workdir=wd))
    assert statuses(report) == ["landed-upstream", "landed-upstream"] and report.ok
    assert not (wd / ".git" / "rebase-apply").exists()
    assert run_git(wd, "rev-list", "--count", "v2..HEAD").strip() == "1"  # the overlay commit


def test_git_am_that_cannot_start_is_an_error(kinds, tmp_path):
    up, patches = kinds
    wd = tmp_path / "wd"
    g(up, "clone", "-q", "--branch", "v3", str(up), str(wd))
    subprocess.run(["git", "am", str(patches["model"])], cwd=wd, capture_output=True)
    assert (wd / ".git" / "rebase-apply").is_dir()  # someone's am, stopped at a conflict
    with pytest.raises(errors.OverlayError, match="has a git am in progress"):  # never skipped or aborted
        series.apply(series.git.open_repo(wd), series.load(make_project(tmp_path / "p", [
            patches["chmod"]]).patches_dir), env=dict(os.environ, **IDENT), ref_sha="HEAD")
    assert (wd / ".git" / "rebase-apply").is_dir()  # theirs, left as it was


def test_rebase_to_rebuilds_a_branch_that_apply_made_on_another_ref(kinds, tmp_path):
    up, patches = kinds
    project = make_project(tmp_path / "p", [patches["chmod"]])
    wd = tmp_path / "wd"
    assert apply(project, up, wd).ok  # the work branch on v1
    report = rebase_to(project, Options(ref="v3", vllm_repo=str(up), workdir=wd))
    assert report.ok, report.to_json()
    assert run_git(wd, "rev-parse", "HEAD~2") == run_git(up, "rev-parse", "v3")  # v3, patch, overlay


def test_rebase_to_never_rewrites_a_branch_it_did_not_make(kinds, tmp_path):
    up, patches = kinds
    project = make_project(tmp_path / "p", [patches["chmod"]])
    wd = tmp_path / "wd"
    g(up, "clone", "-q", str(up), str(wd))
    g(wd, "branch", "k3-overlay/1.0.0", "v1")
    tip = run_git(wd, "rev-parse", "k3-overlay/1.0.0")
    with pytest.raises(errors.UsageError, match="not created by apply.py"):
        rebase_to(project, Options(ref="v3", vllm_repo=str(up), workdir=wd))
    assert run_git(wd, "rev-parse", "k3-overlay/1.0.0") == tip


def test_an_overlay_upstream_already_matches_makes_no_commit(kinds, tmp_path):
    up, patches = kinds
    project = make_project(tmp_path / "p", [patches["chmod"]])
    (project.overlay_dir / "pkg/extra.py").unlink()
    (project.overlay_dir / "pkg/mod.py").write_text(MOD)  # byte for byte upstream's
    project.manifest_path.write_text(json.dumps({"base": "v1", "files": [
        {"path": "pkg/mod.py", "base_blob": run_git(up, "rev-parse", "v1:pkg/mod.py").strip()}]}))
    wd = tmp_path / "wd"
    report = apply(project, up, wd)
    assert report.ok and [f.status for f in report.overlay] == ["replaced"]
    assert run_git(wd, "log", "--format=%s", "v1..HEAD").splitlines() == [PATCHES["chmod"][0]]


def test_an_import_upstream_broke_itself_is_not_ours_to_judge(kinds, tmp_path):
    # Upstream's own pkg/stale.py imports a name pkg.mod never had; our patch touches
    # pkg.mod but takes nothing away, so verification has nothing to say about it.
    up, _ = kinds
    foreign = foreign_upstream(tmp_path, model({}))
    (foreign / "pkg/stale.py").write_text("from pkg.mod import NEVER_THERE\n")
    commit(foreign, "upstream's own broken import")
    run_git(foreign, "tag", "-f", "f1")
    patch = patch_on_v1(up, tmp_path / "out", "pkg.mod grows", {"write": ("pkg/mod.py", MOD + "MORE = 2\n")})
    report = apply(make_project(tmp_path / "p", [patch], base="f1"), foreign, tmp_path / "wd")
    assert report.ok and report.verify.errors == [], report.to_json()



def test_two_patches_sharing_a_subject_are_refused(project, upstream, tmp_path):
    """Found by the second adversarial pass: --rebase-to finds a patch's commit by its subject,
    so after a conflict and ``git am --continue`` the run that went on took a later patch with
    an earlier one's subject for applied: its change was lost, reported ``applied``, exit 0,
    and --export then dropped it without a word."""
    later = make_patch(upstream, project.patches_dir, "0002-model-line-9.patch", {9: "line 9 (ours)"})
    later.write_text(later.read_text().replace("model: change lines [9]", "model: change lines [4]"))
    (project.patches_dir / "series").write_text("0001-model-line-4.patch\n0002-model-line-9.patch\n")
    for run in (lambda: run_apply(project, Options(vllm_repo=str(upstream), workdir=tmp_path / "wd")),
                lambda: rebase_to(project, Options(vllm_repo=str(upstream), workdir=tmp_path / "wd",
                                                   ref="v1.1.0"))):
        with pytest.raises(errors.UsageError) as err:
            run()
        assert str(err.value) == ("0001-model-line-4.patch and 0002-model-line-9.patch share the "
                                  "subject 'model: change lines [4]'; reword one (--rebase-to and "
                                  "--export tell patches apart by subject)")
    assert not (tmp_path / "wd").exists()


def _patch_of(upstream: Path, tmp_path: Path, out: Path, change) -> Path:
    """A format-patch of what ``change(work)`` does to a worktree of v1.0.0 (renames found)."""
    work = tmp_path / "_mk_overlay"
    g(upstream, "worktree", "add", "-q", "--detach", str(work), "v1.0.0")
    try:
        change(work)
        g(work, "add", "-A")
        g(work, "commit", "-q", "-m", "mod: a change of ours\n\nUpstream-Status: Pending")
        out.write_text(g(work, "format-patch", "-1", "-M", "--zero-commit", "--no-signature",
                         "--full-index", "--stdout", "HEAD"))
    finally:
        g(upstream, "worktree", "remove", "--force", str(work))
    return out


OVERLAY_CHANGES = {
    "edits a replaced file": lambda w: (w / "pkg/mod.py").write_text("def old():\n    return 2\n"),
    "adds an added file": lambda w: (w / "pkg/new.py").write_text("NEW = 1\n"),
    "deletes a replaced file": lambda w: (w / "pkg/mod.py").unlink(),
    "renames a replaced file away": lambda w: (w / "pkg/mod.py").rename(w / "pkg/mod2.py"),
}


@pytest.mark.parametrize("kind", list(OVERLAY_CHANGES))
@pytest.mark.parametrize("mode", ["apply", "--rebase-to", "rebase job"])
def test_a_patch_changing_an_overlay_files_path_is_refused_before_any_work(project, upstream, tmp_path,
                                                                          kind, mode):
    """Round 7: a patch editing pkg/mod.py, which the overlay replaces, was reported "applied"
    while the overlay laid over its change (lost, exit 0); --export, which takes a commit
    touching only overlay files for the overlay's own, then dropped the patch from the series."""
    _patch_of(upstream, tmp_path, project.patches_dir / "0002-mod-a-change-of-ours.patch",
              OVERLAY_CHANGES[kind])
    (project.patches_dir / "series").write_text("0001-model-line-4.patch\n0002-mod-a-change-of-ours.patch\n")
    opts = Options(vllm_repo=str(upstream), workdir=tmp_path / "wd", ref="v1.1.0")
    with pytest.raises(errors.UsageError) as err:
        if mode == "apply":
            run_apply(project, opts)
        elif mode == "--rebase-to":
            rebase_to(project, opts)
        else:
            run_rebase(project, ["v1.1.0"], vllm_repo=str(upstream))
    path = "pkg/new.py" if kind == "adds an added file" else "pkg/mod.py"
    assert str(err.value) == (f"0002-mod-a-change-of-ours.patch changes {path}, an overlay file: the "
                              f"overlay is laid whole over the patch's change, which would be lost (and "
                              f"--export would drop the patch); make that change in overlay/{path} instead")
    assert not (tmp_path / "wd").exists()


def _base64_body(patch: Path) -> Path:
    """``patch`` with its body base64-encoded, as some mailers send it (git am decodes it)."""
    head, _, body = patch.read_text().partition("\n\n")
    head += "\nMIME-Version: 1.0\nContent-Type: text/plain; charset=UTF-8\nContent-Transfer-Encoding: base64"
    patch.write_text(head + "\n\n" + base64.encodebytes(body.encode()).decode())
    return patch


@pytest.mark.parametrize("overlay", [False, True])
def test_a_patch_with_a_base64_body_is_read_as_git_am_reads_it(project, upstream, tmp_path, overlay):
    """The paths a patch changes are read from the diff git am applies: a base64 body (which
    git apply alone reads no diff in) still applies, and still counts when it edits an overlay file."""
    if overlay:
        _patch_of(upstream, tmp_path, project.patches_dir / "0001-model-line-4.patch",
                  OVERLAY_CHANGES["edits a replaced file"])
    _base64_body(project.patches_dir / "0001-model-line-4.patch")
    opts = Options(vllm_repo=str(upstream), workdir=tmp_path / "wd")
    if overlay:
        with pytest.raises(errors.UsageError, match="changes pkg/mod.py, an overlay file"):
            run_apply(project, opts)
    else:
        assert [p.status for p in run_apply(project, opts).patches] == ["applied"]


def test_a_patch_with_a_base64_body_is_classified_and_rebased_like_any_other(project, upstream, tmp_path):
    """Round 7: the apply trials and patch-ids read the raw mail, where a base64 body holds no
    diff: on v1.2.0 (upstream made the change) the patch was "redundant", not landed-upstream,
    and --rebase-to stopped: "git apply failed: error: No valid patches in input"."""
    _base64_body(project.patches_dir / "0001-model-line-4.patch")
    wd = tmp_path / "wd"
    landed = run_apply(project, Options(vllm_repo=str(upstream), workdir=tmp_path / "w2", ref="v1.2.0",
                                        allow_drift=True))
    assert [p.status for p in landed.patches] == ["landed-upstream"]
    assert run_apply(project, Options(vllm_repo=str(upstream), workdir=wd)).ok
    rebased = rebase_to(project, Options(vllm_repo=str(upstream), workdir=wd, ref="v1.1.0"))
    assert rebased.ok and [p.status for p in rebased.patches] == ["applied-3way"]


def test_a_patch_is_decoded_once_per_content_and_again_when_it_changes(project, monkeypatch):
    """Each patch's diff was decoded by ``git mailinfo`` for its paths, every apply trial and
    its patch id: one git process each. Decoded once per content now, a changed file anew."""
    from k3overlay import gitpatch

    patch = project.patches_dir / "0001-model-line-4.patch"
    _base64_body(patch)
    real, calls = gitpatch._execute, []
    monkeypatch.setattr(gitpatch, "_execute", lambda args, **kw: calls.append(args[0]) or real(args, **kw))
    gitpatch._decoded.cache_clear()
    diffs = []
    for _ in range(3):
        with gitpatch.diff_of(patch) as diff:
            diffs.append(diff.read_bytes())
    assert calls == ["mailinfo"] and diffs[0] == diffs[2] and b"+line 4 (ours)" in diffs[0]
    patch.write_text(patch.read_text().replace("Subject:", "Subject: [PATCH]", 1))
    with gitpatch.diff_of(patch) as diff:
        assert diff.read_bytes() == diffs[0]
    assert calls == ["mailinfo", "mailinfo"]


# -- Found by the second adversarial pass: a checkout of this repository whose line endings
# git converted (``core.autocrlf=true``, common on Windows and WSL) made every patch of the
# series a "conflict" (exit 3, naming hunks of upstream's files that were never the
# problem) and would lay every overlay file with CRLF endings. The repository's
# ``.gitattributes`` now keeps its data byte for byte on checkout, and a patch converted
# anyway (an archive unpacked by a converting tool) is named in one line, exit 2.


def test_a_patch_with_crlf_endings_is_named_not_called_a_conflict(project, upstream, tmp_path):
    patch = project.patches_dir / "0001-model-line-4.patch"
    patch.write_bytes(patch.read_bytes().replace(b"\n", b"\r\n"))
    with pytest.raises(errors.UsageError) as err:
        run_apply(project, Options(vllm_repo=str(upstream), workdir=tmp_path / "wd"))
    assert str(err.value) == ("0001-model-line-4.patch has CRLF line endings (converted on "
                              "checkout, e.g. by core.autocrlf=true?): check patches/ out again "
                              "with LF endings")
    assert not (tmp_path / "wd").exists()


def test_a_patch_that_changes_crlf_content_is_still_read(project):
    """CR inside the diff (a file upstream keeps with CRLF endings) is content, not a sign of
    a converted patch: only a first line ending in CR is."""
    patch = project.patches_dir / "0001-model-line-4.patch"
    text = patch.read_bytes().replace(b"+line 4 (ours)\n", b"+line 4 (ours)\r\n")
    assert b"\r\n" in text
    patch.write_bytes(text)
    assert [p.name for p in series.load(project.patches_dir)] == ["0001-model-line-4.patch"]


def test_this_repositorys_data_is_checked_out_byte_for_byte_under_autocrlf(project, upstream,
                                                                           tmp_path):
    """The synthetic project committed with this repository's .gitattributes, cloned with
    core.autocrlf=true, still applies (and its files hold no CR)."""
    shutil.copy(ROOT / ".gitattributes", project.root / ".gitattributes")
    g(project.root, "init", "-q", "-b", "main")
    g(project.root, "add", "-A")
    g(project.root, "commit", "-qm", "the project")
    clone = tmp_path / "clone"
    g(tmp_path, "-c", "core.autocrlf=true", "clone", "-q", str(project.root), str(clone))
    data = [p for p in clone.rglob("*") if p.is_file() and ".git" not in p.parts
            and p.name != ".gitattributes"]
    assert len(data) == 6 and not [p for p in data if b"\r" in p.read_bytes()]
    report = run_apply(Project(clone), Options(vllm_repo=str(upstream), workdir=tmp_path / "wd"))
    assert report.ok and [p.status for p in report.patches] == ["applied"]
    assert b"\r" not in (tmp_path / "wd/pkg/new.py").read_bytes()


def test_gitattributes_covers_every_data_path():
    """Every kind of data file of the real repository is marked -text (git says so)."""
    paths = ["patches/series", "patches/0001-x.patch", "overlay/vllm/a/b.py", "overlay.json",
             "VERSION"]
    out = subprocess.run(["git", "check-attr", "text", "--", *paths], cwd=ROOT, check=True,
                         capture_output=True, text=True).stdout.splitlines()
    assert out == [f"{path}: text: unset" for path in paths]
    assert Path(ROOT / ".gitattributes").is_file()


# -- Found by the second adversarial pass: a patch that writes into ``.git`` (any case, at any
# depth) or out of the tree (``../``). git refuses such a path, so nothing was ever written,
# but the report called the patch a bare "conflict" naming no file and no reason; the
# conflict entry now carries git's own line, once (am and apply both said it).


EVIL = """From 0000000000000000000000000000000000000000 Mon Sep 17 00:00:00 2001
From: A <a@b.c>
Date: Thu, 1 Jan 2026 00:00:00 +0000
Subject: [PATCH] evil

Upstream-Status: Pending
---
diff --git a/{path} b/{path}
new file mode 100755
index 0000000..1111111
--- /dev/null
+++ b/{path}
@@ -0,0 +1,2 @@
+#!/bin/sh
+touch {marker}
"""


@pytest.mark.parametrize("path", [".git/hooks/post-checkout", ".GIT/config", "pkg/.git/x",
                                  "../outside.txt", "pkg/../../outside.txt"])
@pytest.mark.parametrize("check", [True, False])
def test_a_patch_writing_into_dot_git_or_out_of_the_tree_is_named(project, upstream, tmp_path,
                                                                  path, check):
    marker = tmp_path / "hook-ran"
    (project.patches_dir / "0002-evil.patch").write_text(EVIL.format(path=path, marker=marker))
    with open(project.patches_dir / "series", "a") as series:
        series.write("0002-evil.patch\n")
    wd = tmp_path / "wd"
    g(tmp_path, "clone", "-q", str(upstream), str(wd))
    head = g(wd, "rev-parse", "HEAD")
    with pytest.raises(errors.UsageError, match=f"^0002-evil.patch writes {path!r}, a path (inside a git "
                                                f"folder|out of the tree): git refuses it"):
        run_apply(project, Options(vllm_repo=str(upstream), workdir=wd, check=check))
    # (round 10: it used to be a conflict, exit 3, whose next lines said `git add -- PATH`)
    assert g(wd, "rev-parse", "HEAD") == head and g(wd, "status", "--porcelain") == ""
    assert sorted(p.name for p in tmp_path.iterdir()) == ["cache", "project", "wd"]
    assert not (wd / ".git/hooks/post-checkout").exists() and not marker.exists()


def test_a_conflict_without_3way_names_only_the_files_whose_hunks_fail():
    """0006 on v0.29.0 in the job's fresh clone: git apply fails mla.py's hunk, mtp.py's apply;
    the files to resolve are mla.py alone (the report used to say "resolve mla.py, mtp.py")."""
    from k3overlay.series import _named

    paths = ["vllm/model_executor/layers/mla.py", "vllm/models/kimi_k3/nvidia/mtp.py"]
    hunks = ["error: patch failed: vllm/model_executor/layers/mla.py:212",
             "error: vllm/model_executor/layers/mla.py: patch does not apply"]
    assert _named(paths, hunks) == ["vllm/model_executor/layers/mla.py"]
    assert _named(paths, ["error: vllm/models/kimi_k3/nvidia/mtp.py: does not exist in index"]) == [paths[1]]
    assert _named(paths, ["something git said"]) == paths  # nothing named: every file, as before


HOSTILE_DIFFS = {  # a patch's diff writing where no patch may, and the path the refusal names
    "into .git": (".git/hooks/post-checkout", "a path inside a git folder"),
    "into .GIT.": ("pkg/.GIT./config", "a path inside a git folder"),
    "into git~1": ("GIT~1/hooks/x", "a path inside a git folder"),
    "out of the tree": ("../outside.txt", "a path out of the tree"),
    "through a link it makes": ("pkg/evil/x.py", "a path through pkg/evil, a symbolic link the patch makes"),
    # round 10b: an NTFS stream, an HFS+-ignored character, a '.' part
    "into .git::$INDEX_ALLOCATION": (".git::$INDEX_ALLOCATION/hooks/x", "a path inside a git folder"),
    "into .g\u200cit": (".g\u200cit/hooks/x", "a path inside a git folder"),
    "a '.' part": ("pkg/./x.py", "a path with a '.' or an empty part"),
}


def _hostile_patch(path: str) -> str:
    link = ("diff --git a/pkg/evil b/pkg/evil\nnew file mode 120000\n--- /dev/null\n+++ b/pkg/evil\n"
            "@@ -0,0 +1 @@\n+/etc\n\\ No newline at end of file\n") if path.startswith("pkg/evil/") else ""
    return ("From 0000000000000000000000000000000000000000 Mon Sep 17 00:00:00 2001\nFrom: t <t@x>\n"
            "Date: Sun, 29 Nov 2026 23:55:00 +0000\nSubject: [PATCH] hostile\n\nUpstream-Status: Pending\n"
            f"---\n{link}diff --git a/{path} b/{path}\nnew file mode 100755\n--- /dev/null\n+++ b/{path}\n"
            "@@ -0,0 +1,2 @@\n+#!/bin/sh\n+touch pwned\n--\n2.39.0\n\n")


@pytest.mark.parametrize("kind", sorted(HOSTILE_DIFFS))
@pytest.mark.parametrize("mode", ["apply", "--rebase-to"])
def test_a_patch_writing_in_git_out_of_the_tree_or_through_its_link_is_bad_input(project, upstream, tmp_path,
                                                                                 kind, mode):
    """Round 10: such a patch was reported as an ordinary conflict (exit 3) after the run had
    cloned and applied the series, and its next lines told the maintainer to
    ``git add -- .git/hooks/post-checkout``. git refuses the path; it is refused before any work."""
    path, why = HOSTILE_DIFFS[kind]
    (project.patches_dir / "0002-hostile.patch").write_text(_hostile_patch(path))
    (project.patches_dir / "series").write_text("0001-model-line-4.patch\n0002-hostile.patch\n")
    opts = Options(vllm_repo=str(upstream), workdir=tmp_path / "wd", ref="v1.1.0")
    with pytest.raises(errors.UsageError) as err:
        run_apply(project, opts) if mode == "apply" else rebase_to(project, opts)
    assert str(err.value) == (f"0002-hostile.patch writes {path!r}, {why}: git refuses it, and no patch "
                              f"of the series may; take it out of the patch")
    assert not (tmp_path / "wd").exists() and not (tmp_path / "outside.txt").exists()


def test_a_link_an_earlier_patch_makes_is_no_way_for_a_later_one(project, upstream, tmp_path):
    """Round 10b: a link made by one patch and written through by the next was a conflict."""
    link = _hostile_patch("pkg/evil/x.py")
    head, _, rest = link.partition("diff --git a/pkg/evil/x.py")
    (project.patches_dir / "0002-link.patch").write_text(head + "--\n2.39.0\n\n")
    (project.patches_dir / "0003-through.patch").write_text(
        head.split("---\n", 1)[0].replace("Subject: [PATCH] hostile", "Subject: [PATCH] through it")
        + "---\ndiff --git a/pkg/evil/x.py" + rest)
    (project.patches_dir / "series").write_text("0001-model-line-4.patch\n0002-link.patch\n0003-through.patch\n")
    with pytest.raises(errors.UsageError) as err:
        run_apply(project, Options(vllm_repo=str(upstream), workdir=tmp_path / "wd"))
    assert str(err.value).startswith("0003-through.patch writes 'pkg/evil/x.py', a path through pkg/evil, ")
