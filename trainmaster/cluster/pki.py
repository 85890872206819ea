"""The cluster's keys and certificates: one CA, the apiserver's serving certificate, the client
certificate the apiserver shows kubelets, and the service-account signing key.

Written with ``cryptography`` (no openssl or cfssl on the path): what kubeadm writes to
``/etc/kubernetes/pki``, reduced to what a cluster of this machine needs.
"""

from __future__ import annotations

import datetime
import ipaddress
import os
from dataclasses import dataclass
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec, rsa
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

VALID_DAYS = 365


@dataclass(frozen=True)
class Pki:
    """Paths of everything :func:`write_pki` writes into one folder."""

    folder: Path

    @property
    def ca_cert(self) -> Path:
        return self.folder / "ca.crt"

    @property
    def ca_key(self) -> Path:
        return self.folder / "ca.key"

    @property
    def apiserver_cert(self) -> Path:
        return self.folder / "apiserver.crt"

    @property
    def apiserver_key(self) -> Path:
        return self.folder / "apiserver.key"

    @property
    def kubelet_client_cert(self) -> Path:
        return self.folder / "apiserver-kubelet-client.crt"

    @property
    def kubelet_client_key(self) -> Path:
        return self.folder / "apiserver-kubelet-client.key"

    @property
    def service_account_key(self) -> Path:
        return self.folder / "sa.key"

    @property
    def service_account_pub(self) -> Path:
        return self.folder / "sa.pub"


def _write_key(path: Path, key: ec.EllipticCurvePrivateKey | rsa.RSAPrivateKey) -> None:
    data = key.private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.TraditionalOpenSSL, serialization.NoEncryption()
    )
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "wb") as f:
        f.write(data)


def _name(common: str, organization: str | None = None) -> x509.Name:
    parts = [x509.NameAttribute(NameOID.COMMON_NAME, common)]
    if organization:
        parts.append(x509.NameAttribute(NameOID.ORGANIZATION_NAME, organization))
    return x509.Name(parts)


def _signed(
    subject: x509.Name,
    public_key: ec.EllipticCurvePublicKey,
    ca_name: x509.Name,
    ca_key: ec.EllipticCurvePrivateKey,
    usages: list[x509.ObjectIdentifier],
    sans: list[x509.GeneralName] | None = None,
) -> x509.Certificate:
    now = datetime.datetime.now(datetime.timezone.utc)
    builder = (
        x509.CertificateBuilder()
        .subject_name(subject)
        .issuer_name(ca_name)
        .public_key(public_key)
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=VALID_DAYS))
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .add_extension(x509.ExtendedKeyUsage(usages), critical=False)
    )
    if sans:
        builder = builder.add_extension(x509.SubjectAlternativeName(sans), critical=False)
    return builder.sign(ca_key, hashes.SHA256())


def write_pki(folder: Path, api_addresses: list[str], api_names: list[str]) -> Pki:
    """Create the CA and every certificate and key in ``folder`` (mode 0700)."""
    folder.mkdir(parents=True, exist_ok=True)
    folder.chmod(0o700)
    pki = Pki(folder)
    now = datetime.datetime.now(datetime.timezone.utc)
    ca_key = ec.generate_private_key(ec.SECP256R1())
    ca_name = _name("trainmaster-cluster-ca")
    ca = (
        x509.CertificateBuilder()
        .subject_name(ca_name)
        .issuer_name(ca_name)
        .public_key(ca_key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=VALID_DAYS))
        .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
        .add_extension(
            x509.KeyUsage(True, False, False, False, False, True, True, False, False), critical=True
        )  # digital signature, cert sign, CRL sign
        .sign(ca_key, hashes.SHA256())
    )
    _write_key(pki.ca_key, ca_key)
    pki.ca_cert.write_bytes(ca.public_bytes(serialization.Encoding.PEM))

    sans: list[x509.GeneralName] = [x509.IPAddress(ipaddress.ip_address(a)) for a in api_addresses]
    sans += [x509.DNSName(n) for n in api_names]
    for cert_path, key_path, subject, usage, names in (
        (pki.apiserver_cert, pki.apiserver_key, _name("kube-apiserver"), ExtendedKeyUsageOID.SERVER_AUTH, sans),
        (
            pki.kubelet_client_cert,
            pki.kubelet_client_key,
            _name("kube-apiserver-kubelet-client", "system:masters"),
            ExtendedKeyUsageOID.CLIENT_AUTH,
            None,
        ),
    ):
        key = ec.generate_private_key(ec.SECP256R1())
        _write_key(key_path, key)
        cert = _signed(subject, key.public_key(), ca_name, ca_key, [usage], names)
        cert_path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))

    sa_key = rsa.generate_private_key(public_exponent=65537, key_size=2048)
    _write_key(pki.service_account_key, sa_key)
    pki.service_account_pub.write_bytes(
        sa_key.public_key().public_bytes(serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo)
    )
    return pki
