"""OpenMPI through mpi4py: MPI_Allreduce in place (started by mpirun; rank from MPI)."""

from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import common  # noqa: E402

s = common.spec()
import numpy as np  # noqa: E402
from mpi4py import MPI  # noqa: E402

comm = MPI.COMM_WORLD
s["rank"] = comm.Get_rank()


def op(a):
    comm.Allreduce(MPI.IN_PLACE, a, op=MPI.SUM)
    return a


times = common.timed(op, s["sizes"], s["iters"], s["warmup"],
                     lambda nbytes: np.ones(nbytes // 4, np.float32))
common.write(s, times)
