"""End-to-end on real vLLM releases, materialized from their sdists (tier ``e2e``).

The release mirror lives in the real cache (``~/.cache/vllm-k3-overlay``), so
only the first run on a machine downloads (about 40 MB per release).
"""

from __future__ import annotations

import subprocess
import sys

from k3overlay import errors, git, source
from k3overlay.job import Options, run_apply
from k3overlay.mirror import release_of
from k3overlay.project import ROOT, Project
from k3overlay.series import load as load_series
from k3overlay.verify import verify

from ..conftest import g, snapshot
from .conftest import DISPATCH, LLG, MTP

# git hash-object of upstream files, as found in the release sdists (shared/FACTS.md)
BLOBS = {("v0.28.0", LLG): "64ea39b4", ("v0.29.0", LLG): "52e6aa04",
         ("v0.28.0", MTP): "45cbe376", ("v0.29.0", MTP): "038c8db6"}


def test_mirror_blobs_match_the_published_releases(mirror_repo):
    for (ref, path), prefix in BLOBS.items():
        assert git.blob_at(mirror_repo, ref, path).startswith(prefix)


def test_apply_on_pinned_base(applied):
    wd, report = applied
    project = Project()
    assert report["ok"] is True and report["ref"] == report["base_ref"] == "v0.28.0"
    assert {p["status"] for p in report["patches"]} == {"applied"}
    assert {f["status"] for f in report["overlay"]} <= {"replaced", "added"}
    assert g(wd, "symbolic-ref", "--short", "HEAD").strip() == f"k3-overlay/{project.version}"
    mtp = (wd / MTP).read_text()
    assert "self.eh_proj = ReplicatedLinear(" in mtp and "nn.Linear(config.hidden_size * 2" not in mtp
    subjects = g(wd, "log", "--format=%s").splitlines()
    n = len(load_series(project.patches_dir))
    assert subjects[0].startswith("k3-overlay: lay overlay files")
    assert subjects[-1] == "vLLM v0.28.0" and len(subjects) == n + 2
    assert (wd / DISPATCH).read_bytes() == (project.overlay_dir / DISPATCH).read_bytes()
    assert g(wd, "hash-object", LLG).startswith(BLOBS["v0.28.0", LLG])  # upstream's, untouched
    assert "low_latency_gemm_dispatch import" in (wd / MTP).read_text()


def test_rerun_is_a_no_op(applied):
    wd, _ = applied
    tip = g(wd, "rev-parse", "HEAD")
    report = run_apply(Project(), Options(workdir=wd))
    assert report.ok and g(wd, "rev-parse", "HEAD") == tip


def test_check_leaves_real_checkout_untouched(applied):
    wd, _ = applied
    before = snapshot(wd)
    report = run_apply(Project(), Options(workdir=wd, check=True))
    assert report.ok and snapshot(wd) == before


def test_dirty_real_checkout_refused_and_change_survives(applied):
    wd, _ = applied
    mine = "# my local experiment\n"
    original = (wd / MTP).read_text()
    (wd / MTP).write_text(original + mine)
    try:
        proc = subprocess.run([sys.executable, str(ROOT / "apply.py"), "--workdir", str(wd), "-q"],
                              capture_output=True, text=True)
        assert proc.returncode == errors.USAGE
        assert proc.stderr.count("\n") == 1 and "uncommitted changes" in proc.stderr
        assert (wd / MTP).read_text() == original + mine
    finally:
        (wd / MTP).write_text(original)


def test_v0_29_0_patch_landed_and_overlay_files_are_all_ours(mirror_repo, tmp_path):
    report = run_apply(Project(), Options(ref="v0.29.0", workdir=tmp_path / "wd", check=True))
    statuses = {p.name.split("-")[0]: p.status for p in report.patches}
    assert statuses["0001"] == "landed-upstream"
    # The hook into upstream's dispatch is two import lines upstream did not touch.
    assert statuses["0002"] == "applied"
    # Every overlay file is one upstream does not have: nothing drifts, LLG is not among them.
    assert {f.status for f in report.overlay} == {"added"}
    assert LLG not in {f.path for f in report.overlay}
    assert report.exit_code == errors.CONFLICT  # 0003/0004 meet upstream's KDA edits, 0006 and 0013 its MLA ones


def test_verify_names_the_hooks_a_keep_both_resolution_of_0007_on_v0_34_0_leaves_dead(applied, mirror_repo,
                                                                                     tmp_path):
    """vLLM v0.34.0 gives both Kimi-K3 model classes a ``process_weights_after_loading`` of
    their own. 0007's hunk for the language model applies cleanly beside upstream's, its
    forwarder conflicts; keeping both sides (``git merge-file --union``) gives a file that
    compiles and imports, where one hook of each class never runs. Verify fails on it."""
    wd, _ = applied
    source.default_mirror().ensure([release_of("v0.34.0")])
    model = "vllm/models/kimi_k3/nvidia/model.py"
    [p0007] = [p for p in load_series(Project().patches_dir) if p.name.startswith("0007-")]
    [ours] = [line.split(" ", 1)[0] for line in g(wd, "log", "--format=%H %s").splitlines()
              if line.split(" ", 1)[1] == p0007.subject]
    theirs = git.read_blob(mirror_repo, git.blob_at(mirror_repo, "v0.34.0", model))
    (tmp_path / "base.py").write_text(g(wd, "show", f"{ours}~1:{model}"))
    (tmp_path / "ours.py").write_text(g(wd, "show", f"{ours}:{model}"))
    merged = tmp_path / "tree" / model
    merged.parent.mkdir(parents=True)
    merged.write_bytes(theirs)
    g(tmp_path, "merge-file", "--union", str(merged), "base.py", "ours.py")
    errors_ = verify(tmp_path / "tree", [model], before={model: theirs}).errors
    assert [e.split(": ", 2)[1].split(" is defined again")[0] for e in errors_] == [
        "KimiK3ForConditionalGeneration.process_weights_after_loading",
        "KimiLinearForCausalLM.process_weights_after_loading"]
    assert verify(tmp_path / "tree", [model], before={model: merged.read_bytes()}).ok  # upstream's own: not ours
