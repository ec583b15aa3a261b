"""TLS contexts for Evergreen servers and clients: TLS 1.2 or later, ALPN ``h2`` (gRPC needs it).

>>> server_tls = server_context("server.pem", "server.key", client_ca_file="clients-ca.pem")  # mTLS
>>> client_tls = client_context(ca_file="ca.pem", cert_file="client.pem", key_file="client.key")

Both raise ``OSError`` (missing file) or ``ssl.SSLError`` (a file that is not PEM, a key that does
not match its certificate) at once, so a misconfigured server fails at start, not at the first call.
"""

from __future__ import annotations

import ssl

ALPN = ["h2"]
"""The ALPN protocols offered: gRPC is HTTP/2 only (grpcio refuses TLS without ``h2``)."""


def server_context(cert_file: str, key_file: str, *, client_ca_file: str | None = None) -> ssl.SSLContext:
    """A server context; with ``client_ca_file``, clients must show a certificate signed by that CA (mTLS)."""
    context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    context.minimum_version = ssl.TLSVersion.TLSv1_2
    context.load_cert_chain(cert_file, key_file)
    context.set_alpn_protocols(ALPN)
    if client_ca_file is not None:
        context.load_verify_locations(client_ca_file)
        context.verify_mode = ssl.CERT_REQUIRED
    return context


def client_context(
    *, ca_file: str | None = None, cert_file: str | None = None, key_file: str | None = None
) -> ssl.SSLContext:
    """A client context that verifies the server against ``ca_file`` (default: the system's CAs),
    showing ``cert_file``/``key_file`` when the server asks for a client certificate."""
    context = ssl.create_default_context(ssl.Purpose.SERVER_AUTH, cafile=ca_file)
    context.minimum_version = ssl.TLSVersion.TLSv1_2
    context.set_alpn_protocols(ALPN)
    if cert_file is not None:
        context.load_cert_chain(cert_file, key_file)
    elif key_file is not None:
        raise ValueError("key_file needs cert_file")
    return context


__all__ = [
    "ALPN",
    "client_context",
    "server_context",
]
