"""One replica's step loop: quorum -> (re)configure FTAR -> step -> commit or retry.

The Manager is the per-replica control plane of FT-HSDP (paper, sections 4.1
and 4.3). Each step it asks the lighthouse for a quorum, rebuilds the FTAR ring
when the quorum id changed, and runs the split training step:

* a healthy replica computes gradients on its next batch, then all-reduces and
  updates (`apply_grads`); the intra-replica commit vote is inside that jitted
  function;
* a behind replica (restarted, late, or one whose last commit failed while the
  others committed) sends a zero gradient, consumes no batch, and applies the
  update to the state of the end of the previous step fetched from its assigned
  peers, so after the all-reduce it holds the same bytes as everyone else. The
  catch-up counts only when the step commits: a replica of several processes
  fetches each process's shards on that process, and its commit vote (a
  reduction over all of them) is what says every process fetched. Until then
  its step, its data state and the loader stay where they were, so an attempt
  that fails (a process had no view of the quorum, a source vanished, the
  all-reduce broke) leaves the replica behind on every process, and it fetches
  again: never some shards new and some old. (The fetched tensors replace the
  old ones at once, so a catch-up step holds no more state in device memory
  than before; a process whose state is a fetched, uncommitted one that a
  quorum then calls healthy, which only a quorum without everyone past its old
  step can, fails its replica, which restarts and rejoins.)

On a RECOVERABLE all-reduce (a peer died, a deadline passed, the lighthouse
declared a member dead and we aborted), only the all-reduce and update are
retried, on a new quorum, with the gradients already in hand: numerically the
same as retraining the step on the same batch. After `max_retries` failed
attempts of one step the Manager raises `ManagerError` instead of live-locking.

Exceptions are no surprise either: whatever the quorum request, the catch-up,
the step or FTAR raises is classified by :func:`fthsdp.errors.classify`. A
RECOVERABLE one (a malformed FTAR chunk from a neighbour, a fetch source that
vanished, a transient lighthouse error) is handled like a failed all-reduce:
the ring is aborted, the peer named in the message is blamed in the step's
events, and the step is retried on a new quorum with the gradients in hand.
Anything else propagates, and the replica process exits with the class's
exit code (fthsdp/replica/process.py).

A ring neighbour that breaks FTAR's protocol (a malformed or unauthenticated
chunk) makes the all-reduce return RECOVERABLE, and the communicator keeps the
violation (which rank of which quorum, its address, what was wrong). The
Manager maps the rank to the member's replica id, blames it in the step's
events and accuses it in its next quorum request; the lighthouse leaves the
accused replica out of the next quorum (fthsdp.control.quorum says for how
long and why one accuser cannot evict anyone for good).
"""

from __future__ import annotations

import collections
import logging
import threading
import time
from dataclasses import dataclass, field
from typing import Callable, Protocol, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from fthsdp.control import quorum as qm
from fthsdp.config import Config
from fthsdp.replica import fsm
from fthsdp.errors import JobFatalError, PeerFetchError, ReplicaFatalError, classify
from fthsdp.data import LoaderState, ReplicaStream
from fthsdp.observe.phase import Phase, PhaseTracker
from fthsdp.step.intervention import Intervention
from fthsdp.step.quorum_inputs import STATUS_FATAL, QuorumInputs, make_quorum_inputs
from fthsdp.step.fingerprint import read_commit
from fthsdp.step.functional import TrainState, TrainStep, nonfinite_skipped, nonfinite_stop

log = logging.getLogger("fthsdp.replica.manager")


def step_pace_s(min_step_s: float, pace: str, num_members: int, replicas: int) -> float:
    """How long a step's compute must take at least (TrainConfig.min_step_s): always, or with
    ``pace="degraded"`` only on a step whose quorum has fewer than the job's ``replicas``."""
    if pace == "degraded" and num_members >= replicas:
        return 0.0
    return min_step_s


class ManagerError(ReplicaFatalError):
    """A fatal condition of the step loop: retries exhausted, no source to recover from.
    The replica exits and its supervisor restarts it (it rejoins from its peers)."""


class ManagerJobError(ManagerError, JobFatalError):
    """A condition no restart of this replica can fix (the message says what to do)."""


def _on_host(x) -> np.ndarray:
    """`x` as a host array, also when it spans the processes of a multi-process replica (then a
    collective of the replica's runtime: every process of the replica calls it at the same point)."""
    if isinstance(x, jax.Array) and not x.is_fully_addressable:
        from jax.experimental import multihost_utils

        return np.asarray(multihost_utils.process_allgather(x, tiled=True))
    return np.asarray(x)


class Communicator(Protocol):
    """What the Manager needs from FTAR's Python face (fthsdp.collective.ftar)."""

    handle: int

    @property
    def addresses(self) -> Sequence[str]: ...  # one listen address per local shard

    def configure(self, job_id: str, quorum_id: int, rank: int, members: Sequence[Sequence[str]],
                  timeout_s: float, op_timeout_s: float = 0.0) -> None: ...  # connect / one all-reduce

    def abort(self, reason: str) -> None: ...

    # Optional (FTAR's communicator has it): protocol violations by ring neighbours since the last
    # call, each with .quorum_id, .rank and .reason.
    # def take_violations(self) -> list: ...


class QuorumSource(Protocol):
    """What the Manager needs from the lighthouse client."""

    def get_quorum(self, step: int, *, ftar_addresses: Sequence[str], state_server_address: str = "",
                   commit_failed: bool = False, num_replicas: int = 0, timeout_s: float = 60.0) -> qm.Quorum: ...


class SoloCommunicator:
    """The communicator of a job with one replica: a ring of one needs no
    connections. Refuses a larger ring instead of silently not reducing."""

    handle = -1
    addresses: tuple[str, ...] = ("solo",)

    def configure(self, job_id: str, quorum_id: int, rank: int, members, timeout_s: float,
                  op_timeout_s: float = 0.0) -> None:
        if len(members) != 1:  # a launch mistake every restart repeats: job-fatal
            raise ManagerJobError(
                f"quorum {quorum_id} has {len(members)} replicas but this replica runs without FTAR "
                "(--allreduce local); start every replica with --allreduce ftar"
            )

    def abort(self, reason: str) -> None:
        pass


# recover(quorum, step) -> (TrainState with .step == step, data state) fetched from the
# quorum's healthy replicas: the state at the end of step `step - 1`.
Recover = Callable[[qm.Quorum, int], tuple[TrainState, dict]]


@dataclass
class StepRecord:
    """What happened in one step, for logs, plots and the failure-stall study."""

    step: int
    quorum_id: int
    members: tuple[str, ...]
    healthy: bool
    committed: bool
    attempts: int
    loss: float | None
    start: float
    end: float
    position: int | None  # stream position trained (None for a zero-gradient step)
    events: list[str] = field(default_factory=list)
    rebuild_s: float = 0.0  # ring reconfigurations during this step
    allreduce_s: float = 0.0  # the committing apply_grads (all-reduce + vote + update)
    grads_s: float = 0.0  # forward + backward
    catch_up_s: float = 0.0  # fetching and installing the peers' state (behind replicas)
    fingerprint: int | None = None  # of the committed state (fthsdp/step/fingerprint.py), when computed
    quorum_at: float | None = None  # when the committing quorum's answer came (wall clock, as start/end)
    skipped: bool = False  # committed with the update skipped: the averaged gradients were not finite

    @property
    def seconds(self) -> float:
        return self.end - self.start


@dataclass
class Manager:
    cfg: Config
    replica_id: str
    job_id: str
    ts: TrainStep
    comm: Communicator
    lighthouse: QuorumSource
    state: TrainState
    loader: LoaderState
    recover: Recover | None = None
    state_server_address: str = ""
    on_commit: Callable[["Manager", StepRecord], None] | None = None
    on_quorum: Callable[["Manager", qm.Quorum], None] | None = None  # after (re)configuring, before compute
    # A catch-up committed: the fetched data state (and its step) is now this replica's. What follows
    # from it (ledger rollbacks, a forked writer's checkpoints deleted) waits for this, not the fetch:
    # a fetch whose step then fails, or is refused, changes nothing.
    on_install: Callable[[dict, int], None] | None = None
    rejoin: bool = False  # restarted alone: it must find peers to rejoin
    # Where this process is, for the lighthouse's root-cause analysis (set at phase boundaries).
    phases: PhaseTracker = field(default_factory=PhaseTracker)

    def __post_init__(self) -> None:
        self.stream = ReplicaStream(self.cfg.data, int(self.loader.replica))
        # Replicated data state: every replica's next stream position and the step
        # that last trained one of its batches. Each commit advances it for the
        # quorum's healthy (contributing) members, identically on every member,
        # so it travels with the model state to a catching-up replica and into
        # persistent checkpoints: a restarted replica resumes its stream from
        # what the model really contains (exactly once), not from what it managed
        # to write before it died.
        n = max(self.cfg.launch.replicas, int(self.loader.replica) + 1)
        self.positions = np.zeros(n, np.int64)
        self.last_step = np.full(n, -1, np.int64)
        self.positions[int(self.loader.replica)] = self.loader.position
        self.quorum: qm.Quorum | None = None
        self._configured_qid: int | None = None
        self._aborted_qid: int | None = None  # the configured quorum whose ring we aborted
        self._lock = threading.Lock()
        # The last steps' records (for a debugger or a test; the log and metrics carry them all):
        # bounded, as a list one record per commit grew with the job.
        self.records: collections.deque[StepRecord] = collections.deque(maxlen=1024)
        self.detections: list[dict] = []
        self._zero_grads = None
        # self.state is a catch-up's fetched state whose step has not committed (see the module's docstring)
        self._fetched_uncommitted = False
        self._op_deadline = 0.0  # the all-reduce deadline the configured ring has (_deadline)
        # (step, data state) of the state this process fetched for a catch-up that has not
        # committed yet: a retry on a quorum at the same step installs it again instead of
        # fetching it again (each attempt refetched, and a fetch longer than the all-reduce's
        # deadline then failed every attempt).
        self._fetch_cache: tuple[int, dict] | None = None
        self._lr_mode = int(Intervention.parse(self.cfg.ft.intervention))
        self._accused: list[str] = []  # replicas that broke FTAR's protocol, for the next quorum request
        self._nonfinite_run = 0  # steps in a row whose update was skipped for non-finite gradients

    # -- failure detection ----------------------------------------------------

    def on_dead(self, dead: tuple[str, ...], quorum_id: int) -> None:
        """Heartbeat-thread callback: abort the in-flight all-reduce at once.

        Called ~10 Hz while the lighthouse lists dead members of its current
        quorum; it aborts only if one of them is in the ring we are using, once
        per quorum id, so FTAR returns RECOVERABLE now instead of at its deadline.
        """
        ours = self._abort_ours(dead, quorum_id, lambda o: f"lighthouse declared replica(s) {', '.join(o)} dead")
        if ours:
            log.warning("lighthouse declared %s dead: aborting the all-reduce of quorum %d", ours, quorum_id)
            self.detections.append({"time": time.time(), "dead": list(ours), "quorum_id": quorum_id})

    def on_asking(self, asking: tuple[str, ...], quorum_id: int, step: int) -> None:
        """Heartbeat-thread callback: members of the quorum whose all-reduce of ``step`` this
        process is in ask the lighthouse for a quorum at or before that step, so they are not
        in that all-reduce and it cannot finish: abort it now, not at its deadline.

        How it happens: the lighthouse wrote some members' answers and died before writing
        the others'; the answered ones entered the all-reduce, the others asked the restarted
        lighthouse, which waits for the answered ones to ask (they hold its newest quorum).
        Only while still in that step's all-reduce (the reply may come after it ended)."""
        if not self.phases.in_allreduce(step):
            return
        ours = self._abort_ours(asking, quorum_id, lambda o: (
            f"replica(s) {', '.join(o)} of quorum {quorum_id} ask for a new quorum at step <= {step} instead of "
            "joining its all-reduce"))
        if ours:
            log.warning("replica(s) %s of quorum %d ask for a quorum at step <= %d, so they are not in its "
                        "all-reduce: aborting it", ours, quorum_id, step)
            self.detections.append({"time": time.time(), "asking": list(ours), "quorum_id": quorum_id})

    def _abort_ours(self, named: tuple[str, ...], quorum_id: int, reason) -> list[str]:
        """Aborts the ring of the configured quorum ``quorum_id`` if other members of it are
        among ``named``, once per configured quorum (FTAR fails RECOVERABLE until the next
        configure); returns them ([]: nothing aborted).

        The abort is queued under the lock that :meth:`_configure` takes before it queues a new
        ring: FTAR applies its commands in order and an abort hits whatever ring is current, so
        an abort decided for quorum Q but queued after Q+1's configure failed Q+1's first
        all-reduce (a retry and a job-wide round lost to a stale heartbeat reply)."""
        with self._lock:
            q = self.quorum
            if q is None or quorum_id != self._configured_qid or self._aborted_qid == quorum_id:
                return []
            ours = [d for d in named if d in q.member_ids and d != self.replica_id]
            if ours:
                self._aborted_qid = quorum_id
                self.comm.abort(reason(ours))
            return ours

    # -- one step -------------------------------------------------------------

    def _configure(self, q: qm.Quorum) -> float:
        t0 = time.perf_counter()
        rank = q.rank_of(self.replica_id)
        members = q.ring_addresses(self.replica_id)  # per member, this process's shards' endpoints
        self._op_deadline = self._deadline(q)
        with self._lock:  # from here no heartbeat reply aborts a ring (see _abort_ours)
            self._configured_qid = None
        self.comm.configure(self.job_id, q.quorum_id, rank, members,
                            timeout_s=self.cfg.timeouts.allreduce_timeout_s, op_timeout_s=self._op_deadline)
        with self._lock:
            self._configured_qid = q.quorum_id
            self._aborted_qid = None
        return time.perf_counter() - t0

    def _deadline(self, q: qm.Quorum) -> float:
        """The all-reduce deadline of quorum ``q``: a behind member fetches the state before it
        joins the all-reduce, so its quorum waits ft.catch_up_timeout_s longer."""
        t = self.cfg.timeouts
        return t.catch_up_allreduce_s if q.behind else t.allreduce_timeout_s

    def _keep_deadline(self, q: qm.Quorum) -> None:
        """``q`` keeps the configured ring (same id: the same members), but its behind members may
        have caught up, or fallen behind: the ring's deadline follows (the long one stayed on for
        the rest of a job whose members all caught up under one quorum id)."""
        want = self._deadline(q)
        if want != self._op_deadline:
            setter = getattr(self.comm, "set_op_timeout", None)
            if setter is not None:
                setter(want)
            self._op_deadline = want

    def _quorum_inputs(self, q: qm.Quorum, healthy: bool) -> QuorumInputs:
        return make_quorum_inputs(
            contribute=healthy,
            num_contributing=q.num_healthy,
            num_members=q.num_members,
            num_configured=max(self.cfg.launch.replicas, q.num_members),
            lr_mode=self._lr_mode,
            rank=q.rank_of(self.replica_id),
            quorum_id=q.quorum_id,
            comm=self.comm.handle,
        )

    def zero_grads(self):
        if self._zero_grads is None:
            # Laid out exactly like compute_grads' output, so apply_grads sees the
            # same input shardings on a catch-up step and never recompiles.
            zeros = jax.jit(lambda p: jax.tree.map(jnp.zeros_like, p), out_shardings=self.ts.state_shardings.params)
            self._zero_grads = zeros(self.state.params)
        return self._zero_grads

    def train_step(self) -> StepRecord:
        """Runs the current step to a commit (possibly after retries)."""
        step = int(self.state.step)
        start = time.time()
        grads = None
        position = None
        loss = None
        commit_failed = False
        events: list[str] = []
        rebuild_s = grads_s = catch_up_s = 0.0
        attempt, step0_since, step0_trusted = 0, None, False
        failing_since: float | None = None  # the first of the quorum requests failing in a row
        failing = 0  # how many in a row (the pause before the next grows with them)
        while attempt <= self.cfg.ft.max_retries:
            attempt += 1
            fetched: dict | None = None  # a behind replica's fetched data state, installed when the step commits
            self.phases.set(Phase.WAITING_FOR_QUORUM, step)
            accused = self.take_accused()
            try:
                q = self.lighthouse.get_quorum(
                    step, ftar_addresses=list(self.comm.addresses), state_server_address=self.state_server_address,
                    commit_failed=commit_failed, num_replicas=self.cfg.launch.replicas,
                    timeout_s=self.cfg.timeouts.quorum_timeout_s, **({"accused": accused} if accused else {}))
            except Exception as e:  # noqa: BLE001 - classified: only a transient error is retried
                self._accused = accused + [r for r in self._accused if r not in accused]  # say it again
                c = classify(e)
                if not c.recoverable or type(e).__name__ == "JobFinished":
                    raise
                now = time.monotonic()
                failing_since, failing = (now if failing_since is None else failing_since), failing + 1
                counted = fsm.quorum_error_counts(now - failing_since, self.cfg.timeouts.lighthouse_outage_s)
                events.append(f"attempt {attempt}: quorum request failed{'' if counted else ' (not counted)'}: "
                              f"{c.reason}")
                log.warning("step %d attempt %d: quorum request failed (%s); asking again%s", step, attempt, c.reason,
                            "" if counted else f" (failing for {now - failing_since:.1f}s, within "
                            f"ft.lighthouse_outage_s: not counted as an attempt)")
                if not counted:
                    attempt -= 1
                time.sleep(min(1.0, 0.1 * failing))
                continue
            failing_since, failing = None, 0
            quorum_at = time.time()
            if self.replica_id not in q.member_ids:
                raise ManagerError(f"quorum {q.quorum_id} does not include replica {self.replica_id}: {q.reason}")
            self.phases.set(Phase.IDLE, quorum_id=q.quorum_id, members=q.member_ids)
            try:
                no_view = getattr(self.lighthouse, "missing_view", "")  # a follower's (replica.group)
                if no_view:  # no rings for q here: the all-reduce fails at once and the replica asks again
                    self.comm.abort(f"step {step}: {no_view}")
                    events.append(f"attempt {attempt} on quorum {q.quorum_id}: no view of it ({no_view})")
                elif q.quorum_id == self._configured_qid:
                    self._keep_deadline(q)
                else:
                    self.quorum = q
                    took = self._configure(q)
                    rebuild_s += took
                    events.append(f"quorum {q.quorum_id} members {list(q.member_ids)} (ring rebuilt in {took:.3f}s)")
                    log.info("step %d: quorum %d members=%s healthy=%s behind=%s (%s); ring rebuilt in %.3fs",
                             step, q.quorum_id, list(q.member_ids), list(q.healthy), list(q.behind), q.reason, took)
                self.quorum = q
                healthy = self.replica_id in q.healthy
                if self.on_quorum:
                    self.on_quorum(self, q)
                if fsm.step0_rule_applies(q, self.replica_id, rejoin=self.rejoin, step=step,
                                          replicas=self.cfg.launch.replicas, trusted=step0_trusted):
                    # Restarted to rejoin, and yet healthy at step 0: every other replica died, or
                    # the replicas holding the job's state are cut off from a lighthouse that forgot
                    # them (restarted) for a moment (fsm.rejoin_at_step_0).
                    now, grace = time.monotonic(), self.cfg.timeouts.alone_rejoin_s
                    verdict, why = fsm.rejoin_at_step_0(q, self.replica_id, 0.0 if step0_since is None
                                                    else now - step0_since, grace)
                    agree = getattr(self.lighthouse, "step0_verdict", None)  # a replica of several processes:
                    if agree is not None:  # its leader's verdict, taken on its clock, for all of them
                        verdict, why = agree(verdict, why, step, q.quorum_id)
                    if verdict == "give up":
                        raise ManagerJobError(
                            f"replica {self.replica_id} was restarted to rejoin its job, but {why}, and the "
                            "lighthouse does not know the job to have finished (every replica died, or those "
                            "holding its state are cut off from the lighthouse); it will not train from its "
                            "initial state. Resume the whole job from its persistent checkpoint (fthsdp run --resume).")
                    if verdict == "train":
                        step0_trusted = True
                        log.warning("replica %s was restarted to rejoin, and quorum %d is at step 0: %s; training "
                                    "from the start with %s", self.replica_id, q.quorum_id, why, list(q.member_ids))
                    else:
                        if step0_since is None:
                            step0_since = now
                            log.warning("replica %s was restarted to rejoin, but quorum %d (members %s) is at step 0 "
                                        "and %s: asking again for up to %.1f s, in case replicas holding the job's "
                                        "state are cut off for a moment", self.replica_id, q.quorum_id,
                                        list(q.member_ids), why, grace)
                        events.append(f"attempt {attempt} on quorum {q.quorum_id}: at step 0, asking again")
                        attempt -= 1
                        self.comm.abort(f"step {step}: replica {self.replica_id} waits for the job's state")
                        time.sleep(min(0.5, self.cfg.timeouts.detect_s / 2))
                        continue
                if healthy and self._fetched_uncommitted:
                    raise ReplicaFatalError(
                        f"replica {self.replica_id} holds the state of step {q.max_step - 1}'s end fetched for a "
                        f"catch-up that did not commit, and quorum {q.quorum_id} calls it healthy at step {step}: "
                        "it cannot train on that state; restarting it to rejoin from its peers")
                fetch_failed = ""
                if not healthy:
                    grads = None
                    if self.cfg.launch.processes_per_replica > 1:
                        # Set on every process of the replica, whatever its own fetch does: the flag must
                        # be the replica's (a process whose fetch failed kept it False and trained when
                        # the next quorum called the replica healthy, while its leader refused to). A
                        # replica of one process sets it only once its fetch replaced its state (below).
                        self._fetched_uncommitted = True
                    cached = self._fetch_cache
                    if not no_view and cached is not None and cached[0] == q.max_step:
                        fetched = cached[1]  # self.state is that fetched state still (the attempt failed)
                        events.append(f"attempt {attempt}: the state of step {q.max_step} fetched in an earlier "
                                      "attempt is used again")
                    elif not no_view:  # without its view this process has no sources: the attempt fails anyway
                        self.phases.set(Phase.FETCHING)
                        t0 = time.perf_counter()
                        try:
                            # the old tensors go now (a catch-up needs no more memory than a step); the step,
                            # the data state and the loader follow only if the step commits
                            self._fetch_cache = None
                            self.state, fetched = self._fetch_peers_state(q, step, events)
                            self._fetched_uncommitted = True
                            self._fetch_cache = (q.max_step, fetched)
                        except PeerFetchError as e:
                            # The replica's other processes may have fetched their shards: they go on to
                            # the commit vote, a collective over every process of the replica. This one
                            # takes part with its ring closed (its state untouched), so the vote fails on
                            # all of them and they ask again together, as without a view; asking at once
                            # would pair its next step with their vote on this one.
                            fetch_failed = f"step {step}: this process's state fetch failed: {e}"
                            self.comm.abort(fetch_failed)
                            events.append(f"attempt {attempt} on quorum {q.quorum_id}: {fetch_failed}")
                            log.warning("step %d attempt %d on quorum %d: %s; failing the commit vote",
                                        step, attempt, q.quorum_id, fetch_failed)
                        finally:
                            catch_up_s += time.perf_counter() - t0
                elif grads is None:
                    batch = self.stream.batch(self.loader.position)
                    x, y = self.ts.shard_batch(batch.inputs, batch.targets)
                    self.phases.set(Phase.COMPUTING)
                    t0 = time.perf_counter()
                    grads, m = self.ts.compute_grads(self.state, x, y)
                    loss, position = m["loss"], batch.position
                    jax.block_until_ready(grads)
                    pace = self._pace_s(q) - (time.perf_counter() - t0)
                    if pace > 0:  # emulate a longer forward/backward (see TrainConfig.min_step_s)
                        time.sleep(pace)
                    grads_s = time.perf_counter() - t0
                    self.phases.computed(grads_s)
                self.phases.set(Phase.ALLREDUCE)
                t0 = time.perf_counter()
                new_state, m = self.ts.apply_grads(self.state, grads if healthy else self.zero_grads(),
                                                   self._quorum_inputs(q, healthy))
                if "commit_words" in m:  # the flags and the fingerprint in one read
                    committed, fingerprint, skipped = read_commit(m["commit_words"])
                else:  # the flags alone (ft.fingerprint off), in one read too
                    flags, fingerprint = int(m["commit_flags"]), None
                    committed, skipped = flags & 1 != 0, flags & 2 != 0
                committed = committed and not fetch_failed  # (its closed ring failed the vote already)
                allreduce_s = time.perf_counter() - t0
            except Exception as e:  # noqa: BLE001 - classified: RECOVERABLE retries, the rest propagates
                c = classify(e)
                if not c.recoverable:
                    log.error("step %d attempt %d on quorum %d: %s fault: %s", step, attempt, q.quorum_id,
                              c.kind.value, c.reason)
                    raise
                self._note_violations(q, step, attempt, events)
                blamed = self.blame(q, c.blame)
                self.comm.abort(f"step {step}: {c.reason}")  # neighbours see the ring close at once
                commit_failed = True
                events.append(f"attempt {attempt} on quorum {q.quorum_id}: {c.reason}"
                              + (f"; blamed replica {blamed}" if blamed else ""))
                log.warning("step %d attempt %d on quorum %d: recoverable fault%s: %s; retrying on a new quorum",
                            step, attempt, q.quorum_id, f" (blamed replica {blamed})" if blamed else "", c.reason)
                continue
            if committed:
                if fetched is not None:  # every process of the replica fetched: the catch-up counts now
                    step = self._install_fetched(q, fetched, events)
                self._fetched_uncommitted = False
                self._fetch_cache = None
                self.state = new_state
                fingerprint = self._report_fingerprint(fingerprint, step + 1, q.quorum_id)
                for r in q.healthy:
                    self.positions[int(r)] += 1
                    self.last_step[int(r)] = step
                if healthy:
                    self.loader = self.loader.advanced()
                    assert self.positions[int(self.replica_id)] == self.loader.position
                self._note_nonfinite(step, skipped, events)
                rec = StepRecord(step, q.quorum_id, q.member_ids, healthy, True, attempt,
                                 float(loss) if (healthy and loss is not None) else None,
                                 start, time.time(), position if healthy else None, events,
                                 rebuild_s=rebuild_s, allreduce_s=allreduce_s, grads_s=grads_s,
                                 catch_up_s=catch_up_s, fingerprint=fingerprint, quorum_at=quorum_at,
                                 skipped=skipped)
                self.records.append(rec)
                self.phases.last_step_s = rec.seconds
                self.phases.set(Phase.IDLE, step + 1)
                if self.on_commit:
                    self.on_commit(self, rec)
                self._check_nonfinite_run(step)
                return rec
            status = _on_host(m["status"])
            if (status == STATUS_FATAL).any():  # (FTAR on a GPU: its fatal errors come back as status 2)
                raise ReplicaFatalError(
                    f"step {step} attempt {attempt} on quorum {q.quorum_id}: FTAR reported a fatal error on this "
                    f"replica (status {status.tolist()}): its communicator's state is broken, so the replica "
                    "restarts and rejoins from its peers (the reason is in the log above)")
            commit_failed = True
            self._note_violations(q, step, attempt, events)
            events.append(f"attempt {attempt} on quorum {q.quorum_id}: all-reduce failed (status {status.tolist()})")
            log.warning("step %d attempt %d: all-reduce on quorum %d failed; retrying on a new quorum",
                        step, attempt, q.quorum_id)
        raise ManagerError(
            f"step {step}: {self.cfg.ft.max_retries + 1} attempts failed ({'; '.join(events[-3:])}); giving up. "
            f"Raise ft.max_retries or check the replicas' logs for the failing peer."
        )

    def _note_nonfinite(self, step: int, skipped: bool, events: list[str]) -> None:
        """Counts the committed steps in a row whose update was skipped (optim.nonfinite=skip)."""
        if not skipped:
            self._nonfinite_run = 0
            return
        self._nonfinite_run += 1
        why = nonfinite_skipped(step, self._nonfinite_run, self.cfg.optim.nonfinite_limit)
        events.append(why)
        log.warning("%s", why)

    def _check_nonfinite_run(self, step: int) -> None:
        """Ends the job once optim.nonfinite_limit updates in a row were skipped. Every replica
        averaged the same gradients, so the replicas that lived through the whole run of skips
        reach the limit at the same step; one restarted during it counts from its restart, and
        ends later or not at all (the others' job-fatal exit ends the job)."""
        run, limit = self._nonfinite_run, self.cfg.optim.nonfinite_limit
        if run >= limit:
            raise ManagerJobError(nonfinite_stop(step, run, limit))

    def _note_violations(self, q: qm.Quorum, step: int, attempt: int, events: list[str]) -> list[str]:
        """The replicas of ``q`` that broke FTAR's protocol in this attempt (from the communicator's
        violations, rank -> replica id): blamed in the events and accused in the next quorum request."""
        take = getattr(self.comm, "take_violations", None)
        if take is None:
            return []
        offenders: list[str] = []
        for v in take():
            if int(v.quorum_id) != q.quorum_id or not 0 <= int(v.rank) < q.num_members:
                continue  # a violation in a ring we no longer use: its ranks mean other replicas now
            rid = q.members[int(v.rank)].replica_id
            if rid == self.replica_id or rid in offenders:
                continue
            offenders.append(rid)
            events.append(f"attempt {attempt} on quorum {q.quorum_id}: {v.reason}; blamed replica {rid}")
            log.warning("step %d attempt %d on quorum %d: recoverable fault (blamed replica %s): %s; accusing it "
                        "to the lighthouse and retrying on a new quorum", step, attempt, q.quorum_id, rid, v.reason)
        for rid in offenders:
            if rid not in self._accused:
                self._accused.append(rid)
        return offenders

    def take_accused(self) -> list[str]:
        """Replicas to accuse in the next quorum request (cleared: each accusation is sent once)."""
        out, self._accused = self._accused, []
        return out

    def _report_fingerprint(self, fingerprint: int | None, committed_steps: int, quorum_id: int) -> int | None:
        """The committed state's fingerprint (computed inside apply_grads; read with the commit
        flag), handed to the lighthouse client, which sends it with the next quorum request
        and heartbeats so the lighthouse can compare the replicas (silent data corruption).
        ``committed_steps``: the new state's step counter, known on the host (no device read);
        ``quorum_id``: the quorum that committed it (a fingerprint of a state that a later fork
        left out of the job's lineage is not judged, however long the client still holds it)."""
        if fingerprint is None or committed_steps % self.cfg.ft.fingerprint_every:
            return None  # not computed this step (ft.fingerprint_every)
        report = getattr(self.lighthouse, "report_fingerprint", None)  # followers: their leader reports
        if report is not None:
            report(committed_steps, fingerprint, quorum_id)
        return fingerprint

    def blame(self, q: qm.Quorum, address: str | None) -> str | None:
        """The member of ``q`` whose FTAR or state-server address is ``address`` (a fault's source)."""
        if not address:
            return None
        return q.member_at(address, self.replica_id)

    def _fetch_peers_state(self, q: qm.Quorum, step: int, events: list[str]) -> tuple[TrainState, dict]:
        """Behind: the healthy replicas' state of the end of step max_step - 1 (this process's
        shards of it) and their data state. The caller puts the tensors in place at once; the
        data state and the step count only once the step commits (:meth:`_install_fetched`)."""
        if self.recover is None:  # built without a way to fetch state: every restart would be the same
            raise ManagerJobError(
                f"replica {self.replica_id} is behind (at step {step}, quorum at {q.max_step}) and has no way to "
                "fetch state from peers (start it with a state server / recovery enabled)"
            )
        t0 = time.perf_counter()
        state, data = self.recover(q, q.max_step)
        got = int(state.step)
        if got != q.max_step:
            raise PeerFetchError(f"recovered state is at step {got}, expected {q.max_step} (sources "
                                 f"{list(q.sources_for(self.replica_id))})")
        took = time.perf_counter() - t0
        sources = list(q.sources_for(self.replica_id))
        events.append(f"fetched step {got}'s state from {sources} in {took:.3f}s")
        log.info("step %d: fetched the state from %s in %.3fs (the catch-up counts if the step commits)", got,
                 sources, took)
        return state, data

    def _install_fetched(self, q: qm.Quorum, data: dict, events: list[str]) -> int:
        """The step that applied the update to the fetched state committed on every process: the
        fetched data state becomes this replica's, and the quorum's step the one the record is of."""
        self.install_data_state(data)
        got = q.max_step
        if self.on_install:
            self.on_install(data, got)
        sources = list(q.sources_for(self.replica_id))
        events.append(f"caught up to step {got} from {sources}")
        log.info("step %d: caught up from %s", got, sources)
        return got

    def data_state(self) -> dict:
        """A copy of the replicated data state (for snapshots and checkpoints)."""
        return {"positions": self.positions.copy(), "last_step": self.last_step.copy()}

    def install_data_state(self, data: dict) -> None:
        positions = np.asarray(data["positions"], np.int64)
        if positions.shape != self.positions.shape:
            raise ManagerJobError(f"peer data state has {positions.shape[0]} replicas, this job {self.positions.shape[0]}; "
                               "the replicas run with different launch.replicas")
        self.positions = positions.copy()
        self.last_step = np.asarray(data["last_step"], np.int64).copy()
        self.loader = LoaderState(self.loader.replica, int(self.positions[int(self.replica_id)]))

    def _pace_s(self, q) -> float:
        t = self.cfg.train
        return step_pace_s(t.min_step_s, t.pace, q.num_members, self.cfg.launch.replicas)

    def warm_up(self) -> float:
        """Compile both halves of the step before checking in with the lighthouse.

        The paper's first-step effect (section 5): a replica that compiles after
        joining the quorum stalls everyone. The warm-up runs `compute_grads` on
        the next batch and `apply_grads` on a ring of one with no contributor,
        which all-reduces nothing over the network and never commits.
        """
        t0 = time.perf_counter()
        batch = self.stream.batch(self.loader.position)
        x, y = self.ts.shard_batch(batch.inputs, batch.targets)
        grads, _ = self.ts.compute_grads(self.state, x, y)
        probe = make_quorum_inputs(contribute=False, num_contributing=0, num_members=1, num_configured=1,
                                   lr_mode=self._lr_mode, comm=self.comm.handle)
        new_state, m = self.ts.apply_grads(self.state, grads, probe)
        if bool(m["committed"]):
            raise ManagerJobError("warm-up step committed; the step's commit vote is broken (a bug of this "
                                  "build: every replica would fail the same way)")
        jax.block_until_ready((new_state, self.zero_grads()))  # a catch-up step compiles nothing
        return time.perf_counter() - t0

    def wait_for_peers(self, status: Callable[[], Sequence], want: int, timeout_s: float) -> int:
        """Start-up barrier: wait until `want` replicas of the job are live (heartbeating).

        Only for a job's first start, so that replicas that compile at different
        speeds begin on one quorum instead of the fastest training alone and the
        rest catching up. A restarted replica does not call it: it joins the
        running quorum. Returns how many were live when it stopped waiting.
        """
        deadline = time.monotonic() + timeout_s
        live = 0
        unreachable_since: float | None = None
        outage_s = self.cfg.timeouts.lighthouse_outage_s
        while time.monotonic() < deadline:
            try:
                jobs = status()
                unreachable_since = None
            except LookupError:
                jobs = []  # the job does not exist on the lighthouse until a replica heartbeats
            except (ConnectionError, TimeoutError) as e:
                # The lighthouse is down (its supervisor restarts it) or slow to answer (a Status
                # past its deadline): ride it out like get_quorum does, for at most the outage limit.
                now = time.monotonic()
                unreachable_since = unreachable_since if unreachable_since is not None else now
                if now - unreachable_since > outage_s:
                    # Job-fatal, as a lighthouse unreachable past the limit is in get_quorum: a
                    # Status past its deadline (a hung lighthouse) read as this replica's own fault,
                    # every replica restarted to rejoin a job that never started.
                    raise JobFatalError(f"start-up: the lighthouse stayed unreachable for "
                                        f"{now - unreachable_since:.0f}s (ft.lighthouse_outage_s={outage_s:g}): {e}; "
                                        "restart it, then start the job again") from e
                log.warning("start-up: lighthouse unreachable for %.1fs (%s); waiting up to ft.lighthouse_outage_s="
                            "%gs", now - unreachable_since, e, outage_s)
                time.sleep(0.2)
                continue
            live = sum(1 for j in jobs for r in j.replicas if not r.dead)
            if live >= want:
                break
            time.sleep(0.1)
        if live < want:
            log.warning("start-up: only %d of %d replicas live after %.0fs; starting without the rest",
                        live, want, timeout_s)
        return live

    def run(self, until_step: int) -> TrainState:
        while int(self.state.step) < until_step:
            self.train_step()
        return self.state
