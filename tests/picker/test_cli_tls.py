"""TLS on the ext_proc port: the self-signed certificate, and --cert-path files reloaded on change
(checked by a real TLS handshake with ALPN h2 over an in-memory stream pair)."""

from __future__ import annotations

import os
import ssl
from pathlib import Path

import pytest
import trio
import trio.testing
from cryptography import x509
from cryptography.hazmat.primitives import serialization

from evergreen_trio.picker.tls import ReloadingContext, TlsError, ext_proc_context, self_signed_pem


async def served_certificate(server: ssl.SSLContext) -> bytes:
    """The DER certificate a client sees from ``server``, and the ALPN protocol must be h2."""
    client = ssl.create_default_context()
    client.check_hostname, client.verify_mode = False, ssl.CERT_NONE
    client.set_alpn_protocols(["h2"])
    left, right = trio.testing.memory_stream_pair()
    server_side = trio.SSLStream(left, server, server_side=True)
    client_side = trio.SSLStream(right, client, server_hostname="picker")
    async with trio.open_nursery() as nursery:
        nursery.start_soon(server_side.do_handshake)
        await client_side.do_handshake()
    assert client_side.selected_alpn_protocol() == "h2"
    der = client_side.getpeercert(binary_form=True)
    assert der is not None
    return der


def write_pair(folder: Path, name: str) -> bytes:
    cert, key = self_signed_pem(name)
    (folder / "tls.crt").write_bytes(cert)
    (folder / "tls.key").write_bytes(key)
    return x509.load_pem_x509_certificate(cert).public_bytes(serialization.Encoding.DER)



async def test_self_signed_when_no_cert_path() -> None:
    context = ext_proc_context(True, None)
    assert isinstance(context, ssl.SSLContext)
    der = await served_certificate(context)
    assert x509.load_der_x509_certificate(der).subject.rfc4514_string() == "CN=evergreen-trio-picker"
    assert ext_proc_context(False, None) is None


async def test_cert_path_files_are_reloaded_when_they_change(tmp_path: Path) -> None:
    first = write_pair(tmp_path, "first")
    reloading = ext_proc_context(True, str(tmp_path))
    assert isinstance(reloading, ReloadingContext)
    assert await served_certificate(reloading()) == first
    second = write_pair(tmp_path, "second")
    os.utime(tmp_path / "tls.crt", ns=(1, 1))  # a new mtime even on coarse clocks
    assert await served_certificate(reloading()) == second
    (tmp_path / "tls.key").write_bytes(b"half written")  # a rotation in progress keeps the last good pair
    assert await served_certificate(reloading()) == second


def test_missing_files_are_a_tls_error(tmp_path: Path) -> None:
    with pytest.raises(TlsError, match=r"tls\.crt"):
        ReloadingContext(tmp_path)
