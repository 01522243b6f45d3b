"""``ci/targets.toml`` against its schema (issue 25, 15): each malformed file is one line
naming the file, the key and what is expected, exit 2; never a traceback, never a string
split into its characters."""

from __future__ import annotations

import re

import pytest

from ci import targets
from k3overlay import errors

GOOD = """[targets."v1.0.0"]
base = true
gpu_stage = true
torch = "2.13.0"
cute_dsl = "4.6.2"
flashinfer = "0.6.18"
quack_kernels = "0.6.4"
"""
E2E = '\n[targets."v1.0.0".e2e]\nlanded = ["0001"]\nconflict = ["0003"]\nsm107_table = false\n'

# what the file says -> a regex the one line matches (after "<file>: ")
BAD = {
    "a string for a list (gpu_wheels)": (GOOD + 'gpu_wheels = "pkg==1"\n',
                                         r'targets\."v1\.0\.0"\.gpu_wheels: expected a list of strings.*'
                                         r"got a string 'pkg==1'"),
    "a string for a list (landed)": (GOOD + E2E.replace('["0001"]', '"0001"'),
                                     r'targets\."v1\.0\.0"\.e2e\.landed: expected a list of strings'),
    "a list of numbers": (GOOD + "gpu_wheels = [1, 2]\n", r"gpu_wheels: expected a list of strings"),
    "a string for a boolean": (GOOD.replace("base = true", 'base = "yes"'),
                               r'\.base: expected true or false, got a string \'yes\''),
    "a number for a string": (GOOD.replace('torch = "2.13.0"', "torch = 2.13"),
                              r"\.torch: expected a string .*, got a number '2\.13'"),
    "a key missing": (GOOD.replace('flashinfer = "0.6.18"\n', ""),
                      r'targets\."v1\.0\.0"\.flashinfer: missing \(expected a string'),
    "an unknown key (a typo)": (GOOD + 'gpu-wheels = ["a==1"]\n',
                                r'targets\."v1\.0\.0"\.gpu-wheels: unknown key \(expected one of '
                                r'.*gpu_wheels'),
    "an unknown key in e2e": (GOOD + E2E + "sm107 = true\n", r"\.e2e\.sm107: unknown key"),
    "an unknown top-level key": ("[target]\n" + GOOD, r"target: unknown key \(expected one of targets\)"),
    "no targets at all": ("# nothing\n", r"targets: missing"),
    "a target that is no table": ('targets = {"v1.0.0" = 1}\n', r'targets\."v1\.0\.0": expected a table'),
    "e2e that is no table": (GOOD + "e2e = [1]\n", r"\.e2e: expected a table, got a list"),
    "a TOML syntax error": (GOOD + "torch = \n", r"not valid TOML: .*line 8"),
    "a target twice": (GOOD + GOOD, r"not valid TOML: Cannot declare .*v1\.0\.0.* twice"),
    "two base targets": (GOOD + GOOD.replace("v1.0.0", "v1.1.0"),
                         r'targets\."v1\.1\.0"\.base: expected one base target, v1\.0\.0 is one already'),
}


@pytest.mark.parametrize("fault", list(BAD))
def test_a_malformed_targets_file_is_one_line_naming_the_key(tmp_path, fault):
    text, expect = BAD[fault]
    path = tmp_path / "targets.toml"
    path.write_text(text)
    with pytest.raises(targets.TargetsError) as err:
        targets.load(path)
    line = str(err.value)
    assert line.startswith(f"{path}: ") and "\n" not in line, line
    assert re.search(expect, line.removeprefix(f"{path}: ")), line
    assert err.value.exit_code == errors.USAGE


def test_the_command_says_it_in_one_line_exit_2(tmp_path, monkeypatch, capsys):
    path = tmp_path / "targets.toml"
    path.write_text(GOOD + 'gpu_wheels = "pkg==1"\n')
    monkeypatch.setattr(targets, "FILE", path)
    monkeypatch.setattr(targets.load, "__defaults__", (path,))
    assert targets.main(["refs"]) == errors.USAGE
    out, err = capsys.readouterr()
    assert out == "" and err.startswith(f"targets.py: error: {path}: ") and err.count("\n") == 1


def test_a_good_file_reads_as_it_says(tmp_path):
    path = tmp_path / "targets.toml"
    path.write_text(GOOD + 'gpu_wheels = ["a==1", "b==2"]\n' + E2E)
    [target] = targets.load(path).values()
    assert target.gpu_wheels == ("a==1", "b==2") and target.base and target.torch == "2.13.0"
    assert target.e2e == targets.E2E(landed=("0001",), conflict=("0003",), sm107_table=False)
    assert set(targets.load()) >= {"v0.28.0", "v0.29.0"}  # the committed file passes
