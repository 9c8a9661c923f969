"""What an exception in the step loop means: retry, restart the replica, or stop the job.

Every exception that can come out of one step (the quorum request, the
catch-up fetch from peers, forward/backward, FTAR's all-reduce and the commit)
falls in one of three classes, decided here by one pure function so the
Manager and the replica process agree and the rule is unit-tested without a
cluster:

* ``RECOVERABLE``: the replica's state is intact and the fault lies in the
  ring or a peer (a peer died, sent a malformed FTAR chunk, a fetch source
  vanished, the lighthouse answered with a transient error). The Manager
  aborts its ring, names the peer to blame when the message says which, and
  retries the step's all-reduce on a new quorum with the gradients it holds.
* ``REPLICA_FATAL``: this process cannot go on (out of memory, an XLA error
  outside FTAR, retries exhausted, a bug). It exits with
  :data:`EXIT_REPLICA_FATAL`; its supervisor restarts it and it rejoins from
  its peers. The other replicas are unaffected.
* ``JOB_FATAL``: no restart of this replica can help (the replicas disagree on
  the job's shape, the lighthouse stayed unreachable past
  ``ft.lighthouse_outage_s``, no replica is left to rejoin). It exits with
  :data:`EXIT_JOB_FATAL` and a message that says what to do.

The classes are decided by type first (the marker bases below, and the
lighthouse client's errors), then by the message for errors that only a
message distinguishes (an XLA runtime error raised by the ``fthsdp_ftar``
custom call carries ``fthsdp ftar:``). Nothing here imports jax or grpc.
"""

from __future__ import annotations

import enum
import re
from dataclasses import dataclass

__all__ = [
    "FaultClass",
    "Classified",
    "RecoverableError",
    "ReplicaFatalError",
    "JobFatalError",
    "PeerFetchError",
    "classify",
    "exit_code",
    "blamed_address",
    "EXIT_REPLICA_FATAL",
    "EXIT_JOB_FATAL",
]

# Exit codes of a replica process (sysexits.h: EX_SOFTWARE, EX_CONFIG). A
# supervisor restarts a replica that exits EXIT_REPLICA_FATAL (or dies by a
# signal); EXIT_JOB_FATAL says a restart would fail the same way.
EXIT_REPLICA_FATAL = 70
EXIT_JOB_FATAL = 78


class FaultClass(enum.Enum):
    RECOVERABLE = "recoverable"  # retry on a new quorum, blame the peer
    REPLICA_FATAL = "replica-fatal"  # this process exits; its supervisor restarts it
    JOB_FATAL = "job-fatal"  # the job stops with a clear message


class RecoverableError(RuntimeError):
    """Raise for a fault of the ring or of a peer that a new quorum gets around."""


class ReplicaFatalError(RuntimeError):
    """Raise when this process cannot continue but a restarted one can."""


class JobFatalError(RuntimeError):
    """Raise when restarting this replica cannot help; the message says what the user must do."""


class PeerFetchError(RecoverableError):
    """No healthy peer served the state this behind replica needed (a new quorum names other sources)."""


@dataclass(frozen=True)
class Classified:
    kind: FaultClass
    reason: str  # one line: what happened and why it is in this class
    blame: str | None = None  # the peer's address ("host:port") the fault came from, when known

    @property
    def recoverable(self) -> bool:
        return self.kind is FaultClass.RECOVERABLE


# host:port, or [v6]:port (an IPv6 literal's own colons are inside the brackets)
_NEIGHBOUR = re.compile(r"(?:left|right) neighbour (\[[0-9A-Fa-f:.%]+\]:\d+|[^\s:\[\]]+:\d+)")
# XLA runtime errors that FTAR's custom call raises (handlers.cc prefixes them).
_FTAR_MARK = "fthsdp ftar:"
# What FTAR's handlers raise (ffi/handlers.cc, ffi/cuda/kernels.cu): a fault of this replica's own
# communicator (bad quorum inputs, an unknown handle, an unresponsive control thread, a fatal
# earlier op), never a peer's; a peer's breach comes back as a RECOVERABLE status, not an error.
_FTAR_FATAL_MARK = "fthsdp ftar fatal:"
_XLA_RUNTIME = ("JaxRuntimeError", "XlaRuntimeError")


def blamed_address(message: str) -> str | None:
    """The ring neighbour an FTAR message names ("... from left neighbour 127.0.0.1:4242: ..."), if any."""
    m = _NEIGHBOUR.search(message)
    return m.group(1).rstrip(":,;") if m else None


def _names(exc: BaseException) -> set[str]:
    return {c.__name__ for c in type(exc).__mro__}


def _first_line(exc: BaseException, limit: int = 300) -> str:
    text = str(exc).strip().splitlines()
    line = text[0] if text else ""
    return f"{type(exc).__name__}: {line[:limit]}"


def classify(exc: BaseException) -> Classified:
    """The class of ``exc`` raised inside the step loop, with a one-line reason."""
    names = _names(exc)
    what = _first_line(exc)
    # Explicit markers first: whoever raised it knew best.
    if isinstance(exc, JobFatalError):
        return Classified(FaultClass.JOB_FATAL, what)
    if isinstance(exc, RecoverableError):
        return Classified(FaultClass.RECOVERABLE, what, blamed_address(str(exc)))
    if isinstance(exc, ReplicaFatalError):
        return Classified(FaultClass.REPLICA_FATAL, what)
    if not isinstance(exc, Exception):  # KeyboardInterrupt, SystemExit: not a fault of the loop
        return Classified(FaultClass.REPLICA_FATAL, f"{what} (interrupted)")
    # The lighthouse client's errors (by name: no grpc import here).
    if "LighthouseError" in names:
        if "JobFinished" in names:  # not a fault: the replica process exits 0 (fthsdp/replica/process.py)
            return Classified(FaultClass.JOB_FATAL, f"{what} (the job already finished: nothing to retry)")
        if "LighthouseUnavailable" in names:
            return Classified(FaultClass.JOB_FATAL, f"{what} (the lighthouse stayed unreachable: no replica "
                                                    "can form a quorum; restart it or resume the job)")
        if "InvalidLighthouseRequest" in names:
            return Classified(FaultClass.JOB_FATAL, f"{what} (the replicas of this job disagree on its shape)")
        if "CredentialRefused" in names:
            return Classified(FaultClass.JOB_FATAL, f"{what} (the lighthouse refuses this job's credential, and "
                                                    "asking again cannot change it: give the job the secret "
                                                    "printed for its name, `fthsdp lighthouse --print-job-secret "
                                                    "JOB` with `fthsdp run --job JOB` / launch.job_id=JOB)")
        if "QuorumTimeout" in names:
            return Classified(FaultClass.REPLICA_FATAL, f"{what} (no quorum including this replica formed: "
                                                        "restart it to rejoin)")
        return Classified(FaultClass.RECOVERABLE, f"{what} (a transient lighthouse error: ask again)")
    if names & set(_XLA_RUNTIME):
        msg = str(exc)
        if _FTAR_FATAL_MARK in msg:
            return Classified(FaultClass.REPLICA_FATAL, f"{what} (FTAR's own state on this replica is broken: "
                                                        "restart the replica; it rejoins from its peers)")
        if _FTAR_MARK in msg:
            peer = blamed_address(msg)
            blame = f"; blaming {peer}" if peer else ""
            return Classified(FaultClass.RECOVERABLE,
                              f"{what} (an FTAR failure: the ring is rebuilt on a new quorum{blame})", peer)
        return Classified(FaultClass.REPLICA_FATAL, f"{what} (an XLA runtime error outside FTAR: restart the "
                                                    "replica; it rejoins from its peers)")
    if isinstance(exc, MemoryError):
        return Classified(FaultClass.REPLICA_FATAL, f"{what} (out of host memory)")
    if isinstance(exc, (ConnectionError, TimeoutError)):
        return Classified(FaultClass.RECOVERABLE, f"{what} (a peer connection failed)",
                          blamed_address(str(exc)))
    return Classified(FaultClass.REPLICA_FATAL, f"{what} (unexpected: restart the replica)")


def exit_code(c: Classified) -> int:
    """The process exit code for a fault that ends the replica (RECOVERABLE never should)."""
    return EXIT_JOB_FATAL if c.kind is FaultClass.JOB_FATAL else EXIT_REPLICA_FATAL
