"""EMULATION ONLY — MOCKS. The model's compute and FTAR's data plane, replaced
by their shapes and timings so that 100,000 ranks fit on one machine.

Nothing outside :mod:`fthsdp.sim` may import this module: everywhere else in
fthsdp the compute is a real jitted step and the all-reduce a real ring over
TCP. Here:

* :class:`ModelShape` — a model as the control plane sees it: how many bytes of
  gradient each rank all-reduces per step and how long forward/backward takes.
* :class:`MockFabric` — FTAR's data plane as one in-process object shared by
  every emulated replica of a process. An all-reduce of quorum ``q`` at step
  ``s`` is a *rendezvous*: it completes (every ring, one per local shard) when
  every member has entered it, after the time a ring all-reduce of that size
  would take over links of the configured latency and bandwidth
  (``2 (n-1)/n * bytes / bandwidth + 2 (n-1) * latency``). It fails as the
  real one does: at once when a member is killed (its sockets close) or any
  member aborts it (the lighthouse declared someone dead), at a member's
  deadline when a member never arrives (a hung process), and on the rings
  or ranks a test injects a fault into.

The failures are the point: the control plane above (the real lighthouse
process, the real quorum decision, the replica step machine) must react to
them exactly as it would to the real thing.
"""

from __future__ import annotations

import asyncio
import math
from dataclasses import dataclass, field

__all__ = ["ModelShape", "FabricConfig", "MockFabric", "AllreduceResult"]


@dataclass(frozen=True)
class ModelShape:
    """What the control plane needs to know of a model: sizes and times."""

    params: int = 8_000_000_000  # per replica (the whole model; each rank holds 1/G)
    grad_bytes_per_param: int = 2  # bf16 gradients
    step_s: float = 0.05  # forward + backward of one step (emulated by a sleep)

    def __post_init__(self) -> None:
        if self.params < 1 or self.grad_bytes_per_param < 1:
            raise ValueError(f"params and grad_bytes_per_param must be >= 1, got {self.params}, "
                             f"{self.grad_bytes_per_param}")
        if not (self.step_s >= 0 and math.isfinite(self.step_s)):
            raise ValueError(f"step_s must be a finite number of seconds >= 0, got {self.step_s}")

    def shard_bytes(self, ranks_per_replica: int) -> int:
        """Gradient bytes one rank all-reduces per step (its FSDP shard)."""
        return max(1, self.params * self.grad_bytes_per_param // ranks_per_replica)


@dataclass(frozen=True)
class FabricConfig:
    latency_s: float = 20e-6  # per hop
    bandwidth_Bps: float = 25e9  # per link (200 Gb/s)
    # Emulated time is divided by this (1 = real time): an 8B model's all-reduce
    # takes ~1 s of emulated time per step; the control plane does not care how
    # long it is, only that it is bounded and ordered.
    time_scale: float = 1.0

    def __post_init__(self) -> None:
        if not (self.latency_s >= 0 and self.bandwidth_Bps > 0 and self.time_scale > 0):
            raise ValueError(f"latency_s >= 0, bandwidth_Bps > 0 and time_scale > 0 needed, got {self}")

    def allreduce_s(self, nbytes: int, members: int) -> float:
        """Ring all-reduce time of ``nbytes`` over ``members`` replicas (0 for a ring of one)."""
        if members <= 1:
            return 0.0
        n = members
        return (2 * (n - 1) / n * nbytes / self.bandwidth_Bps + 2 * (n - 1) * self.latency_s) / self.time_scale


@dataclass(frozen=True)
class AllreduceResult:
    ok: bool  # every ring finished
    reason: str = ""
    failed_rings: frozenset[int] = frozenset()  # rings (local shard indices) that failed although ok overall
    waited_s: float = 0.0


@dataclass
class _Rendezvous:
    key: tuple[int, int]  # (quorum id, step)
    members: frozenset[str]
    nbytes: int
    arrived: set[str] = field(default_factory=set)
    done: asyncio.Event = field(default_factory=asyncio.Event)
    ok: bool = True
    reason: str = ""
    timer: asyncio.TimerHandle | None = None
    read: set[str] = field(default_factory=set)  # members that took the result
    failed_rings: frozenset[int] = frozenset()
    local: int = -1  # members run by this process, of several (fthsdp.sim.shards); -1: all of them

    def fail(self, reason: str) -> None:
        if self.done.is_set():
            return
        self.ok, self.reason = False, reason
        if self.timer is not None:
            self.timer.cancel()
        self.done.set()


class MockFabric:
    """FTAR's data plane for every emulated replica of one process (see module docstring)."""

    def __init__(self, config: FabricConfig | None = None) -> None:
        self.config = config or FabricConfig()
        self._open: dict[tuple[int, int], _Rendezvous] = {}
        # replica id -> the newest quorum id whose all-reduce it cannot join (inf: killed, not back):
        # a restarted replica is a new process with new endpoints, so the rings of the quorums its
        # dead predecessor was in still find a closed socket.
        self._killed: dict[str, float] = {}
        # Injected faults: (step, ring) fails ring `ring` of every quorum at that
        # step once; (step, replica, rank) fails one rank's local vote once.
        self._ring_faults: set[tuple[int, int]] = set()
        self._rank_faults: set[tuple[int, str, int]] = set()
        self.completed = 0
        self.failed = 0
        # The other emulator processes (fthsdp.sim.shards.Peers), when the replicas are split over
        # several: a rendezvous whose members here have all entered says so to them, and its rings
        # start once every process's members are in (release).
        self.peers = None

    # -- fault injection -----------------------------------------------------

    def inject_ring_fault(self, step: int, ring: int) -> None:
        """Ring ``ring`` (local shard index) of the all-reduce at ``step`` fails, once, for every member."""
        self._ring_faults.add((step, ring))

    def inject_rank_fault(self, step: int, replica_id: str, rank: int) -> None:
        """One rank's all-reduce at ``step`` fails locally, once (its replica's vote says no; others commit)."""
        self._rank_faults.add((step, replica_id, rank))

    def rank_faults_of(self, step: int, replica_id: str) -> set[int]:
        """Ranks of ``replica_id`` with a pending local fault at or before ``step`` (consumed: a
        fault fires at the first all-reduce of its step or after, never waits for one at exactly it)."""
        due = {(s, r, k) for (s, r, k) in self._rank_faults if s <= step and r == replica_id}
        self._rank_faults -= due
        return {k for (_, _, k) in due}

    def pending_faults(self) -> set[tuple[str, int, str, int]]:
        """The injected faults that have not fired: ("ring", step, "", ring) and ("rank", step,
        replica, rank)."""
        return ({("ring", s, "", k) for (s, k) in self._ring_faults}
                | {("rank", s, r, k) for (s, r, k) in self._rank_faults})

    def kill(self, replica_id: str) -> None:
        """The replica's process died: its sockets close, so every open all-reduce with it fails now."""
        self._killed[replica_id] = math.inf
        for rv in list(self._open.values()):
            if replica_id in rv.members:
                rv.fail(f"connection to replica {replica_id} closed (killed)")

    def revive(self, replica_id: str, after_quorum: int) -> None:
        """The replica restarted: it may join the all-reduces of quorums after ``after_quorum``
        (every quorum id decided so far); those of earlier ones are its dead predecessor's, which
        fail at once as before (with the replica id alone back alive, a member that entered its
        old quorum's all-reduce after the restart waited its whole deadline)."""
        self._killed[replica_id] = after_quorum

    def abort(self, quorum_id: int, reason: str) -> int:
        """Abort every open all-reduce of ``quorum_id`` (a member closing its ring); returns how many."""
        n = 0
        for rv in list(self._open.values()):
            if rv.key[0] == quorum_id and not rv.done.is_set():
                rv.fail(f"aborted: {reason}")
                n += 1
        return n

    def refuse(self, quorum_id: int, step: int, members: frozenset[str], reason: str) -> None:
        """A member closes its ring of (``quorum_id``, ``step``) without entering it (a rejoiner
        that asks again, fsm.rejoin_at_step_0): the all-reduce fails now for whoever is in it, and
        at once for whoever enters later, as the real ring's closed sockets refuse them."""
        rv = self._open.get((quorum_id, step))
        if rv is None:
            rv = self._open[(quorum_id, step)] = _Rendezvous((quorum_id, step), members, 0)
        rv.fail(f"aborted: {reason}")

    # -- the all-reduce --------------------------------------------------------

    async def allreduce(self, quorum_id: int, step: int, replica_id: str, members: "tuple[str, ...] | frozenset[str]",
                        nbytes: int, rings: int, timeout_s: float) -> AllreduceResult:
        """Enter the all-reduce of (quorum_id, step) for ``replica_id``'s ``rings`` shards; wait for its end."""
        loop = asyncio.get_running_loop()
        t0 = loop.time()
        key = (quorum_id, step)
        rv = self._open.get(key)
        members = members if isinstance(members, frozenset) else frozenset(members)
        if rv is None:
            rv = self._open[key] = _Rendezvous(key, members, nbytes)
        elif rv.members is not members and rv.members != members:
            return AllreduceResult(False, f"ring handshake refused: members of quorum {quorum_id} differ "
                                          f"({sorted(rv.members)} vs {sorted(members)})")
        dead = [m for m, upto in self._killed.items() if quorum_id <= upto and m in rv.members]
        if dead:
            rv.fail(f"connection to replica(s) {sorted(dead)} refused")
        rv.arrived.add(replica_id)
        if self.peers is None:
            if not rv.done.is_set() and rv.arrived == rv.members and rv.timer is None:
                self._start(rv)
        else:
            if rv.local < 0:
                rv.local = sum(1 for m in rv.members if self.peers.is_local(m))
            if len(rv.arrived) == rv.local:  # this process's members are in: tell the others, once
                self.peers.arrive("fabric", key, rv.local, len(rv.members))
        try:
            await asyncio.wait_for(rv.done.wait(), timeout_s)
        except TimeoutError:
            waiting = sorted(rv.members - rv.arrived)
            rv.fail(f"deadline {timeout_s:g}s passed waiting for {waiting}")
        waited = loop.time() - t0
        if not rv.ok:
            self.failed += 1
            return AllreduceResult(False, rv.reason, waited_s=waited)
        rv.read.add(replica_id)
        if rv.read == rv.members:  # everybody has its result: forget it (a failed one stays until stale)
            self._open.pop(key, None)
        return AllreduceResult(True, "", rv.failed_rings, waited_s=waited)

    def _start(self, rv: _Rendezvous) -> None:
        """Every member is in: the rings run for the time an all-reduce of this size takes."""
        rv.timer = asyncio.get_running_loop().call_later(
            self.config.allreduce_s(rv.nbytes, len(rv.members)), self._finish, rv)

    def release(self, key: tuple[int, int]) -> None:
        """Every emulator process's members of rendezvous ``key`` are in (fthsdp.sim.shards)."""
        rv = self._open.get(key)
        if rv is not None and not rv.done.is_set() and rv.timer is None:
            self._start(rv)

    def _finish(self, rv: _Rendezvous) -> None:
        if rv.done.is_set():
            return
        step = rv.key[1]
        due = {(s, k) for (s, k) in self._ring_faults if s <= step}  # at its step, or the first after it
        rv.failed_rings = frozenset(k for (_, k) in due)
        self._ring_faults -= due  # a ring fault fires once
        self.completed += 1
        rv.done.set()

    def close_stale(self, before_step: int) -> None:
        """Forget rendezvous of steps before ``before_step`` (members that never read them died)."""
        for key in [k for k in self._open if k[1] < before_step]:
            self._open[key].fail("stale")
            del self._open[key]
