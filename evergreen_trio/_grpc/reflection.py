"""gRPC server reflection (``grpc.reflection.v1`` and ``v1alpha``) for servers on the bridge.

grpclib's reflection services answer from protobuf's default descriptor pool, where the generated
modules register their files: importing ``evergreen_service_pb2`` here puts the Evergreen service
there, so ``grpcurl list`` and ``describe`` work against the serving port.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from grpclib.reflection.service import ServerReflection

from evergreen_trio._proto.evergreen.v2 import evergreen_service_pb2

SERVICE_FILE = evergreen_service_pb2.DESCRIPTOR.name
"""The .proto file that declares ``evergreen.v2.EvergreenService``, as reflection names it."""


def with_reflection(servables: Sequence[Any]) -> list[Any]:
    """``servables`` and the reflection services (v1, v1alpha) that list them and serve their files."""
    return list(ServerReflection.extend(servables))
