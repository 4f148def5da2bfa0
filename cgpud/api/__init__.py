"""cgpud's local gRPC API (proto/cgpu/v1/local.proto): the generated modules
(cgpud.api.cgpu.v1.local_pb2, _pb2_grpc; made at build time, never
committed), the model <-> protobuf mapping (convert) and the server (server).
The client lives in cgpud.cli.client."""

from __future__ import annotations

from pathlib import Path

# Where cgpud listens and cgpuctl connects unless told otherwise. The
# directory is root-only (0700), which is what keeps other users out.
DEFAULT_SOCKET = Path("/run/cgpud/cgpud.sock")

# What the admin socket's door (api/gate.py) sends before the one line it
# gives a peer it turns away; cgpuctl reads it to say why.
REFUSAL_PREFIX = b"cgpud: "
