"""Fault plans for the launcher: which process gets which signal at which step.

Pure: parsing, the seeded random plan, and the decision whether a fault is
due are plain functions over plain data, so the launcher only has to watch
step counters and send signals.

A fault's step is matched against the *live* process's own progress (the step
its current process reported), never against a file a killed predecessor left
behind: a restarted replica has no progress until its new process commits.
"""

from __future__ import annotations

import random
from dataclasses import asdict, dataclass, field

JOB = -1  # `replica` of a job-level fault (the lighthouse, every process)
KINDS = ("kill", "stop", "lighthouse", "relay", "kill_all")


@dataclass(frozen=True, order=True)
class Fault:
    step: int  # fire once the process has committed this many steps
    replica: int  # JOB for the lighthouse / every process; a relay kill: the relay's index
    kind: str  # kill (SIGKILL), stop (SIGSTOP, SIGCONT after stop_s), lighthouse / relay (SIGKILL it), kill_all
    stop_s: float = 0.0
    # Asked for by name (--kill R@S): may take down the last healthy replica.
    # Random kills are not: they wait until another replica is healthy.
    explicit: bool = field(default=True, compare=False)
    # Which process of a multi-process replica (--kill R.p@S); -1: process 0, the leader.
    process: int = -1

    def label(self) -> str:
        if self.kind == "relay":
            return f"relay {self.relay_index}@{self.step}"
        who = self.kind if self.kind == "lighthouse" else ("all" if self.replica == JOB else f"r{self.replica}")
        if self.process >= 0:
            who += f".{self.process}"
        return f"{self.kind} {who}@{self.step}"

    @property
    def relay_index(self) -> int:
        """The relay a relay kill names (a plan written before relays had an index named the first)."""
        return max(0, self.replica)

    def to_json(self) -> dict:
        return asdict(self)

    @staticmethod
    def from_json(d: dict) -> "Fault":
        return Fault(step=int(d["step"]), replica=int(d["replica"]), kind=str(d["kind"]),
                     stop_s=float(d.get("stop_s", 0.0)), explicit=bool(d.get("explicit", True)),
                     process=int(d.get("process", -1)))


def parse_fault(spec: str, kind: str, stop_s: float = 3.0) -> Fault:
    """'REPLICA@STEP' or 'REPLICA.PROCESS@STEP' -> Fault; says what is wrong otherwise."""
    try:
        who, step = spec.split("@")
        replica, dot, process = who.partition(".")
        f = Fault(step=int(step), replica=int(replica), kind=kind, stop_s=stop_s if kind == "stop" else 0.0,
                  process=int(process) if dot else -1)
    except ValueError:
        raise ValueError(f"bad --{kind} {spec!r}: expected REPLICA@STEP or REPLICA.PROCESS@STEP, e.g. 1@40 "
                         "or 1.1@40") from None
    if f.replica < 0 or f.step < 0 or (dot and f.process < 0):
        raise ValueError(f"bad --{kind} {spec!r}: replica, process and step must be >= 0")
    return f


def parse_relay_fault(spec: str) -> Fault:
    """'STEP' (the first relay) or 'INDEX@STEP' -> a relay kill; says what is wrong otherwise."""
    who, at, step = str(spec).rpartition("@")
    try:
        f = Fault(step=int(step), replica=int(who) if at else 0, kind="relay")
    except ValueError:
        raise ValueError(f"bad --kill-relay {spec!r}: expected STEP or INDEX@STEP (the relay's index, from 0), "
                         "e.g. 40 or 1@40") from None
    if f.step < 0 or f.replica < 0:
        raise ValueError(f"bad --kill-relay {spec!r}: the relay's index and the step must be >= 0")
    return f


def random_kills(count: int, replicas: int, steps: int, seed: int, min_step: int = 5) -> list[Fault]:
    """Exactly `count` SIGKILLs at distinct seeded steps: the plan a soak test
    can reproduce from its seed. They are not `explicit`: the launcher fires
    one only while another replica is healthy, so they never take the job down."""
    if count <= 0:
        return []
    if replicas < 2:
        raise ValueError("random kills need at least 2 replicas (someone must survive)")
    hi = max(steps - 5, min_step + count)
    rng = random.Random(seed)
    at = sorted(rng.sample(range(min_step, hi), count))
    return [Fault(step=s, replica=rng.randrange(replicas), kind="kill", explicit=False) for s in at]


def plan(kills: tuple[str, ...], stops: tuple[str, ...], replicas: int, random_count: int = 0,
         steps: int = 0, seed: int = 0, stop_s: float = 3.0, lighthouse: tuple[int, ...] = (),
         kill_all: tuple[int, ...] = (), relay: tuple[str, ...] = (), relays: int | None = None) -> list[Fault]:
    """The run's faults, sorted. ``relay``: relay kills as 'STEP' or 'INDEX@STEP'; ``relays``: how many
    the launcher starts (an index past them is refused; None: not checked here)."""
    faults = [parse_fault(s, "kill") for s in kills] + [parse_fault(s, "stop", stop_s) for s in stops]
    faults += random_kills(random_count, replicas, steps, seed)
    for f in faults:
        if f.replica >= replicas:
            raise ValueError(f"fault on replica {f.replica} but the job has replicas 0..{replicas - 1}")
    for spec in relay:
        f = parse_relay_fault(spec)
        if relays is not None and relays < 1:
            raise ValueError("--kill-relay: the launcher starts no relay (launch.relays=0); give launch.relays=K "
                             "(K >= 1)")
        if relays is not None and f.relay_index >= relays:
            raise ValueError(f"--kill-relay {spec}: the launcher starts relays 0..{relays - 1} "
                             f"(launch.relays={relays}): name one of those")
        faults.append(f)
    for kind, at in (("lighthouse", lighthouse), ("kill_all", kill_all)):
        for s in at:
            if s < 0:
                raise ValueError(f"bad --{kind.replace('_', '-')} {s}: the step must be >= 0")
            faults.append(Fault(step=s, replica=JOB, kind=kind))
    return sorted(faults)


@dataclass(frozen=True)
class FaultSources:
    """Where a run's fault plan comes from, and the rule that picks one.

    Rule: any fault flag on the command line (--kill, --stop, --random-kills,
    --kill-lighthouse, --kill-relay, --kill-all) replaces the config's whole plan
    (launch.kill / launch.stop / launch.random_kills), so `--random-kills N`
    means exactly N faults. Without fault flags, the config's plan is used.
    """

    kills: tuple[str, ...]
    stops: tuple[str, ...]
    random_count: int
    lighthouse: tuple[int, ...] = ()
    kill_all: tuple[int, ...] = ()
    origin: str = "config"  # "command line" or "config"
    relay: tuple[str, ...] = ()  # 'STEP' or 'INDEX@STEP' each


def choose_sources(cli_kills, cli_stops, cli_random, cli_lighthouse, cli_kill_all,
                   cfg_kills: tuple[str, ...], cfg_stops: tuple[str, ...], cfg_random: int,
                   cli_relay=None) -> FaultSources:
    """The plan's sources under the rule of :class:`FaultSources` (None = flag not given)."""
    given = [x for x in (cli_kills, cli_stops, cli_random, cli_lighthouse, cli_kill_all, cli_relay) if x is not None]
    if given:
        return FaultSources(tuple(cli_kills or ()), tuple(cli_stops or ()), int(cli_random or 0),
                            tuple(cli_lighthouse or ()), tuple(cli_kill_all or ()), origin="command line",
                            relay=tuple(cli_relay or ()))
    return FaultSources(tuple(cfg_kills), tuple(cfg_stops), int(cfg_random), origin="config")


def due(f: Fault, progress: dict[int, int | None], healthy: set[int]) -> str:
    """Whether fault `f` fires now: "fire", or "wait" (not yet / not allowed yet).

    progress: replica -> the step its *live* process reported (None while it
    starts up, is stopped, or is dead). healthy: replicas whose live process
    has committed and is neither stopped nor dead (the ones holding the state).
    """
    if f.kind in ("lighthouse", "relay", "kill_all"):
        live = [p for p in progress.values() if p is not None]
        return "fire" if live and max(live) >= f.step else "wait"
    p = progress.get(f.replica)
    if p is None or p < f.step or f.replica not in healthy:
        return "wait"
    if f.kind == "kill" and not f.explicit and not (healthy - {f.replica}):
        return "wait"  # never take the last healthy replica unless asked by name
    return "fire"
