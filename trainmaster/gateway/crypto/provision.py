"""Provisioning: a private CA, TLS certificates, per-identity key pairs, a roster and configs.

``init_deployment`` writes one directory per identity (gateway, initiator, each party) holding its
TLS certificate, its Ed25519 signing key and X25519 encryption key (files readable only by the
owner) and a ``config.yaml``; ``roster.json`` holds every identity's public keys and endpoint and is
what each service trusts.
"""

from __future__ import annotations

import datetime as dt
import ipaddress
import json
import os
from pathlib import Path
from typing import Any

import yaml
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from cryptography.hazmat.primitives.asymmetric.x25519 import X25519PrivateKey
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

from trainmaster.errors import UserError
from trainmaster.gateway.config import ServiceConfig
from trainmaster.gateway.crypto.envelope import Identity, PublicIdentity, b64d, b64e, raw_private, raw_public
from trainmaster.gateway.crypto.tlsid import NAME_PATTERN, dns_name


def _write_secret(path: Path, data: bytes) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "wb") as fh:
        fh.write(data)


def _name(cn: str) -> x509.Name:
    return x509.Name(
        [x509.NameAttribute(NameOID.ORGANIZATION_NAME, "trainmaster"), x509.NameAttribute(NameOID.COMMON_NAME, cn)]
    )


def make_ca(common_name: str = "trainmaster private CA") -> tuple[ec.EllipticCurvePrivateKey, x509.Certificate]:
    key = ec.generate_private_key(ec.SECP256R1())
    now = dt.datetime.now(dt.timezone.utc)
    cert = (
        x509.CertificateBuilder()
        .subject_name(_name(common_name))
        .issuer_name(_name(common_name))
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - dt.timedelta(minutes=5))
        .not_valid_after(now + dt.timedelta(days=825))
        .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
        .add_extension(x509.KeyUsage(False, False, False, False, False, True, True, False, False), critical=True)
        .sign(key, hashes.SHA256())
    )
    return key, cert


SERVING_ROLES = ("gateway", "party")
"""Roles that accept connections; initiators and operators only connect."""


def issue_cert(
    ca_key: ec.EllipticCurvePrivateKey, ca_cert: x509.Certificate, cn: str, role: str, hosts: list[str] | None = None
) -> tuple[ec.EllipticCurvePrivateKey, x509.Certificate]:
    """A leaf for one identity in one role (item 6).

    Its SANs are the identity name (``<cn>.<role>.trainmaster.invalid``: what peers check) and,
    for a serving role only, the hosts it listens on. Key usage is digital signature only; the
    extended key usage is clientAuth, plus serverAuth for a serving role, so an initiator's or
    operator's certificate cannot be used to pose as a gateway or party.
    """
    key = ec.generate_private_key(ec.SECP256R1())
    now = dt.datetime.now(dt.timezone.utc)
    serving = role in SERVING_ROLES
    sans: list[x509.GeneralName] = [x509.DNSName(dns_name(cn, role))]
    for h in (hosts or []) if serving else []:
        try:
            sans.append(x509.IPAddress(ipaddress.ip_address(h)))
        except ValueError:
            sans.append(x509.DNSName(h))
    cert = (
        x509.CertificateBuilder()
        .subject_name(_name(cn))
        .issuer_name(ca_cert.subject)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - dt.timedelta(minutes=5))
        .not_valid_after(now + dt.timedelta(days=397))
        .add_extension(x509.SubjectAlternativeName(sans), critical=False)
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .add_extension(x509.KeyUsage(True, False, False, False, False, False, False, False, False), critical=True)
        .add_extension(
            x509.ExtendedKeyUsage(
                [ExtendedKeyUsageOID.SERVER_AUTH, ExtendedKeyUsageOID.CLIENT_AUTH]
                if serving
                else [ExtendedKeyUsageOID.CLIENT_AUTH]
            ),
            critical=False,
        )
        .sign(ca_key, hashes.SHA256())
    )
    return key, cert


def _pem_key(key: ec.EllipticCurvePrivateKey) -> bytes:
    return key.private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
    )


def ports_needed(n_parties: int) -> int:
    """Consecutive ports a deployment of ``n_parties`` listens on from ``port_base`` (HTTP and stream ports)."""
    return 2 * (n_parties + 1)


def init_deployment(
    out: Path,
    parties: list[str],
    host: str = "127.0.0.1",
    port_base: int = 8443,
    initiators: list[str] | None = None,
    hosts: dict[str, str] | None = None,
) -> dict[str, Path]:
    """Create CA, certificates, keys, roster and one config per identity under ``out``.

    Identities: ``gateway``, each initiator (default one named ``initiator``), each party, and
    ``operator`` (a client-only identity that may read the services' counters).
    Ports: the gateway listens on ``port_base``, party i on ``port_base + 1 + i``; their stream
    ports follow, the gateway's at ``port_base + 1 + n`` (n parties), party i's at
    ``port_base + 2 + n + i``. ``hosts`` gives
    the gateway's or a party's own host (name or address: its endpoint, listen address and
    certificate SAN) when the services run on separate machines; the others use ``host``.
    Returns each identity's config path.
    """
    import re

    initiators = initiators or ["initiator"]
    hosts = hosts or {}
    names = [*parties, *initiators]
    stray = sorted(set(hosts) - {"gateway", *parties})
    if stray:
        raise UserError(
            "invalid --hosts", details=[f"{n!r} is not the gateway or a party (only they listen)" for n in stray]
        )
    bad = [p for p in names if not re.match(NAME_PATTERN, p)] + [p for p in names if p in ("gateway", "operator")]
    if not parties or bad or len(set(names)) != len(names):
        raise UserError(
            "invalid --parties/--initiators",
            details=[
                f"bad, reserved or duplicate name: {p!r} (names are lower-case letters, digits and "
                "inner hyphens; 'gateway' and 'operator' are taken)"
                for p in bad
            ]
            or ["give distinct names like a,b,c"],
        )
    out.mkdir(parents=True, exist_ok=True)
    if (out / "roster.json").exists():
        raise UserError(f"{out} already holds a deployment (roster.json exists); choose an empty directory")
    ca_key, ca_cert = make_ca()
    (out / "ca").mkdir(exist_ok=True)
    ca_pem = out / "ca" / "ca.pem"
    ca_pem.write_bytes(ca_cert.public_bytes(serialization.Encoding.PEM))
    _write_secret(out / "ca" / "ca.key", _pem_key(ca_key))
    n = len(parties)
    members = [("gateway", "gateway", port_base, port_base + 1 + n), ("operator", "operator", 0, 0)]
    members += [(i, "initiator", 0, 0) for i in initiators]
    members += [(p, "party", port_base + 1 + i, port_base + 2 + n + i) for i, p in enumerate(parties)]
    roster: dict[str, Any] = {"identities": {}}
    configs: dict[str, Path] = {}
    for name, role, port, stream_port in members:
        d = out / name
        d.mkdir(exist_ok=True)
        own_host = hosts.get(name, host)
        tls_key, tls_cert = issue_cert(
            ca_key, ca_cert, name, role, [own_host] if name in hosts else [host, "localhost"]
        )
        (d / "tls.pem").write_bytes(tls_cert.public_bytes(serialization.Encoding.PEM))
        _write_secret(d / "tls.key", _pem_key(tls_key))
        ident = Identity.generate(name)
        _write_secret(d / "sign.key", b64e(raw_private(ident.sign_key)).encode())
        _write_secret(d / "enc.key", b64e(raw_private(ident.enc_key)).encode())
        endpoint = f"https://{own_host}:{port}" if port else None
        bracketed = f"[{own_host}]" if ":" in own_host else own_host
        roster["identities"][name] = {
            "role": role,
            "endpoint": endpoint,
            "stream_endpoint": f"{bracketed}:{stream_port}" if stream_port else None,
            "sign_pub": b64e(raw_public(ident.sign_key.public_key())),
            "enc_pub": b64e(raw_public(ident.enc_key.public_key())),
        }
        cfg = ServiceConfig(
            name=name,
            role=role,
            host=own_host,
            port=port,
            stream_port=stream_port,
            ca=str(ca_pem.resolve()),
            cert=str((d / "tls.pem").resolve()),
            key=str((d / "tls.key").resolve()),
            sign_key=str((d / "sign.key").resolve()),
            enc_key=str((d / "enc.key").resolve()),
            roster=str((out / "roster.json").resolve()),
            state_dir=str((d / "state").resolve()),
            db_url=f"sqlite:///{(d / 'state' / 'mapping.db').resolve()}" if role == "gateway" else None,
        )
        (d / "config.yaml").write_text(yaml.safe_dump(cfg.model_dump(exclude_defaults=False), sort_keys=False))
        configs[name] = d / "config.yaml"
    (out / "roster.json").write_text(json.dumps(roster, indent=2))
    return configs


def load_identity(cfg: ServiceConfig) -> Identity:
    return Identity(
        cfg.name,
        Ed25519PrivateKey.from_private_bytes(b64d(Path(cfg.sign_key).read_text().strip())),
        X25519PrivateKey.from_private_bytes(b64d(Path(cfg.enc_key).read_text().strip())),
    )


def load_roster(path: str | Path) -> dict[str, PublicIdentity]:
    from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PublicKey
    from cryptography.hazmat.primitives.asymmetric.x25519 import X25519PublicKey

    raw = json.loads(Path(path).read_text())
    return {
        name: PublicIdentity(
            name,
            entry["role"],
            Ed25519PublicKey.from_public_bytes(b64d(entry["sign_pub"])),
            X25519PublicKey.from_public_bytes(b64d(entry["enc_pub"])),
            entry.get("endpoint"),
            entry.get("stream_endpoint"),
        )
        for name, entry in raw["identities"].items()
    }
