"""EMULATION — THE ONLY PLACE IN FTHSDP WHERE MOCKS ARE ALLOWED.

*This module, with its mocks in* :mod:`fthsdp.sim.mock_plane`, *stands in for a
cluster. Nothing outside* ``fthsdp/sim/`` *imports it, and nothing outside it
knows that it is emulated.*

It runs fthsdp's real control plane for R replicas x G ranks (up to 100,000
ranks) on one machine, the way the FT-HSDP paper's section 5 "shadow
modules" did: the model's compute is replaced by its shapes and timings and
the all-reduce's data plane by a mock with configurable latency and
bandwidth, while everything that decides is real:

* **the lighthouse** is the real gRPC server (``python -m fthsdp.control.lighthouse``)
  in its own process, with the real quorum decision; a test can SIGKILL it
  and restart it on the same port (the replicas ride the outage out and the
  restarted lighthouse rebuilds the job from what they report);
* **the hierarchy**, as the real protocol (version 2) has it: a replica is P
  processes x D devices (ranks); every process heartbeats to the lighthouse
  under (replica, process) and registers its own shards' endpoints; the
  leader (process 0) gathers the requests of its ranks, asks once, and hands
  the decision to the other processes (in process here, over the key-value
  store in a real replica), which fetch their own views of a new quorum id
  (``GetView``: their shards' rings); the ranks of all replicas share this OS
  process (one asyncio task per replica; each of its processes is a
  :class:`RankGroup`: one shared answer per process, one state per rank), or,
  for fault-free measurements, K emulator processes each hold a block of the
  replicas (``emulator_processes``, :mod:`fthsdp.sim.shards`);
* **relays** (``relays=K``): the real relay (``python -m fthsdp.control.relay``),
  K processes each carrying a contiguous block of replicas' session streams
  to the lighthouse; a test can SIGKILL one and restart it, or SIGSTOP one
  (its processes go to the lighthouse directly, and back once it answers);
* **the decisions** are the pure step machine :mod:`fthsdp.replica.fsm` that
  the leader runs and every rank *replays* on the same inputs (train or catch
  up, ring rebuild, the intra-replica commit vote, retry on a new quorum,
  give up); a rank whose replay disagrees with its leader is a violation
  (replayed once per distinct rank state: exact, the functions are pure);
* **faults** are injected as in the real tests: a replica killed (its
  sockets close, its in-flight all-reduces fail, its heartbeats stop; it is
  restarted and rejoins by catching up from peers), a replica hung (silent
  past the detection window: the lighthouse declares it dead, the survivors'
  heartbeats abort their all-reduce), a ring or a single rank failing, the
  lighthouse killed and restarted, a relay killed.

:class:`Emulation` records what every replica and rank did and
:meth:`EmulationReport.violations` checks the invariants the real tests
check: every decision identical on all ranks of a replica (a follower process's
ranks planning on their own view) and on all replicas of a quorum, no wait past
its deadline (a get_quorum round timed from its first ask; an all-reduce aborted
on a death within the detection window), no all-reduce run to its deadline (a
member that cannot join is detected and the all-reduce aborted: survivors do
not wait for it), every emulated batch trained exactly once (each commit's batch
against the replica's own loader; the kept lineage's steps each once; the job
never redone from its start), quorum ids never going backwards, no error the
real replica would die of (replica-fatal: it restarts; job-fatal: the job stops),
and every injected fault fired.
"""

from __future__ import annotations

import ast
import asyncio
import gc
import collections
import logging
import os
import re
import signal
import subprocess
import sys
import tempfile
import time
import dataclasses
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from fthsdp.gc_policy import low_pause_gc
from fthsdp.control import quorum as qm
from fthsdp.replica import fsm
from fthsdp.errors import FaultClass, classify
from fthsdp.control.lighthouse_client import JobFinished, LighthouseError, LighthouseUnavailable, ring_request_flags
from fthsdp.control.pacing import PACED_BEATS_PER_WINDOW, paced_interval
from fthsdp.control.relay import relay_of
from fthsdp.control.session_client import RelayPath
from fthsdp.sim.aio_client import AioLighthouseClient, DecodeCache
from fthsdp.sim.mock_plane import FabricConfig, MockFabric, ModelShape
from fthsdp.timeouts import Timeouts

if TYPE_CHECKING:
    from fthsdp.sim.shards import Peers, ShardSpec

log = logging.getLogger("fthsdp.sim.emulation")

__all__ = ["Fault", "EmulationConfig", "Emulation", "EmulationReport", "LighthouseProcess", "package_first",
           "percentile_failing", "run_emulation"]

FAULT_KINDS = ("kill", "hang", "ring", "rank", "lighthouse", "lighthouse_answering", "relay", "relay_stop")
RELAY_FAULTS = ("relay", "relay_stop")  # their `replica` is a relay's number


@dataclass(frozen=True)
class Fault:
    """One injected fault.

    ``kill``: replica ``replica`` dies when it reaches ``step`` (restarted after
    ``seconds``, rejoins). ``hang``: it stops (no heartbeats, no progress) for
    ``seconds`` in the compute of ``step``. ``ring``: ring ``rank`` of the
    all-reduce at ``step`` fails for every member. ``rank``: rank ``rank`` of
    ``replica`` fails locally at ``step`` (its replica does not commit, the
    others do: it catches up next step). ``lighthouse``: the lighthouse
    process is SIGKILLed when replica 0 reaches ``step`` and restarted on the
    same port ``seconds`` later. ``lighthouse_answering``: the same, but the SIGKILL lands
    the moment replica 0 holds its answer for ``step``, while the lighthouse is still writing
    the other members' answers (some of them never arrive: the members holding one are in
    the all-reduce, the others ask the restarted lighthouse). ``relay``: relay number
    ``replica`` is SIGKILLed when replica 0 reaches ``step`` and restarted on the same port ``seconds``
    later (0: never; the processes it carried go to the lighthouse directly
    and come back to it once it is back). ``relay_stop``: relay number
    ``replica`` is SIGSTOPped for ``seconds`` (it keeps its connections and
    answers nothing), then continued.
    """

    kind: str
    step: int
    replica: int = 0
    rank: int = 0
    seconds: float = 1.0

    def __post_init__(self) -> None:
        if self.kind not in FAULT_KINDS:
            raise ValueError(f"fault kind {self.kind!r} unknown; one of {FAULT_KINDS}")
        if self.step < 0 or self.replica < 0 or self.rank < 0 or not self.seconds >= 0:
            raise ValueError(f"fault {self}: step, replica, rank and seconds must be >= 0")


@dataclass(frozen=True)
class EmulationConfig:
    replicas: int
    ranks_per_replica: int
    steps: int
    model: ModelShape = ModelShape()
    fabric: FabricConfig = FabricConfig()
    timeouts: Timeouts = Timeouts(detect_s=0.8, join_timeout_s=0.5, allreduce_timeout_s=10.0,
                                  quorum_timeout_s=60.0, lighthouse_outage_s=30.0)
    max_retries: int = 3
    catch_up_s: float = 0.05  # emulated state fetch of a behind replica
    rebuild_s: float = 0.002  # emulated ring reconnection on a new quorum id
    heartbeats: bool = True  # leaders heartbeat (False: an open quorum call is the only sign of life)
    faults: tuple[Fault, ...] = ()
    job_id: str = "emulation"
    lighthouse_tick_s: float = 0.02
    run_timeout_s: float = 600.0  # the whole run; past it the report says what was still running
    # Measurement mode (experiments/scale.py): a leader that holds its answer
    # waits until every running replica of this process holds the same round's
    # answer (at most 1 s) before its ranks replay it. On real hosts each
    # replica's ranks work in parallel; here they share one event loop, and
    # without the barrier one replica's replay would delay the next one's
    # answer and be counted as quorum latency.
    round_barrier: bool = False
    # Run the lighthouse under cProfile and write its stats here (where its time goes).
    lighthouse_profile: str = ""
    # Run it under fthsdp.sim.lighthouse_trace and write its stages' timestamps here
    # (experiments/scale.py's per-round breakdown; the lighthouse is unchanged).
    lighthouse_trace: str = ""
    # Processes per replica (P; the replica's G ranks are P x D devices, D = G / P):
    # as in the real protocol (version 2), every process heartbeats under (replica,
    # process) and registers its own D shards' endpoints, the leader asks for the
    # quorum and gets its view (the members and its D shards' rings: O(R + D) as ring
    # neighbours, O(R x D) whole), and the other processes fetch their own views (GetView)
    # when the quorum id changes.
    processes_per_replica: int = 1
    # Heartbeats and quorum requests on one session stream per process (fthsdp.control.session),
    # as the real client does by default; False: a unary call each (the earlier transport).
    lighthouse_session: bool = True
    # Relays between the leaders and the lighthouse (fthsdp.control.relay), each its own process
    # carrying the sessions of a contiguous block of replicas; 0: every process speaks to the
    # lighthouse directly.
    relays: int = 0
    # How long a process that left its relay waits before it tries the relay again, and how long
    # a relay may answer nothing before its processes leave it (fthsdp.control.session_client.
    # RelayPath; shorter in tests than a job's 5 s and 10 s).
    relay_retry_s: float = RelayPath.RETRY_S
    relay_silence_s: float = RelayPath.SILENCE_S
    # How leaders (and followers) take a new quorum's rings (fthsdp.control.lighthouse_client.
    # RING_FORMS): their ring neighbours' endpoints only (the real client's default), a delta
    # against the view they hold, or whole, as older clients (experiments/ring_forms.py).
    ring_form: str = "neighbours"
    # Emulator processes (fthsdp.sim.shards): the replicas split into this many contiguous blocks,
    # each run by its own process; their all-reduce rendezvous and round barriers meet across the
    # processes. One process sends every leader's request and reads every answer in turn, which on
    # a many-core host is what a measurement of the lighthouse would see; real leaders are hosts
    # of their own. Fault-free runs only (faults reach across replicas: a kill fails the others'
    # all-reduces, a lighthouse restart is timed by replica 0).
    emulator_processes: int = 1
    # CPUs the lighthouse process is bound to (empty: wherever the system runs it): a measurement
    # that keeps it off the emulator's cores (experiments/scale.py --lighthouse-cpus).
    lighthouse_cpus: tuple[int, ...] = ()
    # A folder holding another fthsdp package (an earlier commit's: experiments/before_after.py's
    # extract) to run the lighthouse and relays from, so that one emulator measures two servers
    # side by side (empty: this installation's).
    lighthouse_from: str = ""
    # The lighthouse's beat budget (`fthsdp lighthouse --beats-per-s`; 0 = never pace the beats);
    # None: its default (fthsdp.control.pacing).
    lighthouse_beats_per_s: float | None = None

    def __post_init__(self) -> None:
        if self.replicas < 1 or self.ranks_per_replica < 1 or self.steps < 1:
            raise ValueError(f"replicas, ranks_per_replica and steps must be >= 1, got {self.replicas}, "
                             f"{self.ranks_per_replica}, {self.steps}")
        self.timeouts.check()
        p = self.processes_per_replica
        if p < 1 or self.ranks_per_replica % p:
            raise ValueError(f"processes_per_replica {p} must be >= 1 and divide ranks_per_replica "
                             f"{self.ranks_per_replica} (every process holds the same number of shards)")
        if not 0 <= self.relays <= self.replicas or (self.relays and not self.lighthouse_session):
            raise ValueError(f"relays {self.relays} must be in 0..replicas ({self.replicas}), and relays carry "
                             "session streams only (lighthouse_session must be true)")
        try:  # the clients' own checks, before any process starts
            RelayPath("", self.relay_retry_s, self.relay_silence_s)
        except ValueError as e:
            raise ValueError(f"relay_retry_s / relay_silence_s: {e}") from None
        ring_request_flags(self.ring_form)  # an unknown form is refused here, before any process starts
        if not 1 <= self.emulator_processes <= self.replicas:
            raise ValueError(f"emulator_processes {self.emulator_processes} must be in 1..replicas ({self.replicas})")
        if self.emulator_processes > 1 and self.faults:
            raise ValueError(f"emulator_processes {self.emulator_processes} runs fault-free rows only "
                             f"({len(self.faults)} fault(s) given): a fault reaches across replicas (a kill fails the "
                             "others' all-reduces, a lighthouse or relay fault is timed by replica 0); run faults with "
                             "emulator_processes=1")
        if self.lighthouse_cpus and not (hasattr(os, "sched_setaffinity")
                                         and all(0 <= k < (os.cpu_count() or 1) for k in self.lighthouse_cpus)):
            raise ValueError(f"lighthouse_cpus {list(self.lighthouse_cpus)}: this machine has CPUs 0.."
                             f"{(os.cpu_count() or 1) - 1} (and binding needs Linux); name some of those, or none")
        if self.lighthouse_from and not os.path.isfile(os.path.join(self.lighthouse_from, "fthsdp", "control",
                                                                     "lighthouse.py")):
            raise ValueError(f"lighthouse_from {self.lighthouse_from!r} holds no fthsdp package (fthsdp/control/"
                             "lighthouse.py): give a folder with one, e.g. experiments/before_after.py's extract")
        if p > 1 and not self.heartbeats:
            raise ValueError("processes_per_replica > 1 needs heartbeats: a process registers its endpoints and "
                             "shows it is alive only by heartbeating")
        for f in self.faults:
            if f.replica >= self.replicas and f.kind not in RELAY_FAULTS:
                raise ValueError(f"fault {f} names replica {f.replica} but there are {self.replicas}")
            if f.kind in RELAY_FAULTS and f.replica >= self.relays:
                raise ValueError(f"fault {f} names relay {f.replica} but there are {self.relays}")
            if f.kind in ("ring", "rank") and f.rank >= self.ranks_per_replica:
                raise ValueError(f"fault {f} names rank {f.rank} but replicas have {self.ranks_per_replica}")

    @property
    def ranks(self) -> int:
        return self.replicas * self.ranks_per_replica


def package_first(root: str) -> dict[str, str]:
    """This process's environment with the fthsdp package under ``root`` first on the path
    of a process started with it (an earlier commit's extract: experiments/before_after.py)."""
    rest = [os.environ["PYTHONPATH"]] if os.environ.get("PYTHONPATH") else []
    return dict(os.environ, PYTHONPATH=os.pathsep.join([str(root), *rest]))


_BIND = "import os, sys; os.sched_setaffinity(0, map(int, sys.argv[1].split(','))); os.execv(sys.argv[2], sys.argv[2:])"


class LighthouseProcess:
    """The real lighthouse in its own process, killable and restartable on the same port."""

    def __init__(self, config: EmulationConfig, log_path: str) -> None:
        self.config = config
        self.log_path = log_path
        self.port = 0
        self.proc: subprocess.Popen | None = None
        self.starts = 0
        self.started_at: list[float] = []  # perf_counter when each start was serving

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    READY = "lighthouse listening on "  # the line the process prints once it serves

    def command(self) -> list[str]:
        t = self.config.timeouts
        prof = ["-m", "cProfile", "-o", self.config.lighthouse_profile] if self.config.lighthouse_profile else []
        # --insecure: the emulated replicas do not sign their calls (the emulation measures the
        # lighthouse's scale; experiments/quorum_scale.py measures what authentication costs).
        server = ["-m", "fthsdp.sim.lighthouse_trace", "--trace-out", self.config.lighthouse_trace] \
            if self.config.lighthouse_trace else ["-m", "fthsdp.control.lighthouse"]
        return [sys.executable, *prof, *server, "--bind", f"127.0.0.1:{self.port}", "--insecure",
                "--detect", str(t.detect_s), "--join-timeout", str(t.join_timeout_s),
                "--replicas", str(self.config.replicas), "--tick", str(self.config.lighthouse_tick_s),
                "--log-level", "WARNING",
                *(["--beats-per-s", str(self.config.lighthouse_beats_per_s)]
                  if self.config.lighthouse_beats_per_s is not None else [])]

    def start(self, timeout_s: float = 60.0) -> str:
        cmd = self.command()
        err = open(self.log_path, "a")
        try:
            cpus = self.cpus()
            # Bound before it starts a thread: a small interpreter binds itself and execs the server
            # (a preexec_fn would fork this process, whose JAX and gRPC threads forbid it).
            bind = [sys.executable, "-c", _BIND, ",".join(map(str, cpus))] if cpus else []
            env, cwd = None, None
            if self.config.lighthouse_from:  # its package first on the path (and nothing of this tree's cwd)
                cwd = os.path.abspath(self.config.lighthouse_from)
                env = package_first(cwd)
            self.proc = subprocess.Popen(bind + cmd, stdout=subprocess.PIPE, stderr=err, text=True, env=env, cwd=cwd)
        finally:
            err.close()
        deadline = time.monotonic() + timeout_s
        line = ""
        while time.monotonic() < deadline:  # readline blocks; the process prints one line when ready
            line = self.proc.stdout.readline()
            if line or self.proc.poll() is not None:
                break
        if not line.startswith(self.READY):
            self.kill()
            raise RuntimeError(f"{self.READY.split()[0]} did not start ({cmd}): {line!r}; see {self.log_path}")
        self.port = int(line.split()[-1].rpartition(":")[2])
        self.starts += 1
        self.started_at.append(time.perf_counter())
        return self.address

    def cpus(self) -> tuple[int, ...]:
        """The CPUs the process is bound to from its start (every thread of it; empty: any)."""
        return self.config.lighthouse_cpus

    def kill(self) -> None:
        """SIGKILL (no goodbye: a crash)."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
            self.proc.wait(30)
        if self.proc is not None and self.proc.stdout is not None:
            self.proc.stdout.close()
        self.proc = None

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                try:  # a process holding thousands of connections on a saturated machine can take a while
                    self.proc.wait(120)
                except subprocess.TimeoutExpired:
                    log.warning("lighthouse process %d did not exit within 120 s of SIGKILL", self.proc.pid)
        if self.proc is not None and self.proc.stdout is not None:
            self.proc.stdout.close()
        self.proc = None


def process_cpu_s(pid: int) -> float:
    """CPU seconds (user + system) process ``pid`` used so far (Linux /proc; 0.0 elsewhere)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rpartition(")")[2].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError):
        return 0.0


class RelayProcess(LighthouseProcess):
    """A real relay (fthsdp.control.relay) in its own process, between a block of replicas and
    the lighthouse (which keeps its port across restarts, so the relay's channel finds it again)."""

    READY = "relay listening on "

    def __init__(self, config: EmulationConfig, log_path: str, lighthouse: LighthouseProcess) -> None:
        super().__init__(config, log_path)
        self.lighthouse = lighthouse
        self.cpu_s = 0.0  # read when it is stopped (a killed one's is lost)
        self.stats: dict = {}  # what it carried (fthsdp.control.relay.Relay.stats), from its log

    def cpus(self) -> tuple[int, ...]:
        return ()  # the relays run where the system puts them

    def command(self) -> list[str]:
        # INFO: its last line, when it stops, is what it carried (self.stats)
        return [sys.executable, "-m", "fthsdp.control.relay", "--lighthouse", self.lighthouse.address,
                "--bind", f"127.0.0.1:{self.port}", "--log-level", "INFO"]

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.cpu_s = process_cpu_s(self.proc.pid)
        super().stop()
        try:
            with open(self.log_path) as f:
                last = [line for line in f if "relay stopping (" in line][-1]
            self.stats = ast.literal_eval(last.partition("relay stopping (")[2].rstrip().removesuffix(")"))
        except (OSError, IndexError, ValueError, SyntaxError):
            self.stats = {}


def percentile_failing(xs: list[float | None], q: float) -> float | None:
    """The ``q`` quantile of round latencies where None is a round that never completed: it
    ranks slower than any, and a quantile that falls on one is None (not met), instead of the
    incomplete rounds being dropped and the slowest rounds with them. None for no rounds."""
    if not xs:
        return None
    s = sorted(xs, key=lambda x: (x is None, x or 0.0))
    return s[min(len(s) - 1, max(0, round(q * (len(s) - 1))))]


DECLARED_DEAD = "lighthouse declared"  # how an all-reduce aborted on a member's death says so


def detection_bound_s(t: Timeouts, paced_s: float) -> float:
    """The longest a survivor should wait in an all-reduce whose member went silent (hung or
    dead) before it aborts: the lighthouse's silence window (widened when it paces the beats,
    fthsdp.control.pacing), then a beat of the survivor's to hear of it, and that beat's RPC.
    The member fell silent no later than the survivors entered the all-reduce (it hangs in the
    step's compute, before its own all-reduce), so this bounds the wait from entering."""
    window = max(t.detect_s, PACED_BEATS_PER_WINDOW * paced_s)
    return window + paced_interval(t.heartbeat_interval_s, paced_s) + t.heartbeat_rpc_s


def retry_pause_s(failing: int) -> float:
    """The pause before asking again after ``failing`` quorum requests failed in a row: the
    Manager's ``min(1, 0.1 x failing)``, whether the failure used up an attempt or not."""
    return min(1.0, 0.1 * failing)


def quorum_wait_deadline(t: Timeouts, outage_s: float) -> float:
    """The longest a get_quorum round may take from its first ask: the quorum deadline, plus
    the outage allowance when the answer came after riding out an unreachable lighthouse."""
    return t.quorum_timeout_s + (t.lighthouse_outage_s if outage_s > 0 else 0.0)


def redone_from_scratch(first: CommitRecord | None, superseded: list[CommitRecord]) -> str:
    """A problem ("" if none) when the kept lineage's step 0 (``first``) was committed after a
    superseded commit of a later step: the job's progress was thrown away and trained again
    from its start (every replica lost its state and the rejoiners began anew)."""
    if first is None or not first.at:
        return ""
    lost = [r for r in superseded if r.step > 0 and r.at and r.at < first.at]
    if not lost:
        return ""
    top = max(lost, key=lambda r: r.step)
    return (f"the job was redone from scratch: the lineage kept committed step 0 (quorum {first.quorum_id}) after "
            f"step {top.step} had been committed (quorum {top.quorum_id}, superseded)")


def commit_problems(rid: str, p: fsm.Plan, q: qm.Quorum, position: int, last_step: int, batch: int | None,
                    trained: bool) -> list[str]:
    """What is wrong with replica ``rid`` committing ``p.step`` in ``q`` from a data state whose
    last commit was ``last_step``, its own loader at ``position``, and the data state saying it
    trained stream position ``batch`` (None: none): checks from outside the data state, so
    that a batch skipped or trained twice, a step committed twice or skipped, or a committer
    the quorum does not name each show (empty: none)."""
    out = []
    members, healthy = fsm.membership(q)
    if rid not in members:
        out.append(f"committed step {p.step} in quorum {q.quorum_id}, which does not name it")
    elif trained != (rid in healthy):
        out.append(f"committed step {p.step} in quorum {q.quorum_id} as {p.action.value} but the quorum calls it "
                   f"{'healthy' if rid in healthy else 'behind'}")
    if p.step != last_step + 1:
        out.append(f"committed step {p.step} on a data state whose last step is {last_step}")
    if trained and batch != position:
        out.append(f"trained stream position {batch} at step {p.step}, but its loader is at {position}")
    elif not trained and batch is not None:
        out.append(f"trained stream position {batch} at step {p.step} while catching up")
    return out


class DataState:
    """The replicated data state: the next stream position of every replica's loader.

    Immutable and shared. A real replica holds its own copy and advances it in
    O(R) per commit, in parallel with the others; one emulation process holding
    R copies paid O(R^2) per round (about 3 s a round at 2,048 flat replicas,
    an emulation artefact counted as quorum latency). Every replica that
    commits the same quorum from the same state reaches the same next state, so
    it is computed once and shared, as an answer is decoded once (DecodeCache).

    Each state also knows the commit that made it (``parent``, ``step``,
    ``quorum_id``, ``batches``): its :meth:`history` is the lineage a replica
    holding it trained, which is what exactly-once is checked on. Two replicas
    that committed the same step in different quorums hold different
    lineages; that is harmless only while one of them is abandoned (its holder
    fetches the other's state), which the report checks at the end.
    """

    __slots__ = ("positions", "_after", "parent", "step", "quorum_id", "batches", "_trained")

    def __init__(self, positions: dict[str, int] | None = None, parent: "DataState | None" = None,
                 step: int = -1, quorum_id: int = 0, batches: tuple = ()) -> None:
        self.positions: dict[str, int] = positions if positions is not None else {}
        self._after: tuple[qm.Quorum, tuple, "DataState"] | None = None  # the last commit from this state
        self.parent, self.step, self.quorum_id, self.batches = parent, step, quorum_id, batches
        self._trained: dict[str, int] | None = None

    def trained(self) -> dict[str, int]:
        """replica -> the stream position it trained into the commit that made this state (built
        once per shared state, not once per replica: O(R) a round, not O(R^2))."""
        if self._trained is None:
            self._trained = dict(self.batches)
        return self._trained

    def history(self) -> list["DataState"]:
        """The commits that made this state, oldest first (one per committed step)."""
        out: list[DataState] = []
        s: DataState | None = self
        while s is not None and s.parent is not None:
            out.append(s)
            s = s.parent
        out.reverse()
        return out

    def commit(self, q: qm.Quorum) -> tuple[tuple[tuple[str, int], ...], "DataState"]:
        """``(batches trained, next state)`` when ``q``'s healthy replicas each train their next batch."""
        hit = self._after
        if hit is not None and (hit[0] is q or (hit[0].healthy is q.healthy and hit[0].quorum_id == q.quorum_id
                                                and hit[0].max_step == q.max_step)):
            return hit[1], hit[2]  # the same decision (views differing only in their rings)
        batches = tuple((h, self.positions.get(h, 0)) for h in q.healthy)
        nxt = dict(self.positions)
        for h in q.healthy:
            nxt[h] = nxt.get(h, 0) + 1
        new = DataState(nxt, self, q.max_step, q.quorum_id, batches)
        self._after = (q, batches, new)
        return batches, new


def decision(p: fsm.Plan) -> tuple:
    """What a plan decides, the same on every rank of a replica: the fields a follower process,
    planning on its own view (other rings, its own shards' sources), must agree on with its leader."""
    return p.action, p.step, p.quorum_id, p.reconfigure, p.compute


def follower_quorum(q: qm.Quorum, view: qm.Quorum) -> qm.Quorum:
    """The quorum a follower process plans on: its leader's decision ``q`` with its own ``view``'s
    rings and recovery sources. A mirror of ``FollowerQuorumSource._merge`` (fthsdp/replica/group.py)
    but for the members' state servers, which no plan reads and which would cost O(R) per process
    per round here (the members stay the leader's tuple: fsm.membership's cache keeps hitting)."""
    return dataclasses.replace(q, rings=view.rings, first_shard=view.first_shard, ring_neighbours=view.ring_neighbours,
                               sources=view.sources if q.recovery else (), recovery=view.recovery if q.recovery else {})


class RankGroup:
    """The D emulated ranks of one process of a replica (its shards ``first`` .. ``first + D - 1``).

    Every rank keeps its own control state (``states[k]``, rank ``first + k``) and
    replays its leader's decisions on it; the group holds the one answer object
    its ranks read (``quorum``), as one process hands its devices the decision
    once: telling 6,250 ranks is one assignment, not 6,250 (on real hosts each
    process does this in parallel with the others; per-rank protocol work here
    would be the emulator's own cost counted as the system's).

    The replays (:func:`fthsdp.replica.fsm.plan`, :func:`fthsdp.replica.fsm.after_attempt`)
    run once per *distinct state object* among the ranks, then every rank takes
    the result for its own state. The functions are pure, so this is exact:
    ranks holding the same state reach the same decision, and a rank whose state
    diverged is a distinct input, replayed on its own and counted as a violation
    when it disagrees with the leader. Replaying each of 100,000 ranks one by one
    cost the emulator ~1.2 s of one core per round, taken from the lighthouse
    sharing the machine.
    """

    __slots__ = ("first", "states", "quorum", "commits", "_distinct", "_counts", "_plans")

    def __init__(self, first: int, size: int, state: fsm.StepState) -> None:
        self.first = first
        self.states: list[fsm.StepState] = [state] * size
        self.quorum: qm.Quorum | None = None
        self.commits = 0  # the group's ranks commit together (the replica's vote)
        self._distinct: dict[int, fsm.StepState] = {}
        self._counts: dict[int, int] = {}
        self._plans: dict[int, fsm.Plan] = {}

    def __len__(self) -> int:
        return len(self.states)

    def _group(self) -> None:
        """The distinct state objects among the ranks, and how many ranks hold each.
        Every rank is looked at: ``list.count`` compares each rank's state with the first
        (identity first, in C: ~10 ns a rank), and only ranks holding other objects take
        the slower pass that groups them."""
        st = self.states
        if st.count(st[0]) == len(st):
            self._distinct, self._counts = {id(st[0]): st[0]}, {id(st[0]): len(st)}
            return
        self._distinct = dict(zip(map(id, st), st))
        self._counts = collections.Counter(map(id, st))

    def disagree(self, state: fsm.StepState) -> int:
        """How many ranks hold a state other than ``state`` (the leader's)."""
        self._group()
        return sum(self._counts[k] for k, x in self._distinct.items() if x is not state and x != state)

    def plan(self, rid: str, leader: fsm.Plan) -> int:
        """Every rank plans its attempt on the answer the group holds (a follower process's: the
        leader's decision with its own view's rings and sources); returns how many ranks decided
        differently from ``leader`` (:func:`decision`: what to do, not which rings to do it on).
        A rank that gave up earlier (it disagreed once already) stays given up."""
        self._group()
        q = self.quorum
        self._plans = {k: fsm.plan(x, q, rid) if x.action is fsm.Action.ASK else None
                       for k, x in self._distinct.items()}
        want = decision(leader)
        return sum(self._counts[k] for k, p in self._plans.items() if p is None or decision(p) != want)

    def after(self, outcome: fsm.Outcome, planned: bool, leader: fsm.StepState, counted: bool = True) -> int:
        """Every rank moves on from its attempt's ``outcome`` (with its plan when
        ``planned``; a quorum error ``counted`` or not, as the leader judged it: one clock);
        returns how many ranks reach a state other than ``leader``'s.
        A rank reaching an equal state holds the leader's object (they stay shared)."""
        if not planned:
            self._group()
        nxt = {}
        for k, x in self._distinct.items():
            if x.action is fsm.Action.GIVE_UP:  # (a diverged rank: see plan)
                nxt[k] = x
                continue
            t = fsm.after_attempt(x, self._plans[k] if planned else None, outcome, counted)
            nxt[k] = leader if t == leader else t
        if len(nxt) == 1:  # every rank held the same state: every rank takes the same result
            self.states = [next(iter(nxt.values()))] * len(self.states)
        else:
            self.states = list(map(nxt.__getitem__, map(id, self.states)))
        return sum(self._counts[k] for k, t in nxt.items() if t is not leader)


@dataclass
class QuorumRecord:
    """One get_quorum round trip of one replica: from its last rank's request to every rank holding the answer."""

    replica_id: str
    step: int
    attempt: int
    quorum_id: int
    last_rank_request: float  # perf_counter: the last of its ranks handed its request to the leader
    sent: float
    received: float
    all_ranks_hold: float  # the last of its ranks holds the quorum
    outage_s: float


@dataclass
class CommitRecord:
    step: int
    quorum_id: int
    members: tuple[str, ...]
    healthy: tuple[str, ...]
    batches: tuple[tuple[str, int], ...]  # (replica, stream position) trained into this step
    at: float = field(default=0.0, compare=False)  # time.monotonic() of its first commit (system-wide on Linux)


@dataclass
class EmulationReport:
    config: EmulationConfig
    wall_s: float
    quorum_records: list[QuorumRecord]
    # step -> what its committers agreed on, along the lineage the replicas finished with
    # (commits of an abandoned fork are counted in `superseded`, not here)
    commits: dict[int, CommitRecord]
    committers: dict[int, set[str]]  # step -> replicas that committed it (in that lineage's quorum)
    final_steps: dict[str, int]  # replica -> committed steps of its last incarnation
    qids_seen: dict[str, list[int]]
    waits: list[tuple[str, float, float]]  # (what, waited, deadline)
    events: list[str]
    problems: list[str]  # violations found while running
    lighthouse_starts: int
    rank_replays: int
    fabric_completed: int
    fabric_failed: int
    decode: tuple[int, int]  # answers decoded, cache hits
    unfinished: list[str]
    views_fetched: int = 0  # followers' GetView answers (a new quorum id, replicas of P > 1 processes)
    superseded: int = 0  # commits of a forked lineage that its holders abandoned (fetched the job's state)
    answer_bytes: int = 0  # the largest quorum answer (a leader's view) on the wire
    # (request bytes, answer bytes) of every leader's quorum request that was answered: what a
    # round puts on the wire, for experiments/grpc_floor.py's bare round of the same sizes
    wire_sizes: list[tuple[int, int]] = field(default_factory=list)
    # The emulated ranks' own Python work per step (gather check and replays, every replica),
    # and this process's CPU time over the run: the emulator's cost, not the system's.
    rank_work_s: dict[int, float] = field(default_factory=dict)
    emulator_cpu_s: float = 0.0
    relay_cpu_s: float = 0.0  # the relay processes' CPU time over the run, all together
    relay_stats: list[dict] = field(default_factory=list)  # what each relay carried (its Relay.stats)
    # step -> (the emulator's CPU, the live relays', the lighthouse's) when replica 0 began it: a
    # steady round's cost, without the start-up and the first rounds (answers carrying every ring)
    cpu_at_step: dict[int, tuple[float, float, float]] = field(default_factory=dict)
    # perf_counter when each start of the lighthouse was serving (a restart's round is timed from it)
    lighthouse_started_at: list[float] = field(default_factory=list)
    # What the lighthouse logged: {"declared_dead": N, "paced": [its pacing lines], "head": [...]}
    lighthouse_log: dict = field(default_factory=dict)

    def cpu_per_round(self, first: int) -> tuple[float | None, float | None, float | None]:
        """(emulator, relays, lighthouse) CPU seconds per round from step ``first`` to the last one
        sampled, None without two samples (a relay or lighthouse killed meanwhile makes its share
        a lower bound)."""
        steps = sorted(s for s in self.cpu_at_step if s >= first)
        if len(steps) < 2:
            return None, None, None
        a, b = self.cpu_at_step[steps[0]], self.cpu_at_step[steps[-1]]
        n = steps[-1] - steps[0]
        return (b[0] - a[0]) / n, (b[1] - a[1]) / n, (b[2] - a[2]) / n

    def violations(self, deadline_slack_s: float = 2.0) -> list[str]:
        """Every broken invariant, in words (empty = all hold)."""
        out = list(self.problems)
        # Exactly once: each replica's stream positions trained 0, 1, 2, ... with no gap or repeat.
        trained: dict[str, list[int]] = collections.defaultdict(list)
        for step in sorted(self.commits):
            for rid, pos in self.commits[step].batches:
                trained[rid].append(pos)
        for rid, positions in trained.items():
            if positions != list(range(len(positions))):
                dup = [p for p, c in collections.Counter(positions).items() if c > 1]
                out.append(f"replica {rid}: batches not exactly once (duplicates {dup[:5]}, "
                           f"sequence head {positions[:10]})")
        steps = sorted(self.commits)
        if steps and steps != list(range(steps[-1] + 1)):
            out.append(f"committed steps have gaps: {steps[:20]}")
        for step, who in self.committers.items():
            members = set(self.commits[step].members)
            if not who <= members:
                out.append(f"step {step} committed by non-members {sorted(who - members)}")
        for rid, qids in self.qids_seen.items():
            if any(b < a for a, b in zip(qids, qids[1:])):
                out.append(f"replica {rid}: quorum ids went backwards: {qids[:30]}")
        ran_out = []
        for what, waited, deadline in self.waits:
            if waited > deadline + deadline_slack_s:
                out.append(f"{what} waited {waited:.2f}s past its deadline {deadline:g}s")
            elif what.endswith(" all-reduce") and waited >= 0.99 * deadline:
                ran_out.append(what.removesuffix(" all-reduce"))
        if ran_out:
            # Survivors don't wait (invariant 5): a member that cannot join an all-reduce (dead,
            # hung, never answered, asking again) is detected and the all-reduce aborted; one
            # that runs to its deadline stalled the job for it (a lighthouse killed while
            # answering did, until its heartbeats named the replicas asking).
            out.append(f"{len(ran_out)} all-reduce(s) ran to their deadline instead of being aborted when a member "
                       f"could not join (replicas {ran_out[:8]})")
        if self.unfinished:
            out.append(f"still running at the run's deadline: {self.unfinished[:10]}")
        return out

    def rounds(self) -> list[dict]:
        """Per (step, attempt) with every replica: latency from the last request to every rank holding it."""
        by: dict[tuple[int, int], list[QuorumRecord]] = collections.defaultdict(list)
        for r in self.quorum_records:
            by[(r.step, r.attempt)].append(r)
        out = []
        for (step, attempt), rs in sorted(by.items()):
            out.append({  # (a replica that asked twice in one round, e.g. a rejoiner told to wait, counts once)
                "step": step, "attempt": attempt, "replicas": len({r.replica_id for r in rs}),
                "quorum_ids": sorted({r.quorum_id for r in rs}),
                "latency_s": max(r.all_ranks_hold for r in rs) - max(r.last_rank_request for r in rs),
                "lighthouse_s": max(r.received for r in rs) - max(r.sent for r in rs),
                "fanout_s": max(r.all_ranks_hold - r.received for r in rs),
                "outage_s": max(r.outage_s for r in rs),
            })
        return out

    def summary(self) -> dict:
        """Latency over the rounds after the first (round 0 connects and forms the first quorum),
        counted alike in ``rounds``, ``complete_rounds`` and the percentiles; a round that not
        every replica completed (or one that rode out an outage) counts as slower than any, so
        that it cannot leave the percentiles looking better (None when one falls on it)."""
        rounds = self.rounds()[1:]
        full = [r["replicas"] == self.config.replicas and r["outage_s"] == 0 for r in rounds]
        lat = [r["latency_s"] if ok else None for r, ok in zip(rounds, full)]
        return {
            "replicas": self.config.replicas, "ranks": self.config.ranks, "wall_s": self.wall_s,
            "complete_rounds": sum(full), "rounds": len(rounds),
            "p50_s": percentile_failing(lat, 0.5), "p99_s": percentile_failing(lat, 0.99),
            "final_steps": sorted(set(self.final_steps.values())),
            "events": len(self.events), "violations": len(self.violations()),
        }


class EmulatedReplica:
    """One replica: P processes (each a lighthouse client heartbeating as its process,
    D = G / P ranks each); process 0 leads (asks for the quorum, hands the decision to
    the others, as over the real replica's key-value store), the others fetch their
    own views of a new quorum id."""

    def __init__(self, emu: "Emulation", index: int, incarnation: int, rejoin: bool) -> None:
        c = emu.config
        self.emu = emu
        self.index = index
        self.rid = str(index)
        self.incarnation = incarnation
        self.rejoin = rejoin
        nproc = c.processes_per_replica
        self.per_process = c.ranks_per_replica // nproc
        # Process p's own shards' endpoints and state server (p holds shards p*D .. p*D+D-1): addresses
        # nobody connects to, but well-formed (the lighthouse checks their syntax).
        self.ftar = [tuple(f"emu-{index}.{incarnation}:{p * self.per_process + k + 1}" for k in range(self.per_process))
                     for p in range(nproc)]
        self.servers = [f"http://emu-{index}.{incarnation}.{p}.state:1" for p in range(nproc)]
        self.state = fsm.initial(0, c.max_retries)
        self.groups = [RankGroup(p * self.per_process, self.per_process, self.state) for p in range(nproc)]
        self.data = emu.initial_data  # the replicated data state (shared with the replicas in the same state)
        # Its own loader's next stream position, kept apart from ``data`` (advanced on a committed
        # TRAIN, installed from the fetched state on a committed catch-up; a restart holds none):
        # each commit's batch is checked against it (commit_problems).
        self.position = 0
        self.clients: list[AioLighthouseClient] = []
        for p in range(nproc):
            cl = AioLighthouseClient(emu.lighthouse_address, c.job_id, self.rid,
                                     outage_s=c.timeouts.lighthouse_outage_s,
                                     heartbeat_timeout_s=c.timeouts.heartbeat_rpc_s, rejoin=rejoin,
                                     process_index=p, num_processes=nproc, session=c.lighthouse_session,
                                     relay=emu.relay_of(index), relay_retry_s=c.relay_retry_s,
                                     relay_silence_s=c.relay_silence_s, ring_form=c.ring_form)
            cl.decode_cache = emu.decode_cache
            if nproc > 1:
                cl.register(self.ftar[p], self.servers[p], c.ranks_per_replica)
            self.clients.append(cl)
        self.client = self.clients[0]  # the leader's
        self.view_qid = 0  # the quorum id whose views the followers hold
        self.views: list[qm.Quorum | None] = [None] * nproc  # each follower process's (index 0: the leader's)
        self.failing_since: float | None = None  # quorum requests failing in a row: since, how many
        self.failing = 0
        self.inflight: tuple[qm.Quorum, int] | None = None  # the quorum and step of the all-reduce it is in
        self.hung = False
        self.finished = False
        self.step0_since: float | None = None  # a rejoiner healthy at step 0 asks again since (fsm.rejoin_at_step_0)
        self.step0_trusted = False
        self.asking: tuple[int, int] | None = None  # the (step, attempt) it asks for, since perf_counter asked_at
        self.asked_at = 0.0
        self.task: asyncio.Task | None = None
        self.hb_tasks: list[asyncio.Task] = []

    # -- helpers ---------------------------------------------------------------

    def _violation(self, what: str) -> None:
        self.emu.problems.append(f"replica {self.rid}.{self.incarnation}: {what}")

    def _fatal(self, kind: FaultClass, why: str) -> None:
        """What a real replica process does on an error it cannot retry: it exits; a replica-fatal
        one is restarted by its supervisor (it rejoins), a job-fatal one stops the job. Either is a
        violation here: no emulated fault should make the control plane give up."""
        self._violation(f"{kind.value}: {why}")
        if kind is FaultClass.JOB_FATAL:
            self.emu.job_fatal(self)
        else:
            self.emu.replica_fatal(self)

    def _replay_after(self, p: fsm.Plan | None, outcome: fsm.Outcome, new: fsm.StepState,
                      counted: bool = True) -> None:
        t_work = time.perf_counter()
        bad = sum(g.after(outcome, p is not None, new, counted) for g in self.groups)
        self.emu.rank_work(self.state.step, time.perf_counter() - t_work)
        self.emu.rank_replays += self.emu.config.ranks_per_replica
        if bad:
            self._violation(f"{bad} rank(s) disagree with the leader after {outcome.value}")

    # -- the loop --------------------------------------------------------------

    async def run(self) -> None:
        emu, c = self.emu, self.emu.config
        if c.heartbeats:
            loop = asyncio.get_running_loop()
            self.hb_tasks = [loop.create_task(self._heartbeats(p)) for p in range(len(self.clients))]
        nbytes = c.model.shard_bytes(c.ranks_per_replica)
        try:
            await self.client.connect(c.timeouts.lighthouse_outage_s)
            while self.state.step < c.steps and self.state.action is not fsm.Action.GIVE_UP:
                state = self.state
                if state.attempt == 1 and self.incarnation == 0 and self.index == emu.replica_indices.start:
                    emu.sample_cpu(state.step)
                await emu.fire_faults(self, state.step)
                # Gather: every rank asks its leader for the quorum of its step.
                t_work = time.perf_counter()
                bad = sum(g.disagree(state) for g in self.groups)
                emu.rank_work(state.step, time.perf_counter() - t_work)
                if bad:
                    self._violation(f"{bad} rank(s) ask for a different step state than the leader")
                if self.asking != (state.step, state.attempt):  # a re-sent request keeps the round's clock
                    self.asking, self.asked_at = (state.step, state.attempt), time.perf_counter()
                last_req = self.asked_at
                try:
                    reply = await self.client.get_quorum(
                        state.step, ftar_addresses=self.ftar[0], state_server_address=self.servers[0],
                        commit_failed=state.commit_failed, num_replicas=c.replicas,
                        timeout_s=c.timeouts.quorum_timeout_s, local_world_size=c.ranks_per_replica)
                    # as FollowerQuorumSource: a new quorum id, or a recovery (its sources are per process)
                    if len(self.clients) > 1 and (reply.quorum.quorum_id != self.view_qid or reply.quorum.recovery):
                        await self._follower_views(reply.quorum)
                except JobFinished as e:
                    emu.events.append(f"replica {self.rid}: job finished at step {e.step} (at step {state.step})")
                    self.finished = True
                    return
                except LighthouseUnavailable as e:  # job-fatal (classify): no replica can form a quorum
                    self._fatal(FaultClass.JOB_FATAL, f"lighthouse unreachable past ft.lighthouse_outage_s: {e}")
                    return
                except LighthouseError as e:
                    emu.events.append(f"replica {self.rid} step {state.step}: quorum request failed: {e}")
                    # (failures in a row within the outage allowance are free: they may take that long on top)
                    emu.waits.append((f"replica {self.rid} get_quorum", time.perf_counter() - last_req,
                                      quorum_wait_deadline(c.timeouts, float(self.failing > 0))))
                    kind = classify(e).kind
                    if kind is not FaultClass.RECOVERABLE:  # the Manager re-raises it: the process ends
                        self._fatal(kind, f"quorum request at step {state.step} failed: {type(e).__name__}: {e}")
                        return
                    now = time.monotonic()  # the Manager's rule: failures within the outage allowance are free
                    self.failing_since = now if self.failing_since is None else self.failing_since
                    self.failing += 1
                    counted = fsm.quorum_error_counts(now - self.failing_since, c.timeouts.lighthouse_outage_s)
                    self.state = fsm.after_attempt(state, None, fsm.Outcome.QUORUM_ERROR, counted)
                    self._replay_after(None, fsm.Outcome.QUORUM_ERROR, self.state, counted)
                    await asyncio.sleep(retry_pause_s(self.failing))  # counted or not, as the Manager
                    continue
                self.failing_since, self.failing = None, 0
                q = reply.quorum
                emu.answered(self, state.step)
                emu.answer_bytes = max(emu.answer_bytes, self.client.last_reply_bytes)
                emu.wire_sizes.append((self.client.last_request_bytes, self.client.last_reply_bytes))
                self.groups[0].quorum = q  # one fan-out per process: its ranks read the group's answer
                for g, v in zip(self.groups[1:], self.views[1:]):  # a follower's: with its own view
                    g.quorum = follower_quorum(q, v) if v is not None else q
                held = time.perf_counter()
                emu.quorum_records.append(QuorumRecord(self.rid, state.step, state.attempt, q.quorum_id, last_req,
                                                       reply.sent_at, reply.received_at, held, reply.outage_s))
                # the whole wait from the round's first ask (an outage ridden out is allowed on top)
                emu.waits.append((f"replica {self.rid} get_quorum", reply.received_at - last_req,
                                  quorum_wait_deadline(c.timeouts, reply.outage_s)))
                emu.qids_seen[self.rid].append(q.quorum_id)
                if c.round_barrier:
                    await emu.round_barrier((state.step, state.attempt))
                else:
                    await asyncio.sleep(0)  # let the leaders whose answer arrived hand it out first
                verdict = await self._rejoiner_at_step_0(q, state)
                if verdict == "wait":
                    continue
                if verdict == "give up":
                    return
                outcome = await self._attempt(state, q, nbytes)
                if outcome is None:
                    return
        finally:
            for t in self.hb_tasks:
                t.cancel()
            emu.final_steps[self.rid] = self.state.step
            emu.final_data[self.rid] = self.data
            if self.state.step >= c.steps:
                self.finished = True
                await self.client.leave(self.state.step, finished=True)
            for cl in reversed(self.clients):  # the leader's (owning the channel) last
                await cl.close()

    async def _rejoiner_at_step_0(self, q: qm.Quorum, state: fsm.StepState) -> str:
        """A restarted replica (holding no state) that ``q`` calls healthy at step 0 does what
        the real Manager does (fsm.rejoin_at_step_0): "train", or "wait" (its quorum's all-reduce
        aborted, it asks again after a pause, no attempt spent), or "give up" (job-fatal: the
        run records it as a problem, since the emulated job then ends unfinished)."""
        c = self.emu.config
        if not fsm.step0_rule_applies(q, self.rid, rejoin=self.rejoin, step=state.step, replicas=c.replicas,
                                      trusted=self.step0_trusted):
            return "train"
        now = time.monotonic()
        self.step0_since = now if self.step0_since is None else self.step0_since
        verdict, why = fsm.rejoin_at_step_0(q, self.rid, now - self.step0_since, c.timeouts.alone_rejoin_s)
        if verdict == "train":
            self.step0_trusted = True
            self.emu.events.append(f"replica {self.rid}: restarted to rejoin, trains from step 0: {why}")
        elif verdict == "give up":
            self._violation(f"job-fatal: restarted to rejoin, {why}")
        else:
            if self.step0_since == now:
                self.emu.events.append(f"replica {self.rid}: restarted to rejoin, quorum {q.quorum_id} at step 0 "
                                       f"({why}): asks again")
            self.emu.fabric.refuse(q.quorum_id, 0, self.emu.member_set(q), f"replica {self.rid} waits for the "
                                   "job's state")
            await asyncio.sleep(min(0.5, c.timeouts.detect_s / 2))
        return verdict

    async def _follower_views(self, q: qm.Quorum) -> None:
        """The followers fetch their own views of the leader's new quorum ``q`` (their
        shards' rings and recovery sources), as the real FollowerQuorumSource does, and keep
        them: their ranks plan on the leader's decision merged with them (follower_quorum).
        A view that disagrees with the decision is a violation; a view
        the lighthouse no longer holds fails the attempt (LighthouseError, as for the
        real follower: the replica then asks again)."""
        c = self.emu.config
        views = await asyncio.gather(*(cl.get_view(q.quorum_id, timeout_s=c.timeouts.quorum_timeout_s)
                                       for cl in self.clients[1:]))
        for p, v in enumerate(views, start=1):
            vq = v.quorum
            if vq.member_ids != q.member_ids or vq.max_step != q.max_step:
                self._violation(f"process {p}'s view of quorum {q.quorum_id} disagrees with its leader's")
            want = self.per_process
            if len(vq.rings) != want or vq.first_shard != p * want:
                self._violation(f"process {p}'s view of quorum {q.quorum_id} has rings {vq.first_shard}+"
                                f"{len(vq.rings)}, not its shards {p * want}+{want}")
        self.emu.views_fetched += len(views)
        self.view_qid = q.quorum_id
        self.views[1:] = [v.quorum for v in views]

    async def _attempt(self, state: fsm.StepState, q: qm.Quorum, nbytes: int) -> fsm.Outcome | None:
        emu, c = self.emu, self.emu.config
        p = fsm.plan(state, q, self.rid)
        # Every rank replays the leader's decision on the answer it holds (RankGroup.plan).
        t_work = time.perf_counter()
        bad = sum(g.plan(self.rid, p) for g in self.groups)
        emu.rank_work(state.step, time.perf_counter() - t_work)
        emu.rank_replays += c.ranks_per_replica
        if bad:
            self._violation(f"{bad} rank(s) planned differently from the leader on quorum {q.quorum_id}")
        if p.action is fsm.Action.GIVE_UP:
            emu.events.append(f"replica {self.rid}: gives up: {p.reason}")
            self.state = fsm.after_attempt(state, p, fsm.Outcome.FAILED)
            emu.replica_fatal(self)
            return None
        if p.reconfigure:
            await asyncio.sleep(c.rebuild_s)
        outcome: fsm.Outcome | None = None
        fetched = None  # a catch-up's peers' data, installed only if the step commits
        if p.action is fsm.Action.CATCH_UP:
            if "fenced, behind" in q.reason:
                emu.events.append(f"replica {self.rid}: behind at step {state.step} in quorum {q.quorum_id} (max step "
                                  f"{q.max_step}): {q.reason.partition('; fenced, behind: ')[2]}")
            await asyncio.sleep(c.catch_up_s)
            src = p.sources[0]
            snap = emu.snapshots.get(src)
            if snap is None or snap[0] != p.step:
                emu.events.append(f"replica {self.rid}: catch-up source {src} holds step "
                                  f"{None if snap is None else snap[0]}, not {p.step}")
                outcome = fsm.Outcome.ERROR
            else:
                fetched = snap[1]
        elif p.compute:
            hang = emu.take_hang(self, p.step)
            if hang is not None:
                await self._hang(p.step, hang.seconds)
            await asyncio.sleep(c.model.step_s)
        if outcome is None:
            self.inflight = (q, p.step)
            # the Manager's deadline: a quorum with a behind member waits ft.catch_up_timeout_s longer
            deadline = c.timeouts.catch_up_allreduce_s if q.behind else c.timeouts.allreduce_timeout_s
            res = await emu.fabric.allreduce(q.quorum_id, p.step, self.rid, emu.member_set(q), nbytes,
                                             c.ranks_per_replica, deadline)
            self.inflight = None
            emu.waits.append((f"replica {self.rid} all-reduce", res.waited_s, deadline))
            if not res.ok and DECLARED_DEAD in res.reason:  # aborted on a death: within detection, not the deadline
                emu.waits.append((f"replica {self.rid} all-reduce abort on a death",
                                  res.waited_s, detection_bound_s(c.timeouts, self.client.paced_s)))
            # a rank fault fires at an all-reduce it can fail (one failing anyway would hide it)
            local = emu.fabric.rank_faults_of(p.step, self.rid) if res.ok else set()
            failed_rings = res.failed_rings
            ok = res.ok
            votes = [ok] * c.ranks_per_replica  # rank k's all-reduce: its ring and its own local part
            for k in failed_rings | local:
                if 0 <= k < len(votes):
                    votes[k] = False
            outcome = fsm.vote(votes)
            if outcome is not fsm.Outcome.COMMITTED:
                why = res.reason or f"rings {sorted(failed_rings)[:4]} / ranks {sorted(local)[:4]} failed"
                emu.events.append(f"replica {self.rid} step {p.step} quorum {q.quorum_id}: all-reduce failed: {why}")
        if outcome is fsm.Outcome.COMMITTED:
            if fetched is not None:
                self.data = fetched
                self.position = fetched.positions.get(self.rid, 0)  # the loader's state comes with the model's
                emu.events.append(f"replica {self.rid}: caught up to step {p.step} from {p.sources[0]}")
            before = self.data
            batches, self.data = self.data.commit(q)
            trained = p.action is fsm.Action.TRAIN
            for what in commit_problems(self.rid, p, q, self.position, before.step,
                                        self.data.trained().get(self.rid), trained):
                self._violation(what)
            if trained:
                self.position += 1  # its loader hands out the next batch
            for g in self.groups:
                g.commits += 1
            emu.record_commit(self, p.step, q, batches)
            emu.snapshots[self.rid] = (p.step + 1, self.data)
        new = fsm.after_attempt(state, p, outcome)
        self._replay_after(p, outcome, new)
        self.state = new
        if new.action is fsm.Action.GIVE_UP:
            emu.events.append(f"replica {self.rid}: gives up: {new.reason}")
            emu.replica_fatal(self)
            return None
        return outcome

    async def _hang(self, step: int, secs: float) -> None:
        self.emu.events.append(f"replica {self.rid}: hangs {secs:g}s at step {step}")
        self.hung = True
        await asyncio.sleep(secs)
        self.hung = False

    async def _heartbeats(self, process: int) -> None:
        c = self.emu.config
        client = self.clients[process]
        interval = c.timeouts.heartbeat_interval_s
        # Independent processes heartbeat at unrelated phases, not in one burst.
        await asyncio.sleep(interval * (((self.index * len(self.clients) + process) * 0.618034) % 1.0))
        while True:
            every = paced_interval(interval, client.paced_s)  # the lighthouse may ask for fewer beats
            await asyncio.sleep(every)
            if self.hung:
                continue
            inflight = self.inflight if process == 0 else None
            try:
                reply = await client.heartbeat(self.state.step, skip_within_s=every, own_interval_s=interval,
                                               allreduce=inflight and (inflight[0].quorum_id, inflight[1]))
            except LighthouseError:
                continue  # the lighthouse is down or slow: keep trying every interval
            if process or reply is None:
                continue  # a follower's beat: its liveness and addresses; or a beat skipped
            self._heard_beat(reply)

    def _heard_beat(self, reply) -> None:
        """The leader's heartbeat answer: dead members of the quorum in flight, or members asking
        for a quorum at or before its step (they are not in it: see Manager.on_asking), abort
        its all-reduce."""
        if self.inflight is None:
            return
        q, step = self.inflight
        ours = self._others_of(q, reply.dead_members) if reply.quorum_id == q.quorum_id else []
        if ours and self.emu.fabric.abort(q.quorum_id, f"{DECLARED_DEAD} {ours} dead"):
            self.emu.events.append(f"replica {self.rid}: aborted quorum {q.quorum_id} ({ours} dead)")
        ours = self._others_of(q, reply.asking) if reply.allreduce == (q.quorum_id, step) else []
        names = ", ".join(ours[:4]) + (f" and {len(ours) - 4} more" if len(ours) > 4 else "")
        if ours and self.emu.fabric.abort(q.quorum_id, f"{names} ask for a quorum at step <= {step}"):
            self.emu.events.append(f"replica {self.rid}: aborted quorum {q.quorum_id} at step {step} "
                                   f"({names} ask for a new quorum)")

    def _others_of(self, q: qm.Quorum, named: tuple[str, ...]) -> list[str]:
        """The members of ``q`` but this replica among ``named`` (the quorum's members only read
        when some are named: every heartbeat reply comes here)."""
        if not named:
            return []
        members = fsm.membership(q)[0]
        return [d for d in named if d != self.rid and d in members]


class Emulation:
    """Runs one emulated job (see the module docstring); :meth:`run` returns the report."""

    def __init__(self, config: EmulationConfig, workdir: str | None = None, shard: "ShardSpec | None" = None) -> None:
        """``shard``: this process runs one block of the replicas for a coordinating emulation
        (fthsdp.sim.shards), which runs the lighthouse and the relays."""
        self.config = config
        self.shard = shard
        self.peers: "Peers | None" = None  # the other emulator processes (fthsdp.sim.shards), set in a shard
        self.replica_indices = range(shard.first, shard.end) if shard is not None else range(config.replicas)
        self._tmp = None
        if workdir is None and shard is None:
            self._tmp = tempfile.TemporaryDirectory(prefix="fthsdp-emulation-")
            workdir = self._tmp.name
        self.workdir = workdir
        # A shard's coordinator runs the servers (it knows their addresses: self.shard).
        self.lighthouse = LighthouseProcess(config, os.path.join(workdir, "lighthouse.log")) if shard is None else None
        self.relays = [RelayProcess(config, os.path.join(workdir, f"relay-{i}.log"), self.lighthouse)
                       for i in range(config.relays if shard is None else 0)]
        self.unfinished: list[str] = []
        self.worker_cpu_s = 0.0  # the emulator processes' CPU (a coordinating emulation's; fthsdp.sim.shards)
        self._absorbed = 0
        self.fabric = MockFabric(config.fabric)
        self.decode_cache = DecodeCache()
        self.replicas: dict[int, EmulatedReplica] = {}
        self.quorum_records: list[QuorumRecord] = []
        # (step, quorum id) -> what its committers agreed on, and who they are: one step
        # may be committed in two quorums when the lighthouse re-decided it (a lineage fork;
        # see fthsdp.control.quorum, rule 6); the report keeps the lineage that survived.
        self.commit_log: dict[tuple[int, int], CommitRecord] = {}
        self.committers: dict[tuple[int, int], set[str]] = collections.defaultdict(set)
        self.final_data: dict[str, DataState] = {}
        self.snapshots: dict[str, tuple[int, DataState]] = {}
        self.initial_data = DataState()  # every replica starts from it (one object: see DataState)
        self.final_steps: dict[str, int] = {}
        self.qids_seen: dict[str, list[int]] = collections.defaultdict(list)
        self.waits: list[tuple[str, float, float]] = []
        self.events: list[str] = []
        self.problems: list[str] = []
        self.cpu_at_step: dict[int, tuple[float, float, float]] = {}  # EmulationReport.cpu_at_step
        self.rank_replays = 0
        self.views_fetched = 0
        self.answer_bytes = 0
        self.wire_sizes: list[tuple[int, int]] = []
        self.stopped = False  # a job-fatal error stopped the job (job_fatal)
        self._fired: set[Fault] = set()
        self._side_tasks: list[asyncio.Task] = []
        self._barriers: dict[tuple[int, int], list] = {}
        self._member_sets: dict[int, tuple[qm.Quorum, frozenset[str]]] = {}
        self._rank_work: dict[int, float] = collections.defaultdict(float)
        for f in config.faults:
            if f.kind == "ring":
                self.fabric.inject_ring_fault(f.step, f.rank)
            elif f.kind == "rank":
                self.fabric.inject_rank_fault(f.step, str(f.replica), f.rank)

    # -- called by replicas ----------------------------------------------------

    @property
    def lighthouse_address(self) -> str:
        return self.shard.lighthouse if self.shard is not None else self.lighthouse.address

    def relay_of(self, replica: int) -> str:
        """The relay carrying replica ``replica``'s sessions ("" = none): contiguous blocks."""
        addresses = self.shard.relays if self.shard is not None else tuple(r.address for r in self.relays)
        return relay_of(addresses, replica, self.config.replicas)

    async def fire_faults(self, rep: EmulatedReplica, step: int) -> None:
        """The faults due when ``rep`` begins (or asks again for) ``step``: each fires once, at
        the first step at or after its own that its replica (replica 0 for the servers') reaches,
        in whichever incarnation and attempt (one that never does is a problem: unfired_faults)."""
        for f in self.config.faults:
            if f in self._fired or f.step > step:
                continue
            if f.kind == "kill" and f.replica == rep.index:
                self._fired.add(f)
                self.events.append(f"fault: kill replica {rep.rid} in step {step}, restart in {f.seconds:g}s")
                # Mid-step (during its compute or all-reduce), as a real SIGKILL lands.
                delay = self.config.model.step_s / 2
                self._side_tasks.append(asyncio.get_running_loop().create_task(self._kill(rep, f.seconds, delay)))
            elif f.kind == "lighthouse" and rep.index == 0:
                self._fired.add(f)
                self.events.append(f"fault: lighthouse SIGKILLed at step {step}, restarted after {f.seconds:g}s")
                self._side_tasks.append(asyncio.get_running_loop().create_task(self._lighthouse_hiccup(f.seconds)))
            elif f.kind in RELAY_FAULTS and rep.index == 0:
                self._fired.add(f)
                if f.kind == "relay":
                    then = f"restarted after {f.seconds:g}s" if f.seconds else "not restarted"
                    self.events.append(f"fault: relay {f.replica} SIGKILLed at step {step}, {then}")
                else:
                    self.events.append(f"fault: relay {f.replica} SIGSTOPped at step {step} for {f.seconds:g}s")
                self._side_tasks.append(asyncio.get_running_loop().create_task(
                    self._relay_fault(self.relays[f.replica], f.kind == "relay_stop", f.seconds)))

    def answered(self, rep: EmulatedReplica, step: int) -> None:
        """Replica ``rep`` holds its answer for ``step``: a ``lighthouse_answering`` fault fires
        now, synchronously (no await: the lighthouse is still writing the other answers)."""
        for f in self.config.faults:
            if f.kind == "lighthouse_answering" and f.step <= step and rep.index == 0 and f not in self._fired:
                self._fired.add(f)
                self.events.append(f"fault: lighthouse SIGKILLed while answering step {step}, restarted after "
                                   f"{f.seconds:g}s")
                if self.lighthouse.proc is not None:
                    self.lighthouse.proc.send_signal(signal.SIGKILL)
                self._side_tasks.append(asyncio.get_running_loop().create_task(self._lighthouse_hiccup(f.seconds)))

    def sample_cpu(self, step: int) -> None:
        """This process's, the relays' and the lighthouse's CPU time as its first replica begins
        ``step`` (EmulationReport.cpu_at_step; of shards, the first one counts the servers)."""
        if self.shard is not None:
            relays, lighthouse = self.shard.relay_pids, self.shard.lighthouse_pid
        else:
            relays = [r.proc.pid for r in self.relays if r.proc is not None]
            lighthouse = self.lighthouse.proc.pid if self.lighthouse.proc is not None else 0
        self.cpu_at_step[step] = (time.process_time(), sum(process_cpu_s(p) for p in relays),
                                  process_cpu_s(lighthouse) if lighthouse else 0.0)

    async def round_barrier(self, key: tuple[int, int]) -> None:
        ev = self._barriers.get(key)
        if ev is None:  # the first arrival counts the running replicas, once per round
            running = sum(1 for r in self.replicas.values() if r.task is not None and not r.task.done())
            ev = self._barriers[key] = [0, asyncio.Event(), running]
        ev[0] += 1
        if ev[0] >= ev[2]:
            if self.peers is None:
                ev[1].set()
                self._barriers.pop(key, None)
                return
            self.peers.arrive("barrier", key, 1)  # released when every running process is in
        try:
            await asyncio.wait_for(ev[1].wait(), 1.0)
        except TimeoutError:
            pass

    def barrier_released(self, key: tuple[int, int]) -> None:
        """Every emulator process's replicas reached round ``key`` (fthsdp.sim.shards)."""
        ev = self._barriers.pop(key, None)
        if ev is not None:
            ev[1].set()

    def rank_work(self, step: int, seconds: float) -> None:
        self._rank_work[step] += seconds

    def member_set(self, q: qm.Quorum) -> frozenset[str]:
        """The members of ``q`` as a set, built once per quorum (not once per replica; views
        that differ only in their rings share their members tuple)."""
        hit = self._member_sets.get(q.quorum_id)
        if hit is None or hit[0].members is not q.members:
            if len(self._member_sets) > 8:
                self._member_sets.clear()
            hit = self._member_sets[q.quorum_id] = (q, frozenset(fsm.membership(q)[0]))
        return hit[1]

    def take_hang(self, rep: EmulatedReplica, step: int) -> Fault | None:
        """The hang fault ``rep`` runs into as it computes ``step`` (the first of its own due at or
        before it, fired now), or None."""
        for f in self.config.faults:
            if f.kind == "hang" and f.replica == rep.index and f.step <= step and f not in self._fired:
                self._fired.add(f)
                return f
        return None

    def unfired_faults(self) -> list[str]:
        """The injected faults that never fired (a run that tests nothing it claims to): the
        fabric's still pending, the others never reached."""
        pending = self.fabric.pending_faults()
        out = []
        for f in self.config.faults:
            key = {"ring": ("ring", f.step, "", f.rank), "rank": ("rank", f.step, str(f.replica), f.rank)}.get(f.kind)
            if (key in pending) if key is not None else (f not in self._fired):
                out.append(f"fault {f} never fired (its replica never reached step {f.step} or later)")
        return out

    def record_commit(self, rep: EmulatedReplica, step: int, q: qm.Quorum, batches: tuple) -> None:
        key = (step, q.quorum_id)
        first = self.commit_log.get(key)
        if first is not None and first.batches is batches:
            rec = first  # the same shared state and quorum: equal without an O(R) comparison
        else:
            rec = CommitRecord(step, q.quorum_id, tuple(fsm.membership(q)[0]), q.healthy, batches, time.monotonic())
            first = self.commit_log.setdefault(key, rec)
        if first != rec:  # members of one quorum holding different states: a fork nobody fenced
            self.problems.append(f"step {step} in quorum {q.quorum_id}: replica {rep.rid} committed from a different "
                                 f"state than another member (batches {list(rec.batches)[:4]} vs "
                                 f"{list(first.batches)[:4]}): split brain")
        if rep.rid in self.committers[key]:
            self.problems.append(f"step {step}: replica {rep.rid} committed it twice in quorum {q.quorum_id}")
        self.committers[key].add(rep.rid)

    def lineage_commits(self) -> tuple[dict[int, CommitRecord], dict[int, set[str]], int]:
        """``(commits, committers, superseded)`` along the lineage the replicas ended with
        (those that finished the job, else the furthest); a problem if they ended with
        different lineages (split brain)."""
        if not self.final_data:
            return {}, {}, len(self.commit_log)
        top = max(self.final_steps.get(r, 0) for r in self.final_data)
        ends = {r: d for r, d in self.final_data.items() if self.final_steps.get(r, 0) == top}
        ref_rid, ref = min(ends.items(), key=lambda kv: qm.ring_key(kv[0]))
        ref_hist = [(d.step, d.quorum_id, d.batches) for d in ref.history()]
        for rid, d in sorted(ends.items(), key=lambda kv: qm.ring_key(kv[0])):
            if d is not ref and [(x.step, x.quorum_id, x.batches) for x in d.history()] != ref_hist:
                self.problems.append(f"replicas {ref_rid} and {rid} ended at step {top} with different states "
                                     "(split brain: their lineages forked and neither was abandoned)")
                break
        steps = [step for step, _, _ in ref_hist]
        if steps != list(range(len(steps))):  # (a dict keyed by step below would hide a step committed twice)
            self.problems.append(f"replica {ref_rid}'s lineage does not commit steps 0, 1, 2, ... once each: "
                                 f"{steps[:20]}")
        commits: dict[int, CommitRecord] = {}
        committers: dict[int, set[str]] = {}
        for step, qid, batches in ref_hist:
            rec = self.commit_log.get((step, qid))
            commits[step] = rec if rec is not None else CommitRecord(step, qid, (), (), batches)
            committers[step] = set(self.committers.get((step, qid), ()))
        kept = {(step, qid) for step, qid, _ in ref_hist}
        superseded = [rec for k, rec in self.commit_log.items() if k not in kept]
        redo = redone_from_scratch(commits.get(0), superseded)
        if redo:
            self.problems.append(redo)
        return commits, committers, len(superseded)

    def shard_state(self, cpu_s: float, wall_s: float) -> dict:
        """What this shard's replicas did (fthsdp.sim.shards), for its coordinator's :meth:`absorb`."""
        from fthsdp.sim.shards import pack_states

        return {
            "quorum_records": self.quorum_records, "commit_log": self.commit_log, "committers": dict(self.committers),
            "final_data": pack_states(self.final_data), "final_steps": self.final_steps,
            "qids_seen": dict(self.qids_seen), "waits": self.waits, "events": self.events, "problems": self.problems,
            "cpu_at_step": self.cpu_at_step, "rank_replays": self.rank_replays, "views_fetched": self.views_fetched,
            "answer_bytes": self.answer_bytes, "wire_sizes": self.wire_sizes, "rank_work": dict(self._rank_work),
            "decode": (self.decode_cache.decoded, self.decode_cache.hits),
            "fabric": (self.fabric.completed, self.fabric.failed), "unfinished": self.unfinished,
            "cpu_s": cpu_s, "wall_s": wall_s, "pid": os.getpid(),
            "replicas": (self.replica_indices.start, self.replica_indices.stop)}

    def absorb(self, state: dict) -> None:
        """Add one shard's :meth:`shard_state` to this (coordinating) emulation's records: its
        report then checks every invariant over all shards' replicas, as over one process's."""
        from fthsdp.sim.shards import unpack_states

        first = self._absorbed == 0
        self._absorbed += 1
        lo, end = state["replicas"]
        self.events.append(f"emulator process {state['pid']}: replicas {lo}..{end - 1}, {state['cpu_s']:.2f} s of CPU "
                           f"in {state['wall_s']:.2f} s")
        self.quorum_records += state["quorum_records"]
        for key, rec in state["commit_log"].items():
            held = self.commit_log.setdefault(key, rec)
            if held != rec:
                self.problems.append(f"step {key[0]} in quorum {key[1]}: replicas in two emulator processes committed "
                                     f"from different states (batches {list(rec.batches)[:4]} vs "
                                     f"{list(held.batches)[:4]}): split brain")
        for key, who in state["committers"].items():
            self.committers[key] |= who
        self.final_data.update(unpack_states(*state["final_data"]))
        self.final_steps.update(state["final_steps"])
        self.qids_seen.update(state["qids_seen"])
        self.waits += state["waits"]
        self.events += state["events"]
        self.problems += state["problems"]
        self.unfinished += state["unfinished"]
        # A round's CPU is every shard's at the same step (steps every shard sampled).
        cpu = state["cpu_at_step"]
        self.cpu_at_step = dict(cpu) if first else {
            s: tuple(a + b for a, b in zip(mine, cpu[s])) for s, mine in self.cpu_at_step.items() if s in cpu}
        self.rank_replays += state["rank_replays"]
        self.views_fetched += state["views_fetched"]
        self.answer_bytes = max(self.answer_bytes, state["answer_bytes"])
        self.wire_sizes += state["wire_sizes"]
        for step, s in state["rank_work"].items():
            self._rank_work[step] += s
        self.decode_cache.decoded += state["decode"][0]
        self.decode_cache.hits += state["decode"][1]
        # every shard completes (or fails) each all-reduce once, for its own members
        self.fabric.completed = max(self.fabric.completed, state["fabric"][0])
        self.fabric.failed = max(self.fabric.failed, state["fabric"][1])
        self.worker_cpu_s += state["cpu_s"]

    def replica_fatal(self, rep: EmulatedReplica) -> None:
        """The replica process exits (replica-fatal): its supervisor restarts it, as after a kill."""
        if not self.stopped:
            self._side_tasks.append(asyncio.get_running_loop().create_task(self._restart(rep, 0.5)))

    def job_fatal(self, rep: EmulatedReplica) -> None:
        """A job-fatal error: the job stops (every replica ends where it is; none is restarted),
        as the real launcher stops a job whose replica exited job-fatal."""
        self.stopped = True
        self.events.append(f"replica {rep.rid}: job-fatal error: the job stops")
        for r in self.replicas.values():
            if r is not rep and r.task is not None and not r.task.done():
                r.task.cancel()

    # -- fault machinery -------------------------------------------------------

    async def _kill(self, rep: EmulatedReplica, restart_after_s: float, delay_s: float) -> None:
        await asyncio.sleep(delay_s)
        self.fabric.kill(rep.rid)
        if rep.task is not None:
            rep.task.cancel()
            try:
                await rep.task
            except asyncio.CancelledError:
                pass
        await self._restart(rep, restart_after_s)

    async def _restart(self, rep: EmulatedReplica, after_s: float) -> None:
        await asyncio.sleep(after_s)
        if self.stopped:
            return
        self.fabric.revive(rep.rid, max((q for qs in self.qids_seen.values() for q in qs[-1:]), default=0))
        new = EmulatedReplica(self, rep.index, rep.incarnation + 1, rejoin=True)
        self.replicas[rep.index] = new
        self.events.append(f"replica {rep.rid}: restarted (incarnation {new.incarnation}), rejoins")
        new.task = asyncio.get_running_loop().create_task(new.run())

    @staticmethod
    async def _relay_fault(relay: RelayProcess, stop: bool, seconds: float) -> None:
        if stop:
            relay.proc.send_signal(signal.SIGSTOP)
            await asyncio.sleep(seconds)
            relay.proc.send_signal(signal.SIGCONT)
            return
        await asyncio.to_thread(relay.kill)
        if seconds:
            await asyncio.sleep(seconds)
            await asyncio.to_thread(relay.start)

    async def _lighthouse_hiccup(self, down_s: float) -> None:
        await asyncio.to_thread(self.lighthouse.kill)
        await asyncio.sleep(down_s)
        await asyncio.to_thread(self.lighthouse.start)

    # -- the run ---------------------------------------------------------------

    async def run_async(self) -> EmulationReport:
        t0, cpu0 = time.perf_counter(), time.process_time()
        await asyncio.to_thread(self.lighthouse.start)
        try:
            for r in self.relays:
                await asyncio.to_thread(r.start)
            if self.config.emulator_processes > 1:
                from fthsdp.sim.shards import run_shards
                await run_shards(self)
            else:
                await self.run_replicas()
        finally:
            for r in self.relays:
                await asyncio.to_thread(r.stop)
            await asyncio.to_thread(self.lighthouse.stop)
        return self._report(t0, cpu0)

    async def run_replicas(self) -> None:
        """This process's replicas from start to end (or the run's deadline)."""
        c = self.config
        unfinished = self.unfinished
        for i in self.replica_indices:
            rep = self.replicas[i] = EmulatedReplica(self, i, 0, rejoin=False)
            rep.task = asyncio.get_running_loop().create_task(rep.run())
        deadline = time.monotonic() + c.run_timeout_s
        settled = False
        while time.monotonic() < deadline:
            if not settled and all(r.state.step >= 1 for r in self.replicas.values()):
                gc.freeze()  # every rank's state is built: out of the collector's walks (fthsdp.gc_policy)
                settled = True
            pending = [r for r in self.replicas.values() if r.task is not None and not r.task.done()]
            side = [t for t in self._side_tasks if not t.done()]
            if not pending and not side:
                break
            await asyncio.sleep(0.05)
        for r in self.replicas.values():
            if r.task is not None and not r.task.done():
                unfinished.append(f"replica {r.rid} at step {r.state.step}")
                r.task.cancel()
            if r.task is not None and r.task.done() and not r.task.cancelled() and r.task.exception():
                e = r.task.exception()
                self.problems.append(f"replica {r.rid}: crashed: {type(e).__name__}: {e}")
        for t in self._side_tasks:
            t.cancel()
        await asyncio.sleep(0)
        self.problems += self.unfired_faults()
        paths = [cl.relay_path for r in self.replicas.values() for cl in r.clients if cl.relay_path.leaves]
        if paths:
            why = collections.Counter(re.sub(r"\d+", "N", p.left_why)[:200] for p in paths).most_common(1)[0][0]
            self.events.append(
                f"{len(paths)} process(es) left a failed relay for the lighthouse (most often: {why}); "
                f"{sum(1 for p in paths if p.via_relay)} are back on it "
                f"({sum(1 for p in paths if p.reconnects)} returned as soon as it accepted connections again), "
                f"{sum(1 for p in paths if not p.via_relay)} still speak to the lighthouse directly")

    def _report(self, t0: float, cpu0: float) -> EmulationReport:
        c = self.config
        commits, committers, superseded = self.lineage_commits()
        if superseded:
            self.events.append(f"{superseded} commit(s) of a forked lineage superseded (their holders fetched "
                               "the job's state or stopped)")
        return EmulationReport(
            config=c, wall_s=time.perf_counter() - t0, quorum_records=self.quorum_records, commits=commits,
            committers=committers, superseded=superseded, final_steps=dict(self.final_steps),
            qids_seen=dict(self.qids_seen),
            waits=self.waits, events=self.events, problems=self.problems,
            lighthouse_starts=self.lighthouse.starts if self.shard is None else 0,
            rank_replays=self.rank_replays, fabric_completed=self.fabric.completed,
            fabric_failed=self.fabric.failed, decode=(self.decode_cache.decoded, self.decode_cache.hits),
            unfinished=self.unfinished, views_fetched=self.views_fetched, answer_bytes=self.answer_bytes,
            wire_sizes=self.wire_sizes,
            rank_work_s=dict(self._rank_work), emulator_cpu_s=time.process_time() - cpu0 + self.worker_cpu_s,
            relay_cpu_s=sum(r.cpu_s for r in self.relays), relay_stats=[r.stats for r in self.relays],
            cpu_at_step=dict(self.cpu_at_step), lighthouse_started_at=list(self.lighthouse.started_at),
            lighthouse_log=self._lighthouse_log())

    def _lighthouse_log(self, keep: int = 20) -> dict:
        """What the lighthouse logged (WARNING and up): how many replicas it declared dead, and
        the first ``keep`` lines. Read before the run's folder goes."""
        if self.lighthouse is None:
            return {}
        try:
            with open(self.lighthouse.log_path, errors="replace") as f:
                lines = [x.rstrip() for x in f]
        except OSError:
            return {}
        return {"declared_dead": sum("declared dead" in x for x in lines),
                "paced": [x for x in lines if "processes beat this lighthouse" in x][:keep],
                "head": lines[:keep], "lines": len(lines)}

    def run(self) -> EmulationReport:
        try:
            # One process stands for hundreds of hosts: its collector's pauses would stall them
            # all at once, which no real job sees (fthsdp.gc_policy).
            with low_pause_gc():
                return asyncio.run(self.run_async())
        finally:
            if self._tmp is not None:
                self._tmp.cleanup()


def run_emulation(config: EmulationConfig, workdir: str | None = None) -> EmulationReport:
    """Run one emulated job to its end (or ``config.run_timeout_s``) and return what happened."""
    return Emulation(config, workdir).run()
