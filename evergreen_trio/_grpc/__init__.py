"""gRPC on Trio alone: the server (`server`, the shell over the sans-IO `server_wire`) for sessions, the
picker's ext_proc, health and reflection; the session client (`client` over the sans-IO `client_wire`)."""
