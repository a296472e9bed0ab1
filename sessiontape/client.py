"""A Python client for sessiontape's native HTTP API (docs/protocols/http.md), sync and async.

Usage::

    from sessiontape import Client

    with Client("http://127.0.0.1:8080", token="...") as st:
        doc = st.create_session(label="demo")
        sid = doc["id"]
        st.append(sid, text="Hello")
        for update in st.generate_stream(sid, max_tokens=16, seed=1):
            print(update.document["history"]["text"])        # the live session document
        child = st.fork(sid, at_position=3)
        st.feedback(sid, {"score": 1})
        events = st.export(sid)                             # the session's log, one dict per event
        st.close_session(sid)

``AsyncClient`` has the same methods as coroutines and async iterators.

Streams carry the session document as a snapshot and then JSON Patch+
patches (docs/protocols/json-patch-plus.md); the client applies them and
yields :class:`Update` objects whose ``document`` is the live document
(updated in place: copy it to keep a version). :meth:`Client.tail` follows a
session and resumes a dropped connection by itself with ``Last-Event-ID``,
losing and repeating nothing. A POSTed generation stream is not resumed:
the server stops a generation whose stream is dropped; to follow a
generation across reconnects, start it with :meth:`Client.generate_background`
and :meth:`Client.tail` it with ``until_generation``.

Errors are typed (:mod:`sessiontape.errors`): a refused request raises an
:class:`~sessiontape.errors.APIError` subclass chosen by its code and status;
a server that cannot be reached raises :class:`~sessiontape.errors.TransportError`.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Iterator, Mapping
from typing import Any

import httpx

from sessiontape.client_requests import (
    GENERATE_FIELDS,
    Call,
    Calls,
    auth_headers,
    parse,
    session_path,
)
from sessiontape.errors import TransportError, from_response
from sessiontape.streams import SSE, Follow, SSEDecoder, Update

__all__ = [
    "DEFAULT_URL",
    "GENERATE_FIELDS",
    "SSE",
    "AsyncClient",
    "Call",
    "Client",
    "SSEDecoder",
    "Update",
]

# The client's names live here for their users, whichever module writes them (as httpx
# gives its names the module ``httpx``): reprs, pickles and docs say sessiontape.client.
for _cls in (Call, SSE, SSEDecoder, Update):
    _cls.__module__ = __name__

DEFAULT_URL = "http://127.0.0.1:8080"


# -- sync ---------------------------------------------------------------------------


class Client:
    """The native API over a blocking ``httpx.Client``.

    ``retries`` bounds consecutive failed reconnects of :meth:`tail` (waiting
    ``backoff_s``, doubling, between them); ``stream_timeout`` is how long a
    stream may be silent (the server sends a heartbeat every ``heartbeat_s``,
    15 s by default) before it counts as dropped.
    """

    def __init__(
        self,
        base_url: str = DEFAULT_URL,
        *,
        token: str | None = None,
        timeout: float = 30.0,
        stream_timeout: float = 60.0,
        retries: int = 5,
        backoff_s: float = 0.2,
    ) -> None:
        self._http = httpx.Client(base_url=base_url, headers=auth_headers(token), timeout=timeout)
        self.stream_timeout = stream_timeout
        self.retries = retries
        self.backoff_s = backoff_s

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *_: object) -> None:
        self.close()

    def close(self) -> None:
        """Close the client's connections (not a session: see :meth:`close_session`)."""
        self._http.close()

    def _send(self, call: Call) -> Any:
        try:
            response = self._http.request(
                call.method, call.path, json=call.json, params=call.params
            )
        except httpx.TransportError as exc:
            raise TransportError(f"{call.method} {call.path}: {exc!r}") from exc
        return parse(call, response)

    # sessions

    def health(self) -> dict[str, Any]:
        return dict(self._send(Calls.health()))

    def create_session(
        self,
        *,
        protocol: str | None = None,
        label: str | None = None,
        mode: str | None = None,
        ttl_s: float | None = None,
        eos_token_ids: list[int] | None = None,
        meta: Mapping[str, Any] | None = None,
    ) -> dict[str, Any]:
        """Open a session; returns its document (``["id"]`` is the session id)."""
        return dict(self._send(Calls.create(protocol, label, mode, ttl_s, eos_token_ids, meta)))

    def list_sessions(
        self,
        *,
        status: str | None = None,
        protocol: str | None = None,
        parent: str | None = None,
        limit: int | None = None,
        offset: int | None = None,
    ) -> list[dict[str, Any]]:
        return list(self._send(Calls.listing(status, protocol, parent, limit, offset))["sessions"])

    def get_session(self, session_id: str, *, version: int | None = None) -> dict[str, Any]:
        return dict(self._send(Calls.get(session_id, version)))

    def append(
        self,
        session_id: str,
        *,
        text: str | None = None,
        tokens: list[int] | None = None,
        offset: int | None = None,
        truncating: bool | None = None,
    ) -> dict[str, Any]:
        """Append text or tokens; returns ``{session_id, length, version}``."""
        return dict(self._send(Calls.append(session_id, text, tokens, offset, truncating)))

    def generate(self, session_id: str, **params: Any) -> dict[str, Any]:
        """Generate and wait; returns ``{session_id, generation, version}`` (``generation`` as in the document)."""
        return dict(self._send(Calls.generate(session_id, params, stream=False)))

    def generate_background(self, session_id: str, **params: Any) -> str:
        """Start a generation that outlives this request; returns its id (follow it with :meth:`tail`)."""
        return str(self._send(Calls.generate(session_id, params, background=True))["generation_id"])

    def generate_stream(
        self,
        session_id: str,
        *,
        last_event_id: int | None = None,
        document: dict[str, Any] | None = None,
        **params: Any,
    ) -> Iterator[Update]:
        """Generate, yielding the live document: the snapshot, then one update per committed event.

        With the ``document`` of an earlier stream and its ``last_event_id``
        (both, or neither) no snapshot is sent: the updates continue that
        document, so a turn costs the same however long the session has grown.
        """
        follow = Follow.resume(None, last_event_id, document)
        call = Calls.generate(session_id, params)
        try:
            with self._http.stream(
                call.method,
                call.path,
                json=call.json,
                headers=follow.headers(),
                timeout=self._stream_timeout(),
            ) as r:
                if r.status_code >= 400:
                    r.read()
                    raise from_response(r.status_code, r.content)
                yield from follow.lines(r.iter_lines())
        except httpx.TransportError as exc:
            raise TransportError(f"generate stream of {session_id}: {exc!r}") from exc

    def tail(
        self,
        session_id: str,
        *,
        until_generation: str | None = None,
        last_event_id: int | None = None,
        document: dict[str, Any] | None = None,
    ) -> Iterator[Update]:
        """Follow a session's document live until it ends (or ``until_generation`` finishes).

        A dropped connection is resumed with ``Last-Event-ID``: no update is
        lost or repeated. To resume a stream you read before, pass both the
        ``last_event_id`` and the ``document`` you had then.
        """
        follow = Follow.resume(until_generation, last_event_id, document)
        failures = 0
        while not follow.done:
            try:
                with self._http.stream(
                    "GET",
                    session_path(session_id, "/events"),
                    headers=follow.headers(),
                    timeout=self._stream_timeout(),
                ) as r:
                    if r.status_code >= 400:
                        r.read()
                        raise from_response(r.status_code, r.content)
                    for update in follow.lines(r.iter_lines()):
                        failures = 0
                        yield update
                        if follow.done:
                            return
                failures = _closed_early(failures, self.retries, session_id)
            except httpx.TransportError as exc:
                failures += 1
                if failures > self.retries:
                    raise TransportError(
                        f"tail of {session_id}: {failures} reconnects failed: {exc!r}"
                    ) from exc
            follow.decoder = SSEDecoder()
            if not follow.done and failures:
                time.sleep(min(self.backoff_s * 2 ** (failures - 1), 5.0))

    def _stream_timeout(self) -> httpx.Timeout:
        return httpx.Timeout(self._http.timeout.connect, read=self.stream_timeout)

    def fork(
        self,
        session_id: str,
        *,
        at_position: int | None = None,
        at_version: int | None = None,
        label: str | None = None,
        protocol: str | None = None,
    ) -> dict[str, Any]:
        """A new session continuing this one at a token position or event version; returns its document."""
        return dict(self._send(Calls.fork(session_id, at_position, at_version, label, protocol)))

    def close_session(self, session_id: str, *, reason: str | None = None) -> dict[str, Any]:
        """Close a session (a no-op on a closed one); returns its document."""
        return dict(self._send(Calls.close(session_id, reason)))

    def feedback(self, session_id: str, feedback: Mapping[str, Any]) -> dict[str, Any]:
        return dict(self._send(Calls.feedback(session_id, feedback)))

    def export(self, session_id: str) -> list[dict[str, Any]]:
        """The session's events, as ``sessiontape export`` writes them (one dict per event)."""
        return list(self._send(Calls.export(session_id)))

    def audit(self, session_id: str) -> dict[str, Any]:
        return dict(self._send(Calls.audit(session_id)))


def _closed_early(failures: int, retries: int, session_id: str) -> int:
    """A stream the server closed before the session ended: reconnect, but not forever."""
    failures += 1
    if failures > retries:
        raise TransportError(
            f"tail of {session_id}: the server closed the stream {failures} times in a row"
        )
    return failures


# -- async --------------------------------------------------------------------------


class AsyncClient:
    """The native API over ``httpx.AsyncClient``: the methods of :class:`Client`, awaitable."""

    def __init__(
        self,
        base_url: str = DEFAULT_URL,
        *,
        token: str | None = None,
        timeout: float = 30.0,
        stream_timeout: float = 60.0,
        retries: int = 5,
        backoff_s: float = 0.2,
    ) -> None:
        self._http = httpx.AsyncClient(
            base_url=base_url, headers=auth_headers(token), timeout=timeout
        )
        self.stream_timeout = stream_timeout
        self.retries = retries
        self.backoff_s = backoff_s

    async def __aenter__(self) -> AsyncClient:
        return self

    async def __aexit__(self, *_: object) -> None:
        await self.aclose()

    async def aclose(self) -> None:
        await self._http.aclose()

    async def _send(self, call: Call) -> Any:
        try:
            response = await self._http.request(
                call.method, call.path, json=call.json, params=call.params
            )
        except httpx.TransportError as exc:
            raise TransportError(f"{call.method} {call.path}: {exc!r}") from exc
        return parse(call, response)

    async def health(self) -> dict[str, Any]:
        return dict(await self._send(Calls.health()))

    async def create_session(
        self,
        *,
        protocol: str | None = None,
        label: str | None = None,
        mode: str | None = None,
        ttl_s: float | None = None,
        eos_token_ids: list[int] | None = None,
        meta: Mapping[str, Any] | None = None,
    ) -> dict[str, Any]:
        return dict(
            await self._send(Calls.create(protocol, label, mode, ttl_s, eos_token_ids, meta))
        )

    async def list_sessions(
        self,
        *,
        status: str | None = None,
        protocol: str | None = None,
        parent: str | None = None,
        limit: int | None = None,
        offset: int | None = None,
    ) -> list[dict[str, Any]]:
        return list(
            (await self._send(Calls.listing(status, protocol, parent, limit, offset)))["sessions"]
        )

    async def get_session(self, session_id: str, *, version: int | None = None) -> dict[str, Any]:
        return dict(await self._send(Calls.get(session_id, version)))

    async def append(
        self,
        session_id: str,
        *,
        text: str | None = None,
        tokens: list[int] | None = None,
        offset: int | None = None,
        truncating: bool | None = None,
    ) -> dict[str, Any]:
        return dict(await self._send(Calls.append(session_id, text, tokens, offset, truncating)))

    async def generate(self, session_id: str, **params: Any) -> dict[str, Any]:
        return dict(await self._send(Calls.generate(session_id, params, stream=False)))

    async def generate_background(self, session_id: str, **params: Any) -> str:
        call = Calls.generate(session_id, params, background=True)
        return str((await self._send(call))["generation_id"])

    async def generate_stream(
        self,
        session_id: str,
        *,
        last_event_id: int | None = None,
        document: dict[str, Any] | None = None,
        **params: Any,
    ) -> AsyncIterator[Update]:
        follow = Follow.resume(None, last_event_id, document)
        try:
            call = Calls.generate(session_id, params)
            async with self._http.stream(
                call.method,
                call.path,
                json=call.json,
                headers=follow.headers(),
                timeout=self._stream_timeout(),
            ) as r:
                if r.status_code >= 400:
                    await r.aread()
                    raise from_response(r.status_code, r.content)
                async for line in r.aiter_lines():
                    for update in follow.lines((line,)):
                        yield update
        except httpx.TransportError as exc:
            raise TransportError(f"generate stream of {session_id}: {exc!r}") from exc

    async def tail(
        self,
        session_id: str,
        *,
        until_generation: str | None = None,
        last_event_id: int | None = None,
        document: dict[str, Any] | None = None,
    ) -> AsyncIterator[Update]:
        follow = Follow.resume(until_generation, last_event_id, document)
        failures = 0
        while not follow.done:
            try:
                async with self._http.stream(
                    "GET",
                    session_path(session_id, "/events"),
                    headers=follow.headers(),
                    timeout=self._stream_timeout(),
                ) as r:
                    if r.status_code >= 400:
                        await r.aread()
                        raise from_response(r.status_code, r.content)
                    async for line in r.aiter_lines():
                        for update in follow.lines((line,)):
                            failures = 0
                            yield update
                            if follow.done:
                                return
                failures = _closed_early(failures, self.retries, session_id)
            except httpx.TransportError as exc:
                failures += 1
                if failures > self.retries:
                    raise TransportError(
                        f"tail of {session_id}: {failures} reconnects failed: {exc!r}"
                    ) from exc
            follow.decoder = SSEDecoder()
            if not follow.done and failures:
                await asyncio.sleep(min(self.backoff_s * 2 ** (failures - 1), 5.0))

    def _stream_timeout(self) -> httpx.Timeout:
        return httpx.Timeout(self._http.timeout.connect, read=self.stream_timeout)

    async def fork(
        self,
        session_id: str,
        *,
        at_position: int | None = None,
        at_version: int | None = None,
        label: str | None = None,
        protocol: str | None = None,
    ) -> dict[str, Any]:
        return dict(
            await self._send(Calls.fork(session_id, at_position, at_version, label, protocol))
        )

    async def close_session(self, session_id: str, *, reason: str | None = None) -> dict[str, Any]:
        return dict(await self._send(Calls.close(session_id, reason)))

    async def feedback(self, session_id: str, feedback: Mapping[str, Any]) -> dict[str, Any]:
        return dict(await self._send(Calls.feedback(session_id, feedback)))

    async def export(self, session_id: str) -> list[dict[str, Any]]:
        return list(await self._send(Calls.export(session_id)))

    async def audit(self, session_id: str) -> dict[str, Any]:
        return dict(await self._send(Calls.audit(session_id)))
