"""No child outlives the tool: a watchdog process stops what a killed run left running.

Git children run in sessions of their own (no terminal, so nothing can prompt), so
neither a terminal's hang-up nor the kernel stops them when the tool dies: a
SIGKILL'd run's ``git worktree add`` went on writing its tree as an orphan and raced
the next run. ``prctl(PR_SET_PDEATHSIG)`` would stop git itself but not what git
started (``worktree add`` runs ``git reset --hard``, ``fetch`` runs ``index-pack``), it
is tied to the thread that forked, and it is Linux only. So the tool starts one
watchdog (at its first git child) joined to it by a socket: each child's process
group is announced as it starts and withdrawn when it has ended. However the tool
dies, the kernel closes its end of the socket; the watchdog then SIGKILLs every
group still announced, waits until none of their processes is left, and exits.

The tool also hands the watchdog a copy of each lock it takes (``lock``): a lock is
released only when its last copy is closed, so after a crash the lock stays held
until the killed run's git children are gone, and the next run on that checkout
waits for them rather than racing them. A lock given up normally is unlocked
explicitly (``flock(LOCK_UN)`` releases every copy), then the watchdog drops its copy.

The one window left: the tool killed between starting a git child and announcing it
(a few microseconds, no git work done yet by then).

Children other than git that start children of their own (pip: ``--build-wheel``'s install
check, ``--wheel-build vllm``'s build) run through ``run``: in a session of their own too,
each announcing itself between fork and exec (while it holds a copy of the tool's end of the
socket, so not even that window is left), and stopped with what they started on an interrupt.
"""

from __future__ import annotations

import contextlib
import inspect
import os
import signal
import socket
import subprocess
import sys
import time

from .interrupts import deferred

# The watchdog, run as ``python -I -S -c``: stdin is its end of the socket (SOCK_SEQPACKET:
# one message per announcement; a lock comes as an attached descriptor).
_WATCHDOG = r"""
import os, signal, socket, time
for sig in (signal.SIGINT, signal.SIGHUP, signal.SIGPIPE):
    signal.signal(sig, signal.SIG_IGN)
channel = socket.socket(fileno=0)
groups, held = set(), {}
while True:
    try:
        data, fds, _, _ = socket.recv_fds(channel, 256, 4)
    except OSError:
        break
    if not data:
        break  # the tool is gone, however it ended
    op, _, arg = data.decode("utf-8", "surrogateescape").partition(" ")
    if op == "+":
        groups.add(int(arg))
    elif op == "-":
        groups.discard(int(arg))
    elif op == "L" and fds:
        held[arg] = fds.pop(0)
    elif op == "U" and arg in held:
        os.close(held.pop(arg))
    for fd in fds:
        os.close(fd)


"""  # (then ``_members``, the function below, as the watchdog's own: one copy of it)
_WATCHDOG_END = r"""


for group in groups:
    try:
        os.killpg(group, signal.SIGKILL)
    except OSError:
        pass
deadline = time.monotonic() + 30
while groups and time.monotonic() < deadline:
    groups = {g for g in groups if _members(g)}
    time.sleep(0.01)
"""

_channel: socket.socket | None = None
_owner = 0  # the pid that started the watchdog: a forked child of ours must not use it


def _started() -> socket.socket | None:
    """The socket to this process's watchdog, started at the first call; None if it cannot
    be (the tool then works as before, without the guarantee)."""
    global _channel, _owner
    if _channel is not None and _owner == os.getpid():
        return _channel
    ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    try:
        subprocess.Popen([sys.executable, "-I", "-S", "-c", _WATCHDOG], stdin=theirs,
                         stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                         start_new_session=True)  # a terminal's Ctrl-C or hang-up is not for it
    except OSError:
        ours.close()
        return None
    finally:
        theirs.close()
    _channel, _owner = ours, os.getpid()
    return _channel


def _send(message: str, fds: list[int] | None = None) -> None:
    channel = _started()
    if channel is None:
        return
    with contextlib.suppress(OSError):  # a watchdog gone: no SIGPIPE (the tool reads it as ^C)
        # (os.fsencode: a lock's path may hold bytes that are no UTF-8, a TMPDIR's name say)
        socket.send_fds(channel, [os.fsencode(message)], fds or [], socket.MSG_NOSIGNAL)


def watch(group: int) -> None:
    """Announce process group ``group`` (a git child that leads its own session)."""
    _send(f"+ {group}")


def forget(group: int) -> None:
    """Withdraw ``group``: it has ended and been waited for."""
    _send(f"- {group}")


def hold(key: str, fd: int) -> None:
    """Give the watchdog a copy of lock descriptor ``fd``, kept until ``drop(key)`` or until
    the tool's git children are gone after it died."""
    _send(f"L {key}", [fd])


def drop(key: str) -> None:
    """The watchdog closes its copy of lock ``key`` (unlock it first: ``flock(LOCK_UN)``)."""
    _send(f"U {key}")


def run(command: list[str], **kwargs) -> subprocess.CompletedProcess:
    """``subprocess.run(command, **kwargs)`` (stdin ``/dev/null`` unless given) for a child
    that starts children of its own (pip, the build backend it runs, a compiler): it leads a
    session of its own, announced to the watchdog by the child itself before it execs, so a
    killed tool's watchdog stops it and all it started; withdrawn once it has ended. On an
    interrupt (Ctrl-C, SIGTERM: ``subprocess.run`` kills the child itself) what it started is
    killed too before the interrupt goes on."""
    channel = _started()
    told, tell = os.pipe()  # the child's pid (its group), from the child itself

    def announce() -> None:  # in the child, between fork and exec: no import, no lock
        pid = b"%d" % os.getpid()
        os.write(tell, pid)
        if channel is not None:
            with contextlib.suppress(OSError):
                channel.send(b"+ " + pid, socket.MSG_NOSIGNAL)

    kwargs.setdefault("stdin", None if "input" in kwargs else subprocess.DEVNULL)
    group = 0
    try:
        return subprocess.run(command, start_new_session=True, preexec_fn=announce, **kwargs)
    except BaseException:
        group = _told(told)
        if group:
            with deferred(then_raise=False):  # what it started (it is gone: run killed it)
                with contextlib.suppress(OSError):
                    os.killpg(group, signal.SIGKILL)
                _wait_gone(group)
        raise
    finally:
        group = group or _told(told)
        if group:
            forget(group)
        os.close(told)
        os.close(tell)


def _wait_gone(group: int, wait_s: float = 5) -> None:
    """Wait (``wait_s`` at most) until no process of ``group`` is left but zombies."""
    deadline = time.monotonic() + wait_s
    while _members(group) and time.monotonic() < deadline:
        time.sleep(0.01)


def _members(group: int) -> int:
    """How many processes of ``group`` are not zombies (as the watchdog counts them)."""
    try:
        pids = [p for p in os.listdir("/proc") if p.isdigit()]
    except OSError:
        try:
            os.killpg(group, 0)
            return 1
        except OSError:
            return 0
    found = 0
    for pid in pids:
        try:
            with open(f"/proc/{pid}/stat", "rb") as f:
                fields = f.read().rsplit(b")", 1)[1].split()
        except OSError:
            continue
        if int(fields[2]) == group and fields[0] != b"Z":
            found += 1
    return found


def _told(fd: int) -> int:
    """The pid the child wrote into pipe ``fd`` (once: the first call reads it), else 0."""
    os.set_blocking(fd, False)
    try:
        return int(os.read(fd, 32) or 0)
    except (OSError, ValueError):
        return 0


# The watchdog runs alone (``python -I -S -c``): it gets ``_members`` as source, not by import.
_WATCHDOG += "\n\n" + inspect.getsource(_members) + _WATCHDOG_END
