"""The Responses API's items as this server writes them: a response's output (one message,
or the function calls its reply made) and a stored request's input items (messages, the
function calls it sent back and their outputs), from what the log records."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from sessiontape.core.tools import ToolCall


def message_item(key: str, status: str, text: str, logprobs: list[Any]) -> dict[str, Any]:
    """A reply's text as its one output message."""
    part = {"type": "output_text", "text": text, "annotations": [], "logprobs": logprobs}
    return {
        "type": "message",
        "id": "msg_" + key,
        "status": status,
        "role": "assistant",
        "content": [part],
    }


def call_items(key: str, calls: Sequence[ToolCall]) -> list[dict[str, Any]]:
    """The calls a reply made, one ``function_call`` output item each."""
    return [
        {
            "type": "function_call",
            "id": f"fc_{key}_{i}",
            "call_id": c.id,
            "name": c.name,
            "arguments": c.arguments,
            "status": "completed",
        }
        for i, c in enumerate(calls)
    ]


def choice_json(choice: str) -> Any:
    return (
        choice if choice in ("auto", "none", "required") else {"type": "function", "name": choice}
    )


def tool_json(t: dict[str, Any]) -> dict[str, Any]:
    """A recorded tool (chat's shape) in the Responses API's flat shape."""
    f = t["function"]
    return {"type": "function", **f}


def input_items(key: str, m: dict[str, Any]) -> list[dict[str, Any]]:
    """A recorded input message as the input items it came from."""
    if m.get("role") == "tool":
        return [
            {
                "id": f"fco_{key}",
                "type": "function_call_output",
                "call_id": m.get("tool_call_id"),
                "output": m.get("content"),
                "status": "completed",
            }
        ]
    if m.get("tool_calls"):
        return [
            {
                "id": f"fc_{key}_{j}",
                "type": "function_call",
                "call_id": c["id"],
                "name": c["function"]["name"],
                "arguments": c["function"]["arguments"],
                "status": "completed",
            }
            for j, c in enumerate(m["tool_calls"])
        ]
    return [
        {
            "id": f"msg_{key}",
            "type": "message",
            "role": m["role"],
            "status": "completed",
            "content": [
                {
                    "type": "output_text" if m["role"] == "assistant" else "input_text",
                    "text": m["content"],
                }
            ],
        }
    ]
