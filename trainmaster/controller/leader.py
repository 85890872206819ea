"""Leader election for several controller servers sharing one store (PostgreSQL).

Exactly one server reconciles; the others serve reads and accept submissions into the queue. As
Kubernetes controllers do with a ``Lease``: the leader renews a lease row every ``renew``
seconds; a candidate takes it over only once it has expired (``duration`` after the last
renewal), with a conditional UPDATE that one candidate alone can win, and the takeover bumps the
**fencing token**. Each reconcile transaction first re-asserts ``(holder, token)`` with an
UPDATE of the lease row, which takes the row's lock: a leader that was paused past its lease
(GC, SIGSTOP, a network partition) finds its token gone and its pass is rolled back, and a
takeover that races a pass waits for that pass's commit. Clocks: expiry is judged on the
candidate's clock against the time the holder wrote, so servers need clocks synchronised to well
within ``duration`` (NTP does that; the default is 3.5 s).
"""

from __future__ import annotations

import logging
import os
import socket
import threading
import time
import uuid
from dataclasses import dataclass

from sqlalchemy import event, insert, update
from sqlalchemy.exc import IntegrityError, OperationalError
from sqlalchemy.orm import Session, sessionmaker

from trainmaster.store.models import LeaseRow

log = logging.getLogger(__name__)
LEASE = "controller"


class LeaseLost(RuntimeError):
    """This server's fencing token is no longer the lease's: it must stop writing."""


@dataclass(frozen=True)
class LeaseOptions:
    duration: float = 3.5  # seconds a lease holds without renewal
    renew: float = 1.0  # seconds between renewals (and between a candidate's tries): takeover <= 4.5 s


def server_identity() -> str:
    """A name for this server process that no other process shares, readable by people."""
    return f"{socket.gethostname()}-{os.getpid()}-{uuid.uuid4().hex[:6]}"


class LeaderElector:
    """Campaigns for and renews the lease in a background thread; ``token`` is set while leading."""

    def __init__(
        self, sessions: sessionmaker[Session], identity: str | None = None, options: LeaseOptions | None = None
    ):
        self.sessions = sessions
        self.identity = identity or server_identity()
        self.options = options or LeaseOptions()
        self.token: int | None = None
        self.leader: str | None = None  # the current holder, as last read
        self.elected = threading.Event()
        self._stopping = threading.Event()
        self._thread = threading.Thread(target=self._run, name="leader-election", daemon=True)

    @property
    def leading(self) -> bool:
        return self.token is not None

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        """Stop campaigning and give the lease up at once, so a successor need not wait for expiry."""
        self._stopping.set()
        self._thread.join(timeout=self.options.renew + 5)
        if self.token is not None:
            try:
                with self.sessions() as session:
                    session.execute(
                        update(LeaseRow)
                        .where(LeaseRow.name == LEASE, LeaseRow.holder == self.identity, LeaseRow.token == self.token)
                        .values(expires_at=0.0)
                    )
                    session.commit()
            except OperationalError:
                log.warning("could not release the lease on stop; it expires in %ss", self.options.duration)
            self.token = None

    def _run(self) -> None:
        while not self._stopping.is_set():
            try:
                self.try_lead()
            except OperationalError as exc:  # the database is away: we cannot prove we still lead
                if self.token is not None:
                    log.warning("lost contact with the store while leading: %s", exc.orig or exc)
                self._lose("store unreachable")
            self._stopping.wait(self.options.renew)

    def try_lead(self) -> bool:
        """One round: renew while leading, else take over an expired lease. True when leading."""
        now = time.time()
        expires = now + self.options.duration
        with self.sessions() as session:
            if self.token is not None:
                renewed = session.execute(
                    update(LeaseRow)
                    .where(LeaseRow.name == LEASE, LeaseRow.holder == self.identity, LeaseRow.token == self.token)
                    .values(expires_at=expires)
                ).rowcount  # type: ignore[attr-defined]
                session.commit()
                if renewed:
                    return True
                self._lose("the lease was taken over")
            taken = session.execute(
                update(LeaseRow)
                .where(LeaseRow.name == LEASE, LeaseRow.expires_at < now)
                .values(holder=self.identity, token=LeaseRow.token + 1, expires_at=expires, acquired_at=now)
            ).rowcount  # type: ignore[attr-defined]
            if not taken:
                try:
                    session.execute(
                        insert(LeaseRow).values(
                            name=LEASE, holder=self.identity, token=1, expires_at=expires, acquired_at=now
                        )
                    )
                    taken = 1
                except IntegrityError:  # someone holds it (and it has not expired)
                    session.rollback()
            session.commit()
            row = session.get(LeaseRow, LEASE)
            self.leader = row.holder if row else None
            if taken and row is not None and row.holder == self.identity:
                self.token = row.token
                log.info("leading the controller (fencing token %s)", row.token)
                self.elected.set()
                return True
        return False

    def _lose(self, why: str) -> None:
        if self.token is not None:
            log.warning("no longer leading: %s", why)
        self.token = None
        self.elected.clear()

    def fence(self, session: Session) -> None:
        """Make ``session``'s every commit re-assert this server's lease (see the module doc)."""
        event.listen(session, "before_commit", self._assert_lease)

    def _assert_lease(self, session: Session) -> None:
        token = self.token
        if token is None:
            raise LeaseLost("this server does not lead the controller")
        held = session.execute(
            update(LeaseRow)
            .where(LeaseRow.name == LEASE, LeaseRow.holder == self.identity, LeaseRow.token == token)
            .values(holder=self.identity)
        ).rowcount  # type: ignore[attr-defined]
        if not held:
            self._lose("fencing token superseded")
            raise LeaseLost(f"fencing token {token} was superseded: another server leads now")
