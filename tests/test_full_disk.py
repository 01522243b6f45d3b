"""A full disk (or a read-only one) while publishing leaves the checkout exactly as it was:
branches, HEAD, index, files, config record, no untracked leftovers (issue 18, H).

On a real small file system: a size-limited tmpfs, mounted here (we run as root; skipped
with the reason where mounting is not permitted); and with injected failures where that is
cheaper (a switch that fails after git wrote the files, a record that cannot be written).
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
from packaging.version import Version

from k3overlay import cli, errors, git, publish, source
from k3overlay.job import Options, run_apply
from k3overlay.lock import workdir_lock_path
from k3overlay.project import ROOT, cache_dir

from .conftest import g

V = Version("0.1.0")
NEW_FILES = 30
FILE_BYTES = 40_000  # each; incompressible: checking them out needs 1.2 MB


@contextlib.contextmanager
def small_fs(where: Path, size: str):
    """A tmpfs of ``size`` mounted at ``where`` for the block; skips the test if it cannot be."""
    where.mkdir(parents=True, exist_ok=True)
    proc = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(where)],
                          capture_output=True, text=True)
    if proc.returncode != 0:
        pytest.skip(f"cannot mount a small tmpfs here: {proc.stderr.strip() or proc.returncode}")
    try:
        yield where
    finally:
        subprocess.run(["umount", "-l", str(where)], check=False)


def fill(fs: Path, leave: int) -> Path:
    """Fill ``fs`` until about ``leave`` bytes are free; the filler file."""
    filler = fs / "filler"
    free = os.statvfs(fs).f_bavail * os.statvfs(fs).f_frsize
    with open(filler, "wb") as f:
        f.write(b"\0" * max(free - leave, 0))
    return filler


@pytest.fixture(scope="module")
def big_upstream(tmp_path_factory, upstream) -> Path:
    """The synthetic upstream plus tag v1.4.0: v1.0.0 with 30 new incompressible files."""
    repo = tmp_path_factory.mktemp("big") / "up"
    g(upstream.parent, "clone", "-q", str(upstream), str(repo))
    g(repo, "checkout", "-q", "-b", "big", "v1.0.0")
    for i in range(NEW_FILES):
        data = b"".join(hashlib.sha256(f"{i}.{n}".encode()).digest() for n in range(FILE_BYTES // 32))
        (repo / "pkg" / "data").mkdir(parents=True, exist_ok=True)
        (repo / "pkg" / "data" / f"f{i:02}.bin").write_bytes(data)
    g(repo, "add", "-A")
    g(repo, "commit", "-q", "-m", "30 new files")
    g(repo, "tag", "v1.4.0")
    return repo


def everything(wd: Path) -> dict:
    """All a user could lose: every file (bytes) outside .git, refs, HEAD, index, status, config."""
    files = {}
    for path in sorted(wd.rglob("*")):
        rel = path.relative_to(wd)
        if rel.parts[0] == ".git":
            continue
        files[str(rel)] = path.read_bytes() if path.is_file() and not path.is_symlink() else "dir"
    return {"files": files, "refs": g(wd, "for-each-ref", "--format=%(refname) %(objectname)"),
            "head": g(wd, "symbolic-ref", "-q", "HEAD"), "index": g(wd, "ls-files", "-s"),
            "status": g(wd, "status", "--porcelain", "--untracked-files=all", "--ignored"),
            "config": (wd / ".git" / "config").read_text()}


def test_publishing_onto_a_full_disk_leaves_the_checkout_as_it_was(project, big_upstream, tmp_path,
                                                                   monkeypatch, capsys):
    with small_fs(tmp_path / "small", "3m") as fs:
        wd = fs / "wd"
        assert run_apply(project, Options(vllm_repo=str(big_upstream), workdir=wd)).ok
        g(wd, "fetch", "-q", "origin", "tag", "v1.4.0")  # (already there: a clone has the tags)
        before = everything(wd)
        filler = fill(fs, 400_000)
        monkeypatch.setattr(cli, "Project", lambda: project)
        args = ["-q", "--vllm-repo", str(big_upstream), "--workdir", str(wd), "--vllm-ref", "v1.4.0"]
        capsys.readouterr()
        assert cli.main(args) == errors.USAGE
        err = capsys.readouterr().err.splitlines()
        assert len(err) == 1 and err[0].startswith("apply.py: error: git checkout failed: "), err
        assert err[0].endswith(f"KiB free); {wd} was left as it was")
        assert everything(wd) == before
        assert not workdir_lock_path(wd).with_suffix(".journal").exists()
        filler.unlink()  # space freed: the same run goes through, nothing in its way
        assert cli.main(args) == errors.OK
        assert len(list((wd / "pkg" / "data").iterdir())) == NEW_FILES


def test_a_read_only_checkout_is_one_line_and_left_as_it_was(project, upstream, tmp_path, monkeypatch,
                                                            capsys):
    with small_fs(tmp_path / "small", "8m") as fs:
        wd = fs / "wd"
        assert run_apply(project, Options(vllm_repo=str(upstream), workdir=wd)).ok
        before = everything(wd)
        subprocess.run(["mount", "-o", "remount,ro", str(fs)], check=True)
        capsys.readouterr()
        monkeypatch.setattr(cli, "Project", lambda: project)
        code = cli.main(["-q", "--vllm-repo", str(upstream), "--workdir", str(wd),
                         "--vllm-ref", "v1.1.0"])
        err = capsys.readouterr().err.splitlines()
        assert code == errors.USAGE and len(err) == 1 and "Read-only file system" in err[0], err
        assert everything(wd) == before
        assert not workdir_lock_path(wd).with_suffix(".journal").exists()


def test_a_full_cache_disk_refuses_before_the_journal_can_be_torn(project, upstream, tmp_path,
                                                                 monkeypatch, capsys):
    """Disk full during the journal write itself: the step is not taken, nothing changes."""
    wd = tmp_path / "wd"
    assert run_apply(project, Options(vllm_repo=str(upstream), workdir=wd)).ok
    before = everything(wd)
    with small_fs(tmp_path / "cache", "64k") as cache:
        monkeypatch.setenv("XDG_CACHE_HOME", str(cache))
        (cache / "vllm-k3-overlay" / "locks").mkdir(parents=True)
        fill(cache, 0)
        monkeypatch.setattr(cli, "Project", lambda: project)
        capsys.readouterr()
        code = cli.main(["-q", "--vllm-repo", str(upstream), "--workdir", str(wd),
                         "--vllm-ref", "v1.1.0"])
        err = capsys.readouterr().err.splitlines()
        assert code == errors.USAGE and len(err) == 1, err
        assert "cannot record the next step in " in err[0] and "No space left on device" in err[0]
        assert err[0].endswith("nothing was changed")
    assert everything(wd) == before


@pytest.mark.parametrize("fails", ["switch after the files were written", "the branch record"])
def test_an_injected_failure_while_publishing_is_undone(project, upstream, tmp_path, monkeypatch,
                                                        fails):
    wd = tmp_path / "wd"
    assert run_apply(project, Options(vllm_repo=str(upstream), workdir=wd)).ok
    g(wd, "checkout", "-q", "-b", "mine", "v1.0.0")  # the user is on their own branch
    before = everything(wd)
    real_set, real_config = git.set_branch, git.config_set

    def set_branch(repo, name, sha):
        real_set(repo, name, sha)
        if fails.startswith("switch"):
            raise git.GitError("git checkout failed: error: unable to write file: No space left on device")

    def config_set(repo, key, value):
        if fails == "the branch record" and key.endswith("k3overlaybase"):
            raise git.GitError("git config failed: error: could not write config file: No space left")
        real_config(repo, key, value)

    monkeypatch.setattr(git, "set_branch", set_branch)
    monkeypatch.setattr(git, "config_set", config_set)
    with pytest.raises(git.GitError, match="No space left"):
        run_apply(project, Options(vllm_repo=str(upstream), workdir=wd, ref="v1.1.0"))
    monkeypatch.setattr(git, "config_set", real_config)
    assert everything(wd) == before


def test_a_switch_that_cannot_be_undone_is_finished_by_the_next_run(project, upstream, tmp_path,
                                                                    monkeypatch, capsys):
    wd = tmp_path / "wd"
    assert run_apply(project, Options(vllm_repo=str(upstream), workdir=wd)).ok
    real_set = git.set_branch

    def set_branch(repo, name, sha):
        real_set(repo, name, sha)
        raise git.GitError("git checkout failed: No space left on device")

    def undo(*_args, **_kwargs):
        raise OSError(28, "No space left on device")

    real_undo = publish._undo
    monkeypatch.setattr(git, "set_branch", set_branch)
    monkeypatch.setattr(publish, "_undo", undo)
    with pytest.raises(errors.UsageError, match="putting .* back failed too .*run apply.py again"):
        run_apply(project, Options(vllm_repo=str(upstream), workdir=wd, ref="v1.1.0"))
    assert workdir_lock_path(wd).with_suffix(".journal").exists()
    monkeypatch.setattr(git, "set_branch", real_set)
    monkeypatch.setattr(publish, "_undo", real_undo)
    capsys.readouterr()
    report = run_apply(project, Options(vllm_repo=str(upstream), workdir=wd, ref="v1.1.0"))
    assert report.ok and g(wd, "status", "--porcelain") == ""
    said = capsys.readouterr().err.splitlines()
    assert [line for line in said if "note:" in line] == [
        f"… note: the last run was killed; it was switching {wd} to k3-overlay/9.9.9 "
        f"({g(wd, 'rev-parse', 'HEAD').strip()[:12]}): finished"]


# ----------------------------------------------- the user's edits while the run goes on


@pytest.mark.parametrize("how", ["appended", "emptied"])  # emptied: a prefix of the new content
@pytest.mark.parametrize("when", ["before git's checkout", "after it"])
def test_an_edit_made_while_the_run_went_on_survives_a_failed_switch(project, upstream, tmp_path,
                                                                     monkeypatch, when, how):
    """A file the switch changes, edited after the run's start-of-run check: git refuses to
    overwrite it (before), or the switch fails once git wrote everything and the user edits
    on top (after). Either way the edit stays byte for byte, the error names it, and
    everything git wrote goes back."""
    wd = tmp_path / "wd"
    assert run_apply(project, Options(vllm_repo=str(upstream), workdir=wd)).ok
    before = everything(wd)
    real_set, edited = git.set_branch, {}

    def set_branch(repo, name, sha):
        # a file the switch changes, and that is there before and after it
        victim = next(p for p in g(wd, "diff", "--name-only", "HEAD", sha).split()
                      if (wd / p).is_file() and g(wd, "cat-file", "-t", f"{sha}:{p}").strip() == "blob")
        edited[victim] = b"" if how == "emptied" else (
            (wd / victim).read_bytes() + b"\n# my edit, made while apply.py ran\n")
        if when == "after it":
            real_set(repo, name, sha)
            (wd / victim).write_bytes(edited[victim])
            raise git.GitError("git checkout failed: error: unable to write file: No space left on device")
        (wd / victim).write_bytes(edited[victim])
        real_set(repo, name, sha)  # git: your local changes would be overwritten

    monkeypatch.setattr(git, "set_branch", set_branch)
    with pytest.raises(git.GitError) as err:
        run_apply(project, Options(vllm_repo=str(upstream), workdir=wd, ref="v1.1.0"))
    [(victim, mine)] = edited.items()
    assert (wd / victim).read_bytes() == mine, "the user's edit is gone"
    assert victim in str(err.value) and "\n" not in str(err.value)
    after = everything(wd)
    assert {p: b for p, b in after["files"].items() if p != victim} == \
        {p: b for p, b in before["files"].items() if p != victim}
    assert [after[k] for k in ("refs", "head", "config")] == [before[k] for k in ("refs", "head", "config")]
    assert g(wd, "status", "--porcelain").split() == ["M", victim]


# -- The cache on a full disk (found when CI's own machine filled up, stop 40): the release
# wheel's download ended in a traceback; an sdist unpacked onto a full TMPDIR was blamed on the
# package index, deleted from the cache and fetched again, then called broken (exit 6).

def noise(nbytes: int) -> str:
    """``nbytes`` of hex text that gzip and zlib shrink only to about half."""
    return "".join(hashlib.sha256(str(n).encode()).hexdigest() for n in range(nbytes // 64))


def release_file(kind: str, nbytes: int) -> tuple[str, bytes]:
    from .test_mirror import sdist_bytes
    from .wheels import wheel_bytes

    files = {"vllm/a.py": "A = 1\n", "vllm/big.txt": noise(nbytes)}
    if kind == "sdist":
        return "vllm-0.1.0.tar.gz", sdist_bytes("0.1.0", files)
    return "vllm-0.1.0-py3-none-any.whl", wheel_bytes("0.1.0", files)


@pytest.mark.parametrize("kind", ["sdist", "wheel"])
def test_a_download_into_a_full_cache_is_one_line_and_leaves_no_part(kind, fake_index, tmp_path,
                                                                     monkeypatch):
    name, data = release_file(kind, 4_000_000)
    fake_index.publish(name, data)
    with small_fs(tmp_path / "small", "1m") as fs:
        monkeypatch.setenv("XDG_CACHE_HOME", str(fs))
        files = source.release_files()
        pkg = files.sdist(V) if kind == "sdist" else files.wheel(V)
        with pytest.raises(errors.OverlayError) as err:
            files.fetch(pkg)
        folder = fs / "vllm-k3-overlay" / f"{kind}s"
        assert str(err.value) == f"cannot download {name} into {folder}: No space left on device"
        assert err.value.exit_code == errors.USAGE
        assert sorted(p.name for p in folder.iterdir()) == [".lock"]  # no partial file left


def test_apply_into_a_full_cache_is_one_line_exit_2(fake_index, tmp_path):
    """The case CI met, end to end (there the 314 MB wheel of ``--build-wheel``)."""
    fake_index.publish("vllm-0.28.0.tar.gz", release_file("sdist", 4_000_000)[1])
    with small_fs(tmp_path / "small", "1m") as fs:
        env = {**os.environ, "XDG_CACHE_HOME": str(fs)}
        proc = subprocess.run([sys.executable, str(ROOT / "apply.py"), "--check", "-q", "--workdir",
                               str(tmp_path / "wd")], capture_output=True, text=True, env=env)
    assert proc.returncode == errors.USAGE, proc.stderr
    assert proc.stderr.splitlines() == [f"apply.py: error: cannot download vllm-0.28.0.tar.gz into "
                                        f"{fs / 'vllm-k3-overlay' / 'sdists'}: No space left on device"]


def test_an_sdist_unpacked_onto_a_full_tmpdir_is_not_blamed_on_the_index(fake_index, tmp_path,
                                                                          monkeypatch):
    name, data = release_file("sdist", 4_000_000)
    fake_index.publish(name, data)
    with small_fs(tmp_path / "small", "1m") as fs:
        monkeypatch.setattr(tempfile, "tempdir", str(fs))
        with pytest.raises(errors.OverlayError) as err:
            source.default_mirror().ensure([V])
        assert err.value.exit_code == errors.USAGE, err.value
        assert str(err.value).startswith(f"cannot unpack {name} into {fs}/k3-sdist-")
        assert str(err.value).endswith(": No space left on device")
        assert list(fs.iterdir()) == []  # the half-unpacked tree is gone
    assert fake_index.downloads[name] == 1  # the cached sdist is good: kept, not fetched again
    assert (cache_dir() / "sdists" / name).read_bytes() == data


def test_a_mirror_commit_into_a_full_cache_is_one_line(fake_index, tmp_path, monkeypatch):
    name, data = release_file("sdist", 4_000_000)
    fake_index.publish(name, data)
    with small_fs(tmp_path / "small", "3m") as fs:  # room for the sdist, not for its git objects
        monkeypatch.setenv("XDG_CACHE_HOME", str(fs))
        with pytest.raises(errors.OverlayError) as err:
            source.default_mirror().ensure([V])
        assert err.value.exit_code == errors.USAGE and "\n" not in str(err.value), err.value
        assert "No space left on device" in str(err.value), err.value
        mirror = source.default_mirror()
        assert mirror.releases() == []  # no tag for a half-written commit
