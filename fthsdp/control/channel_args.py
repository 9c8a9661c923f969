"""The gRPC channel arguments every control-plane client shares: how fast it
reconnects and how long one connection attempt may take.

Three clients open channels to the lighthouse or to a relay: a replica's
:class:`fthsdp.control.lighthouse_client.LighthouseClient`, a relay's one
stream up to the lighthouse (:mod:`fthsdp.control.relay`) and the emulation's
asyncio client. They want the same two things, and gRPC couples them in one
argument, which is why they live here:

* **Reconnect quickly.** gRPC's default backoff between connection attempts
  starts at 1 s and grows to 2 minutes, far past a restarted lighthouse or
  relay. Ours is 0.1 s throughout, so a server restarted on its port is
  found within a tenth of a second of listening again (the clients wait for
  the channel to connect between their own tries, not a fixed backoff:
  ``LighthouseClient._pause``). With a 0.25 s cap the threaded client was
  answered 0.109 s after a restarted lighthouse served (median of 10; max
  0.250 s), with 0.1 s 0.055 s (max 0.099 s), side by side
  (results/reconnect_cap_100ms.json); at 512 x 196 emulated ranks the
  restart's stall was the same either way (1.75 vs 1.74 s: the reconnection
  storm is no worse concentrated). A refused connection (nothing listening
  yet) fails at once and costs nothing to retry: ten a second per process
  while the lighthouse is down.
* **Give a connection time to form.** gRPC takes the *minimum connect timeout*
  (how long one connection attempt may take) from
  ``grpc.min_reconnect_backoff_ms``, default 20 s. It was set to 100 ms beside
  the backoff, which abandoned any attempt to a server too busy to take the
  connection that fast ("failed to connect to all addresses ... tcp handshaker
  shutdown", a call failed ``UNAVAILABLE`` at once). At start-up, when
  hundreds of processes connect at once, that was routine: 512 emulated
  leaders behind one relay resent 76 first requests and 35 of them left the
  live relay for the lighthouse; at 512 x 196 ranks, 379 requests were resent
  behind two relays and 108 with none (README, "Connecting under load").
  :data:`CONNECT_TIMEOUT_S` is that limit now. It never makes a call wait
  longer than its own deadline. What it costs: a host that answers nothing at
  all (down without a reset, its packets dropped) fails a waiting call after
  up to 5 s instead of 0.1 s; the lighthouse client rides that out as any
  outage, within ``ft.lighthouse_outage_s``, and a process leaves a relay that
  answers nothing by its silence (``RelayPath``), not by failed connections.
"""

from __future__ import annotations

__all__ = ["CONNECT_TIMEOUT_S", "RECONNECT_ARGS"]

# How long one connection attempt may take before gRPC abandons it and backs off (see above).
CONNECT_TIMEOUT_S = 5.0

RECONNECT_ARGS: tuple[tuple[str, int], ...] = (
    ("grpc.initial_reconnect_backoff_ms", 100),
    ("grpc.max_reconnect_backoff_ms", 100),
    # gRPC's name for the minimum connect timeout, not a backoff (see the module docstring).
    ("grpc.min_reconnect_backoff_ms", int(CONNECT_TIMEOUT_S * 1000)),
)


# A server argument, for the lighthouse and the relay. gRPC binds with SO_REUSEPORT by default: a
# second lighthouse (or relay) on a port in use bound it too, and the kernel split new connections
# between the two, each deciding its own quorums with the same ids (a split brain). Off, the
# second one's bind fails ("is the port in use?"); a restart on a dead one's port still binds
# (SO_REUSEADDR stays on).
NO_REUSEPORT = ("grpc.so_reuseport", 0)
