"""One replica process: `python -m fthsdp.replica --replica-id R --lighthouse HOST:PORT ...`.

The launcher (fthsdp/launch/local.py, Ray) starts one of these per replica.
It builds the replica's mesh, FTAR communicator and step, connects to the
lighthouse, and runs the Manager. Every committed step it appends a JSON line
to `metrics-R.jsonl` and rewrites `status-R.json` atomically, which is what
the launcher's live status line and the tests read.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import pathlib
import secrets
import sys
import time

log = logging.getLogger("fthsdp.replica")


def write_json_atomic(path: pathlib.Path, obj: dict) -> None:
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(json.dumps(obj))
    os.replace(tmp, path)


def parse_args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m fthsdp.replica", description=__doc__.split("\n")[0])
    p.add_argument("--config", default="base")
    p.add_argument("--replica-id", required=True, type=int)
    p.add_argument("--lighthouse", required=True, help="HOST:PORT of `fthsdp lighthouse`")
    p.add_argument("--job", default="fthsdp")
    p.add_argument("--out-dir", required=True)
    p.add_argument("--allreduce", choices=("ftar", "local"), default="ftar",
                   help="local = identity (a job of one replica, no FTAR)")
    p.add_argument("--hash-every", type=int, default=1, help="record a state hash every N committed steps (0: never)")
    p.add_argument("--rejoin", action="store_true",
                   help="this replica was restarted alone: join the running quorum without the start-up barrier")
    p.add_argument("--resume", default="", metavar="RESTART_ID",
                   help="full restart: resume from the latest persistent checkpoint and its loader positions; "
                        "RESTART_ID names this restart in the exactly-once ledgers")
    p.add_argument("overrides", nargs="*")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    from fthsdp import config as config_lib
    from fthsdp import logs
    from fthsdp.devices import enable_compilation_cache, force_host_devices

    cfg = config_lib.load(args.config, args.overrides)
    force_host_devices(cfg.launch.devices_per_replica)
    out = pathlib.Path(args.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    rid = str(args.replica_id)
    logs.setup(f"fthsdp.replica{rid}", file=str(out / f"replica-{rid}.log"))
    enable_compilation_cache()

    import jax
    import numpy as np

    from fthsdp.checkpoint import orbax_peer
    from fthsdp.checkpoint.peer_server import PeerServer
    from fthsdp.checkpoint.persistent import PersistentCheckpointer
    from fthsdp.checkpoint.snapshot import Snapshotter
    from fthsdp.data import LoaderState
    from fthsdp.data.ledger import Commit, Ledger, Restore, read_ledger
    from fthsdp.data.loader_state import LoaderStateStore
    from fthsdp.lighthouse_client import LighthouseClient
    from fthsdp.manager import Manager, ManagerError, StepRecord, state_hash
    from fthsdp.quorum_inputs import local_allreduce
    from fthsdp.sharding import replica_mesh
    from fthsdp.step import make_train_step

    mesh = replica_mesh(cfg.launch.devices_per_replica)
    if args.allreduce == "ftar":
        from fthsdp import ftar

        comm = ftar.Communicator(num_shards=mesh.devices.size, streams=cfg.ft.streams_per_peer,
                                 timeout_s=cfg.ft.allreduce_timeout_s)
        allreduce = ftar.allreduce
    else:
        from fthsdp.manager import SoloCommunicator

        comm, allreduce = SoloCommunicator(), local_allreduce
    ts = make_train_step(cfg, mesh, allreduce=allreduce)
    state = ts.init(cfg.train.seed)
    loader = LoaderState(replica=args.replica_id)

    token = os.environ.get("FTHSDP_PEER_TOKEN", "")
    if not token:
        if cfg.launch.replicas > 1:
            raise SystemExit("FTHSDP_PEER_TOKEN is not set: every replica of a job needs the same shared secret "
                             "to serve and fetch state (fthsdp run sets it)")
        token = secrets.token_hex(16)
    snapshots = Snapshotter()
    server = PeerServer(snapshots, token,
                        max_bytes_per_s=cfg.ft.peer_serve_cap_gbps * 1e9 if cfg.ft.peer_serve_cap_gbps > 0 else None).start()
    ckpt = PersistentCheckpointer(out / "checkpoints", every=cfg.ft.checkpoint_every)
    ledger = Ledger(out / "ledger" / f"replica_{rid}.jsonl", args.replica_id)
    loader_store = LoaderStateStore(out / "loader_state")
    loader_store.clean_temporaries()

    abstract = jax.tree.map(lambda x, sh: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sh),
                            state, ts.state_shardings)

    def recover(q, step):
        """The healthy replicas' state at `step`: assigned sources first, then any healthy peer."""
        me = rid
        assigned = [q.member(src).state_server_address for src in q.sources_for(me)]
        others = [q.member(h).state_server_address for h in q.healthy]
        tries = [list(dict.fromkeys(a for a in assigned if a))]
        tries.append([a for a in dict.fromkeys(others) if a and a not in tries[0]] + tries[0])
        like = {"train": abstract, "data": mgr.data_state()}
        last = None
        deadline = time.monotonic() + cfg.ft.allreduce_timeout_s
        while True:
            for sources in tries:
                if not sources:
                    continue
                try:
                    tree, info = orbax_peer.restore(like, sources, token, step, timeout_s=cfg.ft.allreduce_timeout_s,
                                                    streams_per_source=cfg.ft.peer_streams)
                    log.info("fetched state of step %d from %s: %s", step, sources, info.detail)
                    backfill_ledger(tree["data"])
                    return tree["train"], tree["data"]
                except Exception as e:  # noqa: BLE001 - every failure falls through to the next set of sources
                    last = e
            # With on-demand snapshots the peers start copying when they see the
            # same quorum we do: a source may not serve this step for a few ms yet.
            if time.monotonic() > deadline:
                break
            time.sleep(0.05)
        raise ManagerError(f"could not fetch the state of step {step} from any healthy peer: {last}")

    def backfill_ledger(data: dict) -> None:
        """Record our batch that the peers' model contains but our ledger lacks.

        That happens when the all-reduce of a step completed on the peers but not
        here (we died, or failed the commit vote, right after contributing): the
        replicated positions say the batch is in the model, so it is recorded now,
        at the step that trained it (last_step), not trained again.
        """
        me = args.replica_id
        pos, last = int(data["positions"][me]), int(data["last_step"][me])
        if pos == 0 or last < 0:
            return
        contents = read_ledger(ledger.path)
        restores = [r for r in contents.records if isinstance(r, Restore)]
        cut = max(restores, key=lambda r: r.t_ns) if restores else None
        live = {c.position for c in contents.records if isinstance(c, Commit)
                and (cut is None or c.t_ns > cut.t_ns or c.step <= cut.step)}
        if pos - 1 not in live:
            ledger.commit(last + 1, pos - 1)
            log.info("ledger: batch %d was committed by the peers at step %d before we recorded it", pos - 1, last + 1)

    metrics = logs.MetricsWriter(out / f"metrics-{rid}.jsonl")
    status_path = out / f"status-{rid}.json"
    started = time.time()

    snapshot_of = {"step": -1}

    def snapshot(mgr: Manager) -> None:
        """Start the lazy host copy of the committed state (lands while the step computes)."""
        step = int(mgr.state.step)
        if snapshot_of["step"] != step:
            snapshots.begin(step, {"train": mgr.state, "data": mgr.data_state()})
            snapshot_of["step"] = step

    def on_quorum(mgr: Manager, q) -> None:
        if cfg.ft.snapshot == "on_demand" and q.behind and rid in q.healthy:
            snapshot(mgr)

    def on_commit(mgr: Manager, rec: StepRecord) -> None:
        committed = rec.step + 1
        if cfg.ft.snapshot == "every_commit":
            snapshot(mgr)
        if rec.healthy:
            ledger.commit(committed, rec.position)
        loader_store.save(mgr.loader, committed)
        if ckpt.should_save(committed) and rid == min(mgr.quorum.healthy, key=int):
            try:
                ckpt.save(committed, mgr.state, {i: int(p) for i, p in enumerate(mgr.positions)},
                          metadata={"writer": rid, "quorum_id": rec.quorum_id})
            except Exception as e:  # noqa: BLE001 - a failed checkpoint must not stop training; say it loudly
                log.error("persistent checkpoint of step %d failed: %s", committed, e)
        record = {"kind": "step", "replica": rid, "step": rec.step, "quorum_id": rec.quorum_id,
                  "members": list(rec.members), "healthy": rec.healthy, "attempts": rec.attempts,
                  "loss": rec.loss, "start": rec.start, "end": rec.end, "position": rec.position,
                  "events": rec.events, "pid": os.getpid(), "rebuild_s": rec.rebuild_s,
                  "allreduce_s": rec.allreduce_s, "grads_s": rec.grads_s}
        if args.hash_every and committed % args.hash_every == 0:
            record["hash"] = state_hash(mgr.state)
        metrics.write(**record)
        write_json_atomic(status_path, {"replica": rid, "step": committed, "loss": rec.loss,
                                        "quorum_id": rec.quorum_id, "members": list(rec.members),
                                        "state": "training" if rec.healthy else "caught up",
                                        "pid": os.getpid(), "time": time.time(), "started": started})

    client = LighthouseClient(args.lighthouse, args.job, rid, heartbeat_interval_s=cfg.ft.heartbeat_interval_s)
    mgr = Manager(cfg=cfg, replica_id=rid, job_id=args.job, ts=ts, comm=comm, lighthouse=client,
                  state=state, loader=loader, recover=recover, state_server_address=server.url,
                  on_commit=on_commit, on_quorum=on_quorum, rejoin=args.rejoin)
    if args.resume:
        if ckpt.latest_step() is None:
            # killed before its first durable checkpoint: the whole job starts over
            ledger.restore(0, args.resume)
            log.warning("replica %s: --resume but no finished checkpoint under %s; starting from step 0",
                        rid, out / "checkpoints")
        else:
            restored = ckpt.restore(abstract)
            mgr.state = restored.state
            mgr.install_data_state({
                "positions": np.array([restored.loader_positions.get(i, 0) for i in range(len(mgr.positions))]),
                "last_step": np.full(len(mgr.positions), -1)})
            ledger.restore(restored.step, args.resume)
            log.info("replica %s: resumed from the persistent checkpoint of step %d, stream position %d",
                     rid, restored.step, mgr.loader.position)
    log.info("replica %s: %d device(s), lighthouse %s, ftar endpoints %s, state server %s", rid,
             mesh.devices.size, args.lighthouse, list(comm.addresses), server.url)
    log.info("replica %s: compiled the step in %.1fs (before checking in)", rid, mgr.warm_up())
    if cfg.ft.snapshot == "every_commit":
        snapshot(mgr)
    client.start_heartbeats(on_dead=mgr.on_dead)
    if cfg.launch.replicas > 1 and not args.rejoin:  # a job's (re)start: begin together
        live = mgr.wait_for_peers(client.status, cfg.launch.replicas, cfg.ft.startup_timeout_s)
        log.info("replica %s: %d replica(s) live, starting", rid, live)
    try:
        mgr.run(cfg.train.steps)
        ckpt.wait()
    finally:
        client.close()
        close = getattr(comm, "close", None)
        if close is not None:
            close()
        server.close()
        ckpt.close()
        ledger.close()
    for d in mgr.detections:
        metrics.write(kind="detection", replica=rid, **d)
    metrics.write(kind="done", replica=rid, step=int(mgr.state.step), hash=state_hash(mgr.state),
                  position=mgr.loader.position, positions=mgr.positions.tolist(),
                  compilations={"compute_grads": ts.compute_grads._cache_size(),
                                "apply_grads": ts.apply_grads._cache_size()})
    write_json_atomic(status_path, {"replica": rid, "step": int(mgr.state.step), "state": "done",
                                    "pid": os.getpid(), "time": time.time(), "started": started})
    log.info("replica %s done at step %d", rid, int(mgr.state.step))
    return 0


if __name__ == "__main__":
    sys.exit(main())
