"""The D4 worker: answers DDIP-001 calls from nostr relays as sessions.

One call is one session (``d4_<call id>``); a funded call that references a
result with ``more_results: true`` continues that result's session. Every
event the worker receives or sends is recorded with its full signed JSON
(``wire.message``, transport ``nostr``) *before* it is acted on or
published, so the log alone says which calls were answered. An answer is
only delivered once a relay took it: that is recorded too (a
``note.recorded`` naming the event and the relays), and answers without
one are published again, on start and while running.

The worker's memory (calls, results, seen events, locks) is bounded: what
falls out of it is looked up in the log again when needed. On start it
reads only the sessions that can still matter (open ones, and those
active around the last call it recorded) and re-subscribes ``since`` that
call (minus a slack for client clock drift).

Usage::

    worker = D4Worker(runtime, Settings.from_options(opts))
    print(await worker.start())
    ...
    await worker.stop()
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
from collections import Counter
from collections.abc import AsyncIterator, Mapping, Sequence
from contextlib import AbstractAsyncContextManager
from typing import Any

import nostr_sdk as ns

from sessiontape.core.errors import (
    ConcurrencyError,
    ConfigError,
    FailedPrecondition,
    InvalidParameters,
    SessionNotFound,
    SessiontapeError,
)
from sessiontape.core.events import NewEvent, T
from sessiontape.core.runtime import Runtime
from sessiontape.transports.nostr import d4, nip90
from sessiontape.transports.nostr.callbook import (
    FUNCTION_TAG,
    CallBook,
    CallRef,
    Lru,
    ResultRef,
    SessionLocks,
    answer_of,
    call_session_id,
    is_function_event,
)
from sessiontape.transports.nostr.errors import to_err
from sessiontape.transports.nostr.relay import Relays
from sessiontape.transports.nostr.settings import FunctionSpec, Settings
from sessiontape.transports.nostr.streaming import CallToAnswer, stream_answer

__all__ = [
    "FUNCTION_TAG",
    "CallRef",
    "D4Worker",
    "Lru",
    "ResultRef",
    "answer_of",
    "call_session_id",
]

log = logging.getLogger("sessiontape.nostr")


class D4Worker:
    """One worker identity on its relays: lifecycle, dispatch of incoming events, recording and
    delivering answers. Relay I/O is :mod:`~sessiontape.transports.nostr.relay`, call state
    :mod:`~sessiontape.transports.nostr.callbook`, streaming :mod:`~sessiontape.transports.nostr.streaming`, NIP-90
    :mod:`~sessiontape.transports.nostr.nip90`."""

    def __init__(self, runtime: Runtime, settings: Settings) -> None:
        self.runtime = runtime
        self.settings = settings
        try:
            self.keys = ns.Keys.parse(settings.secret)
        except Exception as exc:  # the SDK's error text may echo the key
            raise ConfigError(
                "transports.nostr: the secret key is not a valid nsec or hex key"
            ) from exc
        self.pubkey: str = self.keys.public_key().to_hex()
        #: function event id -> spec (filled in by start)
        self.functions: dict[str, FunctionSpec] = {}
        self.stats: Counter[str] = Counter()
        # bounded: the log stays the truth for what it forgets (see _recall)
        self.book = CallBook(self.pubkey, settings)
        self.relays = Relays(settings, self.stats)
        self.locks = SessionLocks()
        self._republishing = asyncio.Lock()
        self._sem = asyncio.Semaphore(settings.max_concurrent_calls)
        self._tasks: set[asyncio.Task[Any]] = set()
        self._reader: asyncio.Task[None] | None = None
        self._watcher: asyncio.Task[None] | None = None
        self._stopping = False

    @property
    def worker_session_id(self) -> str:
        return "d4w_" + self.pubkey[:48]

    # -- lifecycle ---------------------------------------------------------

    async def start(self) -> str:
        await self._scan_log()
        await self.relays.connect()
        await self._ensure_functions()
        self._republish_soon()
        since = self.since()
        notes = await self.relays.subscribe(self._filters(since))
        self._reader = asyncio.create_task(self.relays.read(notes, self.ingest), name="d4-reader")
        self._watcher = asyncio.create_task(self._watch_relays(), name="d4-relay-watch")
        ids = ", ".join(f"{spec.name}={fid}" for fid, spec in self.functions.items())
        line = (
            f"nostr D4 worker {self.pubkey} on {', '.join(self.settings.relays)}; "
            f"functions {ids}; since {since}"
        )
        log.info("%s", line)
        return line

    async def stop(self, grace: float = 5.0) -> None:
        self._stopping = True
        await self.relays.unsubscribe()
        if self._tasks:
            _, pending = await asyncio.wait(list(self._tasks), timeout=grace)
            for p in pending:
                p.cancel()
            if pending:
                await asyncio.wait(pending, timeout=grace)
        background: list[asyncio.Task[None] | None] = [self._watcher, self._reader]
        for bg in background:
            if bg is not None:
                bg.cancel()
                with contextlib.suppress(asyncio.CancelledError, Exception):
                    await bg
        await self.relays.close()

    def since(self) -> int:
        """The ``since`` for (re-)subscribing: the last recorded call, less the slack."""
        return self.book.since()

    def _filters(self, since: int) -> list[Any]:
        ts = ns.Timestamp.from_secs(since)
        ids = [ns.EventId.parse(fid) for fid in self.functions]
        out = [ns.Filter().kind(ns.Kind(1)).events(ids).since(ts)]
        if self.settings.nip90:
            out.append(ns.Filter().kind(ns.Kind(nip90.KIND_JOB)).since(ts))
        return out

    async def _watch_relays(self) -> None:
        """Re-subscribe relays that come back; publish unacknowledged answers again now and then."""
        next_republish = time.monotonic() + self.settings.republish_every_s

        def tick() -> None:
            nonlocal next_republish
            if self.book.unacked and time.monotonic() >= next_republish:
                next_republish = time.monotonic() + self.settings.republish_every_s
                self._republish_soon()

        await self.relays.watch(self._filters, self.since, self._republish_soon, tick)

    # -- the log as the worker's memory -------------------------------------

    async def _scan_log(self) -> None:
        """Rebuild the indexes from the sessions that can still matter.

        Those are: the worker session (functions, answers left unpublished),
        every open call session (continuable results, calls to resume), and
        the sessions active within two slacks of the newest recorded call
        (the calls a ``since`` re-subscription can bring back, and answers a
        crash left unpublished). Older closed sessions are not read: a call
        of theirs delivered again is found by ``_recall``.
        """
        await self._recall(self.worker_session_id)
        rows = []
        page, offset = 500, 0
        while True:  # the index rows only; events are read below for the few that matter
            batch = await self.runtime.reads.list_sessions(
                protocol="nostr", limit=page, offset=offset
            )
            rows += [r for r in batch if r.id != self.worker_session_id]
            if len(batch) < page:
                break
            offset += page
        # newest activity first: the newest call is learned before the window is applied
        rows.sort(key=lambda r: r.updated_at, reverse=True)
        window = 2 * self.settings.since_slack_s
        read: set[str] = set()
        for row in rows:
            recent = not self.book.last_call_at or row.updated_at >= self.book.last_call_at - window
            if row.status == "open" or recent or row.id in self.book.flagged.values():
                await self._recall(row.id)
                read.add(row.id)
        for sid in set(self.book.flagged.values()) - read:
            await self._recall(sid)
            read.add(sid)
        self.stats["scanned_sessions"] = len(read)
        log.info(
            "read %d of %d nostr sessions from the log; %d answers to publish again",
            len(read),
            len(rows),
            len(self.book.unacked),
        )

    async def _recall(self, session_id: str) -> None:
        """Learn one session's calls, answers and results from the log (nothing if it does not exist)."""
        for e in await self.runtime.reads.read_events(session_id):
            self.book.learn(session_id, e)

    async def is_answered(self, call_id: str, session_id: str) -> bool:
        """Whether ``call_id`` has its answer; asks the log when the worker's memory has forgotten it."""
        if call_id not in self.book.calls:
            await self._recall(session_id)
        return self.book.knows_answer(call_id)

    def knows_answer(self, call_id: str) -> bool:
        """Whether memory says ``call_id`` is answered (cheap; :meth:`is_answered` asks the log too)."""
        return self.book.knows_answer(call_id)

    def record_call(self, session_id: str, payload: Mapping[str, Any]) -> None:
        self.book.record_call(session_id, payload)

    async def record_incoming_call(self, sid: str, payload: Mapping[str, Any]) -> None:
        """Record a call's signed event in its session, unless it is already recorded."""
        if str(payload["id"]) not in self.book.calls:
            await self.runtime.record_wire(sid, "nostr", "in", payload)
            self.record_call(sid, payload)

    # -- function events ---------------------------------------------------

    async def _ensure_functions(self) -> None:
        info = self.runtime.engine.info
        for spec in self.settings.functions:
            fid = spec.id or self.book.published.get(spec.name)
            if fid is None:
                content = d4.function_content(
                    name=spec.name,
                    description=spec.description,
                    model_id=info.model_id,
                    engine=info.name,
                    price_msat=self.settings.price_msat,
                )
                fid = await self.send(
                    await self._worker_session(), content, [["t", FUNCTION_TAG], ["t", "d4"]]
                )
                self.book.published[spec.name] = fid
                log.info("published function %s as %s", spec.name, fid)
            self.functions[fid] = spec

    async def _worker_session(self) -> str:
        sid = self.worker_session_id
        try:
            await self.runtime.get(sid)
        except SessionNotFound:
            await self.runtime.open_session(
                "nostr",
                session_id=sid,
                label="d4 worker",
                meta={"role": "worker", "pubkey": self.pubkey},
            )
        return sid

    # -- incoming ----------------------------------------------------------

    def ingest(self, event: Any) -> bool:
        """Take one event from a relay; returns True when it was queued for handling.

        Forged events (bad id or signature) are dropped and counted;
        duplicates (the same event from several relays, or one already in
        the log) are dropped and counted. The worker's own events (its
        results carry the function's tag, so the calls subscription brings
        each back) are dropped first, before their signature is checked.
        """
        if self._stopping or event.author().to_hex() == self.pubkey:
            return False
        try:
            valid = bool(event.verify())
        except Exception:
            valid = False
        if not valid:
            self.stats["forged"] += 1
            log.warning("dropped an event with a bad id or signature")
            return False
        eid = event.id().to_hex()
        if eid in self.book.seen:
            self.stats["duplicate"] += 1
            return False
        self.book.seen[eid] = None
        task = asyncio.create_task(self._handle(event), name=f"d4-{eid[:8]}")
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return True

    async def _handle(self, event: Any) -> None:
        payload: dict[str, Any] = json.loads(event.as_json())
        try:
            if payload["kind"] == nip90.KIND_JOB:
                if self.settings.nip90:
                    await nip90.handle_job(self, payload)
                return
            refs = d4.e_refs(payload["tags"])
            fids = [r for r in refs if r in self.functions]
            if not fids:
                self.stats["unrelated"] += 1
                return
            others = [r for r in refs if r not in self.functions]
            try:
                obj: dict[str, Any] | None = d4.parse_object(payload["content"])
                bad: InvalidParameters | None = None
            except InvalidParameters as exc:
                obj, bad = None, exc
            kind = d4.CALL if obj is None else d4.classify(obj)
            if kind == d4.FEEDBACK:
                assert obj is not None
                await self._on_feedback(payload, obj, others)
            elif kind == d4.CALL:
                await self._on_call(payload, fids[0], others, obj, bad)
            else:
                self.stats["other_results"] += 1
        except Exception:  # one bad event must not stop the worker
            log.exception("handling event %s failed", payload.get("id"))

    def session_lock(self, sid: str) -> AbstractAsyncContextManager[None]:
        """Serialise the handlers of one session (a call and its continuations)."""
        return self.locks.hold(sid)

    @contextlib.asynccontextmanager
    async def call_slot(self, sid: str) -> AsyncIterator[None]:
        """One of ``max_concurrent_calls`` handler slots, then the session's lock."""
        async with self._sem, self.session_lock(sid):
            yield

    async def claim_call(
        self, call_id: str, sid: str, meta: Mapping[str, Any] | None = None
    ) -> bool:
        """Under the call's slot: whether ``call_id`` is still to be answered.

        A new call (``meta``: its session's) opens its session first. When that
        succeeds the log held nothing of it, so there is no answer to look for; when
        the session is there already (the call delivered again, or seen before a
        restart) its log says. A continuation (``meta`` None) runs in the session of
        the result it continues.
        """
        if meta is not None:
            with contextlib.suppress(ConcurrencyError):  # the session is there already
                await self.runtime.open_session("nostr", session_id=sid, label="d4 call", meta=meta)
                return True
        return not await self.is_answered(call_id, sid)

    async def _on_call(
        self,
        payload: dict[str, Any],
        fid: str,
        others: Sequence[str],
        obj: dict[str, Any] | None,
        bad: InvalidParameters | None,
    ) -> None:
        call_id: str = payload["id"]
        caller: str = payload["pubkey"]
        known = self.book.calls.get(call_id)
        if known is not None and known.answered:
            self.stats["duplicate"] += 1
            return
        prev = next((self.book.results[r] for r in others if r in self.book.results), None)
        sid = prev.session_id if prev else (known.session_id if known else call_session_id(call_id))
        meta = None if prev else {"call_id": call_id, "caller": caller, "function_id": fid}
        async with self.call_slot(sid):
            if not await self.claim_call(call_id, sid, meta):
                self.stats["duplicate"] += 1
                return
            await self.record_incoming_call(sid, payload)
            self.stats["calls"] += 1
            tags = [["e", call_id], ["e", fid]]
            try:
                if bad is not None:
                    raise bad
                assert obj is not None
                call = d4.parse_call(obj)
                if prev is not None:
                    if prev.caller != caller:
                        raise FailedPrecondition("only the original caller may continue a result")
                    if not (prev.final and prev.more_results):
                        raise FailedPrecondition(
                            "the referenced result has no more results to continue"
                        )
                if d4.needs_negotiation(self.settings.price_msat, call):
                    wanted = call.args.max_tokens or self.settings.default_max_tokens
                    content = d4.negotiation_content(
                        iteration_cost=self.settings.price_msat,
                        total_cost=self.settings.price_msat * wanted,
                    )
                    self.stats["negotiations"] += 1
                    await self.send(
                        sid,
                        content,
                        [["e", call_id], ["e", self.settings.negotiate_function_id]],
                        call_id=call_id,
                        final=True,
                        close="negotiation" if prev is None else None,
                    )
                    return
                await stream_answer(self, CallToAnswer(sid, call_id, caller, call, tags))
            except Exception as exc:
                if self.book.knows_answer(call_id):
                    # the answer is recorded (and published or queued): a second one would contradict it
                    log.exception("call %s failed after its answer was recorded", call_id)
                    return
                if not isinstance(exc, SessiontapeError):
                    log.exception("call %s failed", call_id)
                await self._fail(sid, call_id, caller, tags, exc, close=prev is None)

    async def _fail(
        self,
        sid: str,
        call_id: str,
        caller: str,
        tags: list[list[str]],
        exc: BaseException,
        *,
        close: bool,
    ) -> None:
        err = to_err(exc)
        self.stats["errors"] += 1
        await self.runtime.record_error(sid, err["code"], err["message"])
        content = d4.result_content(
            result=None,
            iteration_cost=self.settings.price_msat,
            total_cost=0,
            more_results=False,
            err=err,
        )
        await self.send(
            sid,
            content,
            tags,
            call_id=call_id,
            final=True,
            caller=caller,
            close="error" if close else None,
        )

    async def _on_feedback(
        self, payload: dict[str, Any], obj: Mapping[str, Any], others: Sequence[str]
    ) -> None:
        result_id = next((r for r in others if r in self.book.results), None)
        if result_id is None:
            self.stats["feedback_unknown"] += 1
            return
        ref = self.book.results[result_id]
        try:
            fb = d4.parse_feedback(obj)
        except InvalidParameters as exc:
            self.stats["feedback_invalid"] += 1
            log.warning("dropped feedback %s: %s", payload["id"], exc.message)
            return
        async with self.session_lock(ref.session_id):
            # the seen-set is bounded: the session's own feedback list is the truth for duplicates
            st = await self.runtime.get(ref.session_id)
            if any(f.get("event_id") == payload["id"] for f in st.feedback):
                self.stats["duplicate"] += 1
                return
            await self.runtime.record_wire(ref.session_id, "nostr", "in", payload)
            await self.runtime.record_feedback(
                ref.session_id,
                {
                    "score": fb.score,
                    "version": fb.version,
                    "transport": "nostr",
                    "event_id": payload["id"],
                    "pubkey": payload["pubkey"],
                    "result_id": result_id,
                    "call_id": ref.call_id,
                },
            )
        self.stats["feedback"] += 1

    # -- outgoing ----------------------------------------------------------

    async def send(
        self,
        sid: str,
        content: str,
        tags: list[list[str]],
        *,
        kind: int = 1,
        call_id: str | None = None,
        final: bool = False,
        caller: str = "",
        more_results: bool = False,
        close: str | None = None,
    ) -> str:
        """Sign, record, close the session (``close`` = reason), publish, record the relays' ack.

        Durable before visible: a client that has the event can rely on the
        log having it, and on the session being closed when it says so.
        """
        builder = ns.EventBuilder(ns.Kind(kind), content).tags([ns.Tag.parse(t) for t in tags])
        event = builder.finalize(self.keys)
        payload = json.loads(event.as_json())
        await self.runtime.record_wire(sid, "nostr", "out", payload)
        eid: str = payload["id"]
        answers = answer_of(payload)
        if answers is not None:
            self.book.mark_answered(answers, sid)
        if (
            call_id is not None
            and kind == 1
            and self.settings.negotiate_function_id not in (t[1] for t in tags[1:])
        ):
            self.book.record_result(eid, sid, call_id, caller, more_results, final)
        if close is not None:
            try:
                await self.runtime.close(sid, close)
            except (
                SessiontapeError
            ) as exc:  # the answer stands; a session the sweeper closed stays so
                log.warning("closing %s (%s) failed: %s", sid, close, exc)
        if answers is None and not is_function_event(tags):
            await self.publish(event)  # intermediate results and statuses: best effort
            return eid
        await self._deliver(sid, eid, event, payload)
        return eid

    async def _deliver(self, sid: str, eid: str, event: Any, payload: dict[str, Any]) -> bool:
        """Publish an answer and record which relays took it; queue it for another try when none did."""
        accepted = await self.publish(event)
        if not accepted:
            if eid not in self.book.unacked:
                self.book.unacked[eid] = (sid, payload)
            if eid not in self.book.flagged:
                self.book.flagged[eid] = sid
                with contextlib.suppress(SessiontapeError):
                    await self.runtime.record(
                        await self._worker_session(),
                        [
                            NewEvent(
                                T.NOTE,
                                {"transport": "nostr", "unpublished": eid, "session_id": sid},
                            )
                        ],
                    )
            self.stats["unacked"] += 1
            return False
        note = NewEvent(T.NOTE, {"transport": "nostr", "published": eid, "relays": accepted})
        await self.runtime.record(sid, [note])
        if eid in self.book.flagged and sid != self.worker_session_id:
            await self.runtime.record(self.worker_session_id, [note])
        self.book.delivered(eid)
        return True

    def _republish_soon(self) -> None:
        # in the background: with every relay down, each answer takes its full retry back-off
        if self.book.unacked and not self._republishing.locked() and not self._stopping:
            task = asyncio.create_task(self.republish(), name="d4-republish")
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)

    async def republish(self) -> int:
        """Publish again the answers no relay has acknowledged; returns how many are now delivered."""
        if not self.book.unacked or self.relays.publisher is None:
            return 0
        done = 0
        async with self._republishing:
            for eid, (sid, payload) in list(self.book.unacked.items()):
                if eid not in self.book.unacked or self._stopping:
                    continue
                # the same signed event: relays keep one copy per id, so a second delivery is harmless
                event = ns.Event.from_json(json.dumps(payload))
                if await self._deliver(sid, eid, event, payload):
                    done += 1
                    self.stats["republished"] += 1
                    log.info(
                        "published %s again (recorded in %s, not acknowledged before)",
                        eid[:12],
                        sid,
                    )
        return done

    async def publish(self, event: Any) -> list[str]:
        """Send to every relay, retrying rejections; returns the relays that took it (empty: none)."""
        return await self.relays.publish(event)
