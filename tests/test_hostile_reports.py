"""Hostile upstream content and hostile secrets against every output: the error line,
progress, the human report, ``--json`` (apply.py's and the rebase job's), JUnit XML and
markdown. Each format must stay valid and no password may survive in any of them.
"""

from __future__ import annotations

import io
import json
import xml.etree.ElementTree as ET

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from markdown_it import MarkdownIt
from rich.console import Console

from k3overlay import cli, errors, progress
from k3overlay.manifest import DRIFT, FileResult
from k3overlay.report import Report, junit_xml, markdown, write_human, write_json
from k3overlay.series import PatchResult

from .test_rebase import load_ci_rebase
from .test_redact import SECRET, _closed_port, _leaks

# What a CodeCommit (or any generated) password holds unescaped, and what ends a URL's
# authority for every reader but curl.
HOSTILE = "/?#@+%:=&;!$*,()[]~"


def _report(url: str, **overlay) -> Report:
    """A report quoting ``url`` wherever a run can: the source, an error, git's lines, a note."""
    files = [FileResult("pkg/model.py", DRIFT, detail=f"fatal: unable to access '{url}/'",
                        **overlay)]
    return Report("0.1.0", "v1.0.0", "v1.1.0", ref_sha="a" * 40, branch="k3", workdir="/w",
                  patches=[PatchResult("0001-x.patch", "conflict", files=["pkg/model.py"],
                                       hunks=[f"error: cannot fetch {url}"])],
                  overlay=files, vllm_repo=url, notes=[f"cloning {url} into /w"])


def _every_output(report: Report, tmp_path, capsys) -> str:
    """Every rendering of ``report`` (checking each stays valid), and what was printed."""
    json_file, many_file = tmp_path / "r.json", tmp_path / "many.json"
    write_json(report, json_file)
    write_json([report, report], many_file)
    json.loads(json_file.read_text()), json.loads(many_file.read_text())
    xml = junit_xml([report])
    ET.fromstring(xml.encode())
    human = io.StringIO()
    write_human(report, Console(file=human, width=10_000))
    progress.quiet = False
    progress.say(f"cloning {report.vllm_repo} into /w")
    cli.tell(f"apply.py: error: {report.patches[0].hunks[0]}")
    out, err = capsys.readouterr()
    return "\n".join([json_file.read_text(), many_file.read_text(), xml, markdown([report]),
                      human.getvalue(), out, err])


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.text(alphabet=HOSTILE + "aZ09", min_size=1, max_size=24))
def test_no_generated_password_survives_in_any_output(tmp_path, capsys, noise):
    # CodeCommit's passwords hold / and +; the masking stopped at the first / ? # and
    # printed the rest, in the progress line, the error line and --json (issue 25, 8)
    password = f"{noise}{SECRET}{noise}"
    url = f"https://user:{password}@git-codecommit.example/v1/repos/vllm"
    text = _every_output(_report(url), tmp_path, capsys)
    assert password not in text and SECRET not in text
    assert "https://***@git-codecommit.example/v1/repos/vllm" in text


def test_a_codecommit_password_given_to_apply_and_the_rebase_job_reaches_no_output(
        project, tmp_path, monkeypatch, capsys):
    password = f"Ab/cd+ef?gh#ij%zz{SECRET}"
    url = f"https://user:{password}@127.0.0.1:{_closed_port()}/up.git"
    monkeypatch.setattr(cli, "Project", lambda: project)
    code = cli.main(["--workdir", str(tmp_path / "wd"), "--vllm-repo", url,
                     "--json", str(tmp_path / "r.json")])
    ci_rebase = load_ci_rebase()
    monkeypatch.setattr(ci_rebase, "Project", lambda: project)
    outs = [tmp_path / "out.json", tmp_path / "out.xml", tmp_path / "out.md"]
    job = ci_rebase.main(["--onto", "v1.1.0", "--vllm-repo", url, "--no-tests", "--json", str(outs[0]),
                          "--junit", str(outs[1]), "--markdown", str(outs[2])])
    out, err = capsys.readouterr()
    assert code != errors.OK and job != errors.OK
    assert SECRET not in out + err and _leaks(tmp_path) == []
    assert "https://***@127.0.0.1" in err


BEARER = '-H "Authorization: Bearer $TOKEN" https://h/x'


def test_a_header_in_upstream_text_keeps_every_json_report_valid(tmp_path, capsys):
    # redaction ran on the serialized JSON too: `Bearer $TOKEN\"` lost its backslash
    report = _report("https://h/x", upstream_diff=f'+curl {BEARER}\n')
    report.error = f"git said: curl {BEARER}"
    report.patches[0].hunks.append('pkg/\x1b[31m]]></failure></testcase>&amp;"\'.py:1-2')
    text = _every_output(report, tmp_path, capsys)  # parses every JSON and XML it writes
    data = json.loads((tmp_path / "r.json").read_text())
    assert "Authorization: Bearer ***" in data["overlay"][0]["upstream_diff"] and "$TOKEN" not in text


def _md_tokens(text: str) -> list:
    return MarkdownIt("commonmark").parse(text)


def test_upstream_backticks_and_tags_do_not_change_the_markdown_structure():
    # a docstring's code fence in upstream's diff closed the `diff` fence early, and what
    # followed rendered as markup: a fake heading, a stray </details>
    diff = "\n".join([" '''Example:", " ```", " ````python", "### v9: clean", "</details>",
                      "<details><summary>x</summary>", " ```", "+new"])
    path = "pkg/a`b</summary></details>\n### fake.py"
    report = Report("0.1.0", "v1.0.0", "v1.1.0", overlay=[FileResult(path, DRIFT, detail="d\n# h",
                                                                     upstream_diff=diff)])
    text = markdown([report])
    tokens = _md_tokens(text)
    fences = [t for t in tokens if t.type == "fence"]
    assert [f.info for f in fences] == ["bash", "diff"]
    assert fences[1].content.splitlines() == diff.splitlines()
    headings = [tokens[i + 1].content for i, t in enumerate(tokens) if t.type == "heading_open"]
    assert len(headings) == 2 and headings[1].startswith("v1.1.0: needs a maintainer"), headings
    # one collapsed block, opened and closed once: no tag of upstream's
    html = "".join(t.content for t in tokens if t.type == "html_block")
    assert html.count("</details>") == 1 and html.count("<details>") == 1
    code = [c.content for t in tokens if t.type == "inline" for c in t.children or []
            if c.type == "code_inline"]
    assert path.replace("\n", " ") in code


ESCAPES = ["\x1b[2J", "\x1b]0;owned\x07", "\x9b31m", "\u202e", "\r", "\x08"]


def test_terminal_control_sequences_from_upstream_are_shown_escaped(capsys):
    # an upstream path holding ESC sequences reached the terminal raw in the human report
    hostile = "pkg/" + "".join(ESCAPES) + "x.py"
    report = Report("0.1.0", "v1.0.0", "v1.1.0", overlay=[FileResult(hostile, DRIFT, detail=hostile)],
                    patches=[PatchResult("0001-x.patch", "conflict", hunks=[hostile])],
                    notes=[hostile], error=hostile)
    human = io.StringIO()
    write_human(report, Console(file=human, width=10_000, color_system=None))
    progress.quiet = False
    progress.say(f"laying {hostile}")
    cli.tell(f"apply.py: error: git: {hostile}")
    out, err = capsys.readouterr()
    for text in (human.getvalue(), err):
        assert not any(e in text for e in ESCAPES), repr(text)
        assert "pkg/\\x1b[2J\\x1b]0;owned\\x07\\x9b31m\\u202e\\r\\x08x.py" in text


@pytest.mark.parametrize("terminal", [False, True])
def test_a_progress_bars_label_from_the_index_is_text_not_markup_or_escapes(monkeypatch, terminal):
    # a file name from the package index labels the download's bar, which rich reads as markup
    out = io.StringIO()
    monkeypatch.setattr(progress, "console", Console(file=out, force_terminal=terminal, width=200,
                                                     color_system=None))
    monkeypatch.setattr(progress, "LOG_EVERY_S", 0.0)
    monkeypatch.setattr(progress, "quiet", False)
    with progress.ByteBar(2_000_000, "vllm-\x1b]0;owned\x07[/x].whl") as bar:
        bar.update(1_000_000)
    assert "\x1b]0;owned" not in out.getvalue()
    assert terminal or "vllm-\\x1b]0;owned\\x07[/x].whl: 1.0 MB of 2.0 MB" in out.getvalue()


MARKDOWN_HOSTILE = st.text(alphabet="`~<>/#*_|-[]() \nadeilmrsuy", max_size=40)


@settings(max_examples=80, deadline=None)
@given(path=MARKDOWN_HOSTILE.filter(str.strip), diff=st.lists(MARKDOWN_HOSTILE, min_size=1, max_size=6),
       detail=MARKDOWN_HOSTILE)
def test_no_upstream_text_changes_the_markdown_structure(path, diff, detail):
    lines = "\n".join(diff).splitlines() or [""]
    report = Report("0.1.0", "v1.0.0", "v1.1.0",
                    overlay=[FileResult(path, DRIFT, detail=detail, upstream_diff="\n".join(lines) + "\n")])
    tokens = _md_tokens(markdown([report]))
    fences = [t for t in tokens if t.type == "fence"]
    assert [f.info for f in fences] == ["bash", "diff"]
    assert fences[1].content.splitlines() == "\n".join(lines).rstrip().splitlines()
    assert sum(t.type == "heading_open" for t in tokens) == 2
    html = "".join(t.content for t in tokens if t.type == "html_block")
    assert html.count("<details>") == 1 and html.count("</details>") == 1
