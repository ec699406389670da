"""Test-made certificates (cryptography): no certificate is committed, each test module makes its own."""

from __future__ import annotations

import datetime
import ipaddress
from pathlib import Path

#: DNS name of the internal identity (InternalTLS.server_name's default)
INTERNAL_NAME = "viasd-internal"


def make_certificates(root: Path) -> dict[str, Path]:
    """PEM files under `root`, by name (`<name>.pem` certificate, `<name>.key` key):

    * `ca`: a CA; `server` (127.0.0.1 / localhost, serverAuth) and `client` (clientAuth) signed by it;
    * `internal`: one identity for both ends of the internal services (serverAuth + clientAuth,
      DNS name viasd-internal), signed by `ca`;
    * `other-ca` with its own `other-client` and `other-internal`: trusted by nobody.
    """
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

    now = datetime.datetime.now(datetime.UTC)
    paths: dict[str, Path] = {}

    def write(name: str, cert, key) -> None:
        paths[f"{name}.pem"] = root / f"{name}.pem"
        paths[f"{name}.pem"].write_bytes(cert.public_bytes(serialization.Encoding.PEM))
        paths[f"{name}.key"] = root / f"{name}.key"
        paths[f"{name}.key"].write_bytes(
            key.private_bytes(
                serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
            )
        )

    def make(name: str, issuer=None, *, ca: bool = False, usages=(), names=()):
        key = ec.generate_private_key(ec.SECP256R1())
        subject = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, name)])
        issuer_cert, issuer_key = issuer or (None, key)
        builder = (
            x509.CertificateBuilder()
            .subject_name(subject)
            .issuer_name(issuer_cert.subject if issuer_cert else subject)
            .public_key(key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(minutes=5))
            .not_valid_after(now + datetime.timedelta(days=1))
            .add_extension(x509.BasicConstraints(ca=ca, path_length=None), critical=True)
        )
        if names:
            builder = builder.add_extension(x509.SubjectAlternativeName(list(names)), critical=False)
        if usages:
            builder = builder.add_extension(x509.ExtendedKeyUsage(list(usages)), critical=False)
        cert = builder.sign(issuer_key, hashes.SHA256())
        write(name, cert, key)
        return cert, key

    server, client = ExtendedKeyUsageOID.SERVER_AUTH, ExtendedKeyUsageOID.CLIENT_AUTH
    loopback = (x509.DNSName("localhost"), x509.IPAddress(ipaddress.ip_address("127.0.0.1")))
    internal = (x509.DNSName(INTERNAL_NAME),)
    ca = make("ca", ca=True)
    make("server", ca, usages=(server,), names=loopback)
    make("client", ca, usages=(client,))
    make("internal", ca, usages=(server, client), names=internal)
    other = make("other-ca", ca=True)
    make("other-client", other, usages=(client,))
    make("other-internal", other, usages=(server, client), names=internal)
    return paths
