"""atheris harness: a real in-process lighthouse (gRPC server) fed arbitrary requests.

Each input picks one of the lighthouse's four methods and sends it, over a
real gRPC channel to a real ``LighthouseThread`` on loopback, either
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
import sys

import atheris
import grpc

from fthsdp.control import lighthouse as lh_mod
from fthsdp.control import quorum as qm

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
                       "examples": dict(self.examples)}, f, indent=1)
        os.replace(tmp, self.stats_path)


STATE: _State | None = None


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
        return pb2.LeaveRequest(**common, finished=fdp.ConsumeBool())
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


def test_one_input(data: bytes) -> None:
    global STATE
    if STATE is None:
        STATE = _State()
    state = STATE
    fdp = atheris.FuzzedDataProvider(data)
    method = METHODS[fdp.ConsumeIntInRange(0, len(METHODS) - 1)]
    mode = fdp.ConsumeIntInRange(0, 2)
    if mode == 0:  # arbitrary bytes as the request body
        body = fdp.ConsumeBytes(fdp.remaining_bytes())
    else:
        body = _message(method, fdp).SerializeToString()
        if mode == 2:  # a valid message followed by junk
            body += fdp.ConsumeBytes(fdp.remaining_bytes())
    _call(state, method, body)
    state.inputs += 1
    if state.inputs % LIVENESS_EVERY == 0:
        probe = pb2.StatusRequest(protocol_version=LIGHTHOUSE_PROTOCOL_VERSION).SerializeToString()
        if _call(state, "Status", probe) != grpc.StatusCode.OK:
            raise AssertionError("the lighthouse stopped answering a well-formed Status call")
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
