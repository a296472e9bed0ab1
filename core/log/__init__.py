"""The persistent event log (SQLAlchemy async: SQLite or PostgreSQL)."""

from sessiontape.core.log.store import EventLog, SessionRow

__all__ = ["EventLog", "SessionRow"]
