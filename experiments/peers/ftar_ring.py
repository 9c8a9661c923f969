"""The FTAR ring both FTAR peers time (CPU, and one device of a chosen platform):
a communicator, the rendezvous of its address, a configured quorum of every
peer, and the jitted all-reduce with donated buffers and the status checked
on every call. Python 3.12 only (jax); common.py stays stdlib + numpy."""

from __future__ import annotations

import jax
import numpy as np

import common
from fthsdp.collective import ftar
from fthsdp.step.quorum_inputs import make_quorum_inputs


def ring_op(s: dict, mesh):
    """(communicator, op): op(buf) all-reduces the pytree ``buf`` over every peer of spec ``s``."""
    rank, n = s["rank"], s["n"]
    comm = ftar.Communicator(streams=s.get("streams", 2), chunk_bytes=s.get("chunk_bytes", 1 << 20),
                             chunks=s.get("chunks", 4), timeout_s=120.0, key=bytes.fromhex(s.get("key", "")))
    common.publish(s["rdv"], f"addr{rank}", comm.address)
    members = common.gather(s["rdv"], [f"addr{r}" for r in range(n)])
    res = comm.configure("bench", 1, rank, members, timeout_s=60.0)
    assert res, res.reason
    q = make_quorum_inputs(num_contributing=n, num_members=n, num_configured=n, rank=rank, quorum_id=1,
                           comm=comm.handle)
    step = jax.jit(lambda g, q: ftar.allreduce(g, q, mesh), donate_argnums=0)

    def op(buf):
        out, status = step(buf, q)
        jax.block_until_ready(out)
        assert int(np.asarray(status)[0]) == 0, comm.stats()
        return out

    return comm, op
