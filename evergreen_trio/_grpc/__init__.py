"""gRPC for sessions: the server on grpclib through trio-asyncio (`bridge`, the package's only asyncio
code); the client on Trio alone (`client` over the sans-IO `client_wire`)."""
