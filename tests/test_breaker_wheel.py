"""Found by the adversarial pass: write errors in ``--wheel-dir`` (a full disk, a read-only
folder) and a file the tool names itself there. Expectations: one line, the folder named,
exit 2 like a full disk under ``--json``, nothing left in the folder, nothing written
through a link."""

from __future__ import annotations

import errno
import os
import zipfile

from k3overlay import cli, errors

from .test_wheel import setup, vupstream  # noqa: F401 (fixtures)


def _build(setup, wheel_dir, monkeypatch):
    project, release, _repo, report, _tip = setup
    monkeypatch.setattr(cli, "Project", lambda: project)
    return cli.main(["-q", "--vllm-repo", report.workdir, "--workdir", report.workdir,
                     "--build-wheel", "--release-wheel", str(release), "--wheel-dir", str(wheel_dir)])


def test_a_full_wheel_folder_is_one_line_naming_the_folder_not_the_release(setup, tmp_path,
                                                                           monkeypatch, capsys):
    wheel_dir = tmp_path / "wheels"
    wheel_dir.mkdir()
    real = zipfile.ZipFile.writestr

    def writestr(self, *args, **kwargs):  # the disk fills up once writing into the folder starts
        if str(self.filename).startswith(str(wheel_dir)):
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        return real(self, *args, **kwargs)

    monkeypatch.setattr(zipfile.ZipFile, "writestr", writestr)
    code = _build(setup, wheel_dir, monkeypatch)
    err = capsys.readouterr().err.strip().splitlines()
    release = setup[1].name
    assert code == errors.USAGE, err
    assert len(err) == 1 and str(wheel_dir) in err[0] and "No space left on device" in err[0], err
    assert release not in err[0]  # the release wheel is fine: it is not blamed
    assert os.listdir(wheel_dir) == []


def test_a_read_only_wheel_folder_is_one_line_not_a_traceback(setup, tmp_path, monkeypatch, capsys):
    wheel_dir = tmp_path / "wheels"
    wheel_dir.mkdir()
    real = os.mkdir

    def mkdir(path, *args, **kwargs):  # what a read-only mount answers, even to root
        if str(path).startswith(str(wheel_dir) + os.sep):
            raise OSError(errno.EROFS, os.strerror(errno.EROFS), str(path))
        return real(path, *args, **kwargs)

    monkeypatch.setattr(os, "mkdir", mkdir)
    code = _build(setup, wheel_dir, monkeypatch)
    err = capsys.readouterr().err.strip().splitlines()
    assert code == errors.USAGE and len(err) == 1, err
    assert str(wheel_dir) in err[0] and "Read-only file system" in err[0], err


def test_the_build_log_is_not_written_through_a_link_in_the_wheel_folder(setup, tmp_path,
                                                                           monkeypatch):
    from k3overlay.wheel import VLLM

    from .test_wheel import build_in

    outside = tmp_path / "outside.txt"
    outside.write_text("mine\n")
    wheel_dir = tmp_path / "wheels"
    wheel_dir.mkdir()
    (wheel_dir / "vllm-build.log").symlink_to(outside)
    monkeypatch.setattr("k3overlay.wheel.torch_in", lambda python: ("2.13.0+cu130", "13.0"))
    monkeypatch.setattr("k3overlay.wheel.VLLM_BUILD_ENV", {"VLLM_USE_PRECOMPILED": "0"})
    try:
        build_in(setup, wheel_dir, method=VLLM)
    except errors.BuildError as err:
        assert "vLLM's build failed" in str(err) and "log not kept" in str(err), err
    else:
        raise AssertionError("the stand-in build should fail")
    assert outside.read_text() == "mine\n" and (wheel_dir / "vllm-build.log").is_symlink()
