"""The reference package's agent app (``avp.transport.create_app``, FastAPI) under a real ASGI server
(hypercorn's asyncio worker) in its own process. Prints the port, then serves until killed.

Its handlers answer what the message held, so a test can see what arrived.
"""

from __future__ import annotations

import asyncio
import socket
import sys
from typing import Any

import numpy as np
from avp.transport import create_app
from hypercorn.asyncio import serve
from hypercorn.config import Config


async def handler(message: Any) -> dict[str, Any]:
    meta = message.metadata
    return {
        "payload_type": meta.payload_type.name,
        "dtype": meta.dtype.name,
        "shape": list(meta.tensor_shape),
        "bytes": len(message.payload),
        "session_id": meta.session_id,
        "sum": float(np.frombuffer(message.payload, dtype="<f4").sum()) if meta.dtype == 0 and not meta.payload_type
        else None,
    }


async def text_handler(message: Any) -> dict[str, Any]:
    return {"content": message.content, "session_id": message.session_id}


def main() -> None:
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    sock.listen(64)
    sock.set_inheritable(True)
    config = Config()
    config.bind = [f"fd://{sock.fileno()}"]
    config.accesslog = None
    print(sock.getsockname()[1], flush=True)
    asyncio.run(serve(create_app(handler, text_handler), config))  # type: ignore[arg-type]


if __name__ == "__main__":
    sys.exit(main())
