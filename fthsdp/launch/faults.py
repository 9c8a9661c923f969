"""Fault plans for the launcher: which replica gets which signal at which step.

Pure: parsing and the seeded random plan are plain functions, so the launcher
only has to watch step counters and send signals.
"""

from __future__ import annotations

import random
from dataclasses import dataclass


@dataclass(frozen=True, order=True)
class Fault:
    step: int  # fire once the replica has committed this many steps
    replica: int
    kind: str  # "kill" (SIGKILL) or "stop" (SIGSTOP, SIGCONT after stop_s)
    stop_s: float = 0.0


def parse_fault(spec: str, kind: str, stop_s: float = 3.0) -> Fault:
    """'REPLICA@STEP' -> Fault; says what is wrong otherwise."""
    try:
        replica, step = spec.split("@")
        f = Fault(step=int(step), replica=int(replica), kind=kind, stop_s=stop_s if kind == "stop" else 0.0)
    except ValueError:
        raise ValueError(f"bad --{kind} {spec!r}: expected REPLICA@STEP, e.g. 1@40") from None
    if f.replica < 0 or f.step < 0:
        raise ValueError(f"bad --{kind} {spec!r}: replica and step must be >= 0")
    return f


def random_kills(count: int, replicas: int, steps: int, seed: int, min_step: int = 5) -> list[Fault]:
    """`count` SIGKILLs at distinct seeded steps, never two at once and never
    all replicas: the plan a soak test can reproduce from its seed."""
    if count <= 0:
        return []
    if replicas < 2:
        raise ValueError("random kills need at least 2 replicas (someone must survive)")
    hi = max(steps - 5, min_step + count)
    rng = random.Random(seed)
    at = sorted(rng.sample(range(min_step, hi), count))
    return [Fault(step=s, replica=rng.randrange(replicas), kind="kill") for s in at]


def plan(kills: tuple[str, ...], stops: tuple[str, ...], replicas: int, random_count: int = 0,
         steps: int = 0, seed: int = 0, stop_s: float = 3.0) -> list[Fault]:
    faults = [parse_fault(s, "kill") for s in kills] + [parse_fault(s, "stop", stop_s) for s in stops]
    faults += random_kills(random_count, replicas, steps, seed)
    for f in faults:
        if f.replica >= replicas:
            raise ValueError(f"fault on replica {f.replica} but the job has replicas 0..{replicas - 1}")
    return sorted(faults)
