"""No secret reaches any output: terminal, reports (JSON, JUnit, markdown) or the checkout.

The source URL carries ``user:SECRET@`` (or a token in its query). A ``url.<path>.insteadOf``
in a test-made global config sends git to the synthetic upstream, so every step runs for
real (clone, fetch, publish) with the credentialed URL as the one the user gave.
"""

from __future__ import annotations

import json
import socket
from pathlib import Path

import pytest

from k3overlay import cli, errors
from k3overlay.redact import redact, scrub, url_without_credentials

from .test_rebase import load_ci_rebase

SECRET = "S3cr3tT0ken"


def _closed_port() -> int:
    with socket.socket() as s:  # bound, never listening: a connection is refused at once
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _user_git_config(tmp_path: Path, monkeypatch, text: str) -> None:
    """``text`` as the user's only git config (``~/.gitconfig`` of a HOME under ``tmp_path``)."""
    config = tmp_path / "home" / ".gitconfig"
    config.parent.mkdir()
    config.write_text(text)
    monkeypatch.setenv("HOME", str(config.parent))
    monkeypatch.setenv("GIT_CONFIG_GLOBAL", str(config))
    monkeypatch.setenv("GIT_CONFIG_NOSYSTEM", "1")
    monkeypatch.setenv("XDG_CONFIG_HOME", str(config.parent / ".config"))


@pytest.fixture
def secret_url(upstream, tmp_path, monkeypatch) -> str:
    """An https URL with a password in it, which the user's git config maps to ``upstream``."""
    url = f"https://user:{SECRET}@127.0.0.1:{_closed_port()}/up.git"
    _user_git_config(tmp_path, monkeypatch, f'[url "{upstream}"]\n\tinsteadOf = {url}\n')
    return url


def _leaks(folder: Path) -> list[str]:
    """Files under ``folder`` whose bytes hold the secret (the test's own git config aside)."""
    return [str(p) for p in folder.rglob("*") if p.is_file() and "home" not in p.relative_to(folder).parts
            and SECRET.encode() in p.read_bytes()]


@pytest.mark.parametrize("text, kept", [
    (f"cloning https://user:{SECRET}@h:1/up.git into /w", "https://***@h:1/up.git"),
    (f"https://{SECRET}@github.com/o/r.git", "https://***@github.com/o/r.git"),
    (f"http://u:p@{SECRET}@h/x", "http://***@h/x"),  # the last @ before the path ends it
    (f"ssh://git:{SECRET}@h/x", "ssh://git:***@h/x"),
    (f"fatal: unable to access 'https://u:{SECRET}@h/': refused", "'https://***@h/'"),
    (f"https://h/x.git?private_token={SECRET}&a=1", "?private_token=***&a=1"),
    (f"https://s3/x?X-Amz-Credential={SECRET}&X-Amz-Signature={SECRET}",
     "X-Amz-Credential=***&X-Amz-Signature=***"),
    (f"https://blob/x?sv=1&sig={SECRET}", "sv=1&sig=***"),
    (f"https://h/x?access_token={SECRET}", "access_token=***"),
    (f"Authorization: Bearer {SECRET}", "Authorization: Bearer ***"),
    (f"http.extraHeader=Authorization: Basic {SECRET}", "Basic ***"),
    (f"PRIVATE-TOKEN: {SECRET}", "PRIVATE-TOKEN: ***"),
    (f"Cookie: session={SECRET}", "Cookie: ***"),
    # round 3: the query kind's neighbours (a fragment, ';', a percent-encoded name), key headers
    (f"https://h/cb#access_token={SECRET}&state=1", "#access_token=***&state=1"),
    (f"https://h/x?a=1;token={SECRET}", ";token=***"),
    (f"https://h/x?access%5Ftoken={SECRET}", "access%5Ftoken=***"),
    (f"X-Api-Key: {SECRET}", "X-Api-Key: ***"),
    (f"x-goog-api-key: {SECRET}", "x-goog-api-key: ***"),
    (f"Api-Key: {SECRET}", "Api-Key: ***"),
])
def test_each_kind_of_secret_is_masked(text, kept):
    assert SECRET not in redact(text) and kept in redact(text)


@pytest.mark.parametrize("text", ["ssh://git@github.com/o/r.git", "git@github.com:o/r.git",
                                  "/tmp/a@b/up.git", "https://github.com/o/r@v1",
                                  "pkg/model.txt:4-9", "ref 'v1.0.0' not found",
                                  "alice@host:o/r.git", "a/b:c@d:e"])
def test_text_without_secrets_is_left_as_it_is(text):
    assert redact(text) == text


@pytest.mark.parametrize("pw", ["s3cr3tpass", "pa/ss", "pa:ss", "ab+c/d==", "p@ss"])
def test_the_password_of_an_scp_like_source_is_masked_once_remembered(pw, monkeypatch):
    """Round 5: ``user:password@host:path`` (git reads host ``user``): the password showed in
    the console and the reports, whatever it holds; ordinary text with a colon and an @
    is never masked (only the source the user gave is remembered)."""
    import k3overlay.redact as redact_mod

    monkeypatch.setattr(redact_mod, "_REMEMBERED", {})
    source = f"alice:{pw}@host:o/r.git"
    redact_mod.remember(source)
    out = redact(f"cloning {source} into /w; fatal: '{source}' does not appear to be a git repository")
    assert pw not in out and out.count("alice:***@host:o/r.git") == 2
    assert redact("12:30@host: v1:abcdef@HEAD:pkg/x.py") == "12:30@host: v1:abcdef@HEAD:pkg/x.py"


def test_scrub_reaches_every_string_of_a_report():
    from k3overlay.report import Report
    from k3overlay.series import PatchResult
    from k3overlay.stages import Problem, Section, TestRun

    report = Report("1", "b", f"https://u:{SECRET}@h/x", error=f"in https://u:{SECRET}@h/x",
                    patches=[PatchResult("p", "conflict", [f"?token={SECRET}"])],
                    notes=[f"Authorization: token {SECRET}"],
                    runs=[TestRun(env_error=f"?sig={SECRET}",
                                  problems=[Problem("t", f"https://u:{SECRET}@h")])],
                    sections=[Section("ab", "gpu a/b", [f"?token={SECRET}"], {"url": f"https://u:{SECRET}@h"})])
    assert SECRET not in repr(scrub(report)) and SECRET in repr(report)  # a copy; the original stays


def test_a_stored_url_keeps_no_credentials():
    assert url_without_credentials(f"https://u:{SECRET}@h/x.git") == "https://h/x.git"
    assert url_without_credentials(f"ssh://git:{SECRET}@h/x.git") == "ssh://git@h/x.git"
    assert url_without_credentials("/srv/vllm.git") == "/srv/vllm.git"


def test_apply_with_a_password_in_the_url_puts_it_nowhere(project, secret_url, tmp_path, monkeypatch,
                                                          capsys):
    monkeypatch.setattr(cli, "Project", lambda: project)
    wd, report = tmp_path / "wd", tmp_path / "report.json"
    assert cli.main(["--vllm-repo", secret_url, "--vllm-ref", "v1.1.0", "--workdir", str(wd),
                     "--json", str(report)]) == errors.OK
    assert cli.main(["--vllm-repo", secret_url, "--vllm-ref", "nosuch", "--workdir", str(wd),
                     "--json", str(tmp_path / "error.json")]) == errors.USAGE
    out, err = capsys.readouterr()
    assert "cloning https://***@127.0.0.1" in err and "not found in https://***@127.0.0.1" in err
    assert SECRET not in out + err
    assert "not found in https://***@" in json.loads((tmp_path / "error.json").read_text())["error"]
    # the published checkout: config (remote.origin.url), reflogs, FETCH_HEAD, everything
    assert _leaks(tmp_path) == []
    assert (wd / ".git" / "config").read_text().count("url = https://127.0.0.1:") == 1


def test_check_and_an_unreachable_url_with_a_token_leak_nothing(project, tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(cli, "Project", lambda: project)
    url = f"https://127.0.0.1:{_closed_port()}/up.git?private_token={SECRET}"
    code = cli.main(["--vllm-repo", url, "--workdir", str(tmp_path / "wd"), "--check",
                     "--json", str(tmp_path / "r.json")])
    out, err = capsys.readouterr()
    assert code == errors.SOURCE and "cannot reach the vLLM source" in err
    assert SECRET not in out + err and _leaks(tmp_path) == []
    assert json.loads((tmp_path / "r.json").read_text())["error"].startswith("cannot reach")


def test_rebase_job_reports_leak_nothing_and_keep_every_ref(project, secret_url, tmp_path, monkeypatch,
                                                            capsys):
    ci_rebase = load_ci_rebase()
    monkeypatch.setattr(ci_rebase, "Project", lambda: project)
    outs = [tmp_path / "out.json", tmp_path / "out.xml", tmp_path / "out.md"]
    code = ci_rebase.main(["--onto", "nosuch", "--onto", "v1.1.0", "--vllm-repo", secret_url,
                           "--no-tests", "--json", str(outs[0]), "--junit", str(outs[1]),
                           "--markdown", str(outs[2])])
    out, err = capsys.readouterr()
    assert code == errors.USAGE and SECRET not in out + err and _leaks(tmp_path) == []
    first, second = json.loads(outs[0].read_text())
    assert "not found in https://***@127.0.0.1" in first["error"] and second["ok"]
    assert "https://***@" in outs[1].read_text() and "https://***@" in outs[2].read_text()


def test_rebase_job_whose_source_is_unreachable_still_writes_every_report(project, tmp_path,
                                                                          monkeypatch, capsys):
    ci_rebase = load_ci_rebase()
    monkeypatch.setattr(ci_rebase, "Project", lambda: project)
    url = f"https://user:{SECRET}@127.0.0.1:{_closed_port()}/up.git"
    outs = [tmp_path / "out.json", tmp_path / "out.xml", tmp_path / "out.md"]
    code = ci_rebase.main(["-q", "--onto", "v1.1.0", "--onto", "v1.2.0", "--vllm-repo", url,
                           "--json", str(outs[0]), "--junit", str(outs[1]), "--markdown", str(outs[2])])
    out, err = capsys.readouterr()
    assert code == errors.SOURCE and SECRET not in out + err and _leaks(tmp_path) == []
    reports = json.loads(outs[0].read_text())
    assert [r["ref"] for r in reports] == ["v1.1.0", "v1.2.0"]
    assert all(r["error"].startswith("cannot reach the vLLM source") for r in reports)
    # Stopped before any target, each report still names the pinned base (apply.py's too).
    base = json.loads((project.root / "overlay.json").read_text())["base"]
    assert base and all(r["base_ref"] == base for r in reports)
    assert outs[1].read_text().count("<error") == 2 and "cannot reach" in outs[2].read_text()


def test_a_usage_error_quoting_a_secret_is_masked(project, monkeypatch, capsys):
    monkeypatch.setattr(cli, "Project", lambda: project)
    with pytest.raises(SystemExit):
        cli.main(["--build-wheel", "--wheel-build", f"https://u:{SECRET}@h/x"])
    err = capsys.readouterr().err
    assert "invalid choice: 'https://***@h/x'" in err and SECRET not in err


def test_a_secret_in_vllm_repo_from_the_environment_or_in_a_ref_is_masked(project, secret_url, tmp_path,
                                                                          monkeypatch, capsys):
    monkeypatch.setattr(cli, "Project", lambda: project)
    monkeypatch.setenv("VLLM_REPO", secret_url)
    report = tmp_path / "r.json"
    assert cli.main(["--check", "--workdir", str(tmp_path / "wd"), "--vllm-ref", "v1.1.0",
                     "--json", str(report)]) == errors.OK
    assert cli.main(["--check", "--workdir", str(tmp_path / "wd"), "--vllm-ref",
                     f"https://u:{SECRET}@h/x", "--json", str(report)]) == errors.USAGE
    out, err = capsys.readouterr()
    assert "cloning https://***@" in err and "bad ref 'https://***@h/x'" in err
    assert SECRET not in out + err and _leaks(tmp_path) == []


def test_a_secret_in_what_git_itself_says_is_masked(project, upstream, tmp_path, monkeypatch, capsys):
    # the user's insteadOf sends git to a credentialed URL that refuses: git's own message names it
    _user_git_config(tmp_path, monkeypatch, f'[url "https://user:{SECRET}@127.0.0.1:{_closed_port()}/"]\n'
                                            f'\tinsteadOf = https://mirror.invalid/\n')
    monkeypatch.setattr(cli, "Project", lambda: project)
    code = cli.main(["--workdir", str(tmp_path / "wd"), "--vllm-repo", "https://mirror.invalid/up.git",
                     "--json", str(tmp_path / "r.json")])
    out, err = capsys.readouterr()
    assert code == errors.SOURCE and SECRET not in out + err and _leaks(tmp_path) == []


@pytest.mark.parametrize("password", [f"it's{SECRET}", f'a"{SECRET}', f"<{SECRET}>", f"a`{SECRET}",
                                      f"pa ss{SECRET}", f"pa%20ss{SECRET}"])
def test_a_password_with_quotes_or_spaces_is_masked_everywhere(project, upstream, password, tmp_path,
                                                               monkeypatch, capsys):
    # RFC 3986 allows ' in user info unescaped and git hands "<>` to curl as they are (the
    # masking used to stop at them and show the rest); a space, which curl refuses, is still
    # what the user meant as a password: the source's user info is masked as given
    url = f"https://user:{password}@127.0.0.1:{_closed_port()}/up.git"
    _user_git_config(tmp_path, monkeypatch,
                     f'[url "{upstream}"]\n\tinsteadOf = {url.replace(chr(34), chr(92) + chr(34))}\n')
    monkeypatch.setattr(cli, "Project", lambda: project)
    wd = tmp_path / "wd"
    assert cli.main(["--vllm-repo", url, "--vllm-ref", "v1.1.0", "--workdir", str(wd),
                     "--json", str(tmp_path / "r.json")]) == errors.OK
    assert cli.main(["--vllm-repo", url, "--vllm-ref", "nosuch", "--workdir", str(wd),
                     "--json", str(tmp_path / "e.json")]) == errors.USAGE
    out, err = capsys.readouterr()
    assert "cloning https://***@127.0.0.1" in err and SECRET not in out + err
    assert _leaks(tmp_path) == []  # reports, and the checkout's config


@pytest.mark.parametrize("text, kept", [
    (f"fatal: 'https://u:it's{SECRET}@h/x' refused", "'https://***@h/x'"),
    (f"<https://u:<{SECRET}>@h/x>", "<https://***@h/x>"),
    (f"https://u:{SECRET}\"@h/x", "https://***@h/x"),
])
def test_quote_like_characters_do_not_end_a_password(text, kept):
    assert SECRET not in redact(text) and kept in redact(text)


def test_a_token_in_the_query_reaches_no_file_of_the_checkout(project, upstream, tmp_path, monkeypatch,
                                                              capsys):
    # git's own anonymising takes user info only: a query token went into the clone's reflog
    # ("clone: from URL") and, fetching into the checkout, into FETCH_HEAD and its reflogs
    url = f"https://127.0.0.1:{_closed_port()}/up.git?private_token={SECRET}"
    _user_git_config(tmp_path, monkeypatch, f'[url "{upstream}"]\n\tinsteadOf = {url}\n')
    monkeypatch.setattr(cli, "Project", lambda: project)
    wd = tmp_path / "wd"
    for ref in ("v1.1.0", "main", "v1.2.0"):
        cli.main(["--vllm-repo", url, "--vllm-ref", ref, "--workdir", str(wd)])
    out, err = capsys.readouterr()
    assert SECRET not in out + err and (wd / ".git" / "FETCH_HEAD").exists()
    assert _leaks(tmp_path) == []


@pytest.mark.parametrize("entry", ["apply.py", "ci/rebase.py"])
def test_the_traceback_of_a_bug_is_masked_too(tmp_path, entry):
    # a traceback is the one text the tool does not print itself; an exception quoting the
    # source URL printed its password
    import subprocess
    import sys
    url = f"https://user:{SECRET}@127.0.0.1:{_closed_port()}/up.git"
    boom = ("import runpy, sys; from k3overlay import source\n"
            "URL = sys.argv[-1]\n"
            "def locate(*a, **k): raise RuntimeError('a bug while fetching ' + URL)\n"
            "source.locate = locate\n"
            f"sys.argv = [{entry!r}, '--vllm-repo', URL] + (['--onto', 'v0.28.0', '--no-tests']"
            f" if 'rebase' in {entry!r} else ['--workdir', {str(tmp_path / 'wd')!r}])\n"
            f"runpy.run_path({entry!r}, run_name='__main__')\n")
    run = subprocess.run([sys.executable, "-c", boom, url], cwd=Path(__file__).resolve().parent.parent,
                         capture_output=True, text=True, timeout=120)
    assert "RuntimeError: a bug while fetching https://***@127.0.0.1" in run.stderr, run.stderr[-2000:]
    assert SECRET not in run.stdout + run.stderr


@pytest.mark.parametrize("text, kept", [
    # a server percent-decodes a parameter's name (and reads + as a space) before it looks at it:
    # each of these is ``token``/``access_token`` to it (urllib.parse.parse_qs says so)
    (f"https://h/x?tok%65n={SECRET}", "?tok%65n=***"),
    (f"https://h/x?%74oken={SECRET}&a=1", "?%74oken=***&a=1"),
    (f"https://h/x?a=1&access_t%6Fken={SECRET}", "&access_t%6Fken=***"),
    (f"https://h/x?private_%74oken={SECRET}", "?private_%74oken=***"),
    (f"https://h/x?%54%4F%4B%45%4E={SECRET}", "?%54%4F%4B%45%4E=***"),
    (f"https://h/x?api+key={SECRET}", "?api+key=***"),
    (f"https://h/x?ToKeN={SECRET}", "?ToKeN=***"),
    # its neighbours: a fragment, ';', an ssh or scp-like source, a double-encoded name (masked:
    # a layer that decodes once more, a proxy or a redirect, hands ``token`` on)
    (f"https://h/cb#acc%65ss_token={SECRET}", "#acc%65ss_token=***"),
    (f"https://h/x?a=1;tok%65n={SECRET}", ";tok%65n=***"),
    (f"ssh://git@h/x.git?tok%65n={SECRET}", "?tok%65n=***"),
    (f"git@h:o/x.git?tok%65n={SECRET}", "?tok%65n=***"),
    (f"https://h/x?tok%2565n={SECRET}", "?tok%2565n=***"),
    # a parameter that is no secret does not hide one after it, whatever its value holds
    (f"https://h/x?next=/a?tok%65n={SECRET}", "?tok%65n=***"),
    (f"https://h/x?next=/a?token={SECRET}", "?token=***"),
    # the review of round 6: a name in brackets (PHP's and Rails' form fields), ``pass``, and a
    # quote inside a value (the rest of the value used to show)
    (f"https://h/x?user[password]={SECRET}", "?user[password]=***"),
    (f"https://h/x?user%5Bpassword%5D={SECRET}", "?user%5Bpassword%5D=***"),
    (f"https://h/x?access_token[]={SECRET}", "?access_token[]=***"),
    (f"https://h/x?pass={SECRET}", "?pass=***"),
    (f"https://h/x?token=ab'{SECRET}", "?token=***"),
    (f"https://h/x?token='{SECRET}'", "?token=***'"),
    (f"'https://h/x?token={SECRET}' failed", "?token=***' failed"),
])
def test_a_percent_encoded_or_mixed_case_credential_name_is_masked(text, kept):
    # round 6: the name was matched as raw text, so only ``%5F`` (which the pattern allowed inside
    # a name) was masked: ``tok%65n=SECRET`` reached the console and the reports
    assert SECRET not in redact(text) and kept in redact(text)
    assert SECRET not in url_without_credentials(text)


@pytest.mark.parametrize("text", ["https://h/x?to%6Ben_count=3&author=ann", "https://h/x?q=a%26b&page=2",
                                  "see #12=ok", "https://h/x?design=1&monkey%2Dwrench=2x"])
def test_a_decoded_name_that_is_no_secret_is_left_as_it_is(text):
    assert redact(text) == text and url_without_credentials(text) == text


def test_apply_with_a_percent_encoded_token_name_leaks_nothing(project, tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(cli, "Project", lambda: project)
    url = f"https://127.0.0.1:{_closed_port()}/up.git?tok%65n={SECRET}"
    code = cli.main(["--vllm-repo", url, "--workdir", str(tmp_path / "wd"),
                     "--json", str(tmp_path / "r.json")])
    out, err = capsys.readouterr()
    assert code == errors.SOURCE and "?tok%65n=***" in err
    assert SECRET not in out + err and _leaks(tmp_path) == []


# Round 10: a source whose password holds a space and a control character (or an scp-like one
# holding a line feed) was refused with the source quoted by ``!r``: its escapes (``\x07``,
# ``\n`` as text) matched no remembered form and the space ended the URL, so the password
# reached the error line and --json's ``error``.
ESCAPED = [f"{SECRET} Tok\x07", f"{SECRET}\tTok \x1b", f"pa ss\u2028{SECRET}", f"a\xa0{SECRET} \x01",
           f"it's {SECRET}\x7f", f"{SECRET} \\ \x85"]

def _run_with_source(project, tmp_path, monkeypatch, capsys, given: str, url: str):
    """apply.py with ``url`` as ``given`` (``--vllm-repo`` or ``$VLLM_REPO``) and ``--json``:
    (exit code, stdout, stderr, the JSON report's ``error``)."""
    monkeypatch.setattr(cli, "Project", lambda: project)
    args = ["--workdir", str(tmp_path / "wd"), "--json", str(tmp_path / "r.json")]
    if given == "--vllm-repo":
        args.append(f"--vllm-repo={url}")  # (a leading - is a value, not an option)
    else:
        monkeypatch.setenv("VLLM_REPO", url)
    code = cli.main(args)
    out, err = capsys.readouterr()
    return code, out, err, json.loads((tmp_path / "r.json").read_text())["error"]



@pytest.mark.parametrize("password", ESCAPED)
@pytest.mark.parametrize("given", ["--vllm-repo", "$VLLM_REPO"])

@pytest.mark.parametrize("shape, shown", [
    ("https://user:{pw}@127.0.0.1:1/x.git", "'https://***@127.0.0.1:1/x.git'"),
    ("https://{pw}@127.0.0.1:1/x.git", "'https://***@127.0.0.1:1/x.git'"),
    ("user:{pw}@host:path", "'user:***@host:path'"),
    ("-https://user:{pw}@127.0.0.1:1/x.git", "'-https://***@127.0.0.1:1/x.git'"),
    ("ssh://git:{pw}@h/x.git", "'ssh://git:***@h/x.git'"),
])
def test_a_refusal_quoting_the_source_masks_its_escaped_password(project, tmp_path, monkeypatch, capsys,
                                                                 password, given, shape, shown):
    import k3overlay.redact as redact_mod

    monkeypatch.setattr(redact_mod, "_REMEMBERED", {})  # what another test's source left
    url = shape.format(pw=password)
    code, out, err, error = _run_with_source(project, tmp_path, monkeypatch, capsys, given, url)
    assert code == errors.USAGE and len(err.splitlines()) == 1, err
    assert SECRET not in out + err + error and _leaks(tmp_path) == []
    assert f"error: {given} {shown} is not a URL or a path" in err and error.startswith(f"{given} {shown}")


@pytest.mark.parametrize("password", ESCAPED + [f"p/a?s#s@{SECRET}\x1b", f"{SECRET}%0A"])
def test_every_escaped_form_of_a_remembered_password_is_masked(password, monkeypatch):
    import k3overlay.redact as redact_mod
    from k3overlay.printable import printable

    monkeypatch.setattr(redact_mod, "_REMEMBERED", {})
    for url in (f"https://user:{password}@h/x", f"alice:{password}@host:o/r.git"):
        redact_mod.remember(url)
        for shown in (url, repr(url), ascii(url), repr(url + '"'), json.dumps(url),
                      json.dumps(url, ensure_ascii=False), url.encode("unicode_escape").decode(),
                      printable(url), repr(url.replace("%0A", "\n"))):
            assert SECRET not in redact(f"error: {shown} refused"), shown


@pytest.mark.parametrize("url", ["file:///srv/at@dir/mirror.git", "https://host/a/b.git@other.example/x",
                                 "ssh://git@host/a/b@v2.git", "ssh://git@host:22/a@b", "file://localhost/s@t/x",
                                 "git://host/o/r.git@v1", "https://bücher.example/a@b"])
def test_an_at_in_a_source_path_is_no_user_info(url, monkeypatch):
    # round 10: user info was everything up to the URL's last @; git reads it from the
    # authority only (up to the first / after scheme://): the path was shown as masked
    # credentials ("file://***@dir/…") and stored as the host (remote.origin.url
    # "file://dir/mirror.git", "https://other.example/x": a later fetch went elsewhere)
    import k3overlay.redact as redact_mod

    monkeypatch.setattr(redact_mod, "_REMEMBERED", {})
    redact_mod.remember(url)
    assert url_without_credentials(url) == url
    assert redact(f"cloning {url} into /w") == f"cloning {url} into /w"
    assert redact_mod.userinfo_problem(url) is None


@pytest.mark.parametrize("url, stored", [
    (f"alice:{SECRET}@host:o/r.git", "alice:***@host:o/r.git"),
    (f"alice:p@{SECRET}@host:o/r.git", "alice:***@host:o/r.git"),
    (f"alice:{SECRET}@host:o/r@v2.git", "alice:***@host:o/r@v2.git"),
])
def test_the_reported_form_of_an_scp_like_source_masks_its_password(url, stored, monkeypatch):
    # the rebase job's reports name the source through ``url_without_credentials`` (before the
    # source is checked, a bad ref refused first): an scp-like source's password was kept
    import k3overlay.redact as redact_mod

    assert url_without_credentials(url) == stored
    monkeypatch.setattr(redact_mod, "_REMEMBERED", {})
    redact_mod.remember(url)
    assert SECRET not in redact(f"fatal: '{url}' does not appear to be a git repository")


# What git (curl) does with each, tried with ``git ls-remote`` against a local server:
# ``user:p@ss@h`` "URL using bad/illegal format" (and git's own message showed ``ss@h``);
# ``user:pa/ss@h`` host ``user``, port ``pa``: bad format; ``user:p?ss@h``, ``user:p#ss@h``:
# bad format; ``h:8443/a@b`` is host h (a password ``8443/a`` for user ``h`` reads the same).
UNTELLABLE = {
    "an @ in the password": ("https://user:p@{s}@127.0.0.1:{port}/x.git", "%40"),
    "a / in the password": ("https://user:Ab/cd+{s}@127.0.0.1:{port}/x.git", "%2F"),
    "a ? in the password": ("https://user:p?{s}@127.0.0.1:{port}/x.git", "%3F"),
    "a # in the password": ("https://user:p#{s}@127.0.0.1:{port}/x.git", "%23"),
    "an @ and a / in the password": ("https://user:p@a/{s}@127.0.0.1:{port}/x.git", "%40 and %2F"),
    "a password of digits and /": ("https://user:12/{s}@127.0.0.1:{port}/x.git", "%2F"),
    "a token holding ?": ("https://tok?{s}@127.0.0.1:{port}/x.git", "%3F"),
    "an ssh password holding /": ("ssh://git:p/{s}@127.0.0.1:{port}/x.git", "%2F"),
    "an @ in the path after user info": ("https://user:{s}@127.0.0.1:{port}/x@y.git", "%40"),
    "a port and an @ in the path": ("https://127.0.0.1:{port}/{s}@x.git", "%40"),
}


@pytest.mark.parametrize("case", sorted(UNTELLABLE))
@pytest.mark.parametrize("given", ["--vllm-repo", "$VLLM_REPO"])
def test_user_info_git_would_read_otherwise_is_refused_in_one_line(project, tmp_path, monkeypatch, capsys,
                                                                  case, given):
    shape, escape = UNTELLABLE[case]
    url = shape.format(s=SECRET, port=_closed_port())
    code, out, err, error = _run_with_source(project, tmp_path, monkeypatch, capsys, given, url)
    assert code == errors.USAGE and len(err.splitlines()) == 1, err
    assert f"error: {given} '{url[:6]}" in err and "***@" in err and escape in err, err
    assert SECRET not in out + err + error and _leaks(tmp_path) == []
    assert not (tmp_path / "wd").exists()
