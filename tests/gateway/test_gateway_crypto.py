"""Envelopes, the authentication gate, replay protection and provisioning (no network)."""

from __future__ import annotations

import json
import stat
import time
from pathlib import Path

import pytest
from cryptography import x509
from pydantic import ValidationError

from trainmaster.errors import UserError
from trainmaster.gateway.crypto.tlsid import PeerIdentity
from trainmaster.gateway.crypto.envelope import EnvelopeError, Identity, b64d, b64e, make_header, seal
from trainmaster.gateway.crypto.gate import EnvelopeGate
from trainmaster.gateway.models import DataTransfer, Envelope, MessageKind
from trainmaster.gateway.crypto.provision import init_deployment, load_identity, load_roster
from trainmaster.gateway.config import load_config
from trainmaster.gateway.crypto.replay import SeenTable

GATEWAY, PARTY = Identity.generate("gateway"), Identity.generate("a")
ROSTER = {"gateway": GATEWAY.public("gateway"), "a": PARTY.public("party")}
PAYLOAD = {"task_id": "t1", "data_id": "m1", "call": {"rule": "row_count", "params": {}}}


def _gate(now: float | None = None) -> EnvelopeGate:
    return EnvelopeGate(
        PARTY, ROSTER, SeenTable("sqlite://"), skew_s=30.0, clock=(lambda: now) if now is not None else time.time
    )


def _env(sender: Identity = GATEWAY, now: float | None = None, ttl: float = 60.0, payload: dict = PAYLOAD) -> Envelope:
    h = make_header(sender.name, "a", "data_transfer", "t1", "m1", ttl, now=now)
    return seal(sender, ROSTER["a"], h, payload)


def _open(gate: EnvelopeGate, env: Envelope) -> DataTransfer:
    sender = gate.roster.get(env.header.sender)
    peer = PeerIdentity(sender.name, sender.role) if sender else None
    return gate.open(env, MessageKind.data_transfer, {"gateway"}, DataTransfer, peer=peer)[1]


def test_envelope_round_trip_decrypts_to_the_payload() -> None:
    """Sealing: X25519 + HKDF + AES-GCM to the recipient, Ed25519 signature by the sender."""
    assert _open(_gate(), _env()).call.rule == "row_count"


def test_payload_is_encrypted_on_the_wire() -> None:
    """Payload confidentiality: nothing of the plaintext appears in the serialized envelope."""
    wire = _env().model_dump_json()
    assert "row_count" not in wire and "row_count" not in b64d(json.loads(wire)["ciphertext"]).decode("latin1")


def _flip(text: str, index: int = 5) -> str:
    raw = bytearray(b64d(text))
    raw[index % len(raw)] ^= 0x01
    return b64e(bytes(raw))


@pytest.mark.parametrize(
    "field",
    [
        "msg_id",
        "kind",
        "task_id",
        "data_id",
        "sender_known",
        "issued_at",
        "expires_at",
        "eph_pub",
        "nonce",
        "ciphertext",
        "signature",
    ],
)
def test_one_flipped_bit_in_any_field_is_refused(field: str) -> None:
    """Integrity: one changed bit in any header field or any envelope part fails signature checks."""
    env = _env()
    d = env.model_dump(mode="json")
    h = d["header"]
    if field == "msg_id":
        h["msg_id"] = ("1" if h["msg_id"][0] == "0" else "0") + h["msg_id"][1:]
    elif field == "kind":
        h["kind"] = "data_receive"
    elif field == "task_id":
        h["task_id"] = "t0"
    elif field == "data_id":
        h["data_id"] = "m0"
    elif field == "sender_known":
        ROSTER.setdefault("b", Identity.generate("b").public("gateway"))
        h["sender"] = "b"
    elif field in ("issued_at", "expires_at"):
        h[field] = h[field] + 0.001
    else:
        d[field] = _flip(d[field])
    gate = _gate()
    with pytest.raises(EnvelopeError) as exc:
        _open(gate, Envelope.model_validate(d))
    assert exc.value.status in (400, 401)
    assert gate.seen.count() == 0  # nothing recorded for a refused message


def test_stripped_signature_is_a_validation_error() -> None:
    """Strict models: an envelope without its signature does not even parse."""
    d = _env().model_dump(mode="json")
    del d["signature"]
    with pytest.raises(ValidationError):
        Envelope.model_validate(d)
    d["signature"] = ""
    with pytest.raises(ValidationError):
        Envelope.model_validate(d)


def test_replay_inside_window_is_refused_once_seen() -> None:
    """Replay protection (inside the window): the seen-message table accepts a message id once."""
    gate, env = _gate(), _env()
    _open(gate, env)
    with pytest.raises(EnvelopeError) as exc:
        _open(gate, env)
    assert exc.value.status == 409 and "replayed" in exc.value.reason


def test_replay_outside_window_is_refused_as_expired() -> None:
    """Replay protection (outside the window): an expired message is refused even when the seen
    table no longer holds its id; a message from the future beyond the skew is refused too."""
    now = time.time()
    with pytest.raises(EnvelopeError, match="expired"):
        _open(_gate(), _env(now=now - 600, ttl=60))
    with pytest.raises(EnvelopeError, match="future"):
        _open(_gate(), _env(now=now + 120))
    _open(_gate(now=now), _env(now=now + 10))  # inside the skew window: accepted


def test_unknown_sender_and_wrong_role_and_wrong_recipient_are_refused() -> None:
    """Roster: unregistered identities, senders of the wrong role and misaddressed messages are refused."""
    mallory = Identity.generate("mallory")
    h = make_header("mallory", "a", "data_transfer", "t1", "m1")
    env = seal(mallory, ROSTER["a"], h, PAYLOAD)
    with pytest.raises(EnvelopeError, match="unknown sender"):
        _open(_gate(), env)
    other = Identity.generate("a")  # a second party-role identity impersonating the gateway role
    with pytest.raises(EnvelopeError, match="may not send"):
        EnvelopeGate(
            GATEWAY, {"a": other.public("party"), "gateway": GATEWAY.public("gateway")}, SeenTable("sqlite://"), 30
        ).open(
            seal(other, GATEWAY.public("gateway"), make_header("a", "gateway", "data_transfer", "t1", "m1"), PAYLOAD),
            MessageKind.data_transfer,
            {"gateway"},
            DataTransfer,
        )
    with pytest.raises(EnvelopeError, match="addressed"):
        EnvelopeGate(GATEWAY, ROSTER, SeenTable("sqlite://"), 30).open(
            _env(), MessageKind.data_transfer, {"gateway"}, DataTransfer
        )


def test_payload_must_match_signed_header_and_strict_model() -> None:
    """Binding: the payload's task/data ids must equal the signed header's; unknown fields refused."""
    with pytest.raises(EnvelopeError, match="does not match"):
        _open(_gate(), _env(payload={**PAYLOAD, "data_id": "m2"}))
    with pytest.raises(EnvelopeError, match="invalid data_transfer payload"):
        _open(_gate(), _env(payload={**PAYLOAD, "code": "import os"}))


def test_provisioning_writes_ca_certs_keys_roster(tmp_path: Path) -> None:
    """Provisioning: a private CA, TLS certs chained to it, owner-only key files, a roster."""
    configs = init_deployment(tmp_path / "d", ["a", "b", "c"], port_base=30000)
    assert set(configs) == {"gateway", "operator", "initiator", "a", "b", "c"}
    roster = load_roster(tmp_path / "d" / "roster.json")
    assert {n: r.role for n, r in roster.items()} == {
        "gateway": "gateway",
        "operator": "operator",
        "initiator": "initiator",
        "a": "party",
        "b": "party",
        "c": "party",
    }
    ca = x509.load_pem_x509_certificate((tmp_path / "d" / "ca" / "ca.pem").read_bytes())
    for name in configs:
        cfg = load_config(configs[name])
        leaf = x509.load_pem_x509_certificate(Path(cfg.cert).read_bytes())
        leaf.verify_directly_issued_by(ca)
        for secret in (cfg.key, cfg.sign_key, cfg.enc_key):
            assert stat.S_IMODE(Path(secret).stat().st_mode) == 0o600
        ident = load_identity(cfg)
        assert roster[name].enc_pub_raw == ident.public(cfg.role).enc_pub_raw
    with pytest.raises(UserError):
        init_deployment(tmp_path / "d", ["a"])  # never overwrite a deployment
    with pytest.raises(UserError):
        init_deployment(tmp_path / "e", ["a", "../b"])
