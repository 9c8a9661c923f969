"""The quorum decision, as one pure function over plain data.

The lighthouse server (fthsdp/control/lighthouse.py) owns time, sockets and state; this
module only answers "given who is asking, who has been heard from and the last
quorum, is there a quorum now, and why (not)?". Keeping it pure lets every rule
be unit-tested without a server and makes the server's behaviour explainable:
the reason string it returns is what `fthsdp lighthouse` status shows.

Rules, in the order they are checked (see :func:`decide_quorum`):

1. **Liveness.** A replica is *live* if it was heard from (heartbeat or quorum
   request) within ``heartbeat_window_s``. Only live requesters can be members.
2. **min_replicas.** Fewer live requesters than ``min_replicas``: no quorum.
3. **Incumbents are waited for; the join time limit is for newcomers only.**
   A live member of the previous quorum (an *incumbent*) that is not asking
   yet is mid-step: it is waited for until it asks or the failure detector
   declares it dead (silent > ``heartbeat_window_s``), never dropped by a
   timer. Dropping it would make a healthy replica "behind" and cost it a
   catch-up just because a rejoiner asked first (a waiting rejoiner asks up
   to a whole step before the healthy members finish theirs). A live
   *newcomer* (not in the previous quorum) that is not asking yet is waited
   for at most ``join_timeout_s`` (paper, section 6.1), counted from when the
   last incumbent asked, i.e. from when the quorum could otherwise have
   formed: it is the newcomer's lateness alone that the limit bounds, so a
   long step of the incumbents never uses it up. A newcomer left out this way
   is not waited for again (it joins at whichever later step it asks at).
   Before the job's first quorum every live replica is a newcomer, and the
   limit (from the first request) also covers configured replicas never
   heard from yet, when the job states its replica count.
   After a lighthouse restart (no previous quorum in memory) the incumbents
   are the members of the highest quorum the requesters report
   (``last_quorum_id``, ``last_members``); those it has not heard from at
   all yet are given two detection windows to reconnect, once. The same two
   windows are given when no requester listed the members (only the first
   few send the list): a replica that was merely slow, reporting an older
   quorum than the others hold, must not form a quorum alone before their
   heartbeats report the newer one.
4. **Split-brain guard.** The members must be a strict majority of the replicas
   live now (requesters included). We count against *live* replicas, not the
   configured total: after losing 2 of 4 replicas the 2 survivors must go on
   training (counting against 4 would stall them), while a minority that is
   merely faster than a live majority can never move on alone.
5. **Quorum id.** Kept when the membership (replica ids and their addresses) is
   unchanged, incremented when it changes or any requester reports that its
   last commit failed (so every FTAR ring is rebuilt). Never at or below an
   id a replica reports having seen (``last_quorum_id``, or the job's
   ``quorum_id_floor``) unless it is that very quorum: a restarted lighthouse,
   which remembers nothing, continues the job's ids instead of reusing them.

6. **Lineage fence.** A replica whose state forked from the job's lineage is
   *behind* whatever step it reports, and fetches the lineage's state. The
   split-brain guard (rule 4) counts *live* replicas, so it cannot stop this
   sequence, which the emulation caught at 512 x 196 ranks on an overloaded
   machine (its starved event loop silenced replicas' heartbeats; a real job
   gets the same from SIGSTOP, a hung host or a partition between replicas and
   the lighthouse that leaves their FTAR links up): quorum A = {0, 1} forms at
   step s while replica 2 is silent past the detection window; 0 and 1 commit
   step s; then 0 and 1 go silent mid-step s+1 and 2 comes back asking at step
   s; 0 and 1 are dead now, so 2 alone is a majority of the live and forms
   quorum B at step s, retraining it with other batches. Both groups hold a
   "step s+1" state, and when they meet again every one of them is at the top
   step, so each would be called healthy: the replicas are no longer identical
   and batches are trained twice or never. Neither commit can be prevented
   (a commit needs no lighthouse, and a silent replica may be dead or only
   slow), but the fork can be refused at the next decision: the lighthouse
   keeps the job's :class:`Lineage` (which quorum last decided each step), and
   a requester whose last quorum was followed by a quorum that re-decided a
   step it had already committed (:func:`forked_at`) is fenced: behind, even
   above the others' step (it then goes back to the lineage's step). The
   top step is the highest among the unfenced; if no unfenced requester holds
   the state of the step that forked the others, there is no quorum (the
   lineage may yet come back; only its holders can say what it trained).
   A restarted lighthouse rebuilds the lineage from the replicas: each one
   keeps the lineage of the quorums it was answered (the same stack, over the
   quorums it saw) and reports its last :data:`LINEAGE_REPORTED` entries with
   every quorum request; the lighthouse merges the entries older than the
   first quorum it decided itself (:meth:`Lineage.merged`: the stack of a
   union is the stack of the union of stacks, so the order of the reports
   does not matter). The replicas that re-decided a step hold its entry, and
   rule 3a makes the restarted lighthouse wait for the members of the highest
   reported quorum, so the fence holds across a restart unless every holder
   of the re-deciding quorum is gone before it asks (then the others' state is
   the only one left). A full report may have been cut: the quorum ids before
   its oldest entry are forgotten (:func:`unreported_through`), and a replica
   whose last quorum is that old is fenced as one older than the lineage kept,
   so a fork more than :data:`LINEAGE_REPORTED` quorum changes back is fenced
   too (such a replica is behind the reporter anyway unless it forked).
   A fork in the job's last steps is followed by no request that a decision
   could fence; the lighthouse judges each Leave with :func:`forked_at`
   instead: a forked leaver is told (:func:`fork_reason`) and its ``finished``
   does not end the job (the lineage's holders may still be training).

Members are in ring order (:func:`ring_key`); replicas at the highest step are
*healthy*, the rest *behind*: they contribute zero gradients and fetch state
from healthy replicas, one source per local shard, spread round-robin.

**Replicas, not processes, decide.** A replica may be several processes (each
holding a run of its shards); the decision is over replicas only. Processes
appear only as data: a request carries every shard's endpoint and each
process's state server (the lighthouse assembles them from the processes'
own registrations), and :func:`process_view` cuts a decided quorum down to
what one process needs: the members, the rings of its own shards, and its
shards' recovery sources. A ring all-reduce connects each endpoint to its two
neighbours only, so a process that says it can take them gets just those
(:func:`ring_neighbourhood`): three endpoints per shard, not one per member.

**Excluded replicas.** A replica whose ring neighbour caught it breaking FTAR's
protocol (a malformed or unauthenticated chunk) is accused in the neighbour's
next quorum request; :func:`admit_accusation` decides whether the accusation
stands, and the lighthouse passes the replicas it excludes to
:func:`decide_quorum` as data (``excluded``): the decision treats them as if
they were not there at all (not candidates, not live for the split-brain
guard, not waited for as incumbents). An exclusion lasts for exactly **one**
quorum, the next one formed; the excluded replica's own request stays
pending, so it joins the quorum after that as a newcomer, *behind* (its step
is older), and rejoins by fetching the live state from its peers, exactly as
a restarted replica does. A receiver cannot tell a lying accuser from a
faulty sender, so no single accuser can evict anyone for long: an accusation
counts only between two members of the quorum it names, never by or against
an already excluded replica, and each accuser gets at most one admitted
accusation per :data:`ACCUSATION_COOLDOWN_QUORUMS` quorum ids. A liar can
therefore cost one member one quorum per cooldown (it rejoins, with its
state fetched from peers: nothing is lost); a replica that really keeps
corrupting chunks is excluded again whenever the cooldown allows, and every
corrupt chunk in between costs only a retried all-reduce.
"""

from __future__ import annotations

import bisect
import dataclasses
import math
from collections.abc import Collection, Iterable, Mapping, Sequence
from dataclasses import dataclass, field

from fthsdp.digits import ascii_int

__all__ = [
    "MAX_QUORUM_ID",
    "MAX_REPORTED_QUORUM_ID",
    "QuorumConfig",
    "QuorumRequest",
    "Member",
    "Quorum",
    "decide_quorum",
    "dead_replicas",
    "incumbents_of",
    "assign_sources",
    "ring_key",
    "ShardSource",
    "process_view",
    "check_shards",
    "Accusation",
    "admit_accusation",
    "ACCUSATION_COOLDOWN_QUORUMS",
    "Lineage",
    "forked_at",
    "LAST_MEMBERS_SENDERS",
    "LINEAGE_REPORTED",
    "fork_reason",
    "lineage_report",
    "parse_lineage_report",
    "unreported_through",
    "sends_last_members",
    "ring_changes",
    "delta_view",
    "rings_with_delta",
    "positions",
    "ring_neighbourhood",
    "same_neighbourhood",
    "kept_neighbourhood",
]

# One admitted accusation per accuser per this many quorum ids (see the module docstring).
ACCUSATION_COOLDOWN_QUORUMS = 10

# Members of a quorum (the first in ring order) that list its members in their quorum requests.
LAST_MEMBERS_SENDERS = 3

# Lineage entries each replica reports with its quorum requests (its newest ones): what a
# restarted lighthouse rebuilds the lineage fence from (rule 6). Four pairs, ~30 bytes a request.
LINEAGE_REPORTED = 4

# Quorum ids run to the protocol's limit (guard.Limits.max_step: exact in a double); a decision
# past it is refused with the reason instead of issuing an id no replica could report back.
MAX_QUORUM_ID = 2**53
# How far the quorum id floor (every id any replica reported, heartbeats included until the
# lighthouse decided the job's first quorum; rule 5) can
# move the job's ids. Followed so that a restarted lighthouse does not reuse ids; but a process
# holding the job's secret could report the limit and leave no id to issue. Followed only up to
# 2**52, such a report leaves 2**52 ids: more than any job decides. A restarted lighthouse still
# continues from the last quorum its members report (their own, named with its members), so it
# never reuses an id they saw.
MAX_REPORTED_QUORUM_ID = 2**52


def ring_key(replica_id: str) -> tuple[int, int, str]:
    """Natural order of replica ids: numeric ids numerically ("2" < "10"), then others."""
    number = ascii_int(replica_id, max_digits=len(replica_id))  # "²" is a digit int() cannot read
    if number is not None:
        return (0, number, replica_id)
    return (1, 0, replica_id)


@dataclass(frozen=True)
class QuorumConfig:
    """Per-job decision parameters (the lighthouse's flags, possibly refined per job)."""

    min_replicas: int = 1
    join_timeout_s: float = 1.0
    # The failure-detection window: silent this long -> dead (not live).
    heartbeat_window_s: float = 0.8
    # Replicas the job is configured with; 0 = count every replica ever heard from.
    num_configured: int = 0

    def __post_init__(self) -> None:
        if self.min_replicas < 1:
            raise ValueError(f"min_replicas must be >= 1, got {self.min_replicas}")
        if not (self.join_timeout_s >= 0 and math.isfinite(self.join_timeout_s)):
            raise ValueError(f"join_timeout_s must be a finite number >= 0, got {self.join_timeout_s}")
        if not (self.heartbeat_window_s > 0 and math.isfinite(self.heartbeat_window_s)):
            raise ValueError(f"heartbeat_window_s must be > 0, got {self.heartbeat_window_s}")
        if self.num_configured < 0:
            raise ValueError(f"num_configured must be >= 0 (0 = unknown), got {self.num_configured}")


@dataclass(frozen=True)
class QuorumRequest:
    """One pending quorum request, as the decision sees it."""

    replica_id: str
    step: int
    arrived_at: float
    ftar_addresses: tuple[str, ...] = ()
    state_server_address: str = ""
    local_world_size: int = 1
    commit_failed: bool = False
    # The last quorum this replica was a member of (0 = none) and its members:
    # what a restarted lighthouse rebuilds the job's ids and incumbents from.
    last_quorum_id: int = 0
    last_members: tuple[str, ...] = ()
    # A replica of several processes: each process's state server, in process
    # order (process p holds shards p*D .. p*D+D-1, D = local_world_size / num_processes).
    num_processes: int = 1
    state_server_addresses: tuple[str, ...] = ()
    # Restarted to rejoin a running job (its process was restarted after a failure).
    rejoin: bool = False


@dataclass(frozen=True)
class Member:
    replica_id: str
    step: int
    ftar_addresses: tuple[str, ...] = ()  # every shard's endpoint (empty in a process's view)
    state_server_address: str = ""  # process 0's (in a view: the one holding the viewer's first shard)
    local_world_size: int = 1
    num_processes: int = 1
    state_server_addresses: tuple[str, ...] = ()  # per process (empty: state_server_address for all)
    # Restarted to rejoin and asking at step 0: it holds none of the job's state (see
    # fthsdp.replica.fsm.rejoin_at_step_0: a quorum of only such members does not train the job
    # from its start, and decides no step of its lineage: Lineage.after_quorum).
    rejoining: bool = False

    def identity(self) -> tuple:
        """What a ring connection depends on: a change here needs a new quorum id."""
        return (self.replica_id, self.ftar_addresses, self.state_server_address, self.local_world_size,
                self.num_processes, self.state_server_addresses)

    def server_for(self, shard: int) -> str:
        """The state server of the process that holds ``shard`` of this replica."""
        if not self.state_server_addresses:
            return self.state_server_address
        per = max(1, self.local_world_size // max(1, len(self.state_server_addresses)))
        return self.state_server_addresses[min(shard // per, len(self.state_server_addresses) - 1)]


@dataclass(frozen=True)
class ShardSource:
    """Where a behind process fetches one of its shards: the assigned healthy replica and
    the state server of that replica's process holding the shard."""

    shard: int
    replica_id: str
    state_server_address: str


@dataclass(frozen=True)
class Quorum:
    """The answer every member of one step receives (identical for all of them)."""

    quorum_id: int
    members: tuple[Member, ...]  # ring order
    max_step: int
    healthy: tuple[str, ...]  # at max_step, ring order
    behind: tuple[str, ...]  # below max_step, ring order
    # behind replica id -> source replica id per local shard
    recovery: Mapping[str, tuple[str, ...]] = field(default_factory=dict)
    num_healthy: int = 0
    num_configured: int = 0
    reason: str = ""
    # Live newcomers this quorum was formed without after the join timeout;
    # the next decision does not wait for them again.
    left_out: tuple[str, ...] = ()
    # A process's view (see process_view): rings[j] = shard first_shard + j of every
    # member, in ring order; sources: the viewer's shards' recovery sources (viewer behind).
    rings: tuple[tuple[str, ...], ...] = ()
    first_shard: int = 0
    sources: tuple[ShardSource, ...] = ()
    # rings[j] holds only the viewer's neighbourhood in that shard's ring, (left, own, right):
    # the endpoints of members rank - 1, rank and rank + 1 (mod the size; left and right are the
    # other member in a ring of two, the viewer itself in a ring of one). See ring_neighbourhood.
    ring_neighbours: bool = False

    @property
    def member_ids(self) -> tuple[str, ...]:
        return tuple(m.replica_id for m in self.members)

    @property
    def num_members(self) -> int:
        return len(self.members)

    @property
    def only_rejoining(self) -> bool:
        """Every member was restarted to rejoin and holds no state (Member.rejoining): none of
        them trains on it (fsm.rejoin_at_step_0: they ask again, then give up), so it decides no
        step of the job's lineage (Lineage.after_quorum)."""
        return all(m.rejoining for m in self.members)

    def rank_of(self, replica_id: str) -> int:
        """Ring position of ``replica_id``; ValueError if it is not a member. O(1) after the first
        call for the same members tuple (the views of one decision share theirs)."""
        i = positions(self.members).get(replica_id)
        if i is None:
            raise ValueError(f"replica {replica_id!r} is not in quorum {self.quorum_id} {list(self.member_ids)}")
        return i

    def member(self, replica_id: str) -> Member:
        return self.members[self.rank_of(replica_id)]

    def is_healthy(self, replica_id: str) -> bool:
        return replica_id in self.healthy

    def sources_for(self, replica_id: str) -> tuple[str, ...]:
        """Healthy replicas that serve each local shard of behind ``replica_id`` (empty if healthy).
        In a process's view: each of that process's shards."""
        return tuple(self.recovery.get(replica_id, ()))

    def _neighbourhood(self, viewer: str | None) -> tuple[int, int, int]:
        """Ranks of ``viewer``'s left neighbour, its own and its right neighbour's (the three
        positions of a neighbour view's rings)."""
        if viewer is None:
            raise ValueError(f"quorum {self.quorum_id}'s rings hold one process's ring neighbours only: say whose "
                             "view it is (viewer)")
        return ring_neighbourhood(len(self.members), self.rank_of(viewer))

    def ring_addresses(self, viewer: str | None = None) -> list[list[str]]:
        """Per member (ring order), the endpoints the viewer connects to: the viewer's own
        shards' rings in a process's view, every shard of every member otherwise. In a
        neighbour view (``ring_neighbours``; ``viewer`` is the replica whose view it is) only
        the viewer's and its two neighbours' are known: every other member's are empty
        strings, which FTAR accepts for members it does not connect to."""
        if self.ring_neighbours:
            out = [[""] * len(self.rings)] * len(self.members)
            for pos, i in enumerate(self._neighbourhood(viewer)):
                out[i] = [ring[pos] for ring in self.rings]
            return out
        if self.rings:
            return [[ring[i] for ring in self.rings] for i in range(len(self.members))]
        return [list(m.ftar_addresses) for m in self.members]

    def member_at(self, address: str, viewer: str | None = None) -> str | None:
        """The member whose FTAR endpoint or state server is ``address`` (a fault's source);
        a neighbour view's rings are searched when ``viewer`` says whose view it is."""
        near: dict[int, int] = {}
        if self.ring_neighbours and viewer is not None and viewer in self.member_ids:
            near = {i: pos for pos, i in enumerate(self._neighbourhood(viewer))}
        for i, m in enumerate(self.members):
            if address in m.ftar_addresses or address == m.state_server_address or \
                    address in m.state_server_addresses:
                return m.replica_id
            if self.ring_neighbours:
                if i in near and any(r[near[i]] == address for r in self.rings):
                    return m.replica_id
            elif any(r[i] == address for r in self.rings):
                return m.replica_id
        for s in self.sources:
            if s.state_server_address == address:
                return s.replica_id
        return None


# Ring positions of the last few members tuples (positions, rank_of): keyed by the tuple's identity and
# holding it, so an id is never reused while cached; results never depend on the cache. Only
# single dict operations touch it (a Manager's threads may call rank_of at once): full, it is
# cleared, and the next call rebuilds the one in use.
_POSITIONS: dict[int, tuple[tuple, dict[str, int]]] = {}


def positions(members: tuple) -> dict[str, int]:
    """Ring position by replica id of ``members`` (a quorum's), built once per tuple; shared by
    its callers, who must not change it."""
    hit = _POSITIONS.get(id(members))
    if hit is not None and hit[0] is members:
        return hit[1]
    ranks = {m.replica_id: i for i, m in enumerate(members)}
    if len(_POSITIONS) >= 16:
        _POSITIONS.clear()
    _POSITIONS[id(members)] = (members, ranks)
    return ranks


def check_shards(m: Member, first_shard: int, num_shards: int) -> None:
    """Raises ValueError unless member ``m`` holds shards ``first_shard`` .. ``+num_shards-1``
    (a process's view, or its ring neighbours' endpoints, cut from ``m``'s)."""
    last = first_shard + num_shards
    if len(m.ftar_addresses) < last:
        raise ValueError(f"shards {first_shard}..{last - 1} are outside member {m.replica_id}'s "
                         f"{len(m.ftar_addresses)} shards (every replica must have the same shards)")


def process_view(q: Quorum, replica_id: str, first_shard: int, num_shards: int, rings: bool = True) -> Quorum:
    """What one process of ``replica_id`` holding shards ``first_shard`` .. ``+num_shards-1``
    is told about ``q``: the members (ids, steps; no endpoint lists), the rings of its own
    shards, and, if its replica is behind, one source per own shard (replica and the state
    server of the process holding that shard there). O(members x num_shards), not O(members
    x every shard); ``rings=False``: without the rings (a neighbour view adds its own,
    :func:`ring_neighbourhood`), O(members + num_shards). Raises ValueError if the shards are
    outside the members' shards."""
    last = first_shard + num_shards
    for m in q.members:
        if m.ftar_addresses:
            check_shards(m, first_shard, num_shards)
    members = tuple(Member(m.replica_id, m.step, (), m.server_for(first_shard), m.local_world_size, m.num_processes,
                           rejoining=m.rejoining)
                    for m in q.members)
    ring_list = tuple(tuple(m.ftar_addresses[k] for m in q.members) for k in range(first_shard, last)) if rings else ()
    recovery: dict[str, tuple[str, ...]] = {}
    sources: tuple[ShardSource, ...] = ()
    ids = q.recovery.get(replica_id)
    if ids:
        by_id = {m.replica_id: m for m in q.members}
        mine = tuple(ids[k % len(ids)] for k in range(first_shard, last))
        recovery[replica_id] = mine
        sources = tuple(ShardSource(k, r, by_id[r].server_for(k)) for k, r in zip(range(first_shard, last), mine))
    return Quorum(q.quorum_id, members, q.max_step, q.healthy, q.behind, recovery, q.num_healthy,
                  q.num_configured, q.reason, q.left_out, ring_list, first_shard, sources)


def ring_neighbourhood(n: int, rank: int) -> tuple[int, int, int]:
    """The ranks a ring all-reduce at ``rank`` of ``n`` members connects to, with its own:
    ``(left, rank, right)``, its neighbours ``rank - 1`` and ``rank + 1`` mod ``n`` (both the
    other member in a ring of two, ``rank`` itself in a ring of one). A neighbour view
    (``Quorum.ring_neighbours``) holds these members' endpoints only: O(shards) per process
    instead of O(members x shards) (1.45 MB per leader at 512 replicas x 196 shards, 0.74 GB
    for one round's new quorum). Raises ValueError for a rank outside the ring."""
    if not 0 <= rank < n:
        raise ValueError(f"rank {rank} outside a ring of {n} member(s)")
    return (rank - 1) % n, rank, (rank + 1) % n


def same_neighbourhood(new: Quorum, old: Quorum, replica_id: str, first_shard: int, num_shards: int) -> bool:
    """Whether ``replica_id``'s ring neighbourhood in ``new`` is the one it had in ``old``: the
    same left neighbour, itself and right neighbour, each with the same endpoints of shards
    ``first_shard`` .. ``+num_shards-1``. Then a process holding its neighbour view of ``old``
    already holds its rings of ``new`` (``Quorum.neighbourhood_from``): when one replica of
    many dies or rejoins, all but the two beside it. Both quorums carry every member's
    endpoints (the lighthouse's)."""
    at_new, at_old = positions(new.members).get(replica_id), positions(old.members).get(replica_id)
    if at_new is None or at_old is None:
        return False
    last = first_shard + num_shards
    now = ring_neighbourhood(len(new.members), at_new)
    was = ring_neighbourhood(len(old.members), at_old)
    for i, j in zip(now, was):
        a, b = new.members[i], old.members[j]
        if a.replica_id != b.replica_id:
            return False
        if a.ftar_addresses is not b.ftar_addresses and \
                a.ftar_addresses[first_shard:last] != b.ftar_addresses[first_shard:last]:
            return False
    return True


def kept_neighbourhood(q: Quorum, viewer: str, held: Quorum) -> Quorum:
    """``q``, an answer whose neighbourhood was left out as unchanged since ``held`` (the
    viewer's view of an earlier quorum, :func:`same_neighbourhood`), with its rings: the held
    neighbourhood's, or, from a whole view, the three members' endpoints cut from its rings.
    Raises ValueError when ``held`` cannot be that view (the lighthouse's and the client's
    views disagree: a protocol error)."""
    ids = [q.members[i].replica_id for i in ring_neighbourhood(len(q.members), q.rank_of(viewer))]
    if held.ring_neighbours:
        was = [held.members[i].replica_id for i in ring_neighbourhood(len(held.members), held.rank_of(viewer))]
        if was != ids:
            raise ValueError(f"the ring neighbourhood {ids} of quorum {q.quorum_id} is not the {was} held from quorum "
                             f"{held.quorum_id}")
        rings = held.rings
    else:
        idx = [held.rank_of(r) for r in ids]
        rings = tuple((ring[idx[0]], ring[idx[1]], ring[idx[2]]) for ring in held.rings)
    return dataclasses.replace(q, rings=rings, first_shard=held.first_shard, ring_neighbours=True)


def ring_changes(old: Quorum, new: Quorum, first_shard: int, num_shards: int) -> tuple[str, ...]:
    """The members of ``new`` (in its ring order) whose FTAR endpoints of shards
    ``first_shard`` .. ``+num_shards-1`` are not what they were in ``old``: the members new
    since ``old`` and those whose endpoints changed (a restarted process). What a leader
    holding its view of ``old`` must be sent to build its view of ``new``
    (:func:`rings_with_delta`). Both quorums carry every member's endpoints (the lighthouse's)."""
    last = first_shard + num_shards
    had = {m.replica_id: m.ftar_addresses[first_shard:last] for m in old.members}
    return tuple(m.replica_id for m in new.members if had.get(m.replica_id) != m.ftar_addresses[first_shard:last])


def delta_view(view: Quorum, changed: tuple[str, ...]) -> Quorum:
    """``view`` (a :func:`process_view`) with each ring cut to the endpoints of ``changed``
    members, in their order: the rings of a delta answer."""
    rank = {m.replica_id: i for i, m in enumerate(view.members)}
    idx = [rank[r] for r in changed]
    return dataclasses.replace(view, rings=tuple(tuple(ring[i] for i in idx) for ring in view.rings))


def rings_with_delta(q: Quorum, changed: tuple[str, ...], held: Quorum) -> Quorum:
    """``q``, a view whose rings are a delta (:func:`delta_view`) against ``held``, this
    process's view of an earlier quorum, with whole rings: each member's endpoint from the
    delta if it is in ``changed``, else the one it had in ``held``. O(members x shards), once
    per change of membership. Raises ValueError when the delta does not fit ``held`` (the
    lighthouse's and the client's views disagree: a protocol error)."""
    if len(q.rings) != len(held.rings) or (q.rings and q.first_shard != held.first_shard):
        raise ValueError(f"a ring delta of {len(q.rings)} shard(s) from {q.first_shard} against a view of "
                         f"{len(held.rings)} from {held.first_shard}")
    new = {r: i for i, r in enumerate(changed)}
    if len(new) != len(changed) or not set(changed) <= set(q.member_ids):
        raise ValueError(f"the ring delta names members that are not the quorum's or names one twice: {changed[:8]}")
    old = {m.replica_id: i for i, m in enumerate(held.members)}
    missing = [r for r in q.member_ids if r not in new and r not in old]
    if missing:
        raise ValueError(f"the ring delta leaves out member(s) {missing[:8]} that the held view of quorum "
                         f"{held.quorum_id} does not have")
    src = [(True, new[r]) if r in new else (False, old[r]) for r in q.member_ids]
    rings = []
    for delta, ring in zip(q.rings, held.rings):
        if len(delta) != len(changed):
            raise ValueError(f"a delta ring lists {len(delta)} endpoint(s) for {len(changed)} changed member(s)")
        rings.append(tuple(delta[i] if fresh else ring[i] for fresh, i in src))
    return dataclasses.replace(q, rings=tuple(rings), first_shard=held.first_shard if held.rings else q.first_shard)


@dataclass(frozen=True)
class Lineage:
    """Which quorum last decided each step of a job, as much as the fence needs
    (rule 6 of the module docstring).

    ``entries`` are ``(quorum_id, step)``: quorum ``quorum_id`` was decided to
    train ``step`` (its max step). Only what :func:`forked_at` asks is kept:
    the smallest step decided by any quorum after a given one. An entry is
    dropped when a later quorum decides the same or an earlier step (it can
    never be that smallest step again), so the entries rise in both quorum id
    and step, the lookup is a binary search, and a job that never forks keeps
    one entry per quorum id change, at most ``limit`` (older ones are dropped
    and recorded in ``dropped_through``: a replica whose last quorum is that
    old is fenced, as its state cannot be checked; it is far behind anyway).
    """

    entries: tuple[tuple[int, int], ...] = ()
    dropped_through: int = 0  # quorum ids <= this were forgotten (0: none)
    limit: int = 1024

    def __post_init__(self) -> None:
        if self.limit < 1:
            raise ValueError(f"Lineage limit must be >= 1 (entries kept), got {self.limit}")

    def after(self, quorum_id: int, step: int) -> "Lineage":
        """The lineage once quorum ``quorum_id`` is decided at max step ``step``."""
        entries = list(self.entries)
        if entries and entries[-1][0] == quorum_id and entries[-1][1] <= step:
            return self  # the same quorum going on: it decided its first step already
        while entries and entries[-1][1] >= step:
            entries.pop()
        entries.append((quorum_id, step))
        dropped = self.dropped_through
        if len(entries) > self.limit:
            dropped = entries[len(entries) - self.limit - 1][0]
            entries = entries[len(entries) - self.limit:]
        return Lineage(tuple(entries), dropped, self.limit)

    def after_quorum(self, q: "Quorum") -> "Lineage":
        """The lineage once quorum ``q`` is decided (:meth:`after` of its id and max step), but
        for a quorum of only replicas restarted to rejoin, which decides nothing: recorded, its
        step 0 would fence every replica holding the job's state that came back after it (a
        chaos soak saw a rejoiner's waiting quorum fence the one healthy replica, at step 90,
        as forked)."""
        return self if q.only_rejoining else self.after(q.quorum_id, q.max_step)

    def answered_quorum(self, q: "Quorum") -> "Lineage":
        """A member's own lineage once answered ``q`` (:meth:`answered`; nothing for a quorum of
        only rejoiners, as :meth:`after_quorum`)."""
        return self if q.only_rejoining else self.answered(q.quorum_id, q.max_step)

    def answered(self, quorum_id: int, step: int) -> "Lineage":
        """A member's own lineage once it is answered quorum ``quorum_id`` at max step ``step``:
        ids only rise, so an answer of an older id (a delayed one) leaves it as it is."""
        newest = self.entries[-1][0] if self.entries else 0
        return self.after(quorum_id, step) if quorum_id > newest else self

    def merged(self, reported: Iterable[tuple[int, int]]) -> "Lineage":
        """This lineage with ``reported`` entries added: what a restarted lighthouse learns
        from the replicas (each reports the newest entries of its own lineage, the quorums
        it was answered). An entry is dropped exactly when a later entry of the union
        decided the same or an earlier step, so merging stacks gives the stack of all their
        decisions, in any order. Returns ``self`` when nothing is new."""
        have = set(self.entries)
        new = {(int(q), int(s)) for q, s in reported if int(q) > self.dropped_through} - have  # forgotten stays so
        if not new:
            return self
        out = Lineage(limit=self.limit)
        for q, s in sorted(have | new):
            out = out.after(q, s)
        return Lineage(out.entries, max(self.dropped_through, out.dropped_through), self.limit)

    def forgotten_through(self, quorum_id: int) -> "Lineage":
        """This lineage with quorum ids <= ``quorum_id`` forgotten, as its own limit forgets
        (a replica whose last quorum is that old is fenced: its state cannot be checked);
        ``self`` when they were already."""
        if quorum_id <= self.dropped_through:
            return self
        return Lineage(tuple(e for e in self.entries if e[0] > quorum_id), quorum_id, self.limit)

    def first_decided_after(self, quorum_id: int) -> tuple[int, int] | None:
        """``(quorum id, step)``: the smallest step decided by a quorum later than ``quorum_id``."""
        i = bisect.bisect_right(self.entries, (quorum_id, math.inf))
        return self.entries[i] if i < len(self.entries) else None


def forked_at(lineage: Lineage, last_quorum_id: int, step: int) -> tuple[int, int] | None:
    """Whether a replica at ``step`` (it committed steps < ``step``) whose last quorum was
    ``last_quorum_id`` holds a state the job's lineage no longer contains: ``(quorum id,
    step)`` of the later quorum that re-decided a step it had committed, else None.
    ``(0, 0)`` when its last quorum is older than the lineage remembers. A replica that
    was never in a quorum (``last_quorum_id`` 0: a fresh or restarted process) is judged
    by its step alone, as before."""
    if last_quorum_id <= 0 or step <= 0 or (lineage.entries and last_quorum_id >= lineage.entries[-1][0]):
        return None  # never in a quorum, or a member of the newest decided one (O(1))
    if last_quorum_id <= lineage.dropped_through:
        return (0, 0)
    hit = lineage.first_decided_after(last_quorum_id)
    if hit is not None and hit[1] <= step - 1:
        return hit
    return None


def fork_reason(replica_id: str, step: int, last_quorum_id: int, hit: tuple[int, int]) -> str:
    """Why replica ``replica_id`` at ``step`` (last quorum ``last_quorum_id``) holds a forked
    state, given :func:`forked_at`'s answer ``hit``."""
    if hit[0] == 0:
        return (f"replica {replica_id} at step {step} holds a state forked from the job's lineage: its last "
                f"quorum {last_quorum_id} is older than the lineage kept, so its state cannot be checked")
    return (f"replica {replica_id} at step {step} holds a state forked from the job's lineage: quorum {hit[0]} "
            f"re-decided step {hit[1]} after its last quorum {last_quorum_id}, so its commits of steps "
            f"{hit[1]}..{step - 1} are not in the job's model")


def lineage_report(lineage: Lineage) -> list[int]:
    """What a replica sends (QuorumRequest.lineage): its newest :data:`LINEAGE_REPORTED`
    entries, oldest first, flattened to ``[quorum_id, step, quorum_id, step, ...]``."""
    return [v for e in lineage.entries[-LINEAGE_REPORTED:] for v in e]


def unreported_through(pairs: Sequence[tuple[int, int]]) -> int:
    """The quorum ids a parsed lineage report cannot speak for: a report of
    :data:`LINEAGE_REPORTED` entries may have been cut (its sender holds older ones), so what
    was decided before its oldest entry is unknown, ids up to that entry's minus one; 0 for
    a shorter report, which is its sender's whole lineage. A restarted lighthouse forgets
    those ids (:meth:`Lineage.forgotten_through`) rather than judge a replica whose last
    quorum is among them by the entries it happens to hold: the entry of the quorum that
    forked it may be one of the cut ones (rule 6)."""
    return pairs[0][0] - 1 if len(pairs) >= LINEAGE_REPORTED else 0


def parse_lineage_report(values: Sequence[int], last_quorum_id: int | None = None) -> tuple[tuple[int, int], ...]:
    """The entries of a QuorumRequest.lineage (see :func:`lineage_report`); ValueError saying
    what is wrong when it is not pairs of increasing quorum ids > 0 and steps >= 0, or, given the
    request's ``last_quorum_id``, names a quorum past the one the replica was last a member of (or
    past MAX_REPORTED_QUORUM_ID): an honest replica's newest entry is its last quorum. (A restarted
    lighthouse merged such an entry into the job's lineage, and the entries it then appended were
    no longer sorted: honest replicas read as forked.) Its step is not compared with the request's:
    a replica whose catch-up did not commit reports the quorum's step while it asks at its own."""
    if len(values) % 2:
        raise ValueError(f"lineage has {len(values)} values: it must be (quorum_id, step) pairs")
    if len(values) > 2 * LINEAGE_REPORTED:
        raise ValueError(f"lineage has {len(values) // 2} entries: at most {LINEAGE_REPORTED} (the newest)")
    pairs = tuple((int(values[i]), int(values[i + 1])) for i in range(0, len(values), 2))
    for i, (q, s) in enumerate(pairs):
        if q <= 0 or s < 0:
            raise ValueError(f"lineage entry {i} is (quorum {q}, step {s}): quorum ids must be > 0, steps >= 0")
        if i and (q <= pairs[i - 1][0] or s <= pairs[i - 1][1]):
            raise ValueError(f"lineage entries must rise in quorum id and step (oldest first), got {list(pairs)}")
    if pairs:
        newest_q, newest_s = pairs[-1]
        cap = MAX_REPORTED_QUORUM_ID if last_quorum_id is None else min(last_quorum_id, MAX_REPORTED_QUORUM_ID)
        if newest_q > cap:
            raise ValueError(f"lineage entry (quorum {newest_q}, step {newest_s}) is past the last quorum this "
                             f"replica was a member of ({last_quorum_id}) or past {MAX_REPORTED_QUORUM_ID}: report "
                             "quorums this replica was answered")
    return pairs


def dead_replicas(heartbeats: Mapping[str, float], now: float, window: float) -> list[str]:
    """Replicas last heard from more than ``window`` seconds before ``now`` (ring order)."""
    return sorted((r for r, t in heartbeats.items() if now - t > window), key=ring_key)


def assign_sources(
    behind: Iterable[tuple[str, int]], healthy: tuple[str, ...]
) -> dict[str, tuple[str, ...]]:
    """Assign each behind replica one healthy source per local shard, round-robin.

    ``behind`` is ``(replica_id, local_world_size)`` pairs in ring order. Shard k
    of the i-th behind replica comes from ``healthy[(offset_i + k) % H]`` where
    ``offset_i`` is the number of shards assigned before it, so the fetch load
    is spread evenly over the healthy replicas and, whenever H >= shards, one
    replica's shards come from different sources.
    """
    if not healthy:
        raise ValueError("cannot assign recovery sources: no healthy replica")
    out: dict[str, tuple[str, ...]] = {}
    offset = 0
    for rid, shards in behind:
        out[rid] = tuple(healthy[(offset + k) % len(healthy)] for k in range(shards))
        offset += shards
    return out


def _fmt(ids: Iterable[str], limit: int = 8) -> str:
    ids = sorted(ids, key=ring_key)
    shown = ", ".join(ids[:limit])
    return f"[{shown}{', ...' if len(ids) > limit else ''}]"


def sends_last_members(q: Quorum, replica_id: str) -> bool:
    """Whether ``replica_id``, a member of ``q``, lists ``q``'s members (``last_members``) in
    its quorum requests: only the first :data:`LAST_MEMBERS_SENDERS` in ring order do.

    Only a lighthouse that does not remember the job's quorum (restarted) reads the list
    (:func:`incumbents_of`: the members it must wait for), and one requester's list is
    all it needs. Every member sending it made each request O(N) bytes and a round O(N^2):
    at 4,096 replicas 67 MB per round to parse and check, most of the flat lighthouse's
    time beside gRPC's per-call cost. Three senders, so that the list still arrives when
    one or two of them died with the lighthouse; if all three did, the restarted
    lighthouse knows the members only from their own reports (``last_quorum_id``) and
    does not wait for those it never hears from."""
    return any(m.replica_id == replica_id for m in q.members[:LAST_MEMBERS_SENDERS])


def incumbents_of(
    previous: Quorum | None,
    requests: Iterable[QuorumRequest],
    reported: Mapping[str, int] | None = None,
) -> tuple[set[str], int]:
    """The previous quorum's members and id, from memory or, after a lighthouse
    restart, from what the replicas report: the highest quorum id reported by a
    requester (``last_quorum_id``, with its ``last_members``) or by a heartbeat
    (``reported``: replica id -> its last quorum id). Every replica that reports
    that id is a member of it, so one that only heartbeats (it is mid-step) is
    an incumbent too, and restarted replicas at step 0 cannot form a quorum
    without it."""
    if previous is not None:
        return set(previous.member_ids), previous.quorum_id
    requests = list(requests)
    reported = dict(reported or {})
    for r in requests:
        reported[r.replica_id] = max(reported.get(r.replica_id, 0), r.last_quorum_id)
    best = max(reported.values(), default=0)
    if best <= 0:
        return set(), 0
    members = {rid for rid, q in reported.items() if q == best}
    for r in requests:
        if r.last_quorum_id == best:
            members.update(r.last_members)
    return members, best


@dataclass(frozen=True)
class Accusation:
    """``accuser`` caught ``accused`` breaking FTAR's protocol in quorum ``quorum_id``."""

    accuser: str
    accused: str
    quorum_id: int


def admit_accusation(acc: Accusation, current: Quorum | None, excluded: Collection[str],
                     last_admitted: Mapping[str, int]) -> tuple[bool, str]:
    """Whether ``acc`` excludes its accused replica from the next quorum, and why (not).

    ``current``: the job's latest quorum; ``excluded``: replicas already excluded
    from the next one; ``last_admitted``: accuser -> quorum id of its last
    admitted accusation. Pure: the caller records an admitted accusation.
    """
    if current is None or acc.quorum_id != current.quorum_id:
        have = current.quorum_id if current is not None else "none"
        return False, f"it names quorum {acc.quorum_id}, the job's latest is {have}"
    members = set(current.member_ids)
    if acc.accuser not in members or acc.accused not in members:
        return False, f"accuser and accused must both be members of quorum {acc.quorum_id}"
    if acc.accuser == acc.accused:
        return False, "a replica cannot accuse itself"
    if acc.accuser in excluded:
        return False, f"the accuser {acc.accuser} is itself excluded from the next quorum"
    if acc.accused in excluded:
        return False, f"{acc.accused} is already excluded from the next quorum"
    last = last_admitted.get(acc.accuser)
    if last is not None and acc.quorum_id - last < ACCUSATION_COOLDOWN_QUORUMS:
        return False, (f"{acc.accuser}'s last admitted accusation was in quorum {last}: at most one per "
                       f"{ACCUSATION_COOLDOWN_QUORUMS} quorums")
    return True, (f"{acc.accuser} caught {acc.accused} breaking FTAR's protocol in quorum {acc.quorum_id}: "
                  f"{acc.accused} is left out of the next quorum, then rejoins behind")


# The reasons that say the replicas asking are too few for any quorum (an exclusion is lifted then).
_TOO_FEW = ("no replica is asking for a quorum", "waiting for replicas:")


def decide_quorum(
    requests: Mapping[str, QuorumRequest],
    heartbeats: Mapping[str, float],
    previous: Quorum | None,
    config: QuorumConfig,
    now: float,
    quorum_id_floor: int = 0,
    reported_quorum_ids: Mapping[str, int] | None = None,
    condemned: Iterable[str] = (),
    excluded: Collection[str] = frozenset(),
    lineage: Lineage | None = None,
    lift_exclusion: bool = True,
) -> tuple[Quorum | None, str]:
    """Decide the quorum of one job, or explain why there is none yet.

    ``requests``: pending quorum requests by replica id. ``heartbeats``: time
    each replica was last heard from (same clock as ``now`` and ``arrived_at``).
    ``previous``: the job's last quorum (None on a fresh or restarted
    lighthouse). ``quorum_id_floor``: the highest quorum id any replica of the
    job reported (heartbeats included, until this lighthouse decided a quorum of the job).
    ``reported_quorum_ids``: each
    replica's last quorum id as its heartbeats report it (what a restarted
    lighthouse knows of replicas that are mid-step). ``condemned``: replicas whose
    state a fingerprint mismatch condemned (:mod:`fthsdp.control.sdc`): listed
    behind even at the top step, so they fetch the majority's state. ``excluded``:
    replicas left out of this decision entirely (accused of breaking FTAR's
    protocol; see the module docstring). ``lineage``: which quorum last decided
    each step (rule 6: a requester whose state forked from it is fenced, i.e.
    behind). Returns ``(quorum, reason)`` with
    ``quorum`` None while the rules in the module docstring say wait.

    An exclusion never starves the job: when the replicas left once it is applied are too few
    to form any quorum (fewer than ``min_replicas`` asking, or none: the accuser died after
    accusing), while with the excluded ones a quorum forms, the exclusion is lifted and the
    reason says so (otherwise it holds until a quorum forms, and none ever would);
    ``lift_exclusion=False`` decides with the exclusion whatever the outcome.
    """
    if excluded and lift_exclusion:
        args = (requests, heartbeats, previous, config, now, quorum_id_floor, reported_quorum_ids, condemned)
        q, why = decide_quorum(*args, excluded=excluded, lineage=lineage, lift_exclusion=False)
        if q is None and why.startswith(_TOO_FEW):
            q2, why2 = decide_quorum(*args, lineage=lineage)
            if q2 is not None:
                return q2, f"{why2}; exclusion of {_fmt(sorted(excluded, key=ring_key))} lifted: without them {why}"
        return q, why
    excluded_note = ""
    if excluded:
        requests = {r: q for r, q in requests.items() if r not in excluded}
        heartbeats = {r: t for r, t in heartbeats.items() if r not in excluded}
        if reported_quorum_ids:
            reported_quorum_ids = {r: q for r, q in reported_quorum_ids.items() if r not in excluded}
        excluded_note = f"; excluded {_fmt(sorted(excluded, key=ring_key))} (accused of breaking FTAR's protocol)"
    if not requests:
        return None, "no replica is asking for a quorum" + excluded_note
    window = config.heartbeat_window_s

    def last_seen(rid: str) -> float:
        t = heartbeats.get(rid, -math.inf)
        req = requests.get(rid)
        return max(t, req.arrived_at) if req is not None else t

    live = {r for r in heartbeats if now - last_seen(r) <= window}
    live.update(r for r in requests if now - last_seen(r) <= window)
    candidates = [requests[r] for r in requests if r in live]
    stale = [r for r in requests if r not in live]
    stale_note = f"; ignoring requests of {_fmt(stale)} (silent > {window:g}s)" if stale else ""
    cand_ids = {c.replica_id for c in candidates}
    not_asking = live - cand_ids

    # Rule 2: min_replicas.
    if len(candidates) < config.min_replicas:
        waiting = f"; live but not asking: {_fmt(not_asking)}" if not_asking else ""
        return None, (
            f"waiting for replicas: {len(candidates)} live requesting, min_replicas={config.min_replicas}"
            f"{waiting}{stale_note}"
        )

    # Rule 3a: live incumbents are waited for until they ask or are declared dead.
    incumbents, prev_qid = incumbents_of(
        previous, candidates, {r: q for r, q in (reported_quorum_ids or {}).items() if r in live})
    rebuilt = previous is None and prev_qid > 0
    busy = not_asking & incumbents
    if busy:
        return None, (
            f"waiting for {len(busy)} live member(s) of quorum {prev_qid} not asking yet {_fmt(busy)} "
            f"(until they ask or stay silent > {window:g}s); {len(candidates)} asking{stale_note}"
        )
    # After a lighthouse restart, reported incumbents it has not heard from yet are
    # probably reconnecting (their heartbeats resume within a reconnect backoff):
    # give them two detection windows from the round's first request, once.
    # Only the first members send the list (sends_last_members): when none of them asked,
    # the members of quorum prev_qid are not known, and a requester that was only slow
    # (hung, its last quorum older than the others') could otherwise form a quorum alone
    # before the others' heartbeats report the newer one -- and reuse its id. Found by the
    # emulation: a replica hung past a lighthouse restart got a one-member "quorum 5"
    # while the others held the old lighthouse's quorum 5.
    unheard_incumbents = incumbents - live - set(heartbeats) - set(excluded)
    members_unknown = rebuilt and not any(c.last_members for c in candidates if c.last_quorum_id == prev_qid)
    round_start = min(c.arrived_at for c in candidates)
    if rebuilt and (unheard_incumbents or members_unknown) and now - round_start < 2 * window:
        missing = (f"{len(unheard_incumbents)} member(s) of quorum {prev_qid} not heard from yet "
                   f"{_fmt(unheard_incumbents)}" if unheard_incumbents else
                   f"the members of quorum {prev_qid} (no requester listed them)")
        return None, (
            f"lighthouse restarted: waiting up to {2 * window - (now - round_start):.2f}s more for "
            f"{missing}; {len(candidates)} asking{stale_note}"
        )
    # Rule 3b: newcomers are waited for at most join_timeout_s after the last incumbent asked.
    already_left_out = set(previous.left_out) if previous is not None else set()
    newcomers = not_asking - already_left_out
    asked = [c.arrived_at for c in candidates if c.replica_id in incumbents]
    ready_at = max(asked) if asked else min(c.arrived_at for c in candidates)
    waited = now - ready_at
    if newcomers and waited < config.join_timeout_s:
        return None, (
            f"waiting up to {config.join_timeout_s - waited:.2f}s more for {len(newcomers)} live "
            f"newcomer(s) not asking yet {_fmt(newcomers)}; {len(candidates)} asking{stale_note}"
        )
    unheard = config.num_configured - len(live | set(heartbeats))
    if previous is None and not rebuilt and unheard > 0 and waited < config.join_timeout_s:
        return None, (
            f"first quorum: waiting up to {config.join_timeout_s - waited:.2f}s more for {unheard} of "
            f"{config.num_configured} configured replica(s) never heard from; {len(candidates)} asking{stale_note}"
        )

    # Rule 4: split-brain guard (strict majority of the live replicas).
    if 2 * len(candidates) <= len(live):
        need = len(live) // 2 + 1
        return None, (
            f"split-brain guard: only {len(candidates)} of {len(live)} live replicas asking, "
            f"a quorum needs a strict majority ({need}); live but not asking: {_fmt(not_asking)}"
            f"{stale_note}"
        )

    # Rule 6: lineage fence. A requester whose last quorum is the newest decided one
    # (every member of a running quorum) is skipped in O(1).
    fenced: dict[str, tuple[int, int]] = {}
    if lineage is not None and (lineage.entries or lineage.dropped_through):
        newest = lineage.entries[-1][0] if lineage.entries else 0
        for c in candidates:
            if 0 < c.last_quorum_id < newest or 0 < c.last_quorum_id <= lineage.dropped_through:
                hit = forked_at(lineage, c.last_quorum_id, c.step)
                if hit is not None:
                    fenced[c.replica_id] = hit
    fence_note = ""
    if fenced:
        top = max((c.step for c in candidates if c.replica_id not in fenced), default=None)
        need = max(h[1] for h in fenced.values())
        by = min(fenced.values())
        what = (f"quorum {by[0]} re-decided step {by[1]}" if by[0] else
                "their last quorum is older than the lineage kept")
        if top is None or top < need:
            return None, (
                f"lineage fence: {len(fenced)} requester(s) {_fmt(fenced)} hold a state that forked from the "
                f"job's lineage ({what} after their last quorum); waiting for a replica holding the lineage's "
                f"state at step >= {need} (the fenced fetch it; {'none asks' if top is None else f'the others are at step {top}'})"
                f"{stale_note}")
        fence_note = f"; fenced, behind: {_fmt(fenced)} (state forked from the job's lineage: {what})"

    # Form it.
    ordered = sorted(candidates, key=lambda c: ring_key(c.replica_id))
    members = tuple(
        Member(c.replica_id, c.step, tuple(c.ftar_addresses), c.state_server_address, c.local_world_size,
               c.num_processes, tuple(c.state_server_addresses), rejoining=c.rejoin and c.step == 0)
        for c in ordered
    )
    max_step = max(m.step for m in members if m.replica_id not in fenced)
    condemned = set(condemned) & cand_ids
    healthy = tuple(m.replica_id for m in members
                    if m.step == max_step and m.replica_id not in condemned and m.replica_id not in fenced)
    if not healthy:
        return None, (
            f"every requester at the top step {max_step} is condemned by a fingerprint mismatch "
            f"{_fmt(condemned)}: no clean state to rejoin from; waiting for a replica holding the majority's state"
            f"{stale_note}")
    healthy_ids = frozenset(healthy)  # a set: `not in healthy` (a tuple) made this O(N^2), 2 s at 8,192
    behind = tuple(m.replica_id for m in members if m.replica_id not in healthy_ids)
    lws = {m.replica_id: m.local_world_size for m in members}
    recovery = assign_sources(((b, lws[b]) for b in behind), healthy)
    known = set(heartbeats) | set(requests)
    num_configured = config.num_configured or len(known)

    # Rule 5: quorum id.
    failed = sorted((c.replica_id for c in candidates if c.commit_failed), key=ring_key)
    identity = tuple(m.identity() for m in members)
    if previous is None and not rebuilt:
        quorum_id, why_id = 1, "first quorum"
    elif previous is None:
        quorum_id, why_id = prev_qid + 1, f"lighthouse restarted: replicas last saw quorum {prev_qid}"
    elif failed:
        quorum_id, why_id = previous.quorum_id + 1, f"commit failed on {_fmt(failed)}"
    elif identity != tuple(m.identity() for m in previous.members):
        old, new = set(previous.member_ids), set(cand_ids)
        delta = []
        if new - old:
            delta.append(f"+{_fmt(new - old)}")
        if old - new:
            delta.append(f"-{_fmt(old - new)}")
        if not delta:
            delta.append("addresses changed")
        quorum_id, why_id = previous.quorum_id + 1, "membership changed " + " ".join(delta)
    else:
        quorum_id, why_id = previous.quorum_id, "same membership"
    floor = max([quorum_id_floor, *(c.last_quorum_id for c in candidates)])
    capped = floor > MAX_REPORTED_QUORUM_ID
    floor = min(floor, MAX_REPORTED_QUORUM_ID)
    reused = previous is None or quorum_id != previous.quorum_id
    if quorum_id < floor or (quorum_id == floor and reused):
        quorum_id, why_id = floor + 1, f"{why_id}; above quorum {floor} reported by a replica"
    if capped and quorum_id == MAX_REPORTED_QUORUM_ID + 1:
        why_id += f" (a higher id was reported: followed only up to {MAX_REPORTED_QUORUM_ID})"
    if quorum_id > MAX_QUORUM_ID:
        return None, (f"quorum ids of this job are used up: the next would be {quorum_id}, past {MAX_QUORUM_ID} "
                      f"({why_id}); a replica reported an id near the limit. Resume the job under a new job id")

    left_out = tuple(sorted(not_asking, key=ring_key))
    if left_out:
        how = f"without live newcomer(s) {_fmt(left_out)} (join timeout {config.join_timeout_s:g}s or left out before)"
    else:
        how = "every live replica asking"
    reason = (
        f"quorum {quorum_id} ({why_id}): {len(members)} members at max step {max_step}, "
        f"{len(healthy)} healthy, {len(behind)} behind; {how}{stale_note}{excluded_note}{fence_note}"
    )
    if condemned:
        reason += f"; condemned by a fingerprint mismatch (rejoin from the majority): {_fmt(condemned)}"

    quorum = Quorum(
        quorum_id=quorum_id,
        members=members,
        max_step=max_step,
        healthy=healthy,
        behind=behind,
        recovery=recovery,
        num_healthy=len(healthy),
        num_configured=num_configured,
        reason=reason,
        left_out=left_out,
    )
    return quorum, reason

