"""The loopback TCP ceiling: n processes in a ring, each streaming to its right
neighbour while reading from its left one (n concurrent senders), after warm-up.
Rank 0 writes {"gbps": aggregate bytes per second of all senders / 1e9}."""

from __future__ import annotations

import os
import socket
import sys
import threading
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import common  # noqa: E402

s = common.spec()
rank, n = s["rank"], s["n"]
total, warm = s["bytes"], s["bytes"] // 4
block = memoryview(bytearray(4 << 20))

srv = socket.socket()
srv.bind(("127.0.0.1", 0))
srv.listen(1)
common.publish(s["rdv"], f"lb{rank}", str(srv.getsockname()[1]))
ports = common.gather(s["rdv"], [f"lb{r}" for r in range(n)])
out = socket.create_connection(("127.0.0.1", int(ports[(rank + 1) % n])))
inc, _ = srv.accept()


def send(nbytes):
    left = nbytes
    while left > 0:
        k = min(left, len(block))
        out.sendall(block[:k])
        left -= k


def recv(nbytes):
    buf = bytearray(4 << 20)
    left = nbytes
    while left > 0:
        got = inc.recv_into(buf, min(left, len(buf)))
        if got == 0:
            raise ConnectionError("peer closed")
        left -= got


def both(nbytes):
    t = threading.Thread(target=recv, args=(nbytes,))
    t.start()
    send(nbytes)
    t.join()


both(warm)
t0 = time.perf_counter()
both(total)
secs = time.perf_counter() - t0
common.publish(s["rdv"], f"secs{rank}", str(secs))
all_secs = [float(x) for x in common.gather(s["rdv"], [f"secs{r}" for r in range(n)])]
if rank == 0:
    import json
    import pathlib

    pathlib.Path(s["out"]).write_text(json.dumps({"gbps": n * total / max(all_secs) / 1e9}))
