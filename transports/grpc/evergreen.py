"""Evergreen v2 over gRPC: ``EvergreenService/StartSession``, one stream = one session.

Each stream opens a session (protocol ``evergreen``) and runs two tasks
beside the response generator:

* the *reader* records every incoming ``NodeFragment`` (``node.fragment``,
  direction ``in``; the rules are :func:`sessiontape.core.nodes.check_fragment`) and
  ``Action`` (``action.submitted``) as it arrives, and queues the actions;
* the *worker* runs the queued actions in arrival order. An action first
  waits at a data-dependency barrier until every node it reads is complete
  (the reader keeps accepting fragments meanwhile), then runs; GENERATE
  streams its output node back as fragments, each recorded (direction
  ``out``) before it is sent.

A GENERATE given tools may make calls: each goes to the client as an action
of its own, and the client's answer is that action's output node
(:mod:`sessiontape.transports.grpc.evergreen_calls`).

Any failed action, invalid fragment or protocol violation aborts the
session (``session.aborted`` with the error's code) and ends the stream with
the status from :mod:`sessiontape.transports.grpc.status`. A client that half-closes
after its last message gets every pending action's output, then the stream
ends OK and the session is closed (reason ``client``); a stream cancelled
by the client or by server shutdown stops the running generation (recorded
as ``cancelled``) and closes the session with reason ``cancelled``.
docs/protocols/evergreen.md lists every decision the seed leaves open.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import logging
from collections import deque
from collections.abc import AsyncGenerator, AsyncIterator, Sequence
from dataclasses import dataclass
from typing import Any, cast

from sessiontape.core.bodies import NodeFragment, action_id_of, body
from sessiontape.core.document.text import TextStream
from sessiontape.core.engine.interface import SamplingParams
from sessiontape.core.errors import (
    InvalidAction,
    InvalidFragment,
    ProtocolViolation,
    SessiontapeError,
    TargetNotFound,
    shown,
)
from sessiontape.core.events import Event, NewEvent, T
from sessiontape.core.generation.request import GenerateRequest
from sessiontape.core.nodes import FragmentIn, missing, text_of
from sessiontape.core.runtime import Runtime
from sessiontape.core.session.state import SessionState
from sessiontape.core.tools import ToolUse
from sessiontape.transports.grpc import evergreen_calls as calls
from sessiontape.transports.grpc.evergreen_config import config_json, generate_config
from sessiontape.transports.grpc.gen.evergreen.v2 import evergreen_pb2, evergreen_pb2_grpc
from sessiontape.transports.grpc.service import GrpcService
from sessiontape.transports.grpc.settings import GrpcSettings
from sessiontape.transports.grpc.status import code_for, message_for

log = logging.getLogger("sessiontape.grpc.evergreen")

SERVICE = evergreen_pb2.DESCRIPTOR.services_by_name["EvergreenService"].full_name
GENERATE = "GENERATE"
#: Output parameter names GENERATE fills (the seed's examples use both).
GENERATE_OUTPUTS = frozenset({"text", "response"})
OUT_MIMETYPE = "text/plain; charset=utf-8"
#: Outgoing messages queued before GENERATE waits for the client to read.
HIGH_WATER = 32


@dataclass(frozen=True)
class PendingAction:
    id: str
    name: str
    inputs: tuple[tuple[str, str], ...]
    outputs: tuple[tuple[str, str], ...]
    params: SamplingParams
    #: the tools the model may call (None: none)
    tools: ToolUse | None = None


# -- wire <-> core ------------------------------------------------------------


def _metadata_dict(m: evergreen_pb2.ChunkMetadata) -> dict[str, Any]:
    out: dict[str, Any] = {"mimetype": m.mimetype}
    if m.role:
        out["role"] = m.role
    if m.original_file_name:
        out["original_file_name"] = m.original_file_name
    if m.HasField("capture_time"):
        try:
            out["capture_time"] = m.capture_time.ToJsonString()
        except ValueError as exc:  # seconds/nanos outside the Timestamp range
            raise InvalidFragment(f"capture_time is not a valid timestamp: {exc}") from None
    if m.experimental:
        out["experimental"] = [
            {"type_url": a.type_url, "value": base64.b64encode(a.value).decode()}
            for a in m.experimental
        ]
    return out


def fragment_in(f: evergreen_pb2.NodeFragment) -> FragmentIn:
    """A wire fragment as the core takes it (the seed's defaults are proto3's)."""
    if not f.HasField("chunk_fragment"):
        return FragmentIn(id=f.id, seq=f.seq, continued=f.continued, child_ids=tuple(f.child_ids))
    c = f.chunk_fragment
    metadata = _metadata_dict(c.metadata) if c.HasField("metadata") else None
    if f.seq == 0 and metadata is None:
        raise InvalidFragment(f"node {f.id}: the seq 0 fragment of a leaf must carry metadata")
    which = c.WhichOneof("payload")
    return FragmentIn(
        id=f.id,
        seq=f.seq,
        continued=f.continued,
        child_ids=tuple(f.child_ids),
        has_chunk=True,
        metadata=metadata,
        ref=c.ref if which == "ref" else None,
        data=c.data if which == "data" else None,
    )


def fragment_out(f: FragmentIn) -> evergreen_pb2.NodeFragment:
    msg = evergreen_pb2.NodeFragment(
        id=f.id, seq=f.seq, continued=f.continued, child_ids=list(f.child_ids)
    )
    if f.has_chunk:
        chunk = msg.chunk_fragment
        chunk.SetInParent()
        if f.metadata is not None:
            chunk.metadata.mimetype = str(f.metadata.get("mimetype", ""))
        if f.ref is not None:
            chunk.ref = f.ref
        elif f.data is not None:
            chunk.data = f.data
    return msg


# -- one stream ---------------------------------------------------------------


class _Stopped(Exception):
    """The stream is ending: leave the generation (which records it as cancelled)."""


class _Stream:
    """The state of one StartSession call."""

    def __init__(self, runtime: Runtime, session_id: str, endings: set[asyncio.Task[None]]) -> None:
        self.runtime = runtime
        self.sid = session_id
        #: the service's endings still recording (see EvergreenServicer)
        self._endings = endings
        self.loop = asyncio.get_running_loop()
        self.outbox: asyncio.Queue[evergreen_pb2.SessionMessage | None] = asyncio.Queue()
        self.actions: asyncio.Queue[PendingAction | None] = asyncio.Queue()
        self.changed = asyncio.Event()
        self.drained = asyncio.Event()
        self.error: BaseException | None = None
        self.stopping = False
        self.input_done = False
        #: output node ids of every accepted action: only the server writes them
        self.output_ids: set[str] = set()
        #: accepted actions, and calls sent, without an action.completed/failed event yet
        self.unfinished: list[str] = []
        #: calls sent to the client whose result node is not complete yet
        self.calls = calls.Waiting()
        self.tasks: list[asyncio.Task[None]] = []
        self._ending: asyncio.Task[None] | None = None

    @property
    def targets(self) -> frozenset[str]:
        info = self.runtime.engine.info
        return frozenset({"", info.model_id, info.name})

    def start(self, requests: AsyncIterator[evergreen_pb2.SessionMessage]) -> None:
        self.tasks = [
            asyncio.create_task(
                self._guard(self._read(requests)), name=f"evergreen-read-{self.sid}"
            ),
            asyncio.create_task(self._guard(self._work()), name=f"evergreen-work-{self.sid}"),
        ]

    async def _guard(self, coro: Any) -> None:
        try:
            await coro
        except asyncio.CancelledError:
            raise
        except BaseException as exc:  # every failure aborts the session
            self._fail(exc)

    def _fail(self, exc: BaseException) -> None:
        if self.error is None:
            self.error = exc
            self.stopping = True
            self._wake()
            self.outbox.put_nowait(None)

    def _wake(self) -> None:
        self.changed.set()
        self.drained.set()
        self.actions.put_nowait(None)  # the worker may be parked on an empty queue

    # Runtime mutations are shielded: a cancelled caller must not leave a
    # commit half-applied (the log has it, the cached state would not).

    # -- reader --

    async def _read(self, requests: AsyncIterator[evergreen_pb2.SessionMessage]) -> None:
        async for msg in requests:
            if self.stopping:
                return
            await self._receive(msg)
        self.input_done = True
        self.changed.set()
        self.actions.put_nowait(None)

    async def _receive(self, msg: evergreen_pb2.SessionMessage) -> None:
        # Within one message fragments come before actions (field order on the wire).
        frags = [fragment_in(f) for f in msg.node_fragments]
        for f in frags:
            if f.id in self.output_ids:
                raise ProtocolViolation(
                    f"node {f.id} is an action output: only the server writes it"
                )
        if frags:
            then = self.calls.answers if self.calls else None
            await asyncio.shield(self.runtime.nodes.append_fragments(self.sid, frags, "in", then))
            for c in self.calls.settle():  # committed: tool.result and the call's completion
                self.unfinished.remove(c.action_id)
            self.changed.set()
        for a in msg.actions:
            await self._accept(a)

    async def _accept(self, a: evergreen_pb2.Action) -> None:
        if a.name != GENERATE:
            raise InvalidAction(f"unknown action {a.name!r} (this server offers {GENERATE})")
        target = a.target_spec.id
        if target not in self.targets:
            raise TargetNotFound(
                f"unknown target {target!r} (known: {', '.join(sorted(repr(t) for t in self.targets))})"
            )
        inputs = tuple((p.name, p.id) for p in a.inputs)
        outputs = tuple((p.name, p.id) for p in a.outputs)
        if not inputs:
            raise InvalidAction("GENERATE needs at least one input")
        for kind, named in (("input", inputs), ("output", outputs)):
            names = [n for n, _ in named]
            if len(set(names)) != len(names):
                raise InvalidAction(f"GENERATE: duplicate {kind} parameter name in {names}")
            if any(not i for _, i in named):
                raise InvalidAction(f"GENERATE: {kind} parameter without a node id")
        unknown = sorted({n for n, _ in outputs} - GENERATE_OUTPUTS)
        if unknown:
            raise InvalidAction(
                f"GENERATE has no output {unknown} (outputs: {', '.join(sorted(GENERATE_OUTPUTS))})"
            )
        overlap = {i for _, i in inputs} & {i for _, i in outputs}
        if overlap:
            raise InvalidAction(f"GENERATE reads and writes the same node {sorted(overlap)}")
        config = generate_config(a.configs)
        ev = await asyncio.shield(
            self.runtime.nodes.submit_action(
                self.sid,
                a.name,
                inputs,
                outputs,
                target=target,
                configs=[config_json(c) for c in a.configs],
            )
        )
        self.output_ids.update(i for _, i in outputs)
        aid = str(action_id_of(ev))
        self.unfinished.append(aid)
        self.actions.put_nowait(
            PendingAction(aid, a.name, inputs, outputs, config.params, config.tools)
        )

    # -- worker --

    async def _work(self) -> None:
        while not self.stopping:
            act = await self.actions.get()
            if act is None or self.stopping:
                break
            try:
                await self._barrier(act)
                if self.stopping:
                    return
                completed = await self._generate(act)
            except (_Stopped, asyncio.CancelledError):
                return  # finish() records the action as cancelled
            except Exception as exc:
                code = exc.code if isinstance(exc, SessiontapeError) else "internal"
                await self._finish_action(act.id, (code, message_for(exc)))
                raise
            if completed:
                self.unfinished.remove(act.id)  # action.completed rode with the last run
            else:
                await self._finish_action(act.id, None)
        if not self.stopping:
            self.outbox.put_nowait(None)

    async def _barrier(self, act: PendingAction) -> None:
        """Wait until every node ``act`` reads is complete."""
        while not self.stopping:
            self.changed.clear()
            st = await self.runtime.get(self.sid)
            waiting = sorted({n for _, i in act.inputs for n in missing(st, i)})
            if not waiting:
                return
            blocked = [n for n in waiting if n in self.output_ids]
            if blocked:
                raise ProtocolViolation(
                    f"action {act.id} reads {_ids(blocked)}, the output of a later action"
                    " (it would never run)"
                )
            if self.input_done:
                raise ProtocolViolation(
                    f"action {act.id} waits for incomplete nodes {_ids(waiting)}"
                    " but the client ended its stream"
                )
            await self.changed.wait()

    async def _prompt(self, act: PendingAction) -> list[int]:
        """The inputs' text, concatenated; with tools, after their description (the
        fallback of :mod:`sessiontape.core.tools`: a raw prompt has no template)."""
        st = await self.runtime.get(self.sid)
        text = "".join(text_of(st, root, "GENERATE") for _, root in act.inputs)
        if not text:
            raise InvalidAction(f"GENERATE: action {act.id} has an empty prompt")
        if act.tools is not None and act.tools.tools:
            text = act.tools.system_text() + "\n\n" + text
        tokens = self.runtime.engine.tokenize(text)
        if not tokens:
            raise InvalidAction(f"GENERATE: action {act.id} has an empty prompt")
        return tokens

    async def _generate(self, act: PendingAction) -> bool:
        """Run ``act``'s generation, streaming its output; True when ``action.completed``
        was committed with the last run (the generation ended on its own)."""
        prompt = await self._prompt(act)
        st = await self.runtime.get(self.sid)
        # The prompt replaces the session's token history; keep the common
        # prefix so an engine cache for it stays valid.
        common = next(
            (k for k, (a, b) in enumerate(zip(st.tokens, prompt, strict=False)) if a != b),
            min(len(st.tokens), len(prompt)),
        )
        # the output's text, decoded as it grows (not the whole output again per run);
        # a character split across tokens waits for its last byte
        text = TextStream(self.runtime.engine.detokenize)
        seq = 0
        # One output fragment per committed run of tokens (not one per token),
        # recorded in the run's own commit: each run is one append and one message,
        # whatever the engine's speed, and nothing commits between a run and its
        # fragment.
        sent: deque[list[FragmentIn]] = deque()

        def fragment(st: SessionState, tokens: list[int], last: bool) -> list[NewEvent]:
            # the last run also carries the final fragment (the text's tail, continued=False)
            # and the action's completion: the output is whole once that run commits
            nonlocal seq
            piece = text.extend(tokens) + (text.finish() if last else "")
            frags = self._fragments(act, seq, piece, continued=not last) if piece or last else []
            if not frags or self.stopping:
                return []
            new, _ = self.runtime.nodes.fragment_events(st, frags, "out")
            seq += 1
            sent.append(frags)
            if last:
                new.append(NewEvent(T.ACTION_COMPLETED, {"action_id": act.id}))
            return new

        # the calls the reply makes, recorded with the last run (evergreen_calls.py)
        reply = calls.ReplyCalls(
            self.runtime.nodes, self.runtime.engine.detokenize, act.tools, act.id
        )

        def with_run(st: SessionState, tokens: list[int], last: bool) -> Sequence[NewEvent]:
            made = reply.run(st, tokens, last)
            new = fragment(st, tokens, last)
            if self.stopping:
                reply.sent = []  # not recorded
                return new
            return [*new, *made]

        outs = {oid for _, oid in act.outputs}

        runs = cast(
            AsyncGenerator[list[Event], None],
            self.runtime.generate_runs(
                self.sid,
                GenerateRequest(
                    act.params,
                    append=prompt[common:],
                    offset=common,
                    truncating=True,
                    action_id=act.id,
                    with_run=with_run,
                    # the calls' records name the generation: its start commits first
                    start_apart=reply.wanted,
                ),
            ),
        )
        completed = False
        async with contextlib.aclosing(runs):
            async for run in runs:
                completed = completed or any(ev.type == T.ACTION_COMPLETED for ev in run)
                if self.stopping:
                    if completed:
                        # the action is whole in the log: not cancelled (its calls are)
                        self.unfinished.extend(c.action_id for c in reply.sent)
                        return True
                    raise _Stopped
                if any(
                    ev.type == T.NODE_FRAGMENT and body(ev, NodeFragment)["id"] in outs
                    for ev in run
                ):
                    # the output's final fragment goes with the calls, in one message
                    last = any(ev.type == T.ACTION_COMPLETED for ev in run)
                    await self._send(sent.popleft(), reply if last else None)
        if not completed:
            await self._emit(act, seq, text.finish(), continued=False)
        if reply.sent and not reply.announced:  # no output to go with
            await self._send([], reply)
        return completed

    def _fragments(
        self, act: PendingAction, seq: int, text: str, *, continued: bool
    ) -> list[FragmentIn]:
        """The fragment of each of ``act``'s outputs that carries ``text``."""
        return [
            FragmentIn(
                id=oid,
                seq=seq,
                continued=continued,
                has_chunk=True,
                metadata={"mimetype": OUT_MIMETYPE} if seq == 0 else None,
                data=text.encode(),
            )
            for _, oid in act.outputs
        ]

    async def _emit(self, act: PendingAction, seq: int, text: str, *, continued: bool) -> None:
        """Record and send an output fragment of its own (the last, after the run)."""
        frags = self._fragments(act, seq, text, continued=continued)
        if not frags or self.stopping:
            return
        await asyncio.shield(self.runtime.nodes.append_fragments(self.sid, frags, "out"))
        await self._send(frags)

    async def _send(self, frags: list[FragmentIn], reply: calls.ReplyCalls | None = None) -> None:
        """Send recorded output fragments, with ``reply``'s recorded calls (their nodes and
        actions, then waited for); wait while the client is behind."""
        self.changed.set()
        message = evergreen_pb2.SessionMessage(node_fragments=[fragment_out(f) for f in frags])
        if reply is not None and reply.sent:
            self.calls.add(reply.sent)
            self.unfinished.extend(c.action_id for c in reply.sent)
            reply.announce(message)
        self.outbox.put_nowait(message)
        while self.outbox.qsize() > HIGH_WATER and not self.stopping:
            self.drained.clear()
            await self.drained.wait()

    async def _finish_action(self, action_id: str, error: tuple[str, str] | None) -> None:
        self.unfinished.remove(action_id)
        await asyncio.shield(self.runtime.nodes.finish_action(self.sid, action_id, error))

    # -- ending --

    def end(self, cancelled: bool) -> asyncio.Task[None]:
        """Stop the stream once, in a task of its own so a second cancel cannot cut it short."""
        if self._ending is None:
            self._ending = asyncio.ensure_future(self._finish(cancelled))
            self._endings.add(self._ending)
            self._ending.add_done_callback(self._endings.discard)
            self.outbox.put_nowait(None)  # wakes the response generator
        return self._ending

    async def _finish(self, cancelled: bool) -> None:
        """Stop both tasks and record how the session ended."""
        self.stopping = True
        self._wake()
        self.tasks[0].cancel()  # the reader may be parked on the request stream
        await asyncio.gather(*self.tasks, return_exceptions=True)
        try:
            for aid in list(self.unfinished):
                await self._finish_action(
                    aid, ("cancelled", "the session ended before the action finished")
                )
            if self.error is not None:
                exc = self.error
                code = exc.code if isinstance(exc, SessiontapeError) else "internal"
                await self.runtime.abort(self.sid, code, message_for(exc))
            else:
                await self.runtime.close(self.sid, "cancelled" if cancelled else "client")
        except SessiontapeError:
            log.exception("ending evergreen session %s", self.sid)


class EvergreenServicer(evergreen_pb2_grpc.EvergreenServiceServicer, GrpcService):
    def __init__(self, runtime: Runtime) -> None:
        self.runtime = runtime
        #: Open streams, and endings still recording: after the server's grace period
        #: the grpc core cancels the calls, but the handlers may only notice later, so
        #: drain() ends what is left itself.
        self.streams: set[_Stream] = set()
        self.endings: set[asyncio.Task[None]] = set()

    @classmethod
    def create(cls, runtime: Runtime, settings: GrpcSettings) -> EvergreenServicer:
        return cls(runtime)

    def add_to(self, server: Any) -> list[str]:
        evergreen_pb2_grpc.add_EvergreenServiceServicer_to_server(self, server)
        return [SERVICE]

    async def drain(self, limit_s: float) -> None:
        """End the streams still open after the grace period; wait up to ``limit_s`` for the records."""
        loop = asyncio.get_running_loop()
        for stream in [s for s in self.streams if s.loop is loop]:
            self.streams.discard(stream)
            stream.end(cancelled=True)
        pending = [t for t in self.endings if not t.done() and t.get_loop() is loop]
        if pending:
            await asyncio.wait(pending, timeout=limit_s)

    async def StartSession(
        self, request_iterator: AsyncIterator[evergreen_pb2.SessionMessage], context: Any
    ) -> AsyncIterator[evergreen_pb2.SessionMessage]:
        st = await self.runtime.open_session(
            "evergreen", meta={"transport": "grpc", "peer": str(context.peer())}
        )
        stream = _Stream(self.runtime, st.session_id, self.endings)
        await context.send_initial_metadata((("x-session-id", st.session_id),))
        self.streams.add(stream)
        stream.start(request_iterator)
        ended = False
        try:
            while True:
                msg = await stream.outbox.get()
                if stream.outbox.qsize() <= HIGH_WATER // 2:
                    stream.drained.set()
                if msg is None:
                    break
                yield msg
            ended = True
        finally:
            self.streams.discard(stream)
            await asyncio.shield(stream.end(cancelled=not ended))
        if stream.error is not None:
            await context.abort(code_for(stream.error), message_for(stream.error))


def _ids(node_ids: list[str]) -> str:
    """Node ids as an error message lists them, each bounded (core.errors.shown)."""
    return "[" + ", ".join(shown(n, "node id") for n in node_ids) + "]"
