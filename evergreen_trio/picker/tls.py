"""TLS for the ext_proc port, as the reference picker serves it.

``--cert-path DIR`` names a directory holding ``tls.crt`` and ``tls.key`` (a Kubernetes TLS
Secret mounted as a volume); the files are re-read when either changes, so a rotated Secret
takes effect on the next connection. Without one, a self-signed certificate is made at start
(Envoy in front of the reference picker does not verify it either). ALPN offers ``h2`` only:
ext_proc is gRPC.
"""

from __future__ import annotations

import datetime
import logging
import os
import ssl
import tempfile
from collections.abc import Callable
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID

from evergreen_trio.picker.errors import PickerError

log = logging.getLogger(__name__)
CERT_FILE, KEY_FILE = "tls.crt", "tls.key"


class TlsError(PickerError):
    """The certificate or key under ``--cert-path`` is missing or unreadable."""


def self_signed_pem(common_name: str = "evergreen-trio-picker", days: int = 365) -> tuple[bytes, bytes]:
    """A fresh P-256 key and a self-signed certificate for it, both PEM: ``(cert, key)``."""
    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, common_name)])
    now = datetime.datetime.now(datetime.UTC)
    cert = (
        x509.CertificateBuilder()
        .subject_name(name)
        .issuer_name(name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=days))
        .add_extension(x509.SubjectAlternativeName([x509.DNSName(common_name)]), critical=False)
        .sign(key, hashes.SHA256())
    )
    key_pem = key.private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption())
    return cert.public_bytes(serialization.Encoding.PEM), key_pem


def server_context(cert_file: str | Path, key_file: str | Path) -> ssl.SSLContext:
    """A TLS 1.2+ server context offering ALPN ``h2``; TlsError when the files do not load."""
    context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    context.minimum_version = ssl.TLSVersion.TLSv1_2
    context.set_alpn_protocols(["h2"])
    try:
        context.load_cert_chain(cert_file, key_file)
    except (OSError, ssl.SSLError) as exc:
        raise TlsError(f"expected a certificate {cert_file} and key {key_file}, got {exc}") from None
    return context


def self_signed_context() -> ssl.SSLContext:
    """A server context for a certificate made now (``load_cert_chain`` only reads files)."""
    cert, key = self_signed_pem()
    with tempfile.TemporaryDirectory() as folder:
        cert_file, key_file = Path(folder, CERT_FILE), Path(folder, KEY_FILE)
        cert_file.write_bytes(cert)
        key_file.write_bytes(key)
        os.chmod(key_file, 0o600)
        return server_context(cert_file, key_file)


class ReloadingContext:
    """Callable giving the context for ``cert_dir``'s files, rebuilt when their mtime or size changes.

    A half-written rotation (files that do not load) keeps the previous context and logs once.
    """

    def __init__(self, cert_dir: str | Path) -> None:
        self.cert_file = Path(cert_dir, CERT_FILE)
        self.key_file = Path(cert_dir, KEY_FILE)
        self._stamp = self._files_stamp()
        self._context = server_context(self.cert_file, self.key_file)

    def _files_stamp(self) -> tuple[int, int, int, int]:
        try:
            cert, key = self.cert_file.stat(), self.key_file.stat()
        except OSError as exc:
            raise TlsError(f"expected {self.cert_file} and {self.key_file}, got {exc}") from None
        return cert.st_mtime_ns, cert.st_size, key.st_mtime_ns, key.st_size

    def __call__(self) -> ssl.SSLContext:
        try:
            stamp = self._files_stamp()
            if stamp != self._stamp:
                self._stamp = stamp  # tried once per change: a bad pair logs once, not per connection
                self._context = server_context(self.cert_file, self.key_file)
                log.info("picker.tls_reloaded cert=%s", self.cert_file)
        except TlsError as exc:
            log.warning("picker.tls_reload_failed error=%s (keeping the previous certificate)", exc)
        return self._context


def ext_proc_context(secure: bool, cert_path: str | None) -> ssl.SSLContext | Callable[[], ssl.SSLContext] | None:
    """What ``serve_grpc`` gets: None (plaintext), a reloading callable, or a self-signed context."""
    if not secure:
        return None
    if cert_path:
        return ReloadingContext(cert_path)
    log.info("picker.tls_self_signed")
    return self_signed_context()
