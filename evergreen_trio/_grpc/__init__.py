"""gRPC over grpclib, run on Trio through trio-asyncio. `bridge` holds the package's only asyncio code."""
