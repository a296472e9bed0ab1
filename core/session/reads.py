"""The runtime's read API: what transports ask of the log (they never touch it directly).

:class:`LogReads` is a part of :class:`sessiontape.core.runtime.Runtime` (``runtime.reads``): every
method reads committed events, the sessions index or blobs through the
runtime's :class:`~sessiontape.core.log.EventLog`.
"""

from __future__ import annotations

from collections.abc import AsyncIterator

from sessiontape.core import document
from sessiontape.core.events import Event
from sessiontape.core.log import EventLog, SessionRow
from sessiontape.core.session.state import SessionState


class LogReads:
    """Reads of the log, for transports (the runtime's ``reads``)."""

    def __init__(self, log_: EventLog) -> None:
        self.log = log_

    def subscribe(
        self, from_position: int = 0, session_id: str | None = None, *, with_forks: bool = False
    ) -> AsyncIterator[Event]:
        """Committed events after ``from_position`` (catch-up, then live): every
        session's, or one session's (``with_forks``: and the opening of each fork of it)."""
        return self.log.subscribe(from_position, session_id, with_forks=with_forks)

    def subscribe_batches(
        self, from_position: int = 0, session_id: str | None = None, *, with_forks: bool = False
    ) -> AsyncIterator[list[Event]]:
        """:meth:`subscribe`'s events, each time all that are ready: a committed run of
        tokens comes as one list, so a transport can send it in one write."""
        return self.log.subscribe_batches(from_position, session_id, with_forks=with_forks)

    async def read_events(
        self, session_id: str, from_version: int = 1, to_version: int | None = None
    ) -> list[Event]:
        """A session's committed events in version order, ``from_version`` to ``to_version`` inclusive
        (empty for an unknown session)."""
        return await self.log.read(session_id, from_version, to_version)

    async def read_after(
        self, after_position: int = 0, *, limit: int = 1000, session_id: str | None = None
    ) -> list[Event]:
        """Committed events with position > ``after_position`` in position order (one session's, or all)."""
        return await self.log.read_all(after_position, limit=limit, session_id=session_id)

    async def last_position(self) -> int:
        """The position of the newest committed event (0 for an empty log): a resume cursor."""
        return await self.log.last_position()

    async def position_exists(self, position: int) -> bool:
        """Whether the log reaches ``position`` (a client's resume cursor): from memory when
        this process has committed or seen that far, else read."""
        return position <= self.log.known_end() or position <= await self.log.last_position()

    async def session_row(self, session_id: str) -> SessionRow:
        """The session's row in the sessions index; raises SessionNotFound."""
        return await self.log.get_session(session_id)

    async def list_sessions(
        self,
        *,
        status: str | None = None,
        protocol: str | None = None,
        parent_id: str | None = None,
        limit: int = 1000,
        offset: int = 0,
        newest_first: bool = True,
        active_after: float | None = None,
    ) -> list[SessionRow]:
        """Rows of the sessions index (see :meth:`sessiontape.core.log.EventLog.list_sessions`)."""
        return await self.log.list_sessions(
            status=status,
            protocol=protocol,
            parent_id=parent_id,
            limit=limit,
            offset=offset,
            newest_first=newest_first,
            active_after=active_after,
        )

    async def get_blob(self, sha256: str) -> bytes | None:
        """A content-addressed payload (chunk or image bytes), None when the log has none."""
        return await self.log.get_blob(sha256)

    @property
    def inline_max_bytes(self) -> int:
        """Payloads larger than this are stored as blobs, not in their event."""
        return self.log.inline_max_bytes

    async def fork_base(self, first: Event) -> SessionState | None:
        """The state a fork starts from, given the fork's first event; None when it is no fork."""
        return await document.fork_base(self.log, first)
