"""OpenAI's wire shapes of function calling: the calls and results a chat request's
messages bring (an assistant message's ``tool_calls``, a ``tool`` message), recorded as
``tool.called`` / ``tool.result`` events supplied by the client.

What is not OpenAI's (tools, the call format and its grammar, reading calls back, the
fallback prompt, recording the model's calls) is :mod:`sessiontape.core.tools`.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from sessiontape.core.events import NewEvent
from sessiontape.core.tools import called_event, result_event


def supplied_events(messages: Sequence[Mapping[str, Any]]) -> list[NewEvent]:
    """``tool.called``/``tool.result`` events for the calls and results a request brings
    (an assistant message's ``tool_calls``, a ``tool`` message), supplied by the client."""
    out: list[NewEvent] = []
    for m in messages:
        for c in m.get("tool_calls") or ():
            f = c["function"]
            out.append(called_event(str(c["id"]), str(f["name"]), str(f["arguments"]), "client"))
        if m.get("role") == "tool":
            name = m.get("name")
            out.append(
                result_event(
                    str(m.get("tool_call_id")),
                    None if name is None else str(name),
                    str(m.get("content") or ""),
                    "client",
                )
            )
    return out
