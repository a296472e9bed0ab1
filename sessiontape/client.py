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
import json
import time
from collections.abc import AsyncIterator, Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

import httpx

from sessiontape.core.patch import apply_op
from sessiontape.errors import APIError, TransportError, from_body, from_response

DEFAULT_URL = "http://127.0.0.1:8080"

#: the generation fields the server takes (docs/protocols/http.md)
GENERATE_FIELDS = frozenset(
    {
        "max_tokens",
        "temperature",
        "top_p",
        "top_k",
        "seed",
        "stop_token_ids",
        "logprob_top_k",
        "logprob_ranges",
        "readout_ranges",
        "text",
        "tokens",
    }
)


# -- requests (shared by both clients) ----------------------------------------------


@dataclass(frozen=True)
class Call:
    method: str
    path: str
    json: dict[str, Any] | None = None
    params: dict[str, Any] | None = None
    ndjson: bool = False


def _given(**fields: Any) -> dict[str, Any]:
    return {k: v for k, v in fields.items() if v is not None}


def _generation(params: Mapping[str, Any], **mode: Any) -> dict[str, Any]:
    unknown = set(params) - GENERATE_FIELDS
    if unknown:
        raise TypeError(
            f"unknown generation parameters: {sorted(unknown)} (known: {sorted(GENERATE_FIELDS)})"
        )
    return {**_given(**params), **mode}


def _session(sid: str, tail: str = "") -> str:
    return f"/v1/sessions/{sid}{tail}"


class _Calls:
    """The requests behind each method, built once for both clients."""

    @staticmethod
    def create(
        protocol: str | None,
        label: str | None,
        mode: str | None,
        ttl_s: float | None,
        eos_token_ids: list[int] | None,
        meta: Mapping[str, Any] | None,
    ) -> Call:
        return Call(
            "POST",
            "/v1/sessions",
            _given(
                protocol=protocol,
                label=label,
                mode=mode,
                ttl_s=ttl_s,
                eos_token_ids=eos_token_ids,
                meta=None if meta is None else dict(meta),
            ),
        )

    @staticmethod
    def listing(
        status: str | None,
        protocol: str | None,
        parent: str | None,
        limit: int | None,
        offset: int | None,
    ) -> Call:
        return Call(
            "GET",
            "/v1/sessions",
            params=_given(
                status=status, protocol=protocol, parent=parent, limit=limit, offset=offset
            ),
        )

    @staticmethod
    def append(
        sid: str,
        text: str | None,
        tokens: list[int] | None,
        offset: int | None,
        truncating: bool | None,
    ) -> Call:
        if text is None and tokens is None:
            raise TypeError("append needs text or tokens")
        return Call(
            "POST",
            _session(sid, "/append"),
            _given(text=text, tokens=tokens, offset=offset, truncating=truncating),
        )

    @staticmethod
    def fork(
        sid: str,
        at_position: int | None,
        at_version: int | None,
        label: str | None,
        protocol: str | None,
    ) -> Call:
        return Call(
            "POST",
            _session(sid, "/fork"),
            _given(at_position=at_position, at_version=at_version, label=label, protocol=protocol),
        )


@dataclass
class Update:
    """One step of a session-document stream.

    ``kind`` is ``snapshot`` (the whole document), ``patch`` (``patch`` was
    applied to it) or ``end`` (the session ended; ``data`` says how).
    ``position`` is the log position the document is complete up to (the SSE
    event id), ``None`` for ``end``.
    """

    kind: str
    position: int | None
    document: dict[str, Any]
    patch: list[dict[str, Any]] | None = None
    data: Any = None


@dataclass
class SSE:
    event: str = "message"
    data: str = ""
    id: str | None = None


class SSEDecoder:
    """Server-Sent Events from lines (the WHATWG rules this server's streams need)."""

    def __init__(self) -> None:
        self._event = ""
        self._data: list[str] = []
        self._id: str | None = None

    def line(self, line: str) -> SSE | None:
        line = line.rstrip("\r\n")
        if not line:
            if not self._data and not self._event:
                return None
            out = SSE(self._event or "message", "\n".join(self._data), self._id)
            self._event, self._data = "", []
            return out
        if line.startswith(":"):
            return None  # a comment: the server's heartbeat
        name, _, value = line.partition(":")
        value = value[1:] if value.startswith(" ") else value
        if name == "event":
            self._event = value
        elif name == "data":
            self._data.append(value)
        elif name == "id":
            self._id = value
        return None


@dataclass
class _Follow:
    """The document a stream builds, and where to resume it."""

    document: dict[str, Any] | None = None
    last_event_id: int | None = None
    until_generation: str | None = None
    done: bool = False
    decoder: SSEDecoder = field(default_factory=SSEDecoder)

    def headers(self) -> dict[str, str]:
        return {} if self.last_event_id is None else {"Last-Event-ID": str(self.last_event_id)}

    def lines(self, lines: Iterable[str]) -> Iterator[Update]:
        for line in lines:
            sse = self.decoder.line(line)
            if sse is not None:
                update = self.event(sse)
                if update is not None:
                    yield update

    def event(self, sse: SSE) -> Update | None:
        if sse.event == "error":
            self.done = True
            raise from_body(0, _json(sse.data))
        if sse.event == "end":
            self.done = True
            return Update("end", None, self.document or {}, data=_json(sse.data))
        if sse.event not in ("snapshot", "patch"):
            return None
        position = int(sse.id) if sse.id else None
        if sse.event == "snapshot":
            self.document = _json(sse.data)
            update = Update("snapshot", position, self.document)
        else:
            if self.document is None:
                raise APIError(0, "protocol", "a patch arrived before the snapshot")
            ops = _json(sse.data)
            doc: Any = self.document
            for n, op in enumerate(ops):
                doc = apply_op(doc, op, n)
            self.document = doc
            update = Update("patch", position, doc, patch=ops)
        if position is not None:
            self.last_event_id = position
        if self.until_generation is not None and _generation_done(
            update.document, self.until_generation
        ):
            self.done = True
        return update


def _json(data: str) -> Any:
    try:
        return json.loads(data)
    except ValueError as exc:
        raise APIError(
            0, "protocol", f"the server sent an event that is not JSON: {data[:200]!r}"
        ) from exc


def _generation_done(doc: Mapping[str, Any], gid: str) -> bool:
    return any(
        g.get("id") == gid and g.get("status") == "finished" for g in doc.get("generations", ())
    )


def _headers(token: str | None) -> dict[str, str]:
    return {"Authorization": f"Bearer {token}"} if token else {}


def _parse(call: Call, response: httpx.Response) -> Any:
    if response.status_code >= 400:
        raise from_response(response.status_code, response.content)
    if call.ndjson:
        return [json.loads(line) for line in response.text.splitlines() if line.strip()]
    return response.json()


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
        self._http = httpx.Client(base_url=base_url, headers=_headers(token), timeout=timeout)
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
        return _parse(call, response)

    # sessions

    def health(self) -> dict[str, Any]:
        return dict(self._send(Call("GET", "/healthz")))

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
        return dict(self._send(_Calls.create(protocol, label, mode, ttl_s, eos_token_ids, meta)))

    def list_sessions(
        self,
        *,
        status: str | None = None,
        protocol: str | None = None,
        parent: str | None = None,
        limit: int | None = None,
        offset: int | None = None,
    ) -> list[dict[str, Any]]:
        return list(self._send(_Calls.listing(status, protocol, parent, limit, offset))["sessions"])

    def get_session(self, session_id: str, *, version: int | None = None) -> dict[str, Any]:
        return dict(self._send(Call("GET", _session(session_id), params=_given(version=version))))

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
        return dict(self._send(_Calls.append(session_id, text, tokens, offset, truncating)))

    def generate(self, session_id: str, **params: Any) -> dict[str, Any]:
        """Generate and wait; returns ``{session_id, generation, version}`` (``generation`` as in the document)."""
        return dict(
            self._send(
                Call("POST", _session(session_id, "/generate"), _generation(params, stream=False))
            )
        )

    def generate_background(self, session_id: str, **params: Any) -> str:
        """Start a generation that outlives this request; returns its id (follow it with :meth:`tail`)."""
        call = Call("POST", _session(session_id, "/generate"), _generation(params, background=True))
        return str(self._send(call)["generation_id"])

    def generate_stream(self, session_id: str, **params: Any) -> Iterator[Update]:
        """Generate, yielding the live document: the snapshot, then one update per committed event."""
        follow = _Follow()
        body = _generation(params)
        try:
            with self._http.stream(
                "POST", _session(session_id, "/generate"), json=body, timeout=self._stream_timeout()
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
        follow = _start(until_generation, last_event_id, document)
        failures = 0
        while not follow.done:
            try:
                with self._http.stream(
                    "GET",
                    _session(session_id, "/events"),
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
        return dict(self._send(_Calls.fork(session_id, at_position, at_version, label, protocol)))

    def close_session(self, session_id: str, *, reason: str | None = None) -> dict[str, Any]:
        """Close a session (a no-op on a closed one); returns its document."""
        return dict(self._send(Call("POST", _session(session_id, "/close"), _given(reason=reason))))

    def feedback(self, session_id: str, feedback: Mapping[str, Any]) -> dict[str, Any]:
        return dict(self._send(Call("POST", _session(session_id, "/feedback"), dict(feedback))))

    def export(self, session_id: str) -> list[dict[str, Any]]:
        """The session's events, as ``sessiontape export`` writes them (one dict per event)."""
        return list(self._send(Call("GET", _session(session_id, "/export"), ndjson=True)))

    def audit(self, session_id: str) -> dict[str, Any]:
        return dict(self._send(Call("GET", _session(session_id, "/audit"))))


def _closed_early(failures: int, retries: int, session_id: str) -> int:
    """A stream the server closed before the session ended: reconnect, but not forever."""
    failures += 1
    if failures > retries:
        raise TransportError(
            f"tail of {session_id}: the server closed the stream {failures} times in a row"
        )
    return failures


def _start(
    until_generation: str | None, last_event_id: int | None, document: dict[str, Any] | None
) -> _Follow:
    if (last_event_id is None) != (document is None):
        raise TypeError("resuming needs both last_event_id and the document it belongs to")
    return _Follow(
        document=document, last_event_id=last_event_id, until_generation=until_generation
    )


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
        self._http = httpx.AsyncClient(base_url=base_url, headers=_headers(token), timeout=timeout)
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
        return _parse(call, response)

    async def health(self) -> dict[str, Any]:
        return dict(await self._send(Call("GET", "/healthz")))

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
            await self._send(_Calls.create(protocol, label, mode, ttl_s, eos_token_ids, meta))
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
            (await self._send(_Calls.listing(status, protocol, parent, limit, offset)))["sessions"]
        )

    async def get_session(self, session_id: str, *, version: int | None = None) -> dict[str, Any]:
        return dict(
            await self._send(Call("GET", _session(session_id), params=_given(version=version)))
        )

    async def append(
        self,
        session_id: str,
        *,
        text: str | None = None,
        tokens: list[int] | None = None,
        offset: int | None = None,
        truncating: bool | None = None,
    ) -> dict[str, Any]:
        return dict(await self._send(_Calls.append(session_id, text, tokens, offset, truncating)))

    async def generate(self, session_id: str, **params: Any) -> dict[str, Any]:
        call = Call("POST", _session(session_id, "/generate"), _generation(params, stream=False))
        return dict(await self._send(call))

    async def generate_background(self, session_id: str, **params: Any) -> str:
        call = Call("POST", _session(session_id, "/generate"), _generation(params, background=True))
        return str((await self._send(call))["generation_id"])

    async def generate_stream(self, session_id: str, **params: Any) -> AsyncIterator[Update]:
        follow = _Follow()
        try:
            async with self._http.stream(
                "POST",
                _session(session_id, "/generate"),
                json=_generation(params),
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
        follow = _start(until_generation, last_event_id, document)
        failures = 0
        while not follow.done:
            try:
                async with self._http.stream(
                    "GET",
                    _session(session_id, "/events"),
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
            await self._send(_Calls.fork(session_id, at_position, at_version, label, protocol))
        )

    async def close_session(self, session_id: str, *, reason: str | None = None) -> dict[str, Any]:
        return dict(
            await self._send(Call("POST", _session(session_id, "/close"), _given(reason=reason)))
        )

    async def feedback(self, session_id: str, feedback: Mapping[str, Any]) -> dict[str, Any]:
        return dict(
            await self._send(Call("POST", _session(session_id, "/feedback"), dict(feedback)))
        )

    async def export(self, session_id: str) -> list[dict[str, Any]]:
        return list(await self._send(Call("GET", _session(session_id, "/export"), ndjson=True)))

    async def audit(self, session_id: str) -> dict[str, Any]:
        return dict(await self._send(Call("GET", _session(session_id, "/audit"))))
