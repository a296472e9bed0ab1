"""The native API's handlers: sessions, their documents and SSE patch streams, export, audit, replay.

Routes and error codes are described in docs/protocols/http.md and served
as OpenAPI at ``/openapi.json`` (:mod:`sessiontape.transports.http.server.openapi`). Every
handler calls the runtime; every core error becomes an HTTP status in
:mod:`sessiontape.transports.http.server.errors`. The app that routes to them is
:func:`sessiontape.transports.http.server.app.create_app`.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import AsyncIterator
from typing import Any

from starlette.requests import Request
from starlette.responses import Response, StreamingResponse
from starlette.routing import BaseRoute, Route

from sessiontape.core.audit import audit_session
from sessiontape.core.bodies import ImageAttached, body, fork_point, generation_id_of
from sessiontape.core.document import DocumentBuilder
from sessiontape.core.document.generation_view import generation_view
from sessiontape.core.errors import (
    InvalidParameters,
    NodeNotFound,
    NotFound,
)
from sessiontape.core.events import T
from sessiontape.core.generation.request import GenerateRequest
from sessiontape.core.handback import handing_back
from sessiontape.core.runtime import Runtime
from sessiontape.transports.http.native.bodies import (
    Append,
    Close,
    CreateSession,
    Feedback,
    Fork,
    Generate,
    M,
    validate,
)
from sessiontape.transports.http.native.feeds import (
    Feeds,
    events_after,
    load_builder,
    session_stream,
)
from sessiontape.transports.http.native.list_feed import list_stream
from sessiontape.transports.http.server import inputs
from sessiontape.transports.http.server.json_encoding import JSONResponse, dumps

SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}


# -- request helpers ------------------------------------------------------------


def _rfc(request: Request) -> bool:
    fmt = request.query_params.get("patch", "plus")
    if fmt not in ("plus", "rfc6902"):
        raise InvalidParameters(f"patch must be 'plus' or 'rfc6902', got {fmt!r}")
    return fmt == "rfc6902"


def _sse(stream: AsyncIterator[bytes]) -> StreamingResponse:
    return StreamingResponse(stream, media_type="text/event-stream", headers=SSE_HEADERS)


# -- the app ------------------------------------------------------------------


def prefers_minimal(request: Request) -> bool:
    """The request's ``Prefer`` header asks for ``return=minimal`` (RFC 7240: a
    comma-separated list of preferences, each maybe with parameters after ``;``)."""
    for header in request.headers.getlist("prefer"):
        for pref in header.split(","):
            name, _, value = pref.split(";", 1)[0].partition("=")
            if name.strip().lower() == "return" and value.strip().strip('"').lower() == "minimal":
                return True
    return False


class Api:
    """Route handlers bound to one runtime."""

    def __init__(
        self,
        runtime: Runtime,
        *,
        heartbeat_s: float = 15.0,
        ring: int = 4096,
        ring_bytes: int = 65536,
        linger_s: float = 30.0,
        limits: inputs.Limits | None = None,
    ) -> None:
        self.runtime = runtime
        self.limits = limits or inputs.Limits()
        self.heartbeat_s = heartbeat_s
        self.feeds = Feeds(runtime, ring=ring, ring_bytes=ring_bytes, linger_s=linger_s)
        self.background: set[asyncio.Task[Any]] = set()

    async def aclose(self) -> None:
        for t in list(self.background):
            t.cancel()
            with contextlib.suppress(BaseException):
                await t
        await self.feeds.close()

    def _detok(self) -> Any:
        return self.runtime.engine.detokenize

    async def document(self, sid: str, version: int | None = None) -> dict[str, Any]:
        return (await load_builder(self.runtime, self.feeds.forks, sid, upto_version=version)).doc

    # sessions

    async def _body(self, request: Request, model: type[M]) -> M:
        """The route's body as its model (bodies.py), or the typed error."""
        return validate(model, await inputs.body(request, self.limits))

    async def create(self, request: Request) -> Response:
        b = await self._body(request, CreateSession)
        st = await self.runtime.open_session(
            b.protocol or "http",
            mode=b.mode or "offset",
            label=b.label or "",
            eos_token_ids=b.eos_token_ids,
            ttl_s=b.ttl_s,
            meta=inputs.sized(b.meta, "meta", self.limits.max_meta_bytes),
        )
        return JSONResponse(
            await self.document(st.session_id),
            status_code=201,
            headers={"Location": f"/v1/sessions/{st.session_id}"},
        )

    async def list(self, request: Request) -> Response:
        q = request.query_params
        limit = inputs.integer(q.get("limit"), "limit", lo=1, hi=10_000) or 100
        offset = inputs.integer(q.get("offset"), "offset", lo=0) or 0
        rows = await self.runtime.reads.list_sessions(
            status=q.get("status"),
            protocol=q.get("protocol"),
            parent_id=q.get("parent"),
            limit=limit,
            offset=offset,
        )
        out = []
        for r in rows:
            row = r.to_json()
            row["generating"] = self.runtime.generations.is_running(r.id)
            out.append(row)
        return JSONResponse({"sessions": out})

    async def get(self, request: Request) -> Response:
        version = inputs.integer(request.query_params.get("version"), "version", lo=1)
        return JSONResponse(await self.document(request.path_params["sid"], version))

    async def list_events(self, request: Request) -> Response:
        limit = inputs.integer(request.query_params.get("limit"), "limit", lo=1, hi=10_000) or 200
        return _sse(
            list_stream(self.runtime, limit=limit, heartbeat_s=self.heartbeat_s, rfc=_rfc(request))
        )

    async def events(self, request: Request) -> Response:
        sid = request.path_params["sid"]
        rfc = _rfc(request)
        # Fail before the 200 goes out: unknown sessions and bad positions are HTTP errors.
        await self.runtime.get(sid)  # the cached state: no read per request
        last = await self._last_event_id(request)
        return _sse(session_stream(self.feeds, sid, last, rfc=rfc, heartbeat_s=self.heartbeat_s))

    async def _last_event_id(self, request: Request) -> int | None:
        """Where a document stream resumes: ``Last-Event-ID`` (or ``?last_event_id=``), checked.

        A blank value is malformed like any other non-integer (docs/protocols/http.md), not
        "from the start": EventSource sends the header only once it has an id. The header,
        when present, wins over the query parameter."""
        raw = request.headers.get("last-event-id")
        if raw is None:
            raw = request.query_params.get("last_event_id")
        last = inputs.integer(raw, "Last-Event-ID", lo=0)
        if last is not None and not await self.runtime.reads.position_exists(last):
            raise InvalidParameters(f"Last-Event-ID {last} is past the end of the log")
        return last

    async def append(self, request: Request) -> Response:
        sid = request.path_params["sid"]
        b = await self._body(request, Append)
        # offset and truncating apply to text as to tokens (the Salience rule), never ignored
        tokens = self.runtime.engine.tokenize(b.text) if b.text is not None else b.tokens or []
        length = await self.runtime.append_tokens(
            sid, tokens, offset=b.offset, truncating=bool(b.truncating)
        )
        st = await self.runtime.get(sid)
        return JSONResponse({"session_id": sid, "length": length, "version": st.version})

    async def generate(self, request: Request) -> Response:
        sid = request.path_params["sid"]
        b = await self._body(request, Generate)
        params, options = b.sampling()
        rfc = _rfc(request)
        append = self.runtime.engine.tokenize(b.text) if b.text is not None else b.tokens or []
        mode = b.mode
        # Subscribe before the generation starts, so the stream's snapshot precedes its first
        # event; a client holding the document up to Last-Event-ID gets no snapshot, only the
        # patches after it, so a turn costs the same however long the session has grown.
        stream = None
        if mode == "stream":
            await self.runtime.get(sid)
            last = await self._last_event_id(request)
            fin: asyncio.Future[int] = asyncio.get_running_loop().create_future()
            stream = session_stream(
                self.feeds, sid, last, rfc=rfc, heartbeat_s=self.heartbeat_s, until=fin
            )
            first_frame = await anext(stream)
        # background answers once generation.started is durable: it commits apart
        agen = self.runtime.generate(
            sid, GenerateRequest(params, options, append=append, start_apart=mode == "background")
        )
        try:
            first = await anext(agen)
        except BaseException:
            if stream is not None:
                await stream.aclose()
            raise
        gid = generation_id_of(first) or ""

        async def drain() -> int:
            last = first
            async for e in agen:
                last = e
            return last.position

        if mode == "json":
            evs = [first, *[e async for e in agen]]
            return JSONResponse(
                {
                    "session_id": sid,
                    "generation": generation_view(self._detok(), evs, gid),
                    "version": evs[-1].version,
                }
            )
        task = asyncio.create_task(drain(), name=f"generate-{sid}")
        self.background.add(task)
        task.add_done_callback(self.background.discard)
        if mode == "background":
            return JSONResponse({"session_id": sid, "generation_id": gid or None}, status_code=202)
        assert stream is not None
        task.add_done_callback(lambda t: _settle(fin, t))

        async def body() -> AsyncIterator[bytes]:
            assert stream is not None
            try:
                if first_frame:
                    yield first_frame
                async for chunk in stream:
                    yield chunk
            finally:
                # The client went away: stop the generation (the runtime records it as
                # cancelled). Cancel exactly once and do not await it here: this
                # generator is itself being cancelled, and a cancelled await would
                # re-cancel the task in the middle of its cleanup.
                if not task.done():
                    task.cancel()
                await stream.aclose()

        return _sse(body())

    async def fork(self, request: Request) -> Response:
        sid = request.path_params["sid"]
        b = await self._body(request, Fork)
        st = await self.runtime.fork(
            sid,
            at_position=b.at_position,
            at_version=b.at_version,
            protocol=b.protocol,
            label=b.label or "",
        )
        return JSONResponse(
            await self.document(st.session_id),
            status_code=201,
            headers={"Location": f"/v1/sessions/{st.session_id}"},
        )

    async def close(self, request: Request) -> Response:
        """The closed session's document; with ``Prefer: return=minimal`` (RFC 7240) its id,
        status and version only, which costs nothing that grows with the session (the
        document is folded from the log where no live feed holds it: tens of milliseconds
        for thousands of events)."""
        sid = request.path_params["sid"]
        b = await self._body(request, Close)
        st = await self.runtime.close(sid, "client" if b.reason is None else b.reason)
        if prefers_minimal(request):
            return JSONResponse(
                {"id": sid, "status": st.status, "version": st.version},
                headers={"Preference-Applied": "return=minimal"},
            )
        doc = await self.feeds.final_document(sid, st.version)
        return JSONResponse(doc if doc is not None else await self.document(sid))

    async def feedback(self, request: Request) -> Response:
        sid = request.path_params["sid"]
        b = inputs.sized(
            (await self._body(request, Feedback)).root, "feedback", self.limits.max_meta_bytes
        )
        await self.runtime.reads.session_row(sid)
        e = await self.runtime.record_feedback(sid, b)
        return JSONResponse({"session_id": sid, "version": e.version}, status_code=201)

    async def export(self, request: Request) -> Response:
        sid = request.path_params["sid"]
        evs = await self.runtime.reads.read_events(sid)
        if not evs:
            raise NotFound(f"session {sid!r} not found")
        lines = "".join(
            [json.dumps(e.to_json(), separators=(",", ":")) + "\n" async for e in handing_back(evs)]
        )
        return Response(
            lines,
            media_type="application/x-ndjson",
            headers={"Content-Disposition": f'attachment; filename="{sid}.ndjson"'},
        )

    async def audit(self, request: Request) -> Response:
        report = await audit_session(self.runtime, request.path_params["sid"])
        return JSONResponse(report.to_json())

    async def replay(self, request: Request) -> Response:
        """The base document and one patch per event: what the viewer's scrubber plays.

        The builder folds in place, so the base and each step's patch are
        serialised as they are made; the body is assembled from those.
        """
        sid = request.path_params["sid"]
        own = await self.runtime.reads.read_events(sid, 1, 1)
        if not own:
            raise NotFound(f"session {sid!r} not found")
        builder = DocumentBuilder(
            sid, detokenize=self._detok(), base=await self.runtime.reads.fork_base(own[0])
        )
        base = dumps(builder.doc)
        steps = []
        async for e in handing_back(await events_after(self.runtime, self.feeds.forks, sid, 0)):
            patch = builder.apply(e)
            steps.append(
                dumps(
                    {
                        "position": e.position,
                        "version": e.version if e.session_id == sid else None,
                        "session_id": e.session_id,
                        "type": e.type,
                        "recorded_at": e.recorded_at,
                        "patch": patch,
                    }
                )
            )
        body = (
            f'{{"session_id":{dumps(sid)},"base":{base},"steps":[{",".join(steps)}],'
            f'"version":{dumps(builder.doc["version"])}}}'
        )
        return Response(body, media_type="application/json")

    async def image(self, request: Request) -> Response:
        sid, sha = request.path_params["sid"], request.path_params["sha"]
        st = await self.runtime.get(sid)
        image = next((im for im in st.images if im.sha256 == sha), None)
        if image is None:
            raise NotFound(f"image {sha!r} not found in session {sid!r}")
        data = await self.runtime.reads.get_blob(sha)
        if data is None and image.size <= self.runtime.reads.inline_max_bytes:
            # Small images are stored inline in their image.attached event, not in the blob table.
            data = await self._inline_image(st.session_id, sha)
        if data is None:
            raise NotFound(f"image {sha!r} not found in session {sid!r}")
        return Response(data, media_type=image.mime or "application/octet-stream")

    async def _inline_image(self, sid: str, sha: str) -> bytes | None:
        """The bytes of an image too small for the blob table: in this session's events or its parent's."""
        session: str | None = sid
        upto: int | None = None
        while session is not None:
            evs = await self.runtime.reads.read_events(session, 1, upto)
            for e in evs:
                if (
                    e.type == T.IMAGE_ATTACHED
                    and body(e, ImageAttached).get("sha256") == sha
                    and e.data is not None
                ):
                    return e.data
            parent = fork_point(evs[0]) if evs else None
            session, upto = (
                (str(parent["session_id"]), int(parent["version"])) if parent else (None, None)
            )
        return None

    async def node_content(self, request: Request) -> Response:
        sid, nid = request.path_params["sid"], request.path_params["nid"]
        st = await self.runtime.get(sid)
        node = st.nodes.get(nid)
        if node is None or node.kind != "leaf":
            raise NodeNotFound(f"leaf node {nid!r} not found in session {sid!r}")
        mime = str((node.metadata or {}).get("mimetype") or "application/octet-stream")
        return Response(node.data(), media_type=mime)


def _settle(fut: asyncio.Future[int], task: asyncio.Task[int]) -> None:
    if fut.done():
        return
    if task.cancelled():
        fut.cancel()
    elif task.exception() is not None:
        fut.set_exception(task.exception())  # type: ignore[arg-type]
    else:
        fut.set_result(task.result())


def routes(api: Api) -> list[BaseRoute]:
    """The native API's route table."""
    sid = "/v1/sessions/{sid}"
    return [
        Route("/v1/sessions", api.create, methods=["POST"]),
        Route("/v1/sessions", api.list, methods=["GET"]),
        Route("/v1/sessions/events", api.list_events),
        Route(sid, api.get),
        Route(sid + "/events", api.events),
        Route(sid + "/append", api.append, methods=["POST"]),
        Route(sid + "/generate", api.generate, methods=["POST"]),
        Route(sid + "/fork", api.fork, methods=["POST"]),
        Route(sid + "/close", api.close, methods=["POST"]),
        Route(sid + "/feedback", api.feedback, methods=["POST"]),
        Route(sid + "/export", api.export),
        Route(sid + "/audit", api.audit),
        Route(sid + "/replay", api.replay),
        Route(sid + "/images/{sha}", api.image),
        Route(sid + "/nodes/{nid}/content", api.node_content),
    ]
