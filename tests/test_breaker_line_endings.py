"""Found by the second adversarial pass: a checkout of this repository whose line endings
git converted (``core.autocrlf=true``, common on Windows and WSL) made every patch of the
series a "conflict" (exit 3, naming hunks of upstream's files that were never the
problem) and would lay every overlay file with CRLF endings. The repository's
``.gitattributes`` now keeps its data byte for byte on checkout, and a patch converted
anyway (an archive unpacked by a converting tool) is named in one line, exit 2."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

from k3overlay import errors, series
from k3overlay.job import Options, run_apply
from k3overlay.project import ROOT, Project

from .conftest import g


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
