"""Output fit for pipes and CI logs: no token cut over two lines, lines in the order things happened."""

from __future__ import annotations

import re
import subprocess
import sys

from k3overlay.wheel import PRINT_RECORD

from .test_wheel import setup, vupstream  # noqa: F401 (fixtures: a project, its tree, a release wheel)

RUN = ("import sys; from pathlib import Path; from k3overlay import cli; "
       "from k3overlay.project import Project; cli.Project = lambda: Project(Path(sys.argv[1])); "
       "sys.exit(cli.main(sys.argv[2:]))")


def piped(root, *args: str) -> tuple[int, list[str]]:
    """apply.py's main with stdout and stderr into one pipe, as ``apply.py ... 2>&1 | cat``."""
    proc = subprocess.run([sys.executable, "-c", RUN, str(root), *args], stdout=subprocess.PIPE,
                          stderr=subprocess.STDOUT, text=True)
    return proc.returncode, proc.stdout.splitlines()


def test_a_wheel_run_piped_keeps_shas_paths_and_commands_whole_and_in_order(setup, tmp_path):  # noqa: F811
    project, release, _repo, report, _tip = setup
    wheel_dir = tmp_path / ("a-long-folder-name-" * 8) / "wheels"  # the wheel line: over 200 columns
    args = ["--vllm-repo", report.workdir, "--workdir", report.workdir, "--build-wheel",
            "--release-wheel", str(release), "--wheel-dir", str(wheel_dir)]
    code, lines = piped(project.root, *args)  # the branch is there already: "nothing to do"
    assert code == 0, lines
    [wheel] = [i for i, line in enumerate(lines) if line.startswith("wheel: ")]
    [same] = [i for i, line in enumerate(lines) if "already at" in line]
    packing = [i for i, line in enumerate(lines) if line.startswith("… packing")]
    assert packing and packing[0] < wheel and same < wheel, lines  # as it happened
    built = next(wheel_dir.glob("*.whl"))
    assert re.fullmatch(rf"wheel: {re.escape(str(built))} \([\d,]+ bytes, sha256 [0-9a-f]{{64}}\)",
                        lines[wheel]), lines[wheel]
    assert any(line.endswith(PRINT_RECORD) for line in lines), lines  # the command: one line
    assert lines[-1].startswith("ok -> branch ")
