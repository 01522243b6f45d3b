"""Issue 8's link and folder cases on a copy of the real v0.28.0 tree (tier ``e2e``).

Upstream's commit ``k3-hostile`` on top of the release puts, where our overlay files go:
a link to an absolute path (the file we replace), a relative link climbing out of any
worktree (a file we add), and a folder (another file we add); plus a dangling ``.py``
link elsewhere in the tree. Nothing outside the tree may change, whatever runs.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile

from k3overlay import errors
from k3overlay.project import ROOT, Project
from k3overlay.rebase import run_rebase

from ..conftest import g, snapshot
from .conftest import DISPATCH as LLG  # an overlay path: a link there is never written through

SM90 = "vllm/models/kimi_k3/nvidia/low_latency_gemm_sm90.py"
TABLES = "vllm/models/kimi_k3/nvidia/low_latency_gemm_tables.py"
PRECIOUS = "precious: must never be overwritten\n"


def _hostile_release(mirror_repo, tmp_path):
    up = tmp_path / "up"
    g(tmp_path, "clone", "-q", "--branch", "v0.28.0", mirror_repo.git_dir, str(up))
    victims = tmp_path / "victim-abs.py", tmp_path / "victim-rel.py"
    for victim in victims:
        victim.write_text(PRECIOUS)
    (up / LLG).symlink_to(victims[0])
    # from <tmp>/t/k3overlay-<uid>/run-*/k3-worktree-*/tree/vllm/models/kimi_k3/nvidia/ (the run's
    # own folder in TMPDIR, ``scratch``) nine levels up is tmp_path
    (up / SM90).symlink_to("../" * 9 + "victim-rel.py")
    (up / TABLES).mkdir()
    (up / TABLES / "README").write_text("upstream made this a folder\n")
    (up / "vllm" / "k3_dangling.py").symlink_to("does/not/exist.py")
    g(up, "add", "-A")
    g(up, "commit", "-qm", "upstream: links and a folder where the overlay goes")
    g(up, "tag", "k3-hostile")
    return up, victims


def test_real_tree_links_and_folders_are_never_written_through(mirror_repo, tmp_path, monkeypatch):
    up, victims = _hostile_release(mirror_repo, tmp_path)
    (tmp_path / "t").mkdir()
    env = {**os.environ, "TMPDIR": str(tmp_path / "t")}
    out = tmp_path / "report.json"
    before = snapshot(up)  # the hostile clone is the user's checkout here: --check on it
    proc = subprocess.run([sys.executable, str(ROOT / "apply.py"), "-q", "--check", "--vllm-repo",
                           str(up), "--vllm-ref", "k3-hostile", "--workdir", str(up),
                           "--json", str(out)], capture_output=True, text=True, env=env)
    assert proc.returncode == errors.DRIFT, proc.stdout + proc.stderr
    overlay = {f["path"]: f for f in json.loads(out.read_text())["overlay"]}
    assert overlay[LLG]["status"] == overlay[SM90]["status"] == overlay[TABLES]["status"] == "conflict"
    assert "symbolic link" in overlay[LLG]["detail"] and "symbolic link" in overlay[SM90]["detail"]
    assert "folder" in overlay[TABLES]["detail"]
    assert [v.read_text() for v in victims] == [PRECIOUS, PRECIOUS]
    assert os.listdir(tmp_path / "t") == [] and snapshot(up) == before

    # The rebase job lays what it can, and never vouches for that partial tree (verify: not run).
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path / "t"))
    (rep,) = run_rebase(Project(), ["k3-hostile"], vllm_repo=str(up))
    statuses = {f.path: f.status for f in rep.overlay}
    assert statuses[LLG] == statuses[SM90] == statuses[TABLES] == "conflict"
    assert {s for p, s in statuses.items() if p not in (LLG, SM90, TABLES)} == {"added"}
    assert rep.verify is None and rep.verification.status == "not run", rep.verification
    assert [v.read_text() for v in victims] == [PRECIOUS, PRECIOUS]
