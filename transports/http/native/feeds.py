"""Session documents from the log, and the live feeds that stream their patches.

A :class:`SessionFeed` folds one session's committed events once and fans
the serialised patches out to every watcher, so a hundred viewers of a
generating session cost one fold and one ``json.dumps`` per event. It keeps
a ring of recent patches: a watcher that reconnects with ``Last-Event-ID``
inside the ring resumes from memory; one further back rebuilds the document
at its position from the log and catches up from there (exact either way,
because the document at a log position is a pure function of the log).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections import OrderedDict, deque
from collections.abc import AsyncGenerator, AsyncIterator
from dataclasses import dataclass, field
from typing import Any

from sessiontape.core.bodies import fork_point
from sessiontape.core.document import TERMINAL, DocumentBuilder
from sessiontape.core.errors import InvalidParameters, SessionNotFound
from sessiontape.core.events import Event
from sessiontape.core.handback import handing_back
from sessiontape.core.patch import to_rfc6902
from sessiontape.core.runtime import Runtime
from sessiontape.transports.http.server.json_encoding import dump_bytes, dumps

log = logging.getLogger("sessiontape.http.feeds")


def frame(event: str, data: str | bytes, id_: int | None = None) -> bytes:
    head = f"id: {id_}\nevent: {event}\ndata: " if id_ is not None else f"event: {event}\ndata: "
    return b"".join((head.encode(), data if isinstance(data, bytes) else data.encode(), b"\n\n"))


# -- documents from the log ---------------------------------------------------


class Forks:
    """The ``session.opened`` event of each fork, by the session it forks from.

    Listing a session's forks is one query on the sessions index. A fork's
    first event never changes, so it is read once per process (or taken
    from the live feed when it is committed) and kept, at most ``keep``.
    """

    def __init__(self, runtime: Runtime, keep: int = 100_000) -> None:
        self.runtime = runtime
        self.keep = keep
        self._opened: OrderedDict[str, Event] = OrderedDict()

    def remember(self, e: Event) -> None:
        if fork_point(e):
            self._opened[e.session_id] = e
            if len(self._opened) > self.keep:
                self._opened.popitem(last=False)

    async def of(self, session_id: str, after: int = 0) -> list[Event]:
        """The forks' ``session.opened`` events past log position ``after``."""
        out = []
        for row in await self.runtime.reads.list_sessions(parent_id=session_id, limit=100_000):
            if row.status == "purged":  # its events, the opening one included, are gone
                continue
            e = self._opened.get(row.id)
            if e is None:
                first = await self.runtime.reads.read_events(row.id, 1, 1)
                if not first:
                    continue
                e = first[0]
                self.remember(e)
            if e.position > after:
                out.append(e)
        return out


async def load_builder(
    runtime: Runtime,
    forks: Forks,
    session_id: str,
    *,
    upto_position: int | None = None,
    upto_version: int | None = None,
) -> DocumentBuilder:
    """The document of ``session_id`` after every event up to a log position or a version.

    Children (forks) count from the position their ``session.opened`` was
    committed at. Raises SessionNotFound, or InvalidParameters for a version
    the session does not have.
    """
    own = await runtime.reads.read_events(session_id, 1, upto_version)
    if not own:
        raise SessionNotFound(session_id)
    if upto_version is not None and (upto_version < 1 or own[-1].version < upto_version):
        raise InvalidParameters(f"version {upto_version} is outside [1, {own[-1].version}]")
    base = await runtime.reads.fork_base(own[0])
    if upto_position is not None:
        own = [e for e in own if e.position <= upto_position]
    limit = (
        upto_position
        if upto_position is not None
        else (own[-1].position if upto_version is not None else None)
    )
    builder = DocumentBuilder(session_id, detokenize=runtime.engine.detokenize, base=base)
    children = [e for e in await forks.of(session_id) if limit is None or e.position <= limit]
    async for e in handing_back(sorted([*own, *children], key=lambda e: e.position)):
        builder.apply(e)
    if upto_position is not None:
        builder.position = max(builder.position, upto_position)
    return builder


async def events_after(runtime: Runtime, forks: Forks, session_id: str, after: int) -> list[Event]:
    """Every event past ``after`` that can change the session's document, in log order."""
    own = await runtime.reads.read_after(after, limit=1_000_000, session_id=session_id)
    return sorted([*own, *await forks.of(session_id, after)], key=lambda e: e.position)


# -- feeds ----------------------------------------------------------------------


@dataclass
class Entry:
    """One committed event's patch, serialised once per format."""

    position: int
    plus: str
    rfc: str | None = None
    #: its text's length, both forms, once in a ring (what it counts against ring_bytes)
    size: int = 0


END = Entry(-1, "")


@dataclass(eq=False)
class Watcher:
    rfc: bool
    queue: asyncio.Queue[Entry] = field(default_factory=lambda: asyncio.Queue(maxsize=10_000))
    lagged: bool = False

    def put(self, entry: Entry) -> None:
        if self.lagged:
            return
        try:
            self.queue.put_nowait(entry)
        except asyncio.QueueFull:
            # Drop the watcher rather than buffer without bound: it ends its
            # stream and the client resumes from its Last-Event-ID.
            self.lagged = True
            with contextlib.suppress(asyncio.QueueEmpty):
                self.queue.get_nowait()
            self.queue.put_nowait(END)


class SessionFeed:
    """The live document of one open session and its watchers."""

    def __init__(
        self,
        runtime: Runtime,
        builder: DocumentBuilder,
        position: int,
        ring: int,
        forks: Forks | None = None,
        ring_bytes: int = 65536,
    ) -> None:
        self.runtime = runtime
        self.forks = forks
        self.builder = builder
        self.session_id = builder.session_id
        #: every event with a position <= this is folded into ``doc``
        self.position = position
        #: every patch with floor < position <= self.position, within ring and ring_bytes
        self.floor = position
        self.ring: deque[Entry] = deque()
        self.ring_max = ring
        self.ring_bytes_max = ring_bytes
        self.ring_bytes = 0
        self.watchers: set[Watcher] = set()
        self.ended = builder.doc["status"] in TERMINAL
        self.task: asyncio.Task[None] | None = None
        self.idle_since: float | None = None
        #: callers waiting for the document to hold a version of the session (folded)
        self._folding: list[tuple[int, asyncio.Future[None]]] = []

    @property
    def doc(self) -> dict[str, Any]:
        return self.builder.doc

    def start(self) -> None:
        self.task = asyncio.create_task(self._run(), name=f"sse-feed-{self.session_id}")

    async def stop(self) -> None:
        if self.task is not None:
            self.task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self.task
        for w in list(self.watchers):
            w.put(END)
        self._wake_folded(everyone=True)

    def folded(self, version: int) -> asyncio.Future[None]:
        """Done once the document holds the session's event ``version``, or the feed ended
        (what it holds then is the caller's to check)."""
        fut: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        if self.ended or self.builder.doc["version"] >= version:
            fut.set_result(None)
        else:
            self._folding.append((version, fut))
        return fut

    def _wake_folded(self, *, everyone: bool) -> None:
        version = self.builder.doc["version"]
        waiting, self._folding = self._folding, []
        for want, fut in waiting:
            if everyone or version >= want:
                if not fut.done():
                    fut.set_result(None)
            elif not fut.done():  # a waiter that gave up is dropped
                self._folding.append((want, fut))

    async def _run(self) -> None:
        try:
            async for batch in self.runtime.reads.subscribe_batches(
                self.position, self.session_id, with_forks=True
            ):
                for e in batch:
                    self.publish(e)
                    if self.ended:
                        break
                if self.ended:
                    break
        except Exception:  # end the watchers' streams; they resume from the log
            log.exception("feed of %s failed", self.session_id)
        finally:
            self.ended = True
            for w in list(self.watchers):
                w.put(END)
            self._wake_folded(everyone=True)

    def publish(self, e: Event) -> None:
        if self.forks is not None:
            self.forks.remember(e)
        ops = self.builder.apply(e)
        self.position = e.position
        if not ops:
            return
        after = self.builder.doc
        entry = Entry(e.position, dumps(ops))
        if any(w.rfc for w in self.watchers):
            entry.rfc = dumps(to_rfc6902(ops, after))
        self.keep(entry)
        for w in list(self.watchers):
            w.put(entry)
        if after["status"] in TERMINAL:
            self.ended = True
        if self._folding:
            self._wake_folded(everyone=self.ended)

    def keep(self, entry: Entry) -> None:
        """``entry`` into the ring; the oldest leave (the floor rising) while it is over."""
        ring, rfc = self.ring, entry.rfc
        entry.size = size = len(entry.plus) if rfc is None else len(entry.plus) + len(rfc)
        ring.append(entry)
        total = self.ring_bytes + size
        while len(ring) > 1 and (total > self.ring_bytes_max or len(ring) > self.ring_max):
            old = ring.popleft()
            total -= old.size
            self.floor = old.position
        self.ring_bytes = total

    def backlog(self, after: int, rfc: bool) -> list[Entry] | None:
        """Ring entries past ``after``, or None when the ring does not reach back that far."""
        if after < self.floor:
            return None
        # positions rise along the ring: walk back from its end, past only what is
        # wanted (a stream resumed each turn wants a turn's entries, not the ring's)
        out: list[Entry] = []
        for en in reversed(self.ring):
            if en.position <= after:
                break
            out.append(en)
        out.reverse()
        if rfc and any(en.rfc is None for en in out):
            return None
        return out


class Feeds:
    """The live feeds by session id; a feed lingers ``linger_s`` after its last watcher leaves."""

    def __init__(
        self,
        runtime: Runtime,
        *,
        ring: int = 4096,
        ring_bytes: int = 65536,
        linger_s: float = 30.0,
    ) -> None:
        self.runtime = runtime
        self.ring = ring
        self.ring_bytes = ring_bytes
        self.linger_s = linger_s
        self.feeds: dict[str, SessionFeed] = {}
        self.forks = Forks(runtime)
        self._building: dict[str, asyncio.Future[SessionFeed]] = {}
        self._reaper: asyncio.Task[None] | None = None

    async def get(self, session_id: str) -> SessionFeed:
        feed = self.feeds.get(session_id)
        if feed is not None and not feed.ended:
            return feed
        pending = self._building.get(session_id)
        if pending is not None:
            return await asyncio.shield(pending)
        fut: asyncio.Future[SessionFeed] = asyncio.get_running_loop().create_future()
        self._building[session_id] = fut
        try:
            position = await self.runtime.reads.last_position()
            builder = await load_builder(
                self.runtime, self.forks, session_id, upto_position=position
            )
            feed = SessionFeed(
                self.runtime, builder, position, self.ring, self.forks, self.ring_bytes
            )
            if not feed.ended:
                feed.start()
                self.feeds[session_id] = feed
            fut.set_result(feed)
            self._ensure_reaper()
            return feed
        except BaseException as exc:
            fut.set_exception(exc)
            fut.exception()  # retrieved: waiters re-raise it
            raise
        finally:
            self._building.pop(session_id, None)

    async def final_document(
        self, session_id: str, version: int, wait_s: float = 1.0
    ) -> dict[str, Any] | None:
        """The document of a session that ended at ``version``, from its live feed once the
        feed has folded that event; None when no feed holds it (the caller reads the log).

        Closing a session that an SSE client watches answers what the feed has built
        instead of reading and folding the whole history again, which in a fleet of long
        SSE sessions is a noticeable share of the server's loop.
        """
        feed = self.feeds.get(session_id)
        if feed is None:
            return None
        try:
            async with asyncio.timeout(wait_s):  # not wait_for: 3.11's can lose a cancel
                await feed.folded(version)
        except TimeoutError:
            return None
        doc = feed.doc
        if doc["version"] != version or doc["status"] not in TERMINAL:
            return None  # the feed failed or stopped short, or more came after the end
        return doc

    def _ensure_reaper(self) -> None:
        if self._reaper is None or self._reaper.done():
            self._reaper = asyncio.create_task(self._reap(), name="sse-feed-reaper")

    async def _reap(self) -> None:
        loop = asyncio.get_running_loop()
        while self.feeds:
            await asyncio.sleep(max(0.05, min(self.linger_s, 5.0)))
            now = loop.time()
            for sid, feed in list(self.feeds.items()):
                if feed.watchers:
                    feed.idle_since = None
                elif feed.ended or (
                    feed.idle_since is not None and now - feed.idle_since >= self.linger_s
                ):
                    self.feeds.pop(sid, None)
                    await feed.stop()
                elif feed.idle_since is None:
                    feed.idle_since = now

    def attach(self, feed: SessionFeed, watcher: Watcher) -> None:
        feed.watchers.add(watcher)
        feed.idle_since = None
        self._ensure_reaper()

    def detach(self, feed: SessionFeed, watcher: Watcher) -> None:
        feed.watchers.discard(watcher)
        if not feed.watchers and self.linger_s <= 0:
            self.feeds.pop(feed.session_id, None)
            asyncio.get_running_loop().create_task(feed.stop())

    async def close(self) -> None:
        if self._reaper is not None:
            self._reaper.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._reaper
        for feed in list(self.feeds.values()):
            await feed.stop()
        self.feeds.clear()


async def _catch_up(
    runtime: Runtime, forks: Forks, builder: DocumentBuilder, after: int, rfc: bool
) -> AsyncIterator[bytes]:
    async for e in handing_back(await events_after(runtime, forks, builder.session_id, after)):
        ops = builder.apply(e)
        if ops:
            yield frame("patch", dumps(to_rfc6902(ops, builder.doc) if rfc else ops), e.position)


def _end(doc: dict[str, Any]) -> bytes:
    return frame("end", dumps({"status": doc["status"], "version": doc["version"]}))


async def _next(watcher: Watcher, until: asyncio.Future[int] | None, wait_s: float) -> Entry | None:
    """The watcher's next entry; None on a heartbeat timeout or when ``until`` resolves first."""
    if until is None or until.done():
        try:
            async with asyncio.timeout(wait_s):  # not wait_for: 3.11's can lose a cancel
                return await watcher.queue.get()
        except TimeoutError:
            return None
    if not watcher.queue.empty():
        return watcher.queue.get_nowait()
    get: asyncio.Future[Any] = asyncio.ensure_future(watcher.queue.get())
    waiting: set[asyncio.Future[Any]] = {get, until}
    try:
        await asyncio.wait(waiting, timeout=wait_s, return_when=asyncio.FIRST_COMPLETED)
    finally:
        if not get.done():
            get.cancel()
    if get.done() and not get.cancelled():
        got: Entry = get.result()
        return got
    return None


@dataclass
class _Stream:
    """One watcher's stream of a session document: the feed it reads and what it sent."""

    feeds: Feeds
    session_id: str
    watcher: Watcher
    until: asyncio.Future[int] | None
    #: the feed to detach from when the stream ends (set as soon as one is looked up)
    feed: SessionFeed | None = None
    #: the log position of the last snapshot or patch this stream sent
    sent: int = 0
    #: the end went out before any live patch: nothing left to pump
    over: bool = False

    async def snapshot(self) -> AsyncIterator[bytes]:
        """A fresh start: the live feed's document, attached to its patches (or, ended, the end)."""
        feed = self.feed = await self.feeds.get(self.session_id)
        if feed.ended:
            yield frame("snapshot", dump_bytes(feed.doc), feed.position)
            yield _end(feed.doc)
            self.over = True
            return
        # no await between the snapshot and attaching: nothing can slip in between
        first = frame("snapshot", dump_bytes(feed.doc), feed.position)
        self.sent = feed.position
        self.feeds.attach(feed, self.watcher)
        yield first

    async def resume(self, last_id: int) -> AsyncIterator[bytes]:
        """A reconnect after ``last_id``: from the live feed's ring if it reaches back that far,
        otherwise from the log until it does."""
        self.sent = last_id
        feed = self.feed = self.feeds.feeds.get(self.session_id)
        backlog = None if feed is None or feed.ended else feed.backlog(last_id, self.watcher.rfc)
        if feed is not None and backlog is not None:
            self._join(feed, backlog)
            return
        async for chunk in self._from_log(last_id):
            yield chunk

    async def _from_log(self, last_id: int) -> AsyncIterator[bytes]:
        """The document rebuilt at ``last_id`` from the log, caught up until the session ends
        (the end goes out) or a live feed's ring reaches back to what was sent."""
        runtime, forks, rfc = self.feeds.runtime, self.feeds.forks, self.watcher.rfc
        builder = await load_builder(runtime, forks, self.session_id, upto_position=last_id)
        async for chunk in _catch_up(runtime, forks, builder, last_id, rfc):
            yield chunk
        self.sent = builder.position
        while builder.doc["status"] not in TERMINAL:
            feed = self.feed = await self.feeds.get(self.session_id)
            backlog = feed.backlog(self.sent, rfc) if not feed.ended else None
            if backlog is not None:
                self._join(feed, backlog)
                return
            async for chunk in _catch_up(runtime, forks, builder, self.sent, rfc):
                yield chunk
            self.sent = builder.position
        yield _end(builder.doc)
        self.over = True

    def _join(self, feed: SessionFeed, backlog: list[Entry]) -> None:
        """Attach to ``feed``, with the patches of its ring this stream has not sent queued."""
        self.feeds.attach(feed, self.watcher)
        for en in backlog:
            self.watcher.put(en)

    async def pump(self, heartbeat_s: float) -> AsyncIterator[bytes]:
        """The attached feed's patches as they come, heartbeats in between, then the end (or error)."""
        until = self.until
        while True:
            if until is not None and until.done():
                if not until.cancelled() and (exc := until.exception()) is not None:
                    yield _failed(exc)
                    return
                if until.cancelled() or self.sent >= until.result():
                    return
            nxt = await _next(self.watcher, until, heartbeat_s)
            if nxt is None:
                if until is None or not until.done():
                    yield b": ping\n\n"
                continue
            chunks, ended = self._drain(nxt)
            if chunks:
                yield b"".join(chunks)
            if ended:
                if not self.watcher.lagged and self.feed is not None:
                    yield _end(self.feed.doc)
                return

    def _drain(self, first: Entry) -> tuple[list[bytes], bool]:
        """``first`` and the entries queued behind it as patch frames, and whether the feed ended;
        a committed run of tokens arrives together and goes out in one write, not one per token."""
        rfc, queue = self.watcher.rfc, self.watcher.queue
        chunks: list[bytes] = []
        en = first
        while True:
            if en is END:
                return chunks, True
            if en.position > self.sent:
                data = en.rfc if rfc and en.rfc is not None else en.plus
                chunks.append(frame("patch", data, en.position))
                self.sent = en.position
                if self._reached_until():
                    return chunks, False
            if queue.empty():
                return chunks, False
            en = queue.get_nowait()

    def _reached_until(self) -> bool:
        """``until`` gave a log position, and the patch at it went out."""
        u = self.until
        if u is None or not u.done() or u.cancelled() or u.exception() is not None:
            return False
        return self.sent >= u.result()


def _failed(exc: BaseException) -> bytes:
    """The error frame of the generation a stream was following to its end."""
    from sessiontape.transports.http.server.errors import error_body

    code = getattr(exc, "code", "internal")
    message = getattr(exc, "message", "generation failed")
    return frame("error", dumps(error_body(code, message)))


async def session_stream(
    feeds: Feeds,
    session_id: str,
    last_id: int | None,
    *,
    rfc: bool = False,
    heartbeat_s: float = 15.0,
    until: asyncio.Future[int] | None = None,
) -> AsyncGenerator[bytes, None]:
    """The SSE byte stream of a session document: snapshot (or resume), patches, end.

    With ``last_id`` (a position this stream sent) no snapshot is sent: the
    patches after that position follow, exactly. ``until`` (a future giving
    a log position) ends the stream once the patch at that position went out;
    such a stream's first chunk comes as soon as it is attached (``b""`` when
    a resume has nothing to send yet), so its caller can then start what it follows.
    """
    stream = _Stream(feeds, session_id, Watcher(rfc), until)
    try:
        sent = False
        async for chunk in stream.snapshot() if last_id is None else stream.resume(last_id):
            sent = True
            yield chunk
        if not sent and until is not None:
            yield b""
        if not stream.over:
            async for chunk in stream.pump(heartbeat_s):
                yield chunk
    finally:
        if stream.feed is not None:
            feeds.detach(stream.feed, stream.watcher)
