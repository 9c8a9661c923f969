"""What every config field may hold, declared once, checked before anything starts.

A bad value used to surface late and far from its cause: ``optim.lr=nan``
trained a model into NaNs, ``model.dtype=banana`` died in a traceback deep in
flax, ``data.seq_len=0`` or ``ft.max_retries=-1`` were accepted and failed (or
silently misbehaved) minutes into a job. :data:`RULES` says, for every field of
every section, what is allowed; :func:`check` applies it to a whole ``Config``
and raises one :class:`ConfigError` naming the field, the value and what is
allowed. A test checks that every field has a rule, so a new field cannot slip
through unchecked.

Three kinds of checks, in order:

1. **type** (from the dataclass annotations): an ``int`` field holds an int
   (not a bool), a ``float`` field a finite number, and so on;
2. **per field** (:data:`RULES`): ranges, enums, the fault-spec grammar;
3. **across fields** (:func:`check`): the timeouts' order (owned by
   :class:`fthsdp.timeouts.Timeouts`), heads dividing the width, the sequence
   fitting the model and the corpus, the batch splitting over the devices.

The fault specs' grammar is checked here; whether they name existing replicas
is checked by the launcher (``fthsdp.launch.faults.plan``) before it starts
anything, because ``fthsdp run --replicas N --kill ...`` replaces both.
"""

from __future__ import annotations

import dataclasses
import math
import re
import typing
from dataclasses import dataclass
from typing import Any, Callable


class ConfigError(ValueError):
    """A config (file, override or value) is not usable; the message says which field and what is allowed."""


@dataclass(frozen=True)
class Number:
    """A number in a range. ``integer``: ints only; otherwise any finite number."""

    integer: bool
    lo: float | None = None
    hi: float | None = None
    lo_open: bool = False  # lo itself is not allowed
    hi_open: bool = False
    why: str = ""

    def allowed(self) -> str:
        def num(x: float) -> str:
            return str(int(x)) if float(x).is_integer() and abs(x) < 1e15 else f"{x:g}"

        parts = []
        if self.lo is not None:
            parts.append(f"{'>' if self.lo_open else '>='} {num(self.lo)}")
        if self.hi is not None:
            parts.append(f"{'<' if self.hi_open else '<='} {num(self.hi)}")
        what = "an integer" if self.integer else "a finite number"
        text = f"{what} {' and '.join(parts)}".rstrip()
        return f"{text} ({self.why})" if self.why else text

    def problem(self, value: Any) -> str | None:
        if isinstance(value, bool):
            return self.allowed()
        if self.integer and not isinstance(value, int):
            return self.allowed()
        if not isinstance(value, (int, float)) or (isinstance(value, float) and not math.isfinite(value)):
            return self.allowed()  # (an int is finite; math.isfinite of one past a float's range raises)
        if self.lo is not None and (value < self.lo or (self.lo_open and value == self.lo)):
            return self.allowed()
        if self.hi is not None and (value > self.hi or (self.hi_open and value == self.hi)):
            return self.allowed()
        return None


@dataclass(frozen=True)
class OneOf:
    """One of a fixed set of names (an enum read from a config file or the command line)."""

    choices: tuple[str, ...]

    def allowed(self) -> str:
        return "one of " + ", ".join(self.choices)

    def problem(self, value: Any) -> str | None:
        return None if isinstance(value, str) and value in self.choices else self.allowed()


@dataclass(frozen=True)
class Parsed:
    """A value accepted by a parser (which raises ``ValueError`` with its own reason)."""

    parse: Callable[[Any], Any]
    description: str

    def allowed(self) -> str:
        return self.description

    def problem(self, value: Any) -> str | None:
        try:
            self.parse(value)
        except (ValueError, TypeError) as e:
            return f"{e} (allowed: {self.description})"
        return None


@dataclass(frozen=True)
class Timeout:
    """A timeout: its range and its order with the others belong to :class:`fthsdp.timeouts.Timeouts`."""

    def allowed(self) -> str:
        return "a number of seconds (see fthsdp.timeouts.Timeouts)"

    def problem(self, value: Any) -> str | None:
        return None  # Timeouts.check() runs on the whole set in check()


@dataclass(frozen=True)
class Anything:
    """No constraint beyond the field's type (say why in ``why``)."""

    why: str

    def allowed(self) -> str:
        return self.why

    def problem(self, value: Any) -> str | None:
        return None


Rule = Number | OneOf | Parsed | Timeout | Anything


def _int(lo: float | None = None, hi: float | None = None, why: str = "") -> Number:
    return Number(True, lo, hi, why=why)


def _real(lo: float | None = None, hi: float | None = None, lo_open: bool = False, hi_open: bool = False,
          why: str = "") -> Number:
    return Number(False, lo, hi, lo_open, hi_open, why)


SEED = _int(0, 2**32 - 1, "a random seed")
DTYPES = ("float32", "bfloat16", "float16")  # what the model and FTAR's reduction kernels support
RELAY_PLACEMENTS = ("lighthouse", "replicas")  # launch.relay_placement: where the launcher's relays run
FTAR_MAX_STREAMS = 64  # ffi/control_thread.cc refuses more streams per peer


def _nonempty_text(value: Any) -> None:
    if not isinstance(value, str) or not value.strip():
        raise ValueError("is empty")
    if any(ord(c) < 32 for c in value):
        raise ValueError("contains control characters")


def _host_port_or_empty(value: Any) -> None:
    """'' (start a lighthouse locally) or host:port ([v6]:port) with a port in 1..65535."""
    if value == "":
        return
    from fthsdp.addresses import split_host_port

    try:
        split_host_port(str(value), allow_zero_port=False)
    except ValueError as e:
        raise ValueError(f"not host:port with a port in 1..65535 (e.g. 127.0.0.1:29510 or [::1]:29510): {e}") from None


def _bind_address(value: Any) -> None:
    """host:port ([v6]:port) to listen on; port 0 = any free port."""
    from fthsdp.addresses import split_host_port

    split_host_port(str(value))


def _readable_or_empty(value: Any) -> None:
    if value == "":
        return
    import os

    if not os.path.isfile(str(value)) or not os.access(str(value), os.R_OK):
        raise ValueError("is not a readable file (give the path of a PEM file, or leave it empty)")


_JOB_ID = re.compile(r"[A-Za-z0-9._-]{1,64}")


def _job_id(value: Any) -> None:
    if not isinstance(value, str) or not _JOB_ID.fullmatch(value):
        raise ValueError("a job's name is 1 to 64 ASCII letters, digits, '.', '_' or '-' (it names the job at "
                         "its lighthouse, in its replicas' Ray actor names and in the checkpoint directory)")


def _secret_file_or_empty(value: Any) -> None:
    if value == "":
        return
    from fthsdp.control.auth import load_secret

    load_secret(str(value), environ={})  # SecretError (a ValueError) says what is wrong


def _host(value: Any) -> None:
    from fthsdp.addresses import check_host

    check_host(value)


def _host_or_empty(value: Any) -> None:
    if value != "":
        _host(value)


def _flip_spec(value: Any) -> None:
    from fthsdp.control.sdc import parse_flip

    parse_flip(value)


def _die_before_ledger_spec(value: Any) -> None:
    if str(value).strip():
        from fthsdp.launch.faults import parse_fault

        parse_fault(str(value).strip(), "test_die_before_ledger")


def _fail_fetch_spec(value: Any) -> None:
    import re

    if str(value).strip() and not re.fullmatch(r"\d+(\.\d+)?", str(value).strip()):
        raise ValueError(f"{value!r} is not a process: give REPLICA (e.g. 1) or REPLICA.PROCESS (e.g. 1.0)")


def _hold_view_spec(value: Any) -> None:
    from fthsdp.replica.group import parse_hold_view

    parse_hold_view(value)


def _advertisable_hosts(value: Any) -> None:
    from fthsdp.addresses import check_host, is_wildcard

    for h in value:
        check_host(h)
        if is_wildcard(h):
            raise ValueError(f"host {h!r} binds every interface and cannot be advertised; name each host's address")


def _relay_addresses(value: Any) -> None:
    for a in value:
        if a == "":
            raise ValueError("an empty relay address: list each relay's host:port, or none")
        _host_port_or_empty(a)


def _fault_specs(kind: str) -> Callable[[Any], None]:
    def parse(value: Any) -> None:
        from fthsdp.launch.faults import parse_fault

        for spec in value:
            parse_fault(spec, kind)

    return parse


def _intervention(value: Any) -> None:
    from fthsdp.step.intervention import Intervention

    Intervention.parse(value)


# Every field of every section: "section.field" (or "field" at the top level) -> rule.
RULES: dict[str, Rule] = {
    "name": Parsed(_nonempty_text, "a non-empty name"),
    # model
    "model.vocab_size": _int(256, why="every byte of the corpus must be a token"),
    "model.d_model": _int(1),
    "model.num_layers": _int(1),
    "model.num_heads": _int(1),
    "model.mlp_ratio": _int(1),
    "model.max_seq_len": _int(1),
    "model.dtype": OneOf(DTYPES),
    # data
    "data.seed": SEED,
    "data.seq_len": _int(1),
    "data.batch_size": _int(1),
    "data.corpus_bytes": _int(1024, 1 << 32, "bytes of generated text"),
    "data.eval_batches": _int(0),
    # optim
    "optim.lr": _real(0, lo_open=True),
    "optim.warmup_steps": _int(0, 2**31 - 2, "compared with the int32 step counter"),
    "optim.weight_decay": _real(0),
    "optim.b1": _real(0, 1, hi_open=True),
    "optim.b2": _real(0, 1, hi_open=True),
    "optim.grad_clip": _real(0, lo_open=True, why="the global gradient norm is clipped to this"),
    "optim.decay": OneOf(("cosine", "constant")),
    "optim.nonfinite": OneOf(("skip", "apply")),
    "optim.nonfinite_limit": _int(1, 2**31 - 2, "skipped steps in a row"),
    # ft
    "ft.intervention": Parsed(_intervention, "an LR intervention (none, linear or sqrt)"),
    "ft.min_replicas": _int(1),
    "ft.join_timeout_s": Timeout(),
    "ft.startup_timeout_s": Timeout(),
    "ft.heartbeat_interval_s": Timeout(),
    "ft.detect_s": Timeout(),
    "ft.allreduce_timeout_s": Timeout(),
    "ft.catch_up_timeout_s": Timeout(),
    "ft.quorum_timeout_s": Timeout(),
    "ft.lighthouse_outage_s": Timeout(),
    "ft.max_retries": _int(0, why="retries of a failed step before the replica gives up"),
    "ft.streams_per_peer": _int(1, FTAR_MAX_STREAMS, "FTAR connections per neighbour"),
    "ft.checkpoint_every": _int(1, why="steps between persistent checkpoints"),
    "ft.snapshot": OneOf(("on_demand", "every_commit")),
    "ft.peer_streams": _int(1, FTAR_MAX_STREAMS, "parallel HTTP streams per source"),
    "ft.peer_serve_cap_gbps": _real(0, why="0 = no cap"),
    "ft.peer_header_s": Timeout(),
    "ft.peer_idle_s": Timeout(),
    "ft.peer_send_s": Timeout(),
    "ft.peer_tls_cert": Parsed(_readable_or_empty, "empty (plain HTTP) or this replica's PEM certificate file"),
    "ft.peer_tls_key": Parsed(_readable_or_empty, "empty or the PEM private key of ft.peer_tls_cert"),
    "ft.peer_tls_ca": Parsed(_readable_or_empty, "empty or the PEM CA file that signed the replicas' certificates"),
    "ft.lighthouse_tls_ca": Parsed(_readable_or_empty, "empty (plain gRPC) or the PEM CA file that signed the "
                                   "lighthouse's certificate (a self-signed one: the certificate itself)"),
    "ft.bind_host": Parsed(_host, "an IPv4/IPv6 literal or a host name (0.0.0.0 or :: = every interface)"),
    "ft.advertise_host": Parsed(_host_or_empty, "empty (the bind host) or the host peers connect to"),
    "ft.fingerprint": Anything("true or false"),
    "ft.lighthouse_session": Anything("true or false"),
    "ft.lighthouse_relays": Parsed(_relay_addresses, "empty or host:port of each `fthsdp relay` (port 1..65535)"),
    "ft.lighthouse_relay_file": Anything("empty or the path of a file the launcher writes a moved relay's "
                                         "host:port to"),
    "ft.fingerprint_every": _int(1, 2**31 - 1, "fingerprint the state after every K-th committed step (1: every "
                                               "commit; an int32, as the step counter it divides)"),
    "ft.test_flip_bit": Parsed(_flip_spec, "empty (off) or REPLICA@STEP[:BIT] (a test hook)"),
    "ft.test_hold_view": Parsed(_hold_view_spec, "empty (off), STEP:SECONDS or STEP:SECONDS:recovering (a test hook)"),
    "ft.test_die_before_ledger": Parsed(_die_before_ledger_spec, "empty (off) or REPLICA@STEP (a test hook)"),
    "ft.test_fail_fetch": Parsed(_fail_fetch_spec, "empty (off), REPLICA or REPLICA.PROCESS (a test hook)"),
    # launch
    "launch.replicas": _int(1),
    "launch.devices_per_replica": _int(1),
    "launch.processes_per_replica": _int(1, why="processes of one replica (process 0 leads)"),
    "launch.job_id": Parsed(_job_id, "the job's name at its lighthouse: 1 to 64 of A-Z a-z 0-9 . _ -"),
    "launch.lighthouse": Parsed(_host_port_or_empty, "empty (start one locally) or host:port ([v6]:port)"),
    "launch.lighthouse_bind": Parsed(_bind_address, "host:port ([v6]:port) to listen on, port 0 = any free port"),
    "launch.lighthouse_advertise": Parsed(_host_or_empty, "empty (the bind host) or the host replicas connect to"),
    "launch.secret_file": Parsed(_secret_file_or_empty, "empty (a fresh secret per job) or a readable file "
                                 "holding the secret (64 hex digits)"),
    "launch.lighthouse_tls_cert": Parsed(_readable_or_empty, "empty (plain gRPC) or the PEM certificate chain the "
                                         "launcher's own lighthouse serves TLS with"),
    "launch.lighthouse_tls_key": Parsed(_readable_or_empty, "empty or the PEM private key of launch.lighthouse_tls_cert"),
    "launch.lighthouse_connection_calls_per_s": _real(0, 1e6, lo_open=True,
                                                      why="calls per second one connection may make"),
    "launch.lighthouse_beats_per_s": _real(0, 1e7, why="heartbeats a second the launcher's lighthouse asks of all "
                                           "processes together (0: never pace them)"),
    "launch.lighthouse_standby": Anything("true or false"),
    "launch.relays": _int(0, why="relay processes the launcher starts (0: none)"),
    "launch.relay_placement": OneOf(RELAY_PLACEMENTS),
    "launch.hosts": Parsed(_advertisable_hosts, "comma-separated hosts, one per emulated machine (empty: ft.bind_host)"),
    "launch.kill": Parsed(_fault_specs("kill"), "comma-separated REPLICA@STEP"),
    "launch.restart": Anything("true or false"),
    "launch.restart_delay_s": _real(0, why="seconds"),
    "launch.deadline_s": _real(0, why="seconds after which the launcher stops an unfinished job (0: no limit)"),
    "launch.stop": Parsed(_fault_specs("stop"), "comma-separated REPLICA@STEP"),
    "launch.random_kills": _int(0),
    "launch.fault_seed": SEED,
    "launch.max_job_restarts": _int(0, why="whole-job restarts from the latest checkpoint, 0 = never"),
    # train
    "train.steps": _int(0, 2**31 - 1, "the state counts committed steps in an int32"),
    "train.seed": SEED,
    "train.log_every": _int(1),
    "train.eval_every": _int(0, why="0 = no evaluation"),
    "train.out_dir": Parsed(_nonempty_text, "a directory"),
    "train.min_step_s": _real(0, why="seconds; 0 = off"),
    "train.pace": OneOf(("always", "degraded")),
}


def _type_problem(value: Any, typ: Any) -> str | None:
    """Why `value` is not of the annotated type `typ` (None when it is)."""
    origin = typing.get_origin(typ)
    if typ is bool:
        return None if isinstance(value, bool) else "true or false"
    if typ is int:
        return None if isinstance(value, int) and not isinstance(value, bool) else "an integer"
    if typ is float:
        ok = isinstance(value, int) and not isinstance(value, bool) or isinstance(value, float) and math.isfinite(value)
        return None if ok else "a finite number"
    if typ is str:
        return None if isinstance(value, str) else "a string"
    if origin is tuple:
        ok = isinstance(value, tuple) and all(isinstance(x, str) for x in value)
        return None if ok else "a tuple of strings"
    return None


def leaf_fields(cfg: Any, prefix: str = "") -> list[tuple[str, Any, Any]]:
    """(dotted name, value, annotated type) of every non-section field of a config."""
    out = []
    hints = typing.get_type_hints(type(cfg))
    for f in dataclasses.fields(cfg):
        value = getattr(cfg, f.name)
        name = prefix + f.name
        if dataclasses.is_dataclass(value) and not isinstance(value, type):
            out += leaf_fields(value, name + ".")
        else:
            out.append((name, value, hints[f.name]))
    return out


def _fail(name: str, value: Any, allowed: str) -> typing.NoReturn:
    raise ConfigError(f"{name}={value!r}: must be {allowed}")


def _refuse(name: str, value: Any, reason: str) -> typing.NoReturn:
    raise ConfigError(f"{name}={value!r}: {reason}")


def _check_lighthouse_budget(cfg: Any) -> None:
    """The launcher's own lighthouse must let a replica process's heartbeats through with room for
    its quorum requests; an external lighthouse's budget is its own command line's."""
    from fthsdp.config import LaunchConfig

    rate = cfg.launch.lighthouse_connection_calls_per_s
    if cfg.launch.lighthouse and rate != LaunchConfig.lighthouse_connection_calls_per_s:
        raise ConfigError(f"launch.lighthouse_connection_calls_per_s={rate:g} is for the launcher's own lighthouse, "
                          f"but the job uses the external lighthouse launch.lighthouse={cfg.launch.lighthouse}: "
                          "give that lighthouse --connection-calls-per-s instead")
    pace = cfg.launch.lighthouse_beats_per_s
    if cfg.launch.lighthouse and pace != LaunchConfig.lighthouse_beats_per_s:
        raise ConfigError(f"launch.lighthouse_beats_per_s={pace:g} is for the launcher's own lighthouse, but the job "
                          f"uses the external lighthouse launch.lighthouse={cfg.launch.lighthouse}: give that "
                          "lighthouse --beats-per-s instead")
    beats = 1.0 / cfg.ft.heartbeat_interval_s
    if not cfg.launch.lighthouse and rate < 2 * beats:  # (an external one: its --connection-calls-per-s)
        raise ConfigError(f"launch.lighthouse_connection_calls_per_s={rate:g} leaves no room: a replica process's "
                          f"heartbeats alone send {beats:g} calls/s (1/ft.heartbeat_interval_s), and its quorum "
                          f"requests come on top; give at least {2 * beats:g} (twice the heartbeat rate)")


def _check_relays(cfg: Any) -> None:
    """Relays carry session streams; more relays than replicas would leave some idle."""
    n = cfg.launch.relays
    if n and not cfg.ft.lighthouse_session:
        raise ConfigError(f"launch.relays={n} needs ft.lighthouse_session=true: a relay carries session streams only")
    if n > cfg.launch.replicas:
        raise ConfigError(f"launch.relays={n} must be <= launch.replicas={cfg.launch.replicas}: each relay carries "
                          "a block of replicas")
    if n and cfg.ft.lighthouse_relays:
        raise ConfigError(f"launch.relays={n} starts the launcher's own relays, but ft.lighthouse_relays names "
                          f"{cfg.ft.lighthouse_relays}: choose one")


def check(cfg: Any) -> None:
    """Raises :class:`ConfigError` for the first field (or combination) that is not allowed."""
    for name, value, typ in leaf_fields(cfg):
        rule = RULES.get(name)
        wrong = _type_problem(value, typ)
        if wrong is not None:
            _fail(name, value, rule.allowed() if isinstance(rule, Number | OneOf) else wrong)
        if rule is not None:
            why = rule.problem(value)
            if why is not None and isinstance(rule, Parsed):
                _refuse(name, value, why)
            if why is not None:
                _fail(name, value, why)

    from fthsdp.timeouts import Timeouts, TimeoutsError

    try:
        Timeouts.from_ft(cfg.ft).check()
    except TimeoutsError as e:
        raise ConfigError(str(e)) from None

    tls = {f"ft.{k}": getattr(cfg.ft, k) for k in ("peer_tls_cert", "peer_tls_key", "peer_tls_ca")}
    if any(tls.values()) and not all(tls.values()):
        given = ", ".join(k for k, v in tls.items() if v)
        raise ConfigError(f"{given} given without the rest: HTTPS for the peer state server needs all of "
                          f"{', '.join(tls)} (or none of them, for plain HTTP)")

    lh_tls = {k: getattr(cfg.launch, k) for k in ("lighthouse_tls_cert", "lighthouse_tls_key")}
    if bool(lh_tls["lighthouse_tls_cert"]) != bool(lh_tls["lighthouse_tls_key"]):
        given = next(k for k, v in lh_tls.items() if v)
        raise ConfigError(f"launch.{given} given without its pair: the lighthouse's TLS needs both "
                          "launch.lighthouse_tls_cert and launch.lighthouse_tls_key (or neither, for plain gRPC)")
    if lh_tls["lighthouse_tls_cert"] and cfg.launch.lighthouse:
        raise ConfigError(f"launch.lighthouse_tls_cert is for the launcher's own lighthouse, but the job uses the "
                          f"external lighthouse launch.lighthouse={cfg.launch.lighthouse}: give that lighthouse "
                          "--tls-cert/--tls-key and the replicas ft.lighthouse_tls_ca")
    if lh_tls["lighthouse_tls_cert"] and not cfg.ft.lighthouse_tls_ca:
        raise ConfigError("launch.lighthouse_tls_cert is set but ft.lighthouse_tls_ca is empty: the replicas need "
                          "the CA that signed the lighthouse's certificate to reach it (for a self-signed "
                          "certificate, the certificate file itself)")

    _check_lighthouse_budget(cfg)
    _check_relays(cfg)

    m, d, launch = cfg.model, cfg.data, cfg.launch
    if m.d_model % m.num_heads:
        raise ConfigError(f"model.d_model={m.d_model} is not divisible by model.num_heads={m.num_heads}: "
                          "choose a width that is a multiple of the number of heads")
    if d.seq_len > m.max_seq_len:
        raise ConfigError(f"data.seq_len={d.seq_len} exceeds model.max_seq_len={m.max_seq_len}: "
                          "data.seq_len must be <= model.max_seq_len")
    if cfg.train.eval_every > 0 and d.eval_batches == 0:
        raise ConfigError(f"train.eval_every={cfg.train.eval_every} evaluates, but data.eval_batches=0 gives it no "
                          "batch (its loss would be NaN): set data.eval_batches >= 1, or train.eval_every=0")
    if cfg.train.eval_every > 0 and max(d.corpus_bytes // 8, 1 << 16) < d.seq_len + 2:
        raise ConfigError(f"data.seq_len={d.seq_len} is longer than the held-out corpus "
                          f"({max(d.corpus_bytes // 8, 1 << 16)} bytes, data.corpus_bytes // 8 or 64 KiB): "
                          "raise data.corpus_bytes, or set train.eval_every=0")
    if d.corpus_bytes < d.seq_len + 2:
        raise ConfigError(f"data.corpus_bytes={d.corpus_bytes} must be >= data.seq_len + 2 = {d.seq_len + 2}: "
                          "a training window must fit in the corpus")
    if d.batch_size % launch.devices_per_replica:
        raise ConfigError(
            f"data.batch_size={d.batch_size} must be divisible by launch.devices_per_replica="
            f"{launch.devices_per_replica} (the batch is sharded over the replica's devices)")
    shards = launch.devices_per_replica * launch.processes_per_replica
    if d.batch_size % shards:
        raise ConfigError(
            f"data.batch_size={d.batch_size} must be divisible by launch.devices_per_replica x "
            f"launch.processes_per_replica = {shards} (the batch is sharded over all the replica's devices)")
    from fthsdp.addresses import is_wildcard, split_host_port

    if is_wildcard(cfg.ft.bind_host) and not cfg.ft.advertise_host:
        raise ConfigError(f"ft.bind_host={cfg.ft.bind_host!r} listens on every interface: set ft.advertise_host "
                          "to the address other replicas reach this host on")
    if (not launch.lighthouse and is_wildcard(split_host_port(launch.lighthouse_bind)[0])
            and not launch.lighthouse_advertise):
        raise ConfigError(f"launch.lighthouse_bind={launch.lighthouse_bind!r} listens on every interface: set "
                          "launch.lighthouse_advertise to the address replicas reach the lighthouse on")
    if cfg.ft.min_replicas > launch.replicas:
        raise ConfigError(f"ft.min_replicas={cfg.ft.min_replicas} must be <= launch.replicas={launch.replicas}: "
                          "otherwise no quorum can ever form")
