"""Re-render a session in the terminal as it happened, from the log alone.

No model is run. Text is decoded with the session's own tokenizer when the caller
has it (``detokenize``: the one its ``session.opened`` recorded, found by the
engine plugin, ``core/commands/common.py``), turns by role as the viewer shows
them: a chat request's messages (``[system]``, ``[user]``) in place of the
template-rendered tokens it appended, its reply as ``[assistant]``; other input as
``[user]``, other generations as ``[model]``. Without it (``--tokens``, or a
tokenizer not at hand) token ids below 256 render as their bytes (the byte-level
convention of the built-in engines), others as ``<id>``. A generation's text is
decoded incrementally, so a character split across tokens prints whole once its
last byte arrives, and one cut off at the end is not printed (its bytes stay in
the log). Control characters (other than newline and tab) and bidirectional
overrides are printed as escapes (``\\x1b``, ``\\u202e``), so a recorded session
cannot drive the terminal. Pacing follows the recorded times divided by
``speed``; ``instant`` prints without waiting.
"""

from __future__ import annotations

import asyncio
import codecs
import json
import re
from collections.abc import AsyncIterator, Callable, Iterable, Mapping
from typing import Any, TextIO

from sessiontape.core.bodies import (
    ActionFailed,
    ActionSubmitted,
    ErrorRecorded,
    GenerationFinished,
    GenerationStarted,
    NodeFragment,
    SessionOpened,
    TokensAppended,
    TokensTruncated,
    action_id_of,
    body,
    generated_token,
)
from sessiontape.core.document.conversation import openai_request, request_messages
from sessiontape.core.document.text import Detokenize, TextRun
from sessiontape.core.events import Event, T

#: C0 and C1 controls except \t and \n, DEL, and the bidirectional embedding/override/isolate marks
_UNSAFE = re.compile("[\x00-\x08\x0b-\x1f\x7f-\x9f\u061c\u200e\u200f\u202a-\u202e\u2066-\u2069]")


def _escape_char(m: re.Match[str]) -> str:
    c = ord(m.group())
    return f"\\x{c:02x}" if c < 0x100 else f"\\u{c:04x}"


def escape_controls(text: str) -> str:
    """``text`` with the characters that would steer a terminal written as escapes."""
    return _UNSAFE.sub(_escape_char, text)


class TokenText:
    """Token ids to text, decoding UTF-8 across token boundaries."""

    def __init__(self) -> None:
        self._decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")

    def feed(self, ids: Iterable[int]) -> str:
        out: list[str] = []
        for t in ids:
            if 0 <= t < 256:
                out.append(self._decoder.decode(bytes((t,))))
            else:
                out.append(self.flush())
                out.append(f"<{t}>")
        return "".join(out)

    def flush(self) -> str:
        """Whatever bytes are pending (an unfinished character becomes U+FFFD)."""
        return self._decoder.decode(b"", final=True)


def render_tokens(ids: Iterable[int]) -> str:
    text = TokenText()
    return text.feed(ids) + text.flush()


def _body_text(body: Any) -> str:
    return json.dumps(body, ensure_ascii=False, sort_keys=True, default=str)


class _Ids:
    """Token ids as ``<id>`` each (``--tokens``)."""

    def feed(self, ids: Iterable[int]) -> str:
        return "".join(f"<{t}>" for t in ids)

    def flush(self) -> str:
        return ""


class _Tokenized:
    """A generation's tokens to text with the session's tokenizer (:class:`TextRun`)."""

    def __init__(self, detokenize: Detokenize) -> None:
        self._detok = detokenize
        self._run = TextRun(detokenize)

    def feed(self, ids: Iterable[int]) -> str:
        return self._run.push(list(ids))

    def flush(self) -> str:
        piece = self._run.flush()
        self._run = TextRun(self._detok)
        return piece


class Renderer:
    """Events to terminal text, keeping the decoder state a generation's tokens share.

    With ``detokenize``, the input a request appended and the start of its generation
    are held until it is known whether a chat request recorded them (its
    ``wire.message`` follows the commit that holds both), which shows them as its
    messages by role."""

    def __init__(self, detokenize: Detokenize | None = None, *, ids: bool = False) -> None:
        self._detok = None if ids else detokenize
        self._ids = ids
        self._model: TokenText | _Tokenized | _Ids = (
            _Ids() if ids else TokenText() if detokenize is None else _Tokenized(detokenize)
        )
        #: what the last input and generation start would print, held (see above)
        self._held: list[str] = []
        self._held_generation: str | None = None

    def render(self, e: Event) -> str | None:
        """One event as terminal text (None for events with nothing to show)."""
        if e.type == T.GENERATION_TOKEN:
            tok = generated_token(e)
            if tok is None:
                return None  # a scored prompt position
            return escape_controls(self._release() + self._model.feed([int(tok)])) or None
        if self._detok is not None:
            if e.type == T.TOKENS_APPENDED:
                held = self._release()
                self._held.append(f"\n[user] {self._detok(body(e, TokensAppended)['tokens'])}")
                return escape_controls(held) or None
            if e.type == T.GENERATION_STARTED:
                self._held.append("\n[model] ")
                self._held_generation = str(body(e, GenerationStarted)["generation_id"])
                return None
            if e.type == T.WIRE and (payload := openai_request(e)) is not None:
                return escape_controls(self._chat(payload)) or None
        if self._ids and e.type == T.TOKENS_APPENDED:
            ids = _Ids().feed(body(e, TokensAppended)["tokens"])
            return f"\n[user] {ids}"
        text = self._release() + self._model.flush() + (_render_other(e) or "")
        return escape_controls(text) or None

    def _chat(self, payload: Mapping[str, Any]) -> str:
        """A recorded chat request: its messages by role, then its reply's start."""
        request = payload.get("request")
        if payload.get("generation_id") != self._held_generation or not isinstance(
            request, Mapping
        ):
            return self._release()
        self._held, self._held_generation = [], None
        turns = [f"\n[{role}] {text}" for role, text in request_messages(request)]
        return "".join(turns) + "\n[assistant] "

    def _release(self) -> str:
        held = "".join(self._held)
        self._held, self._held_generation = [], None
        return held

    def flush(self) -> str:
        """The end of the session's events: whatever is held or pending."""
        return escape_controls(self._release() + self._model.flush())


def render_event(e: Event) -> str | None:
    """One event on its own (a generation token split mid-character shows as U+FFFD; prefer :class:`Renderer`)."""
    return Renderer().render(e)


def _render_other(e: Event) -> str | None:
    if e.type == T.SESSION_OPENED:
        so = body(e, SessionOpened)
        eng = so.get("engine", {})
        parent = so.get("parent")
        fork = f" fork of {parent['session_id']}@{parent.get('token_position')}" if parent else ""
        return f"── session {e.session_id} ({so.get('protocol')}, {eng.get('engine')}:{eng.get('model_id')}){fork}\n"
    if e.type == T.TOKENS_APPENDED:
        return f"\n[user] {render_tokens(body(e, TokensAppended)['tokens'])}"
    if e.type == T.TOKENS_TRUNCATED:
        tt = body(e, TokensTruncated)
        return f"\n[truncated: {tt.get('reason')}, dropped {tt.get('dropped')}]"
    if e.type == T.GENERATION_STARTED:
        return "\n[model] "
    if e.type == T.GENERATION_FINISHED:
        gf = body(e, GenerationFinished)
        return f"  ⟨{gf.get('finish_reason')}, {gf.get('completion_tokens')} tokens⟩"
    if e.type == T.NODE_FRAGMENT:
        b = body(e, NodeFragment)
        arrow = "→" if b.get("direction") == "out" else "←"
        chunk = b.get("chunk")
        what = (
            f"children {b.get('child_ids')}"
            if not chunk
            else (
                f"ref {chunk.get('ref')}"
                if chunk.get("ref")
                else (e.data or b"").decode("utf-8", errors="replace")
            )
        )
        return f"\n{arrow} node {b['id']}#{b.get('seq', 0)}: {what}"
    if e.type == T.ACTION_SUBMITTED:
        sub = body(e, ActionSubmitted)
        return f"\n[action {sub['action_id']}] {sub['name']} {sub.get('inputs')} -> {sub.get('outputs')}"
    if e.type in (T.ACTION_COMPLETED, T.ACTION_FAILED):
        message = body(e, ActionFailed).get("message", "") if e.type == T.ACTION_FAILED else ""
        return f"\n[action {action_id_of(e)} {e.type.split('.')[1]}] {message}".rstrip()
    if e.type == T.FEEDBACK:
        return f"\n[feedback] {_body_text(e.body)}"
    if e.type == T.ERROR:
        er = body(e, ErrorRecorded)
        return f"\n[error {er.get('code')}] {er.get('message')}"
    if e.type in (T.SESSION_CLOSED, T.SESSION_ABORTED, T.SESSION_EXPIRED, T.SESSION_PURGED):
        return f"\n── {e.type.split('.')[1]} {_body_text(e.body) if e.body else ''}\n"
    return None


async def replay(
    events: AsyncIterator[Event] | Iterable[Event],
    out: TextIO,
    *,
    speed: float = 1.0,
    instant: bool = False,
    sleep: Callable[[float], object] = asyncio.sleep,
    max_gap_s: float = 5.0,
    detokenize: Detokenize | None = None,
    ids: bool = False,
) -> int:
    """Write ``events`` to ``out`` paced by their recorded times; returns how many were
    rendered. ``detokenize``: the session's tokenizer (None: bytes and ``<id>``);
    ``ids``: every token as ``<id>``."""
    prev: float | None = None
    n = 0
    renderer = Renderer(detokenize, ids=ids)

    async def each() -> AsyncIterator[Event]:
        if hasattr(events, "__aiter__"):
            async for e in events:
                yield e
        else:
            for e in events:
                yield e

    async for e in each():
        if not instant and prev is not None:
            gap = min(max(0.0, e.recorded_at - prev), max_gap_s) / max(speed, 1e-9)
            if gap > 0:
                await sleep(gap)  # type: ignore[misc]
        prev = e.recorded_at
        text = renderer.render(e)
        if text is not None:
            out.write(text)
            out.flush()
            n += 1
    out.write(renderer.flush() + "\n")
    return n
