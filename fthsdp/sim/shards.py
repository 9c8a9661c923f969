"""EMULATION ONLY. The emulated replicas split over several emulator processes.

One emulator process runs every replica leader's gRPC client: it writes each
leader's request and reads each answer in turn, ~0.1-0.2 ms of its one core per
leader per round at 512 leaders (``emulator_cpu_s_per_round`` in
experiments/scale.py). Real leaders are hosts of their own, each reading its one
answer in parallel with the others. On a host with cores to spare, a measurement
of the lighthouse then sees the emulator's serial reads, not the lighthouse.
With ``EmulationConfig.emulator_processes = K`` the coordinating
:class:`fthsdp.sim.emulation.Emulation` runs the lighthouse and the relays as
always, and K worker processes each run a contiguous block of the replicas
(their own :class:`Emulation` over that block, its replicas speaking to the same
lighthouse through the same relays).

What the replicas of one process share in memory, processes share through their
coordinator, over one pipe each:

* a **rendezvous** of the mock all-reduce (fthsdp.sim.mock_plane) whose members in
  one process have all entered is announced with their count; once the counts of
  every process add up to its members, every process starts its rings;
* a **round barrier** (measurement mode) holds until every process's replicas are in;
* every process starts its replicas when all are ready (spawned and imported),
  so that none asks for the first quorum seconds before the others;
* at the end each sends what it recorded (quorum round trips, commits, data
  lineages, waits, events, problems, CPU), and the coordinator's report checks
  the invariants over all of them, as for one process (a commit of one step and
  quorum from different states in two processes is a split brain, as in one).

Fault-free runs only (EmulationConfig refuses faults with K > 1): a kill, a hang
or an abort reaches the all-reduces of replicas in other processes, and the
lighthouse and relay faults are timed by replica 0. Timestamps are
``time.perf_counter`` (CLOCK_MONOTONIC on Linux), one clock for every process.
"""

from __future__ import annotations

import asyncio
import collections
import socket
import subprocess
import sys
import time
import traceback
from dataclasses import dataclass
from multiprocessing.connection import Connection
from typing import TYPE_CHECKING

from fthsdp.gc_policy import low_pause_gc

if TYPE_CHECKING:
    from fthsdp.sim.emulation import DataState, Emulation

__all__ = ["ShardSpec", "Peers", "blocks", "pack_states", "unpack_states", "run_shards"]

READY_S = 120.0  # spawning and importing K processes on a loaded host
REPORT_SLACK_S = 120.0  # past a shard's own run deadline, for its report to arrive


@dataclass(frozen=True)
class ShardSpec:
    """One emulator process's share: replicas ``first`` .. ``end - 1``, and where the servers are."""

    index: int
    first: int
    end: int
    lighthouse: str
    relays: tuple[str, ...]
    # whose CPU this shard samples each round (the first shard: the relays and the lighthouse)
    relay_pids: tuple[int, ...] = ()
    lighthouse_pid: int = 0


def blocks(replicas: int, processes: int) -> list[range]:
    """``replicas`` in ``processes`` contiguous blocks, sizes differing by at most one."""
    if not 1 <= processes <= replicas:
        raise ValueError(f"processes {processes} must be in 1..replicas ({replicas})")
    q, r = divmod(replicas, processes)
    out, first = [], 0
    for k in range(processes):
        end = first + q + (1 if k < r else 0)
        out.append(range(first, end))
        first = end
    return out


def pack_states(states: "dict[str, DataState]") -> tuple[list[tuple], dict[str, int]]:
    """Replicas' data states as plain rows (each commit once, however many replicas share it):
    ``(rows, replica -> row)``, a row ``(parent row or -1, positions, step, quorum id, batches)``."""
    rows: list[tuple] = []
    index: dict[int, int] = {}

    def add(state: "DataState") -> int:
        chain, s = [], state
        while s is not None and id(s) not in index:
            chain.append(s)
            s = s.parent
        for x in reversed(chain):  # oldest first: every parent has its row before its children
            index[id(x)] = len(rows)
            rows.append((-1 if x.parent is None else index[id(x.parent)], x.positions, x.step, x.quorum_id,
                         x.batches))
        return index[id(state)]

    return rows, {rid: add(s) for rid, s in states.items()}


def unpack_states(rows: list[tuple], of: dict[str, int]) -> "dict[str, DataState]":
    """The inverse of :func:`pack_states`."""
    from fthsdp.sim.emulation import DataState

    built: list[DataState] = []
    for parent, positions, step, quorum_id, batches in rows:
        built.append(DataState(positions, built[parent] if parent >= 0 else None, step, quorum_id, batches))
    return {rid: built[i] for rid, i in of.items()}


class Peers:
    """A shard's side of the pipe to its coordinator: announces what its replicas reached and
    releases the barriers and rendezvous that every process's replicas reached."""

    def __init__(self, conn, spec: ShardSpec, emu: "Emulation") -> None:
        self.conn = conn
        self.first, self.end = spec.first, spec.end
        self.emu = emu
        self.go: asyncio.Future | None = None  # set when the coordinator says every shard is ready

    def is_local(self, replica_id: str) -> bool:
        return self.first <= int(replica_id) < self.end

    def arrive(self, kind: str, key: tuple[int, int], count: int, total: int = 0) -> None:
        """``count`` of the ``total`` needed for ``kind`` (``barrier`` or ``fabric``) ``key`` are in here
        (a barrier's total is every shard still running, which only the coordinator knows)."""
        self.conn.send(("arrive", kind, key, count, total))

    def readable(self) -> None:
        try:
            while self.conn.poll():
                self._on(self.conn.recv())
        except (EOFError, OSError):  # the coordinator is gone: waits end at their own deadlines
            asyncio.get_running_loop().remove_reader(self.conn.fileno())

    def _on(self, msg: tuple) -> None:
        if msg[0] in ("go", "abort"):
            if self.go is not None and not self.go.done():
                if msg[0] == "go":
                    self.go.set_result(None)
                else:
                    self.go.set_exception(RuntimeError("another emulator process failed before the start"))
        elif msg[0] == "release":
            _, kind, key = msg
            if kind == "barrier":
                self.emu.barrier_released(key)
            else:
                self.emu.fabric.release(key)


async def _serve_shard(emu: "Emulation", peers: Peers, conn, index: int) -> dict:
    loop = asyncio.get_running_loop()
    peers.go = loop.create_future()
    loop.add_reader(conn.fileno(), peers.readable)
    conn.send(("ready", index))
    await asyncio.wait_for(peers.go, READY_S)
    t0, cpu0 = time.perf_counter(), time.process_time()
    await emu.run_replicas()
    loop.remove_reader(conn.fileno())
    return emu.shard_state(time.process_time() - cpu0, time.perf_counter() - t0)


def shard_main(fd: int) -> None:
    """A worker process (``python -m fthsdp.sim.shards FD``): read its config and share from the
    connection on ``fd``, run replicas ``spec.first`` .. ``spec.end - 1``, send back what they did."""
    from fthsdp.sim.emulation import Emulation

    conn = Connection(fd)
    try:
        config, spec = conn.recv()
        emu = Emulation(config, shard=spec)
        peers = Peers(conn, spec, emu)
        emu.peers = emu.fabric.peers = peers
        with low_pause_gc():  # as the one-process emulation (fthsdp.gc_policy)
            state = asyncio.run(_serve_shard(emu, peers, conn, spec.index))
        conn.send(("report", state))
    except BaseException as e:  # noqa: BLE001 - whatever ended it, the coordinator must hear why
        try:
            conn.send(("failed", f"{type(e).__name__}: {e}\n{traceback.format_exc()[-2000:]}"))
        except OSError:
            pass
    finally:
        conn.close()


async def run_shards(emu: "Emulation") -> None:
    """Run ``emu.config.emulator_processes`` shards of ``emu``'s replicas against its lighthouse
    and relays (started already), coordinate them, and merge what they did into ``emu``."""
    c = emu.config
    loop = asyncio.get_running_loop()
    relays = tuple(r.address for r in emu.relays)
    pids = tuple(r.proc.pid for r in emu.relays if r.proc is not None)
    lighthouse = emu.lighthouse.proc.pid if emu.lighthouse.proc is not None else 0
    specs = [ShardSpec(k, b.start, b.stop, emu.lighthouse.address, relays, relay_pids=pids if k == 0 else (),
                       lighthouse_pid=lighthouse if k == 0 else 0)
             for k, b in enumerate(blocks(c.replicas, c.emulator_processes))]
    conns: list[Connection] = []
    procs: list[subprocess.Popen] = []
    for spec in specs:
        # A fresh interpreter (not a fork: no gRPC state of this process, and not multiprocessing's
        # spawn, which imports the caller's main module again), its config sent over a socket pair.
        mine, theirs = socket.socketpair()
        procs.append(subprocess.Popen([sys.executable, "-m", "fthsdp.sim.shards", str(theirs.fileno())],
                                      pass_fds=(theirs.fileno(),)))
        theirs.close()
        conns.append(Connection(mine.detach()))
        conns[-1].send((c, spec))
    ready: set[int] = set()
    counts: collections.Counter = collections.Counter()
    results: dict[int, dict] = {}
    ended: set[int] = set()
    all_ended = loop.create_future()

    def send_all(msg: tuple) -> None:
        for k, cn in enumerate(conns):
            if k not in ended:
                try:
                    cn.send(msg)
                except OSError:
                    pass  # it ended; its reader says how

    def needed(kind: str, total: int) -> int:
        # A round barrier waits for every shard still running (one that ended runs no replica).
        return len(conns) - len(ended) if kind == "barrier" else total

    def end(k: int, problem: str = "") -> None:
        if k in ended:
            return
        ended.add(k)
        loop.remove_reader(conns[k].fileno())
        for kind, key in [x for x in counts if x[0] == "barrier" and counts[x] >= needed("barrier", 0)]:
            del counts[(kind, key)]
            send_all(("release", kind, key))
        if problem:
            emu.problems.append(f"emulator process {k} (replicas {specs[k].first}..{specs[k].end - 1}): {problem}")
            if len(ready) < len(conns):  # the others wait for a start that will not come
                send_all(("abort",))
        if len(ended) == len(conns) and not all_ended.done():
            all_ended.set_result(None)

    def readable(k: int) -> None:
        cn = conns[k]
        try:
            while k not in ended and cn.poll():
                msg = cn.recv()
                if msg[0] == "arrive":
                    _, kind, key, count, total = msg
                    counts[(kind, key)] += count
                    if counts[(kind, key)] >= needed(kind, total):
                        del counts[(kind, key)]
                        send_all(("release", kind, key))
                elif msg[0] == "ready":
                    ready.add(k)
                    if len(ready) == len(conns):
                        send_all(("go",))
                elif msg[0] == "report":
                    results[k] = msg[1]
                    end(k)
                else:
                    end(k, f"failed: {msg[1]}")
        except (EOFError, OSError):
            try:
                code = procs[k].wait(1)  # gone (its socket closed): reaped at once, or said to be unknown
            except subprocess.TimeoutExpired:
                code = None
            end(k, f"ended without its report (exit code {code}; its error went to stderr)")

    for k, cn in enumerate(conns):
        loop.add_reader(cn.fileno(), readable, k)
    try:
        await asyncio.wait_for(asyncio.shield(all_ended), READY_S + c.run_timeout_s + REPORT_SLACK_S)
    except TimeoutError:
        for k in range(len(conns)):
            end(k, "sent no report in time")
    finally:
        for k in range(len(conns)):
            end(k)
        for p in procs:
            try:
                await asyncio.to_thread(p.wait, 10)
            except subprocess.TimeoutExpired:
                p.kill()
                await asyncio.to_thread(p.wait, 10)
        for cn in conns:
            cn.close()
    for k in sorted(results):
        emu.absorb(results[k])


if __name__ == "__main__":
    shard_main(int(sys.argv[1]))
