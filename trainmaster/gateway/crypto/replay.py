"""Replay protection: the seen-message table every service keeps (a message id is accepted once)."""

from __future__ import annotations

from sqlalchemy import Float, String, Table, delete, insert, select
from sqlalchemy.exc import IntegrityError
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column

from trainmaster.gateway.store import HotPath, make_sessionmaker


class Base(DeclarativeBase):
    pass


class SeenMessage(Base):
    __tablename__ = "seen_messages"
    msg_id: Mapped[str] = mapped_column(String(32), primary_key=True)
    sender: Mapped[str] = mapped_column(String(64))
    expires_at: Mapped[float] = mapped_column(Float, index=True)


class SeenTable:
    """Replay protection: a message id is accepted once; old ids age out past the skew window."""

    def __init__(self, url: str):
        self._sessions = make_sessionmaker(url, Base.metadata)
        self._hot = HotPath(self._sessions.kw["bind"])
        self._table: Table = SeenMessage.__table__  # type: ignore[assignment]  # a mapped class's table
        self._insert = insert(self._table)
        self._last_prune = 0.0

    def first_sighting(self, msg_id: str, sender: str, expires_at: float, now: float, skew_s: float) -> bool:
        """Record ``msg_id`` (committed) and say whether this was its first sighting."""
        if now - self._last_prune > 30:
            with self._hot.tx() as c:
                c.execute(delete(self._table).where(SeenMessage.expires_at < now - 2 * skew_s))
            self._last_prune = now
        try:
            with self._hot.tx() as c:
                c.execute(self._insert, {"msg_id": msg_id, "sender": sender, "expires_at": expires_at})
            return True
        except IntegrityError:
            return False

    def count(self) -> int:
        with self._sessions() as s:
            return len(s.scalars(select(SeenMessage.msg_id)).all())
