"""The D4 worker: answers DDIP-001 calls from nostr relays as sessions.

One call is one session (``d4_<call id>``); a funded call that references a
result with ``more_results: true`` continues that result's session. Every
event the worker receives or sends is recorded with its full signed JSON
(``wire.message``, transport ``nostr``) *before* it is acted on or
published, so the log alone says which calls were answered: on start the
worker rebuilds its indexes from it and re-subscribes ``since`` the last
call it recorded (minus a slack for client clock drift).

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
from collections import Counter
from collections.abc import AsyncGenerator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, cast

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
from core.events import Event, T
from core.runtime import Runtime
from transports.nostr import d4, nip90
from transports.nostr.errors import to_err
from transports.nostr.settings import FunctionSpec, Settings

log = logging.getLogger("sessiontape.nostr")

FUNCTION_TAG = "d4-function"


def call_session_id(call_id: str) -> str:
    return "d4_" + call_id[:48]


@dataclass(frozen=True)
class ResultRef:
    """What the worker knows about a result it sent."""

    session_id: str
    call_id: str
    caller: str
    more_results: bool
    final: bool


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
        self._seen: set[str] = set()
        self._answered: set[str] = set()
        self._results: dict[str, ResultRef] = {}
        self._call_sessions: dict[str, str] = {}
        self._callers: dict[str, str] = {}
        self._published: dict[str, str] = {}
        self._last_call_at = 0
        self._locks: dict[str, asyncio.Lock] = {}
        self._sem = asyncio.Semaphore(settings.max_concurrent_calls)
        self._tasks: set[asyncio.Task[None]] = set()
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
        while True:
            if not first:
                await asyncio.sleep(0.25)
            first = False
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
        page = 500
        offset = 0
        while True:
            rows = await self.runtime.log.list_sessions(protocol="nostr", limit=page, offset=offset,
                                                        newest_first=False)
            for row in rows:
                for e in await self.runtime.log.read(row.id):
                    if e.type == T.WIRE and e.body.get("transport") == "nostr":
                        payload = e.body.get("payload")
                        if isinstance(payload, dict):
                            self._learn(row.id, str(e.body.get("direction")), payload)
            if len(rows) < page:
                return
            offset += page

    def _learn(self, session_id: str, direction: str, payload: Mapping[str, Any]) -> None:
        eid = str(payload.get("id", ""))
        tags = payload.get("tags") or []
        try:
            obj = d4.parse_object(str(payload.get("content", "")))
        except InvalidParameters:
            obj = {}
        if direction == "in":
            kind = payload.get("kind")
            if kind == nip90.KIND_JOB or (kind == 1 and d4.classify(obj) == d4.CALL):
                # not "seen": a call recorded but not answered (worker stopped mid-way) is resumed
                self._call_sessions[eid] = session_id
                self._callers[eid] = str(payload.get("pubkey", ""))
                self._last_call_at = max(self._last_call_at, int(payload.get("created_at", 0)))
            else:
                self._seen.add(eid)
            return
        if payload.get("pubkey") != self.pubkey:
            return
        if any(len(t) >= 2 and t[0] == "t" and t[1] == FUNCTION_TAG for t in tags):
            self._published[str(obj.get("name", ""))] = eid
            return
        refs = d4.e_refs(tags)
        if payload.get("kind") == nip90.KIND_FEEDBACK or not refs:
            if payload.get("kind") == nip90.KIND_FEEDBACK and refs:
                st = nip90.feedback_status(tags)
                if st in ("error", "payment-required"):
                    self._answered.add(refs[0])
            return
        call_id = refs[0]
        final = not obj.get("partial", False)
        if final:
            self._answered.add(call_id)
        if self.settings.negotiate_function_id in refs[1:]:
            return  # a price suggestion, not a result to continue
        self._results[eid] = ResultRef(session_id, call_id, self._callers.get(call_id, ""),
                                       bool(obj.get("more_results", False)), final)

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
        self._seen.add(eid)
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

    def _lock(self, sid: str) -> asyncio.Lock:
        lock = self._locks.get(sid)
        if lock is None:
            lock = self._locks[sid] = asyncio.Lock()
        return lock

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
        if call_id in self._answered:
            self.stats["duplicate"] += 1
            return
        prev = next((self._results[r] for r in others if r in self._results), None)
        sid = prev.session_id if prev else self._call_sessions.get(call_id, call_session_id(call_id))
        async with self._sem, self._lock(sid):
            if call_id in self._answered:
                return
            if prev is None:
                await self.open_call_session(sid, {"call_id": call_id, "caller": caller, "function_id": fid})
            if call_id not in self._call_sessions:
                await self.runtime.record_wire(sid, "nostr", "in", payload)
                self._call_sessions[call_id] = sid
                self._callers[call_id] = caller
                self._last_call_at = max(self._last_call_at, int(payload["created_at"]))
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
                                     call_id=call_id, final=True)
                    if prev is None:
                        await self.runtime.close(sid, "negotiation")
                    return
                await self._generate(sid, call_id, caller, call, tags)
            except SessiontapeError as exc:
                await self._fail(sid, call_id, caller, tags, exc, close=prev is None)
            except Exception as exc:
                log.exception("call %s failed", call_id)
                await self._fail(sid, call_id, caller, tags, exc, close=prev is None)

    async def _fail(self, sid: str, call_id: str, caller: str, tags: list[list[str]],
                    exc: BaseException, *, close: bool) -> None:
        err = to_err(exc)
        self.stats["errors"] += 1
        await self.runtime.record_error(sid, err["code"], err["message"])
        content = d4.result_content(result=None, iteration_cost=self.settings.price_msat, total_cost=0,
                                    more_results=False, err=err)
        await self._send(sid, content, tags, call_id=call_id, final=True, caller=caller)
        if close:
            with contextlib.suppress(SessiontapeError):
                await self.runtime.close(sid, "error")

    async def _on_feedback(self, payload: dict[str, Any], obj: Mapping[str, Any], others: Sequence[str]) -> None:
        ref = next((self._results[r] for r in others if r in self._results), None)
        if ref is None:
            self.stats["feedback_unknown"] += 1
            return
        try:
            fb = d4.parse_feedback(obj)
        except InvalidParameters as exc:
            self.stats["feedback_invalid"] += 1
            log.warning("dropped feedback %s: %s", payload["id"], exc.message)
            return
        result_id = next(r for r in others if r in self._results)
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
        await self._send(sid, content, tags, call_id=call_id, final=True, caller=caller, more_results=more)
        self.stats["answered"] += 1
        if not more:
            await rt.close(sid, "complete")

    # -- outgoing ----------------------------------------------------------

    async def _send(self, sid: str, content: str, tags: list[list[str]], *, kind: int = 1,
                    call_id: str | None = None, final: bool = False, caller: str = "",
                    more_results: bool = False) -> str:
        """Sign, record (durable before visible), then publish; returns the event id."""
        builder = ns.EventBuilder(ns.Kind(kind), content).tags([ns.Tag.parse(t) for t in tags])
        event = builder.finalize(self.keys)
        payload = json.loads(event.as_json())
        await self.runtime.record_wire(sid, "nostr", "out", payload)
        eid: str = payload["id"]
        if call_id is not None:
            if final:
                self._answered.add(call_id)
            if kind == 1 and self.settings.negotiate_function_id not in (t[1] for t in tags[1:]):
                self._results[eid] = ResultRef(sid, call_id, caller or self._callers.get(call_id, ""),
                                               more_results, final)
        await self.publish(event)
        return eid

    async def publish(self, event: Any) -> bool:
        """Send to every relay; retry the ones that reject (rate limits) with back-off."""
        target: Any = None
        eid = event.id().to_hex()
        for attempt in range(self.settings.publish_retries + 1):
            try:
                if target is None:
                    out = await self._client.send_event(event)
                else:
                    out = await self._client.send_event(event, ns.SendEventTarget.to(target))
                failed = {str(u): str(m) for u, m in out.failed.items() if not str(m).startswith("duplicate")}
            except Exception as exc:  # the SDK raises when no relay took it
                failed = {url: str(exc) for url in (self.settings.relays if target is None else map(str, target))}
            if not failed:
                return True
            self.stats["publish_failures"] += len(failed)
            for url, msg in failed.items():
                log.warning("relay %s rejected %s (attempt %d): %s", url, eid[:12], attempt + 1, msg)
            if attempt == self.settings.publish_retries or self._client is None:
                break
            target = [ns.RelayUrl.parse(u) for u in failed]
            await asyncio.sleep(min(self.settings.retry_base_s * (2 ** attempt), 5.0))
        log.error("gave up publishing %s to %s", eid[:12], ", ".join(failed))
        return False
