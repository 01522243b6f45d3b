"""A package index on 127.0.0.1 serving vLLM release files the test made (PEP 691 JSON).

The test controls what the index says (each file's sha256 and upload time) and
what it serves (the bytes), independently, so a corrupt or lying index can be
staged; ``downloads`` counts the downloads of each file.
"""

from __future__ import annotations

import hashlib
import json
import ssl
import threading
from collections import Counter
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer


@dataclass
class FakeIndex:
    url: str = ""  # the Simple API root, for $PIP_INDEX_URL
    files: dict[str, bytes] = field(default_factory=dict)  # what is served
    digests: dict[str, str] = field(default_factory=dict)  # what the index claims
    upload_times: dict[str, str | None] = field(default_factory=dict)
    downloads: Counter = field(default_factory=Counter)

    def publish(self, name: str, data: bytes, uploaded: str | None = "2026-08-02T00:00:00Z") -> None:
        """List ``name`` with ``data``'s true sha256 and serve ``data``."""
        self.files[name] = data
        self.digests[name] = hashlib.sha256(data).hexdigest()
        self.upload_times[name] = uploaded

    def page(self, base: str) -> dict:
        files = []
        for name in sorted(self.digests):
            entry = {"filename": name, "url": f"{base}/files/{name}", "size": len(self.files.get(name, b"")),
                     "hashes": {"sha256": self.digests[name]} if self.digests[name] else {}}
            if self.upload_times[name]:
                entry["upload-time"] = self.upload_times[name]
            files.append(entry)
        return {"meta": {"api-version": "1.1"}, "name": "vllm", "files": files}


def serve(index: FakeIndex, tls: tuple[str, str] | None = None) -> ThreadingHTTPServer:
    """Start serving ``index`` on a free loopback port; sets ``index.url``. Call ``shutdown()``.

    ``tls``: (certificate, key) files to serve HTTPS with, as a company mirror behind its own CA.
    """

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self):  # noqa: N802 (http.server's name)
            base = f"{scheme}://127.0.0.1:{self.server.server_address[1]}"
            if self.path.rstrip("/") == "/simple/vllm":
                self._send(json.dumps(index.page(base)).encode(), "application/vnd.pypi.simple.v1+json")
            elif self.path.startswith("/files/") and self.path[7:] in index.files:
                index.downloads[self.path[7:]] += 1
                self._send(index.files[self.path[7:]], "application/octet-stream")
            else:
                self.send_error(404)

        def _send(self, body: bytes, content_type: str) -> None:
            self.send_response(200)
            self.send_header("Content-Type", content_type)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args):  # keep pytest's output clean
            pass

    scheme = "https" if tls else "http"
    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    if tls:
        context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        context.load_cert_chain(*tls)
        server.socket = context.wrap_socket(server.socket, server_side=True)
    index.url = f"{scheme}://127.0.0.1:{server.server_address[1]}/simple/"
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server
