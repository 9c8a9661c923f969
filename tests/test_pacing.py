"""Heartbeat pacing (fthsdp.control.pacing): the pure rule, then a real lighthouse that paces
real clients' beats and still detects a stopped one, and one restarted under paced clients that
keeps their pace."""

from __future__ import annotations

import math
import time

import pytest

from fthsdp.control.pacing import (INHERIT_S, MAX_PACED_INTERVAL_S, PACED_BEATS_PER_WINDOW, BeatPacer,
                                   paced_interval, reported_ms)


def test_few_processes_are_not_paced_and_the_window_stays_as_configured():
    p = BeatPacer(beats_per_s=10_000, detect_s=0.8)
    assert p.update(16, now=0.0) == 0.001  # announced, but slower than nobody's own 0.1 s beat
    assert paced_interval(0.1, p.interval_s) == 0.1
    assert p.window() == 0.8 and not p.paced
    assert p.update(1000, now=1.0) == 0.1 and p.window() == 0.8  # 1,000 x 0.1 s: exactly the budget


def test_many_processes_are_paced_to_the_budget_and_the_window_widens_at_once():
    p = BeatPacer(beats_per_s=10_000, detect_s=0.8)
    assert p.update(4096, now=0.0) == 0.409
    assert paced_interval(0.1, p.interval_s) == 0.409  # 4,096 / 0.409 s = the budget
    assert p.paced and p.window() == pytest.approx(PACED_BEATS_PER_WINDOW * 0.409)
    assert p.update(200_000, now=1.0) == MAX_PACED_INTERVAL_S  # capped
    assert p.window() == PACED_BEATS_PER_WINDOW * MAX_PACED_INTERVAL_S


def test_the_window_narrows_only_after_every_process_can_have_beaten_at_the_faster_pace():
    """A process told 0.409 s keeps it until its next beat's reply: the wide window stays for
    PACED_BEATS_PER_WINDOW of it after the pace fell, then follows the new pace."""
    p = BeatPacer(beats_per_s=10_000, detect_s=0.8)
    p.update(4096, now=10.0)
    wide = p.window()
    assert p.update(2048, now=10.25) == 0.204
    assert p.window() == wide  # some still beat every 0.409 s
    p.update(2048, now=10.0 + PACED_BEATS_PER_WINDOW * 0.409 - 0.01)
    assert p.window() == wide
    p.update(2048, now=10.0 + PACED_BEATS_PER_WINDOW * 0.409)
    assert p.window() == pytest.approx(PACED_BEATS_PER_WINDOW * 0.204)
    p.update(10, now=20.0)
    p.update(10, now=20.0 + PACED_BEATS_PER_WINDOW * 0.204)
    assert p.window() == 0.8 and not p.paced


def test_a_restarted_lighthouse_keeps_the_pace_its_processes_bring_while_it_recounts_them():
    """A lighthouse restarted under 4,096 processes paced to 0.819 s counts them as they come back:
    from its first count (300) it would ask them to beat every 0.1 s. For INHERIT_S it keeps the
    slowest pace they report, with its window; then its own count rules (here: fewer came back)."""
    p = BeatPacer(beats_per_s=5_000, detect_s=0.8, started_at=100.0)
    assert p.inherit(0.819, now=100.1)  # raised: update now
    assert p.update(300, now=100.1) == 0.819 and p.counted_s == 0.06
    assert p.window() == pytest.approx(PACED_BEATS_PER_WINDOW * 0.819)
    assert not p.inherit(0.5, now=100.2) and not p.inherit(math.nan, now=100.2)  # not slower
    assert not p.inherit(0.819, now=100.2)
    assert p.update(4096, now=100.35) == 0.819  # all back: the same pace by its own count
    assert p.inherit(3600.0, now=100.4) and p.update(4096, now=100.4) == MAX_PACED_INTERVAL_S  # capped
    assert p.update(2048, now=100.0 + INHERIT_S - 0.1) == MAX_PACED_INTERVAL_S  # recounted every 0.25 s
    assert p.update(2048, now=100.0 + INHERIT_S) == 0.409  # past INHERIT_S: its count
    assert p.window() == PACED_BEATS_PER_WINDOW * MAX_PACED_INTERVAL_S  # some still beat at 1 s
    assert not p.inherit(1.0, now=100.0 + INHERIT_S) and p.update(2048, now=120.0) == 0.409  # ignored now
    assert not BeatPacer(beats_per_s=0, detect_s=0.8).inherit(0.8, now=0.0)  # no budget: their own pace


def test_no_budget_never_paces_and_bad_budgets_are_refused():
    p = BeatPacer(beats_per_s=0, detect_s=0.8)
    assert p.update(1_000_000, now=0.0) == 0.0 and p.window() == 0.8
    for bad in (-1.0, math.inf, math.nan):
        with pytest.raises(ValueError, match="beats_per_s must be a finite number >= 0"):
            BeatPacer(beats_per_s=bad, detect_s=0.8)


def test_a_client_never_beats_faster_than_its_own_interval_nor_trusts_a_wild_announcement():
    assert paced_interval(0.1, 0.0) == 0.1
    assert paced_interval(0.5, 0.2) == 0.5  # its own is slower: its own
    assert paced_interval(0.1, 3600.0) == MAX_PACED_INTERVAL_S
    assert paced_interval(0.1, math.nan) == 0.1 and paced_interval(0.1, -4.0) == 0.1
    # what its beats say of its pace: only a pace slower than its own (BeatPacer.inherit reads it)
    assert reported_ms(0.1, 0.409) == 409 and reported_ms(0.1, 0.0) == 0 and reported_ms(0.5, 0.2) == 0
    assert reported_ms(0.1, 3600.0) == 1000


def test_lighthouse_config_refuses_a_negative_budget():
    from fthsdp.control.lighthouse import LighthouseConfig

    with pytest.raises(ValueError, match="beats_per_s"):
        LighthouseConfig(beats_per_s=-5)


def beat_until_paced(clients, pace_s: float) -> None:
    """Start the clients' heartbeats and wait until every one beats at ``pace_s``."""
    for c in clients:
        c.start_heartbeats()
    deadline = time.monotonic() + 10.0
    while time.monotonic() < deadline and not all(c.beat_interval_s == pace_s for c in clients):
        time.sleep(0.05)
    assert [c.beat_interval_s for c in clients] == [pace_s] * len(clients)


@pytest.mark.multiprocess
def test_a_real_lighthouse_paces_real_clients_and_still_detects_a_stopped_one():
    """8 processes beating every 0.1 s against a budget of 20 beats/s: the replies ask for 0.4 s,
    the clients follow (the lighthouse hears ~20 beats/s, not 80), nobody is declared dead for
    beating slowly, the lighthouse's window widened, and a client whose beats stop is declared dead
    within the widened window (not the configured 0.8 s, which would have killed the paced)."""
    from fthsdp.control.lighthouse import LighthouseConfig, LighthouseThread
    from fthsdp.control.lighthouse_client import LighthouseClient, format_detection

    with LighthouseThread(LighthouseConfig(join_timeout_s=0.3, detect_s=0.8, beats_per_s=20.0)) as lh:
        clients = [LighthouseClient(lh.address, "paced", str(i), heartbeat_interval_s=0.1, heartbeat_timeout_s=2.0)
                   for i in range(8)]
        try:
            beat_until_paced(clients, 0.4)
            assert lh.server.detect_s == pytest.approx(PACED_BEATS_PER_WINDOW * 0.4)
            shown = format_detection(clients[0].status_reply())  # what `fthsdp status` prints
            assert shown.startswith("failure detection: 3.2 s") and "beat every 0.4 s at most" in shown, shown
            beats0 = lh.server.stats["heartbeats"]
            time.sleep(2.0)
            rate = (lh.server.stats["heartbeats"] - beats0) / 2.0
            assert 10.0 <= rate <= 30.0, f"{rate} beats/s against a budget of 20 (unpaced: 80)"

            def dead() -> set[str]:
                (job,) = clients[0].status()
                return {r.replica_id for r in job.replicas if r.dead}

            assert dead() == set()
            clients[7].stop_heartbeats()
            stopped = time.monotonic()
            while time.monotonic() - stopped < 5.0 and not dead():
                time.sleep(0.05)
            took = time.monotonic() - stopped
            assert dead() == {"7"}
            # its last beat was up to one paced interval before the stop
            assert PACED_BEATS_PER_WINDOW * 0.4 - 0.45 <= took <= PACED_BEATS_PER_WINDOW * 0.4 + 1.0, took
        finally:
            for c in clients:
                c.close()


@pytest.mark.multiprocess
def test_a_restarted_lighthouse_keeps_its_processes_pace_instead_of_calling_a_storm_of_beats(caplog):
    """8 clients paced to 0.4 s (budget 20 beats/s) and their lighthouse restarted on its port: the
    new one knows nobody at first, and from its first counts would ask them for their own 0.1 s
    (a storm of beats while it is busiest). Their beats say 0.4 s; it keeps that pace and its
    window from the first reply on, and nobody is declared dead."""
    from fthsdp.control.lighthouse import LighthouseConfig, LighthouseThread
    from fthsdp.control.lighthouse_client import LighthouseClient
    from test_resilience_lighthouse import free_port

    port = free_port()
    cfg = LighthouseConfig(bind=f"127.0.0.1:{port}", join_timeout_s=0.3, detect_s=0.8, beats_per_s=20.0)
    clients = [LighthouseClient(f"127.0.0.1:{port}", "paced", str(i), heartbeat_interval_s=0.1,
                                heartbeat_timeout_s=2.0, outage_s=30.0) for i in range(8)]
    first, second = LighthouseThread(cfg), None
    first.start()
    try:
        beat_until_paced(clients, 0.4)
        first.stop()
        time.sleep(0.5)  # their beats fail meanwhile; they keep the pace of their last reply
        second = LighthouseThread(cfg)
        second.start()
        started, fastest, heard = time.monotonic(), 1.0, False
        while time.monotonic() - started < 3.0:
            fastest = min(fastest, *(c.beat_interval_s for c in clients))
            heard = heard or second.server.stats["heartbeats"] >= 8
            time.sleep(0.005)
        assert heard, "the clients never reached the restarted lighthouse"
        assert fastest == 0.4, f"a client was told to beat every {fastest} s after the restart"
        assert second.server.detect_s == pytest.approx(PACED_BEATS_PER_WINDOW * 0.4)
        rate = second.server.stats["heartbeats"] / (time.monotonic() - started)
        assert rate <= 35.0, f"{rate:.0f} beats/s at the restarted lighthouse (paced: ~20, unpaced: 80)"
        (job,) = clients[0].status()
        assert [r.replica_id for r in job.replicas if r.dead] == []
        said = [r.getMessage() for r in caplog.records if "kept from what its processes report" in r.getMessage()]
        assert said and "every 0.4 s at most" in said[0], said  # its log says where the pace came from
    finally:
        for c in clients:
            c.close()
        for lh in (first, second):
            if lh is not None:
                lh.stop()
