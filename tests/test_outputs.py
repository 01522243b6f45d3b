"""No path a run writes is, or is inside, a path it reads, and no two outputs are one path
(issue 25, items 6 and 19): refused in one line, exit 2, before any work; links and ``..``
are resolved first.
"""

from __future__ import annotations

import errno
import os
import subprocess
from pathlib import Path

import pytest

from k3overlay import cli, errors

from .conftest import g, snapshot
from .test_rebase import load_ci_rebase


@pytest.fixture
def sources(upstream, tmp_path) -> dict[str, Path]:
    """A source folder (a clone of upstream, with a work tree) and a source bundle, the run's inputs."""
    folder, bundle = tmp_path / "src", tmp_path / "vllm.bundle"
    g(upstream, "clone", "-q", str(upstream), str(folder))
    g(upstream, "bundle", "create", str(bundle), "--all")
    (tmp_path / "link").symlink_to(tmp_path / "wd")
    return {"folder": folder, "bundle": bundle}


def _files(tmp_path: Path) -> dict:
    """Every file under ``tmp_path`` with its bytes (the inputs are there)."""
    return {str(p): p.read_bytes() for p in sorted(tmp_path.rglob("*")) if p.is_file()}


APPLY_CASES = {
    # issue 25, 6: --json over the bundle replaced it
    "json over the bundle": (["--vllm-repo", "{bundle}", "--json", "{bundle}"], "is --vllm-repo"),
    "json as a file:// bundle": (["--vllm-repo", "file://{bundle}", "--json", "{bundle}"],
                                 "is --vllm-repo"),
    "json inside the source folder": (["--vllm-repo", "{folder}", "--json", "{folder}/r.json"],
                                      "is inside --vllm-repo"),
    # 19: a file inside the checkout is untracked there, and every later run refuses it as dirty
    "json inside the workdir": (["--json", "{tmp}/wd/r.json"], "is inside --workdir"),
    "json inside it through a link": (["--json", "{tmp}/link/r.json"], "is inside --workdir"),
    "json inside it through ..": (["--json", "{tmp}/other/../wd/sub/r.json"], "is inside --workdir"),
    "wheel folder inside the workdir": (["--build-wheel", "--wheel-dir", "{tmp}/wd/dist"],
                                        "is inside --workdir"),
    "json as the wheel folder": (["--build-wheel", "--wheel-dir", "{tmp}/out", "--json", "{tmp}/out"],
                                 "is the path --json"),
    # the tool's cache (XDG_CACHE_HOME is tmp/cache here): --json over a lock file replaced its
    # inode, so a run waiting on the old one and a new run on the new one went on at once
    "json over a lock file in the cache": (["--json", "{tmp}/cache/vllm-k3-overlay/locks/x.lock"],
                                           "inside the tool's cache"),
    "json over a cached download through a link": (["--json", "{tmp}/cachelink/sdists/v.tar.gz"],
                                                   "inside the tool's cache"),
    "wheel folder in the cache": (["--build-wheel", "--wheel-dir", "{tmp}/cache/vllm-k3-overlay/wheels"],
                                  "inside the tool's cache"),
    "workdir in the cache": (["--workdir", "{tmp}/cache/vllm-k3-overlay/locks"],
                             "inside the tool's cache"),
}


@pytest.mark.parametrize("case", APPLY_CASES)
def test_apply_refuses_an_output_over_an_input(project, sources, tmp_path, monkeypatch, capsys, case):
    monkeypatch.setattr(cli, "Project", lambda: project)
    args, said = APPLY_CASES[case]
    fill = {"bundle": sources["bundle"], "folder": sources["folder"], "tmp": tmp_path}
    argv = [a.format(**fill) for a in args]
    if "--vllm-repo" not in argv:
        argv += ["--vllm-repo", str(sources["bundle"])]
    wd = tmp_path / "wd"
    wd.mkdir()
    (tmp_path / "cache" / "vllm-k3-overlay" / "locks").mkdir(parents=True)
    (tmp_path / "cache" / "vllm-k3-overlay" / "locks" / "x.lock").write_text("apply.py (pid 1)\n")
    (tmp_path / "cachelink").symlink_to(tmp_path / "cache" / "vllm-k3-overlay")
    before = _files(tmp_path)
    code = cli.main(["--workdir", str(wd), *argv])
    err = capsys.readouterr().err
    assert code == errors.USAGE and said in err and err.count("\n") == 1, err
    assert _files(tmp_path) == before and os.listdir(wd) == []  # before any work


def test_apply_refuses_json_inside_the_default_checkout_and_vllm_repo_from_the_environment(
        project, sources, monkeypatch, capsys):
    monkeypatch.setattr(cli, "Project", lambda: project)
    monkeypatch.setenv("VLLM_REPO", str(sources["bundle"]))
    assert cli.main(["--json", str(project.root / "work" / "vllm" / "r.json")]) == errors.USAGE
    assert cli.main(["--json", str(sources["bundle"])]) == errors.USAGE
    err = capsys.readouterr().err.splitlines()
    assert "is inside the checkout" in err[0] and "is --vllm-repo" in err[1]
    assert not (project.root / "work").exists()


def test_apply_still_takes_outputs_beside_its_inputs(project, upstream, tmp_path, monkeypatch):
    monkeypatch.setattr(cli, "Project", lambda: project)
    (tmp_path / "wd-reports").mkdir()  # a name that starts like the checkout's is not inside it
    assert cli.main(["--vllm-repo", str(upstream), "--workdir", str(tmp_path / "wd"), "--json",
                     str(tmp_path / "wd-reports" / "r.json")]) == errors.OK
    assert snapshot(tmp_path / "wd")["status"] == ""  # the report is not in the checkout


REBASE_CASES = {
    "json over the bundle": (["--vllm-repo", "{bundle}", "--json", "{bundle}"], "is --vllm-repo"),
    "markdown inside the source folder": (["--vllm-repo", "{folder}", "--markdown", "{folder}/r.md"],
                                          "is inside --vllm-repo"),
    "junit inside --gpu-results": (["--vllm-repo", "{bundle}", "--gpu-results", "{tmp}/gpu",
                                    "--junit", "{tmp}/gpu/r.xml"], "is inside --gpu-results"),
    "wheels as --gpu-export": (["--vllm-repo", "{bundle}", "--wheels", "{tmp}/out", "--gpu-export",
                                "{tmp}/out"], "is the path --wheels"),
    "wheels inside the source through a link": (["--vllm-repo", "{folder}", "--wheels",
                                                 "{tmp}/srclink/dist"], "is inside --vllm-repo"),
    "junit over a journal in the cache": (["--vllm-repo", "{bundle}", "--junit",
                                           "{tmp}/cache/vllm-k3-overlay/locks/x.journal"],
                                          "inside the tool's cache"),
    "gpu export into the cache": (["--vllm-repo", "{bundle}", "--gpu-export",
                                   "{tmp}/cache/vllm-k3-overlay/envs"], "inside the tool's cache"),
}


@pytest.mark.parametrize("case", REBASE_CASES)
def test_the_rebase_job_refuses_an_output_over_an_input(project, sources, tmp_path, monkeypatch, capsys,
                                                        case):
    ci_rebase = load_ci_rebase()
    monkeypatch.setattr(ci_rebase, "Project", lambda: project)
    (tmp_path / "gpu").mkdir()
    (tmp_path / "srclink").symlink_to(sources["folder"])
    args, said = REBASE_CASES[case]
    fill = {"bundle": sources["bundle"], "folder": sources["folder"], "tmp": tmp_path}
    before = _files(tmp_path)
    code = ci_rebase.main(["--onto", "v1.1.0", "--no-tests", *[a.format(**fill) for a in args]])
    err = capsys.readouterr().err
    assert code == errors.USAGE and said in err and err.count("\n") == 1, err
    assert _files(tmp_path) == before


@pytest.fixture
def bind(tmp_path):
    """``bind(src, dest)``: ``src`` mounted again at ``dest`` (one folder, two paths realpath
    cannot join, as a name in another case is on a case-insensitive file system); skipped
    where mounting is not permitted. Unmounted afterwards."""
    mounted: list[Path] = []

    def mount(src: Path, dest: Path) -> None:
        dest.mkdir()
        if subprocess.run(["mount", "--bind", str(src), str(dest)], capture_output=True).returncode:
            pytest.skip("bind mounts are not permitted here")
        mounted.append(dest)

    yield mount
    for dest in reversed(mounted):
        subprocess.run(["umount", str(dest)], check=False)


ALIASES = {
    # one inode, two names: os.path.realpath resolves links and .., not these
    "json hard-linked to the bundle": ("hard", "{tmp}/vllm.bundle", "{tmp}/also.bundle",
                                       ["--json", "{tmp}/also.bundle"], "is --vllm-repo"),
    "json hard-linked to overlay.json": ("hard", "{root}/overlay.json", "{tmp}/m.json",
                                         ["--json", "{tmp}/m.json"], "is this repository's overlay.json"),
    "json into the workdir through a bind mount": ("bind", "{tmp}/wd", "{tmp}/alias",
                                                   ["--json", "{tmp}/alias/r.json"], "is inside --workdir"),
    "json into patches/ through a bind mount": ("bind", "{root}/patches", "{tmp}/alias",
                                                ["--json", "{tmp}/alias/r.json"],
                                                "is inside this repository's patches/"),
    "json into the cache through a bind mount": ("bind", "{tmp}/cache", "{tmp}/alias",
                                                 ["--json", "{tmp}/alias/vllm-k3-overlay/locks/x.lock"],
                                                 "inside the tool's cache"),
    "json and the release wheel one file by a hard link": (
        "hard", "{tmp}/vllm.whl", "{tmp}/r.json",
        ["--build-wheel", "--release-wheel", "{tmp}/vllm.whl", "--json", "{tmp}/r.json"],
        "is the file --release-wheel"),
}


@pytest.mark.parametrize("case", ALIASES)
def test_an_output_aliasing_an_input_by_inode_is_refused(project, sources, tmp_path, monkeypatch,
                                                         capsys, bind, case):
    """A hard link, a bind mount (and so a name in another case on a case-insensitive file
    system, macOS's default) reach an input under a path realpath never joins to it: the
    report used to be written there (into the checkout, patches/, over the bundle's other
    name)."""
    monkeypatch.setattr(cli, "Project", lambda: project)
    how, src, dest, args, said = ALIASES[case]
    fill = {"tmp": tmp_path, "root": project.root, "bundle": sources["bundle"]}
    wd = tmp_path / "wd"
    wd.mkdir()
    (tmp_path / "cache" / "vllm-k3-overlay" / "locks").mkdir(parents=True)  # an earlier run's
    (tmp_path / "vllm.whl").write_bytes(b"PK\x05\x06" + bytes(18))
    src, dest = Path(src.format(**fill)), Path(dest.format(**fill))
    if how == "hard":
        os.link(src, dest)
    else:
        bind(src, dest)
    before = _files(tmp_path)
    code = cli.main(["--vllm-repo", str(sources["bundle"]), "--workdir", str(wd),
                     *[a.format(**fill) for a in args]])
    err = capsys.readouterr().err
    assert code == errors.USAGE and said in err and err.count("\n") == 1, err
    assert _files(tmp_path) == before and os.listdir(wd) == []


@pytest.fixture
def unresolvable(tmp_path, monkeypatch) -> dict[str, Path]:
    """Paths that cannot be resolved, as each comes about: ``loop``, a link to itself (ELOOP);
    ``long``, a name of 300 characters (ENAMETOOLONG); ``locked``, a folder that cannot be
    searched (EACCES below it: ``/proc/1/root`` for a user; faked for root, whom no mode stops)."""
    (tmp_path / "loop").symlink_to("loop")
    locked = tmp_path / "locked"
    locked.mkdir()
    real_stat, real_lstat = os.stat, os.lstat

    def refused(real):
        def look(path, *args, **kwargs):
            if "dir_fd" not in kwargs and isinstance(path, (str, Path)) \
                    and os.fspath(path).startswith(f"{locked}/"):
                raise PermissionError(errno.EACCES, os.strerror(errno.EACCES), os.fspath(path))
            return real(path, *args, **kwargs)
        return look

    monkeypatch.setattr(os, "stat", refused(real_stat))
    monkeypatch.setattr(os, "lstat", refused(real_lstat))
    return {"loop": tmp_path / "loop", "long": tmp_path / ("n" * 300), "locked": locked}


LOOP = "cannot be resolved: Too many levels of symbolic links"
LONG = "cannot be resolved: File name too long"
DENIED = "cannot be resolved: Permission denied"
UNRESOLVABLE = {
    "workdir through a link loop": (["--check", "--workdir", "{loop}/x"], "--workdir {loop}/x", LOOP),
    "json through a link loop": (["--json", "{loop}/r.json"], "--json {loop}/r.json", LOOP),
    "wheel folder through a link loop": (["--build-wheel", "--wheel-dir", "{loop}/w"], "--wheel-dir {loop}/w",
                                         LOOP),
    "release wheel through a link loop": (["--build-wheel", "--release-wheel", "{loop}/v.whl"],
                                          "--release-wheel {loop}/v.whl", LOOP),
    "source through a link loop": (["--vllm-repo", "{loop}/src"], "--vllm-repo {loop}/src", LOOP),
    "export's workdir through a link loop": (["--export", "--workdir", "{loop}/x"], "--workdir {loop}/x",
                                             LOOP),
    "rebase-to's workdir through a link loop": (["--rebase-to", "v1.1.0", "--workdir", "{loop}/x"],
                                                "--workdir {loop}/x", LOOP),
    "workdir with a name too long": (["--check", "--workdir", "{long}/x"], "--workdir ", LONG),
    "json with a name too long": (["--json", "{long}/r.json"], "--json ", LONG),
    "wheel folder with a name too long": (["--build-wheel", "--wheel-dir", "{long}"], "--wheel-dir ", LONG),
    "workdir in a folder that cannot be searched": (["--check", "--workdir", "{locked}/x"],
                                                    "--workdir {locked}/x", DENIED),
    "json in a folder that cannot be searched": (["--json", "{locked}/r.json"], "--json {locked}/r.json",
                                                 DENIED),
    "wheel folder in a folder that cannot be searched": (["--build-wheel", "--wheel-dir", "{locked}/w"],
                                                         "--wheel-dir {locked}/w", DENIED),
    "workdir a folder that cannot be searched": (["--check", "--workdir", "{locked}"], "--workdir {locked}",
                                                 "is a folder that cannot be searched: Permission denied"),
}


@pytest.mark.parametrize("case", UNRESOLVABLE)
def test_a_path_that_cannot_be_resolved_is_one_line_naming_its_option(project, upstream, tmp_path,
                                                                       monkeypatch, capsys, unresolvable,
                                                                       case):
    """``--workdir /proc/1/root/tmp/x`` as a user, a path through a link loop or with a name too
    long: the first look at it (resolving it for the checks of what a run writes) was a
    traceback (PermissionError, RuntimeError "Symlink loop", OSError), whatever the option."""
    monkeypatch.setattr(cli, "Project", lambda: project)
    args, named, said = UNRESOLVABLE[case]
    argv = [a.format(**unresolvable) for a in args]
    if "--workdir" not in argv:
        argv += ["--workdir", str(tmp_path / "wd")]
    if "--vllm-repo" not in argv and "--export" not in argv:
        argv += ["--vllm-repo", str(upstream)]
    before = _files(tmp_path)
    code = cli.main(argv)
    err = capsys.readouterr().err
    assert code == errors.USAGE and err.count("\n") == 1, err
    assert err.startswith(f"apply.py: error: {named.format(**unresolvable)}") and err.endswith(f"{said}\n")
    assert _files(tmp_path) == before and not (tmp_path / "wd").exists()


def test_a_default_checkout_or_wheel_folder_that_cannot_be_resolved_is_one_line(project, upstream, tmp_path,
                                                                                capsys, monkeypatch):
    """The paths a run uses when none is given (``work/vllm``, ``work/wheels``) are resolved as
    given ones are: a ``work`` that is a link loop was a traceback from the job."""
    monkeypatch.setattr(cli, "Project", lambda: project)
    (project.root / "work").symlink_to("work")
    assert cli.main(["--check", "--vllm-repo", str(upstream)]) == errors.USAGE
    assert cli.main(["--build-wheel", "--vllm-repo", str(upstream), "--workdir", str(tmp_path / "wd")]) \
        == errors.USAGE
    assert capsys.readouterr().err.splitlines() == [
        f"apply.py: error: the checkout {project.root}/work/vllm {LOOP}",
        f"apply.py: error: the wheel folder {project.root}/work/wheels {LOOP}"]
    assert not (tmp_path / "wd").exists()


REBASE_UNRESOLVABLE = {
    "json through a link loop": (["--json", "{loop}/r.json"], "--json {loop}/r.json", LOOP),
    "junit with a name too long": (["--junit", "{long}/r.xml"], "--junit ", LONG),
    "markdown in a folder that cannot be searched": (["--markdown", "{locked}/r.md"],
                                                     "--markdown {locked}/r.md", DENIED),
    "wheels through a link loop": (["--wheels", "{loop}/w"], "--wheels {loop}/w", LOOP),
    "gpu export in a folder that cannot be searched": (["--gpu-export", "{locked}/e"],
                                                       "--gpu-export {locked}/e", DENIED),
    "gpu results through a link loop": (["--gpu-results", "{loop}/g"], "--gpu-results {loop}/g", LOOP),
    "source with a name too long": (["--vllm-repo", "{long}"], "--vllm-repo ", LONG),
}


@pytest.mark.parametrize("case", REBASE_UNRESOLVABLE)
def test_the_rebase_job_refuses_a_path_that_cannot_be_resolved_in_one_line(project, upstream, tmp_path,
                                                                           monkeypatch, capsys,
                                                                           unresolvable, case):
    ci_rebase = load_ci_rebase()
    monkeypatch.setattr(ci_rebase, "Project", lambda: project)
    args, named, said = REBASE_UNRESOLVABLE[case]
    argv = [a.format(**unresolvable) for a in args]
    if "--vllm-repo" not in argv:
        argv += ["--vllm-repo", str(upstream)]
    before = _files(tmp_path)
    code = ci_rebase.main(["--onto", "v1.1.0", "--no-tests", *argv])
    err = capsys.readouterr().err
    assert code == errors.USAGE and err.count("\n") == 1, err
    assert err.startswith(f"rebase.py: error: {named.format(**unresolvable)}") and err.endswith(f"{said}\n")
    assert _files(tmp_path) == before
