"""A replica that spans several processes: its JAX runtime and its leader's channel.

In the paper a replica is many hosts. Here a replica is P processes x D local
devices that form **one JAX multi-controller runtime of their own** (one
`jax.distributed.initialize` per replica, with the replica's own coordinator,
which process 0 runs): FSDP shards the state over the replica's global mesh
(`fthsdp.step.sharding.replica_mesh`), and intra-replica collectives run over
gloo on CPU hosts (NCCL on GPUs). Replicas never share a runtime: across
replicas only FTAR and the lighthouse talk, so one replica's failure cannot
wedge another's collectives (invariant 3 holds across replicas; inside a
replica a hang ends only by the launcher killing the whole group).

**One leader per replica.** Process 0 asks the lighthouse; every decision the
replica's processes must take identically (the quorum, whether to retry,
whether to commit) is *published by the leader and replayed by the
followers* through :class:`DecisionChannel`. Every process heartbeats to the
lighthouse itself, under (replica, process), with its own FTAR endpoints and
state server: the lighthouse counts the replica live only while all its
processes are, and gives each process its own view of a quorum (its shards'
rings and recovery sources; a follower fetches it by the quorum id its leader
hands over), so no process receives every endpoint of the job.

Why the channel is the distributed runtime's key-value store and not a
socket of our own: the store already exists (the coordinator that
`jax.distributed.initialize` starts in process 0), every process of the
replica is already connected and authenticated to it by the runtime's own
handshake, it needs no extra listener, address or port (one fewer thing to
bind and advertise, item 6), and its lifetime is the replica's: when the
leader dies the store goes with it and every follower's blocking read fails
within its deadline, which is exactly "the replica fails as a unit". Its
cost (one RPC to the coordinator per decision, ~100 us on a LAN) is small
beside a step. Keys are never reused (a sequence number per decision), so a
follower can never replay a stale one.

`GroupSpec` is what the `fthsdp replica` entry point reads from its flags or
environment variables, so that slurm, Kubernetes or Ray can start one
process per host.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import threading
import time
from typing import Any

from fthsdp.addresses import split_host_port
from fthsdp.errors import ReplicaFatalError

log = logging.getLogger(__name__)

__all__ = ["GroupSpec", "DecisionChannel", "DecisionTimeout", "initialize", "ENV", "LeaderQuorumSource",
           "FollowerQuorumSource", "ViewUnavailable", "GroupWatchdog", "FollowerSilence"]

# Environment variables the entry point reads (flags win), one per field.
ENV = {
    "replica_id": "FTHSDP_REPLICA_ID",
    "process_index": "FTHSDP_PROCESS_INDEX",
    "num_processes": "FTHSDP_NUM_PROCESSES",
    "coordinator": "FTHSDP_COORDINATOR",
}


@dataclasses.dataclass(frozen=True)
class GroupSpec:
    """Which process of which replica this is, and where its replica's coordinator listens.

    coordinator: host:port ([v6]:port) of the replica's JAX coordinator, served
    by process 0 of the replica (so it must be an address of process 0's host);
    unused when num_processes == 1.
    """

    replica_id: int
    process_index: int = 0
    num_processes: int = 1
    coordinator: str = ""

    def __post_init__(self) -> None:
        if self.replica_id < 0:
            raise ValueError(f"replica id must be >= 0, got {self.replica_id}")
        if self.num_processes < 1:
            raise ValueError(f"processes per replica must be >= 1, got {self.num_processes}")
        if not 0 <= self.process_index < self.num_processes:
            raise ValueError(f"process index {self.process_index} is outside 0..{self.num_processes - 1} "
                             f"(the replica has {self.num_processes} processes)")
        if self.num_processes > 1:
            if not self.coordinator:
                raise ValueError("a replica of several processes needs its coordinator's host:port "
                                 f"(--coordinator or {ENV['coordinator']}): process 0 of the replica serves it")
            split_host_port(self.coordinator, allow_zero_port=False)

    @property
    def is_leader(self) -> bool:
        return self.process_index == 0

    @property
    def label(self) -> str:
        """`R` for a one-process replica (as before), `R.p` for a process of a group."""
        return str(self.replica_id) if self.num_processes == 1 else f"{self.replica_id}.{self.process_index}"

    @classmethod
    def from_env(cls, env: dict[str, str] | None = None, **flags: Any) -> "GroupSpec":
        """Flags (not None) win over the environment variables in :data:`ENV`."""
        env = os.environ if env is None else env
        values: dict[str, Any] = {}
        for name, var in ENV.items():
            v = flags.get(name)
            if v is None and env.get(var, "") != "":
                v = env[var]
            if v is None:
                continue
            if name != "coordinator":
                try:
                    v = int(v)
                except (TypeError, ValueError):
                    raise ValueError(f"{name.replace('_', ' ')} must be an integer, got {v!r} "
                                     f"(flag or {var})") from None
            values[name] = v
        if "replica_id" not in values:
            raise ValueError(f"no replica id: pass --replica-id or set {ENV['replica_id']}")
        return cls(**values)


def initialize(spec: GroupSpec, timeout_s: float = 120.0) -> None:
    """Joins this process to its replica's runtime (nothing to do for one process).

    Must run before any JAX computation. CPU collectives use gloo (jax's
    default CPU collectives cannot run across processes); on GPUs the runtime
    picks NCCL by itself."""
    if spec.num_processes == 1:
        return
    import jax

    if os.environ.get("JAX_PLATFORMS", "cpu").split(",")[0] == "cpu":
        jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(coordinator_address=spec.coordinator, num_processes=spec.num_processes,
                               process_id=spec.process_index, initialization_timeout=int(max(1, timeout_s)))


class DecisionTimeout(ReplicaFatalError, TimeoutError):
    """A follower waited past its deadline for its leader's decision: the leader is dead or
    hung, and the replica must fail as a unit (the launcher restarts the group). Replica-fatal,
    not a timeout to retry: the decision's key is spent, so a follower that asked again would
    read the leader's next decision while the leader publishes this one."""


class DecisionChannel:
    """Leader -> followers, one JSON decision per key, over the runtime's key-value store.

    The leader calls ``publish(kind, payload)``; each follower calls
    ``receive(kind, timeout_s)`` in the same order and gets the same payload.
    Sequence numbers are per kind and advance on both sides in lockstep, so
    every key is written once and read once by each follower."""

    def __init__(self, spec: GroupSpec, namespace: str = "fthsdp", client: Any = None):
        self.spec = spec
        self.namespace = namespace
        self._seq: dict[str, int] = {}
        self._client = client
        if self._client is None and spec.num_processes > 1:
            from jax._src import distributed

            self._client = distributed.global_state.client
            if self._client is None:
                raise RuntimeError("DecisionChannel: jax.distributed is not initialized (call "
                                   "replica_group.initialize first)")

    # Decisions of one kind kept in the store behind the newest: a follower reads each before the
    # collective step it decides, so it is never more than one or two behind; older keys are
    # deleted (each quorum's, with every member's endpoints, grew the coordinator's memory with
    # every attempt of a long job).
    KEPT = 8

    def _key(self, kind: str, seq: int | None = None) -> str:
        if seq is None:
            seq = self._seq.get(kind, 0)
            self._seq[kind] = seq + 1
        return f"{self.namespace}/r{self.spec.replica_id}/{kind}/{seq}"

    def publish(self, kind: str, payload: Any) -> Any:
        """Leader only: make `payload` (JSON-able) the group's next `kind` decision; returns it."""
        if not self.spec.is_leader:
            raise RuntimeError(f"process {self.spec.label} is not its replica's leader: it replays decisions")
        key = self._key(kind)
        if self._client is not None:
            self._client.key_value_set(key, json.dumps(payload))
            old = self._seq[kind] - 1 - self.KEPT
            if old >= 0:
                try:
                    self._client.key_value_delete(self._key(kind, old))
                except Exception as e:  # noqa: BLE001 - housekeeping: a key left behind costs memory only
                    log.debug("replica %s: could not delete decision %s/%d: %s", self.spec.replica_id, kind, old, e)
        return payload

    def receive(self, kind: str, timeout_s: float) -> Any:
        """Follower only: the leader's next `kind` decision, or DecisionTimeout past `timeout_s`."""
        if self.spec.is_leader:
            raise RuntimeError("the leader publishes decisions; it does not receive them")
        key = self._key(kind)
        t0 = time.monotonic()
        try:
            text = self._client.blocking_key_value_get(key, int(max(1, timeout_s * 1000)))
        except Exception as e:  # the runtime raises its own error types (deadline, leader gone)
            raise DecisionTimeout(f"replica {self.spec.replica_id} process {self.spec.process_index}: no "
                                  f"{kind!r} decision from the leader within {timeout_s:.1f}s "
                                  f"(waited {time.monotonic() - t0:.1f}s; {type(e).__name__}: "
                                  f"{str(e).splitlines()[0] if str(e) else ''}); the leader is dead or hung, "
                                  "so this replica fails as a unit") from e
        return json.loads(text)

    def mailbox(self, kind: str) -> str:
        """The key prefix of a follower -> leader mailbox of ``kind`` (:meth:`post`, :meth:`collect`)."""
        return f"{self.namespace}/r{self.spec.replica_id}/mail/{kind}/"

    def post(self, kind: str, payload: Any) -> None:
        """Follower -> leader, without waiting: ``payload`` left in the ``kind`` mailbox, where
        the leader's next :meth:`collect` finds it (for what the leader needs but need not wait
        for, like a follower's accusations)."""
        if self._client is None:
            return
        seq = self._seq.get(f"mail/{kind}", 0)
        self._seq[f"mail/{kind}"] = seq + 1
        self._client.key_value_set(f"{self.mailbox(kind)}p{self.spec.process_index}.{seq}", json.dumps(payload))

    def collect(self, kind: str) -> list[Any]:
        """Leader: every payload posted to the ``kind`` mailbox since the last collect (each
        taken once: its key is deleted). Best effort: a store that cannot be read yields []."""
        if self._client is None:
            return []
        out = []
        try:
            for key, text in self._client.key_value_dir_get(self.mailbox(kind)):
                self._client.key_value_delete(key)
                out.append(json.loads(text))
        except Exception as e:  # noqa: BLE001 - advisory mail: the replica goes on without it
            log.warning("replica %s: the %r mailbox could not be read: %s", self.spec.replica_id, kind, e)
        return out

    def share(self, kind: str, payload: Any, timeout_s: float) -> Any:
        """The same value on every process: the leader's `payload`, published; followers' ignored."""
        if self.spec.num_processes == 1:
            return payload
        return self.publish(kind, payload) if self.spec.is_leader else self.receive(kind, timeout_s)

    def gather(self, kind: str, payload: Any, timeout_s: float) -> list[Any] | None:
        """Every process's `payload`, in process order, at the leader (None at followers): how the
        leader learns its followers' FTAR and state-server addresses."""
        if self.spec.num_processes == 1:
            return [payload]
        seq = self._seq.get(kind, 0)
        self._seq[kind] = seq + 1
        base = f"{self.namespace}/r{self.spec.replica_id}/{kind}/{seq}"
        self._client.key_value_set(f"{base}/p{self.spec.process_index}", json.dumps(payload))
        if not self.spec.is_leader:
            return None
        out = []
        for p in range(self.spec.num_processes):
            try:
                out.append(json.loads(self._client.blocking_key_value_get(f"{base}/p{p}",
                                                                          int(max(1, timeout_s * 1000)))))
            except Exception as e:
                raise DecisionTimeout(f"replica {self.spec.replica_id}: process {p} did not report its "
                                      f"{kind!r} within {timeout_s:.1f}s ({type(e).__name__})") from e
        return out


# -- the pieces a process of a multi-process replica plugs into the Manager ------------------------


def quorum_to_json(q) -> dict:
    """The leader's decision for its followers: the quorum without the leader's own view
    (its rings and sources; each follower fetches its own from the lighthouse)."""
    return dataclasses.asdict(dataclasses.replace(q, rings=(), sources=(), ring_neighbours=False))


def quorum_from_json(d: dict):
    from fthsdp.control import quorum as qm

    d = dict(d)
    d["members"] = tuple(qm.Member(**{**m, "ftar_addresses": tuple(m["ftar_addresses"]),
                                      "state_server_addresses": tuple(m.get("state_server_addresses", ()))})
                         for m in d["members"])
    for k in ("healthy", "behind", "left_out"):
        d[k] = tuple(d.get(k, ()))
    d["recovery"] = {k: tuple(v) for k, v in d.get("recovery", {}).items()}
    d["rings"] = tuple(tuple(r) for r in d.get("rings", ()))
    d["sources"] = tuple(qm.ShardSource(**x) for x in d.get("sources", ()))
    return qm.Quorum(**d)


class ViewUnavailable(ReplicaFatalError):
    """A follower could not get its own view of its leader's quorum because the lighthouse
    stayed unreachable past its outage allowance. The replica fails as a unit and rejoins.
    (A follower that reaches a restarted lighthouse which no longer holds the quorum does not
    fail its replica, healthy or recovering: see :attr:`FollowerQuorumSource.missing_view`.)"""


def parse_hold_view(text: str) -> tuple[int, float, bool] | None:
    """``ft.test_hold_view`` (a test hook): ``""`` -> None (off); ``"STEP:SECONDS"`` -> (step,
    seconds, False): a follower waits that long before fetching its view of the first quorum it
    is handed at or after STEP, so that a test can restart the lighthouse in between;
    ``"STEP:SECONDS:recovering"`` -> (step, seconds, True): only a view of a quorum in which its
    replica is recovering (the rejoin of a restarted replica)."""
    parts = text.strip().split(":")
    if parts == [""]:
        return None
    try:
        held = (int(parts[0]), float(parts[1]), parts[2:] == ["recovering"]) if 2 <= len(parts) <= 3 else None
    except ValueError:
        held = None
    if held is None or held[0] < 0 or not 0 < held[1] <= 600 or (len(parts) == 3 and not held[2]):
        raise ValueError("expected STEP:SECONDS or STEP:SECONDS:recovering with STEP >= 0 and 0 < SECONDS "
                         "<= 600 (e.g. 5:8)")
    return held


def _not_held(e: Exception) -> bool:
    """Whether a GetView failure says the lighthouse does not hold the quorum (FAILED_PRECONDITION:
    a restarted lighthouse holds none), as opposed to an unreachable lighthouse."""
    return getattr(getattr(e, "code", None), "name", "") == "FAILED_PRECONDITION"


# GetView failures that end a follower: the lighthouse stayed unreachable past its outage
# allowance, it refuses this job's credential, or the job is over. Any other lighthouse error (a
# deadline, a budget's RESOURCE_EXHAUSTED, ABORTED) is passing: the follower takes the step
# without its view, the replica's commit vote fails, and its leader asks again, as the leader
# itself does for the same errors of its quorum request.
_VIEW_FATAL = {"LighthouseUnavailable", "CredentialRefused", "JobFinished"}


def _passing(e: Exception) -> bool:
    names = {c.__name__ for c in type(e).__mro__}
    return "LighthouseError" in names and not names & _VIEW_FATAL


class LeaderQuorumSource:
    """The leader's lighthouse client, publishing every quorum it gets to its followers."""

    def __init__(self, client, channel: DecisionChannel):
        self.client = client
        self.channel = channel
        self._mail: list[str] = []  # followers' accusations collected and not yet sent in a request that got an answer

    def get_quorum(self, step: int, **kwargs):
        from fthsdp.control.lighthouse_client import JobFinished

        # The followers' accusations (a ring neighbour of theirs broke FTAR's protocol), sent
        # with the leader's own: only the leader asks the lighthouse. Kept until a request carrying
        # them is answered (collected once from the channel, they were lost with a failed request).
        posted = [str(r) for p in self.channel.collect("accused") if isinstance(p, list) for r in p]
        self._mail = mail = list(dict.fromkeys([*self._mail, *posted]))
        if mail:
            from fthsdp.control.lighthouse import MAX_ACCUSED  # what one request may carry

            kwargs["accused"] = list(dict.fromkeys([*kwargs.get("accused", ()), *mail]))[:MAX_ACCUSED]
            log.info("step %d: accusing %s for this replica's followers", step, mail)
        try:
            q = self.client.get_quorum(step, **kwargs)
        except JobFinished as e:  # the followers end the same way (exit 0), not at a timeout
            self.channel.share("quorum", {"job_finished": e.step, "message": str(e), "data": e.data}, 0)
            raise
        self._mail = []
        self.channel.share("quorum", quorum_to_json(q), 0)
        return q

    def leave(self, step: int, finished: bool = False, **kwargs) -> bool:
        """The replica's goodbye, and the lighthouse's verdict on it for the followers: whether
        the replica's final state forked from the job's lineage (the client's ``forked``).
        Published on every leave, so that each follower's own leave reads exactly this one."""
        ok = self.client.leave(step, finished=finished, **kwargs)
        forked = getattr(self.client, "forked", None)
        self.channel.share("leave", {"left": bool(ok), "forked": list(forked) if forked else None}, 0)
        return ok

    def step0_verdict(self, verdict: str, why: str, step: int, quorum_id: int) -> tuple[str, str]:
        """The replica's verdict on a rejoin at step 0 (fsm.rejoin_at_step_0) on quorum
        ``quorum_id`` at ``step``: the leader's, taken on its clock, for every process (each
        process's own clock could cross the grace on different attempts, and the group would exit
        with mixed codes). Tagged with the step and quorum, so that a process that missed one
        exchange fails its replica instead of reading a verdict on another quorum."""
        self.channel.share("step0", [verdict, why, step, quorum_id], 0)
        return verdict, why

    def __getattr__(self, name):  # heartbeats, status, forked, close: the client's
        return getattr(self.client, name)


class FollowerQuorumSource:
    """A follower's quorum source: it replays its leader's decisions (never asks for a
    quorum itself), heartbeats to the lighthouse as its own process (so that its silence
    alone makes the replica dead there), and fetches its own view of each quorum its
    leader hands it: the rings of its own shards and their recovery sources."""

    def __init__(self, channel: DecisionChannel, timeout_s: float, client,
                 hold_view: tuple[int, float] | None = None):
        self.channel = channel
        self.timeout_s = timeout_s
        self.client = client
        self.hold_view = hold_view  # ft.test_hold_view (parse_hold_view), a test hook
        self._view = None  # the last view fetched (rings depend only on the quorum id)
        # Why this process has no view of the quorum :meth:`get_quorum` last returned ("" when it
        # has one). The lighthouse that decided it is gone (restarted: a new one holds no quorum)
        # between the leader's answer and this process's GetView. Rather than fail the replica as
        # a unit (every multi-process replica of the job at once, since all their followers ask
        # the same restarted lighthouse), the Manager takes the step without configuring this
        # process's rings: its all-reduce fails at once, the replica's commit vote (over all its
        # processes) fails with it, and the leader asks the new lighthouse again, like after any
        # failed all-reduce. A recovering replica too: this process fetches nothing (it has no
        # sources), and the others' fetched shards are dropped with the failed step, because a
        # fetched state is installed only when the step commits (fthsdp.replica.manager).
        self.missing_view = ""
        # The lighthouse's verdict at the replica's Leave, as the leader heard it: (step, why)
        # when the replica's final state forked from the job's lineage (set by leave()).
        self.forked: tuple[int, str] | None = None

    @property
    def heartbeating(self) -> bool:
        return self.client.heartbeating

    def get_quorum(self, step: int, accused: list | tuple = (), **kwargs):
        if accused:  # this process's ring neighbours that broke FTAR's protocol: its leader sends them
            self.channel.post("accused", [str(r) for r in accused])
        d = self.channel.receive("quorum", self.timeout_s)
        if "job_finished" in d:
            from fthsdp.control.lighthouse_client import JobFinished

            raise JobFinished(d["message"], int(d["job_finished"]), d.get("data"))
        q = quorum_from_json(d)
        self.client.set_step(step)
        self.missing_view = ""
        v = self._view
        if v is None or v.quorum_id != q.quorum_id or q.recovery:
            self._hold(step, q)
            me = f"process {self.client.process_index} of replica {self.client.replica_id}"
            try:
                fresh = self.client.get_view(q.quorum_id)
            except Exception as e:  # noqa: BLE001 - any failure: this process cannot follow its leader
                from fthsdp.errors import FaultClass, classify

                # The job's own verdicts stand for the replica too (a refused credential, a malformed
                # request, a job stopped for corruption: 78; the end: 0). A lighthouse this process
                # alone cannot reach, while its leader just did, is this process's: replica-fatal below.
                unreachable = type(e).__name__ == "LighthouseUnavailable"
                if type(e).__name__ == "JobFinished" or (classify(e).kind is FaultClass.JOB_FATAL and not unreachable):
                    raise
                if _passing(e) and not _not_held(e):
                    return self._without_view(q, v, f"{me}: no view of quorum {q.quorum_id} this time ({e})")
                if not _not_held(e):
                    raise ViewUnavailable(f"{me}: no view of quorum {q.quorum_id} from the lighthouse ({e}); the "
                                          "replica fails as a unit and rejoins") from e
                return self._without_view(q, v, f"{me}: the lighthouse no longer holds quorum {q.quorum_id} "
                                                f"(restarted since the leader's answer?): {e}")
            if fresh.max_step != q.max_step or fresh.member_ids != q.member_ids:
                return self._without_view(q, v, (
                    f"{me}: the lighthouse's quorum {q.quorum_id} (members {list(fresh.member_ids)} at step "
                    f"{fresh.max_step}) is not the one the leader handed over (members {list(q.member_ids)} at "
                    f"step {q.max_step})"))
            v = self._view = fresh
        return self._merge(q, v)

    def step0_verdict(self, verdict: str, why: str, step: int, quorum_id: int) -> tuple[str, str]:
        """The leader's verdict on a rejoin at step 0 on the same quorum and step, in place of
        this process's own (:meth:`LeaderQuorumSource.step0_verdict`)."""
        got = self.channel.receive("step0", self.timeout_s)
        if not (isinstance(got, list) and len(got) == 4 and all(isinstance(x, str) for x in got[:2])):
            raise ViewUnavailable(f"replica {self.channel.spec.replica_id}: its leader's step-0 verdict is "
                                  f"{str(got)[:200]}, not [verdict, why, step, quorum id]; the replica fails as a unit")
        if got[2:] != [step, quorum_id]:
            raise ViewUnavailable(f"replica {self.channel.spec.replica_id}: its leader's step-0 verdict is on step "
                                  f"{got[2]} of quorum {got[3]}, this process's on step {step} of quorum {quorum_id}: "
                                  "its processes are out of step; the replica fails as a unit")
        return got[0], got[1]

    @staticmethod
    def _merge(q, v):
        """The leader's quorum ``q`` with this process's view ``v`` of it."""
        # the leader's members (this step's steps), with the state servers of this process's view
        servers = {m.replica_id: m.state_server_address for m in v.members}
        members = tuple(dataclasses.replace(m, state_server_address=servers.get(m.replica_id, ""),
                                            state_server_addresses=()) for m in q.members)
        return dataclasses.replace(q, members=members, rings=v.rings, first_shard=v.first_shard,
                                   ring_neighbours=v.ring_neighbours, sources=v.sources if q.recovery else (),
                                   recovery=v.recovery if q.recovery else {})

    def _without_view(self, q, v, why: str):
        """``q`` for a process whose view of it could not be had. A healthy replica's process
        that already holds a view of the same quorum (a recovery quorum's second view) keeps
        its rings (they depend only on the quorum id) and the step goes on; otherwise
        :attr:`missing_view` says why and the step is taken without rings (see there). A
        recovering replica's process never goes on without this view: its sources are in it."""
        if v is not None and v.quorum_id == q.quorum_id and str(self.client.replica_id) in q.healthy:
            log.warning("%s; keeping this process's rings of the same quorum", why)
            return self._merge(q, v)
        self.missing_view = why
        log.warning("%s; this process takes the step without its rings, so the replica does not commit and its "
                    "leader asks the lighthouse again", why)
        members = tuple(dataclasses.replace(m, state_server_address="", state_server_addresses=())
                        for m in q.members)
        return dataclasses.replace(q, members=members, rings=(), sources=(), recovery={}, ring_neighbours=False)

    def _hold(self, step: int, q) -> None:
        """The test hook ``ft.test_hold_view``: wait before the first view at or after its step
        (of a quorum in which this replica recovers, when the hook says ``recovering``)."""
        if self.hold_view is None or step < self.hold_view[0]:
            return
        if self.hold_view[2] and str(self.client.replica_id) in q.healthy:
            return
        secs, self.hold_view = self.hold_view[1], None
        log.warning("test hook ft.test_hold_view: holding the view of quorum %d (step %d) for %.1f s", q.quorum_id,
                    step, secs)
        time.sleep(secs)

    def start_heartbeats(self, on_dead=None, on_asking=None) -> None:
        if not self.client.heartbeating:
            self.client.start_heartbeats(on_dead, on_asking)

    def status(self, *a, **kw):
        return self.client.status(*a, **kw)

    def leave(self, step: int, finished: bool = False, data: dict | None = None) -> bool:
        """Stop heartbeating; the leader says goodbye for the replica, and hands over the
        lighthouse's verdict: when the replica's final state forked, :attr:`forked` is set
        exactly as on the leader, so this process discards its state the same way (its
        ledger's commits rolled back, no "done" record claiming a final state). Without the
        verdict (the leader died first) nothing is claimed forked: returns False. ``data``
        (the model's data state) is the leader's to send; a follower's copy is the same."""
        self.client.stop_heartbeats()
        try:
            d = self.channel.receive("leave", self.timeout_s)
        except DecisionTimeout as e:
            log.warning("no leave verdict from the leader: %s", e)
            return False
        forked = d.get("forked") if isinstance(d, dict) else None
        if forked:
            self.forked = (int(forked[0]), str(forked[1]))
        return bool(d.get("left")) if isinstance(d, dict) else False

    def abandon(self, step: int) -> None:
        """A follower's goodbye on a fault of its own: stop heartbeating and go, without waiting for
        its leader's verdict. The leader publishes it only when it leaves itself, and a leader
        waiting for this process in a collective never does: :meth:`leave` waited its whole
        timeout (five minutes by default) while the replica was out of the job."""
        self.client.stop_heartbeats()

    def close(self) -> None:
        self.client.close()


@dataclasses.dataclass
class FollowerSilence:
    """How long each follower's beat has not moved, judged on the leader's clock (pure).

    Call :meth:`poll` once per watch round, then :meth:`observe` for each follower
    with the value its beat left in the store. A round that came late (the leader's
    own thread did not run for a while: an overloaded host, a long pause of the
    leader's process) moves every follower's last-change time forward by the delay:
    beats that landed while the leader was not looking are not seen as changes only
    because the leader looked once, so without this a loaded host, which delays
    the follower's beat and the leader's look alike, read as a frozen follower.
    A follower that really stopped is still judged silent ``silent_s`` of the
    leader's punctual rounds after its last beat.

    Until the replica trains (:meth:`training`), the window is ``startup_silent_s``:
    a follower that is importing and compiling beside its group on a busy host can
    miss its beats for longer than the detection window (seen: 0.82 s against 0.8 s
    on a 2-core host starting six processes), and nothing waits on it yet; taking the
    replica out then cost a restart of the whole job. From the first step on, every
    follower gets the strict window afresh, so one that froze while starting is still
    caught ``silent_s`` after the replica begins to train."""

    interval_s: float
    silent_s: float
    startup_silent_s: float = 0.0  # the window before training starts (0: ``silent_s`` throughout)
    seen: dict[int, tuple[str, float]] = dataclasses.field(default_factory=dict)
    last_poll: float | None = None
    forgiven_s: float = 0.0  # the leader's own delays, in all (the watchdog logs each)
    trains: bool = False

    def training(self, now: float, followers: "range | tuple[int, ...]" = ()) -> None:
        """The replica starts its step loop at ``now``: the strict window from here on, counted
        from ``now`` for every follower (their start-up is not held against them), ``followers``
        that never beat included (one that froze before its first beat was never judged, and
        its leader waited in the first collective for ever)."""
        if not self.trains:
            self.trains = True
            self.seen = {p: (v, now) for p, (v, _) in self.seen.items()}
            for p in followers:
                self.seen.setdefault(p, ("", now))

    @property
    def window_s(self) -> float:
        return self.silent_s if self.trains else max(self.silent_s, self.startup_silent_s)

    def poll(self, now: float) -> float:
        """A watch round at ``now``: the delay forgiven to the followers (0.0 when punctual)."""
        late = 0.0 if self.last_poll is None else now - self.last_poll - self.interval_s
        self.last_poll = now
        if late <= self.interval_s:  # a scheduling hiccup of up to one interval is the follower's too
            return 0.0
        self.seen = {p: (v, t + late) for p, (v, t) in self.seen.items()}
        self.forgiven_s += late
        return late

    def observe(self, process: int, value: str, now: float) -> float | None:
        """Follower ``process``'s beat now reads ``value``: its silence in seconds when over
        ``silent_s``, else None."""
        last = self.seen.get(process)
        if last is None or last[0] != value:
            self.seen[process] = (value, now)
            return None
        silent = now - last[1]
        return silent if silent > self.window_s else None


class GroupWatchdog:
    """Every process of a replica is alive, or the replica is dead as a whole.

    The lighthouse hears the replica through its leader's heartbeats. So that a
    *frozen* follower (SIGSTOP, a hung host) also takes its replica out, each
    follower beats into the runtime's key-value store every `interval_s`, and
    the leader, watching those beats, calls `on_silent(process, silent_s)` when
    one has not moved for `silent_s` (the job's detection window): the replica
    then leaves as a unit (the caller exits replica-fatal, the lighthouse
    stops hearing the leader, the launcher kills the rest of the group). A
    follower that never beat yet is not judged (it may still be starting), and
    until the leader calls :meth:`training` the window is ``startup_silent_s``
    (:class:`FollowerSilence`).

    :meth:`stop` joins the thread: it calls into the runtime's native client,
    and a daemon thread still inside such a call when the interpreter
    finalizes is ended by CPython through C++ frames that may not unwind,
    which aborts the process (seen once: a leader that had finished its last
    step died with SIGABRT, "FATAL: exception not rethrown")."""

    def __init__(self, spec: GroupSpec, interval_s: float, silent_s: float, on_silent, namespace: str = "fthsdp",
                 client: Any = None, startup_silent_s: float = 0.0):
        self.spec, self.interval_s, self.silent_s, self.on_silent = spec, interval_s, silent_s, on_silent
        self.startup_silent_s = startup_silent_s
        self._training = threading.Event()
        self.prefix = f"{namespace}/r{spec.replica_id}/alive"
        if client is None:
            from jax._src import distributed

            client = distributed.global_state.client
        self._client = client
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._follow if not spec.is_leader else self._watch,
                                        name="fthsdp-group-watchdog", daemon=True)

    def start(self) -> "GroupWatchdog":
        if self.spec.num_processes > 1:
            self._thread.start()
        return self

    def training(self) -> None:
        """The replica begins its step loop: the strict window applies from now on."""
        self._training.set()

    def stop(self, timeout_s: float = 5.0) -> None:
        """Stops the thread and waits for it (at most ``timeout_s``; a round is two quick calls)."""
        self._stop.set()
        if self._thread.is_alive() and self._thread is not threading.current_thread():
            self._thread.join(timeout_s)

    def _follow(self) -> None:
        n, failing = 0, False
        while not self._stop.wait(self.interval_s):
            n += 1
            try:
                self._client.key_value_set(f"{self.prefix}/p{self.spec.process_index}", str(n), allow_overwrite=True)
            except Exception as e:  # noqa: BLE001 - beat on: one failed write must not silence a live follower
                # (a leader that is gone ends this process through the runtime itself)
                if not failing:
                    log.warning("replica %s: a beat to the group's leader failed (%s: %s); beating on",
                                self.spec.replica_id, type(e).__name__, e)
                failing = True
                continue
            if failing:
                log.info("replica %s: beats to the group's leader go through again", self.spec.replica_id)
            failing = False

    def _watch(self) -> None:
        judge = FollowerSilence(self.interval_s, self.silent_s, self.startup_silent_s)
        while not self._stop.wait(self.interval_s):
            now = time.monotonic()
            if self._training.is_set():
                judge.training(now, range(1, self.spec.num_processes))
            late = judge.poll(now)
            if late:
                log.warning("replica %s: the group watchdog's round came %.2fs late (this process was not "
                            "scheduled: an overloaded host?); the delay is not counted against its followers",
                            self.spec.replica_id, late)
            for p in range(1, self.spec.num_processes):
                try:
                    value = self._client.key_value_try_get(f"{self.prefix}/p{p}")
                except Exception:  # noqa: BLE001 - not beating yet (NOT_FOUND): judged from training on
                    value = ""
                    if not judge.trains:
                        continue
                silent = judge.observe(p, value, now)
                if silent is not None:
                    self.on_silent(p, silent)
                    return
