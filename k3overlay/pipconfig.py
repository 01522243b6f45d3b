"""The package index as pip sees it: pip's own configuration, read by pip.

A user whose ``pip download vllm==X`` works must find the tool reaches the same index the
same way, with no extra setting. So the settings come from ``python -m pip config list``
(pip reads its files, ``$PIP_CONFIG_FILE`` and ``PIP_*`` variables in its own order), and
the requests session trusts what pip trusts: pip's ``cert`` (a company CA bundle) when set,
else the system trust store (``truststore``, as pip >= 24.2 does), never certifi's list
alone. What is honoured: ``index-url``, ``extra-index-url``, ``no-index``, ``cert``,
``client-cert``, ``proxy``. Not honoured: ``find-links`` (its files come with no published
sha256, and the tool uses nothing unverified), ``trusted-host`` (no certificate check),
and an index that is a ``file://`` folder (requests cannot read it); such an extra index is
passed over with a note, as pip passes over a location it cannot read.

Why not ``pip download`` itself: for vLLM's sdist pip prepares metadata by running vLLM's
own build (it wants a CUDA torch), i.e. it executes upstream code just to fetch a tarball.
"""

from __future__ import annotations

import ast
import ssl
import subprocess
import sys
from dataclasses import dataclass

import requests
from requests.adapters import HTTPAdapter

PYPI = "https://pypi.org/simple/"
# pip's option order: [global], then the command's own section, then PIP_* variables
_SECTIONS = ("global", "download", ":env:")


@dataclass(frozen=True)
class IndexSettings:
    """Where vLLM's files are looked up (``indexes``, first pip's index-url then its extra
    ones) and how they are reached (``cert``: a CA bundle path, None: the system store)."""

    indexes: tuple[str, ...] = (PYPI,)
    cert: str | None = None
    client_cert: str | None = None
    proxy: str | None = None

    def session(self) -> requests.Session:
        """A requests session reaching the indexes as pip would (certificates, proxy)."""
        session = _Session(self.cert)
        if self.cert:
            session.verify = self.cert
        else:
            session.mount("https://", _SystemTrust())
        if self.client_cert:
            session.cert = self.client_cert
        if self.proxy:
            session.proxies = {"http": self.proxy, "https": self.proxy}
        return session


class _Session(requests.Session):
    """A session whose CA bundle, when pip names one, wins over ``$REQUESTS_CA_BUNDLE`` and
    ``$CURL_CA_BUNDLE`` (requests would let them override it): pip's ``cert`` is the user's word."""

    def __init__(self, cert: str | None) -> None:
        super().__init__()
        self._pip_cert = cert

    def merge_environment_settings(self, url, proxies, stream, verify, cert):
        merged = super().merge_environment_settings(url, proxies, stream, verify, cert)
        if self._pip_cert:
            merged["verify"] = self._pip_cert
        return merged


class _SystemTrust(HTTPAdapter):
    """HTTPS verified against the operating system's trust store, as pip does by default."""

    def init_poolmanager(self, *args, **kwargs):
        try:  # imported here: only an HTTPS index needs it
            import truststore
        except ImportError:  # a venv installed before it was a dependency: requests' own CAs
            return super().init_poolmanager(*args, **kwargs)
        kwargs["ssl_context"] = truststore.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
        return super().init_poolmanager(*args, **kwargs)


def settings(python: str = sys.executable) -> IndexSettings:
    """pip's index settings as ``python -m pip`` reads them; pip's defaults where pip is
    missing or its configuration cannot be read (pip itself would then fail to download)."""
    try:
        proc = subprocess.run([python, "-m", "pip", "config", "list"], capture_output=True, text=True)
    except OSError:
        return IndexSettings()
    return parse(proc.stdout if proc.returncode == 0 else "")


def parse(listing: str) -> IndexSettings:
    """IndexSettings from ``pip config list``'s lines (``section.key='value'``)."""
    found: dict[tuple[str, str], str] = {}
    for line in listing.splitlines():
        name, eq, value = line.partition("=")
        section, dot, key = name.rpartition(".")
        if not (eq and dot):
            continue
        try:
            found[section, key] = str(ast.literal_eval(value))
        except (ValueError, SyntaxError):
            found[section, key] = value
    value = {key: found[section, key] for section in _SECTIONS for (s, key) in list(found) if s == section}
    words = lambda key: tuple(value.get(key, "").split())  # noqa: E731  (pip splits lists on space)
    if value.get("no-index", "").lower() in ("1", "true", "yes", "on"):
        indexes: tuple[str, ...] = ()
    else:
        indexes = (value.get("index-url") or PYPI, *words("extra-index-url"))
    return IndexSettings(indexes=indexes, cert=value.get("cert") or None,
                         client_cert=value.get("client-cert") or None, proxy=value.get("proxy") or None)
