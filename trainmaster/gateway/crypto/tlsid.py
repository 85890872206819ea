"""Which identity and role a TLS certificate speaks for (item 6).

Every certificate the deployment's CA issues carries one DNS name ``<name>.<role>.trainmaster.invalid``
(``.invalid`` never resolves, so the name cannot collide with a real host). A client names the
identity it expects as the TLS server name (SNI), so the TLS library itself checks that the server
is that gateway or party; a server reads the client's name and role from its verified certificate
and the gate compares them with the envelope's sender. The role is also fixed by the extended key
usage: an initiator's or operator's certificate is client-only and cannot serve.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

SUFFIX = ".trainmaster.invalid"
ROLES = ("gateway", "party", "initiator", "operator")
NAME_PATTERN = r"^[a-z0-9]([a-z0-9-]{0,61}[a-z0-9])?$"
"""Identity names usable in a certificate: one DNS label (lower case, digits, inner hyphens)."""

_DNS = re.compile(r"^([a-z0-9-]+)\.(gateway|party|initiator|operator)" + re.escape(SUFFIX) + "$")


def dns_name(name: str, role: str) -> str:
    if role not in ROLES or not re.match(NAME_PATTERN, name):
        raise ValueError(f"no certificate name for identity {name!r} with role {role!r}")
    return f"{name}.{role}{SUFFIX}"


@dataclass(frozen=True)
class PeerIdentity:
    """The verified TLS peer of one connection."""

    name: str
    role: str


def peer_from_cert(cert: dict[str, Any] | None) -> PeerIdentity | None:
    """The identity in a verified peer certificate (``SSLObject.getpeercert()``), or None.

    A certificate naming two identities is refused (None): one certificate, one identity.
    """
    if not cert:
        return None
    found = {m.groups() for kind, value in cert.get("subjectAltName", ()) if kind == "DNS" and (m := _DNS.match(value))}
    if len(found) != 1:
        return None
    name, role = found.pop()
    return PeerIdentity(name, role)
