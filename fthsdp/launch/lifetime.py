"""Processes a launcher starts do not outlive it.

`fthsdp run` starts its lighthouse and replicas in their own sessions (so a
Ctrl-C at the terminal reaches the launcher alone, which then stops them in
order). That also means nothing stops them when the launcher itself is
killed: a SIGTERM from a scheduler or an operator used to leave a job's
replicas training on, holding ports and GPUs, with nobody supervising them.

Two rules close that gap:

* the launcher turns SIGTERM and SIGHUP into ``SystemExit``, so its
  ``finally`` blocks stop every process it started, as for Ctrl-C;
* a child started with :func:`child_env` asks the kernel (Linux
  ``PR_SET_PDEATHSIG``) to be sent SIGKILL when the launcher dies by any
  means, SIGKILL included, and exits at once if the launcher is already gone
  by the time it runs.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os
import signal
import subprocess
import sys
import types

from fthsdp.atomic_file import write_atomic
from fthsdp.gc_policy import low_pause_gc

LAUNCHER_PID_ENV = "FTHSDP_LAUNCHER_PID"
_PR_SET_PDEATHSIG = 1  # from <linux/prctl.h>


def child_env(env: dict[str, str]) -> dict[str, str]:
    """``env`` for a child that must die with this process (see :func:`die_with_launcher`)."""
    return {**env, LAUNCHER_PID_ENV: str(os.getpid())}


def die_with_launcher() -> bool:
    """Called first thing in a child's entry point. When the environment names
    a launcher (``$FTHSDP_LAUNCHER_PID``), ask to be SIGKILLed when it dies,
    and exit if it is already gone. Returns whether the kernel took the request
    (False off Linux or without a launcher: then nothing changes)."""
    value = os.environ.get(LAUNCHER_PID_ENV)
    if not value or not sys.platform.startswith("linux"):
        return False
    try:
        launcher = int(value)
    except ValueError:
        print(f"fthsdp: ignoring ${LAUNCHER_PID_ENV}={value!r}: not a process id", file=sys.stderr)
        return False
    libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
    if libc.prctl(_PR_SET_PDEATHSIG, int(signal.SIGKILL), 0, 0, 0) != 0:
        return False
    if os.getppid() != launcher:  # it died between our fork and the prctl: nobody supervises us
        print(f"fthsdp: the launcher (pid {launcher}) that started this process is gone; exiting",
              file=sys.stderr)
        os._exit(1)
    return True


class Terminated(SystemExit):
    """The launcher was told to stop by a signal (SIGTERM, SIGHUP)."""


def exit_on_termination_signals() -> None:
    """SIGTERM and SIGHUP raise :class:`Terminated` (exit code 128 + signal) in the
    main thread, so ``finally`` blocks stop the children as Ctrl-C does."""

    def handler(signum: int, _frame: types.FrameType | None) -> None:
        raise Terminated(128 + signum)

    for sig in (signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, handler)


def stop_process(proc: subprocess.Popen, grace_s: float = 10.0) -> None:
    """SIGTERM ``proc`` and give it ``grace_s`` to exit cleanly (a lighthouse closes its
    listeners, a job writes its report); then SIGKILL it and reap it (at most ``grace_s`` more)."""
    proc.terminate()
    try:
        proc.wait(grace_s)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(grace_s)


STANDBY_COMMAND = "serve"  # the line that makes a standby server bind and serve (`fthsdp lighthouse --standby`)


def wait_to_serve(stream, what: str) -> bool:
    """A standby server's wait (a launcher's warm spare, started and waiting to bind): True
    once ``stream`` (its stdin) gives the line :data:`STANDBY_COMMAND`; False when it ends
    first (the launcher needs no spare any more). Any other line is refused on stderr, naming
    ``what`` (the command), and the wait goes on."""
    for line in stream:
        if line.strip() == STANDBY_COMMAND:
            return True
        print(f"{what} --standby: ignoring {line.strip()[:80]!r} on stdin: only {STANDBY_COMMAND!r} makes it "
              "serve", file=sys.stderr, flush=True)
    return False


async def serve_until_terminated(port: int, port_file: str | None, ready_line: str) -> None:
    """A server process's life after it bound ``port``: write ``port_file`` (before the line, so
    whoever reads the line also finds the file), print ``ready_line``, then wait for SIGTERM or
    SIGINT under the low-pause collector (the process is the server's own: fthsdp.gc_policy)."""
    import asyncio

    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    if port_file:
        write_atomic(port_file, f"{port}\n")
    print(ready_line, flush=True)
    with low_pause_gc():
        await stop.wait()
