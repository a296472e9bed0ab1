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
import datetime
import json
import logging
import time
from collections import Counter, OrderedDict
from collections.abc import AsyncGenerator, AsyncIterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar, cast

import nostr_sdk as ns

from core.engine import SamplingParams
from core.errors import (
    ConcurrencyError,
    ConfigError,
    FailedPrecondition,
    InvalidParameters,
    SessionNotFound,
    SessiontapeError,
)
from core.events import Event, NewEvent, T
from core.runtime import Runtime
from transports.nostr import d4, nip90
from transports.nostr.errors import to_err
from transports.nostr.settings import FunctionSpec, Settings

log = logging.getLogger("sessiontape.nostr")

FUNCTION_TAG = "d4-function"

_V = TypeVar("_V")


class Lru(OrderedDict[str, _V]):
    """A dict that forgets its least recently written keys beyond ``size``."""

    def __init__(self, size: int) -> None:
        super().__init__()
        self.size = size

    def __setitem__(self, key: str, value: _V) -> None:
        super().__setitem__(key, value)
        self.move_to_end(key)
        while len(self) > self.size:
            self.popitem(last=False)


def call_session_id(call_id: str) -> str:
    return "d4_" + call_id[:48]


def answer_of(payload: Mapping[str, Any]) -> str | None:
    """The call a worker event is the final answer to (result, error, price suggestion), else None."""
    tags = payload.get("tags") or []
    refs = d4.e_refs(tags)
    if not refs:
        return None
    kind = payload.get("kind")
    if kind == nip90.KIND_FEEDBACK:
        return refs[0] if nip90.feedback_status(tags) in ("error", "payment-required") else None
    if kind == nip90.KIND_RESULT:
        return refs[0]
    if kind == 1:
        try:
            partial = d4.parse_object(str(payload.get("content", ""))).get("partial", False)
        except InvalidParameters:
            return None
        return None if partial else refs[0]
    return None


@dataclass(frozen=True)
class ResultRef:
    """What the worker knows about a result it sent."""

    session_id: str
    call_id: str
    caller: str
    more_results: bool
    final: bool


@dataclass
class CallRef:
    """A call the worker recorded: where it lives, who sent it, whether it has its answer."""

    session_id: str
    caller: str
    answered: bool = False


class _SessionLock:
    __slots__ = ("lock", "users")

    def __init__(self) -> None:
        self.lock = asyncio.Lock()
        self.users = 0


class D4Worker:
    def __init__(self, runtime: Runtime, settings: Settings) -> None:
        self.runtime = runtime
        self.settings = settings
        try:
            self.keys = ns.Keys.parse(settings.secret)
        except Exception as exc:  # the SDK's error text may echo the key
            raise ConfigError("transports.nostr: the secret key is not a valid nsec or hex key") from exc
        self.pubkey: str = self.keys.public_key().to_hex()
        #: function event id -> spec (filled in by start)
        self.functions: dict[str, FunctionSpec] = {}
        self.stats: Counter[str] = Counter()
        size = settings.index_size
        # bounded: the log stays the truth for what they forget (see _recall)
        self._seen: Lru[None] = Lru(4 * size)
        self._calls: Lru[CallRef] = Lru(size)
        self._results: Lru[ResultRef] = Lru(size)
        self._published: dict[str, str] = {}
        #: answers recorded but not (known to be) taken by a relay: event id -> (session, signed JSON)
        self._unacked: dict[str, tuple[str, dict[str, Any]]] = {}
        #: answers whose publishing gave up, flagged in the worker session so a restart finds
        #: them however old: event id -> session
        self._flagged: dict[str, str] = {}
        self._republishing = asyncio.Lock()
        self._last_call_at = 0
        #: one per session with a handler inside or waiting; dropped when the last one leaves
        self._locks: dict[str, _SessionLock] = {}
        self._sem = asyncio.Semaphore(settings.max_concurrent_calls)
        self._tasks: set[asyncio.Task[Any]] = set()
        self._client: Any = None
        self._reader: asyncio.Task[None] | None = None
        self._watcher: asyncio.Task[None] | None = None
        self._stopping = False

    @property
    def worker_session_id(self) -> str:
        return "d4w_" + self.pubkey[:48]

    # -- lifecycle ---------------------------------------------------------

    async def start(self) -> str:
        # nostr-sdk runs Python callbacks (policies, monitors) on this loop
        ns.uniffi_set_event_loop(asyncio.get_running_loop())
        await self._scan_log()
        client = ns.ClientBuilder().build()
        opts = (ns.RelayOptions().reconnect(True)
                .retry_interval(datetime.timedelta(seconds=self.settings.reconnect_min_s))
                .adjust_retry_interval(True))
        for url in self.settings.relays:
            try:
                relay_url = ns.RelayUrl.parse(url)
            except Exception as exc:
                raise ConfigError(f"transports.nostr.relays: bad relay URL {url!r}") from exc
            await client.add_relay(relay_url, opts=opts)
        self._client = client
        await client.connect(datetime.timedelta(seconds=self.settings.connect_timeout_s))
        await self._ensure_functions()
        self._republish_soon()
        notes = client.notifications()
        since = self.since()
        await client.subscribe(ns.ReqTarget.auto(self._filters(since)), "d4-calls")
        self._reader = asyncio.create_task(self._read_loop(notes), name="d4-reader")
        self._watcher = asyncio.create_task(self._watch_relays(), name="d4-relay-watch")
        ids = ", ".join(f"{spec.name}={fid}" for fid, spec in self.functions.items())
        line = (f"nostr D4 worker {self.pubkey} on {', '.join(self.settings.relays)}; "
                f"functions {ids}; since {since}")
        log.info("%s", line)
        return line

    async def stop(self, grace: float = 5.0) -> None:
        self._stopping = True
        if self._client is not None:
            with contextlib.suppress(Exception):
                await self._client.unsubscribe_all()
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
        if self._client is not None:
            with contextlib.suppress(Exception):
                await self._client.shutdown()
            self._client = None

    def since(self) -> int:
        """The ``since`` for (re-)subscribing: the last recorded call, less the slack."""
        base = self._last_call_at or int(time.time())
        return max(0, base - self.settings.since_slack_s)

    def _filters(self, since: int) -> list[Any]:
        ts = ns.Timestamp.from_secs(since)
        ids = [ns.EventId.parse(fid) for fid in self.functions]
        out = [ns.Filter().kind(ns.Kind(1)).events(ids).since(ts)]
        if self.settings.nip90:
            out.append(ns.Filter().kind(ns.Kind(nip90.KIND_JOB)).since(ts))
        return out

    async def _watch_relays(self) -> None:
        """Re-subscribe on a relay that came back, with ``since`` from the log.

        nostr-sdk reconnects by itself (retry interval adjusted with back-off);
        this refreshes the subscription so an outage's calls are fetched.
        """
        was: dict[str, bool] = {}
        first = True
        next_republish = time.monotonic() + self.settings.republish_every_s
        while True:
            if not first:
                await asyncio.sleep(0.25)
            first = False
            if self._unacked and time.monotonic() >= next_republish:
                next_republish = time.monotonic() + self.settings.republish_every_s
                self._republish_soon()
            try:
                relays = await self._client.relays()
            except Exception as exc:
                log.debug("listing relays failed: %s", exc)
                continue
            for url, relay in relays.items():
                key = str(url)
                up = relay.status() == ns.RelayStatus.CONNECTED
                if was.get(key) is False and up:
                    since = self.since()
                    try:
                        target = ns.ReqTarget.manual({url: self._filters(since)})
                        await self._client.subscribe(target, "d4-calls")
                        log.info("relay %s reconnected; re-subscribed since %d", key, since)
                        self.stats["resubscribed"] += 1
                        self._republish_soon()
                    except Exception as exc:
                        log.warning("relay %s: re-subscribe failed: %s", key, exc)
                        continue
                elif was.get(key) and not up:
                    self.stats["disconnects"] += 1
                    log.warning("relay %s disconnected (%s); reconnecting", key, relay.status())
                was[key] = up

    async def _read_loop(self, notes: Any) -> None:
        while True:
            note = await notes.next()
            if note.is_shutdown():
                return
            if note.is_new_event():
                self.ingest(note.event)

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
            batch = await self.runtime.log.list_sessions(protocol="nostr", limit=page, offset=offset)
            rows += [r for r in batch if r.id != self.worker_session_id]
            if len(batch) < page:
                break
            offset += page
        # newest activity first: the newest call is learned before the window is applied
        rows.sort(key=lambda r: r.updated_at, reverse=True)
        window = 2 * self.settings.since_slack_s
        read: set[str] = set()
        for row in rows:
            recent = not self._last_call_at or row.updated_at >= self._last_call_at - window
            if row.status == "open" or recent or row.id in self._flagged.values():
                await self._recall(row.id)
                read.add(row.id)
        for sid in set(self._flagged.values()) - read:
            await self._recall(sid)
            read.add(sid)
        self.stats["scanned_sessions"] = len(read)
        log.info("read %d of %d nostr sessions from the log; %d answers to publish again",
                 len(read), len(rows), len(self._unacked))

    async def _recall(self, session_id: str) -> None:
        """Learn one session's calls, answers and results from the log (nothing if it does not exist)."""
        for e in await self.runtime.log.read(session_id):
            self._learn(session_id, e)

    def _note_call(self, created_at: int, recorded_at: float) -> None:
        # a client clock ahead of ours must not move ``since`` past calls not yet seen
        self._last_call_at = max(self._last_call_at, min(int(created_at), int(recorded_at)))

    def _learn(self, session_id: str, e: Event) -> None:
        if e.body.get("transport") != "nostr":
            return
        if e.type == T.NOTE:
            if "published" in e.body:
                self._unacked.pop(str(e.body["published"]), None)
                self._flagged.pop(str(e.body["published"]), None)
            elif "unpublished" in e.body:
                self._flagged[str(e.body["unpublished"])] = str(e.body.get("session_id", ""))
            return
        payload = e.body.get("payload")
        if e.type != T.WIRE or not isinstance(payload, dict):
            return
        eid = str(payload.get("id", ""))
        tags = payload.get("tags") or []
        try:
            obj = d4.parse_object(str(payload.get("content", "")))
        except InvalidParameters:
            obj = {}
        if e.body.get("direction") == "in":
            kind = payload.get("kind")
            if kind == nip90.KIND_JOB or (kind == 1 and d4.classify(obj) == d4.CALL):
                # not "seen": a call recorded but not answered (worker stopped mid-way) is resumed
                if eid not in self._calls:
                    self._calls[eid] = CallRef(session_id, str(payload.get("pubkey", "")))
                self._note_call(int(payload.get("created_at", 0)), e.recorded_at)
            else:
                self._seen[eid] = None
            return
        if payload.get("pubkey") != self.pubkey:
            return
        if any(len(t) >= 2 and t[0] == "t" and t[1] == FUNCTION_TAG for t in tags):
            self._published[str(obj.get("name", ""))] = eid
            self._unacked[eid] = (session_id, payload)
            return
        call_id = answer_of(payload)
        if call_id is not None:
            self._mark_answered(call_id, session_id)
            self._unacked[eid] = (session_id, payload)
        refs = d4.e_refs(tags)
        if payload.get("kind") != 1 or not refs or self.settings.negotiate_function_id in refs[1:]:
            return  # feedback, a NIP-90 result or a price suggestion: nothing to continue
        ref = self._calls.get(refs[0])
        self._results[eid] = ResultRef(session_id, refs[0], ref.caller if ref else "",
                                       bool(obj.get("more_results", False)), not obj.get("partial", False))

    def _mark_answered(self, call_id: str, session_id: str) -> None:
        ref = self._calls.get(call_id)
        if ref is None:
            ref = CallRef(session_id, "")
        ref.answered = True
        self._calls[call_id] = ref

    async def is_answered(self, call_id: str, session_id: str) -> bool:
        """Whether ``call_id`` has its answer; asks the log when the worker's memory has forgotten it."""
        if call_id not in self._calls:
            await self._recall(session_id)
        ref = self._calls.get(call_id)
        return ref is not None and ref.answered

    def record_call(self, session_id: str, payload: Mapping[str, Any]) -> None:
        self._calls[str(payload["id"])] = CallRef(session_id, str(payload["pubkey"]))
        self._note_call(int(payload["created_at"]), time.time())

    # -- function events ---------------------------------------------------

    async def _ensure_functions(self) -> None:
        info = self.runtime.engine.info
        for spec in self.settings.functions:
            fid = spec.id or self._published.get(spec.name)
            if fid is None:
                content = d4.function_content(name=spec.name, description=spec.description,
                                              model_id=info.model_id, engine=info.name,
                                              price_msat=self.settings.price_msat)
                fid = await self._send(await self._worker_session(), content,
                                       [["t", FUNCTION_TAG], ["t", "d4"]])
                self._published[spec.name] = fid
                log.info("published function %s as %s", spec.name, fid)
            self.functions[fid] = spec

    async def _worker_session(self) -> str:
        sid = self.worker_session_id
        try:
            await self.runtime.get(sid)
        except SessionNotFound:
            await self.runtime.open_session("nostr", session_id=sid, label="d4 worker",
                                            meta={"role": "worker", "pubkey": self.pubkey})
        return sid

    # -- incoming ----------------------------------------------------------

    def ingest(self, event: Any) -> bool:
        """Take one event from a relay; returns True when it was queued for handling.

        Forged events (bad id or signature) are dropped and counted;
        duplicates (the same event from several relays, or one already in
        the log) are dropped and counted.
        """
        if self._stopping:
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
        if eid in self._seen:
            self.stats["duplicate"] += 1
            return False
        self._seen[eid] = None
        if event.author().to_hex() == self.pubkey:
            return False
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

    @contextlib.asynccontextmanager
    async def session_lock(self, sid: str) -> AsyncIterator[None]:
        """Serialise the handlers of one session (a call and its continuations)."""
        entry = self._locks.get(sid)
        if entry is None:
            entry = self._locks[sid] = _SessionLock()
        entry.users += 1
        try:
            async with entry.lock:
                yield
        finally:
            entry.users -= 1
            if entry.users == 0:
                del self._locks[sid]

    async def open_call_session(self, sid: str, meta: Mapping[str, Any]) -> None:
        try:
            await self.runtime.get(sid)
        except SessionNotFound:
            with contextlib.suppress(ConcurrencyError):
                await self.runtime.open_session("nostr", session_id=sid, label="d4 call", meta=meta)

    async def _on_call(self, payload: dict[str, Any], fid: str, others: Sequence[str],
                       obj: dict[str, Any] | None, bad: InvalidParameters | None) -> None:
        call_id: str = payload["id"]
        caller: str = payload["pubkey"]
        known = self._calls.get(call_id)
        if known is not None and known.answered:
            self.stats["duplicate"] += 1
            return
        prev = next((self._results[r] for r in others if r in self._results), None)
        sid = prev.session_id if prev else (known.session_id if known else call_session_id(call_id))
        async with self._sem, self.session_lock(sid):
            if await self.is_answered(call_id, sid):
                self.stats["duplicate"] += 1
                return
            if prev is None:
                await self.open_call_session(sid, {"call_id": call_id, "caller": caller, "function_id": fid})
            if call_id not in self._calls:
                await self.runtime.record_wire(sid, "nostr", "in", payload)
                self.record_call(sid, payload)
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
                        raise FailedPrecondition("the referenced result has no more results to continue")
                if d4.needs_negotiation(self.settings.price_msat, call):
                    wanted = call.args.max_tokens or self.settings.default_max_tokens
                    content = d4.negotiation_content(iteration_cost=self.settings.price_msat,
                                                     total_cost=self.settings.price_msat * wanted)
                    self.stats["negotiations"] += 1
                    await self._send(sid, content, [["e", call_id], ["e", self.settings.negotiate_function_id]],
                                     call_id=call_id, final=True, close="negotiation" if prev is None else None)
                    return
                await self._generate(sid, call_id, caller, call, tags)
            except Exception as exc:
                if self._calls.get(call_id, CallRef(sid, "")).answered:
                    # the answer is recorded (and published or queued): a second one would contradict it
                    log.exception("call %s failed after its answer was recorded", call_id)
                    return
                if not isinstance(exc, SessiontapeError):
                    log.exception("call %s failed", call_id)
                await self._fail(sid, call_id, caller, tags, exc, close=prev is None)

    async def _fail(self, sid: str, call_id: str, caller: str, tags: list[list[str]],
                    exc: BaseException, *, close: bool) -> None:
        err = to_err(exc)
        self.stats["errors"] += 1
        await self.runtime.record_error(sid, err["code"], err["message"])
        content = d4.result_content(result=None, iteration_cost=self.settings.price_msat, total_cost=0,
                                    more_results=False, err=err)
        await self._send(sid, content, tags, call_id=call_id, final=True, caller=caller,
                         close="error" if close else None)

    async def _on_feedback(self, payload: dict[str, Any], obj: Mapping[str, Any], others: Sequence[str]) -> None:
        result_id = next((r for r in others if r in self._results), None)
        if result_id is None:
            self.stats["feedback_unknown"] += 1
            return
        ref = self._results[result_id]
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
            await self.runtime.record_feedback(ref.session_id, {
                "score": fb.score, "version": fb.version, "transport": "nostr", "event_id": payload["id"],
                "pubkey": payload["pubkey"], "result_id": result_id, "call_id": ref.call_id})
        self.stats["feedback"] += 1

    # -- generation --------------------------------------------------------

    async def _generate(self, sid: str, call_id: str, caller: str, call: d4.Call, tags: list[list[str]]) -> None:
        rt = self.runtime
        price = self.settings.price_msat
        st = await rt.get(sid)
        append: list[int] = []
        if st.length == 0:
            if call.args.prompt is None:
                raise InvalidParameters("args.prompt is required")
            append = rt.engine.tokenize(call.args.prompt)
        gens = list(st.generations.values())
        answer_start = gens[0].prompt_length if gens else st.length + len(append)
        # a call resumed after a restart has already charged for these
        charged = sum(len(g.tokens) for g in gens if g.action_id == call_id)
        wanted = (call.args.max_tokens or self.settings.default_max_tokens) - charged
        n, _budget_limited = d4.plan_tokens(price, call.max_total_cost - charged * price, max(0, wanted))
        model = rt.engine.info.model_id
        created = int(time.time())
        answer = list(st.tokens[answer_start:])
        produced = charged
        stops = call.args.stop
        finish: str | None = None

        def body(text_tokens: Sequence[int], reason: str | None) -> dict[str, Any]:
            text = rt.engine.detokenize(text_tokens)
            if stops:
                text = d4.cut_at_stop(text, stops) or text
            return d4.completion(completion_id="chatcmpl-" + call_id[:32], model=model, created=created,
                                 text=text, finish_reason=reason, prompt_tokens=answer_start,
                                 completion_tokens=len(text_tokens))

        if n > 0:
            params = SamplingParams(max_tokens=n, temperature=call.args.temperature, top_p=call.args.top_p,
                                    top_k=call.args.top_k, seed=call.args.seed)
            last_n, last_t = produced, time.monotonic()
            gen = cast(AsyncGenerator[Event, None], rt.generate(sid, params, append=append, action_id=call_id))
            async with contextlib.aclosing(gen):
                async for e in gen:
                    if e.type == T.GENERATION_TOKEN and not e.body.get("is_prefill"):
                        produced += 1
                        answer.append(int(e.body["token"]))
                        if stops and d4.cut_at_stop(rt.engine.detokenize(answer), stops) is not None:
                            finish = "stop"
                            break
                        due = (time.monotonic() - last_t) * 1000 >= self.settings.stream_every_ms
                        if produced - last_n >= self.settings.stream_every_tokens or due:
                            last_n, last_t = produced, time.monotonic()
                            content = d4.result_content(result=body(answer, None), iteration_cost=price,
                                                        total_cost=produced * price, more_results=True,
                                                        partial=True)
                            await self._send(sid, content, tags, call_id=call_id, final=False, caller=caller)
                    elif e.type == T.GENERATION_FINISHED:
                        finish = "stop" if e.body["finish_reason"] in ("eos", "stop") else "length"
        if finish is None:
            finish = "length"
        room = st.length < rt.engine.info.max_length
        more = finish == "length" and room
        content = d4.result_content(result=body(answer, finish), iteration_cost=price,
                                    total_cost=produced * price, more_results=more)
        self.stats["answered"] += 1
        await self._send(sid, content, tags, call_id=call_id, final=True, caller=caller, more_results=more,
                         close=None if more else "complete")

    # -- outgoing ----------------------------------------------------------

    async def _send(self, sid: str, content: str, tags: list[list[str]], *, kind: int = 1,
                    call_id: str | None = None, final: bool = False, caller: str = "",
                    more_results: bool = False, close: str | None = None) -> str:
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
            self._mark_answered(answers, sid)
        if call_id is not None and kind == 1 and self.settings.negotiate_function_id not in (t[1] for t in tags[1:]):
            ref = self._calls.get(call_id)
            self._results[eid] = ResultRef(sid, call_id, caller or (ref.caller if ref else ""), more_results, final)
        if close is not None:
            try:
                await self.runtime.close(sid, close)
            except SessiontapeError as exc:  # the answer stands; a session the sweeper closed stays so
                log.warning("closing %s (%s) failed: %s", sid, close, exc)
        if answers is None and FUNCTION_TAG not in (t[1] for t in tags if t[0] == "t"):
            await self.publish(event)  # intermediate results and statuses: best effort
            return eid
        await self._deliver(sid, eid, event, payload)
        return eid

    async def _deliver(self, sid: str, eid: str, event: Any, payload: dict[str, Any]) -> bool:
        """Publish an answer and record which relays took it; queue it for another try when none did."""
        accepted = await self.publish(event)
        if not accepted:
            if eid not in self._unacked:
                self._unacked[eid] = (sid, payload)
            if eid not in self._flagged:
                self._flagged[eid] = sid
                with contextlib.suppress(SessiontapeError):
                    await self.runtime.record(await self._worker_session(), [NewEvent(T.NOTE, {
                        "transport": "nostr", "unpublished": eid, "session_id": sid})])
            self.stats["unacked"] += 1
            return False
        note = NewEvent(T.NOTE, {"transport": "nostr", "published": eid, "relays": accepted})
        await self.runtime.record(sid, [note])
        if eid in self._flagged and sid != self.worker_session_id:
            await self.runtime.record(self.worker_session_id, [note])
        self._unacked.pop(eid, None)
        self._flagged.pop(eid, None)
        return True

    def _republish_soon(self) -> None:
        # in the background: with every relay down, each answer takes its full retry back-off
        if self._unacked and not self._republishing.locked() and not self._stopping:
            task = asyncio.create_task(self.republish(), name="d4-republish")
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)

    async def republish(self) -> int:
        """Publish again the answers no relay has acknowledged; returns how many are now delivered."""
        if not self._unacked or self._client is None:
            return 0
        done = 0
        async with self._republishing:
            for eid, (sid, payload) in list(self._unacked.items()):
                if eid not in self._unacked or self._stopping:
                    continue
                # the same signed event: relays keep one copy per id, so a second delivery is harmless
                event = ns.Event.from_json(json.dumps(payload))
                if await self._deliver(sid, eid, event, payload):
                    done += 1
                    self.stats["republished"] += 1
                    log.info("published %s again (recorded in %s, not acknowledged before)", eid[:12], sid)
        return done

    async def publish(self, event: Any) -> list[str]:
        """Send to every relay; retry the ones that reject (rate limits) with back-off.

        Returns the relays that took the event (``duplicate:`` answers
        included: they already have it), sorted; empty when none did.
        """
        target: Any = None
        eid = event.id().to_hex()
        accepted: set[str] = set()
        failed: dict[str, str] = {}
        for attempt in range(self.settings.publish_retries + 1):
            try:
                if self._client is None:
                    raise ConnectionError("the worker is stopped")
                if target is None:
                    out = await self._client.send_event(event)
                else:
                    out = await self._client.send_event(event, ns.SendEventTarget.to(target))
                accepted |= {str(u) for u in out.success}
                accepted |= {str(u) for u, m in out.failed.items() if str(m).startswith("duplicate")}
                failed = {str(u): str(m) for u, m in out.failed.items() if not str(m).startswith("duplicate")}
            except Exception as exc:  # the SDK raises when no relay took it
                failed = {url: str(exc) for url in (self.settings.relays if target is None else map(str, target))}
            if not failed:
                return sorted(accepted)
            self.stats["publish_failures"] += len(failed)
            for url, msg in failed.items():
                log.warning("relay %s rejected %s (attempt %d): %s", url, eid[:12], attempt + 1, msg)
            if attempt == self.settings.publish_retries or self._client is None:
                break
            target = [ns.RelayUrl.parse(u) for u in failed]
            await asyncio.sleep(min(self.settings.retry_base_s * (2 ** attempt), 5.0))
        log.error("gave up publishing %s to %s", eid[:12], ", ".join(failed))
        return sorted(accepted)
