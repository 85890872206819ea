"""The authentication gate every inbound envelope passes before any handler sees it.

Order matters: recipient and sender are checked against the roster, then the signature, then the
clock window, then the seen-message table, and only then is the payload decrypted and parsed into
its strict model. A failure at any step raises :class:`EnvelopeError` and nothing is recorded
except (after a valid signature) the message id itself.
"""

from __future__ import annotations

import time
from typing import Callable, TypeVar

from pydantic import BaseModel, ValidationError

from trainmaster.gateway.crypto.envelope import EnvelopeError, Identity, PublicIdentity, decrypt, verify
from trainmaster.gateway.models import Envelope, MessageKind
from trainmaster.gateway.crypto.replay import SeenTable
from trainmaster.gateway.crypto.tlsid import PeerIdentity

M = TypeVar("M", bound=BaseModel)

MAX_TTL_S = 86400.0
RESULT_TTL_S = MAX_TTL_S - 60.0
"""Stored results stay openable for a day, so an initiator can fetch them again after a crash."""


class EnvelopeGate:
    def __init__(
        self,
        me: Identity,
        roster: dict[str, PublicIdentity],
        seen: SeenTable,
        skew_s: float,
        clock: Callable[[], float] = time.time,
    ):
        self.me, self.roster, self.seen, self.skew_s, self.clock = me, roster, seen, skew_s, clock
        self.rejected: dict[int, int] = {}

    def _refuse(self, status: int, reason: str) -> EnvelopeError:
        self.rejected[status] = self.rejected.get(status, 0) + 1
        return EnvelopeError(status, reason)

    def open(
        self,
        env: Envelope,
        kind: MessageKind,
        sender_roles: set[str],
        model: type[M],
        peer: PeerIdentity | None = None,
        check_peer: bool = True,
        once: bool = True,
    ) -> tuple[PublicIdentity, M]:
        """Authenticate, de-duplicate and decrypt ``env``; return the sender and the parsed payload.

        A service passes the connection's verified TLS ``peer``: the envelope's sender must be that
        very identity with that role (item 6), so one member's channel cannot carry another's
        signed messages. Only the initiator, which opens what its own gateway relays, passes
        ``check_peer=False``, and ``once=False`` for a leg's stored outcome, which is the same
        envelope each time it is fetched (what it is bound to, task and data id, is checked instead).
        """
        h = env.header
        if h.kind != kind:
            raise self._refuse(400, f"expected a {kind.value} message, got {h.kind.value}")
        if h.recipient != self.me.name:
            raise self._refuse(403, f"message is addressed to {h.recipient!r}, not {self.me.name!r}")
        sender = self.roster.get(h.sender)
        if sender is None:
            raise self._refuse(403, f"unknown sender {h.sender!r}: not in the roster")
        if sender.role not in sender_roles:
            raise self._refuse(403, f"sender {h.sender!r} (role {sender.role}) may not send {kind.value}")
        if check_peer and (peer is None or peer.name != sender.name or peer.role != sender.role):
            got = f"{peer.name!r} (role {peer.role})" if peer else "no trainmaster identity"
            raise self._refuse(
                403,
                f"message from {h.sender!r} arrived over a TLS connection of {got}; "
                "each member sends only its own messages, with its own certificate",
            )
        try:
            verify(env, sender)
        except EnvelopeError as exc:
            raise self._refuse(exc.status, exc.reason) from exc
        now = self.clock()
        if h.issued_at > now + self.skew_s:
            raise self._refuse(
                401, f"message issued {h.issued_at - now:.1f}s in the future (skew window {self.skew_s}s)"
            )
        if now > h.expires_at + self.skew_s or h.expires_at - h.issued_at > MAX_TTL_S or h.expires_at < h.issued_at:
            raise self._refuse(401, "message expired or outside the accepted window")
        if once and not self.seen.first_sighting(h.msg_id, h.sender, h.expires_at, now, self.skew_s):
            raise self._refuse(409, f"replayed message {h.msg_id}")
        try:
            payload = decrypt(env, self.me)
        except EnvelopeError as exc:
            raise self._refuse(exc.status, exc.reason) from exc
        try:
            parsed = model.model_validate(payload)
        except ValidationError as exc:
            raise self._refuse(
                400,
                f"invalid {kind.value} payload: {exc.error_count()} error(s): "
                + "; ".join(f"{'.'.join(map(str, e['loc']))}: {e['msg']}" for e in exc.errors()[:5]),
            ) from exc
        task_id = getattr(parsed, "task_id", h.task_id)
        data_id = getattr(parsed, "data_id", h.data_id)
        if task_id != h.task_id or (h.data_id != "*" and data_id != h.data_id):
            raise self._refuse(400, "payload task/data id does not match the signed header")
        return sender, parsed
