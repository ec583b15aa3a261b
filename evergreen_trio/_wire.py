"""What both ends of an Evergreen session agree on, below the server and the client."""

from __future__ import annotations

START_SESSION = "/evergreen.v2.EvergreenService/StartSession"
"""The gRPC method of ``evergreen.v2.EvergreenService.StartSession`` (bidirectional streaming)."""
