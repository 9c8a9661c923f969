"""Generated gRPC/protobuf stubs (built by CMake from the .proto files here).

grpc_tools emits ``import lighthouse_pb2`` (a top-level name) inside
``lighthouse_pb2_grpc``; :func:`lighthouse` aliases that name to the packaged
module before importing the service stubs, so no generated file is edited.
"""

from __future__ import annotations

import importlib
import sys
from types import ModuleType


def lighthouse() -> tuple[ModuleType, ModuleType]:
    """Return ``(lighthouse_pb2, lighthouse_pb2_grpc)``, with a clear error if unbuilt."""
    try:
        pb2 = importlib.import_module("fthsdp.proto.lighthouse_pb2")
        # Alias only while the service stubs import (they bind the name then),
        # so an unrelated top-level `lighthouse_pb2` elsewhere is left alone.
        previous = sys.modules.get("lighthouse_pb2")
        sys.modules["lighthouse_pb2"] = pb2
        try:
            pb2_grpc = importlib.import_module("fthsdp.proto.lighthouse_pb2_grpc")
        finally:
            if previous is None:
                del sys.modules["lighthouse_pb2"]
            else:
                sys.modules["lighthouse_pb2"] = previous
    except ImportError as e:  # pragma: no cover - depends on the install
        raise ImportError(
            "fthsdp's gRPC stubs are missing (they are generated at build time): run "
            "`pip install --no-build-isolation -e .` in the repository root"
        ) from e
    return pb2, pb2_grpc


# Bumped on any incompatible change to lighthouse.proto; both sides check it.
# 2: (replica, process) heartbeats and views (an answer carries the asker's
# shards' rings, not every endpoint; QuorumRequest.ftar_addresses are the
# asking process's own shards).
LIGHTHOUSE_PROTOCOL_VERSION = 2

# The start of the details of a lighthouse's FAILED_PRECONDITION refusal of a quorum
# request that left its endpoints out (QuorumRequest.endpoints_held) when the
# lighthouse does not hold them: the client sends them again at once.
ENDPOINTS_NOT_HELD = "this lighthouse does not hold the endpoints the request left out"
