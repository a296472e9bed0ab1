"""One serving process per SQLite file.

SQLite takes one writer: a second ``sessiontape serve`` on the same file would fight the
first for its write lock and fork its sessions' engine state. The server holds an
exclusive ``flock`` on the database file while it serves; a second one finds it held and
exits at once with :class:`~sessiontape.core.errors.DatabaseInUse`. Readers (``sessions
ls``, ``replay``, ``audit``) take no such lock. PostgreSQL needs none: replicas share it.

``flock`` locks are apart from the POSIX ``fcntl`` locks SQLite takes, so they never meet;
the descriptor stays open until the server has closed its database (closing a descriptor
of the file drops the process's POSIX locks on it, SQLite's included).
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator

from sqlalchemy.engine import make_url

from sessiontape.core.errors import DatabaseInUse


def sqlite_file(url: str) -> str | None:
    """The file a SQLite URL names; None for other databases and in-memory ones."""
    parsed = make_url(url)
    if parsed.get_backend_name() != "sqlite":
        return None
    path = parsed.database or ""
    if not path or path == ":memory:" or path.startswith("file:"):
        return None
    return path


@contextlib.contextmanager
def serving(url: str) -> Iterator[None]:
    """Hold the serving lock of ``url``'s SQLite file (nothing for other databases)."""
    path = sqlite_file(url)
    try:
        import fcntl
    except ImportError:  # not a POSIX system: no lock to take
        path = None
    if path is None:
        yield
        return
    created = not os.path.exists(path)
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise DatabaseInUse(
                f"another sessiontape server is serving {path} (one server per SQLite file;"
                " share a PostgreSQL database between several)"
            ) from None
        yield
    finally:
        # a server that failed before its database was made leaves no empty file behind
        if created and os.fstat(fd).st_size == 0:
            with contextlib.suppress(OSError):
                os.unlink(path)
        os.close(fd)
