"""Rebuild a session's state from the log: latest snapshot, then the events
after it; a fork folds its parent up to the fork point first."""

from __future__ import annotations

from sessiontape.core.bodies import fork_point
from sessiontape.core.errors import SessionNotFound
from sessiontape.core.events import Event
from sessiontape.core.handback import handing_back
from sessiontape.core.log.store import EventLog
from sessiontape.core.session.snapshot import state_from_json
from sessiontape.core.session.state import SessionState, apply, fork_state


async def base_state(log: EventLog, first: Event) -> SessionState:
    """The state a session's own events fold onto: empty, or for a fork the
    parent's state at the fork version, cut at the fork's token position."""
    parent = fork_point(first)
    if not parent:
        return SessionState(first.session_id)
    pstate = await load_state(log, str(parent["session_id"]), int(parent["version"]))
    tp = parent.get("token_position")
    st = fork_state(pstate, first.session_id, None if tp is None else int(tp))
    st.parent = dict(parent)
    return st


async def load_state(
    log: EventLog, session_id: str, upto_version: int | None = None
) -> SessionState:
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
        base = await base_state(log, evs[0])
    async for e in handing_back(evs):
        apply(base, e)
    return base
