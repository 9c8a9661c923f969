"""Experiment configuration: plain dataclasses, composed in Python files.

A config file under `configs/` defines a module-level `config` (a `Config`).
Variants import a base and override fields with `dataclasses.replace`, or with
`override(config, ["optim.lr=1e-3", ...])`, which is also what the command
line uses (`fthsdp train --config configs/base.py optim.lr=1e-3`).

Every field's allowed values are declared once, in `fthsdp.config_checks.RULES`
(a new field needs a rule there; tests/test_config.py fails without one), and
`Config.validate()` checks them all when a config is loaded, before anything starts.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import pathlib
import sys
import types
import typing
from dataclasses import dataclass, field

from fthsdp.config_checks import ConfigError, check
from fthsdp.control.admission import FairnessLimits
from fthsdp.control.pacing import DEFAULT_BEATS_PER_S

__all__ = ["Config", "ConfigError", "load", "load_module", "override", "to_dict"]


@dataclass(frozen=True)
class ModelConfig:
    """A small decoder-only transformer over bytes."""

    vocab_size: int = 256
    d_model: int = 128
    num_layers: int = 2
    num_heads: int = 4
    mlp_ratio: int = 4
    max_seq_len: int = 64
    dtype: str = "float32"  # activations; parameters stay float32


@dataclass(frozen=True)
class DataConfig:
    """Deterministic byte-level corpus generated from a seed (no downloads)."""

    seed: int = 0
    seq_len: int = 64
    batch_size: int = 16  # per replica, per step
    corpus_bytes: int = 1 << 20
    eval_batches: int = 4


@dataclass(frozen=True)
class OptimConfig:
    lr: float = 3e-3
    warmup_steps: int = 20
    weight_decay: float = 0.01
    b1: float = 0.9
    b2: float = 0.98
    grad_clip: float = 1.0
    decay: str = "cosine"  # cosine | constant
    # Averaged gradients holding a NaN or an infinity (a loss spike, a peer's corrupt contribution):
    #   skip  - the step commits (its batch is spent) with the parameters and optimizer state unchanged
    #   apply - the update is applied as it is (the state turns NaN on every replica alike)
    nonfinite: str = "skip"
    # This many skipped steps in a row end the job (exit 78) with the step to resume from: the
    # run has diverged, and skipping on would spend the data on nothing.
    nonfinite_limit: int = 10


@dataclass(frozen=True)
class FTConfig:
    """Fault tolerance: quorum, detection and retry policy, intervention."""

    intervention: str = "sqrt"  # none | linear | sqrt
    min_replicas: int = 1
    join_timeout_s: float = 0.5
    startup_timeout_s: float = 120.0  # a fresh job waits this long for all replicas to be live
    heartbeat_interval_s: float = 0.1
    detect_s: float = 0.8  # heartbeat silence that declares a replica dead
    allreduce_timeout_s: float = 10.0
    # Added to the all-reduce deadline of a quorum with a behind member: the healthy members wait
    # this much longer for it to fetch the state (a death is still detected within detect_s).
    catch_up_timeout_s: float = 30.0
    quorum_timeout_s: float = 120.0  # one get_quorum call waits this long for a decision
    lighthouse_outage_s: float = 60.0  # replicas ride out a lighthouse outage this long
    max_retries: int = 3
    streams_per_peer: int = 2
    checkpoint_every: int = 50
    # When a healthy replica copies its state to host memory for peers:
    #   on_demand    - only when the quorum lists a behind replica, right after the
    #                  quorum arrives: the committed state is immutable until this
    #                  step's update, so the copy overlaps forward/backward, and a
    #                  step with nobody behind pays nothing (the common case);
    #   every_commit - after every commit (DataStates-style), so a snapshot is
    #                  always ready, at a small cost on every step.
    snapshot: str = "on_demand"
    peer_streams: int = 2  # parallel HTTP streams per source when fetching a peer's state
    peer_serve_cap_gbps: float = 0.0  # cap on what a replica spends serving its state (0 = none)
    # The peer state server's per-connection limits (their order: fthsdp.timeouts.Timeouts).
    peer_header_s: float = 5.0  # a request head must arrive whole within this
    peer_idle_s: float = 30.0  # an idle keep-alive connection is closed after this
    peer_send_s: float = 60.0  # one response must be written out within this
    # HTTPS for the peer state server (PEM files, all three or none): this replica's certificate and
    # key (it must name the host peers fetch from, ft.advertise_host), and the CA its own fetches
    # verify the other replicas' certificates against. Empty: plain HTTP (requests are signed either way).
    peer_tls_cert: str = ""
    peer_tls_key: str = ""
    peer_tls_ca: str = ""
    # The PEM CA the replicas trust when they reach the lighthouse over TLS (the launcher's own,
    # served with launch.lighthouse_tls_cert/key, or an external one run with --tls-cert). For a
    # self-signed certificate, the certificate itself. Empty: plain gRPC (calls are signed either way).
    lighthouse_tls_ca: str = ""
    # Heartbeats and quorum requests as messages of one long-lived stream per process
    # (fthsdp/control/session.py: a fraction of a unary call's cost to the lighthouse); false, or
    # a lighthouse that offers no sessions: one unary call each.
    lighthouse_session: bool = True
    # Relays (`fthsdp relay`, fthsdp/control/relay.py) that carry those streams to the lighthouse,
    # many processes' on one: at hundreds of replicas the lighthouse's cost is per message, and a
    # relay turns a block of replicas' messages into one. The replicas are split among them in
    # contiguous blocks (replica i of R uses relays[i * len(relays) // R]); a process whose relay
    # is gone or silent speaks to the lighthouse directly and tries the relay again later
    # (fthsdp.control.session_client.RelayPath). Empty: every process speaks to the lighthouse.
    lighthouse_relays: tuple[str, ...] = ()
    # A file where the launcher writes this process's relay (HOST:PORT) when it places it elsewhere
    # (`fthsdp ray` with launch.relay_placement=replicas, when the relay's node was lost; `fthsdp
    # run`, when a restarted relay's port was taken): the process reads it when it changes (once a
    # heartbeat) and moves to that relay. Empty: none.
    lighthouse_relay_file: str = ""
    # Where a replica's listeners (FTAR ring endpoints, peer state server,
    # metrics) bind, and the host its peers are told to connect to (empty: the
    # bind host; required when binding every interface, 0.0.0.0 or ::). IPv4
    # or IPv6 literals or names; loopback by default, so nothing is reachable
    # from outside the machine unless asked for (fthsdp.addresses).
    bind_host: str = "127.0.0.1"
    advertise_host: str = ""
    # Silent-data-corruption check: after every commit each replica fingerprints its
    # state on its devices (fthsdp/step/fingerprint.py) and reports it to the
    # lighthouse, which compares the replicas (fthsdp/control/sdc.py).
    fingerprint: bool = True
    # Fingerprint (and compare) the state after every K-th committed step only (1: after
    # every commit). A K > 1 divides the fingerprint's cost by K but lets a corrupted replica
    # contribute gradients for up to K steps before it is found (experiments/fingerprint_cost.py
    # measures the per-commit cost, and the K that would bring it under 1% of a step).
    fingerprint_every: int = 1
    # A test hook, off by default: "REPLICA@STEP[:BIT]" flips bit BIT of one parameter
    # of replica REPLICA right after it commits step STEP (fthsdp.step.fingerprint.FlipSpec).
    test_flip_bit: str = ""
    # A test hook, off by default: "STEP:SECONDS" makes every follower process (a replica's
    # process > 0) wait SECONDS before fetching its view of the first quorum of step >= STEP,
    # so that a test can restart the lighthouse between the leader's answer and the views
    # (STEP:SECONDS:recovering: only a view of a quorum in which its replica recovers).
    test_hold_view: str = ""
    # A test hook, off by default: "REPLICA@STEP" makes replica REPLICA SIGKILL itself right
    # after it commits step STEP, before it writes that commit's ledger line (once per run
    # directory), so that a test can check the batch is recorded when a later state holds it.
    test_die_before_ledger: str = ""
    # A test hook, off by default: "R.P" (process P of replica R; "R" for a one-process replica)
    # makes that process's first state fetch from its peers fail at once, so that a test can
    # check that a replica whose other processes fetched theirs fails the step together.
    test_fail_fetch: str = ""


@dataclass(frozen=True)
class LaunchConfig:
    replicas: int = 1
    devices_per_replica: int = 2  # per process of a replica
    processes_per_replica: int = 1  # one JAX runtime per replica over all its processes (fthsdp.replica.group)
    # The job's name at its lighthouse, which serves every job by name: two jobs on one lighthouse
    # need two names (with the same one their replicas would join one quorum). With an
    # authenticated external lighthouse it is the JOB of `fthsdp lighthouse --print-job-secret JOB`
    # (the job's secret is derived from it). It also names the checkpoint directory's owner.
    job_id: str = "fthsdp"
    lighthouse: str = ""  # host:port ([v6]:port) of a running lighthouse; empty = start one locally
    lighthouse_bind: str = "127.0.0.1:0"  # where the launcher's own lighthouse listens (port 0: any free one)
    lighthouse_advertise: str = ""  # the host replicas reach it on (empty: the bind host)
    # A file holding the secret (fthsdp.control.auth.launcher_keys): the launcher's own lighthouse's
    # secret (empty: a fresh one per job), or with `lighthouse` set, the job's secret.
    secret_file: str = ""
    # TLS for the launcher's own lighthouse (PEM certificate chain and key, both or neither); the
    # replicas then need ft.lighthouse_tls_ca. The files must exist where the lighthouse runs (with
    # Ray: the driver's node; the CA on every node).
    lighthouse_tls_cert: str = ""
    lighthouse_tls_key: str = ""
    # The budget of one client connection to the launcher's own lighthouse, in calls per second
    # (its --connection-calls-per-s, fthsdp.control.admission): calls past it are held back, which
    # slows the replica that sends them. A replica process sends heartbeats at
    # 1/ft.heartbeat_interval_s and one quorum request per step, so a model that steps more than
    # ~80 times a second at the default heartbeat needs more; the lighthouse's log says when a
    # connection is held back. With an external launch.lighthouse it must stay at its default:
    # that lighthouse's budget is its own --connection-calls-per-s.
    lighthouse_connection_calls_per_s: float = FairnessLimits.connection_calls_per_s
    # Heartbeats a second the launcher's own lighthouse asks of all the job's processes together
    # (its --beats-per-s, fthsdp.control.pacing): past this budget x ft.heartbeat_interval_s
    # processes (500 at the defaults) each is asked to beat less often, and failure detection
    # widens to match (the lighthouse logs it). 0: never pace. With an external launch.lighthouse
    # it must stay at its default: that lighthouse's own flag decides.
    lighthouse_beats_per_s: float = DEFAULT_BEATS_PER_S
    # `fthsdp run` keeps a warm spare of its own lighthouse: a second process started and waiting
    # to bind the lighthouse's port (`fthsdp lighthouse --standby`), told to serve the moment the
    # lighthouse dies, so that a restart costs no Python start-up (README, "Lighthouse restarts").
    # false: a dead lighthouse is started cold. (`fthsdp ray`: a second lighthouse actor, created
    # on the driver's node and not bound until the first dies.)
    lighthouse_standby: bool = True
    # Relays (`fthsdp relay`) the launcher (`fthsdp run`, `fthsdp ray`) starts between the replicas
    # and the lighthouse, each carrying the session streams of a contiguous block of replicas (it
    # sets ft.lighthouse_relays to their addresses). A relay that dies is restarted on its address;
    # meanwhile its replicas' processes speak to the lighthouse directly. 0: none.
    relays: int = 0
    # Where the launcher's relays run. "lighthouse": all on the lighthouse's host (`fthsdp ray`:
    # its node), so the replicas' messages cross the network once to it; "replicas": each relay on
    # the host of the first replica of its block (`fthsdp run`: launch.hosts; `fthsdp ray`: the
    # node that replica is placed on, the relay started when it is), so that the relays' CPU is
    # spent beside the replicas they carry, not on the lighthouse's host (README, "The relay
    # tier"). A relay whose node is lost is placed again with the next replica of its block.
    relay_placement: str = "lighthouse"
    # Emulated hosts: replica r's listeners bind (and advertise) hosts[r % len(hosts)],
    # e.g. 127.0.0.2,127.0.0.3 so that each replica acts as its own machine on
    # loopback; empty: every replica uses ft.bind_host / ft.advertise_host.
    hosts: tuple[str, ...] = ()
    kill: tuple[str, ...] = ()  # "REPLICA@STEP"
    restart: bool = True  # the launcher restarts a killed replica, which rejoins from its peers
    restart_delay_s: float = 1.0
    # The launcher stops the job if it has not finished after this many seconds, writes its summary
    # and says how to resume it (0: no limit, a training job runs as long as it needs).
    deadline_s: float = 0.0
    stop: tuple[str, ...] = ()
    random_kills: int = 0
    fault_seed: int = 0
    # When no healthy replica is left (all dead, or restarting without having
    # rejoined), the launcher restarts the whole job from its latest persistent
    # checkpoint by itself, at most this many times (0: never; then --resume by hand).
    max_job_restarts: int = 2


@dataclass(frozen=True)
class TrainConfig:
    steps: int = 200
    seed: int = 0
    log_every: int = 10
    eval_every: int = 50
    out_dir: str = "runs/default"
    # Emulate a longer forward/backward by sleeping until each healthy step's
    # compute took this long. Tiny CPU models step in ~20 ms while a replica
    # restart takes seconds; real steps take ~20 s (paper). Demos and rejoin
    # tests use this to restore a realistic ratio. 0 = off.
    min_step_s: float = 0.0
    # When min_step_s applies: "always", or "degraded", only on steps whose quorum lacks
    # one of the job's launch.replicas. What shapes a rejoin is the ratio of the outage
    # to the step time while a replica is out; once it is back, a rejoin test or demo
    # only needs a few commits together, at the model's own speed.
    pace: str = "always"


@dataclass(frozen=True)
class Config:
    name: str = "base"
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    ft: FTConfig = field(default_factory=FTConfig)
    launch: LaunchConfig = field(default_factory=LaunchConfig)
    train: TrainConfig = field(default_factory=TrainConfig)

    @property
    def timeouts(self):
        """The job's timeouts (:class:`fthsdp.timeouts.Timeouts`), the one owner of their ordering."""
        from fthsdp.timeouts import Timeouts

        return Timeouts.from_ft(self.ft)

    def validate(self) -> "Config":
        """Returns self, or raises :class:`ConfigError` naming the first field that is not allowed
        and what is (every field's rule: :data:`fthsdp.config_checks.RULES`)."""
        check(self)
        return self


def _convert(text: str, typ, where: str):
    origin = typing.get_origin(typ)
    if typ is bool:
        low = text.lower()
        if low in ("1", "true", "yes", "on"):
            return True
        if low in ("0", "false", "no", "off"):
            return False
        raise ConfigError(f"{where}: expected a boolean, got {text!r}")
    if origin is tuple:
        return tuple(s for s in (p.strip() for p in text.split(",")) if s)
    try:
        return typ(text)
    except (TypeError, ValueError):
        raise ConfigError(f"{where}: expected {getattr(typ, '__name__', typ)}, got {text!r}") from None


def override(cfg, assignments: typing.Iterable[str]):
    """Returns `cfg` with dotted `path=value` assignments applied (typed by the dataclass)."""
    for item in assignments:
        if "=" not in item:
            raise ConfigError(f"override {item!r} is not of the form section.field=value")
        path, value = item.split("=", 1)
        cfg = _set(cfg, path.strip().split("."), value, path)
    return cfg


def _set(obj, parts: list[str], value: str, full: str):
    if not dataclasses.is_dataclass(obj):
        raise ConfigError(f"override {full!r}: {parts[0]!r} is not a config section")
    hints = typing.get_type_hints(type(obj))
    names = [f.name for f in dataclasses.fields(obj)]
    if parts[0] not in names:
        raise ConfigError(f"override {full!r}: no field {parts[0]!r} in {type(obj).__name__}; fields: {', '.join(names)}")
    if len(parts) == 1:
        if dataclasses.is_dataclass(hints[parts[0]]):  # (its constructor took the text as its first field)
            fields = ", ".join(f.name for f in dataclasses.fields(hints[parts[0]]))
            raise ConfigError(f"override {full!r}: {parts[0]!r} is a section, not a value: set its fields one by "
                              f"one ({parts[0]}.FIELD=VALUE; fields: {fields})")
        new = _convert(value.strip(), hints[parts[0]], full)
    else:
        new = _set(getattr(obj, parts[0]), parts[1:], value, full)
    return dataclasses.replace(obj, **{parts[0]: new})


def load(path_or_name: str | None, overrides: typing.Iterable[str] = ()) -> Config:
    """Loads `config` from a config file (path, or a name under configs/) and applies overrides."""
    if not path_or_name:
        cfg = Config()
    else:
        cfg = _load_file(path_or_name)
    return override(cfg, overrides).validate()


def _resolve(path_or_name: str) -> pathlib.Path:
    p = pathlib.Path(path_or_name)
    if p.suffix != ".py":
        p = p.with_suffix(".py")
    if p.exists():
        return p
    import configs

    candidate = pathlib.Path(configs.__file__).parent / p.name
    if candidate.exists():
        return candidate
    available = sorted(x.stem for x in pathlib.Path(configs.__file__).parent.glob("*.py") if x.stem != "__init__")
    raise ConfigError(f"config {path_or_name!r} not found; available: {', '.join(available)}")


def load_module(path_or_name: str) -> types.ModuleType:
    """Imports a config file (path, or a name under configs/) and returns the module,
    for callers that read more than `config` from it (e.g. a study's `study`)."""
    path = _resolve(path_or_name)
    name = f"configs.{path.stem}" if path.parent.name == "configs" else f"_fthsdp_config_{path.stem}"
    spec = importlib.util.spec_from_file_location(name, path)
    assert spec and spec.loader
    module = types.ModuleType(name)
    module.__file__ = str(path)
    sys.modules[name] = module
    try:
        spec.loader.exec_module(module)
    except Exception as e:  # a config file is code: any error in it is the file's, reported as such
        sys.modules.pop(name, None)
        if isinstance(e, ConfigError):
            raise ConfigError(f"config {path} failed to load: {e}") from e
        raise ConfigError(f"config {path} failed to load: {type(e).__name__}: {e}") from e
    return module


def _load_file(path_or_name: str) -> Config:
    module = load_module(path_or_name)
    path = module.__file__
    cfg = getattr(module, "config", None)
    if not isinstance(cfg, Config):
        raise ConfigError(f"{path} must define a module-level `config = Config(...)`")
    return cfg


def to_dict(cfg) -> dict:
    return dataclasses.asdict(cfg)
