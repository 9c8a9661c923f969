"""The group watchdog's judgement of a follower's silence (fthsdp.replica.group): pure, then
the watchdog's threads over the runtime's own key-value store (jax.distributed's coordination
service, real gRPC on loopback); a fault (a slow or failing write) is injected by a wrapper
around the real client."""

from __future__ import annotations

import threading
import time

import pytest

from fthsdp.replica.group import FollowerSilence, GroupSpec, GroupWatchdog
from test_replica_group import _kv_pair, _kv_shutdown


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


def test_before_training_a_follower_gets_the_startup_window_then_the_strict_one_afresh():
    """While its replica starts (imports, compiles beside the rest of the job), a follower may
    miss its beats for longer than the detection window without taking the replica out; from
    the first step the detection window applies, counted from that step, so a follower that
    froze while starting is caught one window after training begins."""
    j = FollowerSilence(interval_s=0.1, silent_s=0.8, startup_silent_s=8.0)
    t = 0.0
    j.poll(t)
    j.observe(1, "1", t)
    for _ in range(30):  # 3 s without a beat while starting: not silent
        t += 0.1
        j.poll(t)
        assert j.observe(1, "1", t) is None
    j.training(t)
    began = t
    silent = None
    while silent is None:
        t += 0.1
        j.poll(t)
        silent = j.observe(1, "1", t)
    assert 0.8 < t - began <= 0.9 + 1e-9 and 0.8 < silent <= 0.9 + 1e-9  # one strict window after the start
    # Past the startup window while starting: silent all the same.
    j = FollowerSilence(interval_s=0.1, silent_s=0.8, startup_silent_s=2.0)
    j.poll(0.0)
    j.observe(1, "1", 0.0)
    t, silent = 0.0, None
    while silent is None and t < 5.0:
        t += 0.1
        j.poll(t)
        silent = j.observe(1, "1", t)
    assert silent is not None and 2.0 < t <= 2.1 + 1e-9, t
    # Without a startup window the detection window applies from the start.
    assert FollowerSilence(interval_s=0.1, silent_s=0.8).window_s == 0.8
    # A follower that never beat (it froze before its first beat) is judged from training on:
    # not judged at all, its leader waited in the first collective for ever.
    j = FollowerSilence(interval_s=0.1, silent_s=0.8, startup_silent_s=8.0)
    j.poll(0.0)
    j.training(0.0, range(1, 3))
    j.observe(1, "1", 0.0)  # follower 1 beats on; follower 2 never did ("" read)
    t, silent = 0.0, None
    while silent is None and t < 5.0:
        t += 0.1
        j.poll(t)
        assert j.observe(1, str(int(t * 10)), t) is None
        silent = j.observe(2, "", t)
    assert 0.8 < t <= 0.9 + 1e-9, t


def test_the_startup_window_is_ten_detection_windows_within_the_startup_limit():
    from fthsdp.timeouts import Timeouts

    assert Timeouts().follower_startup_silence_s == 8.0
    assert Timeouts(startup_timeout_s=3.0).follower_startup_silence_s == 3.0
    assert Timeouts(detect_s=5.0, allreduce_timeout_s=60.0, startup_timeout_s=6.0).follower_startup_silence_s == 6.0


def test_a_lone_rejoiner_waits_at_least_for_a_replica_cut_off_by_a_stopped_relay():
    """Timeouts.alone_rejoin_s: ten detection windows within the start-up limit, but never less
    than a relay's silence limit + a beat's deadline + a detection window (the moment a healthy
    replica behind a stopped relay needs to be heard again), however short those two are."""
    from fthsdp.control.session_client import RelayPath
    from fthsdp.timeouts import Timeouts

    assert Timeouts().alone_rejoin_s == 8.0
    t = Timeouts(heartbeat_interval_s=0.1, detect_s=0.3)
    assert t.alone_rejoin_s == RelayPath.SILENCE_S + t.heartbeat_rpc_s + 0.3 > 10 * 0.3
    assert Timeouts(startup_timeout_s=1.0).alone_rejoin_s == RelayPath.SILENCE_S + 0.4 + 0.8


@pytest.fixture
def kv():
    """Two clients of a fresh coordination service (the leader's, a follower's)."""
    service, clients = _kv_pair()
    try:
        yield clients
    finally:
        _kv_shutdown(service, clients)


class Wrapped:
    """A real key-value client with a fault injected into some of its calls (subclasses)."""

    def __init__(self, real) -> None:
        self.real = real

    def __getattr__(self, name: str):
        return getattr(self.real, name)


def test_the_watchdog_names_a_follower_that_stops_and_only_it(kv):
    fired = []
    done = threading.Event()

    def on_silent(p: int, s: float) -> None:
        fired.append((p, s, time.monotonic()))
        done.set()

    leader = GroupWatchdog(GroupSpec(1, 0, 3, "127.0.0.1:1"), 0.05, 0.4, on_silent, client=kv[0])
    followers = [GroupWatchdog(GroupSpec(1, p, 3, "127.0.0.1:1"), 0.05, 0.4, None, client=kv[1]) for p in (1, 2)]
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


def test_stop_waits_for_the_thread_so_no_native_call_outlives_the_process(kv):
    """stop() returns with the watchdog's thread ended (it calls the runtime's native client;
    one still inside such a call while the interpreter finalizes can abort the process)."""
    calls = threading.Semaphore(0)

    class Slow(Wrapped):
        def key_value_set(self, key, value, allow_overwrite=False):
            calls.release()
            time.sleep(0.3)  # a call in flight when stop() is asked
            self.real.key_value_set(key, value, allow_overwrite)

    slow = Slow(kv[1])
    follower = GroupWatchdog(GroupSpec(1, 1, 2, "127.0.0.1:1"), 0.02, 0.4, None, client=slow).start()
    assert calls.acquire(timeout=5.0)
    t0 = time.monotonic()
    follower.stop()
    assert not follower._thread.is_alive() and time.monotonic() - t0 > 0.1
    leader = GroupWatchdog(GroupSpec(1, 0, 2, "127.0.0.1:1"), 0.02, 0.4, lambda p, s: None, client=kv[0]).start()
    leader.stop()
    assert not leader._thread.is_alive()
    GroupWatchdog(GroupSpec(1, 0, 1, "127.0.0.1:1"), 0.02, 0.4, None, client=kv[0]).start().stop()  # never started


def test_a_follower_beats_on_after_a_failed_write(kv):
    """One failed write to the store (a transient error of the runtime's client) ended the
    follower's beat thread: a live follower was then judged silent and its replica restarted."""

    class Flaky(Wrapped):
        failed = 0

        def key_value_set(self, key, value, allow_overwrite=False):
            if value in ("2", "3") and self.failed < 2:
                self.failed += 1
                raise RuntimeError("UNAVAILABLE: a transient error of the coordination service")
            self.real.key_value_set(key, value, allow_overwrite)

    def beats() -> int:
        try:
            return int(kv[0].key_value_try_get("fthsdp/r1/alive/p1"))
        except Exception:  # noqa: BLE001 - NOT_FOUND before the first beat
            return 0

    store = Flaky(kv[1])
    follower = GroupWatchdog(GroupSpec(1, 1, 2, "127.0.0.1:1"), 0.02, 0.4, None, client=store).start()
    try:
        deadline = time.monotonic() + 5.0
        while beats() < 6:
            assert time.monotonic() < deadline, (store.failed, beats())
            time.sleep(0.02)
        assert store.failed == 2 and follower._thread.is_alive()
    finally:
        follower.stop()


def test_the_leaders_decisions_do_not_pile_up_in_the_store(kv):
    """Every attempt's quorum was a new key in the coordinator's store, never deleted: its memory
    grew with the job. The leader keeps the last few decisions of each kind."""
    from fthsdp.replica.group import DecisionChannel

    spec = dict(replica_id=3, num_processes=2, coordinator="127.0.0.1:1")
    leader = DecisionChannel(GroupSpec(process_index=0, **spec), client=kv[0])
    for i in range(300):
        leader.publish("quorum", {"quorum_id": i})
        assert kv[1].key_value_try_get(f"fthsdp/r3/quorum/{i}") == f'{{"quorum_id": {i}}}'
    held = sorted(k for k, _ in kv[1].key_value_dir_get("fthsdp/r3/quorum/"))
    assert held == sorted(f"fthsdp/r3/quorum/{i}" for i in range(300 - DecisionChannel.KEPT, 300))

