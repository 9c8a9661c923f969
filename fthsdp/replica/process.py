"""One replica process: `python -m fthsdp.replica.process --replica-id R --lighthouse HOST:PORT ...`.

The launcher (fthsdp/launch/local.py, Ray) starts one of these per replica.
It builds the replica's mesh, FTAR communicator and step, connects to the
lighthouse, and runs the Manager. Every committed step it appends a JSON line
to `metrics-R.jsonl` and rewrites `status-R.json` atomically, which is what
the launcher's live status line and the tests read.

Exit codes: 0 when the replica finished the job, or arrived (restarted) after
the job had already finished; :data:`fthsdp.errors.EXIT_REPLICA_FATAL` (70)
when this process cannot go on but a restarted one can (its supervisor
restarts it, it rejoins from its peers); :data:`fthsdp.errors.EXIT_JOB_FATAL`
(78) when no restart of this replica can help (the message says what to do).
"""

from __future__ import annotations

import argparse
import logging
import os
import pathlib
import secrets
import signal
import sys
import time

from fthsdp.errors import JobFatalError
from fthsdp.replica.status_file import StatusFile

log = logging.getLogger("fthsdp.replica.process")


def parse_args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m fthsdp.replica.process", description=__doc__.split("\n")[0])
    p.add_argument("--config", default="base")
    p.add_argument("--replica-id", type=int, default=None, help="this replica's id (or FTHSDP_REPLICA_ID)")
    p.add_argument("--process-index", type=int, default=None,
                   help="this process's index in its replica, 0 = the leader (or FTHSDP_PROCESS_INDEX; default 0)")
    p.add_argument("--num-processes", type=int, default=None,
                   help="processes of this replica (or FTHSDP_NUM_PROCESSES; default 1)")
    p.add_argument("--coordinator", default=None, metavar="HOST:PORT",
                   help="the replica's JAX coordinator, served by its process 0 (or FTHSDP_COORDINATOR)")
    p.add_argument("--lighthouse", default=None, help="HOST:PORT of `fthsdp lighthouse` (or FTHSDP_LIGHTHOUSE)")
    p.add_argument("--job", default=None, help="the job's name at its lighthouse (default: launch.job_id)")
    p.add_argument("--out-dir", required=True)
    p.add_argument("--allreduce", choices=("ftar", "local"), default="ftar",
                   help="local = identity (a job of one replica, no FTAR)")
    p.add_argument("--hash-every", type=int, default=1, help="record a state hash every N committed steps (0: never)")
    p.add_argument("--rejoin", action="store_true",
                   help="this replica was restarted alone: join the running quorum without the start-up barrier")
    p.add_argument("--resume", default="", metavar="RESTART_ID",
                   help="full restart: resume from the latest persistent checkpoint and its loader positions; "
                        "RESTART_ID names this restart in the exactly-once ledgers")
    p.add_argument("--bind-host", default=None,
                   help="interface this process's listeners (FTAR, state server, metrics) bind; overrides "
                        "ft.bind_host (default loopback; 0.0.0.0 or :: = every interface)")
    p.add_argument("--advertise-host", default=None,
                   help="host the other replicas are told to connect to; overrides ft.advertise_host "
                        "(default: the bind host)")
    p.add_argument("overrides", nargs="*")
    args = p.parse_args(argv)
    from fthsdp.replica.group import GroupSpec

    try:
        args.group = GroupSpec.from_env(replica_id=args.replica_id, process_index=args.process_index,
                                        num_processes=args.num_processes, coordinator=args.coordinator)
    except ValueError as e:
        p.error(str(e))
    args.replica_id = args.group.replica_id
    args.lighthouse = args.lighthouse or os.environ.get("FTHSDP_LIGHTHOUSE", "")
    if not args.lighthouse:
        p.error("no lighthouse: pass --lighthouse HOST:PORT or set FTHSDP_LIGHTHOUSE")
    # The flags are config overrides, so that the config's rules check them.
    args.overrides = [*args.overrides,
                      *([f"ft.bind_host={args.bind_host}"] if args.bind_host is not None else []),
                      *([f"ft.advertise_host={args.advertise_host}"] if args.advertise_host is not None else [])]
    return args


class ReplicaProcess:
    """Everything one replica process owns, wired around its Manager.

    The Manager runs the step loop; this class gives it the process's parts:
    the FTAR communicator, the snapshotter and the HTTP peer server that feeds
    catching-up peers, the fetch from peers when this replica is behind, the
    persistent checkpoints, loader_state, the exactly-once ledger, and the
    metrics and status files the launcher reads.
    """

    def __init__(self, args: argparse.Namespace, cfg, out: pathlib.Path):
        import jax

        from fthsdp import logs
        from fthsdp.checkpoint.peer_server import PeerServer
        from fthsdp.checkpoint.persistent import PersistentCheckpointer
        from fthsdp.checkpoint.snapshot import Snapshotter
        from fthsdp.data import LoaderState
        from fthsdp.data.ledger import Ledger
        from fthsdp.data.loader_state import LoaderStateStore
        from fthsdp.control.lighthouse_client import LighthouseClient
        from fthsdp.replica.manager import Manager, SoloCommunicator
        from fthsdp.step.quorum_inputs import local_allreduce
        from fthsdp.step.sharding import replica_mesh
        from fthsdp.step.functional import make_train_step

        self.args, self.cfg, self.out = args, cfg, out
        self.rid = str(args.replica_id)
        self.group = args.group
        # Only the leader (process 0) writes the replica's files and talks to the lighthouse;
        # a replica of one process is its own leader, exactly as before.
        self.leader = self.group.is_leader
        self.mesh = replica_mesh(cfg.launch.devices_per_replica)
        native_comm = None
        if args.allreduce == "ftar":
            from fthsdp.collective import ftar

            ftar.scope_test_hooks(self.rid)
            self.comm = ftar.Communicator(num_shards=len(self.mesh.local_devices), streams=cfg.ft.streams_per_peer,
                                          timeout_s=cfg.ft.allreduce_timeout_s, listen_host=cfg.ft.bind_host,
                                          advertise_host=cfg.ft.advertise_host, key=self.load_ring_key())
            allreduce = ftar.allreduce
            native_comm = self.comm
        else:
            self.comm, allreduce = SoloCommunicator(), local_allreduce
        if self.group.num_processes > 1:
            from fthsdp.replica.group import DecisionChannel

            self.channel = DecisionChannel(self.group, namespace=args.job)
        from fthsdp.observe.phase import PhaseTracker

        # Where this process is (heartbeats carry it to the lighthouse's root-cause analysis);
        # in the all-reduce it reads this process's own FTAR endpoints' progress counters.
        self.phases = PhaseTracker(progress=native_comm.progress if native_comm is not None else None)
        self.ts = make_train_step(cfg, self.mesh, allreduce=allreduce)
        state = self.ts.init(cfg.train.seed)
        self.abstract = jax.tree.map(lambda x, sh: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sh),
                                     state, self.ts.state_shardings)

        self.peer_key = self.load_peer_key(cfg)
        self.snapshots = Snapshotter()
        self._snapshot_step = -1
        cap = cfg.ft.peer_serve_cap_gbps * 1e9 if cfg.ft.peer_serve_cap_gbps > 0 else None
        from fthsdp.checkpoint.peer_server import TLSFiles

        tls = TLSFiles(cfg.ft.peer_tls_cert, cfg.ft.peer_tls_key) if cfg.ft.peer_tls_cert else None
        self.server = PeerServer(self.snapshots, self.peer_key, host=cfg.ft.bind_host, max_bytes_per_s=cap,
                                 advertise_host=cfg.ft.advertise_host, timeouts=cfg.timeouts, tls=tls).start()
        # A follower keeps its own copies of the replica's files apart (under followers/R.p/):
        # the run's ledger, loader positions, metrics and status are the leader's alone.
        files = out if self.leader else out / "followers" / self.group.label
        self.files = files
        # The job's checkpoints are one directory: every process of the writer replica saves its own
        # shards into it (Orbax's multi-process save: its process 0 alone writes the metadata and
        # the JSON items), and every process restores its own shards from it.
        self.ckpt = PersistentCheckpointer(out / "checkpoints", every=cfg.ft.checkpoint_every, job_id=args.job)
        # One fsync per commit, for the file that is read back: the ledger (a host crash lost its
        # unsynced lines, and the exactly-once check then reported batches the model holds as never
        # trained). loader_state, a record for people and reports that training never reads, was the
        # one fsync'd, and is now only replaced atomically.
        self.ledger = Ledger(files / "ledger" / f"replica_{self.rid}.jsonl", args.replica_id, fsync=True)
        self.loader_store = LoaderStateStore(files / "loader_state", durable=False)
        # Only this replica's torn temporaries: another live replica may be mid-write
        # of its own (a restarted replica that cleaned them all made a survivor's
        # os.replace fail).
        from fthsdp.atomic_file import temporaries

        for torn in temporaries(files / "loader_state", f"replica_{self.rid}.json"):
            torn.unlink(missing_ok=True)
        self.metrics = logs.MetricsWriter(files / f"metrics-{self.rid}.jsonl")
        # Prometheus: this process's metrics over HTTP (loopback by default; the
        # address is in status-R.json for scrape target lists).
        from fthsdp.addresses import join_host_port
        from fthsdp.observe.metrics import ReplicaMetrics, pytree_bytes, serve

        self.prom = ReplicaMetrics(args.job, self.rid, process=str(jax.process_index()),
                                   grad_bytes=pytree_bytes(state.params))
        self.prom_server = serve(self.prom.registry, os.environ.get("FTHSDP_METRICS_BIND") or
                                 join_host_port(cfg.ft.bind_host, 0))
        # Where scrapers reach it: the advertise host when the bind host is a wildcard (0.0.0.0 would
        # make every scrape target Prometheus's own host), as FTAR and the state server are advertised.
        from fthsdp.addresses import is_wildcard

        self.metrics_address = (join_host_port(cfg.ft.advertise_host, self.prom_server.port)
                                if is_wildcard(self.prom_server.host) and cfg.ft.advertise_host
                                else self.prom_server.address)
        self.status_path = files / f"status-{self.rid}.json"
        self.started = time.time()
        # One object for every thread that writes the status (its lock is what keeps a final record).
        self.status = StatusFile(self.status_path, {"replica": self.rid, "started": self.started,
                                                    "metrics_address": self.metrics_address,
                                                    "peer_server": self.server.url})
        from fthsdp.control.sdc import parse_flip

        self.flip = parse_flip(cfg.ft.test_flip_bit)  # a test hook, off by default
        # another (ft.test_fail_fetch): this process's first state fetch fails at once
        self.fail_fetch_once = bool(cfg.ft.test_fail_fetch.strip()) and cfg.ft.test_fail_fetch.strip() in (
            self.group.label, f"{self.group.replica_id}.{self.group.process_index}")
        self.die_before_ledger = None  # another (ft.test_die_before_ledger): (replica, step)
        if cfg.ft.test_die_before_ledger.strip():
            from fthsdp.launch.faults import parse_fault

            f = parse_fault(cfg.ft.test_die_before_ledger.strip(), "test_die_before_ledger")
            self.die_before_ledger = (f.replica, f.step)

        # Every process is its own client of the lighthouse (heartbeats, its addresses, its
        # views); only the leader asks for quorums.
        from fthsdp.control import auth
        from fthsdp.control.relay import relay_of

        try:  # the job's secret: $FTHSDP_JOB_SECRET_FILE or $FTHSDP_JOB_SECRET (the launchers set it)
            job_key = auth.load_secret()
        except auth.SecretError as e:
            raise JobFatalError(f"fthsdp replica: {e}") from None
        if job_key is None:
            logging.getLogger("fthsdp.replica").warning(
                "no job secret ($%s / $%s): lighthouse calls are unsigned, which only a lighthouse run "
                "with --insecure accepts", auth.SECRET_FILE_ENV, auth.SECRET_ENV)
        client = LighthouseClient(args.lighthouse, args.job, self.rid, key=job_key,
                                  tls_ca_file=cfg.ft.lighthouse_tls_ca, session=cfg.ft.lighthouse_session,
                                  relay=relay_of(cfg.ft.lighthouse_relays, int(args.replica_id), cfg.launch.replicas),
                                  relay_file=cfg.ft.lighthouse_relay_file,
                                  heartbeat_interval_s=cfg.ft.heartbeat_interval_s,
                                  heartbeat_timeout_s=cfg.timeouts.heartbeat_rpc_s,
                                  outage_s=cfg.timeouts.lighthouse_outage_s, rejoin=args.rejoin,
                                  process_index=self.group.process_index, num_processes=self.group.num_processes)
        from fthsdp.step.signature import state_signature

        client.state_signature = state_signature(state, cfg)  # stated with its quorum requests (a leader's)
        if self.group.num_processes > 1:
            client.register(self.comm.addresses, self.server.url,
                            len(self.comm.addresses) * self.group.num_processes)
        # Every process's heartbeats carry where it is (root-cause analysis): a follower's own
        # ring can stall, or the follower itself, while its leader looks fine.
        client.phase_source = lambda: self.phases.report(self.rid)
        if not self.leader:
            from fthsdp.replica.group import FollowerQuorumSource, parse_hold_view

            self.client = FollowerQuorumSource(
                self.channel, cfg.timeouts.quorum_timeout_s + cfg.timeouts.lighthouse_outage_s + cfg.ft.startup_timeout_s,
                client, hold_view=parse_hold_view(cfg.ft.test_hold_view))
        else:
            self.client = client
            if self.group.num_processes > 1:
                from fthsdp.replica.group import LeaderQuorumSource

                self.client = LeaderQuorumSource(self.client, self.channel)
        # Advertised with this process's heartbeats (fthsdp status --prometheus-targets).
        client.advertise_metrics(self.metrics_address)
        self.watchdog = None
        if self.group.num_processes > 1:
            from fthsdp.replica.group import GroupWatchdog

            self.watchdog = GroupWatchdog(self.group, cfg.ft.heartbeat_interval_s, cfg.ft.detect_s,
                                          self.on_silent_follower, namespace=args.job,
                                          startup_silent_s=cfg.timeouts.follower_startup_silence_s).start()
        self.mgr = Manager(cfg=cfg, replica_id=self.rid, job_id=args.job, ts=self.ts, comm=self.comm,
                           lighthouse=self.client, state=state, loader=LoaderState(replica=args.replica_id),
                           recover=self.recover, state_server_address=self.server.url,
                           on_commit=self.on_commit, on_quorum=self.on_quorum, rejoin=args.rejoin,
                           phases=self.phases, on_install=self.on_install)
        if not self.leader:
            # A follower registers its addresses from the start (its heartbeats alone never make
            # its replica known to the lighthouse, nor bring a dead one back: its leader's do).
            self.client.start_heartbeats(on_dead=self.mgr.on_dead, on_asking=self.mgr.on_asking)

    @staticmethod
    def load_ring_key() -> bytes:
        """The key FTAR's ring handshake and chunk tags prove: derived from the job's secret
        ($FTHSDP_JOB_SECRET / $FTHSDP_JOB_SECRET_FILE, set by the launchers) for the purpose
        "ftar"; without one (a lighthouse run --insecure) from the launcher's per-job
        $FTHSDP_PEER_TOKEN; with neither the ring is explicitly insecure (a warning says so)."""
        from fthsdp.collective import ftar
        from fthsdp.control import auth

        try:
            job_key = auth.load_secret()
        except auth.SecretError as e:
            raise JobFatalError(f"fthsdp replica: {e}") from None
        secret = job_key if job_key is not None else os.environ.get("FTHSDP_PEER_TOKEN", "").encode()
        return ftar.key_from_secret(secret) if secret else b""

    @staticmethod
    def load_peer_key(cfg) -> bytes:
        """The key this replica's peer server checks and its fetches sign with: derived from the
        job's secret ($FTHSDP_JOB_SECRET / $FTHSDP_JOB_SECRET_FILE, set by the launchers), so a
        replica of another job is refused. Without a job secret (a lighthouse run --insecure) the
        launcher's per-job $FTHSDP_PEER_TOKEN is used instead; a lone replica makes up its own."""
        from fthsdp.checkpoint.peer_server import peer_key
        from fthsdp.control import auth

        try:
            job_key = auth.load_secret()
        except auth.SecretError as e:
            raise JobFatalError(f"fthsdp replica: {e}") from None
        if job_key is not None:
            return peer_key(job_key)
        token = os.environ.get("FTHSDP_PEER_TOKEN", "")
        if token:
            return token.encode()
        if cfg.launch.replicas > 1:
            raise JobFatalError(f"no job secret (${auth.SECRET_ENV} / ${auth.SECRET_FILE_ENV}) and no "
                                "FTHSDP_PEER_TOKEN: every replica of a job needs the job's secret to serve and fetch "
                                "state (fthsdp run sets it)")
        return secrets.token_bytes(32)

    # -- state from peers -------------------------------------------------------

    def recover(self, q, step: int):
        """The healthy replicas' state at `step`: assigned sources first, then any healthy peer.

        A process of a replica of several fetches only its own shards (its local parts, see
        fthsdp/checkpoint/local_shards.py) from the processes that hold the same shards in the
        healthy replicas (its view's sources), and puts them onto its own devices."""
        from fthsdp.checkpoint import local_shards, orbax_peer
        from fthsdp.errors import PeerFetchError

        if self.fail_fetch_once:  # the test hook ft.test_fail_fetch
            self.fail_fetch_once = False
            log.warning("TEST HOOK ft.test_fail_fetch=%r: failing this process's fetch of step %d",
                        self.cfg.ft.test_fail_fetch, step)
            raise PeerFetchError(f"test hook ft.test_fail_fetch: the fetch of step {step} failed")
        assigned = ([s.state_server_address for s in q.sources] if q.sources else
                    [q.member(src).state_server_address for src in q.sources_for(self.rid)])
        others = [q.member(h).state_server_address for h in q.healthy]
        first = list(dict.fromkeys(a for a in assigned if a))
        tries = [first, [a for a in dict.fromkeys(others) if a and a not in first] + first]
        per_shard = self.group.num_processes > 1
        like = {"train": local_shards.local_like(self.abstract) if per_shard else self.abstract,
                "data": self.mgr.data_state()}
        last: Exception | None = None
        # The fetch's share of a behind quorum's all-reduce deadline (allreduce_timeout_s more than
        # this: Manager._deadline): every wait of every try ends by it. A source that trickles its
        # bytes held the fetch, and through the quorum the whole job, for as long as it liked.
        deadline = time.monotonic() + self.cfg.ft.catch_up_timeout_s
        while True:
            for i, sources in enumerate(tries):
                if not sources:
                    continue
                now = time.monotonic()
                # the assigned sources get half of what is left, so a slow one leaves the others a try
                until = deadline if i == len(tries) - 1 else now + (deadline - now) / 2
                try:
                    tree, info = orbax_peer.restore(like, sources, self.peer_key, step,
                                                    tls_ca_file=self.cfg.ft.peer_tls_ca or None,
                                                    timeout_s=self.cfg.ft.allreduce_timeout_s,
                                                    streams_per_source=self.cfg.ft.peer_streams, deadline=until)
                except Exception as e:  # noqa: BLE001 - every failure falls through to the next sources
                    last = e
                    continue
                log.info("fetched state of step %d from %s: %s", step, sources, info.detail)
                self.prom.observe_fetch(info.detail)
                self.metrics.write(kind="fetch", replica=self.rid, process=self.group.process_index, step=step,
                                   bytes=int(info.detail.get("bytes", 0)) if isinstance(info.detail, dict) else 0,
                                   state_bytes=local_shards.parts_bytes(self.abstract), sources=sources,
                                   per_shard=per_shard)
                train = local_shards.assemble(tree["train"], self.abstract) if per_shard else tree["train"]
                return train, tree["data"]
            # With on-demand snapshots the peers start copying when they see the
            # same quorum we do: a source may not serve this step for a few ms yet.
            if time.monotonic() > deadline:
                raise PeerFetchError(f"could not fetch the state of step {step} from any healthy peer: {last}")
            time.sleep(0.05)

    def reconcile_ledger(self, data: dict, step: int) -> None:
        """Make our ledger say what the state we are installing (of step ``step``) contains.

        Our batches in it are positions ``0 .. positions[me] - 1`` (the replicated data
        state travels with the model). Two things can differ from what we recorded:

        * The peers committed a step whose all-reduce completed on them but not here (we
          died, or failed the commit vote, right after contributing): the model holds our
          batch ``positions[me] - 1`` but the ledger lacks it. It is recorded now, at the
          step that trained it (``last_step[me] + 1``), not trained again.
        * We committed batches the state lacks: we were fenced (our state forked from the
          job's lineage: another quorum re-decided a step we had committed; rule 6 of
          fthsdp.control.quorum), or our commit succeeded while the peers' failed and
          they went on without it. Those commits are discarded with our old state: a
          ``rollback`` line names their steps, and we train those batches again from
          the fetched positions. Without it the exactly-once check counts them twice.
        """
        from fthsdp.data.ledger import discarded_commits, read_ledger

        me = self.args.replica_id
        pos, last = int(data["positions"][me]), int(data["last_step"][me])
        contents = read_ledger(self.ledger.path)
        gone = discarded_commits(contents, pos)
        if gone:
            first, final = min(c.step for c in gone), max(c.step for c in gone)
            self.ledger.rollback(step, first, final)
            log.warning("ledger: the state of step %d we install lacks our %d commit(s) of steps %d..%d (batches "
                        "%d..%d): our state forked from the job's lineage (or our last commit succeeded while the "
                        "peers' failed); they are rolled back and trained again",
                        step, len(gone), first, final, min(c.position for c in gone), max(c.position for c in gone))
            self.metrics.write(kind="rollback", replica=self.rid, step=step, first=first, last=final,
                               positions=sorted(c.position for c in gone))
            self.discard_forked_checkpoints(first, final)
            contents = read_ledger(self.ledger.path)
        self.record_unrecorded_commit(pos, last, contents)

    def record_unrecorded_commit(self, pos: int, last: int, contents=None) -> None:
        """Our batch ``pos - 1`` is in the state we install (its replicated positions say so,
        and ``last`` is the last step we contributed to) but not in our ledger: an earlier
        process of this replica was killed between a commit and its ledger line. Recorded now,
        at the step that trained it (``last + 1``), not trained again."""
        from fthsdp.data.ledger import live_positions, read_ledger

        if pos <= 0 or last < 0:
            return
        contents = read_ledger(self.ledger.path) if contents is None else contents
        if pos - 1 not in live_positions(contents):
            self.ledger.commit(last + 1, pos - 1)
            log.info("ledger: batch %d was committed at step %d before we recorded it (the state we install "
                     "holds it)", pos - 1, last + 1)

    # -- hooks of the Manager -----------------------------------------------------

    def snapshot(self) -> None:
        """Start the lazy host copy of the committed state (it lands while the step computes)."""
        from fthsdp.checkpoint.snapshot import SnapshotError

        step = int(self.mgr.state.step)
        # Taken already: its copy is in flight or served. (One whose copy failed in the background
        # is neither: it is taken again, or peers asking for this step found none until the next.)
        taken = self._snapshot_step == step and (self.snapshots.pending or self.snapshots.served_step() == step)
        if not taken:
            train = self.mgr.state
            if self.group.num_processes > 1:
                # A replica of several processes: each process serves only its own shards (no
                # gather across the replica); a rejoiner's process p fetches them from process p.
                from fthsdp.checkpoint.local_shards import local_parts

                train = local_parts(train)
            try:
                began = self.snapshots.begin(step, {"train": train, "data": self.mgr.data_state()})
            except SnapshotError as e:
                # The state cannot be copied (an array this process does not hold whole): this
                # replica's training is fine; only a fetch now finds no snapshot and asks again.
                log.warning("replica %s: no snapshot of step %d for peers (%s); training goes on, a rejoiner's "
                            "fetch is told to ask again", self.rid, step, e)
                began = False
            # (not begun: a peer still reads every spare slot; the Snapshotter said so, and the next
            # call tries again)
            self._snapshot_step = step if began else -1

    def on_install(self, data: dict, step: int) -> None:
        """A catch-up committed (Manager.on_install): the state is the lineage's now, whatever this
        replica snapshotted before under the same step number (a fenced replica's forked state of
        that step, which peers would otherwise go on fetching as the job's); then the ledger."""
        self._snapshot_step = -1
        self.reconcile_ledger(data, step)

    def on_quorum(self, mgr, q) -> None:
        if not self.client.heartbeating:  # a rejoiner starts heartbeating once it is a member
            self.client.start_heartbeats(on_dead=mgr.on_dead, on_asking=mgr.on_asking)
        if self.cfg.ft.snapshot == "on_demand" and q.behind and self.rid in q.healthy:
            self.snapshot()

    def on_commit(self, mgr, rec) -> None:
        from fthsdp.observe.phase import Phase
        from fthsdp.step.functional import state_hash

        committed = rec.step + 1
        self.prom.observe_step(rec)
        if self.die_before_ledger == (self.args.replica_id, rec.step):
            self._die_before_ledger(rec.step)
        if rec.healthy:
            self.ledger.commit(committed, rec.position)
        if self.cfg.ft.snapshot == "every_commit":  # after the ledger: nothing may come between a commit and it
            self.snapshot()
        self.loader_store.save(mgr.loader, committed)
        # Every process of the writer replica (the same decision on each: replayed quorum) calls save.
        if self.ckpt.should_save(committed) and self.rid == min(mgr.quorum.healthy, key=int):
            self.phases.set(Phase.CHECKPOINTING)
            try:
                self.ckpt.save(committed, mgr.state, {i: int(p) for i, p in enumerate(mgr.positions)},
                               metadata={"writer": self.rid, "quorum_id": rec.quorum_id,
                                         # the step each replica last contributed to: a resume records a
                                         # batch a killed replica committed but did not log (ledger)
                                         "last_step": [int(x) for x in mgr.last_step]})
            except Exception as e:  # noqa: BLE001 - a failed checkpoint must not stop training; say it loudly
                log.error("persistent checkpoint of step %d failed: %s", committed, e)
            self.phases.set(Phase.IDLE)
        record = {"kind": "step", "replica": self.rid, "step": rec.step, "quorum_id": rec.quorum_id,
                  "members": list(rec.members), "healthy": rec.healthy, "attempts": rec.attempts,
                  "loss": rec.loss, "start": rec.start, "end": rec.end, "position": rec.position,
                  "events": rec.events, "pid": os.getpid(), "rebuild_s": rec.rebuild_s,
                  "allreduce_s": rec.allreduce_s, "grads_s": rec.grads_s, "catch_up_s": rec.catch_up_s,
                  "quorum_at": rec.quorum_at, "skipped": rec.skipped}
        if self.args.hash_every and committed % self.args.hash_every == 0:
            record["hash"] = state_hash(mgr.state)
        if rec.fingerprint is not None:
            record["fingerprint"] = f"{rec.fingerprint:016x}"
        if self.flip is not None and self.flip.replica == self.args.replica_id and self.flip.step == rec.step:
            self.flip_bit(mgr)
        self.metrics.write(**record)
        self.write_status(step=committed, loss=rec.loss, quorum_id=rec.quorum_id, members=list(rec.members),
                          state="training" if rec.healthy else "caught up")

    def _die_before_ledger(self, step: int) -> None:
        """The test hook ft.test_die_before_ledger: SIGKILL this process between a commit and its
        ledger line, once per run directory (a marker file), as a kill can land there."""
        marker = self.out / f"test_die_before_ledger-{self.rid}"
        if marker.exists():
            return
        marker.write_text(f"step {step}\n")
        log.warning("TEST HOOK ft.test_die_before_ledger=%r: SIGKILL after committing step %d, before its ledger "
                    "line", self.cfg.ft.test_die_before_ledger, step)
        os.kill(os.getpid(), signal.SIGKILL)

    def flip_bit(self, mgr) -> None:
        """The test hook (ft.test_flip_bit): emulate silent data corruption by flipping one bit
        of this replica's parameters after a commit (after its fingerprint was taken, so the
        lighthouse finds out at the next commit). Every process of the replica flips, on its
        devices, keeping the layout."""
        from fthsdp.step.fingerprint import flip_bit

        mgr.state = mgr.state._replace(params=flip_bit(mgr.state.params, self.flip.bit,
                                                       shardings=self.ts.state_shardings.params))
        self._snapshot_step = -1  # a snapshot taken before the flip no longer matches the state
        log.warning("TEST HOOK ft.test_flip_bit=%r: flipped bit %d of the first parameter of replica %s after "
                    "step %d", self.cfg.ft.test_flip_bit, self.flip.bit, self.rid, int(mgr.state.step) - 1)
        self.metrics.write(kind="test_flip_bit", replica=self.rid, step=int(mgr.state.step) - 1, bit=self.flip.bit)

    def write_status(self, final: bool = False, **fields) -> None:
        """This replica's status (fthsdp.replica.status_file); ``final`` for the last word of a process
        that ends, which no later write from another thread may replace."""
        self.status.write(final=final, **fields)

    def on_silent_follower(self, process: int, silent_s: float) -> None:
        """A follower stopped beating (frozen or dead): the replica leaves as a unit, now. The
        training thread may be stuck in an intra-replica collective with it, so this exits
        from the watchdog's thread; the lighthouse stops hearing the replica and the launcher
        (or the cluster's supervisor) kills the rest of the group."""
        from fthsdp.errors import EXIT_REPLICA_FATAL

        why = (f"process {process} of replica {self.rid} silent for {silent_s:.2f}s (> ft.detect_s="
               f"{self.cfg.ft.detect_s}s): the replica leaves as a unit")
        log.error("%s", why)
        try:
            self.write_status(final=True, step=int(self.mgr.state.step), state="failed (replica-fatal)", fault=why,
                              exit_code=EXIT_REPLICA_FATAL)
        finally:
            os._exit(EXIT_REPLICA_FATAL)

    # -- lifetime ---------------------------------------------------------------------

    def resume(self, restart_id: str) -> None:
        """Full restart: the latest persistent checkpoint and the loader positions saved with it."""
        import numpy as np

        mgr = self.mgr
        latest = self.ckpt.latest_step()
        if self.group.num_processes > 1:
            # The leader's listing decides for the whole replica: each process listing the directory
            # itself (a shared mount's cached listing lags) restored its shards of different steps,
            # or none, past an Orbax barrier that names no step.
            latest = self.channel.share("resume_step", latest, self.cfg.ft.startup_timeout_s)
        if latest is None:
            # killed before its first durable checkpoint: the whole job starts over
            self.ledger.restore(0, restart_id)
            log.warning("replica %s: --resume but no finished checkpoint under %s; starting from step 0",
                        self.rid, self.out / "checkpoints")
            return
        restored = self._restore_newest_readable(latest)
        mgr.state = restored.state
        self._snapshot_step = -1  # whatever was snapshotted under this step number is not this state
        n = len(mgr.positions)
        last = restored.metadata.get("last_step")  # absent from checkpoints written before it was saved
        last = np.array(last, np.int64) if isinstance(last, list) and len(last) == n else np.full(n, -1)
        mgr.install_data_state({"positions": np.array([restored.loader_positions.get(i, 0) for i in range(n)]),
                                "last_step": last})
        self.ledger.restore(restored.step, restart_id)
        # The checkpoint may hold a batch of ours whose ledger line our killed predecessor never
        # wrote, or lack one it recorded at the checkpoint's step or before (our last commit
        # succeeded while the peers' failed, and the job died before we rejoined): the restore
        # line voids only later steps, so the ledger is reconciled as at a rejoin.
        self.reconcile_ledger({"positions": mgr.positions, "last_step": mgr.last_step}, restored.step)
        log.info("replica %s: resumed from the persistent checkpoint of step %d, stream position %d",
                 self.rid, restored.step, mgr.loader.position)

    def _restore_newest_readable(self, latest: int):
        """The newest persistent checkpoint that restores. One torn by a host crash (Orbax writes
        its JSON items without fsync) or otherwise unreadable is skipped, with its error in the
        log: restoring only the latest failed every restart the same way. A replica of several
        processes tries ``latest`` only, its leader's listing: each process restores its own
        shards, and one falling back alone would mix steps (or wait at another barrier than the
        others). None restoring
        is replica-fatal, naming each step's error: a passing cause (a storage outage) is retried
        by the restart, a lasting one stops at the launcher's limit of failed starts."""
        from fthsdp.errors import ReplicaFatalError

        failures = []
        steps = sorted(self.ckpt.all_steps(), reverse=True)
        if self.group.num_processes > 1:
            steps = [latest]  # the leader's listing (resume)
        for step in steps:
            try:
                return self.ckpt.restore(self.abstract, step)
            except Exception as e:  # noqa: BLE001 - this step cannot be used: the one before may be
                failures.append(f"step {step}: {type(e).__name__}: {str(e)[:300]}")
                log.error("replica %s: the persistent checkpoint of step %d cannot be restored (%s: %s); trying "
                          "the one before", self.rid, step, type(e).__name__, e)
        raise ReplicaFatalError(f"no persistent checkpoint under {self.ckpt.directory} can be restored: "
                                f"{'; '.join(failures)}; move the broken step directories aside, or fix what the "
                                "errors name")

    def run(self) -> int:
        from fthsdp.observe.phase import Phase
        from fthsdp.step.functional import state_hash

        cfg, mgr = self.cfg, self.mgr
        from fthsdp.errors import classify, exit_code
        from fthsdp.gc_policy import low_pause_gc
        from fthsdp.control.lighthouse_client import JobFinished

        try:
            # start-up inside the classifier too: a job-fatal error here (a checkpoint of another
            # job, a data state that cannot be installed) exits 78, not 1, and is not restarted
            if self.args.resume:
                self.resume(self.args.resume)
            log.info("replica %s: %d device(s), lighthouse %s, ftar endpoints %s, state server %s", self.group.label,
                     self.mesh.devices.size, self.args.lighthouse, list(self.comm.addresses), self.server.url)
            self.phases.set(Phase.COMPILING)
            took = mgr.warm_up()
            own = self.ts.program_counts()  # a follower process's own program cache (JAX's serves process 0)
            log.info("replica %s: compiled the step in %.1fs (before checking in)%s", self.group.label, took,
                     f"; this process's program cache: {own.loaded} loaded, {own.compiled} compiled"
                     if own.loaded + own.compiled else "")
            self.phases.set(Phase.IDLE)
            if cfg.ft.snapshot == "every_commit":
                self.snapshot()
            if not self.args.rejoin and not self.client.heartbeating:
                # A rejoiner starts heartbeating at its first quorum (on_quorum): its open
                # request is its sign of life until then, so the lighthouse never sees it
                # "live but not asking" and the others never wait a join limit for it.
                self.client.start_heartbeats(on_dead=mgr.on_dead, on_asking=mgr.on_asking)
            if cfg.launch.replicas > 1 and not self.args.rejoin and self.leader:  # a job's (re)start: begin together
                # in the try: a lighthouse that stays unreachable past the outage limit is job-fatal
                # (exit 78, with a final status and a Leave) as it is in the step loop
                live = mgr.wait_for_peers(self.client.status, cfg.launch.replicas, cfg.ft.startup_timeout_s)
                log.info("replica %s: %d replica(s) live, starting", self.rid, live)
            # Everything start-up built (jax, the compiled step) frozen, and young collections
            # rare: CPython's defaults paused a training replica up to 136 ms (a full
            # collection), its heartbeat thread with it (fthsdp.gc_policy).
            if self.watchdog is not None:
                self.watchdog.training()  # from here a silent follower stalls the job: the strict window
            with low_pause_gc():
                mgr.run(cfg.train.steps)
            if self.leader and self.watchdog is not None:
                # Training is over: its followers stop beating as they finish (close), while this
                # leader may still roll a forked state back (a slow delete); judged silent then,
                # they turned a finished replica into a replica-fatal exit and a restart.
                self.watchdog.stop()
            self.ckpt.wait()
            step = int(mgr.state.step)
            # A normal exit is not a death; the finisher's data state lets a replica that
            # arrives after the end complete its ledger (JobFinished below).
            self.client.leave(step, finished=step >= cfg.train.steps, data=mgr.data_state())
            forked = self.roll_back_fork(step)
            if forked is not None:
                return self.end_forked(step, forked[1])
        except JobFinished as e:
            # Restarted (or woken) after the others finished: nothing is left to train,
            # and the replicas that finished hold the result.
            log.warning("replica %s: %s; exiting normally (the replicas that finished hold the job's final state)",
                        self.rid, e)
            me = self.args.replica_id
            if e.data is not None and 0 <= me < len(e.data["positions"]) == len(e.data["last_step"]):
                # Our ledger is made to say what the finished model holds, as at a catch-up's commit:
                # a batch of ours it holds that we never recorded (killed between a commit and its
                # ledger line, restarted too late to rejoin) is recorded, never trained; commits of
                # ours it lacks (fenced, or our last commit succeeded while the peers' failed, and
                # the catch-up that would have rolled them back never committed) are rolled back.
                # A follower's copy of the ledger the same way.
                self.reconcile_ledger(e.data, int(e.step))
            if self.leader and self.watchdog is not None:
                self.watchdog.stop()  # (as after training: the followers finish too)
            self.client.leave(int(mgr.state.step), finished=False)
            self.roll_back_fork(int(mgr.state.step))  # woken after the end with a forked state
            self.metrics.write(kind="job_finished", replica=self.rid, step=int(mgr.state.step),
                               finished_step=e.step)
            self.write_status(final=True, step=int(mgr.state.step), state="job finished")
            self.close()
            return 0
        except Exception as e:  # noqa: BLE001 - every fault leaves with its class's exit code
            c = classify(e)
            code = exit_code(c)
            log.exception("replica %s: %s fault at step %d, exiting with %d: %s", self.rid, c.kind.value,
                          int(mgr.state.step), code, c.reason)
            # Each farewell on its own: one that fails (a lighthouse gone too, a full disk) must not
            # replace the fault's exit code by an uncaught error's 1, which is never restarted.
            if self.watchdog is not None:  # a follower's beats stop now: its leader's watchdog sees it go
                self.watchdog.stop()
            # (a follower does not wait for its leader's leave verdict: its leader may be waiting for it)
            abandon = getattr(self.client, "abandon", None)
            for what, farewell in (
                    ("leave the lighthouse", lambda: abandon(int(mgr.state.step)) if abandon is not None else
                     self.client.leave(int(mgr.state.step), finished=False)),
                    ("write the status", lambda: self.write_status(final=True, step=int(mgr.state.step),
                                                                   state=f"failed ({c.kind.value})", fault=c.reason,
                                                                   exit_code=code)),
                    ("close", self.close)):
                try:
                    farewell()
                except Exception as err:  # noqa: BLE001
                    log.warning("replica %s: could not %s on the way out: %s: %s", self.rid, what,
                                type(err).__name__, err)
            return code
        self.close()
        for d in mgr.detections:
            self.metrics.write(kind="detection", replica=self.rid, **d)
        self.metrics.write(kind="done", replica=self.rid, step=int(mgr.state.step), hash=state_hash(mgr.state),
                           position=mgr.loader.position, positions=mgr.positions.tolist(),
                           compilations={"compute_grads": self.ts.compute_grads._cache_size(),
                                         "apply_grads": self.ts.apply_grads._cache_size()},
                           platform=str(self.mesh.devices.flat[0].platform))
        self.write_status(final=True, step=int(mgr.state.step), state="done")
        log.info("replica %s done at step %d", self.rid, int(mgr.state.step))
        return 0

    def roll_back_fork(self, step: int) -> tuple[int, str] | None:
        """After our Leave: did the lighthouse find our state forked from the job's lineage (a
        quorum we were not in re-decided step ``forked_step`` after our last quorum, and no
        quorum of ours followed that could have fenced us: the job's last steps, or a job
        that finished while we were silent)? Then our commits after ``forked_step`` are not
        in the job's model: they are rolled back in the ledger, and the verdict goes to the
        metrics and the log. Returns ``(forked_step, why)``, or None."""
        from fthsdp.data.ledger import live_commits, read_ledger

        forked = getattr(self.client, "forked", None)
        if forked is None:
            return None
        forked_step, why = forked
        first = max(1, forked_step + 1)
        mine = [c.step for c in live_commits(read_ledger(self.ledger.path)) if c.step >= first]
        if mine:
            self.ledger.rollback(forked_step, first, max(mine))
        log.error("replica %s: %s; our state is discarded (the lineage's replicas hold the job's state)", self.rid, why)
        self.metrics.write(kind="forked", replica=self.rid, step=step, forked_step=forked_step, reason=why,
                           rolled_back=[first, max(mine)] if mine else None)
        self.discard_forked_checkpoints(first, step)
        return forked

    def discard_forked_checkpoints(self, first: int, last: int) -> None:
        """Our persistent checkpoints of the discarded steps ``first``..``last`` hold the forked
        state (we were the lowest healthy replica of our quorum): deleted, so that a restart
        never restores commits our ledger rolled back. The leader alone (one deleter)."""
        if not self.leader:
            return
        try:
            gone = self.ckpt.discard_written_by(self.rid, first, last)
        except Exception as e:  # noqa: BLE001 - the fence must go on; say it loudly
            log.error("could not discard the forked persistent checkpoints of steps %d..%d: %s", first, last, e)
            return
        if gone:
            log.warning("discarded our persistent checkpoint(s) of step(s) %s: they hold the forked state", gone)
            self.metrics.write(kind="checkpoint_discarded", replica=self.rid, steps=gone)

    def end_forked(self, step: int, why: str) -> int:
        """The end of a replica whose final state forked (see :meth:`roll_back_fork`): no
        "done" record claims its state as a final one. Exits 0: the lineage's replicas hold
        the job's final state."""
        self.write_status(final=True, step=step, state="forked (final state discarded)", fault=why)
        self.close()
        return 0

    def close(self) -> None:
        if self.watchdog is not None:
            self.watchdog.stop()  # first: its thread calls the runtime's client, which goes away at exit
        self.client.close()
        close = getattr(self.comm, "close", None)
        if close is not None:
            close()
        self.server.close()
        self.snapshots.close()  # after the server: no lease is taken any more; its copy thread ends
        self.prom_server.close()
        self.ckpt.close()
        self.ledger.close()


def main(argv: list[str] | None = None) -> int:
    from fthsdp.launch.lifetime import die_with_launcher

    die_with_launcher()  # started by `fthsdp run`: never outlive it
    args = parse_args(sys.argv[1:] if argv is None else argv)
    from fthsdp import config as config_lib
    from fthsdp import logs
    from fthsdp.devices import enable_compilation_cache, force_host_devices, place_replica_on_gpus

    from fthsdp.errors import EXIT_JOB_FATAL, EXIT_REPLICA_FATAL

    try:
        cfg = config_lib.load(args.config, args.overrides)
    except (ValueError, OSError) as e:  # a config error: every restart would fail the same way
        print(f"fthsdp replica: {e}", file=sys.stderr)
        return EXIT_JOB_FATAL
    args.job = args.job or cfg.launch.job_id
    if not 0 <= int(args.replica_id) < cfg.launch.replicas:
        # The data positions every replica carries are indexed by replica id: an id past the
        # job's count failed every healthy replica at its first commit with this one.
        print(f"fthsdp replica: --replica-id {args.replica_id} is not one of the job's replicas 0.."
              f"{cfg.launch.replicas - 1} (launch.replicas={cfg.launch.replicas}): number replicas from 0, or "
              "raise launch.replicas on every replica", file=sys.stderr)
        return EXIT_JOB_FATAL
    if args.group.num_processes != cfg.launch.processes_per_replica:
        # The runtime's size is the replica's (--num-processes, the same on each of its processes):
        # the Manager decides some steps by the config's count (a catch-up's flag is set on every
        # process of a replica of several), and a config left at 1 split its processes' decisions.
        import dataclasses

        cfg = dataclasses.replace(cfg, launch=dataclasses.replace(
            cfg.launch, processes_per_replica=args.group.num_processes))
    force_host_devices(cfg.launch.devices_per_replica)  # before jax starts
    place_replica_on_gpus(args.replica_id, cfg.launch.replicas, cfg.launch.devices_per_replica)
    out = pathlib.Path(args.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    logs.setup(f"fthsdp.replica{args.group.label}", file=str(out / f"replica-{args.group.label}.log"))
    enable_compilation_cache()
    from fthsdp.replica.group import initialize

    try:
        initialize(args.group, timeout_s=cfg.ft.startup_timeout_s)  # before any jax computation
    except Exception:  # noqa: BLE001 - the group's coordinator not up in time, a peer process gone: restart it
        log.exception("replica %s: the replica's processes did not form one JAX runtime; exiting with %d (a "
                      "restart of the group tries again)", args.group.label, EXIT_REPLICA_FATAL)
        return EXIT_REPLICA_FATAL
    from fthsdp.errors import classify, exit_code

    try:
        replica = ReplicaProcess(args, cfg, out)
    except Exception as e:  # noqa: BLE001 - a fault while building the replica leaves with its class's code
        c = classify(e)
        code = exit_code(c)
        log.exception("replica %s: %s fault while starting, exiting with %d: %s", args.group.label, c.kind.value,
                      code, c.reason)
        return code
    return replica.run()


if __name__ == "__main__":
    _code = main()
    # Out now, past the interpreter's exit hooks: in a replica of several processes, jax's hook
    # waits at its runtime's shutdown barrier for every other process (300 s by default), and a
    # process that left on its own fault looked alive to its launcher, its group not restarted,
    # for minutes. What must outlive the process is written by now (ledger lines fsync'd, the
    # final status, the checkpoint waited for on a normal end).
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(_code if isinstance(_code, int) else 1)
