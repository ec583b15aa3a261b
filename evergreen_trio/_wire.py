"""What both ends of an Evergreen session agree on, below the server and the client."""

from __future__ import annotations

SERVICE = "evergreen.v2.EvergreenService"
"""The gRPC service (also the name health checks ask about)."""

START_SESSION = f"/{SERVICE}/StartSession"
"""The gRPC method of ``evergreen.v2.EvergreenService.StartSession`` (bidirectional streaming)."""
