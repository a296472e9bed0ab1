"""Rebuild a session's state from the log: latest snapshot, then the events
after it; a fork folds its parent up to the fork point first."""

from __future__ import annotations

from core.errors import SessionNotFound
from core.events import T
from core.log.store import EventLog
from core.snapshot import state_from_json
from core.state import SessionState, apply, fork_state


async def load_state(log: EventLog, session_id: str, upto_version: int | None = None) -> SessionState:
    base: SessionState | None = None
    from_version = 1
    snap = await log.load_snapshot(session_id, upto_version)
    if snap is not None:
        version, state_json, data = snap
        base = state_from_json(state_json, data)
        from_version = version + 1
    evs = await log.read(session_id, from_version, upto_version)
    if base is None:
        if not evs:
            raise SessionNotFound(session_id)
        base = SessionState(session_id)
        first = evs[0]
        parent = first.body.get("parent") if first.type == T.SESSION_OPENED else None
        if parent:
            pstate = await load_state(log, str(parent["session_id"]), int(parent["version"]))
            tp = parent.get("token_position")
            base = fork_state(pstate, session_id, None if tp is None else int(tp))
            base.parent = dict(parent)
    for e in evs:
        apply(base, e)
    return base
