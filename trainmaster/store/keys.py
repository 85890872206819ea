"""Secrets shared by every controller of one store, created on first use."""

from __future__ import annotations

import secrets

from sqlalchemy.exc import IntegrityError
from sqlalchemy.orm import Session, sessionmaker

from trainmaster.store.models import KeyRow


def shared_key(sessions: sessionmaker[Session], name: str) -> bytes:
    """The 32-byte key ``name`` of this store; the first caller creates it (two creating at once:
    the insert that loses reads the winner's)."""
    for _ in range(3):
        with sessions() as session:
            row = session.get(KeyRow, name)
            if row is not None:
                return bytes.fromhex(row.value)
            session.add(KeyRow(name=name, value=secrets.token_hex(32)))
            try:
                session.commit()
            except IntegrityError:
                session.rollback()
                continue
    with sessions() as session:
        row = session.get(KeyRow, name)
        if row is None:
            raise RuntimeError(f"the store's key {name!r} could neither be created nor read")
        return bytes.fromhex(row.value)
