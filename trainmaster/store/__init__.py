"""The state store: SQLAlchemy models and repository functions (SQLite default, any URL by --db)."""

from trainmaster.store.db import default_url, home, make_engine, session_factory

__all__ = ["default_url", "home", "make_engine", "session_factory"]
