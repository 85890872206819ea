"""Alembic migrations of the store's schema (``trainmaster db upgrade``; applied on every start)."""
