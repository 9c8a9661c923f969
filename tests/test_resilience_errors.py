"""The fault classifier (fthsdp/errors.py): one test per class, with the real
exception types the step loop meets (issue 10, item 5). The end-to-end case
(a malformed FTAR chunk sent to a real replica) is in test_resilience_ftar.py."""

from __future__ import annotations

import grpc
import jax
import jax.numpy as jnp
import pytest

from fthsdp.errors import (
    EXIT_JOB_FATAL,
    EXIT_REPLICA_FATAL,
    FaultClass,
    JobFatalError,
    PeerFetchError,
    blamed_address,
    classify,
    exit_code,
)
from fthsdp.control.lighthouse_client import (
    CredentialRefused,
    InvalidLighthouseRequest,
    JobFinished,
    LighthouseError,
    LighthouseUnavailable,
    NotAuthorized,
    QuorumTimeout,
    ReplicaIdHeld,
)
from fthsdp.replica.group import DecisionTimeout
from fthsdp.replica.manager import ManagerError, ManagerJobError

R, RF, JF = FaultClass.RECOVERABLE, FaultClass.REPLICA_FATAL, FaultClass.JOB_FATAL


def xla_error(message: str) -> Exception:
    """A real JaxRuntimeError raised by XLA (a callback that fails inside a jitted function)."""

    def boom(x):
        raise RuntimeError(message)

    f = jax.jit(lambda x: jax.pure_callback(boom, jax.ShapeDtypeStruct((), jnp.float32), x))
    try:
        jax.block_until_ready(f(jnp.float32(1)))
    except Exception as e:  # noqa: BLE001
        return e
    raise AssertionError("the callback did not fail")


def test_malformed_ftar_chunk_is_recoverable_and_blames_the_neighbour():
    e = xla_error("INTERNAL: fthsdp ftar: ftar protocol violation from left neighbour 127.0.0.1:41234: bad chunk magic")
    assert type(e).__name__ in ("JaxRuntimeError", "XlaRuntimeError")
    c = classify(e)
    assert c.kind is R and c.recoverable
    assert c.blame == "127.0.0.1:41234" and "blaming 127.0.0.1:41234" in c.reason


def test_ftars_own_fatal_error_is_replica_fatal_not_retried():
    """FTAR's handlers raise only for this replica's own broken state (bad quorum inputs, an
    unknown communicator, an unresponsive control thread): retried as recoverable, every replica
    rebuilt its ring on every attempt until the retries ran out, and a GPU's reported fatal error
    could even be cleared and trained past. It restarts the replica."""
    e = xla_error("INTERNAL: fthsdp ftar fatal: bad quorum inputs: the step says rank 1 of 2 but quorum 7 "
                  "configured this communicator as rank 0 of 2")
    c = classify(e)
    assert c.kind is RF and not c.recoverable and "FTAR's own state" in c.reason
    assert exit_code(c) == EXIT_REPLICA_FATAL


def test_xla_error_outside_ftar_is_replica_fatal():
    c = classify(xla_error("RESOURCE_EXHAUSTED: out of memory allocating 12 GiB"))
    assert c.kind is RF and "outside FTAR" in c.reason
    assert exit_code(c) == EXIT_REPLICA_FATAL


@pytest.mark.parametrize("exc,kind", [
    (PeerFetchError("could not fetch the state of step 7 from any healthy peer: connection refused"), R),
    (ConnectionResetError("peer 127.0.0.1:9 reset the connection"), R),
    (TimeoutError("fetch timed out"), R),
    (LighthouseError("get_quorum failed: ABORTED: superseded", grpc.StatusCode.ABORTED), R),
    (QuorumTimeout("get_quorum(step=3): no answer within 120s", grpc.StatusCode.DEADLINE_EXCEEDED), RF),
    (ManagerError("step 9: 5 attempts failed; giving up"), RF),
    # a follower's wait for its leader past the deadline: the replica fails as a unit (asking again
    # would read the leader's next decision while the leader publishes this one)
    (DecisionTimeout("replica 0 process 1: no 'quorum' decision from the leader within 300.0s"), RF),
    (MemoryError(), RF),
    (KeyError("a bug"), RF),
    (LighthouseUnavailable("cannot reach lighthouse", grpc.StatusCode.UNAVAILABLE, outage_s=61.0), JF),
    (InvalidLighthouseRequest("local_world_size 4 conflicts with 2", grpc.StatusCode.INVALID_ARGUMENT), JF),
    (ManagerJobError("no other replica is running"), JF),
    (JobFatalError("the job cannot continue"), JF),
    # a credential the lighthouse refuses stays refused (another job's secret, another lighthouse's):
    # retried as transient, the job was restarted from its checkpoint until its restarts ran out
    (CredentialRefused("GetQuorum of job 'fthsdp': the credential does not verify",
                       grpc.StatusCode.UNAUTHENTICATED), JF),
    # ... a replay or clock refusal is not the credential's fault: a new call is signed anew
    (NotAuthorized("Heartbeat of job 'j': nonce already used", grpc.StatusCode.UNAUTHENTICATED), R),
    # ... unlike a replica id held by a process not yet declared dead
    (ReplicaIdHeld("replica id '1' is held by another live process", grpc.StatusCode.PERMISSION_DENIED), R),
])
def test_each_exception_class(exc, kind):
    c = classify(exc)
    assert c.kind is kind, (exc, c)
    assert type(exc).__name__ in c.reason
    if kind is not R:
        assert exit_code(c) == (EXIT_JOB_FATAL if kind is JF else EXIT_REPLICA_FATAL)


def test_job_finished_is_never_retried():
    assert not classify(JobFinished("job 'j' already finished at step 120", 120)).recoverable


def test_blamed_address():
    assert blamed_address("connection from left neighbour 10.0.0.7:5000 lost: reset") == "10.0.0.7:5000"
    assert blamed_address("right neighbour 127.0.0.1:77 refused the handshake: stale") == "127.0.0.1:77"
    assert blamed_address("deadline passed") is None


@pytest.mark.parametrize("args, says", [
    (["--replica-id", "2", "launch.replicas=2"], "--replica-id 2 is not one of the job's replicas 0..1"),
    (["--replica-id", "0", "optim.lr=abc"], "optim.lr"),
])
def test_a_replica_started_wrongly_exits_job_fatal_at_once(tmp_path, args, says):
    """A replica id past launch.replicas failed every healthy replica at its first commit with it
    (the data positions are indexed by replica id); a config error exited 1, which the launcher
    never restarts but reads as an unclassified failure. Both are the job's to fix: exit 78."""
    import subprocess
    import sys

    p = subprocess.run([sys.executable, "-m", "fthsdp.replica.process", "--config", "base", "--lighthouse",
                        "127.0.0.1:1", "--out-dir", str(tmp_path), *args], capture_output=True, text=True, timeout=120)
    assert p.returncode == EXIT_JOB_FATAL and says in p.stderr, p.stderr[-2000:]


def test_a_quorum_with_a_behind_member_gives_its_all_reduce_the_catch_up_allowance():
    """A behind member fetches the state before it joins the all-reduce: with the plain deadline a
    fetch longer than it failed every attempt of the healthy members (each one refetched) until
    they gave up. Such a quorum's ring is configured with ft.catch_up_timeout_s more."""
    import dataclasses
    import threading
    import types

    from fthsdp import config as config_lib
    from fthsdp.control import quorum as qm
    from fthsdp.replica.manager import Manager

    got = []
    comm = types.SimpleNamespace(configure=lambda job, qid, rank, members, timeout_s, op_timeout_s:
                                 got.append(("configure", op_timeout_s)),
                                 set_op_timeout=lambda s: got.append(("set", s)))
    cfg = config_lib.load("base", ["ft.allreduce_timeout_s=10", "ft.catch_up_timeout_s=45"])
    fake = types.SimpleNamespace(cfg=cfg, comm=comm, replica_id="0", job_id="j", _lock=threading.Lock(),
                                 _op_deadline=0.0)
    fake._deadline = lambda q: Manager._deadline(fake, q)
    members = tuple(qm.Member(r, 5, (f"127.0.0.1:{7000 + int(r)}",), "", 1) for r in ("0", "1"))
    Manager._configure(fake, qm.Quorum(3, members, 5, ("0", "1"), ()))
    behind = qm.Quorum(4, members, 5, ("0",), ("1",), recovery={"1": ("0",)})
    Manager._configure(fake, behind)
    # the member caught up: the next quorum keeps id 4 (same members) and the ring, not the long deadline
    Manager._keep_deadline(fake, dataclasses.replace(behind, healthy=("0", "1"), behind=(), recovery={}))
    Manager._keep_deadline(fake, dataclasses.replace(behind, healthy=("0", "1"), behind=(), recovery={}))
    assert got == [("configure", 10.0), ("configure", 55.0), ("set", 10.0)]


def test_a_launch_mistake_of_the_step_loop_is_job_fatal():
    """A replica without FTAR in a quorum of several (--allreduce local) fails the same way at
    every restart: it was replica-fatal (restarted until the launcher's failed-start limit, and
    the job ended as "no healthy replica left" instead of with the cause)."""
    from fthsdp.replica.manager import SoloCommunicator

    with pytest.raises(ManagerJobError) as ei:
        SoloCommunicator().configure("j", 1, 0, [["a"], ["b"]], 1.0)
    c = classify(ei.value)
    assert c.kind is JF and "--allreduce ftar" in c.reason

