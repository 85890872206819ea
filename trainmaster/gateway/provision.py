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
from pydantic import BaseModel, ConfigDict, Field

from trainmaster.errors import UserError
from trainmaster.spec.boundedyaml import load_one
from trainmaster.gateway.crypto import Identity, PublicIdentity, b64d, b64e, raw_private, raw_public
from trainmaster.gateway.models import ID_PATTERN
from trainmaster.gateway.tlsid import NAME_PATTERN, dns_name


class ServiceConfig(BaseModel):
    """What one service (gateway, party or initiator) needs to start."""

    model_config = ConfigDict(extra="forbid")
    name: str = Field(pattern=ID_PATTERN)
    role: str = Field(pattern=r"^(gateway|party|initiator|operator)$")
    host: str = "127.0.0.1"
    port: int = Field(default=0, ge=0, le=65535)
    ca: str
    cert: str
    key: str
    sign_key: str
    enc_key: str
    roster: str
    state_dir: str
    db_url: str | None = None
    skew_s: float = Field(default=30.0, gt=0)
    party_concurrency: int = Field(default=8, ge=1)
    max_inflight_tasks: int = Field(default=256, ge=1)
    task_queue_depth: int = Field(default=4, ge=1)
    max_body_bytes: int = Field(default=128 * 1024 * 1024, ge=1024)
    executor_start_timeout_s: float = Field(default=20.0, gt=0)
    executor_memory_mb: int = Field(default=4096, ge=64)
    allowed_rules: list[str] | None = None
    executor: str = Field(default="subprocess", pattern=r"^(subprocess|ray)$")
    """Party: how each task's isolated executor runs (a subprocess with rlimits, or a Ray actor)."""
    isolation: str = Field(default="sandbox", pattern=r"^(sandbox|process)$")
    """Party with ``executor: subprocess``: ``sandbox`` runs each executor in bubblewrap namespaces as
    uid 65534 with seccomp and cgroup limits (needs root and bubblewrap; the party refuses to start
    without them); ``process`` is the explicit opt-out: a plain subprocess with rlimits only."""
    ray_address: str | None = None
    """Party with ``executor: ray``: the cluster to use; unset starts a local Ray in the party."""
    stream_chunk_bytes: int = Field(default=1 << 20, ge=1024, le=8 << 20)
    """Results larger than this travel as a chunked stream of chunks this size (party config)."""
    max_result_bytes: int = Field(default=1 << 30, ge=1024)
    """The largest streamed result the gateway or initiator accepts."""
    # Connection hygiene (item 4), gateway and parties.
    header_timeout_s: float = Field(default=10.0, gt=0, le=300)
    """A connection must deliver a request's headers this long after it opens or after its last response."""
    body_timeout_s: float = Field(default=60.0, gt=0, le=3600)
    """A request body must arrive whole within this long."""
    idle_timeout_s: float = Field(default=15.0, gt=0, le=600)
    """An idle keep-alive connection is closed after this long."""
    max_connections: int = Field(default=512, ge=4, le=65536)
    """Connections (and requests) served at once; past it new requests get 503."""
    max_header_bytes: int = Field(default=16384, ge=1024, le=1 << 20)
    # Bounds per member (items 5, 8).
    max_open_legs_per_party: int = Field(default=1024, ge=1)
    """Gateway: legs without an outcome a party may be assigned at once; a task past it is refused."""
    max_executors: int = Field(default=32, ge=1)
    """Party: executors running at once; a task created past it queues until one is released (its
    leg's rule has run, or its deadline passed)."""
    max_queued_legs: int = Field(default=4096, ge=0)
    """Party: legs waiting for an executor slot (a few hundred bytes each); a task creation past it
    gets 503 with Retry-After."""
    # Disclosure limits on aggregate rules (item 10), per party and data set.
    min_group_size: int = Field(default=5, ge=1)
    """Party: every non-empty histogram bin and every summary must cover at least this many rows."""
    privacy_budget: int = Field(default=200_000, ge=0)
    """Party: aggregate values one data set may release in total, over all tasks and initiators."""
    # Fault injection, off by default; the fault tests turn these on.
    fault_delay_s: float = 0.0
    fault_clock_offset_s: float = 0.0
    fault_executor_silent: bool = False
    fault_stream: str = Field(default="", pattern=r"^(|truncate|reorder|flip|slow|misattest)$")
    """Party: corrupt outgoing result streams this way (tests that the gateway refuses them);
    ``misattest`` signs a digest of other bytes than it streams (refused at the initiator)."""


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
    Ports: the gateway listens on ``port_base``, party i on ``port_base + 1 + i``. ``hosts`` gives
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
    members = [("gateway", "gateway", port_base), ("operator", "operator", 0)]
    members += [(i, "initiator", 0) for i in initiators]
    members += [(p, "party", port_base + 1 + i) for i, p in enumerate(parties)]
    roster: dict[str, Any] = {"identities": {}}
    configs: dict[str, Path] = {}
    for name, role, port in members:
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
        roster["identities"][name] = {
            "role": role,
            "endpoint": endpoint,
            "sign_pub": b64e(raw_public(ident.sign_key.public_key())),
            "enc_pub": b64e(raw_public(ident.enc_key.public_key())),
        }
        cfg = ServiceConfig(
            name=name,
            role=role,
            host=own_host,
            port=port,
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


def load_config(path: str | Path) -> ServiceConfig:
    p = Path(path)
    if not p.is_file():
        raise UserError(f"config file not found: {p}")
    try:
        return ServiceConfig.model_validate(load_one(p.read_text(), str(p)))
    except Exception as exc:  # pydantic ValidationError or YAML error: both the user's to fix
        raise UserError(f"invalid config {p}", details=[str(exc)]) from exc


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
        )
        for name, entry in raw["identities"].items()
    }
