"""Re-render a session in the terminal as it happened, from the log alone.

No engine is called: token ids below 256 render as their bytes (the byte-level
convention of the built-in engines), others as ``<id>``. Pacing follows the
recorded times divided by ``speed``; ``instant`` prints without waiting.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable, Iterable
from typing import TextIO

from core.events import Event, T


def render_tokens(ids: Iterable[int]) -> str:
    out: list[str] = []
    buf = bytearray()
    for t in ids:
        if 0 <= t < 256:
            buf.append(t)
            continue
        if buf:
            out.append(buf.decode("utf-8", errors="replace"))
            buf.clear()
        out.append(f"<{t}>")
    if buf:
        out.append(buf.decode("utf-8", errors="replace"))
    return "".join(out)


def render_event(e: Event) -> str | None:
    """One event as terminal text (None for events with nothing to show)."""
    b = e.body
    if e.type == T.SESSION_OPENED:
        eng = b.get("engine", {})
        parent = b.get("parent")
        fork = f" fork of {parent['session_id']}@{parent.get('token_position')}" if parent else ""
        return f"── session {e.session_id} ({b.get('protocol')}, {eng.get('engine')}:{eng.get('model_id')}){fork}\n"
    if e.type == T.TOKENS_APPENDED:
        return f"\n[user] {render_tokens(b['tokens'])}"
    if e.type == T.TOKENS_TRUNCATED:
        return f"\n[truncated: {b.get('reason')}, dropped {b.get('dropped')}]"
    if e.type == T.GENERATION_STARTED:
        return "\n[model] "
    if e.type == T.GENERATION_TOKEN and not b.get("is_prefill"):
        return render_tokens([int(b["token"])])
    if e.type == T.GENERATION_FINISHED:
        return f"  ⟨{b.get('finish_reason')}, {b.get('completion_tokens')} tokens⟩"
    if e.type == T.NODE_FRAGMENT:
        arrow = "→" if b.get("direction") == "out" else "←"
        chunk = b.get("chunk")
        what = f"children {b.get('child_ids')}" if not chunk else (
            f"ref {chunk.get('ref')}" if chunk.get("ref") else (e.data or b"").decode("utf-8", errors="replace"))
        return f"\n{arrow} node {b['id']}#{b.get('seq', 0)}: {what}"
    if e.type == T.ACTION_SUBMITTED:
        return f"\n[action {b['action_id']}] {b['name']} {b.get('inputs')} -> {b.get('outputs')}"
    if e.type in (T.ACTION_COMPLETED, T.ACTION_FAILED):
        return f"\n[action {b['action_id']} {e.type.split('.')[1]}] {b.get('message', '')}".rstrip()
    if e.type == T.FEEDBACK:
        return f"\n[feedback] {b}"
    if e.type == T.ERROR:
        return f"\n[error {b.get('code')}] {b.get('message')}"
    if e.type in (T.SESSION_CLOSED, T.SESSION_ABORTED, T.SESSION_EXPIRED, T.SESSION_PURGED):
        return f"\n── {e.type.split('.')[1]} {dict(b) if b else ''}\n"
    return None


async def replay(events: AsyncIterator[Event] | Iterable[Event], out: TextIO, *, speed: float = 1.0,
                 instant: bool = False, sleep: Callable[[float], object] = asyncio.sleep,
                 max_gap_s: float = 5.0) -> int:
    """Write ``events`` to ``out`` paced by their recorded times; returns how many were rendered."""
    prev: float | None = None
    n = 0

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
        text = render_event(e)
        if text is not None:
            out.write(text)
            out.flush()
            n += 1
    out.write("\n")
    return n
