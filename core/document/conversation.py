"""The session document's ``conversation``: a chat session's messages, as turns.

A request through the OpenAI routes (``transports/http/openai/turns.py``) appends its
messages rendered by the chat template, starts a generation (one commit holds
``tokens.appended`` and ``generation.started``) and records a ``wire.message``
(transport ``openai``, direction ``in``) whose payload names the generation,
the number of tokens appended and the request. The conversation folds those:
each of the request's messages becomes a turn spanning the tokens the request
appended (the template's markers, and a default system prompt the template
adds, are inside that span but are not messages), then the generation's reply
becomes an ``assistant`` turn that grows as its tokens arrive, cut before a
stop string (so it is the text the OpenAI reply shows). Sessions no chat
request went into have none. A pure fold of events: no I/O, no engine.

:func:`fork_conversation` gives a fork the conversation of its parent up to
the fork point (it reads the parent's log, as ``fork_base`` does).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from sessiontape.core.bodies import (
    GenerationFinished,
    GenerationStarted,
    GenerationToken,
    TokensTruncated,
    ToolCalled,
    WireMessage,
    body,
    fork_point,
)
from sessiontape.core.document.text import Detokenize, StopCut, TextStream
from sessiontape.core.events import Event, T
from sessiontape.core.log.store import EventLog
from sessiontape.core.patch import Op
from sessiontape.core.session.state import SessionState

#: the ``wire.message`` transport the OpenAI routes record their requests under
WIRE_TRANSPORT = "openai"

Turn = dict[str, Any]


def request_messages(request: Mapping[str, Any]) -> list[tuple[str, str]]:
    """The messages a recorded request put in the history, as (role, text), in the order the
    template did (:func:`request_items` without what its tool turns carry)."""
    return [(str(t["role"]), str(t["text"])) for t in request_items(request)]


def request_items(request: Mapping[str, Any]) -> list[dict[str, Any]]:
    """The turns a recorded request put in the history, in the order the template did: a
    chat completion's ``messages``; a response's ``instructions`` (as a system message)
    then its ``input``. Each is ``{"role", "text"}``; an assistant message's tool calls are
    turns of their own (role ``tool_call``, with ``call``: id, name, arguments, supplied by
    the client) and a ``tool`` message's turn names the call it answers (``call_id``)."""
    if isinstance(raw := request.get("messages"), list):
        items: list[Any] = raw
    else:
        instructions = request.get("instructions")
        items = [{"role": "system", "content": instructions}] if instructions else []
        raw_input = request.get("input")
        if isinstance(raw_input, str):
            items.append({"role": "user", "content": raw_input})
        elif isinstance(raw_input, list):
            items.extend(raw_input)
    out: list[dict[str, Any]] = []
    for m in items:
        if not isinstance(m, dict):
            continue
        calls = m.get("tool_calls")
        if m.get("content") is not None or not calls:
            turn: dict[str, Any] = {
                "role": str(m.get("role", "")),
                "text": _content(m.get("content")),
            }
            if m.get("role") == "tool":
                turn["call_id"] = m.get("tool_call_id")
            out.append(turn)
        for c in calls if isinstance(calls, list) else ():
            f = c.get("function") or {}
            out.append(
                {
                    "role": "tool_call",
                    "text": str(f.get("arguments", "")),
                    "call": _call(c.get("id"), f.get("name"), f.get("arguments"), "client"),
                }
            )
    return out


def _call(call_id: Any, name: Any, arguments: Any, supplied_by: str) -> dict[str, Any]:
    return {"id": call_id, "name": name, "arguments": arguments, "supplied_by": supplied_by}


def _content(content: Any) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list):  # content parts: their text
        return "".join(
            str(p.get("text", "")) for p in content if isinstance(p, dict) and "text" in p
        )
    return "" if content is None else str(content)


def remap(start: int, end: int, keep: Sequence[tuple[int, int]]) -> tuple[int, int] | None:
    """The span ``[start, end)`` in the history a truncation keeping ``keep`` leaves;
    None when none of its tokens (for an empty span: not its position) is kept."""
    new: tuple[int, int] | None = None
    offset = 0
    for a, b in keep:
        lo, hi = max(a, start), min(b, end)
        if lo < hi:
            new = (offset + lo - a if new is None else new[0], offset + hi - a)
        elif start == end and a <= start <= b and new is None:
            return offset + start - a, offset + start - a
        offset += b - a
    return new


def decode_reply(detokenize: Detokenize, ids: Sequence[int], stops: Sequence[str]) -> str:
    """A finished reply's text: its tokens decoded, cut before a stop string."""
    ts = TextStream(detokenize, stops)
    ts.extend(ids)
    ts.finish()
    return ts.text


def _turn(role: str, text: str | None, generation_id: str | None, start: int, end: int) -> Turn:
    return {
        "role": role,
        "text": text,
        "generation_id": generation_id,
        "start": start,
        "end": end,
        "inherited": False,
    }


@dataclass
class _Gen:
    """A generation of the session, for the reply turn its request gives it."""

    prompt_length: int
    end: int
    finished: bool = False
    turn: int | None = None  # index of its reply turn, once its request is recorded
    cut: StopCut | None = None


class Conversation:
    """The ``conversation`` list and the fold that keeps it: each method takes what an
    event says and returns the JSON Patch+ ops (paths under ``/conversation``) of what
    it changed in :attr:`turns`, which the document holds."""

    def __init__(self, detokenize: Detokenize | None = None) -> None:
        self.detokenize = detokenize
        self.turns: list[Turn] = []
        self._stops: list[tuple[str, ...]] = []  # each turn's stop strings (a reply's)
        self._gens: dict[str, _Gen] = {}

    def inherit(self, ids: Sequence[int], detokenize: Detokenize | None) -> Conversation:
        """A fork's conversation, from its parent's (this, cut at the fork): every turn
        marked ``inherited``; a reply's text is that of its tokens in ``ids`` (the fork's
        history)."""
        c = Conversation(detokenize)
        for turn, stops in zip(self.turns, self._stops, strict=True):
            t = {**turn, "inherited": True}
            if t["generation_id"] is not None and t["role"] == "assistant":
                span = ids[t["start"] : t["end"]]
                t["text"] = None if detokenize is None else decode_reply(detokenize, span, stops)
            c.turns.append(t)
            c._stops.append(stops)
        return c

    def _push(self, turn: Turn, stops: tuple[str, ...] = ()) -> Op:
        self.turns.append(turn)
        self._stops.append(stops)
        return {"op": "append", "path": "/conversation", "value": turn}

    # -- the fold ---------------------------------------------------------------

    def started(self, generation_id: str, prompt_length: int) -> None:
        # a request is recorded right after its generation starts (the routes hold the session
        # while they record it): a finished generation no request named by now never gets one
        for gid in [k for k, g in self._gens.items() if g.finished]:
            del self._gens[gid]
        self._gens[generation_id] = _Gen(prompt_length, prompt_length)

    def request(self, payload: Mapping[str, Any], reply: str | None = None) -> list[Op]:
        """A recorded OpenAI request (a ``wire.message`` payload): its messages, then its
        generation's reply (``reply``: the text the generation has so far)."""
        g = self._gens.get(str(payload.get("generation_id")))
        request = payload.get("request")
        if g is None or g.turn is not None or not isinstance(request, Mapping):
            return []
        end = g.prompt_length
        start = max(0, end - int(payload.get("appended", 0)))
        ops = [
            self._push({**_turn(str(t.pop("role")), t.pop("text"), None, start, end), **t})
            for t in request_items(request)
        ]
        stops = tuple(str(s) for s in request.get("stop") or () if isinstance(s, str))
        text = None
        if self.detokenize is not None and reply is not None:
            g.cut = StopCut(stops)
            text = g.cut.feed(reply, final=g.finished)
        gid = str(payload["generation_id"])
        g.turn = len(self.turns)
        ops.append(self._push(_turn("assistant", text, gid, end, g.end), stops))
        if g.finished:
            del self._gens[gid]
        return ops

    def tool_called(self, b: ToolCalled) -> list[Op]:
        """A call the model made (a ``tool.called`` event): a turn of its own, after its
        reply, spanning the tokens its JSON came from. A call a client supplied is a turn
        already: its request's. A call in a reply no chat request asked for (an Evergreen
        GENERATE's) is no turn: its action and nodes show it."""
        span = b.get("span")
        if b.get("supplied_by") != "model" or not span:
            return []
        g = self._gens.get(str(b.get("generation_id")))
        if g is None or g.turn is None:
            return []
        turn = _turn("tool_call", str(b["arguments"]), b.get("generation_id"), *span)
        turn["call"] = _call(b["call_id"], b["name"], b["arguments"], "model")
        return [self._push(turn)]

    def token(self, generation_id: str, piece: str | None, position: int) -> list[Op]:
        """A generated token at ``position``, which added ``piece`` to its generation's text."""
        g = self._gens.get(generation_id)
        if g is None:
            return []
        g.end = position + 1
        return [] if g.turn is None else self._grow(g, piece or "", final=False)

    def finished(self, generation_id: str, piece: str | None) -> list[Op]:
        """The generation ended; ``piece`` is the rest of its text."""
        g = self._gens.get(generation_id)
        if g is None:
            return []
        g.finished = True
        if g.turn is None:
            return []  # its request may still be recorded
        del self._gens[generation_id]
        return self._grow(g, piece or "", final=True)

    def _grow(self, g: _Gen, piece: str, final: bool) -> list[Op]:
        assert g.turn is not None
        turn = self.turns[g.turn]
        path = f"/conversation/{g.turn}"
        ops: list[Op] = []
        if g.cut is not None and turn["text"] is not None:
            delta = g.cut.feed(piece, final)
            if delta:
                turn["text"] += delta
                ops.append({"op": "append", "path": path + "/text", "value": delta})
        if turn["end"] != g.end:
            turn["end"] = g.end
            ops.append({"op": "replace", "path": path + "/end", "value": g.end})
        return ops

    def truncated(self, keep: Sequence[tuple[int, int]], ids: Sequence[int] | None) -> list[Op]:
        """The history was cut to the ``keep`` ranges (``ids``: what is left). Turns move
        with their tokens, a turn none of whose tokens is left goes; a rewind into a reply
        (the history's head kept) cuts its text to the tokens left."""
        rewind = len(keep) == 1 and keep[0][0] == 0
        turns: list[Turn] = []
        stops: list[tuple[str, ...]] = []
        moved: dict[int, int] = {}
        for i, (t, s) in enumerate(zip(self.turns, self._stops, strict=True)):
            span = remap(t["start"], t["end"], keep)
            if span is None:
                continue
            cut = rewind and span[1] - span[0] < t["end"] - t["start"]
            t = {**t, "start": span[0], "end": span[1]}
            reply = (
                t["role"] == "assistant"
                and t["generation_id"] is not None
                and t["text"] is not None
            )
            if cut and reply and self.detokenize is not None and ids is not None:
                t["text"] = decode_reply(self.detokenize, ids[span[0] : span[1]], s)
            moved[i] = len(turns)
            turns.append(t)
            stops.append(s)
        for g in self._gens.values():
            g.turn = None if g.turn is None else moved.get(g.turn)
            if g.turn is not None:
                g.end = turns[g.turn]["end"]
        if turns == self.turns:
            return []
        self.turns, self._stops = turns, stops
        return [{"op": "replace", "path": "/conversation", "value": turns}]

    def clear(self) -> list[Op]:
        """The session was purged."""
        had = bool(self.turns)
        self.turns, self._stops, self._gens = [], [], {}
        return [{"op": "replace", "path": "/conversation", "value": []}] if had else []

    def settle(self) -> None:
        """Stop following running generations (a fork's base: they stay the parent's)."""
        self._gens.clear()

    def fold(self, e: Event) -> None:
        """Fold one event without texts (no detokenizer): what :func:`fork_conversation` uses."""
        if e.type == T.GENERATION_STARTED:
            b = body(e, GenerationStarted)
            self.started(str(b["generation_id"]), int(b["prompt_length"]))
        elif e.type == T.GENERATION_TOKEN:
            t = body(e, GenerationToken)
            if not t.get("is_prefill"):
                self.token(str(t["generation_id"]), None, int(t["position"]))
        elif e.type == T.GENERATION_FINISHED:
            self.finished(str(body(e, GenerationFinished)["generation_id"]), None)
        elif e.type == T.WIRE and (payload := openai_request(e)) is not None:
            self.request(payload)
        elif e.type == T.TOOL_CALLED:
            self.tool_called(body(e, ToolCalled))
        elif e.type == T.TOKENS_TRUNCATED:
            self.truncated([(int(a), int(b)) for a, b in body(e, TokensTruncated)["keep"]], None)
        elif e.type == T.SESSION_PURGED:
            self.clear()


def openai_request(e: Event) -> Mapping[str, Any] | None:
    """The payload of a ``wire.message`` that recorded an OpenAI request; None for another."""
    w = body(e, WireMessage)
    payload = w.get("payload")
    if (
        w.get("transport") != WIRE_TRANSPORT
        or w.get("direction") != "in"
        or not isinstance(payload, Mapping)
        or payload.get("generation_id") is None
    ):
        return None
    return payload


async def fork_conversation(log: EventLog, first: Event) -> Conversation | None:
    """The conversation a fork starts from, given its first event: its parent's at the
    fork's version, cut at its token position, without texts (:meth:`Conversation.inherit`
    decodes the replies). None for a session that is not a fork."""
    parent = fork_point(first)
    if not parent:
        return None
    evs = await log.read(str(parent["session_id"]), 1, int(parent["version"]))
    conv = (await fork_conversation(log, evs[0]) if evs else None) or Conversation()
    for e in evs:
        conv.fold(e)
    conv.settle()
    tp = parent.get("token_position")
    if tp is not None:
        conv.truncated([(0, int(tp))], None)
    return conv


@dataclass
class ForkBase(SessionState):
    """A fork's base state (``fork_base``) that also carries its parent's conversation
    up to the fork point, for the fork's document to start from."""

    conversation: Conversation | None = None

    @classmethod
    def of(cls, st: SessionState, conversation: Conversation | None) -> ForkBase:
        fields = {f.name: getattr(st, f.name) for f in dataclasses.fields(SessionState)}
        return cls(**fields, conversation=conversation)
