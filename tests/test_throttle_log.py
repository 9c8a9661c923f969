"""The lighthouse says in its log when a budget holds back or refuses calls (fthsdp.control.guard.ThrottleLog)."""

from __future__ import annotations

import asyncio
import logging

from fthsdp.control import guard
from fthsdp.control.admission import Admission, Decision, FairnessLimits
from fthsdp.control.guard import THROTTLE_LOG_EVERY_S, THROTTLE_LOG_GAP_S, ThrottleLog


def test_one_line_per_principal_a_minute_and_one_a_second_in_all(caplog):
    t = ThrottleLog()
    held = Decision(wait_s=0.25)
    with caplog.at_level(logging.WARNING, logger="fthsdp.control.lighthouse"):
        assert t.note("connection a", held, "100 calls/s", "do X", now=100.0)
        assert not t.note("connection a", held, "100 calls/s", "do X", now=100.0 + THROTTLE_LOG_GAP_S + 1)
        assert not t.note("connection b", held, "100 calls/s", "do X", now=100.5)  # within a second of a's line
        assert t.note("connection b", held, "100 calls/s", "do X", now=100.0 + THROTTLE_LOG_GAP_S)
        assert t.note("connection a", Decision(wait_s=1.0, refusal="over its budget"), "100 calls/s", "do X",
                      now=100.0 + THROTTLE_LOG_EVERY_S)
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 3
    assert "connection a: a call was held back 0.250 s for its budget (100 calls/s). do X" in lines[0]
    assert "connection b" in lines[1] and "2 not written since the last one" in lines[1]
    assert "a call was refused: over its budget" in lines[2] and "0 not written" in lines[2]


def test_the_gate_logs_a_replica_over_its_connection_budget(caplog):
    """A real CallGate with a small budget: the calls past the burst are held, and the log says
    which connection, its budget and what to do about it, once."""
    limits = FairnessLimits(connection_calls_per_s=50.0, connection_burst=2, new_connection_tokens=2)
    gate = guard.CallGate(authenticator=None, limits=None, admission=Admission(limits))

    async def calls(n: int) -> list:
        return [await gate.connection("ipv4:127.0.0.1:5555", hold_bound=1.0) for _ in range(n)]

    with caplog.at_level(logging.WARNING, logger="fthsdp.control.lighthouse"):
        refusals = asyncio.run(calls(6))
    assert refusals == [None] * 6  # held, then served: the budget slows, it does not refuse
    lines = [r.getMessage() for r in caplog.records if "over" in r.getMessage() or "held back" in r.getMessage()]
    assert len(lines) == 1, lines
    assert "connection ipv4:127.0.0.1:5555: a call was held back" in lines[0]
    assert "50 calls/s, burst 2" in lines[0] and "--connection-calls-per-s" in lines[0]
    assert gate.admission.stats["held"] == 4
