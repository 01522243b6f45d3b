"""The standard streams when they are not what a program expects: closed before the tool
started (``apply.py >&-``, ``2>&-``: a cron line, a daemon), or a pipe whose reader went
away (``apply.py --help | true``, ``| head -1``).

A closed stream is opened on ``/dev/null``: the tool does its work and writes its report
files; what it would have printed is dropped, as the caller chose. A reader gone ends
the tool as any Unix tool ends then: quietly, killed by SIGPIPE (141 in a shell), once
whatever was being done has been cleaned up (``cli.stop_like_ctrl_c``).
"""

from __future__ import annotations

import contextlib
import os
import select
import signal
import sys
from collections.abc import Iterator

_STREAMS = ((0, "stdin", os.O_RDONLY, "r"), (1, "stdout", os.O_WRONLY, "w"),
            (2, "stderr", os.O_WRONLY, "w"))


def reopen_closed() -> None:
    """Open each of fds 0, 1, 2 that is closed on ``/dev/null`` (in that order, so one
    opened for stdout cannot land on a closed 0), and give ``sys`` a stream for it."""
    for fd, name, flags, mode in _STREAMS:
        try:
            os.fstat(fd)
            continue
        except OSError:
            pass
        null = os.open(os.devnull, flags)
        if null != fd:
            os.dup2(null, fd)
            os.close(null)
        setattr(sys, name, open(fd, mode, closefd=False, encoding="utf-8", errors="backslashreplace"))


def reader_gone() -> bool:
    """True if stdout or stderr is a pipe whose reader has gone (POLLERR on a pipe's write end)."""
    poller = select.poll()
    for fd in (1, 2):
        poller.register(fd, select.POLLOUT)
    return any(event & select.POLLERR for _fd, event in poller.poll(0))


def end_as_reader_gone() -> None:
    """End the process as SIGPIPE at its default does: no message, no traceback (a message
    to a pipe nobody reads is lost anyway, and one on the terminal is noise for ``| true``)."""
    signal.signal(signal.SIGPIPE, signal.SIG_DFL)
    os.kill(os.getpid(), signal.SIGPIPE)


def end_if_reader_gone() -> None:
    """``end_as_reader_gone`` if a reader has gone (``reader_gone``); else nothing."""
    if reader_gone():
        end_as_reader_gone()


@contextlib.contextmanager
def quiet_when_reader_gone() -> Iterator[None]:
    """Around an entry point: an interrupt or a broken pipe leaving it ends the process
    quietly when a reader has gone. Writing to the closed pipe raises BrokenPipeError and
    its SIGPIPE is raised as KeyboardInterrupt a few instructions later, possibly inside
    the handler of the first: this catches the one that gets out."""
    try:
        yield
    except (KeyboardInterrupt, BrokenPipeError):
        end_if_reader_gone()
        raise
