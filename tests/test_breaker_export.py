"""Found by the second adversarial pass: ``apply.py --export`` wrote the project's data one
file at a time, opening patches/ and overlay/ and writing overlay.json through links. So
patches/ or overlay.json being a link sent the export's writes outside the repository, and
a link at patches/series (or a full disk part-way) left half an export: a new patch file
written, the series not, and every later run refused ("patches not in series")."""

from __future__ import annotations

import errno
import os
import shutil

import pytest

from k3overlay import errors, files
from k3overlay.export import export
from k3overlay.job import Options, run_apply

from .conftest import g


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
