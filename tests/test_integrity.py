"""Issue 8 on synthetic repos: hostile trees, ignore rules, the user's git config, detached
HEADs, refs that are no commit, and reports on a full disk. Every case asserts what must
not change (files outside the tree, the checkout) as well as the exit code."""

from __future__ import annotations

import errno
import json
import os
import shutil
import stat
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from k3overlay import cli, errors, files, git, manifest, report
from k3overlay import series as series_mod
from k3overlay.export import export
from k3overlay.job import Options, run_apply
from k3overlay.rebase import rebase_to, run_rebase
from k3overlay.verify import verify

from .conftest import IDENT, g, snapshot, write

ROOT = Path(__file__).resolve().parent.parent
PRECIOUS = "precious: must never be overwritten\n"


def apply(project, upstream, workdir, **kw):
    return run_apply(project, Options(vllm_repo=str(upstream), workdir=workdir, **kw))


def hostile(upstream: Path, tmp_path: Path, build, tag: str = "evil", staged=None) -> Path:
    """A clone of the synthetic upstream with ``tag`` = v1.0.0 plus what ``build(tree)`` did
    to the files and ``staged(tree)`` to the index."""
    up = tmp_path / "hostile"
    if not up.exists():
        g(upstream, "clone", "-q", str(upstream), str(up))
    g(up, "checkout", "-q", "--detach", "v1.0.0")
    build(up)
    g(up, "add", "-A")
    if staged:
        staged(up)
    g(up, "commit", "-qm", f"upstream: {tag}")
    g(up, "tag", tag)
    return up


def relink(tree: Path, rel: str, target: str) -> None:
    (tree / rel).unlink(missing_ok=True)
    (tree / rel).parent.mkdir(parents=True, exist_ok=True)
    (tree / rel).symlink_to(target)


@pytest.fixture
def tmpdir_here(tmp_path, monkeypatch) -> Path:
    """Temporary folders (worktrees, scratch clones) under tmp_path/t, so a relative link
    ``../../../../victim`` from a worktree's ``pkg/`` lands on tmp_path/victim."""
    t = tmp_path / "t"
    t.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(t))
    monkeypatch.setenv("TMPDIR", str(t))
    return t


# -- 1. links, folders and submodules where an overlay file goes ------------------------------

@pytest.mark.parametrize("target", ["absolute", "relative", "dangling"])
@pytest.mark.parametrize("recorded", ["link-blob", "base-blob"])
def test_link_at_an_overlay_destination_is_never_written_through(
        project, upstream, tmp_path, tmpdir_here, target, recorded):
    victim = tmp_path / "victim"
    if target != "dangling":
        victim.write_text(PRECIOUS)
    link = {"absolute": str(victim), "relative": "../../../../victim", "dangling": str(victim)}[target]
    up = hostile(upstream, tmp_path, lambda t: (relink(t, "pkg/mod.py", link),
                                                relink(t, "pkg/new.py", link)))
    if recorded == "link-blob":  # the manifest even records the link's blob as our base
        data = json.loads(project.manifest_path.read_text())
        data["files"][0]["base_blob"] = g(up, "rev-parse", "evil:pkg/mod.py").strip()
        project.manifest_path.write_text(json.dumps(data))
    wd = tmp_path / "wd"
    for check in (True, False):
        rep = apply(project, up, wd, ref="evil", check=check)
        assert rep.exit_code == errors.DRIFT and not rep.published
        by_path = {f.path: f for f in rep.overlay}
        for path in ("pkg/mod.py", "pkg/new.py"):
            assert by_path[path].status == "conflict"
            assert "symbolic link" in by_path[path].detail
    assert victim.read_text() == PRECIOUS if target != "dangling" else not victim.exists()
    assert g(wd, "branch", "--list", "k3-overlay/*") == ""
    assert os.listdir(tmpdir_here) == []  # no temporary worktree or clone left behind


@pytest.mark.parametrize("shape, words", [
    ("folder", "a folder"), ("parent-link", "a symbolic link"), ("parent-file", "a file"),
    ("submodule", "a submodule")])
def test_folder_submodule_or_link_on_the_way_is_refused(project, upstream, tmp_path, tmpdir_here,
                                                        shape, words):
    outside = tmp_path / "outside"
    outside.mkdir()

    def build(t: Path) -> None:
        if shape == "folder":
            write(t, {"pkg/new.py/inner.txt": "upstream made this a folder\n"})
        elif shape == "parent-link":
            (t / "ext").symlink_to(outside)
        elif shape == "parent-file":
            write(t, {"ext": "a file where our folder goes\n"})

    def gitlink(t: Path) -> None:
        sha = g(t, "rev-parse", "HEAD").strip()
        g(t, "update-index", "--add", "--cacheinfo", f"160000,{sha},pkg/new.py")

    up = hostile(upstream, tmp_path, build, staged=gitlink if shape == "submodule" else None)
    write(project.overlay_dir, {"ext/tool.py": "X = 1\n"})
    data = json.loads(project.manifest_path.read_text())
    data["files"].append({"path": "ext/tool.py", "base_blob": "new"})
    project.manifest_path.write_text(json.dumps(data))
    rep = apply(project, up, tmp_path / "wd", ref="evil")
    bad = "pkg/new.py" if shape in ("folder", "submodule") else "ext/tool.py"
    result = {f.path: f for f in rep.overlay}[bad]
    assert rep.exit_code == errors.DRIFT and result.status == "conflict" and words in result.detail
    assert os.listdir(outside) == [] and not rep.published


def test_rebase_job_merges_nothing_through_a_link(project, upstream, tmp_path, tmpdir_here):
    victim = tmp_path / "victim"
    victim.write_text(PRECIOUS)
    up = hostile(upstream, tmp_path, lambda t: relink(t, "pkg/mod.py", "../../../../victim"))
    (rep,) = run_rebase(project, ["evil"], vllm_repo=str(up))
    mod = {f.path: f for f in rep.overlay}["pkg/mod.py"]
    assert mod.status == "conflict" and "symbolic link" in mod.detail and mod.merged is None
    assert rep.exit_code == errors.DRIFT and victim.read_text() == PRECIOUS


def test_lay_refuses_a_link_a_patch_made_and_writes_nothing(project, upstream, tmp_path):
    tree = tmp_path / "tree"
    g(upstream, "clone", "-q", "--branch", "v1.0.0", str(upstream), str(tree))
    victim = tmp_path / "victim"
    victim.write_text(PRECIOUS)
    relink(tree, "pkg/new.py", str(victim))
    g(tree, "add", "-A")
    g(tree, "commit", "-qm", "a patch that makes a link")
    results = [manifest.FileResult("pkg/mod.py", "replaced"), manifest.FileResult("pkg/new.py", "added")]
    with pytest.raises(errors.UsageError, match="pkg/new.py is a symbolic link"):
        manifest.lay(git.open_repo(tree), manifest.to_lay(project.overlay_dir, results))
    assert victim.read_text() == PRECIOUS
    assert g(tree, "status", "--porcelain") == ""  # nothing laid, not even pkg/mod.py


def test_write_in_tree_follows_no_link_on_disk(tmp_path):
    tree, outside = tmp_path / "tree", tmp_path / "outside"
    (tree / "pkg").mkdir(parents=True)
    outside.mkdir()
    (outside / "x.py").write_text(PRECIOUS)
    (tree / "linkdir").symlink_to(outside)
    (tree / "pkg" / "link.py").symlink_to(outside / "x.py")
    (tree / "pkg" / "dir.py").mkdir()
    (tree / "plain.txt").write_text("a file\n")
    for rel, what in [("linkdir/x.py", "linkdir is a symbolic link"),
                      ("pkg/link.py", "symbolic link in the tree"),
                      ("pkg/dir.py",
                       "^refusing to write pkg/dir.py: it is a folder in the tree, not a file$"),
                      ("plain.txt/x", "^refusing to write plain.txt/x: plain.txt is a file, not a folder$"),
                      ("pkg/link.py/x", "pkg/link.py is a symbolic link"), ("../x", "not a plain"),
                      ("/etc/x", "not a plain"), ("pkg//x", "not a plain")]:
        with pytest.raises(errors.UsageError, match=what):
            files.write_in_tree(tree, rel, b"evil\n")
    assert (outside / "x.py").read_text() == PRECIOUS and sorted(os.listdir(outside)) == ["x.py"]
    files.write_in_tree(tree, "new/deep/tool.sh", b"#!/bin/sh\n", executable=True)
    mode = (tree / "new/deep/tool.sh").stat().st_mode
    assert mode & stat.S_IXUSR and (tree / "new/deep/tool.sh").read_bytes() == b"#!/bin/sh\n"


def test_verify_skips_links_fifos_and_folders_named_py(tmp_path):
    tree, outside = tmp_path / "tree", tmp_path / "outside"
    write(tree, {"pkg/__init__.py": "", "pkg/mod.py": "VALUE = 1\n",
                 "pkg/user.py": "from pkg.mod import VALUE\n"})
    write(outside, {"evil.py": "from pkg.mod import MISSING\n"})
    (tree / "pkg" / "dangling.py").symlink_to(tmp_path / "nowhere.py")
    (tree / "pkg" / "outside.py").symlink_to(outside / "evil.py")  # read, it would fail verify
    (tree / "pkg" / "dir.py").mkdir()
    os.mkfifo(tree / "pkg" / "fifo.py")  # read, it would block forever
    result = verify(tree, ["pkg/mod.py", "pkg/dangling.py", "pkg/outside.py", "pkg/fifo.py"])
    assert result.ok, result.errors
    (tree / "pkg/mod.py").write_text("OTHER = 1\n")  # and a real failure is still seen
    assert verify(tree, ["pkg/mod.py"]).errors == ["pkg/user.py:1: cannot import name 'VALUE' "
                                                   "from pkg.mod"]


def test_dangling_py_link_in_upstream_tree_applies(project, upstream, tmp_path):
    up = hostile(upstream, tmp_path, lambda t: relink(t, "pkg/gone.py", "../nowhere/gone.py"))
    rep = apply(project, up, tmp_path / "wd", ref="evil")
    assert rep.ok, rep.to_json()
    assert os.path.islink(tmp_path / "wd/pkg/gone.py")  # upstream's link kept as a link


def test_overlay_source_link_or_git_path_is_refused(project, upstream, tmp_path):
    outside = tmp_path / "secret.py"
    outside.write_text("SECRET = 1\n")
    (project.overlay_dir / "pkg/new.py").unlink()
    (project.overlay_dir / "pkg/new.py").symlink_to(outside)
    with pytest.raises(errors.UsageError, match="overlay/pkg/new.py is a symbolic link"):
        apply(project, upstream, tmp_path / "wd")
    for path in (".git/hooks/post-checkout", "pkg/.GIT/x", "pkg/.git./x", "pkg/a\nb"):
        project.manifest_path.write_text(json.dumps(
            {"base": "v1.0.0", "files": [{"path": path, "base_blob": "new"}]}))
        with pytest.raises(errors.UsageError, match="bad path"):
            apply(project, upstream, tmp_path / "wd")
    assert not (tmp_path / "wd").exists()


@pytest.mark.parametrize("file_mode", [False, True])
def test_overlay_files_keep_their_mode(project, upstream, tmp_path, file_mode):
    write(project.overlay_dir, {"pkg/tool.sh": "#!/bin/sh\necho hi\n"})
    (project.overlay_dir / "pkg/tool.sh").chmod(0o755)
    data = json.loads(project.manifest_path.read_text())
    data["files"].append({"path": "pkg/tool.sh", "base_blob": "new"})
    project.manifest_path.write_text(json.dumps(data))
    wd = tmp_path / "wd"
    g(upstream, "clone", "-q", str(upstream), str(wd))
    g(wd, "config", "core.fileMode", str(file_mode).lower())  # git would not see the x bit
    assert apply(project, upstream, wd).ok
    modes = {line.split("\t")[1]: line.split()[0] for line in
             g(wd, "ls-tree", "-r", "HEAD", "pkg").splitlines()}
    assert modes["pkg/tool.sh"] == "100755" and modes["pkg/new.py"] == modes["pkg/mod.py"] == "100644"


# -- 3. ignore rules and filters cannot leave a file out or change it -------------------------

def test_ignored_or_filtered_overlay_files_are_committed_exactly(project, upstream, tmp_path,
                                                                 monkeypatch):
    up = hostile(upstream, tmp_path, lambda t: write(t, {
        ".gitignore": "pkg/new.py\n", ".gitattributes": "*.py filter=evil ident\n"}))
    wd = tmp_path / "wd"
    g(up, "clone", "-q", str(up), str(wd))
    (wd / ".git/info/exclude").write_text("*.py\n")
    g(wd, "config", "filter.evil.clean", "sed s/ours/THEIRS/")  # the checkout's own config
    xdg = tmp_path / "xdg"
    write(xdg, {"git/ignore": "*\n", "git/attributes": "* text eol=crlf\n"})
    global_config = tmp_path / "gitconfig"
    global_config.write_text(f"[core]\n\texcludesFile = {xdg / 'git/ignore'}\n")
    monkeypatch.setenv("XDG_CONFIG_HOME", str(xdg))
    monkeypatch.setenv("GIT_CONFIG_GLOBAL", str(global_config))
    rep = apply(project, up, wd, ref="evil")
    monkeypatch.undo()
    assert rep.ok and {f.path: f.status for f in rep.overlay} == {"pkg/mod.py": "replaced",
                                                                  "pkg/new.py": "added"}
    for path in ("pkg/mod.py", "pkg/new.py"):  # the blob git itself computes from our bytes
        ours = subprocess.run(["git", "hash-object", "--no-filters", str(project.overlay_dir / path)],
                              capture_output=True, text=True, check=True).stdout.strip()
        assert g(wd, "rev-parse", f"HEAD:{path}").strip() == ours


def test_committed_blob_check_names_a_difference(upstream, tmp_path):
    tree = tmp_path / "tree"
    g(upstream, "clone", "-q", "--branch", "v1.0.0", str(upstream), str(tree))
    repo = git.open_repo(tree)
    mod = (tree / "pkg/mod.py").read_bytes()
    assert manifest.committed_mismatches(repo, "HEAD", {"pkg/mod.py": (mod, False)}) == []
    problems = manifest.committed_mismatches(repo, "HEAD", {"pkg/mod.py": (mod + b"#\n", False),
                                                            "pkg/x.py": (b"", False),
                                                            "pkg/user.py": ((tree / "pkg/user.py")
                                                                            .read_bytes(), True)})
    assert [p.split(":")[0] for p in problems] == ["pkg/mod.py", "pkg/user.py", "pkg/x.py"]
    assert "committed nothing" in problems[2] and "committed 100644" in problems[1]


@pytest.mark.parametrize("fmt", ["sha1", "sha256"])
def test_blob_id_only_computes_and_write_blob_writes(tmp_path, fmt):
    """The two names say the difference: ``blob_id`` leaves the object store as it was."""
    g(tmp_path, "init", "-q", f"--object-format={fmt}", "repo")
    repo, data = git.open_repo(tmp_path / "repo"), b"line\r\n\x00binary\n"
    (tmp_path / "data").write_bytes(data)
    want = g(tmp_path / "repo", "hash-object", "--no-filters", str(tmp_path / "data")).strip()

    def stored() -> bool:
        return subprocess.run(["git", "cat-file", "-e", want], cwd=tmp_path / "repo",
                              stderr=subprocess.DEVNULL).returncode == 0

    assert git.blob_id(data, width=len(want)) == want and not stored()
    assert git.write_blob(repo, data) == want and stored()


def test_an_overlay_commit_that_lost_a_file_is_refused_naming_it(upstream, tmp_path, monkeypatch):
    """Were staging ever to miss a laid file (the check exists for faults not yet seen),
    the overlay commit is refused in one line naming the commit and the file."""
    tree = tmp_path / "tree"
    g(upstream, "clone", "-q", "--branch", "v1.0.0", str(upstream), str(tree))
    repo = git.open_repo(tree)
    laid = {"pkg/new.py": (b"NEW = 1\n", False), "pkg/z.py": (b"Z = 1\n", True)}
    real = git.stage_exact
    monkeypatch.setattr(git, "stage_exact",
                        lambda repo, files: real(repo, {"pkg/new.py": files["pkg/new.py"]}))
    with pytest.raises(errors.UsageError) as err:
        manifest.commit_laid(repo, laid, "overlay", env=git.environ(**IDENT))
    sha = g(tree, "rev-parse", "HEAD").strip()
    assert g(tree, "show", "-s", "--format=%s").strip() == "overlay"
    blob = subprocess.run(["git", "hash-object", "--stdin"], input=b"Z = 1\n", capture_output=True,
                          check=True).stdout.decode().strip()
    assert str(err.value) == (f"the overlay commit {sha[:12]} does not hold what was laid: "
                              f"pkg/z.py: committed nothing, laid 100755 {blob[:12]}")


def test_a_blob_git_cannot_store_is_an_error_with_gits_reason(tmp_path):
    g(tmp_path, "init", "-q", "repo")
    repo = tmp_path / "repo"
    sha = subprocess.run(["git", "hash-object", "--stdin"], input=b"x", capture_output=True,
                         check=True).stdout.decode().strip()
    (repo / ".git" / "objects" / sha[:2]).write_text("")  # a file where its folder must go
    said = subprocess.run(["git", "hash-object", "-w", "--stdin"], input="x", cwd=repo,
                          capture_output=True, text=True).stderr.splitlines()
    with pytest.raises(git.GitError) as err:
        git.write_blob(git.open_repo(repo), b"x")
    assert str(err.value) == f"git hash-object failed: {said[0]}" and said[0].startswith("error:")


# -- 4. the user's git config and GIT_* variables change nothing ------------------------------

HOSTILE_CONFIG = """\
[color]
\tui = always
\tdiff = always
\tstatus = always
[diff]
\tnoprefix = true
\tmnemonicPrefix = true
\talgorithm = histogram
\tcontext = 9
\texternal = /bin/false
[core]
\tquotePath = true
\tautocrlf = true
\thooksPath = {hooks}
\tcommentChar = %
\tfsmonitor = /bin/false
[apply]
\twhitespace = error
[am]
\tmessageId = true
\tthreeWay = true
[mailinfo]
\tscissors = true
[commit]
\tcleanup = verbatim
\tgpgSign = true
[gpg]
\tprogram = /bin/false
[i18n]
\tcommitEncoding = ISO-8859-1
[rerere]
\tenabled = true
\tautoUpdate = true
[merge]
\tconflictStyle = zdiff3
[format]
\tsignOff = true
\tsuffix = .diff
\theaders = "X-Evil: 1"
\tcoverLetter = true
\tsubjectPrefix = EVIL
\tthread = deep
\tto = evil@example.invalid
\tnotes = true
\tattach
[log]
\tshowSignature = true
\tdecorate = full
[gc]
\tauto = 1
[user]
\tuseConfigOnly = true
\tname = Alice Example
\temail = alice@example.invalid
[submodule]
\trecurse = true
[status]
\tshowUntrackedFiles = no
"""
HOSTILE_ENV = {"GIT_DIR": "/nonexistent", "GIT_WORK_TREE": "/nonexistent", "GIT_INDEX_FILE": "/x",
               "GIT_CONFIG_PARAMETERS": "'color.ui'='always'", "GIT_CONFIG_COUNT": "1",
               "GIT_CONFIG_KEY_0": "diff.noprefix", "GIT_CONFIG_VALUE_0": "true",
               "GIT_EXTERNAL_DIFF": "/bin/false", "GIT_DIFF_OPTS": "--unified=9",
               "GIT_LITERAL_PATHSPECS": "1", "GIT_ICASE_PATHSPECS": "1",
               "GIT_AUTHOR_DATE": "2001-01-01T00:00:00", "GIT_COMMITTER_DATE": "2001-01-01T00:00:00",
               "GIT_AUTHOR_NAME": "Mallory", "GIT_AUTHOR_EMAIL": "mallory@example.invalid"}


def _hostile_git(tmp_path: Path, monkeypatch, wd: Path | None = None) -> None:
    hooks = tmp_path / "hooks"
    hooks.mkdir(exist_ok=True)
    for hook in ("applypatch-msg", "pre-applypatch", "post-applypatch", "pre-commit", "commit-msg",
                 "post-checkout", "reference-transaction", "post-commit"):
        (hooks / hook).write_text(f"#!/bin/sh\necho {hook} >> {tmp_path / 'hooks-ran'}\nexit 1\n")
        (hooks / hook).chmod(0o755)
    config = HOSTILE_CONFIG.format(hooks=hooks)
    (tmp_path / "gitconfig").write_text(config)
    if wd is not None:  # the checkout's own config: cannot be shut out, only overridden
        with open(wd / ".git/config", "a") as f:
            f.write(config.replace("\tname = Alice Example\n", "")
                    .replace("\temail = alice@example.invalid\n", ""))
    monkeypatch.setenv("GIT_CONFIG_GLOBAL", str(tmp_path / "gitconfig"))
    for key in ("GIT_COMMITTER_NAME", "GIT_COMMITTER_EMAIL"):  # the identity is the config's
        monkeypatch.delenv(key, raising=False)
    for key, value in HOSTILE_ENV.items():
        monkeypatch.setenv(key, value)


def _outcome(rep):
    return ([(p.name, p.status, p.files, p.hunks) for p in rep.patches],
            [(f.path, f.status, f.detail, f.upstream_diff) for f in rep.overlay], rep.exit_code)


def test_users_git_config_and_environment_change_no_verdict_and_no_sha(project, upstream, tmp_path,
                                                                       monkeypatch):
    clean, hostile_wd = tmp_path / "clean", tmp_path / "wd"
    expected = {ref: _outcome(apply(project, upstream, clean, ref=ref, check=True))
                for ref in ("v1.1.0", "v1.2.0", "v1.3.0")}
    assert apply(project, upstream, clean).ok
    g(upstream, "clone", "-q", str(upstream), str(hostile_wd))
    with monkeypatch.context() as m:
        _hostile_git(tmp_path, m, hostile_wd)
        got = {ref: _outcome(apply(project, upstream, hostile_wd, ref=ref, check=True))
               for ref in expected}
        rep = apply(project, upstream, hostile_wd)
    assert got == expected and expected["v1.2.0"][0][0][1] == "landed-upstream"
    assert expected["v1.3.0"][0][0][3][0] == "pkg/model.txt:4-8"
    assert rep.ok and g(hostile_wd, "rev-parse", "HEAD") == g(clean, "rev-parse", "HEAD")
    assert not (tmp_path / "hooks-ran").exists()
    # the user's identity stays theirs where the tool acts for them (the checkout's reflog)
    assert g(hostile_wd, "log", "-g", "-1", "--format=%gn", "HEAD").strip() == "Alice Example"
    assert g(hostile_wd, "log", "-1", "--format=%an|%cn").strip() == "vllm-k3-overlay|vllm-k3-overlay"


def test_export_writes_the_same_patches_under_hostile_config(project, upstream, tmp_path, monkeypatch):
    from k3overlay.export import export
    from k3overlay.project import Project

    twin = Project(tmp_path / "twin")
    subprocess.run(["cp", "-a", str(project.root), str(twin.root)], check=True)
    for proj, wd in ((project, tmp_path / "a"), (twin, tmp_path / "b")):
        assert apply(proj, upstream, wd).ok
        (wd / "pkg/model.txt").write_text((wd / "pkg/model.txt").read_text() + "line 13\n")
        g(wd, "commit", "-qam", "model: line 13\n\nWhy: a test.\n\nUpstream-Status: Pending")
    export(project, tmp_path / "a")
    with monkeypatch.context() as m:
        _hostile_git(tmp_path, m, tmp_path / "b")
        export(twin, tmp_path / "b")
    for name in sorted(os.listdir(project.patches_dir)):
        assert (twin.patches_dir / name).read_bytes() == (project.patches_dir / name).read_bytes()
    assert sorted(os.listdir(twin.patches_dir)) == sorted(os.listdir(project.patches_dir))
    assert twin.manifest_path.read_text() == project.manifest_path.read_text()


def test_repository_reached_through_the_users_url_rewrite(project, upstream, tmp_path, monkeypatch):
    config = tmp_path / "gitconfig"
    config.write_text(f'[url "{upstream}"]\n\tinsteadOf = k3test:\n')
    monkeypatch.setenv("GIT_CONFIG_GLOBAL", str(config))
    rep = run_apply(project, Options(vllm_repo="k3test:", workdir=tmp_path / "wd"))
    assert rep.ok and rep.ref_sha == g(upstream, "rev-parse", "v1.0.0").strip()


# -- 7. reports: whole or not at all ----------------------------------------------------------

def _disk_full_after(monkeypatch, nbytes: int) -> None:
    """Make writes to the tool's temporary files stop with ENOSPC after ``nbytes`` bytes each."""
    real = os.write
    written_to: dict[int, int] = {}

    def write(fd, data):
        if not os.readlink(f"/proc/self/fd/{fd}").endswith(".k3-tmp"):
            return real(fd, data)  # a pipe to git, the terminal, …: unaffected
        budget = nbytes - written_to.get(fd, 0)
        if budget <= 0:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        written = real(fd, bytes(data[:budget]))
        written_to[fd] = written_to.get(fd, 0) + written
        return written

    monkeypatch.setattr(os, "write", write)


def test_full_disk_keeps_the_previous_report(project, upstream, tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(cli, "Project", lambda: project)
    out = tmp_path / "reports" / "r.json"
    base = ["-q", "--vllm-repo", str(upstream), "--workdir", str(tmp_path / "wd"), "--json", str(out)]
    assert cli.main(base) == 0
    good = out.read_text()
    out.chmod(0o640)
    with monkeypatch.context() as m:
        _disk_full_after(m, 10)
        assert cli.main([*base, "--vllm-ref", "v1.2.0"]) == errors.DRIFT  # the job's own code
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [f"apply.py: error: cannot write {out}: No space left on device"]
    assert out.read_text() == good and json.loads(good)["ok"] is True
    assert os.listdir(out.parent) == ["r.json"] and stat.S_IMODE(out.stat().st_mode) == 0o640
    assert cli.main([*base, "--vllm-ref", "v1.2.0"]) == errors.DRIFT  # room again: replaced
    assert json.loads(out.read_text())["ok"] is False and stat.S_IMODE(out.stat().st_mode) == 0o640


def test_full_disk_keeps_the_previous_markdown_and_manifest(project, tmp_path, monkeypatch):
    md = tmp_path / "r.md"
    md.write_text("old\n")
    before = project.manifest_path.read_bytes()
    loaded = manifest.load(project.manifest_path, project.overlay_dir)
    with monkeypatch.context() as m:
        _disk_full_after(m, 3)
        with pytest.raises(errors.UsageError, match="No space left"):
            report.write_text(md, "# new report\n" * 100)
        with pytest.raises(errors.UsageError, match="No space left"):
            manifest.save(manifest.Manifest("v9.9.9", loaded.files), project.manifest_path)
    assert md.read_text() == "old\n" and project.manifest_path.read_bytes() == before
    assert sorted(os.listdir(tmp_path)) == sorted(["r.md", "project", "cache"] if (tmp_path / "cache")
                                                  .exists() else ["r.md", "project"])


# -- 8. a detached HEAD only the reflog would remember ---------------------------------------

def test_detached_head_no_ref_holds_is_refused_with_its_sha(project, upstream, tmp_path):
    wd = tmp_path / "wd"
    assert apply(project, upstream, wd).ok
    g(wd, "checkout", "-q", "--detach")
    write(wd, {"mine.txt": "my work\n"})
    g(wd, "add", "mine.txt")
    g(wd, "commit", "-qm", "my work on a detached HEAD")
    mine = g(wd, "rev-parse", "HEAD").strip()
    before = snapshot(wd)
    for run in (lambda: apply(project, upstream, wd, ref="v1.1.0"),
                lambda: rebase_to(project, Options(ref="v1.1.0", vllm_repo=str(upstream), workdir=wd))):
        with pytest.raises(errors.UsageError, match=f"HEAD is detached at {mine}"):
            run()
    assert snapshot(wd) == before
    assert apply(project, upstream, wd, ref="v1.1.0", check=True).ok  # --check moves nothing
    g(wd, "checkout", "-q", "--detach", "v1.0.0")  # detached where a tag holds it: fine
    assert apply(project, upstream, wd, ref="v1.1.0").ok


# -- 9. refs that name a tree or a blob -------------------------------------------------------

@pytest.fixture
def odd_refs(upstream, tmp_path):
    up = tmp_path / "odd"
    g(upstream, "clone", "-q", str(upstream), str(up))
    g(up, "tag", "treetag", "v1.0.0^{tree}")
    g(up, "tag", "blobtag", "v1.0.0:pkg/mod.py")
    g(up, "tag", "-a", "-m", "annotated", "annotree", "v1.0.0^{tree}")
    refs = {"treetag": "tree", "blobtag": "blob", "annotree": "tree",
            g(up, "rev-parse", "v1.0.0^{tree}").strip(): "tree",
            g(up, "rev-parse", "v1.0.0:pkg/user.py").strip(): "blob"}
    return up, refs


def test_ref_naming_a_tree_or_blob_is_exit_2_in_one_line(project, odd_refs, tmp_path, monkeypatch,
                                                         capsys):
    up, refs = odd_refs
    monkeypatch.setattr(cli, "Project", lambda: project)
    wd = tmp_path / "wd"
    g(up, "clone", "-q", str(up), str(wd))  # a checkout that has every object
    before = snapshot(wd)
    for ref, kind in refs.items():
        for where in (wd, tmp_path / "fresh"):
            for mode in ([], ["--check"]):
                code = cli.main(["-q", "--vllm-repo", str(up), "--workdir", str(where),
                                 "--vllm-ref", ref, *mode])
                err = capsys.readouterr().err.strip().splitlines()
                assert code == errors.USAGE and len(err) == 1, (ref, where, mode, err)
                assert f"names a {kind}" in err[0] or f"names a tag of a {kind}" in err[0], err
    assert snapshot(wd) == before and not (tmp_path / "fresh").exists()


def test_rebase_job_onto_a_tree_is_exit_2_and_no_traceback(project, odd_refs, tmp_path):
    up, _ = odd_refs
    proc = subprocess.run(
        [sys.executable, "-c", "import sys; from ci import rebase;"
         "from k3overlay.project import Project; rebase.Project = lambda: Project(__import__('pathlib')"
         ".Path(sys.argv[1])); sys.exit(rebase.main(sys.argv[2:]))", str(project.root),
         "--onto", "treetag", "--onto", "v1.1.0", "--no-tests", "-q", "--vllm-repo", str(up),
         "--json", str(tmp_path / "out.json")], cwd=ROOT,  # the job runs as a module of this repository
        capture_output=True, text=True, env={**os.environ, "XDG_CACHE_HOME": str(tmp_path / "cache")})
    assert proc.returncode == errors.USAGE and "Traceback" not in proc.stderr, proc.stderr
    data = json.loads((tmp_path / "out.json").read_text())
    assert data[0]["error"] == "ref 'treetag' names a tree, not a commit: give a tag, branch or commit sha"
    assert data[1]["ok"] is True  # the other ref still got its report


def test_paths_that_look_like_markup_are_printed_as_they_are(project, upstream, tmp_path,
                                                              monkeypatch, capsys):
    monkeypatch.setattr(cli, "Project", lambda: project)
    wd = tmp_path / "w[/x]d[bold]"
    assert cli.main(["--vllm-repo", str(upstream), "--workdir", str(wd)]) == 0
    out = capsys.readouterr()
    assert f"cloning {upstream} into {wd}" in out.err and str(wd) in out.out


def test_a_ref_naming_a_tree_found_only_by_fetching_is_named(project, upstream, tmp_path):
    up, wd = tmp_path / "up", tmp_path / "wd"
    g(upstream, "clone", "-q", str(upstream), str(up))
    g(up, "clone", "-q", str(up), str(wd))
    g(up, "tag", "late", "v1.0.0^{tree}")  # made after the checkout was cloned: fetched fresh
    with pytest.raises(errors.UsageError) as err:
        run_apply(project, Options(vllm_repo=str(up), workdir=wd, ref="late"))
    assert str(err.value) == "ref 'late' names a tree, not a commit: give a tag, branch or commit sha"


def test_an_overlay_file_upstream_removed_is_drift(project, upstream, tmp_path):
    up = hostile(upstream, tmp_path, lambda t: (t / "pkg/mod.py").unlink(), tag="v9.0.0")
    report = run_apply(project, Options(vllm_repo=str(up), workdir=tmp_path / "wd", ref="v9.0.0"))
    assert report.exit_code == errors.DRIFT
    [mod] = [f for f in report.to_json()["overlay"] if f["path"] == "pkg/mod.py"]
    assert (mod["status"], mod["detail"]) == ("drift", "upstream removed this file")
    assert mod["upstream_diff"] == g(up, "diff", "v1.0.0", "v9.0.0", "--", "pkg/mod.py")  # git's own


def test_a_series_naming_anything_but_a_patch_file_beside_it_is_refused(project):
    for name in ("../x.patch", "series", "a\x1bb.patch"):  # a path, itself, a terminal escape
        (project.patches_dir / "series").write_text(f"0001-model-line-4.patch\n{name}\n")
        with pytest.raises(errors.UsageError) as err:
            series_mod.load(project.patches_dir)
        assert str(err.value) == f"series names {name!r}: only patch file names in patches/ may be listed"


def test_the_manifest_and_overlay_folder_must_list_the_same_files(project):
    manifest_file = json.loads(project.manifest_path.read_text())
    manifest_file["files"] += [{"path": f"pkg/{name}.py", "base_blob": "new"} for name in "ab"]
    project.manifest_path.write_text(json.dumps(manifest_file))
    with pytest.raises(errors.UsageError) as err:
        manifest.load(project.manifest_path, project.overlay_dir)
    assert str(err.value) == "overlay manifest lists files missing under overlay/: pkg/a.py, pkg/b.py"
    write(project.overlay_dir, {"pkg/a.py": "", "pkg/b.py": "", "pkg/c.py": "", "d.py": ""})
    with pytest.raises(errors.UsageError) as err:
        manifest.load(project.manifest_path, project.overlay_dir)
    assert str(err.value) == "files under overlay/ missing from the manifest: d.py, pkg/c.py"


def test_an_overlay_folder_that_is_a_link_is_refused(project, tmp_path):
    real = tmp_path / "elsewhere"
    (project.overlay_dir / "pkg").rename(real)
    (project.overlay_dir / "pkg").symlink_to(real)
    with pytest.raises(errors.UsageError) as err:
        manifest.load(project.manifest_path, project.overlay_dir)
    assert str(err.value) == ("overlay/pkg is a symbolic link: overlay files and their folders must be "
                              "real ones")


def test_a_path_that_is_not_utf8_comes_back_from_git_as_the_bytes_it_is(tmp_path):
    g(tmp_path, "init", "-q", "repo")
    repo_dir = tmp_path / "repo"
    g(repo_dir, "commit", "-q", "--allow-empty", "-m", "empty")
    name = os.fsdecode(b"caf\xe9.py")  # Latin-1 bytes: not UTF-8
    (repo_dir / name).write_text("X = 1\n")
    g(repo_dir, "add", "-A")
    g(repo_dir, "commit", "-q", "-m", "a file")
    repo = git.open_repo(repo_dir)
    assert git.changed_paths(repo, "HEAD~1", "HEAD") == [name]
    assert os.fsencode(name) == b"caf\xe9.py"


# -- Found by the second adversarial pass: ``apply.py --export`` wrote the project's data one
# file at a time, opening patches/ and overlay/ and writing overlay.json through links. So
# patches/ or overlay.json being a link sent the export's writes outside the repository, and
# a link at patches/series (or a full disk part-way) left half an export: a new patch file
# written, the series not, and every later run refused ("patches not in series").


def work_branch_with_a_new_patch(project, upstream, wd):
    assert run_apply(project, Options(vllm_repo=str(upstream), workdir=wd)).ok
    (wd / "pkg/model.txt").write_text((wd / "pkg/model.txt").read_text() + "line 13\n")
    g(wd, "commit", "-qam", "model: line 13\n\nUpstream-Status: Pending")


def state(root):
    """Every entry under ``root``, links not followed: (kind, bytes or link target)."""
    out = {}
    for dirpath, dirnames, filenames in os.walk(root):
        for name in dirnames + filenames:
            path = os.path.join(dirpath, name)
            rel = os.path.relpath(path, root)
            if os.path.islink(path):
                out[rel] = ("link", os.readlink(path))
            elif os.path.isdir(path):
                out[rel] = ("dir", None)
            else:
                out[rel] = ("file", open(path, "rb").read())
    return out


@pytest.mark.parametrize("what, message", [
    ("patches", "refusing to write patches/0001-model-line-4.patch: patches is a symbolic link, "
                "not a folder"),
    ("overlay", "refusing to write overlay/pkg/mod.py: overlay is a symbolic link, not a folder"),
    ("overlay.json", "cannot read overlay manifest {root}/overlay.json: overlay.json is missing or "
                     "not a regular file"),  # refused as it is read, like a link under overlay/
    ("patches/series", "refusing to write patches/series: it is a symbolic link in the tree, not a file"),
    ("patches/0001-model-line-4.patch",
     "refusing to write patches/0001-model-line-4.patch: it is a symbolic link in the tree, not a file"),
])
def test_export_writes_nothing_through_a_link_in_the_projects_data(project, upstream, tmp_path,
                                                                   what, message):
    wd = tmp_path / "wd"
    work_branch_with_a_new_patch(project, upstream, wd)
    outside = tmp_path / "outside"
    outside.mkdir()
    shutil.move(project.root / what, outside / "real")
    (project.root / what).symlink_to(outside / "real")
    before, before_outside = state(project.root), state(outside)
    with pytest.raises(errors.UsageError) as err:
        export(project, wd)
    assert str(err.value) == message.format(root=project.root)
    assert state(outside) == before_outside and state(project.root) == before


def test_a_full_disk_part_way_leaves_no_half_export(project, upstream, tmp_path, monkeypatch):
    wd = tmp_path / "wd"
    work_branch_with_a_new_patch(project, upstream, wd)
    before = state(project.root)
    calls, write_all = [], files._write_all

    def fills_up(fd, data):  # the third file written (after two patch files) finds the disk full
        calls.append(fd)
        if len(calls) == 3:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        write_all(fd, data)

    monkeypatch.setattr(files, "_write_all", fills_up)
    with pytest.raises(errors.UsageError) as err:
        export(project, wd)
    assert str(err.value) == "cannot write patches/series: No space left on device"
    assert state(project.root) == before  # no patch file, no temporary file
    monkeypatch.undo()
    export(project, wd)  # the same export, room on the disk again
    assert (project.patches_dir / "series").read_text().splitlines() == [
        "0001-model-line-4.patch", "0002-model-line-13.patch"]


def test_write_all_in_tree_renames_nothing_until_every_file_is_on_disk(tmp_path, monkeypatch):
    (tmp_path / "a.py").write_text("old a\n")
    (tmp_path / "pkg").mkdir()
    (tmp_path / "pkg/b.py").write_text("old b\n")
    before = state(tmp_path)

    def full(fd, data):
        if data == b"new b\n":
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        os.write(fd, data)

    monkeypatch.setattr(files, "_write_all", full)
    with pytest.raises(errors.UsageError) as err:
        files.write_all_in_tree(tmp_path, {"a.py": (b"new a\n", False), "pkg/b.py": (b"new b\n", False),
                                           "pkg/c/d.py": (b"new d\n", True)})
    assert str(err.value) == "cannot write pkg/b.py: No space left on device"
    assert state(tmp_path) == before
    monkeypatch.undo()
    files.write_all_in_tree(tmp_path, {"a.py": (b"new a\n", False), "pkg/b.py": (b"new b\n", False),
                                       "pkg/c/d.py": (b"new d\n", True)})
    assert [(tmp_path / p).read_bytes() for p in ("a.py", "pkg/b.py", "pkg/c/d.py")] == [
        b"new a\n", b"new b\n", b"new d\n"]
    assert os.access(tmp_path / "pkg/c/d.py", os.X_OK) and not os.access(tmp_path / "a.py", os.X_OK)
    assert sorted(os.listdir(tmp_path)) == ["a.py", "pkg"] and sorted(os.listdir(tmp_path / "pkg")) == [
        "b.py", "c"]


def test_ctrl_c_between_the_renames_waits_for_the_last(tmp_path, monkeypatch):
    """All or none holds under Ctrl-C too: an interrupt after the first file is renamed into
    place is acted on once every file is."""
    import signal

    rename = os.rename

    def renamed_then_ctrl_c(*args, **kwargs):
        rename(*args, **kwargs)
        os.kill(os.getpid(), signal.SIGINT)

    monkeypatch.setattr(os, "rename", renamed_then_ctrl_c)
    with pytest.raises(KeyboardInterrupt):
        files.write_all_in_tree(tmp_path, {"a.py": (b"a\n", False), "pkg/b.py": (b"b\n", False)})
    monkeypatch.undo()
    assert (tmp_path / "a.py").read_bytes() == b"a\n" and (tmp_path / "pkg/b.py").read_bytes() == b"b\n"
    assert sorted(os.listdir(tmp_path)) == ["a.py", "pkg"] and os.listdir(tmp_path / "pkg") == ["b.py"]


def test_a_work_branch_whose_base_ref_is_gone_is_named(project, upstream, tmp_path):
    """The base tag deleted from the checkout: the error named ``None..HEAD``."""
    wd = tmp_path / "wd"
    work_branch_with_a_new_patch(project, upstream, wd)
    g(wd, "tag", "-d", "v1.0.0")
    before = state(project.root)
    with pytest.raises(errors.UsageError) as err:
        export(project, wd)
    assert str(err.value) == (f"the work branch's base 'v1.0.0' is not in {wd} (a deleted tag or "
                              f"branch?): fetch it, then export again")
    assert state(project.root) == before
