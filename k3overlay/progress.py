"""Progress on long steps (download, unpack, am, wheel pack), on stderr so stdout stays the report."""

from __future__ import annotations

import contextlib
import sys
import time
from collections.abc import Iterator

from rich.console import Console
from rich.markup import escape
from rich.progress import BarColumn, DownloadColumn, Progress, TransferSpeedColumn

from .printable import printable
from .redact import Stream, redact

# One line a step, even in CI logs; every line passes through ``redact`` (a URL's password,
# a token) on its way out, and each message through ``printable`` (a path's ESC sequences).
console = Console(file=Stream(lambda: sys.stderr), highlight=False, soft_wrap=True)
quiet = False


def say(message: str) -> None:
    """One line of progress (a cache re-fetch, say) unless ``-q``; plain text, not markup."""
    if not quiet:
        console.print(escape(printable(redact(message))))


@contextlib.contextmanager
def step(message: str) -> Iterator[None]:
    """Say ``message`` (plain text: a path may hold ``[/x]``) now and how long it took when
    done (seconds)."""
    start = time.monotonic()
    if not quiet:
        console.print(f"[dim]…[/dim] {escape(printable(redact(message)))}")
    yield
    if not quiet:
        console.print(f"[dim]  done in {time.monotonic() - start:.1f} s[/dim]")


def megabytes(size: int | None) -> str:
    """``"40.0 MB"`` (10**6 bytes; below 0.1 MB, ``"12,345 bytes"``), or ``""`` when the
    size is not known."""
    if not size:
        return ""
    return f"{size / 1e6:.1f} MB" if size >= 100_000 else f"{size:,} bytes"


LOG_EVERY_S = 10.0  # where there is no bar (a CI log), a line this often on a long transfer


class ByteBar:
    """A rich bar counting bytes: a download (it is a pypi-simple ProgressTracker),
    or the members of a wheel being packed or checked. Where stderr is no terminal (a CI
    log), a bar is only noise: a line every ``LOG_EVERY_S`` seconds says how far it got."""

    def __init__(self, total: int | None, label: str) -> None:
        label = escape(printable(redact(label)))  # a file name from the index: text, not markup
        self._progress = Progress(
            "[progress.description]{task.description}", BarColumn(), DownloadColumn(),
            TransferSpeedColumn(), console=console, transient=True,
            disable=quiet or not console.is_terminal,
        )
        self._task = self._progress.add_task(label, total=total)
        self._log = not quiet and not console.is_terminal
        self._label, self._total, self._done = label, total, 0
        self._said = time.monotonic()

    def __enter__(self) -> ByteBar:
        self._progress.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._progress.stop()

    def update(self, increment: int) -> None:
        self._progress.advance(self._task, increment)
        self._done += increment
        if self._log and time.monotonic() - self._said >= LOG_EVERY_S:
            self._said = time.monotonic()
            of = f" of {megabytes(self._total)}" if self._total else ""
            console.print(f"[dim]  {self._label}: {megabytes(self._done) or '0 MB'}{of}[/dim]")
