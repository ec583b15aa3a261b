"""TLS for the ext_proc port, as the reference picker serves it.

``--cert-path DIR`` names a directory holding ``tls.crt`` and ``tls.key`` (a Kubernetes TLS
Secret mounted as a volume); the files are re-read when either changes, so a rotated Secret
takes effect on the next connection. Without one, a self-signed certificate is made at start
(Envoy in front of the reference picker does not verify it either). ALPN offers ``h2`` only:
ext_proc is gRPC. ``--tls-min-version`` and ``--tls-cipher-suites`` take the reference's Go names
(:class:`TlsProfile`).
"""

from __future__ import annotations

import datetime
import functools
import logging
import os
import ssl
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from pathlib import Path

from evergreen_trio.picker.errors import ConfigError, PickerError

log = logging.getLogger(__name__)
CERT_FILE, KEY_FILE = "tls.crt", "tls.key"


class TlsError(PickerError):
    """The certificate or key under ``--cert-path`` is missing or unreadable."""


TLS_VERSIONS = {"VersionTLS10": ssl.TLSVersion.TLSv1, "VersionTLS11": ssl.TLSVersion.TLSv1_1,
                "VersionTLS12": ssl.TLSVersion.TLSv1_2, "VersionTLS13": ssl.TLSVersion.TLSv1_3}
# Go's crypto/tls suite names (CipherSuites() and InsecureCipherSuites()) -> IANA ids.
GO_CIPHER_SUITES = {
    "TLS_AES_128_GCM_SHA256": 0x1301, "TLS_AES_256_GCM_SHA384": 0x1302, "TLS_CHACHA20_POLY1305_SHA256": 0x1303,
    "TLS_ECDHE_ECDSA_WITH_AES_128_CBC_SHA": 0xC009, "TLS_ECDHE_ECDSA_WITH_AES_256_CBC_SHA": 0xC00A,
    "TLS_ECDHE_RSA_WITH_AES_128_CBC_SHA": 0xC013, "TLS_ECDHE_RSA_WITH_AES_256_CBC_SHA": 0xC014,
    "TLS_ECDHE_ECDSA_WITH_AES_128_GCM_SHA256": 0xC02B, "TLS_ECDHE_ECDSA_WITH_AES_256_GCM_SHA384": 0xC02C,
    "TLS_ECDHE_RSA_WITH_AES_128_GCM_SHA256": 0xC02F, "TLS_ECDHE_RSA_WITH_AES_256_GCM_SHA384": 0xC030,
    "TLS_ECDHE_RSA_WITH_CHACHA20_POLY1305_SHA256": 0xCCA8, "TLS_ECDHE_ECDSA_WITH_CHACHA20_POLY1305_SHA256": 0xCCA9,
    "TLS_RSA_WITH_RC4_128_SHA": 0x0005, "TLS_RSA_WITH_3DES_EDE_CBC_SHA": 0x000A,
    "TLS_RSA_WITH_AES_128_CBC_SHA": 0x002F, "TLS_RSA_WITH_AES_256_CBC_SHA": 0x0035,
    "TLS_RSA_WITH_AES_128_CBC_SHA256": 0x003C, "TLS_RSA_WITH_AES_128_GCM_SHA256": 0x009C,
    "TLS_RSA_WITH_AES_256_GCM_SHA384": 0x009D, "TLS_ECDHE_ECDSA_WITH_RC4_128_SHA": 0xC007,
    "TLS_ECDHE_RSA_WITH_RC4_128_SHA": 0xC011, "TLS_ECDHE_RSA_WITH_3DES_EDE_CBC_SHA": 0xC012,
    "TLS_ECDHE_ECDSA_WITH_AES_128_CBC_SHA256": 0xC023, "TLS_ECDHE_RSA_WITH_AES_128_CBC_SHA256": 0xC027,
}
_TLS13_SUITES = frozenset({0x1301, 0x1302, 0x1303})


@dataclass(frozen=True)
class TlsProfile:
    """The ext_proc port's TLS floor and, for TLS 1.2 and below, its cipher suites (OpenSSL's
    names; None: OpenSSL's defaults). TLS 1.3 suites are not configurable, as in Go."""

    min_version: ssl.TLSVersion = ssl.TLSVersion.TLSv1_2
    ciphers: str | None = None

    @classmethod
    def from_flags(cls, min_version: str | None, cipher_suites: str | None) -> TlsProfile:
        """From the reference's ``--tls-min-version`` (``VersionTLS12``) and ``--tls-cipher-suites``
        (comma-separated Go names); ConfigError naming the flag for an unknown name."""
        version = cls.min_version
        if min_version:
            if min_version not in TLS_VERSIONS:
                raise ConfigError("--tls-min-version", "one of " + ", ".join(TLS_VERSIONS), min_version)
            version = TLS_VERSIONS[min_version]
        ids = []
        for name in (n.strip() for n in (cipher_suites or "").split(",")):
            if name and name not in GO_CIPHER_SUITES:
                raise ConfigError("--tls-cipher-suites", "Go crypto/tls cipher suite names", name)
            if name and GO_CIPHER_SUITES[name] not in _TLS13_SUITES:
                ids.append(GO_CIPHER_SUITES[name])
        return cls(version, _openssl_names(ids) if ids else None)


def _openssl_names(ids: list[int]) -> str:
    """OpenSSL's cipher string for these suite ids; ConfigError for one this OpenSSL does not have."""
    every = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    every.set_ciphers("ALL:COMPLEMENTOFALL:@SECLEVEL=0")
    by_id = {cipher["id"] & 0xFFFF: cipher["name"] for cipher in every.get_ciphers()}
    for suite in ids:
        if suite not in by_id:
            name = next(n for n, i in GO_CIPHER_SUITES.items() if i == suite)
            raise ConfigError("--tls-cipher-suites", f"a suite {ssl.OPENSSL_VERSION} offers", name)
    return ":".join(by_id[suite] for suite in ids)


def self_signed_pem(common_name: str = "evergreen-trio-picker", days: int = 365) -> tuple[bytes, bytes]:
    """A fresh P-256 key and a self-signed certificate for it, both PEM: ``(cert, key)``."""
    # Only a self-signed certificate needs cryptography: a plaintext or file-backed picker runs without it.
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

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


def server_context(cert_file: str | Path, key_file: str | Path, profile: TlsProfile = TlsProfile(), *,
                   alpn: str = "h2", client_ca: str | Path | None = None) -> ssl.SSLContext:
    """A server context offering ALPN ``alpn``, TLS 1.2+ unless ``profile`` says otherwise, asking
    for a client certificate ``client_ca`` signed when given; TlsError when a file does not load."""
    context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    context.minimum_version = profile.min_version
    if profile.ciphers is not None:
        context.set_ciphers(profile.ciphers)
    context.set_alpn_protocols([alpn])
    try:
        context.load_cert_chain(cert_file, key_file)
    except (OSError, ssl.SSLError) as exc:
        raise TlsError(f"expected a certificate {cert_file} and key {key_file}, got {exc}") from None
    if client_ca is not None:
        try:
            context.load_verify_locations(cafile=client_ca)
        except (OSError, ssl.SSLError) as exc:
            raise TlsError(f"expected CA certificates in {client_ca}, got {exc}") from None
        context.verify_mode = ssl.CERT_REQUIRED
    return context


def self_signed_context(profile: TlsProfile = TlsProfile()) -> ssl.SSLContext:
    """A server context for a certificate made now (``load_cert_chain`` only reads files)."""
    cert, key = self_signed_pem()
    with tempfile.TemporaryDirectory() as folder:
        cert_file, key_file = Path(folder, CERT_FILE), Path(folder, KEY_FILE)
        cert_file.write_bytes(cert)
        key_file.write_bytes(key)
        os.chmod(key_file, 0o600)
        return server_context(cert_file, key_file, profile)


class ReloadingContext:
    """Callable giving the context for ``cert_dir``'s files, rebuilt when their mtime or size changes.

    A half-written rotation (files that do not load) keeps the previous context and logs once.
    """

    def __init__(self, cert_dir: str | Path, profile: TlsProfile = TlsProfile(), *, alpn: str = "h2",
                 client_ca: str | Path | None = None) -> None:
        self.cert_file = Path(cert_dir, CERT_FILE)
        self.key_file = Path(cert_dir, KEY_FILE)
        self._build = partial(server_context, self.cert_file, self.key_file, profile, alpn=alpn, client_ca=client_ca)
        self._stamp = self._files_stamp()
        self._context = self._build()

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
                self._context = self._build()
                log.info("picker.tls_reloaded cert=%s", self.cert_file)
        except TlsError as exc:
            log.warning("picker.tls_reload_failed error=%s (keeping the previous certificate)", exc)
        return self._context


def ext_proc_context(secure: bool, cert_path: str | None, profile: TlsProfile = TlsProfile(),
                     ) -> ssl.SSLContext | Callable[[], ssl.SSLContext] | None:
    """What ``serve_grpc`` gets: None (plaintext), a reloading callable, or a self-signed context."""
    if not secure:
        return None
    if cert_path:
        return ReloadingContext(cert_path, profile)
    log.info("picker.tls_self_signed")
    return self_signed_context(profile)


def metrics_context(cert_dir: str | None, client_ca: str | None) -> ReloadingContext | None:
    """TLS for the metrics port, as the reference's ``--metrics-cert-dir`` (``tls.crt`` and
    ``tls.key``, reloaded on change) and ``--metrics-client-ca-file`` (client certificates it
    signed required); None without a directory. ConfigError for a CA without a directory."""
    if client_ca and not cert_dir:
        raise ConfigError("--metrics-client-ca-file", "--metrics-cert-dir with it", client_ca)
    if not cert_dir:
        return None
    return ReloadingContext(cert_dir, alpn="http/1.1", client_ca=client_ca or None)


@functools.cache
def client_context(skip_verify: bool = False, ca_file: str = "", cert_file: str = "",
                   key_file: str = "") -> ssl.SSLContext:
    """A client context as the Go ``tls.Config`` of the reference's HTTP data sources: the server's
    certificate verified against the system roots, or ``ca_file``'s certificates alone, unless
    ``skip_verify``; ``cert_file``/``key_file`` presented when either is given (mTLS). TlsError
    naming the file that does not load. Built once per arguments (the files are read when the
    config loads, as the reference's factory reads them)."""
    if skip_verify:
        context = ssl.create_default_context(ssl.Purpose.SERVER_AUTH)
        context.check_hostname = False
        context.verify_mode = ssl.CERT_NONE
    else:
        try:
            context = ssl.create_default_context(ssl.Purpose.SERVER_AUTH, cafile=ca_file or None)
        except (OSError, ssl.SSLError) as exc:
            raise TlsError(f"expected CA certificates in {ca_file!r}, got {exc}") from None
    context.set_alpn_protocols(["http/1.1"])
    if cert_file or key_file:
        try:
            context.load_cert_chain(cert_file, key_file or None)
        except (OSError, ssl.SSLError) as exc:
            raise TlsError(f"expected a client certificate {cert_file!r} and key {key_file!r}, got {exc}") from None
    return context
