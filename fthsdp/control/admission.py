"""Per-connection and per-job fairness of the lighthouse: who may use its one event loop, how fast.

**Why.** The lighthouse is one asyncio event loop. gRPC hands it calls in the
order they arrive, so a client that keeps many calls in flight (a flood: a
stranger without credentials, or a holder of one job's secret gone rogue)
fills the queue ahead of every other job's calls, and each of them waits for
the whole queue: measured, a 16-call flood slowed another job's heartbeats
x7 (experiments/auth_cost.py). Refusing the flood faster does not help much,
since a refused client just sends again at once. What helps is *back-pressure*:
a call over its principal's budget is **held** (an idle coroutine, no CPU)
until the budget allows it, so a client with N calls in flight ends up with
N calls parked and sends nothing more; the loop serves the flood at its
budgeted rate and everyone else at theirs. Only a client that piles up more
than ``max_held`` parked calls (or one that would wait longer than the hold
bound) is refused, with ``RESOURCE_EXHAUSTED`` and the reason.

Principals and budgets (token buckets; a call takes one token, a refused call
of a connection costs ``failure_cost`` tokens more):

* the **connection** (gRPC's peer string, ``ipv4:host:port``): every call is
  charged to it *before* its body is parsed or its credential checked, so a
  flood costs the lighthouse its connection's budget and no more. One
  process of a replica uses one connection and sends ~10-60 calls per second
  (heartbeats at 10 Hz, a quorum per step); the default budget is 100/s.
  A connection whose calls fail (no or a bad credential, a malformed body)
  burns its budget ``failure_cost`` times faster: a stranger gets a few
  refusals a second, never thousands. A call that registers a new replica id
  costs ``new_id_cost`` more (a process registers its id once; an insider
  inventing ids gets ~10 a second per connection).
  A new connection starts with a small part of its burst
  (``new_connection_tokens``: one refused call spends it), so opening a
  fresh connection per call buys a stranger one refusal per TCP and HTTP/2
  handshake, and it then waits like the rest. (Budgets are per connection,
  not per host: a stranger must never be able to hold back a replica that
  starts or restarts on its host; tried, and it kept a restarted replica
  from rejoining beside a flood, tests/test_security_lighthouse.py.)
* the **job**, after its credential checked: a budget that scales with the
  job's registered size (``job_calls_per_s + replica_calls_per_s`` x its
  replicas), so a 16,384-replica job's heartbeats are its normal load, while
  one job (even with its valid secret, over many connections) cannot take
  the loop from the others.

Everything here is pure (times in, decisions out) and unit-tested without a
server; :mod:`fthsdp.control.guard` applies it to gRPC calls.
"""

from __future__ import annotations

import math
from collections import OrderedDict
from dataclasses import dataclass

__all__ = ["FairnessLimits", "Bucket", "Admission", "Decision", "SERVE"]


@dataclass(frozen=True)
class FairnessLimits:
    """Budgets of :class:`Admission` (calls per second, bursts in calls)."""

    # Per gRPC connection. A replica process sends ~10-60 calls/s (heartbeats at 10 Hz, a quorum per
    # step); an emulated replica of P processes shares one connection (10 P + a quorum per step).
    # Measured on 2 loaded cores, a lighthouse serves ~1,000-3,000 calls/s in all: one connection
    # at this rate takes a fraction of that, never the loop (experiments/auth_cost.py, flood).
    connection_calls_per_s: float = 100.0
    connection_burst: int = 200
    new_connection_tokens: int = 20  # what a new connection starts with (its bucket fills to the burst)
    # A relay's stream (fthsdp/control/relay.py) is charged per batch, and one batch carries the
    # messages of a block of processes that queued while its last one went out: up to one per
    # message when they trickle in (32 leaders beating at 10 Hz: 320/s). Its refused messages cost
    # ``failure_cost`` calls of a connection's rate each (the same time), so a stranger's stream is
    # held back as soon as a stranger's connection.
    relay_batches_per_s: float = 5000.0
    relay_burst: int = 10000
    failure_cost: float = 20.0  # a refused call costs its connection this many tokens (1 + this)
    new_id_cost: float = 10.0  # so does a call that registers a new replica id (a process does it once)
    job_calls_per_s: float = 2000.0  # per job, plus ...
    replica_calls_per_s: float = 100.0  # ... this much per replica the job has registered
    max_held: int = 64  # calls one principal may have parked; more are refused at once
    max_held_total: int = 65536  # parked calls over all principals
    max_principals: int = 65536  # connections / jobs remembered (least recently used forgotten)

    def __post_init__(self) -> None:
        for k, v in self.__dict__.items():
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or v <= 0:
                raise ValueError(f"FairnessLimits.{k}={v!r}: must be a finite number > 0")


class Bucket:
    """A token bucket that may go into debt: :meth:`reserve` books a call and says how
    long it must wait for its token (0: now), so that held calls leave at the bucket's rate
    in arrival order."""

    __slots__ = ("rate", "burst", "tokens", "at", "held")

    def __init__(self, rate: float, burst: float, now: float, tokens: float | None = None) -> None:
        self.rate, self.burst, self.at, self.held = rate, float(burst), now, 0
        self.tokens = float(burst) if tokens is None else min(float(tokens), float(burst))

    def _refill(self, now: float) -> None:
        if now > self.at:
            self.tokens = min(self.burst, self.tokens + (now - self.at) * self.rate)
            self.at = now

    def wait_s(self, now: float, cost: float = 1.0) -> float:
        """How long a call of ``cost`` tokens would wait if booked now (every call asks: kept to
        plain arithmetic)."""
        if now > self.at:
            t = self.tokens + (now - self.at) * self.rate
            self.tokens = t if t < self.burst else self.burst
            self.at = now
        short = cost - self.tokens
        return short / self.rate if short > 0.0 else 0.0

    def reserve(self, now: float, cost: float = 1.0) -> float:
        """Book ``cost`` tokens (the bucket may go into debt); the wait until they exist."""
        w = self.wait_s(now, cost)
        self.tokens -= cost
        return w

    def charge(self, now: float, cost: float, max_debt: float | None = None) -> None:
        """Take ``cost`` tokens after the fact (a refused call's extra price), leaving at most
        ``max_debt`` tokens owed (default: the burst and a minute of the rate)."""
        self._refill(now)
        floor = -(self.burst + self.rate * 60.0 if max_debt is None else max_debt)
        self.tokens = max(self.tokens - cost, floor)

    def set_rate(self, rate: float, burst: float) -> None:
        self.rate, self.burst = rate, float(burst)


@dataclass(frozen=True)
class Decision:
    """What to do with a call: hold it ``wait_s`` (>= 0), then serve it, or refuse it with
    ``refusal`` when one is given."""

    wait_s: float = 0.0
    refusal: str = ""


SERVE = Decision()  # serve now: the one decision most calls get (frozen, so shared)
_SERVED = (SERVE, None)  # ... and nothing held to release


def _lru_add(table: OrderedDict, key: str, b: Bucket, cap: int) -> Bucket:
    """``b`` remembered under ``key`` (new), the least recently used principals forgotten past ``cap``."""
    table[key] = b
    while len(table) > cap:
        old_key, old = next(iter(table.items()))
        if old.held:  # never forget a principal with calls parked (its count must come back to 0)
            table.move_to_end(old_key)
            break
        table.popitem(last=False)
    return b


class Admission:
    """The lighthouse's budgets: call :meth:`connection` before a call's body is looked at,
    :meth:`job` once its credential checked, :meth:`refused` when it was refused;
    :meth:`release` after a held call's wait."""

    def __init__(self, limits: FairnessLimits | None = None) -> None:
        self.limits = limits or FairnessLimits()
        self._connections: OrderedDict[str, Bucket] = OrderedDict()
        self._jobs: OrderedDict[str, Bucket] = OrderedDict()
        self.held_total = 0
        self.stats = {"held": 0, "refused": 0}

    def _served(self, b: Bucket, now: float) -> bool:
        """Whether the call is served now (its token booked): what most calls get, decided with
        no allocation. Otherwise :meth:`_decide` says how it is held or refused."""
        if b.wait_s(now) == 0.0 and b.held < self.limits.max_held and self.held_total < self.limits.max_held_total:
            b.tokens -= 1.0  # booked (wait_s refilled the bucket at ``now`` already)
            return True
        return False

    def _decide(self, b: Bucket, now: float, max_wait_s: float, describe) -> Decision:
        """``describe()``: (who, budget) for a refusal's reason, built only when one is given
        (two formatted strings per call were most of this module's cost, ~10 us a message of
        the lighthouse's ~50 at 512 leaders, for words read only when a call is refused)."""
        lim = self.limits
        if b.held >= lim.max_held or self.held_total >= lim.max_held_total:
            who, budget = describe()
            self.stats["refused"] += 1
            return Decision(refusal=(
                f"{who} has {b.held} calls held back already (at most {lim.max_held}; {budget}): this call is "
                "refused; send fewer calls at once, or retry after the ones in flight are answered"))
        w = b.wait_s(now)
        if w > max_wait_s:
            # Held for the whole bound, then refused: answered at once, a flooding client would
            # just send again, and the refusals alone would take the loop.
            who, budget = describe()
            self.stats["refused"] += 1
            b.held += 1
            self.held_total += 1
            return Decision(wait_s=max_wait_s, refusal=(
                f"{who} is over its budget ({budget}): the call would have waited {w:.2f} s, longer than "
                f"{max_wait_s:.2f} s: it is refused; slow down and retry later"))
        b.tokens -= 1.0  # booked (wait_s refilled the bucket at ``now`` already)
        if w == 0.0:  # only when called without _served first: a call that need not wait is served
            return SERVE
        b.held += 1
        self.held_total += 1
        self.stats["held"] += 1
        return Decision(wait_s=w)

    def connection(self, peer: str, now: float, max_wait_s: float, relay: bool = False) -> tuple[Decision, object]:
        """The decision for a call arriving on connection ``peer`` (``relay``: a relay's batch, on
        its own budget), and a token to hand back to :meth:`release` if it was held. Charged
        before any parsing."""
        lim = self.limits
        rate, burst = (lim.relay_batches_per_s, lim.relay_burst) if relay else \
            (lim.connection_calls_per_s, lim.connection_burst)
        b = self._connections.get(peer)
        if b is None:
            b = _lru_add(self._connections, peer, Bucket(rate, burst, now, lim.new_connection_tokens),
                         lim.max_principals)
        else:
            self._connections.move_to_end(peer)
        if self._served(b, now):
            return _SERVED

        def describe() -> tuple[str, str]:
            what = "relay stream" if relay else "connection"
            return f"{what} {peer}", (
                f"{rate:g} {'batches' if relay else 'calls'}/s per {what}, a refused "
                f"{'message' if relay else 'call'} counts {1 + lim.failure_cost * rate / lim.connection_calls_per_s:g}")

        d = self._decide(b, now, max_wait_s, describe)
        return d, (b if d.wait_s > 0 else None)

    def job(self, job_id: str, replicas: int, now: float, max_wait_s: float) -> tuple[Decision, object]:
        """The decision for an authenticated call of ``job_id``, a job of ``replicas`` registered
        replicas (its budget follows its size)."""
        lim = self.limits
        rate = lim.job_calls_per_s + lim.replica_calls_per_s * max(0, replicas)
        b = self._jobs.get(job_id)
        if b is None:
            b = _lru_add(self._jobs, job_id, Bucket(rate, rate, now), lim.max_principals)
        else:
            self._jobs.move_to_end(job_id)
            if b.rate != rate:
                b.set_rate(rate, rate)
        if self._served(b, now):
            return _SERVED
        d = self._decide(b, now, max_wait_s, lambda: (
            f"job {job_id!r}", f"{lim.job_calls_per_s:g} calls/s + {lim.replica_calls_per_s:g} per registered replica "
                               f"= {rate:g} calls/s"))
        return d, (b if d.wait_s > 0 else None)

    def release(self, held: object) -> None:
        """A held call's wait is over (served, refused or cancelled)."""
        if isinstance(held, Bucket) and held.held > 0:
            held.held -= 1
            self.held_total -= 1

    def new_id(self, peer: str, now: float) -> None:
        """A call of connection ``peer`` registered a new replica id: the dearest accepted call
        (bookkeeping kept for the detection window and more), which a process makes once."""
        b = self._connections.get(peer)
        if b is not None:
            b.charge(now, self.limits.new_id_cost)

    def refused(self, peer: str, now: float) -> None:
        """A call of connection ``peer`` was refused (malformed, unauthenticated, not allowed). It
        costs the same *time* of its budget on any stream: ``failure_cost`` calls of a connection's
        rate (a relay stream's budget is faster, so its refusals cost it more tokens)."""
        b = self._connections.get(peer)
        if b is not None:
            b.charge(now, self.limits.failure_cost * b.rate / self.limits.connection_calls_per_s)
