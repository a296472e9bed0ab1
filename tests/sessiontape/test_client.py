"""sessiontape.client against a live server: every method, typed errors, and tail resuming
through a loopback proxy that cuts its connections mid-stream."""

from __future__ import annotations

import asyncio
import contextlib
import copy
from collections.abc import AsyncIterator
from typing import Any

import pytest

from sessiontape import AsyncClient, Client, errors
from sessiontape.client import SSEDecoder, Update
from tests.helpers.config import free_port
from tests.helpers.http import Served, serve


@pytest.fixture
async def live(sqlite_url: str, port: int) -> AsyncIterator[Served]:
    s = await serve(sqlite_url, port, step_delay_s=0.02)
    try:
        yield s
    finally:
        await s.transport.stop(grace=1.0)
        await s.runtime.aclose()


class Proxy:
    """A TCP relay on loopback whose open connections can be cut at once."""

    def __init__(self, target: int) -> None:
        self.target = target
        self.port = 0
        self.cuts = 0
        self.connections = 0
        self._pairs: list[tuple[asyncio.StreamWriter, asyncio.StreamWriter]] = []
        self._tasks: set[asyncio.Task[None]] = set()
        self._server: asyncio.Server | None = None

    async def __aenter__(self) -> Proxy:
        self._server = await asyncio.start_server(self._handle, "127.0.0.1", 0)
        self.port = self._server.sockets[0].getsockname()[1]
        return self

    async def __aexit__(self, *_: object) -> None:
        assert self._server is not None
        self._server.close()
        self.cut()
        for t in list(self._tasks):
            t.cancel()
            with contextlib.suppress(BaseException):
                await t
        await self._server.wait_closed()

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        up_reader, up_writer = await asyncio.open_connection("127.0.0.1", self.target)
        self.connections += 1
        self._pairs.append((writer, up_writer))

        async def pump(src: asyncio.StreamReader, dst: asyncio.StreamWriter) -> None:
            with contextlib.suppress(Exception):
                while data := await src.read(65536):
                    dst.write(data)
                    await dst.drain()
            dst.close()

        for t in (
            asyncio.create_task(pump(reader, up_writer)),
            asyncio.create_task(pump(up_reader, writer)),
        ):
            self._tasks.add(t)
            t.add_done_callback(self._tasks.discard)

    def cut(self) -> None:
        for a, b in self._pairs:
            a.transport.abort()
            b.transport.abort()
        self._pairs.clear()
        self.cuts += 1


def test_sse_decoder() -> None:
    d = SSEDecoder()
    lines = ["id: 7", "event: patch", "data: [1,", "data: 2]", "", ": ping", "", "data: x", ""]
    out = [e for e in (d.line(line) for line in lines) if e is not None]
    assert [(e.event, e.data, e.id) for e in out] == [
        ("patch", "[1,\n2]", "7"),
        ("message", "x", "7"),
    ]


async def test_sync_client_covers_the_api(live: Served) -> None:
    def run() -> dict[str, Any]:
        with Client(live.url) as st:
            assert st.health()["status"] == "ok"
            doc = st.create_session(label="client", meta={"k": 1})
            sid = doc["id"]
            assert st.append(sid, text="Hello")["length"] == 5
            gen = st.generate(sid, max_tokens=4, seed=1)["generation"]
            streamed = list(st.generate_stream(sid, max_tokens=3, seed=2))
            child = st.fork(sid, at_position=3, label="kid")
            fb = st.feedback(sid, {"score": 1})
            closed = st.close_session(sid)
            return {
                "sid": sid,
                "gen": gen,
                "streamed": streamed,
                "child": child,
                "fb": fb,
                "closed": closed,
                "listed": st.list_sessions(parent=sid),
                "export": st.export(sid),
                "audit": st.audit(sid),
                "doc": st.get_session(sid),
                "v2": st.get_session(sid, version=2),
            }

    r = await asyncio.to_thread(run)
    sid = r["sid"]
    assert r["gen"]["status"] == "finished" and 1 <= len(r["gen"]["tokens"]) <= 4
    streamed: list[Update] = r["streamed"]
    assert streamed[0].kind == "snapshot" and all(u.kind == "patch" for u in streamed[1:])
    positions = [u.position for u in streamed]
    assert positions == sorted(set(positions))  # type: ignore[type-var]
    assert streamed[-1].document["generations"][-1]["status"] == "finished"
    assert r["child"]["parent"]["session_id"] == sid and r["child"]["history"]["ids"] == list(
        b"Hel"
    )
    assert [s["id"] for s in r["listed"]] == [r["child"]["id"]]
    assert r["closed"]["status"] == "closed" and r["doc"]["status"] == "closed"
    assert r["v2"]["version"] == 2 and r["v2"]["history"]["ids"] == list(b"Hello")
    events = r["export"]
    assert [e["version"] for e in events] == list(range(1, len(events) + 1))
    assert events[-1]["type"] == "session.closed" and r["fb"]["version"] < events[-1]["version"]
    assert r["audit"]["ok"] is True
    # the streamed document is the server's document at that point
    at = await live.runtime.log.read(sid)
    version = streamed[-1].document["version"]
    assert any(e.version == version for e in at)


async def test_async_stream_document_equals_the_server_document(live: Served) -> None:
    async with AsyncClient(live.url) as st:
        sid = (await st.create_session())["id"]
        await st.append(sid, text="Hi")
        last = None
        async for update in st.generate_stream(sid, max_tokens=6, seed=9, text=" there"):
            last = update
        assert last is not None
        assert last.document == await st.get_session(sid)


async def test_typed_errors(live: Served) -> None:
    async with AsyncClient(live.url) as st:
        with pytest.raises(errors.SessionNotFound) as nf:
            await st.append("s_missing", text="x")
        assert nf.value.status == 404 and nf.value.code == "session_not_found"
        sid = (await st.create_session())["id"]
        with pytest.raises(errors.BadRequest) as bad:
            await st.generate(sid, max_tokens=-1)
        assert bad.value.status == 400
        with pytest.raises(TypeError):
            await st.generate(sid, max_token=3)
        await st.append(sid, text="abc")
        with pytest.raises(errors.OffsetMismatch):
            await st.append(sid, tokens=[1], offset=1)
        await st.close_session(sid)
        with pytest.raises(errors.SessionClosed) as closed:
            await st.append(sid, text="late")
        assert isinstance(closed.value, errors.Conflict) and closed.value.status == 409
    async with AsyncClient(f"http://127.0.0.1:{free_port()}") as nobody:
        with pytest.raises(errors.TransportError):
            await nobody.health()


async def test_unauthenticated(sqlite_url: str, port: int) -> None:
    from sessiontape.core.runtime import Runtime
    from sessiontape.engines.reference import ReferenceEngine
    from sessiontape.transports.http.plugin import HttpTransport
    from tests.helpers.config import make_config

    cfg = make_config(sqlite_url, auth={"token": "t0ken"})
    rt = await Runtime.create(cfg, engine=ReferenceEngine())
    tr = HttpTransport(rt, {"listen": f"127.0.0.1:{port}"}, cfg)
    await tr.start()
    try:
        async with AsyncClient(f"http://127.0.0.1:{port}", token="wrong") as st:
            with pytest.raises(errors.Unauthenticated):
                await st.list_sessions()
        async with AsyncClient(f"http://127.0.0.1:{port}", token="t0ken") as st:
            assert await st.list_sessions() == []
    finally:
        await tr.stop(grace=1.0)
        await rt.aclose()


async def test_tail_resumes_across_cut_connections(live: Served) -> None:
    port = int(live.url.rsplit(":", 1)[1])
    async with (
        Proxy(port) as proxy,
        AsyncClient(f"http://127.0.0.1:{proxy.port}", backoff_s=0.01) as st,
    ):
        sid = (await st.create_session())["id"]
        await st.append(sid, text="Once upon a time")
        gid = await st.generate_background(sid, max_tokens=60, seed=4)
        updates = []
        async for u in st.tail(sid, until_generation=gid):
            updates.append(u)
            if len(updates) in (5, 20, 35):
                proxy.cut()
        cuts, connections = proxy.cuts, proxy.connections
        async with AsyncClient(live.url) as direct:
            server_doc = await direct.get_session(sid)
    assert cuts == 3 and connections >= 1 + cuts  # the first connection, then one per cut
    assert updates[0].kind == "snapshot" and all(u.kind == "patch" for u in updates[1:])
    positions = [u.position for u in updates]
    assert len(positions) == len(set(positions)) and positions == sorted(positions)  # type: ignore[type-var]
    final = updates[-1].document
    assert final["generations"][0]["status"] == "finished"
    assert final == server_doc


async def test_sync_tail_resume_with_saved_document(live: Served) -> None:
    def run() -> tuple[list[Update], dict[str, Any]]:
        with Client(live.url) as st:
            sid = st.create_session()["id"]
            st.append(sid, text="abc")
            gid = st.generate_background(sid, max_tokens=30, seed=8)
            first = []
            for u in st.tail(sid):
                first.append(u)
                if len(first) == 4:
                    break
            saved = copy.deepcopy(first[-1].document)
            rest = list(
                st.tail(sid, until_generation=gid, last_event_id=first[-1].position, document=saved)
            )
            return first + rest, st.get_session(sid)

    updates, server_doc = await asyncio.to_thread(run)
    assert updates[-1].document == server_doc
    assert [u.kind for u in updates].count("snapshot") == 1


async def test_seed_comes_back_as_an_exact_integer(live: Served) -> None:
    """Through the client, every document shows a generation's seed as an int, exact above
    2**53 (JSON holds it; a double would not)."""
    big = 2**64 - 1
    async with AsyncClient(live.url) as st:
        sid = (await st.create_session())["id"]
        await st.append(sid, text="Hi")
        gen = (await st.generate(sid, max_tokens=2, seed=big))["generation"]
        streamed = [u async for u in st.generate_stream(sid, max_tokens=2, seed=2**53 + 1)]
        doc = await st.get_session(sid)
        gid = await st.generate_background(sid, max_tokens=2, seed=str(2**63))
        tailed = [u async for u in st.tail(sid, until_generation=gid)]
    assert gen["params"]["seed"] == big and type(gen["params"]["seed"]) is int
    seeds = [big, 2**53 + 1]
    assert [g["params"]["seed"] for g in streamed[-1].document["generations"]] == seeds
    assert [g["params"]["seed"] for g in doc["generations"]] == seeds
    assert [g["params"]["seed"] for g in tailed[-1].document["generations"]] == [*seeds, 2**63]
    assert all(type(g["params"]["seed"]) is int for g in tailed[-1].document["generations"])


async def test_a_stream_continues_the_document_of_the_last_one(live: Served) -> None:
    """``generate_stream(last_event_id=, document=)``: no snapshot on the next turn, and the
    document it ends with is the server's."""
    async with AsyncClient(live.url) as st:
        sid = (await st.create_session())["id"]
        first = [u async for u in st.generate_stream(sid, max_tokens=3, seed=1, text="Hi")]
        assert first[0].kind == "snapshot"
        last = first[-1]
        second = [
            u
            async for u in st.generate_stream(
                sid,
                last_event_id=last.position,
                document=last.document,
                max_tokens=4,
                seed=2,
                text=" again",
            )
        ]
        assert second and all(u.kind == "patch" for u in second)
        assert second[-1].document == await st.get_session(sid)
        assert len(second[-1].document["generations"]) == 2
        with pytest.raises(TypeError, match="both last_event_id and the document"):
            async for _ in st.generate_stream(sid, last_event_id=last.position, max_tokens=1):
                pass

    def sync_turns() -> tuple[list[Update], dict[str, Any]]:
        with Client(live.url) as st:
            first = list(st.generate_stream(sid, max_tokens=2, seed=3))
            more = list(
                st.generate_stream(
                    sid,
                    last_event_id=first[-1].position,
                    document=first[-1].document,
                    max_tokens=2,
                    seed=4,
                )
            )
            return more, st.get_session(sid)

    more, doc = await asyncio.to_thread(sync_turns)
    assert more and all(u.kind == "patch" for u in more) and more[-1].document == doc
