"""Progress on long steps (download, unpack, am, wheel pack), on stderr so stdout stays the report."""

from __future__ import annotations

import contextlib
import sys
import time
from collections.abc import Iterator

from rich.console import Console
from rich.markup import escape
from rich.progress import BarColumn, DownloadColumn, Progress, TransferSpeedColumn

from .redact import Stream, redact

# One line a step, even in CI logs; every line passes through ``redact`` (a URL's password,
# a token) on its way out.
console = Console(file=Stream(lambda: sys.stderr), highlight=False, soft_wrap=True)
quiet = False


def say(message: str) -> None:
    """One line of progress (a cache re-fetch, say) unless ``-q``; plain text, not markup."""
    if not quiet:
        console.print(escape(redact(message)))


@contextlib.contextmanager
def step(message: str) -> Iterator[None]:
    """Say ``message`` (plain text: a path may hold ``[/x]``) now and how long it took when
    done (seconds)."""
    start = time.monotonic()
    if not quiet:
        console.print(f"[dim]…[/dim] {escape(redact(message))}")
    yield
    if not quiet:
        console.print(f"[dim]  done in {time.monotonic() - start:.1f} s[/dim]")


class ByteBar:
    """A rich bar counting bytes: a download (it is a pypi-simple ProgressTracker),
    or the members of a wheel being packed or checked."""

    def __init__(self, total: int | None, label: str) -> None:
        self._progress = Progress(
            "[progress.description]{task.description}", BarColumn(), DownloadColumn(),
            TransferSpeedColumn(), console=console, transient=True,
            disable=quiet or not console.is_terminal,  # a bar in a CI log is only noise
        )
        self._task = self._progress.add_task(label, total=total)

    def __enter__(self) -> ByteBar:
        self._progress.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._progress.stop()

    def update(self, increment: int) -> None:
        self._progress.advance(self._task, increment)
