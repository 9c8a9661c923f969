"""Control plane: the lighthouse (gRPC quorum service), its client, and the pure quorum decision."""
