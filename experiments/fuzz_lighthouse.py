"""atheris harness: a real in-process lighthouse (gRPC server) fed arbitrary requests.

Each input picks one of the lighthouse's four methods and sends it, over a
real gRPC channel to a real ``LighthouseThread`` on loopback (``GetQuorum`` and
``Heartbeat`` either as a unary call or as a message of one long-lived session
stream, fthsdp.control.session; or arbitrary bytes as a session message, or as a
relay's batch or the messages of one on a relay stream, fthsdp.control.relay), either
arbitrary bytes as the request body (what a stranger on the network can send)
or a request message with arbitrary field values (ids of any length and
content, steps anywhere in int64, unknown protocol versions, address lists that
disagree with ``local_world_size``, ...), optionally followed by junk bytes.

What must hold, checked on every input: the call ends with a gRPC status code
within its deadline (never a hang), a successful answer parses as the method's
response message, and the server is alive afterwards (a well-formed ``Status``
call succeeds every few inputs). Which status codes came back, with a few
example details for every code, is the harness's record (written to
``$FTHSDP_FUZZ_STATS``, JSON): ``UNKNOWN`` or ``INTERNAL`` mean a handler
raised or the body was not decodable, which the lighthouse should instead
answer with ``INVALID_ARGUMENT``: findings, not crashes.

Run by ``experiments/fuzz.py`` (``-runs=N -seed=S`` are libFuzzer's flags).
"""

from __future__ import annotations

import collections
import json
import os
import queue
import sys
import threading
import time

import atheris
import grpc

from fthsdp.control import lighthouse as lh_mod
from fthsdp.control import quorum as qm
from fthsdp.control import session

from fthsdp.proto import LIGHTHOUSE_PROTOCOL_VERSION  # noqa: E402
from fthsdp.proto import lighthouse as _stubs  # noqa: E402

pb2, _ = _stubs()

METHODS = ("GetQuorum", "Heartbeat", "Leave", "Status")
REQUEST = {"GetQuorum": pb2.QuorumRequest, "Heartbeat": pb2.HeartbeatRequest, "Leave": pb2.LeaveRequest,
           "Status": pb2.StatusRequest}
RESPONSE = {"GetQuorum": pb2.QuorumResponse, "Heartbeat": pb2.HeartbeatResponse, "Leave": pb2.LeaveResponse,
            "Status": pb2.StatusResponse}
# A status the lighthouse may answer with; anything else (UNAVAILABLE: the
# server is gone) fails the run.
ANSWERS = {grpc.StatusCode.OK, grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.NOT_FOUND,
           grpc.StatusCode.DEADLINE_EXCEEDED, grpc.StatusCode.ABORTED, grpc.StatusCode.RESOURCE_EXHAUSTED,
           grpc.StatusCode.FAILED_PRECONDITION, grpc.StatusCode.UNAUTHENTICATED, grpc.StatusCode.PERMISSION_DENIED,
           grpc.StatusCode.UNKNOWN, grpc.StatusCode.INTERNAL}
CALL_TIMEOUT_S = {"GetQuorum": 0.15, "Heartbeat": 2.0, "Leave": 2.0, "Status": 5.0}
LIVENESS_EVERY = 50  # inputs between liveness probes

_JOBS = ("job-a", "job-b")
_REPLICAS = ("0", "1", "2")


class _State:
    def __init__(self) -> None:
        # No budgets (fairness=None): the fuzzer sends thousands of refused calls a second on one
        # connection by design; what it tests is that no input crashes a handler.
        self.thread = lh_mod.LighthouseThread(lh_mod.LighthouseConfig(bind="127.0.0.1:0", fairness=None))
        self.thread.start()
        self.channel = grpc.insecure_channel(self.thread.address)
        self.calls = {m: self.channel.unary_unary(f"/fthsdp.v1.Lighthouse/{m}") for m in METHODS}
        self.stream = _Stream(self.channel)
        self.relay = _Stream(self.channel, session.RELAY_METHOD)
        self.seq = 0
        self.session_codes: collections.Counter[str] = collections.Counter()
        self.relay_codes: collections.Counter[str] = collections.Counter()  # replies on the relay stream
        self.codes: collections.Counter[str] = collections.Counter()
        self.by_method: dict[str, collections.Counter[str]] = {m: collections.Counter() for m in METHODS}
        self.examples: dict[str, list[str]] = collections.defaultdict(list)
        self.inputs = 0
        self.runs = int(os.environ.get("FTHSDP_FUZZ_RUNS", "0"))
        self.stats_path = os.environ.get("FTHSDP_FUZZ_STATS", "")

    def dump(self) -> None:
        if not self.stats_path:
            return
        tmp = self.stats_path + ".tmp"
        with open(tmp, "w") as f:
            json.dump({"inputs": self.inputs, "status_codes": dict(self.codes),
                       "status_codes_by_method": {m: dict(c) for m, c in self.by_method.items()},
                       "session_reply_codes": dict(self.session_codes),
                       "relay_reply_codes": dict(self.relay_codes),
                       "examples": dict(self.examples)}, f, indent=1)
        os.replace(tmp, self.stats_path)


STATE: _State | None = None


class _Stream:
    """One session stream, or a relay's (``method``), raw bytes both ways; a thread reads its
    replies into a queue (a relay's batches unpacked)."""

    def __init__(self, channel: grpc.Channel, method: str = session.METHOD) -> None:
        self.relayed = method == session.RELAY_METHOD
        self.out: queue.SimpleQueue = queue.SimpleQueue()
        self.replies: queue.Queue = queue.Queue()

        def requests():
            while True:
                yield self.out.get()

        self.call = channel.stream_stream(method)(requests())
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        try:
            for raw in self.call:  # a reply (and a batch of them) must be well-formed
                for one in (pb2.RelayBatch.FromString(raw).messages if self.relayed else (raw,)):
                    self.replies.put(pb2.SessionReply.FromString(one))
        except grpc.RpcError as e:
            self.replies.put(e)
        except Exception as e:  # noqa: BLE001 - recorded as a finding below
            self.replies.put(e)

    def ask(self, raw: bytes, seq: int | None, timeout_s: float):
        """Send ``raw``; the reply of ``seq`` (None: the first reply, if any comes within
        ``timeout_s``; a late reply of an earlier message is skipped). Raises if the stream ended."""
        self.out.put(raw)
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                rep = self.replies.get(timeout=max(0.0, deadline - time.monotonic()))
            except queue.Empty:
                if seq is None:
                    return None
                raise AssertionError(f"no reply to session message {seq} within {timeout_s}s") from None
            if isinstance(rep, Exception):
                raise AssertionError(f"the session stream ended: {rep}")
            if seq is None or rep.seq in (seq, 0):
                return rep


def _text(fdp: atheris.FuzzedDataProvider, known: tuple[str, ...]) -> str:
    choice = fdp.ConsumeIntInRange(0, 7)  # mostly a known id, so requests reach the quorum logic
    if choice < 5:
        return known[fdp.ConsumeIntInRange(0, len(known) - 1)]
    if choice == 5:
        return ""
    return fdp.ConsumeUnicodeNoSurrogates(fdp.ConsumeIntInRange(0, 300))


def _int(fdp: atheris.FuzzedDataProvider, nbytes: int, small: int = 50) -> int:
    return fdp.ConsumeIntInRange(0, small) if fdp.ConsumeBool() else fdp.ConsumeInt(nbytes)


def _version(fdp: atheris.FuzzedDataProvider) -> int:
    return LIGHTHOUSE_PROTOCOL_VERSION if fdp.ConsumeIntInRange(0, 3) else fdp.ConsumeIntInRange(0, 2**32 - 1)


def _message(method: str, fdp: atheris.FuzzedDataProvider):
    version = _version(fdp)
    if method == "Status":
        return pb2.StatusRequest(protocol_version=version, job_id=_text(fdp, _JOBS))
    common = dict(protocol_version=version, job_id=_text(fdp, _JOBS), replica_id=_text(fdp, _REPLICAS),
                  step=_int(fdp, 8))
    if method == "Heartbeat":
        return pb2.HeartbeatRequest(**common, last_quorum_id=_int(fdp, 8))
    if method == "Leave":
        n = fdp.ConsumeIntInRange(0, 3)  # a finisher's data state: mostly well formed, sometimes not
        return pb2.LeaveRequest(**common, finished=fdp.ConsumeBool(),
                                data_positions=[_int(fdp, 8) for _ in range(n)],
                                data_last_steps=[_int(fdp, 8) for _ in range(n if fdp.ConsumeBool() else
                                                                             fdp.ConsumeIntInRange(0, 3))])
    lws = fdp.ConsumeIntInRange(1, 4) if fdp.ConsumeIntInRange(0, 3) else fdp.ConsumeInt(4)
    # Mostly one address per shard (what a replica sends), so requests get past validation.
    count = lws if 0 <= lws <= 8 and fdp.ConsumeIntInRange(0, 3) else fdp.ConsumeIntInRange(0, 4)
    addresses = [_text(fdp, ("127.0.0.1:1", "127.0.0.1:2")) for _ in range(count)]
    return pb2.QuorumRequest(
        **common, ftar_addresses=addresses, state_server_address=_text(fdp, ("127.0.0.1:3",)),
        local_world_size=lws, commit_failed=fdp.ConsumeBool(), num_replicas=_int(fdp, 4, 4),
        last_quorum_id=_int(fdp, 8), last_members=[_text(fdp, _REPLICAS) for _ in range(fdp.ConsumeIntInRange(0, 3))],
        rejoin=fdp.ConsumeBool(), fresh_start=fdp.ConsumeBool())


def _call(state: _State, method: str, body: bytes) -> grpc.StatusCode:
    try:
        reply = state.calls[method](body, timeout=CALL_TIMEOUT_S[method])
    except grpc.RpcError as e:
        code = e.code()
        detail = f"{method}: {(e.details() or '')[:200]}"
    else:
        RESPONSE[method].FromString(reply)  # an OK answer must be a well-formed response
        code, detail = grpc.StatusCode.OK, ""
    state.codes[code.name] += 1
    state.by_method[method][code.name] += 1
    key = f"{method} {code.name}"
    if detail and len(state.examples[key]) < 3 and detail not in state.examples[key]:
        state.examples[key].append(detail)
    if code not in ANSWERS:
        raise AssertionError(f"{method} ended with {code.name}: {detail} (is the lighthouse down?)")
    return code


def _session_call(state: _State, method: str, body: bytes) -> None:
    """``body`` as a message of the session stream: one reply with a code a call may end with."""
    state.seq += 1
    raw = session.envelope(state.seq, method, body, CALL_TIMEOUT_S[method])
    rep = state.stream.ask(raw, state.seq, CALL_TIMEOUT_S[method] + 5.0)
    code = session.status_code(rep.code)
    state.session_codes[code.name] += 1
    state.codes[code.name] += 1
    if code == grpc.StatusCode.OK:
        RESPONSE[method].FromString(rep.body)
    if code not in ANSWERS:
        raise AssertionError(f"session {method} answered {code.name}: {rep.details[:200]}")


def test_one_input(data: bytes) -> None:
    global STATE
    if STATE is None:
        STATE = _State()
    state = STATE
    fdp = atheris.FuzzedDataProvider(data)
    # 0, 1: unary; 2: a session message; 3: raw bytes on the session; 4: on a relay stream, raw bytes
    # as a batch or a batch of up to 4 raw messages
    transport = fdp.ConsumeIntInRange(0, 4)
    if transport >= 3:
        stream = state.stream if transport == 3 else state.relay
        if transport == 4 and fdp.ConsumeBool():
            raw = session.batch([fdp.ConsumeBytes(fdp.ConsumeIntInRange(0, 64)) for _ in range(fdp.ConsumeIntInRange(1, 4))])
        else:
            raw = fdp.ConsumeBytes(fdp.remaining_bytes())
        rep = stream.ask(raw, None, 0.3)
        # no reply yet: a well-formed quorum request without a deadline, waiting for its decision
        name = session.status_code(rep.code).name if rep is not None else "NO_REPLY_YET"
        (state.session_codes if transport == 3 else state.relay_codes)[name] += 1
        state.codes[name] += 1
        _counted(state)
        return
    method = METHODS[fdp.ConsumeIntInRange(0, len(METHODS) - 1)]
    if transport == 2 and method not in session.SESSION_METHODS:
        method = "Heartbeat"
    mode = fdp.ConsumeIntInRange(0, 2)
    if mode == 0:  # arbitrary bytes as the request body
        body = fdp.ConsumeBytes(fdp.remaining_bytes())
    else:
        body = _message(method, fdp).SerializeToString()
        if mode == 2:  # a valid message followed by junk
            body += fdp.ConsumeBytes(fdp.remaining_bytes())
    if transport == 2:
        _session_call(state, method, body)
    else:
        _call(state, method, body)
    _counted(state)


def _counted(state: _State) -> None:
    """One more input answered, whatever carried it: every LIVENESS_EVERY inputs a probe, and the
    statistics written every 20 and at the end. (The raw-bytes path once skipped this, so a run
    whose last inputs all went that way left its count in the file short of the run.)"""
    state.inputs += 1
    if state.inputs % LIVENESS_EVERY == 0:
        probe = pb2.StatusRequest(protocol_version=LIGHTHOUSE_PROTOCOL_VERSION).SerializeToString()
        if _call(state, "Status", probe) != grpc.StatusCode.OK:
            raise AssertionError("the lighthouse stopped answering a well-formed Status call")
        beat = pb2.HeartbeatRequest(protocol_version=LIGHTHOUSE_PROTOCOL_VERSION, job_id="probe",
                                    replica_id="probe").SerializeToString()
        _session_call(state, "Heartbeat", beat)  # the session stream is still served
    if state.inputs % 20 == 0 or state.inputs >= state.runs - 2:
        state.dump()


def main() -> None:
    # Coverage of the lighthouse's own code (fthsdp is often an editable install,
    # whose import hook atheris.instrument_imports cannot see through).
    for module in (lh_mod, qm):
        for obj in vars(module).values():
            if isinstance(obj, type) and obj.__module__ == module.__name__:
                for name, member in vars(obj).items():
                    if callable(member) and hasattr(member, "__code__"):
                        setattr(obj, name, atheris.instrument_func(member))
            elif callable(obj) and getattr(obj, "__module__", None) == module.__name__ and hasattr(obj, "__code__"):
                setattr(module, getattr(obj, "__name__", ""), atheris.instrument_func(obj))
    atheris.Setup(sys.argv, test_one_input)
    atheris.Fuzz()


if __name__ == "__main__":
    main()
