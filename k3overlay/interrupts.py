"""Ctrl-C (SIGINT), a cancelled CI job (SIGTERM), a closed terminal or ssh session (SIGHUP) and
a reader gone mid-run (SIGPIPE): where they may stop the tool and where not.

Anywhere, an interrupt is a ``KeyboardInterrupt``; the git layer then stops its
child before passing it on (see ``git``). Steps that must not be cut in half
(switching the user's checkout, removing a temporary worktree) run inside
``deferred``: the signal is noted and acted on when the step is done.
"""

from __future__ import annotations

import contextlib
import signal
import threading
from collections.abc import Iterator

SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP, signal.SIGPIPE)


@contextlib.contextmanager
def deferred(*, then_raise: bool = True) -> Iterator[list[int]]:
    """Hold SIGINT/SIGTERM/SIGHUP/SIGPIPE until the block is done; yield the list of those that arrived.

    With ``then_raise`` a held signal becomes a ``KeyboardInterrupt`` once the
    block is done; without it the caller reads the list and decides. Outside
    the main thread (where Python cannot set handlers) the block simply runs.
    """
    received: list[int] = []
    if threading.current_thread() is not threading.main_thread():
        yield received
        return
    previous = {sig: signal.signal(sig, lambda number, _frame: received.append(number))
                for sig in SIGNALS}
    try:
        yield received
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        if received and then_raise:
            raise KeyboardInterrupt
