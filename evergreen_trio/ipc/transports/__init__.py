"""Trio transports of the Dissociated IPC Protocol: UCX, TCP and shared memory."""
