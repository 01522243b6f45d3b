"""The one place secrets are taken out of text on its way to a terminal, a report or a file.

What counts as a secret (the kinds git's own redaction covers, and their neighbours):

- the user info of a URL, ``scheme://user:password@host`` (the password; for any scheme but
  ssh the whole user info, since ``https://TOKEN@github.com`` carries a token as the user):
  everything between ``scheme://`` and the last @ before the host, so a password holding
  ``/ ? # @ + %`` unescaped (CodeCommit's) is masked whole;
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
import re
import sys
import traceback
import urllib.parse

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
# fails, but the rest up to the @ before the host is a password (it may hold ``: / @``).
_SCP = re.compile(r"(?P<user>[^:/@\s]+):(?P<pw>.+)@(?P<host>[^@:/\s]+):[^@]*\Z", re.S)
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


def _userinfo(url: str) -> tuple[str, str, str] | None:
    """(``scheme://``, user info, the rest from the host on) of a URL that has user info:
    everything between ``scheme://`` and the last @ of the URL, whatever the characters
    (``https://user:a/b?c#d@host/x``: a password holding ``/ ? #`` unescaped, which git hands
    to curl as it is). A source URL given with an @ in its path must write it ``%40``."""
    scheme = _SCHEME.match(url)
    if not scheme:
        return None
    info, at, _host = url[scheme.end():].rpartition("@")
    return (scheme[0], info, url[scheme.end() + len(info) + 1:]) if at else None


def remember(url: str) -> None:
    """Mask from now on the user info of ``url`` (a source the user gave) wherever it appears,
    as given and percent-decoded: ``https://user:pa ss@host`` is refused by curl, yet the
    message that says so must not show ``pa ss``. Only user info that holds a password, or
    a user name of 8 characters or more (a token), is remembered: a short login name is
    no secret, and masking it everywhere would mangle unrelated text."""
    parts = _userinfo(url)
    scp = _SCP.match(url) if parts is None else None
    if scp:  # remembered as typed and percent-decoded, as a URL's user info is
        for form in {f":{scp['pw']}@", urllib.parse.unquote(f":{scp['pw']}@")}:
            _REMEMBERED[form] = f":{MASK}@"
        return
    if parts is None:
        return
    scheme, info, _rest = parts
    ssh = scheme[:-3].lower() in _SSH
    _user, colon, password = info.partition(":")
    if ssh and colon:
        literal, masked = f":{password}@", f":{MASK}@"
    elif not ssh and (colon or len(info) >= 8):
        literal, masked = f"{info}@", f"{MASK}@"
    else:
        return
    for form in {literal, urllib.parse.unquote(literal)}:
        _REMEMBERED[form] = masked


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
    ``ssh://git:pw@host/x`` -> ``ssh://git@host/x``; the user info is read as git reads it,
    whatever characters it holds. A path or scp-like address as it is."""
    parts = _userinfo(url)
    if parts is not None:
        scheme, info, rest = parts
        kept = info.partition(":")[0] + "@" if scheme[:-3].lower() in _SSH else ""
        url = f"{scheme}{kept}{rest}"
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
