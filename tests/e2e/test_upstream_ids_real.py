"""Upstream's commit ids of the real releases (``k3overlay/releases.json``) against their sdists."""

from __future__ import annotations

import subprocess
import sys

from k3overlay import git, releases
from k3overlay.project import ROOT


def test_each_release_in_the_mirror_records_the_id_the_file_gives(mirror_repo):
    """v0.28.0 and v0.29.0 are in the mirror (the e2e fixture fetched them); every release
    there that the file knows records the same commit in its vllm/_version.py."""
    known = {r.tag: r for r in releases.known()}
    checked = []
    for tag in git.tags(mirror_repo):
        if tag in known:
            text = git.read_blob(mirror_repo, git.blob_at(mirror_repo, tag, releases.VERSION_PY)).decode()
            assert releases.recorded_commit(text) == known[tag].recorded, tag
            checked.append(tag)
    assert {"v0.28.0", "v0.29.0"} <= set(checked)


def test_apply_check_with_upstreams_full_sha_of_v0_29_0(mirror_repo):
    """The issue's command: upstream's full commit id of v0.29.0 is taken for that release."""
    sha = next(r.commit for r in releases.known() if r.tag == "v0.29.0")
    proc = subprocess.run([sys.executable, str(ROOT / "apply.py"), "-q", "--vllm-ref", sha, "--check"],
                          capture_output=True, text=True, cwd=ROOT)
    assert proc.returncode in (0, 3, 4, 5), proc.stderr  # a verdict on v0.29.0, not a usage error
    mirror_sha = git.resolve(mirror_repo, "v0.29.0")
    assert f" on v0.29.0 ({mirror_sha[:12]})" in proc.stdout
    assert (f"--vllm-ref {sha}: upstream's commit of vLLM v0.29.0 (its sdist records g98dff2a81, "
            f"checked)") in proc.stdout
