"""Found by the second adversarial pass: a patch that writes into ``.git`` (any case, at any
depth) or out of the tree (``../``). git refuses such a path, so nothing was ever written,
but the report called the patch a bare "conflict" naming no file and no reason; the
conflict entry now carries git's own line, once (am and apply both said it)."""

from __future__ import annotations

import pytest

from k3overlay.job import Options, run_apply

from .conftest import g

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
    report = run_apply(project, Options(vllm_repo=str(upstream), workdir=wd, check=check))
    assert report.exit_code == 3 and [p.status for p in report.patches] == ["applied", "conflict"]
    assert report.patches[1].hunks == [f"error: invalid path '{path}'"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["cache", "project", "wd"]
    assert not (wd / ".git/hooks/post-checkout").exists() and not marker.exists()
