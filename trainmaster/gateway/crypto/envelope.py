"""Identities, keys and sealed envelopes: the only way any message crosses a hop.

Every request and result is an :class:`Envelope`: a canonical header (who, to whom, about which
task leg, until when), a payload encrypted to the recipient (ephemeral X25519 -> HKDF-SHA256 ->
AES-256-GCM, the canonical header as associated data) and an Ed25519 signature by the sender over
the header and the ciphertext. Opening checks the signature *before* touching the ciphertext, so
nothing unauthenticated is ever decrypted or parsed.
"""

from __future__ import annotations

import base64
import json
import os
import time
import uuid
from dataclasses import dataclass
from typing import Any, Literal

from cryptography.exceptions import InvalidSignature, InvalidTag
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey
from cryptography.hazmat.primitives.asymmetric.x25519 import X25519PrivateKey, X25519PublicKey
from cryptography.hazmat.primitives.ciphers.aead import AESGCM
from cryptography.hazmat.primitives.kdf.hkdf import HKDF

from trainmaster.gateway.models import Envelope, Header, LegAttestation, MessageKind, SignedAttestation

PROTOCOL_VERSION: Literal[1] = 1
_SIGN_DOMAIN = b"trainmaster-gateway/v1/sign\x00"
_KDF_INFO = b"trainmaster-gateway/v1/aead"
_ATTEST_DOMAIN = b"trainmaster-gateway/v1/attest\x00"
MAX_PAYLOAD_BYTES = 96 * 1024 * 1024


class EnvelopeError(Exception):
    """An envelope that must be refused; ``status`` is the HTTP status that says why."""

    def __init__(self, status: int, reason: str):
        super().__init__(reason)
        self.status = status
        self.reason = reason


def b64e(raw: bytes) -> str:
    return base64.urlsafe_b64encode(raw).decode("ascii")


def b64d(text: str) -> bytes:
    try:
        return base64.urlsafe_b64decode(text.encode("ascii"))
    except (ValueError, UnicodeEncodeError) as exc:
        raise EnvelopeError(400, "malformed base64 field") from exc


def canonical_header(header: Header) -> bytes:
    """One byte string per header: sorted keys, no whitespace, so signer and verifier agree."""
    return json.dumps(header.model_dump(mode="json"), sort_keys=True, separators=(",", ":")).encode()


def _signed_bytes(header_bytes: bytes, eph_pub: bytes, nonce: bytes, ciphertext: bytes) -> bytes:
    # Length-prefix every part so no two different tuples sign the same bytes.
    parts = [header_bytes, eph_pub, nonce, ciphertext]
    return _SIGN_DOMAIN + b"".join(len(p).to_bytes(8, "big") + p for p in parts)


@dataclass(frozen=True)
class PublicIdentity:
    """What the roster says about one identity: its name, role and two public keys."""

    name: str
    role: str
    sign_pub: Ed25519PublicKey
    enc_pub: X25519PublicKey
    endpoint: str | None = None
    stream_endpoint: str | None = None
    """``host:port`` of its stream port (gateway and parties)."""

    @property
    def enc_pub_raw(self) -> bytes:
        return self.enc_pub.public_bytes(serialization.Encoding.Raw, serialization.PublicFormat.Raw)


@dataclass(frozen=True)
class Identity:
    """One's own keys: signs what it sends and decrypts what is sent to it."""

    name: str
    sign_key: Ed25519PrivateKey
    enc_key: X25519PrivateKey

    @classmethod
    def generate(cls, name: str) -> "Identity":
        return cls(name, Ed25519PrivateKey.generate(), X25519PrivateKey.generate())

    def public(self, role: str, endpoint: str | None = None) -> PublicIdentity:
        return PublicIdentity(self.name, role, self.sign_key.public_key(), self.enc_key.public_key(), endpoint)


def raw_public(key: Ed25519PublicKey | X25519PublicKey) -> bytes:
    return key.public_bytes(serialization.Encoding.Raw, serialization.PublicFormat.Raw)


def raw_private(key: Ed25519PrivateKey | X25519PrivateKey) -> bytes:
    return key.private_bytes(serialization.Encoding.Raw, serialization.PrivateFormat.Raw, serialization.NoEncryption())


def _derive_key(shared: bytes, eph_pub: bytes, recipient_pub: bytes) -> bytes:
    return HKDF(algorithm=hashes.SHA256(), length=32, salt=eph_pub + recipient_pub, info=_KDF_INFO).derive(shared)


def make_header(
    sender: str,
    recipient: str,
    kind: str,
    task_id: str,
    data_id: str,
    ttl_s: float = 60.0,
    now: float | None = None,
) -> Header:
    issued = time.time() if now is None else now
    return Header(
        v=PROTOCOL_VERSION,
        msg_id=uuid.uuid4().hex,
        kind=MessageKind(kind),
        task_id=task_id,
        data_id=data_id,
        sender=sender,
        recipient=recipient,
        issued_at=round(issued, 3),
        expires_at=round(issued + ttl_s, 3),
    )


def seal(sender: Identity, recipient: PublicIdentity, header: Header, payload: dict[str, Any]) -> Envelope:
    """Encrypt ``payload`` (JSON, never pickle) to ``recipient`` and sign it as ``sender``."""
    if header.sender != sender.name or header.recipient != recipient.name:
        raise ValueError("header sender/recipient do not match the keys used")
    plaintext = json.dumps(payload, separators=(",", ":")).encode()
    header_bytes = canonical_header(header)
    eph = X25519PrivateKey.generate()
    eph_pub = raw_public(eph.public_key())
    key = _derive_key(eph.exchange(recipient.enc_pub), eph_pub, recipient.enc_pub_raw)
    nonce = os.urandom(12)
    ciphertext = AESGCM(key).encrypt(nonce, plaintext, header_bytes)
    signature = sender.sign_key.sign(_signed_bytes(header_bytes, eph_pub, nonce, ciphertext))
    return Envelope(
        header=header, eph_pub=b64e(eph_pub), nonce=b64e(nonce), ciphertext=b64e(ciphertext), signature=b64e(signature)
    )


def verify(envelope: Envelope, sender: PublicIdentity) -> None:
    """Check the sender's signature over header and ciphertext; raise 401 if it does not hold."""
    header_bytes = canonical_header(envelope.header)
    signed = _signed_bytes(header_bytes, b64d(envelope.eph_pub), b64d(envelope.nonce), b64d(envelope.ciphertext))
    try:
        sender.sign_pub.verify(b64d(envelope.signature), signed)
    except InvalidSignature as exc:
        raise EnvelopeError(401, f"bad signature on message from {envelope.header.sender!r}") from exc


def decrypt(envelope: Envelope, recipient: Identity) -> dict[str, Any]:
    """Decrypt a *verified* envelope; the header is the AAD, so header tampering fails here too."""
    eph_pub = b64d(envelope.eph_pub)
    if len(eph_pub) != 32:
        raise EnvelopeError(400, "ephemeral key must be 32 bytes")
    try:
        shared = recipient.enc_key.exchange(X25519PublicKey.from_public_bytes(eph_pub))
    except ValueError as exc:  # a low-order point (e.g. all zeros) gives an all-zero shared secret
        raise EnvelopeError(400, "ephemeral key is a low-order point (no shared secret); refused") from exc
    key = _derive_key(shared, eph_pub, raw_public(recipient.enc_key.public_key()))
    try:
        plaintext = AESGCM(key).decrypt(
            b64d(envelope.nonce), b64d(envelope.ciphertext), canonical_header(envelope.header)
        )
    except (InvalidTag, ValueError) as exc:
        raise EnvelopeError(422, "payload does not decrypt (wrong recipient key or tampered)") from exc
    if len(plaintext) > MAX_PAYLOAD_BYTES:
        raise EnvelopeError(413, "payload too large")
    try:
        payload = json.loads(plaintext)
    except json.JSONDecodeError as exc:
        raise EnvelopeError(422, "payload is not JSON") from exc
    if not isinstance(payload, dict):
        raise EnvelopeError(422, "payload must be a JSON object")
    return payload


def _attest_bytes(body: LegAttestation) -> bytes:
    return _ATTEST_DOMAIN + json.dumps(body.model_dump(mode="json"), sort_keys=True, separators=(",", ":")).encode()


def attest(party: Identity, body: LegAttestation) -> SignedAttestation:
    """A party's signature over (task, data id, party, result digest and size)."""
    if body.party != party.name:
        raise ValueError("an attestation names its signer")
    return SignedAttestation(body=body, signature=b64e(party.sign_key.sign(_attest_bytes(body))))


def verify_attestation(signed: SignedAttestation, party: PublicIdentity, task_id: str, data_id: str) -> None:
    """Refuse unless ``party`` signed this attestation for exactly this task and data id."""
    b = signed.body
    if b.party != party.name or b.task_id != task_id or b.data_id != data_id:
        raise EnvelopeError(
            403,
            f"result attested by {b.party!r} for leg ({b.task_id}, {b.data_id}); expected "
            f"{party.name!r} for ({task_id}, {data_id})",
        )
    try:
        party.sign_pub.verify(b64d(signed.signature), _attest_bytes(b))
    except InvalidSignature as exc:
        raise EnvelopeError(401, f"attestation is not signed by party {party.name!r}") from exc
