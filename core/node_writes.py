"""Evergreen's node DAG: fragments of node messages and actions, written to a session.

:class:`NodeWrites` is the part of the runtime that records them (``runtime.nodes``) (the fold's
rules for them are in core/nodes.py and core/session/state.py): a message's
fragments all or nothing, an action whose outputs are new nodes, an action's
end. Each command is one commit, run again on a reloaded state when another
process moved the session on (:func:`stale_retry`).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from sessiontape.core.errors import InvalidAction, ResourceExhausted
from sessiontape.core.events import Event, NewEvent, T
from sessiontape.core.nodes import FragmentIn, check_fragment
from sessiontape.core.session.cache import SessionStates, stale_retry
from sessiontape.core.session.state import SessionState, overlay, overlay_apply


class NodeWrites:
    """Evergreen's writes to a session's node DAG (see the module docstring)."""

    def __init__(self, sessions: SessionStates, max_depth: int, max_nodes: int) -> None:
        self.sessions = sessions
        #: the deepest a node may nest, and the most nodes a session may hold
        self.max_depth = max_depth
        self.max_nodes = max_nodes

    @stale_retry
    async def append_fragments(
        self,
        session_id: str,
        fragments: Sequence[FragmentIn],
        direction: str = "in",
        then: Callable[[SessionState], Sequence[NewEvent]] | None = None,
    ) -> list[bool]:
        """Record Evergreen fragments; returns, per fragment, False for an ignored duplicate.

        All-or-nothing: if any fragment breaks a rule nothing is recorded. ``then`` (called
        when a fragment is new, with a view of the state the fragments are applied to; it
        must not change it) returns events that commit with the fragments, after them; if
        it raises, nothing is recorded.
        """
        async with self.sessions.lock(session_id):
            st = await self.sessions.open_locked(session_id)
            new, kept = self.fragment_events(st, fragments, direction)
            if new and then is not None:
                scratch = overlay(st)
                for ne in new:
                    overlay_apply(scratch, st, ne.body, ne.data)
                new.extend(then(scratch))
            if new:
                await self.sessions.commit(st, new)
            return kept

    def fragment_events(
        self, st: SessionState, fragments: Sequence[FragmentIn], direction: str
    ) -> tuple[list[NewEvent], list[bool]]:
        """The events that record ``fragments`` on ``st`` (nothing is written), and
        per fragment False for an ignored duplicate; raises if any breaks a rule."""
        # Later fragments of one message are checked against the earlier
        # ones, on a copy-on-write overlay of the touched nodes only.
        scratch = overlay(st) if len(fragments) > 1 else st
        new: list[NewEvent] = []
        kept: list[bool] = []
        fresh: set[str] = set()
        for f in fragments:
            ok = check_fragment(scratch, f, self.max_depth)
            kept.append(ok)
            if ok:
                if f.id not in st.nodes:
                    fresh.add(f.id)
                ne = NewEvent(T.NODE_FRAGMENT, f.body(direction), f.data)
                new.append(ne)
                if scratch is not st:
                    overlay_apply(scratch, st, ne.body, ne.data)
        if len(st.nodes) + len(fresh) > self.max_nodes:
            raise ResourceExhausted(
                f"session {st.session_id} would hold more than {self.max_nodes} nodes"
            )
        return new, kept

    @stale_retry
    async def submit_action(
        self,
        session_id: str,
        name: str,
        inputs: Sequence[tuple[str, str]],
        outputs: Sequence[tuple[str, str]],
        *,
        target: str = "",
        configs: Sequence[Any] = (),
        action_id: str | None = None,
    ) -> Event:
        """Record an action a client submitted; output ids must be new node ids."""
        async with self.sessions.lock(session_id):
            st = await self.sessions.open_locked(session_id)
            if not name:
                raise InvalidAction("action without a name")
            seen: set[str] = set()
            for _, nid in outputs:
                if nid in st.nodes or nid in seen or nid in st.action_outputs:
                    raise InvalidAction(f"output id {nid!r} is not new")
                seen.add(nid)
            aid = action_id or f"a{len(st.actions) + 1}"
            body = {
                "action_id": aid,
                "name": name,
                "inputs": [{"name": n, "id": i} for n, i in inputs],
                "outputs": [{"name": n, "id": i} for n, i in outputs],
                "target": target,
                "configs": list(configs),
            }
            return (await self.sessions.commit(st, [NewEvent(T.ACTION_SUBMITTED, body)]))[0]

    @stale_retry
    async def finish_action(
        self, session_id: str, action_id: str, error: tuple[str, str] | None = None
    ) -> Event:
        async with self.sessions.lock(session_id):
            st = await self.sessions.get(session_id)
            if error is None:
                ne = NewEvent(T.ACTION_COMPLETED, {"action_id": action_id})
            else:
                ne = NewEvent(
                    T.ACTION_FAILED, {"action_id": action_id, "code": error[0], "message": error[1]}
                )
            return (await self.sessions.commit(st, [ne]))[0]
