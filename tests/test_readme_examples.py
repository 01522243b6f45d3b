"""Following the README and its pages (docs/*.md) leaves nothing untracked in the repository: every file or folder its
commands write (reports, checkouts, wheels) is one git ignores."""

from __future__ import annotations

import re
import shlex
import subprocess

import pytest

from k3overlay.project import ROOT

# Options that name something a command writes (apply.py, ci/rebase.py, the GPU tools).
WRITES = ("--json", "--junit", "--markdown", "--workdir", "--wheel-dir", "--wheels", "--gpu-export")
PLACEHOLDER = re.compile(r"^[A-Z_]+$|[A-Z]{3,}")  # FILE, DIR, DEST/trees: the user's choice


def readme_commands() -> list[list[str]]:
    """Each command of the shell blocks of README.md and its pages, as words (continuation
    lines joined)."""
    blocks, inside = [], False
    text = "\n".join(p.read_text() for p in [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))])
    for line in text.splitlines():
        if line.startswith("```"):
            inside = not inside
            blocks.append([]) if inside else None
        elif inside:
            blocks[-1].append(line)
    commands = []
    for block in blocks:
        for line in "\n".join(block).replace("\\\n", " ").splitlines():
            line = line.split("  #")[0].strip()
            if line.startswith(("python", ".venv/", "ci/", ".ci/", "pip ")) or "apply.py" in line:
                for part in re.split(r"&&|;", line):
                    try:
                        commands.append(shlex.split(part))
                    except ValueError:  # an example with an open quote: not a command
                        continue
    return commands


def written_paths() -> list[str]:
    paths = []
    for words in readme_commands():
        words = [w.strip("[]") for w in words]
        for option, value in zip(words, words[1:]):
            if option in WRITES and not PLACEHOLDER.search(value):
                paths.append(value)
    return paths


def ignored(path: str) -> bool:
    return subprocess.run(["git", "check-ignore", "-q", "--no-index", path], cwd=ROOT).returncode == 0


@pytest.fixture(scope="module", autouse=True)
def a_checkout():
    if subprocess.run(["git", "rev-parse", "--git-dir"], cwd=ROOT, capture_output=True).returncode:
        pytest.skip("not a git checkout (an sdist?): nothing can land untracked")


def test_the_readme_names_report_paths_and_each_is_git_ignored():
    paths = written_paths()
    assert "work/report.json" in paths and "reports/rebase.json" in paths  # the parser finds them
    assert [p for p in paths if not ignored(p)] == []


def test_default_outputs_are_git_ignored():
    """apply.py's own defaults (no option given): the checkout and the wheel folder, and the
    reports folder the README sends reports to."""
    for path in ("work/vllm", "work/wheels/x.whl", "reports/rebase.md"):
        assert ignored(path), path
