"""One process of one of two replicas of 2 processes: per-shard recovery over real peer servers.

Replica 0 (seed 0) snapshots only this process's own shards and serves them from
its peer server; replica 1 (seed 1, a different state) fetches, from the matching
process of replica 0 only, its own shards, puts them on its devices and hashes the
whole state (a collective of its replica). Files in a shared folder stand in for
the lighthouse's sources. Writes what it saw as JSON (tests/test_replica_group.py).
"""

import json
import pathlib
import sys
import time

from fthsdp.devices import force_host_devices

out_path, replica, index, coordinator, shared = (sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4],
                                                  pathlib.Path(sys.argv[5]))
force_host_devices(1)

from fthsdp import config as config_lib  # noqa: E402
from fthsdp.replica import group as replica_group  # noqa: E402

spec = replica_group.GroupSpec(replica_id=replica, process_index=index, num_processes=2, coordinator=coordinator)
replica_group.initialize(spec, timeout_s=120)

import jax  # noqa: E402

from fthsdp.checkpoint import local_shards, orbax_peer  # noqa: E402
from fthsdp.checkpoint.peer_server import PeerServer, peer_key  # noqa: E402
from fthsdp.checkpoint.snapshot import Snapshotter  # noqa: E402
from fthsdp.step.functional import make_train_step, state_hash  # noqa: E402
from fthsdp.step.quorum_inputs import local_allreduce  # noqa: E402
from fthsdp.step.sharding import replica_mesh  # noqa: E402

TINY = ["model.d_model=32", "model.num_layers=1", "model.num_heads=2", "model.max_seq_len=16",
        "data.seq_len=16", "data.batch_size=8", "data.corpus_bytes=65536", "train.eval_every=0"]
cfg = config_lib.load("base", TINY + ["launch.devices_per_replica=1"])
ts = make_train_step(cfg, replica_mesh(1), allreduce=local_allreduce)
state = ts.init(replica)  # the two replicas start from different states
abstract = jax.tree.map(lambda x, sh: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sh), state, ts.state_shardings)
key = peer_key(b"per-shard-recovery-test-job-key!")
res = {"replica": replica, "process": index, "hash": state_hash(state),
       "state_bytes": local_shards.parts_bytes(abstract)}
url_file, done_file = shared / f"url-{index}", shared / f"done-{index}"
if replica == 0:
    snaps = Snapshotter()
    snaps.take(5, {"train": local_shards.local_parts(state), "data": {"positions": [0, 0]}})
    server = PeerServer(snaps, key).start()
    url_file.write_text(server.url)
    deadline = time.monotonic() + 240
    while not done_file.exists() and time.monotonic() < deadline:
        time.sleep(0.05)
    res["served"] = server.stats
    res["url"] = server.url
    server.close()
    snaps.close()
else:
    deadline = time.monotonic() + 240
    while not url_file.exists() and time.monotonic() < deadline:
        time.sleep(0.05)
    source = url_file.read_text()
    like = {"train": local_shards.local_like(abstract), "data": {"positions": [0, 0]}}
    tree, info = orbax_peer.restore(like, [source], key, 5, timeout_s=60)
    fetched = local_shards.assemble(tree["train"], abstract)
    res["fetched_hash"] = state_hash(fetched)  # a collective of replica 1: both processes reach it
    res["fetched_bytes"] = int(info.detail["bytes"])
    res["source"] = source
    done_file.write_text("1")
with open(out_path, "w") as f:
    json.dump(res, f)
# the leader waits for its follower before tearing the coordinator down
ch = replica_group.DecisionChannel(spec)
ch.gather("bye", 1, 60)
if spec.is_leader:
    time.sleep(0.5)
