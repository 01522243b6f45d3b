"""The one place secrets are taken out of text on its way to a terminal, a report or a file.

What counts as a secret (the kinds git's own redaction covers, and their neighbours):

- the user info of a URL, ``scheme://user:password@host`` (the password; for any scheme but
  ssh the whole user info, since ``https://TOKEN@github.com`` carries a token as the user).
  In text (git's lines, a report) everything between ``scheme://`` and the last @ before the
  host, so a password holding ``/ ? # @ + %`` unescaped (CodeCommit's) is masked whole. A
  source the user gave (``remember``, ``url_without_credentials``) is read as git reads it:
  its user info is what lies between ``scheme://`` and the first ``/ ? #`` after it (RFC
  3986's authority), when that part holds an @ (``file:///srv/a@b/x`` and
  ``https://host/a.git@b/x`` have none); one git would read otherwise than the user meant
  (``userinfo_problem``: a password holding ``/ ? # @`` unescaped) is refused, masked whole;
- a query (or ``;``, or fragment ``#``) parameter that carries a credential: ``?token=``, ``access_token``,
  ``private_token``, ``sig`` (Azure SAS), ``X-Amz-Signature``, ``X-Amz-Credential``,
  ``X-Amz-Security-Token``, ``X-Goog-Signature``, ``api_key``, ``password``, ... (any name
  ending in token, secret, pass, password, passwd, pwd, sig, signature, credential, key, auth,
  the name read as a server reads it: percent-decoded, ``+`` a space, case-folded, so
  ``tok%65n``, ``%74oken`` and ``ToKeN`` are ``token``; a name encoded twice, ``tok%2565n``,
  too; a part in brackets counts, ``user[password]``); its value to the next separator or
  white space, quotes inside it included;
- an HTTP header that does (``Authorization: Bearer …``, ``Proxy-Authorization``,
  ``Cookie``, ``Private-Token``, ``Job-Token``, ``X-…-Token``, ``X-…-Key``, ``Api-Key``), as git's
  ``GIT_TRACE_REDACT`` does: the scheme word stays, the rest goes.

Each is replaced by ``***``. ``redact`` takes a string, ``scrub`` anything a report holds
(strings inside dicts, lists, tuples and dataclasses), ``url_without_credentials`` gives a
URL fit to store (``remote.origin.url``): the user info removed, not masked.
"""

from __future__ import annotations

import dataclasses
import json
import re
import sys
import traceback
import urllib.parse

from .printable import printable

MASK = "***"

# scheme://userinfo@ — as curl reads ``user:p@ss@host``, greedy up to the last @ before the
# host. Two shapes: user info holding no ``/ ? #`` (the authority ends at the first of them:
# an @ after it is a path's), or ``user:`` followed by a password holding anything but
# white space, ``/ ? # @`` included (CodeCommit's generated passwords hold ``/`` and ``+``;
# git hands such a URL to curl as it is, and its error line quotes it). Quotes, ``<>`` and
# backticks belong to it: ``'`` is a sub-delim RFC 3986 allows there unescaped, and git hands
# ``"<>``` to curl as they are (a password ``it's`` works); stopping at them showed the rest.
_USERINFO = re.compile(r"(?P<scheme>\b[A-Za-z][A-Za-z0-9+.\-]*://)"
                       r"(?P<info>[^/?#\s@:]*:\S*|[^/?#\s]*)@")
_SSH = {"ssh", "git+ssh", "ssh+git"}
_WORD = re.compile(r"\S+")
# A source without a scheme typed ``user:password@host:path``: git reads host ``user`` and
# fails, but the rest up to the last @ before a ``host:`` is a password (it may hold ``: / @``;
# the path may hold an @).
_SCP = re.compile(r"(?P<user>[^:/@\s]+):(?P<pw>.+)@(?P<host>[^@:/\s]+):.*\Z", re.S)
# A query (``?``/``&``), ``;`` or fragment (``#``: OAuth's implicit flow returns
# ``#access_token=`` there) parameter: its name is any run of characters up to ``=`` that a
# server would read as a name, so the name can be judged as the server reads it
# (``_secret_name``), not as typed: ``tok%65n``, ``%74oken``, ``api+key`` are ``token`` and
# ``api key`` to it. Its value runs to the next separator; ``?`` does not end it (a secret
# value may hold one), yet a parameter that is no secret never hides one in its value
# (``_mask_parameters`` looks at every name).
_PARAMETER = re.compile(r"[?&;#](?P<name>[^=?&;#\s'\"<>`]+)=")
# A credential's value: to the next separator or white space, quotes and ``<>`` included (a
# quote inside it used to show the rest), but for those that close it (``'…?token=X'``).
_VALUE = re.compile(r"(?P<value>[^&;#\s]*?)['\"<>`]{0,8}(?=[&;#\s]|\Z)")
# A decoded, case-folded name (or a part of it in brackets, ``user[password]``) ending in one
# of these words is a credential's.
_SECRET_WORD = re.compile(r"(?:token|secret|pass|passw(?:or)?d|pwd|sig|signature|credential|key|auth)\Z")
# Rounds of percent-decoding a name is given: a server decodes once, but a name encoded twice
# (``tok%2565n``) is ``token`` to whatever decodes the URL once more on its way (a proxy, a
# redirect, a URL quoted inside another's parameter); masking it costs nothing.
_DECODE_ROUNDS = 4
_HEADER = re.compile(r"(?P<lead>\b(?i:(?:proxy-)?authorization|(?:set-)?cookie|private-token"
                     r"|job-token|api-key|x-[a-z0-9\-]{0,64}?(?:token|key|secret))"
                     r"\s*:\s*(?:(?i:basic|bearer|token|digest"
                     r"|negotiate)\s+)?)(?P<value>[^\s'\"<>`][^'\"<>`\n]*)")


# The user info of each source the user gave (``remember``), as literal text: masked
# wherever it shows, whatever characters it holds (a space, which ends ``_USERINFO``).
_REMEMBERED: dict[str, str] = {}
_SCHEME = re.compile(r"[A-Za-z][A-Za-z0-9+.\-]*://")


# What ends a URL's authority (RFC 3986, and git: ``credential.c``, curl): the first of these
# after ``scheme://``. git reads ``https://user:pa/ss@host/x`` as host ``user``, port ``pa``.
_AUTHORITY_END = re.compile(r"[/?#]")
# A host name as git (curl, ssh) reaches one: letters and digits of any script, ``. _ ~ -``.
_HOST = re.compile(r"[\w.~\-]*")


def _authority(url: str) -> tuple[str, str, str] | None:
    """(``scheme://``, authority, the rest from the first ``/ ? #`` after it on) of a URL;
    None for anything without ``scheme://`` (a path, an scp-like ``host:path``)."""
    scheme = _SCHEME.match(url)
    if not scheme:
        return None
    end = _AUTHORITY_END.search(url, scheme.end())
    cut = end.start() if end else len(url)
    return scheme[0], url[scheme.end():cut], url[cut:]


def _secret_info(scheme: str, info: str) -> bool:
    """Whether user info ``info`` of a ``scheme://`` URL is masked: a password (``user:pw``),
    or for any scheme but ssh the whole user info (``https://TOKEN@host``)."""
    return ":" in info or scheme[:-3].lower() not in _SSH


def userinfo_problem(url: str) -> str | None:
    """Why the tool cannot tell whether git reads the user info of the source ``url`` as the
    user meant it, or None. git (``credential.c``, curl) takes the user info from the
    authority only, up to its first @, the authority ending at the first ``/ ? #``: a
    password holding ``@`` unescaped (``user:p@ss@host``: curl refuses the URL), one holding
    ``/ ? #`` (``user:pa/ss@host``: host ``user``, port ``pa``; ``user:12/ab@host``: host
    ``user``, port 12), and user info followed by another @ (``user:p@s/s@host``) must be
    written with ``%40 %2F %3F %23``. Taken: an @ after a plain host name and a ``/``
    (``https://host/a.git@b/x``, ``file:///srv/a@b/x``: a path's, as git reads it), an @ after
    an ssh login name (``ssh://git@host/a@b``: no secret). What is taken is masked (``redact``)
    and stored (``url_without_credentials``) as git reads it."""
    parts = _authority(url)
    if parts is None:
        return None
    scheme, authority, rest = parts
    info, at, _host = authority.rpartition("@")
    if at and "@" in info:
        return ("its user info holds an '@' (git ends the user info at the first '@', curl "
                "refuses the URL): write an '@' in a user name or password as %40")
    if "@" not in rest:
        return None
    if at and _secret_info(scheme, info):
        return ("an '@' follows its host, so the tool cannot tell a password holding '@' or '/' "
                "from a path holding '@': write them in a password as %40 and %2F, or an '@' in "
                "the path as %40")
    if not at and not (_HOST.fullmatch(authority) and rest[0] == "/"):
        return (f"git reads its host as ending at the first '{rest[0]}', so the tool cannot tell a "
                f"password holding '/', '?' or '#' from a port or path followed by an '@': write "
                f"them in a password as %2F, %3F and %23, or an '@' in the path as %40")
    return None


def _userinfo(url: str) -> tuple[str, str, str] | None:
    """(``scheme://``, user info, the rest from the host on) of a source URL that has user
    info, read as git reads it: the authority's (what lies between ``scheme://`` and the
    first ``/ ? #`` after it) up to its @; none when the authority holds no @
    (``file:///srv/a@b/x``, ``https://host/a.git@b/x``: an @ of the path). A URL git would
    read otherwise than the user meant (``userinfo_problem``, refused as a source): all up
    to its last @, the widest reading, so whatever was meant as a password is masked."""
    parts = _authority(url)
    if parts is None:
        return None
    scheme, authority, rest = parts
    if userinfo_problem(url):
        info, _at, _host = url[len(scheme):].rpartition("@")
        return scheme, info, url[len(scheme) + len(info) + 1:]
    info, at, host = authority.rpartition("@")
    return (scheme, info, host + rest) if at else None


# The characters requests (pip) leaves as they are when it quotes a URL again (``requote_uri``).
_REQUOTE_SAFE = "!#$%&'()*+,/:;=?@[]~"


def _shown_forms(literal: str) -> set[str]:
    """``literal`` as any output may quote it: as it is; as ``repr``/``ascii`` (so
    ``unicode_escape`` too), ``printable`` and JSON write it (``\\x07``, ``\\n``,
    ``\\u2028``, ``\\xa0``, ``\\\\``, ``\\'``); as a shell quotes it (``'"'"'``); percent-
    encoded as requests does (``%20``). A message quoting the source with ``!r`` showed the
    password of ``https://user:pa ss\\x07@host`` (the escapes matched no remembered text)."""
    forms = {literal, printable(literal), literal.replace("'", "'\"'\"'"),
             json.dumps(literal)[1:-1], json.dumps(literal, ensure_ascii=False)[1:-1]}
    for errors in ("surrogateescape", "surrogatepass"):  # (argv's undecodable bytes, any other)
        try:
            forms.add(urllib.parse.quote(literal, safe=_REQUOTE_SAFE, errors=errors))
            break
        except UnicodeError:
            continue
    for escape in (repr, ascii):
        body = "".join(escape(c)[1:-1] for c in literal)
        forms |= {body, body.replace("'", "\\'")}
    return forms


def _remember_literal(literal: str, masked: str) -> None:
    """Mask ``literal`` from now on, as typed and percent-decoded, in each form it may be
    shown in (``_shown_forms``)."""
    for typed in {literal, urllib.parse.unquote(literal)}:
        for form in _shown_forms(typed):
            _REMEMBERED[form] = masked


# What may come before a source's ``scheme://`` in a refusal quoting it (``-https://…``).
_LEAD = re.compile(r"[-\s]*")


def remember(url: str) -> None:
    """Mask from now on the user info of ``url`` (a source the user gave) wherever it appears,
    as given and percent-decoded, escaped or not: ``https://user:pa ss@host`` is refused by
    curl, yet the message that says so must not show ``pa ss`` (nor ``pa ss\\x07``). Only
    user info that holds a password, or a user name of 8 characters or more (a token), is
    remembered: a short login name is no secret, and masking it everywhere would mangle
    unrelated text. The user info is git's reading (``_userinfo``: an @ in a path is none);
    where the tool cannot tell (``userinfo_problem``), the widest and git's. A URL after
    leading ``-`` or white space (refused, and quoted in the refusal) too."""
    url = url[_LEAD.match(url).end():]
    parts = _userinfo(url)
    scp = _SCP.match(url) if parts is None else None
    if scp:  # remembered as typed and percent-decoded, as a URL's user info is
        _remember_literal(f":{scp['pw']}@", f":{MASK}@")
        return
    if parts is None:
        return
    scheme, info, _rest = parts
    _remember_info(scheme, info)
    authority = _authority(url)[1]
    if "@" in authority:  # refused, yet what git would read is masked too
        _remember_info(scheme, authority.partition("@")[0])


def _remember_info(scheme: str, info: str) -> None:
    """Mask user info ``info`` of a ``scheme://`` URL from now on, if it is a secret: a
    password (ssh: the password only), or a user name of 8 characters or more (a token)."""
    ssh = scheme[:-3].lower() in _SSH
    _user, colon, password = info.partition(":")
    if ssh and colon:
        _remember_literal(f":{password}@", f":{MASK}@")
    elif not ssh and (colon or len(info) >= 8):
        _remember_literal(f"{info}@", f"{MASK}@")


def redact(text: str) -> str:
    """``text`` with every credential it holds replaced by ``***`` (see the module)."""
    if not isinstance(text, str) or not text:
        return text
    for literal in sorted(_REMEMBERED, key=len, reverse=True):
        text = text.replace(literal, _REMEMBERED[literal])
    text = _WORD.sub(lambda word: _masked_userinfos(word[0]), text)
    text = _mask_parameters(text)
    return _HEADER.sub(lambda m: m["lead"] + MASK, text)


def _secret_name(name: str) -> bool:
    """Whether a query, ``;`` or fragment parameter named ``name`` (as it is typed) carries a
    credential: ``name`` read as a server reads it (``urllib.parse.unquote_plus``: percent
    escapes decoded, ``+`` a space; decoded again while that changes it, up to
    ``_DECODE_ROUNDS`` times), case-folded, white space at its ends dropped, ends in a
    secret word (``_SECRET_WORD``)."""
    for _ in range(_DECODE_ROUNDS):
        decoded = urllib.parse.unquote_plus(name)
        if decoded == name:
            break
        name = decoded
    return any(_SECRET_WORD.search(part.strip().casefold()) for part in re.split(r"[\[\]]", name))


def _mask_parameters(text: str) -> str:
    """``text`` with the value of every credential parameter (``_secret_name``) replaced by
    ``***``, its name kept as typed. Each parameter is judged, so a parameter that is no
    secret and whose value holds a ``?`` (``?next=/a?token=X``) leaves the one after it to
    be masked; a name inside a value already masked is not looked at again."""
    kept, end = [], 0
    for parameter in _PARAMETER.finditer(text):
        if parameter.start() < end or not _secret_name(parameter["name"]):
            continue
        value = _VALUE.match(text, parameter.end())
        if value is None or not value["value"]:  # ``token=`` with nothing after it: nothing to hide
            continue
        kept += [text[end:parameter.end()], MASK]
        end = value.end("value")
    kept.append(text[end:])
    return "".join(kept)


def _masked_userinfos(word: str) -> str:
    """``_USERINFO`` masked in one white-space-free ``word`` (a match holds no white space),
    looked for only up to the word's last ``@`` (a match ends at one): linear, where the
    pattern alone takes quadratic time on a long word of ``a://`` with no ``@`` after them."""
    at = word.rfind("@")
    if at < 0 or "://" not in word:
        return word
    return _USERINFO.sub(_masked_userinfo, word[:at + 1]) + word[at + 1:]


def _masked_userinfo(match: re.Match) -> str:
    scheme, info = match["scheme"], match["info"]
    if scheme[:-3].lower() in _SSH:  # ssh://git@host is a login name, not a secret
        user, colon, _password = info.partition(":")
        return f"{scheme}{user}{':' + MASK if colon else ''}@"
    return f"{scheme}{MASK}@"


def scrub(value):
    """``value`` with ``redact`` applied to every string in it (``map_strings``): a new
    object, ``value`` itself is left alone. Renderers scrub the values they render, never
    their serialized text: a mask put into JSON or XML text can swallow its escapes."""
    return map_strings(value, redact)


def map_strings(value, fn):
    """``value`` with ``fn`` applied to every string in it (dict keys and values, list,
    tuple and dataclass members); a new object, ``value`` itself is left alone."""
    if isinstance(value, str):
        return fn(value)
    if isinstance(value, dict):
        return {map_strings(k, fn): map_strings(v, fn) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(map_strings(v, fn) for v in value)
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        fields = {f.name: map_strings(getattr(value, f.name), fn) for f in dataclasses.fields(value)
                  if f.init}
        return dataclasses.replace(value, **fields)
    return value


def url_without_credentials(url: str) -> str:
    """``url`` with its user info's password (ssh) or whole user info (any other scheme)
    removed, for storing: ``https://user:pw@host/x`` -> ``https://host/x``,
    ``ssh://git:pw@host/x`` -> ``ssh://git@host/x``; the user info is read as git reads it
    (``_userinfo``: the authority's; ``file:///srv/a@b/x`` and ``https://host/a.git@b/x``
    have none and are kept whole), whatever characters it holds. A path as it is; an
    scp-like ``user:password@host:path`` (git reads host ``user``) with its password masked."""
    parts = _userinfo(url)
    scp = _SCP.match(url) if parts is None else None
    if parts is not None:
        scheme, info, rest = parts
        kept = info.partition(":")[0] + "@" if scheme[:-3].lower() in _SSH else ""
        url = f"{scheme}{kept}{rest}"
    elif scp:
        url = f"{scp['user']}:{MASK}@{url[scp.end('pw') + 1:]}"
    return _mask_parameters(url)


class Stream:
    """A text stream that redacts what is written to it: what a console prints goes through
    ``redact`` whatever built the line. ``current`` gives the stream at each write (so a
    ``sys.stderr`` replaced later, by a test or a pager, is the one written to)."""

    def __init__(self, current) -> None:
        self._current = current

    def write(self, text: str) -> int:
        return self._current().write(redact(text))

    def __getattr__(self, name: str):  # isatty, fileno, flush, encoding, ...
        return getattr(self._current(), name)


def excepthook(kind, value, tb) -> None:
    """``sys.excepthook`` of the entry points: a bug's traceback is the one text the tool does
    not print itself, and its messages may quote a URL with a password; it goes through
    ``redact`` too."""
    sys.stderr.write(redact("".join(traceback.format_exception(kind, value, tb))))


def for_terminal(value):
    """``value`` (a string, or a report: any structure ``map_strings`` walks) redacted, then
    made printable (``printable``): what ``write_human``, progress and the error lines print."""
    return map_strings(value, lambda text: printable(redact(text)))
