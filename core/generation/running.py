"""Which sessions generate now (one generation a session), the stops asked of them, and
their ends, which an abort waits for."""

from __future__ import annotations

import asyncio


class RunningGenerations:
    """The running generations, by session id (see the module docstring)."""

    def __init__(self) -> None:
        #: generating sessions -> set when their generation ends
        self._ended: dict[str, asyncio.Event] = {}
        self._stop: set[str] = set()

    def __contains__(self, session_id: object) -> bool:
        return session_id in self._ended

    def __len__(self) -> int:
        return len(self._ended)

    def begin(self, session_id: str) -> None:
        self._ended[session_id] = asyncio.Event()

    def end(self, session_id: str) -> None:
        self._stop.discard(session_id)
        ended = self._ended.pop(session_id, None)
        if ended is not None:
            ended.set()

    def stop_requested(self, session_id: str) -> bool:
        return session_id in self._stop

    async def stop(self, session_id: str) -> None:
        """Ask the session's generation to stop (finished as ``aborted``) and wait for its
        end; nothing to do when none runs."""
        ended = self._ended.get(session_id)
        if ended is not None:
            self._stop.add(session_id)
            await ended.wait()
