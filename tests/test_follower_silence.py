"""The group watchdog's judgement of a follower's silence (fthsdp.replica.group): pure, then
the watchdog's threads over an in-memory key-value store (the runtime's store has the same
two calls)."""

from __future__ import annotations

import threading
import time

from fthsdp.replica.group import FollowerSilence, GroupSpec, GroupWatchdog


def test_a_follower_that_stops_beating_is_silent_after_the_window():
    j = FollowerSilence(interval_s=0.1, silent_s=0.8)
    t, v = 0.0, 0
    for _ in range(20):  # beating every round: never silent
        t += 0.1
        v += 1
        j.poll(t)
        assert j.observe(1, str(v), t) is None
    stopped_at = t
    silent = None
    while silent is None:
        t += 0.1
        j.poll(t)
        silent = j.observe(1, str(v), t)
    assert 0.8 < silent <= 0.9 + 1e-9 and abs(t - stopped_at - silent) < 1e-9
    assert j.forgiven_s == 0.0


def test_a_late_leader_does_not_blame_its_follower_for_its_own_delay():
    """The host stalls both processes 2 s: the leader's next round comes 2 s late and the
    follower's beat has not moved. Not silent; a follower that then beats is fine, one that
    stays frozen is judged silent 0.8 s of punctual rounds later."""
    for beats_again in (True, False):
        j = FollowerSilence(interval_s=0.1, silent_s=0.8)
        t = 1.0
        j.poll(t)
        j.observe(1, "5", t)
        t += 2.1  # the stall
        j.poll(t)
        assert j.observe(1, "5", t) is None
        assert abs(j.forgiven_s - 2.0) < 1e-9
        rounds, silent = 0, None
        while silent is None and rounds < 30:
            t += 0.1
            rounds += 1
            j.poll(t)
            silent = j.observe(1, str(5 + rounds) if beats_again else "5", t)
        if beats_again:
            assert silent is None
        else:
            assert silent is not None and 7 <= rounds <= 9, rounds  # ~0.8 s of punctual rounds
    # A delay of up to one interval is a scheduling hiccup, not forgiven.
    j = FollowerSilence(interval_s=0.1, silent_s=0.8)
    j.poll(0.0)
    j.observe(1, "1", 0.0)
    j.poll(0.19)
    assert j.forgiven_s == 0.0


class Store:
    """In memory, the two calls GroupWatchdog makes of jax.distributed's key-value client."""

    def __init__(self) -> None:
        self.kv: dict[str, str] = {}
        self.lock = threading.Lock()

    def key_value_set(self, key: str, value: str, allow_overwrite: bool = False) -> None:
        with self.lock:
            self.kv[key] = value

    def key_value_try_get(self, key: str) -> str:
        with self.lock:
            if key not in self.kv:
                raise KeyError(key)  # the runtime raises NOT_FOUND
            return self.kv[key]


def test_the_watchdog_names_a_follower_that_stops_and_only_it():
    store, fired = Store(), []
    done = threading.Event()

    def on_silent(p: int, s: float) -> None:
        fired.append((p, s, time.monotonic()))
        done.set()

    leader = GroupWatchdog(GroupSpec(1, 0, 3, "127.0.0.1:1"), 0.05, 0.4, on_silent, client=store)
    followers = [GroupWatchdog(GroupSpec(1, p, 3, "127.0.0.1:1"), 0.05, 0.4, None, client=store) for p in (1, 2)]
    for w in [leader, *followers]:
        w.start()
    try:
        time.sleep(0.8)
        assert not fired  # both beating
        followers[1].stop()  # process 2 freezes
        stopped = time.monotonic()
        assert done.wait(5.0)
        p, silent, at = fired[0]
        assert p == 2 and silent > 0.4 and at - stopped < 2.0, fired
    finally:
        for w in [leader, *followers]:
            w.stop()
