"""fthsdp: fault-tolerant hybrid-sharded data-parallel training for JAX/XLA.

The data-parallel replica is the unit of fault tolerance: when one replica
dies, only it leaves; the survivors keep training on a new quorum and the
replica rejoins later by fetching live state from a healthy peer.
"""

__version__ = "0.1.0"
