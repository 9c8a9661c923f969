"""`fthsdp ray`: the fault-tolerant job on a Ray cluster, with faults injected through Ray.

The same job as `fthsdp run` (fthsdp/launch/local.py), with Ray managing the
processes: the supervision rules, the fault plan, the run directory, the live
status lines, the report, summary.json and timeline.png are the local
launcher's own (RayJob subclasses LocalJob and replaces only what touches a
process). What differs:

* the lighthouse is a Ray actor (fthsdp/launch/ray_actors.py, not detached:
  it lives and dies with the job's driver), pinned to the driver's node and
  restarted there on the same address when it dies (by its warm spare, a second
  lighthouse actor created there and not bound until then:
  ``launch.lighthouse_standby``); so are its relays
  (``launch.relays``, RelayActor), as `fthsdp run` starts them beside its lighthouse,
  unless ``launch.relay_placement=replicas``: then each relay is started on the node
  its block's first replica is placed on, when it is, and a relay whose node is lost
  is placed again with the next replica of its block;
* each replica is a placement group with one bundle per process (sized by the
  process's devices; GPUs when the cluster has them) holding one actor per
  process; each actor runs the replica entry point (fthsdp.replica.process.main).
  Process 0 serves the replica's JAX coordinator on its node, and the group
  fails, is torn down and is placed again as a unit, as locally;
* the launcher hands each actor its replica id, the lighthouse's address, the
  job's peer secret, a config file's text and its ledger so far, as call
  arguments. The actor writes into a node-local work directory and the driver
  collects the records through Ray (`poll`) into the run directory, where the
  report reads them as it reads a local run's;
* a replica whose actor died (killed, its process SIGKILLed, its node lost)
  has its placement group removed and placed again: Ray puts it on a node that
  has room (another one if the old node is gone); it rejoins from its peers.
  When it cannot be placed within `ft.startup_timeout_s`, the job goes on with
  fewer replicas and says so;
* faults: `--kill R[.P]@STEP` is `ray.kill` of the actor (`--kill-with ray-kill`)
  or a SIGKILL of the actor's worker process (`--kill-with sigkill`);
  `--kill-node R@STEP` removes the node that runs replica R (SIGKILL of its
  raylet); `--stop` needs the actor on the driver's machine.

Persistent checkpoints go to `--checkpoint-dir` (default OUT/checkpoints):
storage every node can reach, as a Ray job's storage path must be.
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import os
import pathlib
import secrets
import signal
import sys
import time
from dataclasses import dataclass, field

from fthsdp.atomic_file import write_atomic
from fthsdp.control.admission import FairnessLimits
from fthsdp.control.pacing import DEFAULT_BEATS_PER_S
from fthsdp.digits import ascii_int
from fthsdp.launch import faults as faults_lib
from fthsdp.launch import rundir as rundir_lib
from fthsdp.launch import supervise
from fthsdp.launch.local import LocalJob, ReplicaProc

log = logging.getLogger("fthsdp.launch")

KILL_WITH = ("ray-kill", "sigkill")
POLL_TIMEOUT_S = 10.0  # one collection round trip to a live actor
ENV_PASSED = ("JAX_PLATFORMS", "PYTHONUNBUFFERED")  # besides every FTHSDP_* variable


@dataclass(frozen=True)
class Placement:
    """What one replica asks of the cluster: one bundle per process."""

    bundles: list[dict[str, float]]
    strategy: str = "PACK"  # a replica's processes together (they share a mesh), but may spread if they must


def placement_for(per: int, processes: int, cluster_gpus: float) -> Placement:
    """One bundle per process, sized by its devices (`per`, launch.devices_per_replica: per
    process): GPUs when the cluster has them, else host CPUs (one per host device)."""
    if per < 1 or processes < 1:
        raise ValueError(f"a replica needs >= 1 process of >= 1 device, got {processes} x {per}")
    bundle = {"CPU": 1.0, "GPU": float(per)} if cluster_gpus >= per else {"CPU": float(per)}
    return Placement([dict(bundle) for _ in range(processes)])


def cluster_cpus_needed(replicas: int, devices: int, processes: int = 1) -> int:
    """Logical CPUs a fresh local cluster declares: every replica's bundles, the
    lighthouse's share and one spare for a replacement placed before its
    predecessor's bundle is returned. Logical only: Ray does not pin cores."""
    return replicas * devices * processes + 2 * devices * processes


class ActorProcess:
    """A replica's placement group and actor, seen through the calls the local
    launcher makes on a subprocess.Popen (pid, poll, kill, wait, returncode).

    poll() is None while the group is being placed and while the actor runs;
    it becomes the replica's exit code when `run` returns, or -SIGKILL when the
    actor died (killed, its process or its node lost), which the supervision
    rules read as "restart it" like any death by a signal.
    """

    def __init__(self, job: "RayJob", rid: int, argv: list[str]) -> None:
        import ray
        from ray.util.placement_group import placement_group

        self.job, self.rid, self.argv = job, rid, argv
        self.pg = placement_group(job.placement.bundles, strategy=job.placement.strategy,
                                  name=f"{job.job_id}-replica-{rid}-{time.time_ns()}")
        self.ready_ref = self.pg.ready()
        self.deadline = time.monotonic() + job.place_timeout_s
        self.actor = None
        self.run_ref = None
        self.where: dict = {}
        self.returncode: int | None = None
        self.pid = -1
        self.unplaced = ""
        self._ray = ray
        self.index = 0  # process index in the replica (0 leads and owns the placement group)
        self.followers: list[ActorProcess] = []
        self.teardown_deferred = False  # ended with followers still running: see _finish

    # -- placement and start ------------------------------------------------------------

    def advance(self) -> None:
        """Starts the actor once the group is placed; gives up after the placement deadline."""
        if self.actor is not None or self.returncode is not None:
            return
        ray = self._ray
        ready, _ = ray.wait([self.ready_ref], timeout=0)
        if not ready:
            if time.monotonic() > self.deadline:
                self.unplaced = (f"no node has room for {self.job.placement.bundles} within "
                                 f"{self.job.place_timeout_s:.0f} s (cluster resources now: "
                                 f"{ray.available_resources()})")
                self.teardown()
                self.returncode = -int(signal.SIGKILL)
            return
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        from fthsdp.launch.ray_actors import RELAY_FILE, ReplicaActor

        job = self.job
        actors = []
        for index, bundle in enumerate(job.placement.bundles):  # one actor per process, in its own bundle
            cls = ray.remote(ReplicaActor).options(
                num_cpus=bundle.get("CPU", 0), num_gpus=bundle.get("GPU", 0), max_restarts=0, max_concurrency=4,
                scheduling_strategy=PlacementGroupSchedulingStrategy(self.pg, placement_group_bundle_index=index))
            actors.append(cls.remote(self.rid, job.actor_env(), job.seed_files(self.rid) if index == 0 else {},
                                     job.config_text, job.work_prefix))
        self.actor = actors[0]
        group: list[str] = []
        try:
            wheres = ray.get([a.where.remote() for a in actors], timeout=job.place_timeout_s)
            ray.get([a.link_checkpoints.remote(str(job.checkpoint_dir), job.storage_marker) for a in actors],
                    timeout=POLL_TIMEOUT_S)
            if len(actors) > 1:  # the replica's JAX coordinator, served by process 0 on its node
                host = wheres[0]["ip"] if job.listen_host else "127.0.0.1"
                port = ray.get(actors[0].free_port.remote(host), timeout=POLL_TIMEOUT_S)
                group = ["--num-processes", str(len(actors)), "--coordinator", f"{host}:{port}"]
        except Exception as e:  # noqa: BLE001 - a start that fails is a death: restarted by the rules
            from fthsdp.errors import EXIT_JOB_FATAL
            from fthsdp.launch.ray_actors import NOT_SHARED

            log.warning("replica %d: its actors did not start: %s", self.rid, e)
            self.followers = [ActorProcess.attached(self, a, {}, i + 1) for i, a in enumerate(actors[1:])]
            self.teardown()
            # (storage that is not shared fails every start the same way: the job stops, saying so)
            self.returncode = EXIT_JOB_FATAL if NOT_SHARED in str(e) else -int(signal.SIGKILL)
            return
        self.where = wheres[0]
        self.pid = int(self.where["pid"])
        self.followers = []
        relay = job.relay_for(self.rid, self.where["node_id"])  # launch.relay_placement=replicas
        for index, (actor, where) in enumerate(zip(actors, wheres)):
            follow = [f"ft.lighthouse_relay_file={where['work_dir']}/{RELAY_FILE}"] if relay else []
            argv = [*self.argv, *relay, *follow, *(["--process-index", str(index), *group] if group else []),
                    *(["--bind-host", where["ip"], "--advertise-host", where["ip"]] if job.listen_host else [])]
            ref = actor.run.remote(argv)
            if index == 0:
                self.run_ref = ref
            else:
                f = ActorProcess.attached(self, actor, where, index)
                f.run_ref = ref
                self.followers.append(f)
        job.procs[self.rid].followers = list(self.followers)
        job.event("placed", self.rid, node=self.where["node_id"][:12], pid=self.pid, ip=self.where["ip"],
                  **({"processes": [{"node": w["node_id"][:12], "pid": w["pid"]} for w in wheres]}
                     if len(wheres) > 1 else {}))

    @staticmethod
    def attached(leader: "ActorProcess", actor, where: dict, index: int) -> "ActorProcess":
        """Process `index` > 0 of the leader's group: same placement group (the leader removes it)."""
        f = ActorProcess.__new__(ActorProcess)
        f.job, f.rid, f.argv, f.pg, f.ready_ref, f.deadline = leader.job, leader.rid, [], None, None, 0.0
        f.actor, f.run_ref, f.where, f.returncode = actor, None, where, None
        f.pid, f.unplaced, f._ray, f.index, f.followers = int(where.get("pid", -1)), "", leader._ray, index, []
        f.teardown_deferred = False
        return f

    @property
    def placed(self) -> bool:
        return self.actor is not None

    # -- the Popen calls ----------------------------------------------------------------------

    def poll(self) -> int | None:
        if self.returncode is not None:
            if self.teardown_deferred and all(f.poll() is not None for f in self.followers):
                self.teardown_deferred = False
                self.teardown()  # its followers ended too: the placement group goes
            return self.returncode
        if self.run_ref is None:
            return None
        ready, _ = self._ray.wait([self.run_ref], timeout=0)
        if ready:
            self._finish()
        return self.returncode

    def _finish(self) -> None:
        try:
            rc = int(self._ray.get(self.run_ref, timeout=POLL_TIMEOUT_S))
        except Exception:  # noqa: BLE001 - RayActorError and kin: the process is gone
            rc = -int(signal.SIGKILL)
        else:
            if self.index == 0:
                self.job.collect_one(self.rid, self)  # its last records, before the actor goes
        self.returncode = rc
        if rc != 0 and any(f.poll() is None for f in self.followers):
            # A leader that failed with followers still running: they may be on their way out with a
            # verdict of their own (a job-fatal 78 after the leader's 70), which the group rule waits
            # for (LocalJob.fail_groups_as_units); killing them here made that grace void. The rule's
            # kill_replica, or their own end (poll above), removes the group.
            self.teardown_deferred = True
            return
        self.teardown()

    def wait(self, timeout: float | None = None) -> int:
        if self.run_ref is not None and self.returncode is None:
            if self._ray.wait([self.run_ref], timeout=timeout)[0]:
                self._finish()
        if self.returncode is None:
            self.kill()
        return self.returncode

    def kill(self) -> None:
        """The launcher's own kill (shutdown, fallback): ray.kill, then the group is removed."""
        if self.returncode is None:
            self.returncode = -int(signal.SIGKILL)
        self.teardown()

    terminate = kill

    def teardown(self) -> None:
        self.teardown_deferred = False
        ray = self._ray
        if self.actor is not None:
            try:
                ray.kill(self.actor, no_restart=True)
            except Exception:  # noqa: BLE001 - already dead
                pass
        for f in self.followers:
            f.kill()
        if self.pg is None:  # a follower: its leader removes the group
            return
        try:
            from ray.util.placement_group import remove_placement_group

            remove_placement_group(self.pg)
        except Exception:  # noqa: BLE001 - already removed, or its node is gone
            pass


class ServerActorProcess:
    """A server actor (the lighthouse, a relay) through the Popen calls the local launcher makes:
    pinned to ``node_id``, alive while its ``serve`` call is pending. ``standby``: a warm spare,
    created (its worker process started, its imports done) and not bound until :meth:`promote`;
    creating one does not wait for it."""

    def __init__(self, actor_cls, node_id: str, *args, standby: bool = False) -> None:
        import ray
        from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

        self._ray = ray
        cls = ray.remote(actor_cls).options(
            num_cpus=0, max_restarts=0, max_concurrency=4,
            scheduling_strategy=NodeAffinitySchedulingStrategy(node_id, soft=False))
        self.actor = cls.remote(*args, **({"standby": True} if standby else {}))
        self.serve_ref = self.actor.serve.remote()  # pending while the actor lives, standby or not
        self.returncode: int | None = None
        self.address, self.pid = "", 0
        if not standby:
            try:
                self._serving(self._ray.get(self.actor.address.remote(), timeout=60))
            except Exception as e:  # noqa: BLE001 - RayActorError, GetTimeoutError...: the launcher's
                # restart rules (its tries, then a clear give-up) know RuntimeError; and no actor is left
                self.kill()
                raise RuntimeError(f"{actor_cls.__name__} did not start serving: {type(e).__name__}: {e}") from e

    def _serving(self, address: str) -> None:
        self.address = address
        self.pid = self._ray.get(self.actor.pid.remote(), timeout=POLL_TIMEOUT_S)

    def promote(self) -> None:
        """A standby's: bind and serve now (raises if it cannot: it died, or its port is taken)."""
        self._serving(self._ray.get(self.actor.start.remote(), timeout=60))

    def poll(self) -> int | None:
        if self.returncode is None and self._ray.wait([self.serve_ref], timeout=0)[0]:
            try:
                self.returncode = int(self._ray.get(self.serve_ref))
            except Exception:  # noqa: BLE001 - the actor died
                self.returncode = -int(signal.SIGKILL)
        return self.returncode

    def kill(self) -> None:
        try:
            self._ray.kill(self.actor, no_restart=True)
        except Exception:  # noqa: BLE001
            pass
        self._ray.wait([self.serve_ref], timeout=30)
        self.poll()

    def terminate(self) -> None:
        try:
            self._ray.get(self.actor.stop.remote(), timeout=POLL_TIMEOUT_S)
        except Exception:  # noqa: BLE001
            pass
        self.kill()
        self.returncode = 0 if self.returncode is None else self.returncode

    def wait(self, timeout: float | None = None) -> int | None:
        self._ray.wait([self.serve_ref], timeout=timeout)
        return self.poll()


class LighthouseProcess(ServerActorProcess):
    """The lighthouse actor (fthsdp.launch.ray_actors.LighthouseActor)."""

    def __init__(self, host: str, port: int, detect_s: float, join_timeout_s: float, replicas: int,
                 node_id: str, secret: bytes | None = None, tls: tuple[str, str] = ("", ""),
                 connection_calls_per_s: float = FairnessLimits.connection_calls_per_s,
                 standby: bool = False, beats_per_s: float = DEFAULT_BEATS_PER_S) -> None:
        from fthsdp.launch.ray_actors import LighthouseActor

        super().__init__(LighthouseActor, node_id, host, port, detect_s, join_timeout_s, replicas, secret, tls,
                         connection_calls_per_s, beats_per_s, standby=standby)
        self.facts: dict = {}
        if not standby:
            self.facts = self._ray.get(self.actor.facts.remote(), timeout=POLL_TIMEOUT_S)

    def promote(self) -> None:
        super().promote()
        self.facts = self._ray.get(self.actor.facts.remote(), timeout=POLL_TIMEOUT_S)


class RelayProcess(ServerActorProcess):
    """A relay actor (fthsdp.launch.ray_actors.RelayActor); its last ``stats`` are read when it is
    terminated (what it carried, for the run's events)."""

    def __init__(self, host: str, port: int, lighthouse: str, node_id: str, tls: tuple[str, str] = ("", ""),
                 lighthouse_tls_ca: str = "") -> None:
        from fthsdp.launch.ray_actors import RelayActor

        super().__init__(RelayActor, node_id, host, port, lighthouse, tls, lighthouse_tls_ca)
        self.stats: dict = {}

    def terminate(self) -> None:
        try:
            self.stats = self._ray.get(self.actor.stats.remote(), timeout=POLL_TIMEOUT_S)
        except Exception:  # noqa: BLE001 - it died: what it carried is lost with it
            pass
        super().terminate()


@dataclass
class RayJob(LocalJob):
    """A LocalJob whose processes are Ray actors; see the module's docstring."""

    kill_with: str = "ray-kill"
    checkpoint_dir: pathlib.Path | None = None
    config_text: str | None = None  # a config given as a file: its text travels to the actors
    place_timeout_s: float = 120.0
    unplaced: dict[int, str] = field(default_factory=dict)
    summary: dict = field(default_factory=dict)  # summary.json's content, once run() returned

    def __post_init__(self) -> None:
        import ray

        super().__post_init__()
        if self.kill_with not in KILL_WITH:
            raise ValueError(f"kill_with={self.kill_with!r}: expected one of {KILL_WITH}")
        self.checkpoint_dir = pathlib.Path(self.checkpoint_dir or self.out_dir / "checkpoints").resolve()
        self.work_prefix = f"fthsdp-ray-{secrets.token_hex(4)}-"  # this job's node-local work dirs
        # Every actor checks it sees this file before it links the checkpoint directory: a path
        # only the driver's disk holds was created empty on each node, and the checkpoints scattered.
        self.storage_marker = f".fthsdp-driver-{self.work_prefix.removeprefix('fthsdp-ray-').rstrip('-')}"
        self.checkpoint_dir.mkdir(parents=True, exist_ok=True)
        (self.checkpoint_dir / self.storage_marker).write_text("written by the fthsdp ray driver\n")
        self.placement = placement_for(self.devices, self.processes, ray.cluster_resources().get("GPU", 0.0))
        from fthsdp.launch.ray_actors import node_host

        # one machine: every listener on loopback; several: each process on its node's address
        self.driver_node = ray.get_runtime_context().get_node_id()
        self.listen_host = "" if node_host(ray_nodes(), self.driver_node) == "127.0.0.1" else "node"
        self.relay_nodes: list[str] = []  # relay i's node ("" or past the end: the driver's)

    def checkpoints(self) -> pathlib.Path:
        return self.checkpoint_dir  # (storage every node reaches, not OUT/checkpoints)

    def resume_hint(self) -> str:
        """`fthsdp ray` has no --resume: the hint must not send a cluster job to `fthsdp run` on the
        driver's host, which reads OUT/checkpoints only."""
        where = (f"its checkpoints are in {self.checkpoint_dir}" if self.checkpoint_dir is not None
                 else "it has no checkpoint directory")
        return (f"(fthsdp ray cannot resume a job yet; {where}: start a new job, or on one host resume it "
                f"with `fthsdp run --resume --out-dir {self.out_dir}` where OUT/checkpoints holds them)")

    # -- what the actors get -----------------------------------------------------------

    def actor_env(self) -> dict[str, str]:
        env = {k: v for k, v in os.environ.items() if k.startswith("FTHSDP_") or k in ENV_PASSED}
        env["FTHSDP_PEER_TOKEN"] = self.token
        env["PYTHONUNBUFFERED"] = "1"
        from fthsdp.control import auth

        return auth.replica_env(env, self.job_key)

    def seed_files(self, rid: int) -> dict[str, str]:
        """What a replacement continues: the ledger and loader position collected so far."""
        from fthsdp.launch.ray_actors import REWRITTEN

        out = {}
        for rel in (f"ledger/replica_{rid}.jsonl", REWRITTEN[1].format(rid=rid)):
            p = self.out_dir / rel
            if p.exists():
                out[rel] = p.read_text()
        return out

    def replica_argv(self, rid: int, mode: str) -> list[str]:
        return ["--replica-id", str(rid), "--lighthouse", self.lighthouse_addr, "--job", self.job_id,
                "--allreduce", self.allreduce, "--hash-every", str(self.hash_every),
                *([] if self.config_text is not None else ["--config", self.config]),
                *(["--resume", self.resume] if self.resume and mode == "start" else []),
                *(["--rejoin"] if mode == "rejoin" else []), *self.overrides, *self.relay_overrides()]

    # -- the records, through Ray ---------------------------------------------------------

    def collect_one(self, rid: int, ap: ActorProcess) -> None:
        import ray

        try:
            got = ray.get(ap.actor.poll.remote(), timeout=POLL_TIMEOUT_S)
        except Exception:  # noqa: BLE001 - dead: what it did not send is lost with its node
            return
        self._store(got)

    def _store(self, got: dict) -> None:
        for rel, text in got["append"].items():
            p = self.out_dir / rel
            p.parent.mkdir(parents=True, exist_ok=True)
            with open(p, "a") as f:
                f.write(text)
        for rel, text in got["latest"].items():
            p = self.out_dir / rel
            p.parent.mkdir(parents=True, exist_ok=True)
            write_atomic(p, text)

    def collect(self) -> None:
        """One round: every live actor's new records, asked for at once."""
        import ray

        asks = {}
        done = supervise.job_done(self.views())
        for rid, rp in self.procs.items():
            ap = rp.proc
            if isinstance(ap, ActorProcess) and done and not ap.placed and ap.returncode is None:
                # a replacement still waiting for room when the others finished: nothing left to join
                ap.kill()
                rp.state, rp.restart_at = "killed", None
                self.event("no_restart", rid, reason="the job finished while its group waited to be placed")
                continue
            if isinstance(ap, ActorProcess):
                ap.advance()
                if ap.placed and ap.returncode is None:
                    asks[rid] = ap.actor.poll.remote()
        for rid, ref in asks.items():
            try:
                self._store(ray.get(ref, timeout=POLL_TIMEOUT_S))
            except Exception:  # noqa: BLE001 - died meanwhile: reap() handles it
                pass

    # -- processes ------------------------------------------------------------------------

    def start_lighthouse(self) -> None:
        t0 = time.monotonic()
        self.lighthouse = self._take_standby() or self._lighthouse_actor()
        self.lighthouse_addr = self.lighthouse.address
        self.lighthouse_port = int(self.lighthouse_addr.rsplit(":", 1)[1])
        self._serving()
        self.event("lighthouse", address=self.lighthouse_addr, actor_pid=self.lighthouse.pid,
                   start_s=round(time.monotonic() - t0, 3), standby=self.from_standby, **self.lighthouse.facts)

    def _lighthouse_actor(self, standby: bool = False) -> LighthouseProcess:
        from fthsdp.launch.ray_actors import node_host

        host = node_host(ray_nodes(), self.driver_node)
        return LighthouseProcess(host, self.lighthouse_port, self.detect_s, self.join_timeout_s, self.replicas,
                                 self.driver_node, self.lighthouse_secret, self.lighthouse_tls,
                                 self.lighthouse_calls_per_s, standby=standby,
                                 beats_per_s=self.lighthouse_beats_per_s)

    def _new_standby(self) -> LighthouseProcess:
        return self._lighthouse_actor(standby=True)

    def _promote(self, spare: LighthouseProcess) -> LighthouseProcess | None:
        """The warm spare actor (created, not bound) bound now; None if it cannot be (it died, or
        cannot bind: a cold start then)."""
        try:
            spare.promote()
            return spare
        except Exception as e:  # noqa: BLE001 - whatever Ray raised for it
            log.warning("the standby lighthouse actor cannot take over (%s): starting one", e)
            spare.kill()
            return None

    def start_relays(self) -> None:
        if self.relay_placement != "replicas":
            return super().start_relays()
        # none yet: each is started with the first replica of its block placed (relay_for)
        n = self.relays
        self.relay_procs, self.relay_addrs, self.relay_nodes = [None] * n, [""] * n, [""] * n

    def relay_overrides(self) -> list[str]:
        # relay_placement="replicas": a replica's relay is named once its group is placed (relay_for)
        return [] if self.relay_placement == "replicas" else super().relay_overrides()

    def relay_for(self, rid: int, node: str) -> list[str]:
        """The overrides naming replica ``rid``'s relay, once its group is placed on ``node``
        (``relay_placement="replicas"``; [] otherwise: relay_overrides named them). A block's relay
        that runs nowhere (not started yet, lost with its node, or not restarted) is started on
        ``node`` first; one that cannot be leaves the replica speaking to the lighthouse directly."""
        if self.relay_placement != "replicas" or not self.relays:
            return []
        from fthsdp.control.relay import relay_index

        i = relay_index(self.relays, rid, self.replicas)
        if self.relay_procs[i] is None:
            self.relay_nodes[i] = node
            try:
                self.relay_procs[i], self.relay_addrs[i] = self._start_relay(i, 0)
            except RuntimeError as e:
                self.relay_nodes[i] = ""
                log.warning("%s; replica %d speaks to the lighthouse directly", e, rid)
                self.event("relay_lost", index=i, reason=f"it did not start on replica {rid}'s node", error=str(e))
                return []
            self.event("relay", address=self.relay_addrs[i], index=i, node=node[:12], with_replica=rid)
            self._tell_block(i, rid)
        return ["launch.relays=0", f"ft.lighthouse_relays={self.relay_addrs[i]}"]

    def _tell_block(self, i: int, placing: int) -> None:
        """Relay ``i`` was (re)started with replica ``placing``: the other running replicas of its
        block (survivors of the node that took its last life) are told its address, through the
        relay file each of their processes follows (ReplicaActor.set_relay, ft.lighthouse_relay_file)."""
        from fthsdp.control.relay import relay_index

        told = []
        for r, rp in self.procs.items():
            ap = rp.proc
            if (r == placing or relay_index(self.relays, r, self.replicas) != i or not isinstance(ap, ActorProcess)
                    or not ap.placed or ap.returncode is not None):
                continue
            for a in (ap, *ap.followers):
                a.actor.set_relay.remote(self.relay_addrs[i])  # not waited for: a dead one is the rules' business
            told.append(r)
        if told:
            log.info("relay %d is now at %s: replicas %s move to it", i, self.relay_addrs[i], told)
            self.event("relay_moved", index=i, address=self.relay_addrs[i], replicas=told)

    def _start_relay(self, i: int, port: int) -> tuple[RelayProcess, str]:
        """Relay ``i`` as an actor on its node (the lighthouse's, as `fthsdp run` puts its relays on
        the lighthouse's host, or with ``relay_placement="replicas"`` its block's: relay_for), on
        ``port`` (0: any free port)."""
        from fthsdp.launch.ray_actors import node_host

        node = (self.relay_nodes[i] if i < len(self.relay_nodes) else "") or self.driver_node
        host = node_host(ray_nodes(), node)
        try:
            proc = RelayProcess(host, port, self.lighthouse_addr, node, self.lighthouse_tls, self.lighthouse_tls_ca)
        except Exception as e:  # noqa: BLE001 - the actor failed to start (its port is taken, ...)
            raise RuntimeError(f"relay {i} did not start on {host}:{port}: {e}") from e
        return proc, proc.address

    def supervise_relays(self) -> None:
        """As locally (a dead relay restarted on its address), except that a relay whose node is gone
        (``relay_placement="replicas"``) is not restarted there: it is placed again with the next
        replica of its block (relay_for). Replicas that were speaking to it speak to the lighthouse
        directly meanwhile, and are told the new address when it runs (_tell_block)."""
        dead = [i for i, p in enumerate(self.relay_procs) if p is not None and p.poll() is not None]
        if dead and self.relay_placement == "replicas":
            alive = {n.get("NodeID") for n in ray_nodes() if n.get("Alive")}
            for i in dead:
                if self.relay_nodes[i] in alive:
                    continue
                log.warning("relay %d at %s died with its node %s; it is placed again with the next replica of "
                            "its block", i, self.relay_addrs[i], self.relay_nodes[i][:12])
                self.event("relay_lost", index=i, reason="its node is gone", node=self.relay_nodes[i][:12])
                self.relay_procs[i], self.relay_addrs[i], self.relay_nodes[i] = None, "", ""
        super().supervise_relays()

    def supervise_lighthouse(self) -> bool:
        # Called once per iteration of LocalJob.run's loop, first: the records come in here.
        self.collect()
        self._note_unplaced()
        return super().supervise_lighthouse()

    def start_replica(self, rid: int, mode: str = "start") -> None:
        rp = self.procs.setdefault(rid, ReplicaProc(rid))
        rp.log_path = self.out_dir / f"replica-{rid}.log"
        rp.log_path.touch()
        rp.followers = []  # the group's processes 1..P-1 join once it is placed
        rp.group_returncode, rp.group_killed, rp.group_grace_until = None, False, None
        rp.proc = ActorProcess(self, rid, self.replica_argv(rid, mode))
        rp.state, rp.mode, rp.progressed = "running", mode, False
        rp.restart_at = rp.cont_at = None

    def _note_unplaced(self) -> None:
        for rid, rp in self.procs.items():
            ap = rp.proc
            if isinstance(ap, ActorProcess) and ap.unplaced and rid not in self.unplaced:
                self.unplaced[rid] = ap.unplaced
                rp.state, rp.restart_at = "unplaced", None
                left = sorted(r for r, p in self.procs.items() if p.state in ("running", "starting", "stopped"))
                log.warning("replica %d cannot be placed: %s; the job goes on with %d replica(s) %s", rid,
                            ap.unplaced, len(left), left)
                self.event("unplaced", rid, reason=ap.unplaced, replicas_left=left)

    def live_status(self, rid: int) -> dict:
        import json

        rp = self.procs.get(rid)
        # a finished, unreaped process keeps its last word (see LocalJob.live_status)
        if rp is None or not isinstance(rp.proc, ActorProcess) or rp.proc.poll() not in (None, 0) \
                or not rp.proc.placed:
            return {}
        try:
            st = json.loads((self.out_dir / f"status-{rid}.json").read_text())
        except (FileNotFoundError, json.JSONDecodeError):
            return {}
        return st if st.get("pid") == rp.proc.pid else {}

    def signal_replica(self, rid: int, sig: int, process: int | None = None) -> None:
        """The local rule, for an actor's worker process: only one on the driver's node can be
        signalled from here (a pid on another node is some other process of this one)."""
        rp = self.procs[rid]
        if not isinstance(rp.proc, ActorProcess) or rp.proc.poll() is not None or not rp.proc.placed:
            return
        target = self._signal_target(rp, sig, process)
        if target is None or target.poll() is not None:
            return
        if target.where.get("node_id") != self.driver_node:
            log.warning("replica %d's process %d runs on another node: signal %s not sent (only SIGKILL and node "
                        "faults reach other nodes)", rid, getattr(target, "index", 0), signal.Signals(sig).name)
            return
        os.kill(target.pid, sig)

    def kill_replica(self, rid: int) -> None:
        rp = self.procs[rid]
        if rp.proc is not None and rp.proc.poll() is None:
            if isinstance(rp.proc, ActorProcess) and rp.proc.placed:
                self.signal_replica(rid, signal.SIGCONT)  # a stopped actor must not hold its group
            rp.proc.kill()
        elif isinstance(rp.proc, ActorProcess) and rp.proc.teardown_deferred:
            rp.proc.kill()  # its leader ended first (ActorProcess._finish): its followers and the group go

    def kill_followers(self, rp: ReplicaProc) -> None:
        for f in rp.followers:
            f.kill()

    def group_of(self, rp: ReplicaProc) -> list | None:
        """The local rule (LocalJob.fail_groups_as_units: one process of a replica ends -> the
        rest are stopped, after a grace when it gave its own restart verdict) over a placed
        group's actors; kill_replica then kills the group: every actor, then the placement group."""
        ap = rp.proc
        if not isinstance(ap, ActorProcess) or not ap.followers or not ap.placed:
            return None
        return [ap, *ap.followers]

    def ray_kill(self, rid: int, how: str, process: int = -1) -> dict:
        """The fault: `ray-kill` (ray.kill of the actor), `sigkill` (SIGKILL of its worker
        process), or `node` (its whole node), of process `process` of the replica (-1: its
        leader). The records sent so far are collected first."""
        import ray

        rp = self.procs[rid]
        leader = rp.proc
        info: dict = {"how": how}
        if not isinstance(leader, ActorProcess) or not leader.placed or leader.poll() is not None:
            return {**info, "note": "not running"}
        ap = self.group_process(rp, process)
        info.update(node=ap.where.get("node_id", "")[:12], pid=ap.pid,
                    **({"process": max(process, 0)} if rp.followers else {}))
        self.collect_one(rid, leader)
        if how == "ray-kill":
            ray.kill(ap.actor, no_restart=True)
        elif how == "sigkill":
            try:
                ray.get(ap.actor.sigkill_self.remote(), timeout=POLL_TIMEOUT_S)
            except Exception:  # noqa: BLE001 - the expected answer: the actor died
                pass
        elif how == "node":
            if ap.where.get("node_id") == self.driver_node:
                raise RuntimeError(f"--kill-node of replica {rid}: it runs on the driver's own node "
                                   f"({self.driver_node[:12]}); removing it would end the job. Give it a node "
                                   "of its own (more nodes, or fewer CPUs on the head node)")
            info["raylet"] = ray.get(ap.actor.kill_node.remote(), timeout=POLL_TIMEOUT_S)
        # Ray learns of a lost node only after its health checks; the replica itself is
        # found dead by the lighthouse meanwhile, and the launcher waits for Ray here.
        deadline = time.monotonic() + self.place_timeout_s
        while ap.poll() is None and time.monotonic() < deadline:
            ray.wait([ap.run_ref], timeout=0.5)
        leader.kill()  # the replica fails as a unit: the rest of its group, then its placement group
        return info

    def _fire(self, f, progress: dict, healthy: set[int]) -> None:
        if f.kind not in ("kill", "kill_node", "kill_worker"):
            return super()._fire(f, progress, healthy)
        step = progress.get(f.replica)
        self.fired.append({**f.to_json(), "attempt": self.attempt, "at_step": step, "time": time.time()})
        self.rundir.record_fired(self.fired[-1])
        rp = self.procs[f.replica]
        t = time.time()
        how = {"kill_node": "node", "kill_worker": "sigkill"}.get(f.kind, self.kill_with)
        try:
            info = self.ray_kill(f.replica, how, getattr(f, "process", -1))
        except (RuntimeError, ValueError) as e:
            # A fault this cluster cannot carry out (a node kill on the driver's only node, a process
            # the replica does not have): said and skipped, not raised out of the job's loop.
            self.fired[-1]["skipped"] = str(e)
            self.event("fault_skipped", f.replica, step=step, fault=f.label(), reason=str(e))
            log.error("fault %s not carried out: %s", f.label(), e)
            return
        rp.state = "killed"
        # The event's time is the fault's (before the wait for Ray), as the report measures from it.
        self.event("kill", f.replica, step=step, healthy=sorted(healthy - {f.replica}), fault_time=t, **info)
        if self.restart:
            rp.restart_at = time.time() + self.restart_delay_s

    def event(self, kind: str, replica: int | None = None, **extra) -> None:
        import json

        t = extra.pop("fault_time", None)
        if t is None:
            return super().event(kind, replica, **extra)
        rec = {"time": t, "kind": kind, "replica": replica, "attempt": self.attempt, **extra}
        self._events.write(json.dumps(rec) + "\n")
        log.info("%s replica %s %s", kind, replica, " ".join(f"{k}={v}" for k, v in extra.items()))

    def status_line(self) -> str:
        line = super().status_line()
        for rid in self.unplaced:
            line = line.replace(f"r{rid}: starting", f"r{rid}: UNPLACED")
        return line

    def run(self) -> dict:
        summary = super().run()
        if self.unplaced:
            summary["unplaced_replicas"] = {str(k): v for k, v in self.unplaced.items()}
            import json

            (self.out_dir / "summary.json").write_text(json.dumps(summary, indent=2, default=str))
            for rid, why in self.unplaced.items():
                log.info("replica %d was never placed again (%s): the job ran on with fewer replicas", rid, why)
        return summary

    def shutdown(self) -> None:
        for rp in self.procs.values():
            if isinstance(rp.proc, ActorProcess):
                if rp.proc.placed and rp.proc.returncode is None:
                    self.collect_one(rp.rid, rp.proc)
                rp.proc.kill()
        super().shutdown()
        self.remove_work_dirs()

    def stop_relays(self) -> None:
        super().stop_relays()
        for i, proc in enumerate(self.relay_procs):  # what each carried (a local relay logs it)
            if isinstance(proc, RelayProcess) and proc.stats:
                self.event("relay_stopped", index=i, **proc.stats)

    def remove_work_dirs(self) -> None:
        """Every live node's work directories of this job, the dead actors' included."""
        import ray
        from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

        from fthsdp.launch.ray_actors import remove_work_dirs

        task = ray.remote(remove_work_dirs)
        refs = [task.options(num_cpus=0, scheduling_strategy=NodeAffinitySchedulingStrategy(n["NodeID"], soft=False))
                .remote(self.work_prefix) for n in ray_nodes() if n.get("Alive")]
        try:
            ray.get(refs, timeout=60)
        except Exception as e:  # noqa: BLE001 - a node left meanwhile: its temp dir went with it
            log.warning("could not remove every node's work directories (%s): %s", self.work_prefix, e)


def ray_nodes() -> list[dict]:
    import ray

    return ray.nodes()


# -- the cluster ----------------------------------------------------------------------------


def connect(address: str | None, num_cpus: int, temp_dir: str | None = None) -> bool:
    """Joins `address` (auto, HOST:PORT) or starts a fresh local cluster sized for the
    job (explicit CPUs, no dashboard, a small object store: the job needs none of
    them). Returns whether this call started the cluster (then ray.shutdown ends it)."""
    import ray

    if ray.is_initialized():
        return False
    kw = dict(include_dashboard=False, log_to_driver=False, logging_level=logging.WARNING)
    if address:
        ray.init(address=address, **kw)
        return False
    ray.init(num_cpus=num_cpus, num_gpus=None, object_store_memory=80 * 1024 * 1024,
             _node_ip_address="127.0.0.1", **({"_temp_dir": temp_dir} if temp_dir else {}), **kw)
    return True


def parse_ray_kills(specs: list[str] | None, kind: str, replicas: int) -> list[faults_lib.Fault]:
    """--kill-node / --kill-worker REPLICA@STEP -> faults of `kind` (kill_node, kill_worker)."""
    flag = "--" + kind.replace("_", "-")
    out = []
    for s in specs or ():
        try:
            f = faults_lib.parse_fault(s, "kill")  # same REPLICA@STEP grammar and checks
        except ValueError:
            raise ValueError(f"bad {flag} {s!r}: expected REPLICA@STEP, e.g. 1@40") from None
        if f.replica >= replicas:
            raise ValueError(f"{flag} {s}: the job has replicas 0..{replicas - 1}")
        out.append(faults_lib.Fault(step=f.step, replica=f.replica, kind=kind))
    return out


def launch(config: str, overrides: list[str], out: str | pathlib.Path | None = None,
           faults: list[faults_lib.Fault] = (), address: str | None = None, num_cpus: int | None = None,
           temp_dir: str | None = None, kill_with: str = "ray-kill", restart: bool | None = None,
           checkpoint_dir: str | None = None, allreduce: str = "ftar", progress: bool = False,
           origin: str = "the caller", handle_signals: bool = False) -> RayJob:
    """Runs one job on Ray and returns it (its `.summary` is summary.json's content).

    The library form of `fthsdp ray`, for notebooks and scripts: joins the
    cluster this process is connected to (or `address`), else starts a fresh
    local one for the job and ends it afterwards. ``handle_signals`` (the CLI's):
    SIGTERM and SIGHUP stop the job through its ``finally`` (installed after
    ``ray.init``, which sets its own SIGTERM handler).
    """
    from fthsdp import config as config_lib
    from fthsdp import logs

    cfg = config_lib.load(config, overrides)
    config_path = pathlib.Path(config)
    config_text = config_path.read_text() if config_path.suffix == ".py" and config_path.is_file() else None
    out = pathlib.Path(out or cfg.train.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    check_checkpoint_dir(checkpoint_dir)
    held = rundir_lib.hold(out)  # until the launch ends (RunDirBusy: another launcher has it)
    rundir_lib.clean_for_fresh_run(out)
    rundir_lib.RunDir(out).save({"config": config, "overrides": list(overrides), "launcher": "ray",
                                 "effective": rundir_lib.effective(cfg), "faults": [f.to_json() for f in faults],
                                 "fired": [], "attempts": []})
    if not logging.getLogger("fthsdp").handlers:
        logs.setup("fthsdp.launch")
    started = connect(address, num_cpus or cluster_cpus_needed(cfg.launch.replicas, cfg.launch.devices_per_replica,
                                                                cfg.launch.processes_per_replica), temp_dir)
    if handle_signals:
        from fthsdp.launch import lifetime

        lifetime.exit_on_termination_signals()
    job = None
    try:
        job = RayJob(config=config, overrides=list(overrides), out_dir=out, replicas=cfg.launch.replicas,
                     steps=cfg.train.steps, faults=list(faults), job_id=cfg.launch.job_id,
                     restart=cfg.launch.restart if restart is None else restart,
                     restart_delay_s=cfg.launch.restart_delay_s, allreduce=allreduce, deadline_s=cfg.launch.deadline_s,
                     max_job_restarts=cfg.launch.max_job_restarts, detect_s=cfg.ft.detect_s,
                     join_timeout_s=cfg.ft.join_timeout_s, progress=progress, kill_with=kill_with,
                     devices=cfg.launch.devices_per_replica, processes=cfg.launch.processes_per_replica,
                     checkpoint_dir=checkpoint_dir, secret_file=cfg.launch.secret_file,
                     lighthouse_tls=(cfg.launch.lighthouse_tls_cert, cfg.launch.lighthouse_tls_key),
                     lighthouse_calls_per_s=cfg.launch.lighthouse_connection_calls_per_s,
                     lighthouse_beats_per_s=cfg.launch.lighthouse_beats_per_s,
                     config_text=config_text, place_timeout_s=cfg.ft.startup_timeout_s,
                     relays=cfg.launch.relays, relay_placement=cfg.launch.relay_placement,
                     lighthouse_tls_ca=cfg.ft.lighthouse_tls_ca, lighthouse_standby=cfg.launch.lighthouse_standby)
        log.info("ray job: %d replicas x %d process(es) x %d devices (placement %s), %d steps, faults (from %s) %s; "
                 "logs in %s", cfg.launch.replicas, cfg.launch.processes_per_replica, cfg.launch.devices_per_replica,
                 job.placement.bundles, cfg.train.steps,
                 origin, [f.label() for f in faults] or "none", out)
        job.summary = job.run()
    finally:
        if job is not None:
            with contextlib.suppress(OSError):
                (job.checkpoint_dir / job.storage_marker).unlink()
        held.close()  # the run directory is free again (a notebook may launch into it next)
        if started:
            import ray

            ray.shutdown()
    return job


def check_checkpoint_dir(checkpoint_dir: str | None) -> None:
    """A --checkpoint-dir must hold no checkpoint yet: fthsdp ray cannot resume, and a whole-job
    fallback would restore an earlier run's state as this job's (OUT/checkpoints, the default, is
    cleaned with the run directory). ValueError saying what to do."""
    if not checkpoint_dir:
        return
    steps = sorted(s for s in (ascii_int(p.name) for p in pathlib.Path(checkpoint_dir).glob("*")) if s is not None)
    if steps:
        raise ValueError(f"--checkpoint-dir {checkpoint_dir} holds checkpoints of an earlier run (steps "
                         f"{steps[:5]}{'...' if len(steps) > 5 else ''}), and fthsdp ray cannot resume: give it an "
                         "empty directory, or remove them")


def cli(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="fthsdp ray", description="Run a fault-tolerant job on a Ray cluster: the "
                                "lighthouse and every replica as Ray actors (one placement group per replica), "
                                "faults through Ray. The report and files are `fthsdp run`'s.")
    p.add_argument("--config", default="ft_local", help="config name or file (default: ft_local)")
    p.add_argument("--address", default=None, help="auto or HOST:PORT of a running cluster (default: start a "
                   "fresh local one for this job and end it at the end)")
    p.add_argument("--num-cpus", type=int, default=None, help="logical CPUs of a fresh local cluster "
                   "(default: what the job's placement groups need)")
    p.add_argument("--temp-dir", default=None, help="Ray's temp dir for a fresh local cluster")
    p.add_argument("--replicas", type=int, default=None, help="overrides launch.replicas")
    p.add_argument("--devices-per-replica", type=int, default=None,
                   help="overrides launch.devices_per_replica (per process)")
    p.add_argument("--processes-per-replica", type=int, default=None,
                   help="overrides launch.processes_per_replica: one actor (and bundle) per process")
    p.add_argument("--kill", action="append", default=None, metavar="REPLICA[.PROCESS]@STEP",
                   help="kill a replica's actor (of its process PROCESS, default the leader) at a step "
                        "(how: --kill-with); the rest of its group goes with it")
    p.add_argument("--kill-with", choices=KILL_WITH, default="ray-kill",
                   help="ray-kill: ray.kill of the actor; sigkill: SIGKILL of the actor's worker process")
    p.add_argument("--kill-worker", action="append", default=None, metavar="REPLICA@STEP",
                   help="SIGKILL a replica's actor worker process at a step (whatever --kill-with says)")
    p.add_argument("--kill-node", action="append", default=None, metavar="REPLICA@STEP",
                   help="remove the node that runs REPLICA at STEP (SIGKILL of its raylet)")
    p.add_argument("--stop", action="append", default=None, metavar="REPLICA@STEP",
                   help="SIGSTOP a replica's actor process at a step (actors on the driver's node)")
    p.add_argument("--stop-seconds", type=float, default=3.0)
    p.add_argument("--random-kills", type=int, default=None)
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--kill-lighthouse", action="append", default=None, metavar="STEP",
                   help="ray.kill the lighthouse actor at STEP (restarted on the same address)")
    p.add_argument("--kill-relay", action="append", default=None, metavar="[INDEX@]STEP",
                   help="ray.kill relay actor INDEX (default 0, the first) at STEP (launch.relays >= 1; restarted on "
                        "the same address)")
    p.add_argument("--restart", action=argparse.BooleanOptionalAction, default=None,
                   help="place and start killed replicas again (default: launch.restart)")
    p.add_argument("--checkpoint-dir", default=None,
                   help="persistent checkpoints: storage every node reaches (default: OUT/checkpoints)")
    p.add_argument("--out-dir", default=None)
    p.add_argument("--allreduce", choices=("ftar", "local"), default="ftar")
    p.add_argument("--no-progress", action="store_true")
    p.add_argument("overrides", nargs="*", help="section.field=value")
    args = p.parse_args(argv)

    from fthsdp import config as config_lib

    from fthsdp.launch.local import shape_overrides

    overrides = shape_overrides(args)
    try:
        cfg = config_lib.load(args.config, overrides)
    except ValueError as e:
        p.error(str(e))
    from fthsdp.launch.local import _steps

    sources = faults_lib.choose_sources(args.kill, args.stop, args.random_kills,
                                        _steps(args.kill_lighthouse, "--kill-lighthouse", p), None,
                                        cfg.launch.kill, cfg.launch.stop, cfg.launch.random_kills, args.kill_relay)
    if (args.kill_node or args.kill_worker) and sources.origin == "config":
        sources = faults_lib.FaultSources((), (), 0, origin="command line")
    try:
        plan = faults_lib.plan(sources.kills, sources.stops, cfg.launch.replicas, random_count=sources.random_count,
                               steps=cfg.train.steps,
                               seed=args.seed if args.seed is not None else cfg.launch.fault_seed,
                               stop_s=args.stop_seconds, lighthouse=sources.lighthouse, relay=sources.relay,
                               relays=cfg.launch.relays)
        plan = sorted(plan + parse_ray_kills(args.kill_node, "kill_node", cfg.launch.replicas)
                      + parse_ray_kills(args.kill_worker, "kill_worker", cfg.launch.replicas))
    except ValueError as e:
        p.error(str(e))
    try:
        check_checkpoint_dir(args.checkpoint_dir)
    except ValueError as e:
        p.error(str(e))
    bad = [f.label() for f in plan if getattr(f, "process", -1) >= cfg.launch.processes_per_replica]
    if bad:  # (as fthsdp run: caught here, not when the fault is due)
        p.error(f"{', '.join(bad)}: a replica has processes 0..{cfg.launch.processes_per_replica - 1} "
                "(launch.processes_per_replica)")
    from fthsdp.launch import lifetime

    lifetime.exit_on_termination_signals()  # a SIGTERM'd or SIGHUP'd driver still stops its actors
    try:
        job = launch(args.config, overrides, out=args.out_dir, faults=plan, address=args.address,
                     num_cpus=args.num_cpus, temp_dir=args.temp_dir, kill_with=args.kill_with, restart=args.restart,
                     checkpoint_dir=args.checkpoint_dir, allreduce=args.allreduce,
                     progress=not args.no_progress and sys.stderr.isatty(), origin=sources.origin,
                     handle_signals=True)
    except lifetime.Terminated as e:
        log.warning("the driver was stopped by a signal (exit %s); the job's actors were stopped", e.code)
        raise
    except KeyboardInterrupt:
        log.warning("interrupted: the job's actors were stopped")
        return 130
    summary = job.summary
    if job.gave_up:
        return 4
    if summary["failed_replicas"]:
        return 1
    return 0 if summary["identical_final_state"] else 3
