"""GENERATE's configuration on the Evergreen wire: ``google.protobuf.Struct`` messages
packed in the Action's ``configs`` (``Any``), merged in order (later keys win).

Keys: the sampling parameters (max_tokens, temperature, top_p, top_k, seed as a number or
a decimal string, stop_token_ids), ``constraint`` (the native wire's constraint object:
the output node's text is generated under it), and the tools the model may call
(``tools``, ``tool_choice``, ``parallel_tool_calls``: :mod:`sessiontape.core.tools`; how a
call becomes an action is transports/grpc/evergreen_calls.py). Anything else, a wrong
type, or another ``Any`` type is InvalidParameters; docs/protocols/evergreen.md lists them.
"""

from __future__ import annotations

import base64
import dataclasses
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from google.protobuf import json_format, message, struct_pb2

from sessiontape.core.constraint import Constraint
from sessiontape.core.engine.interface import MODEL_SAMPLED, SamplingParams
from sessiontape.core.errors import InvalidParameters, InvalidTool, shown
from sessiontape.core.tools import Tool, ToolUse, tool, use_of

STRUCT_TYPE_URL = "type.googleapis.com/google.protobuf.Struct"

_PARAM_TYPES: Mapping[str, type | tuple[type, ...]] = {
    "max_tokens": (int, float),
    "temperature": (int, float),
    "top_p": (int, float),
    "top_k": (int, float),
    "seed": (int, float, str),
    "stop_token_ids": list,
    # {"json_schema": {...}} | {"json_object": true} | {"regex": "..."} | {"grammar": "..."}
    "constraint": dict,
    # [{"name", "description", "parameters", "strict"}] (or OpenAI's {"type", "function"})
    "tools": list,
    # "auto" | "none" | "required" | a function's name
    "tool_choice": str,
    "parallel_tool_calls": bool,
}
#: keys whose values are booleans (a bool is refused for every other key)
_BOOLEAN = frozenset({"parallel_tool_calls"})


@dataclass(frozen=True)
class GenerateConfig:
    """What a GENERATE's configs ask for: how to sample, and the tools it may call (None:
    no tools, or ``tool_choice`` none without any)."""

    params: SamplingParams
    tools: ToolUse | None = None


def config_json(a: Any) -> dict[str, Any]:
    """A config as ``action.submitted`` records it: a Struct as JSON, anything else base64."""
    if a.type_url == STRUCT_TYPE_URL:
        return {"type_url": a.type_url, "json": _struct(a)}
    return {"type_url": a.type_url, "value": base64.b64encode(a.value).decode()}


def _struct(a: Any) -> dict[str, Any]:
    """A packed Struct as JSON; a corrupt ``Any`` or a NaN/Infinity inside is InvalidParameters."""
    s = struct_pb2.Struct()
    try:
        if not a.Unpack(s):
            raise InvalidParameters("GENERATE config does not decode as google.protobuf.Struct")
        return dict(json_format.MessageToDict(s))
    except (message.DecodeError, ValueError) as exc:  # corrupt bytes; NaN/Infinity number_value
        raise InvalidParameters(f"GENERATE config is not a valid Struct: {exc}") from None


def _integral(value: Any) -> Any:
    """``value`` with its whole numbers as integers: a Struct holds every number as a
    double, and a JSON Schema's ``maxLength: 12`` must not reach llguidance as ``12.0``."""
    if isinstance(value, float) and value.is_integer():
        return int(value)
    if isinstance(value, list):
        return [_integral(v) for v in value]
    if isinstance(value, dict):
        return {k: _integral(v) for k, v in value.items()}
    return value


#: keys whose values are JSON documents (schemas), read with whole numbers as integers
_DOCUMENTS = ("constraint", "tools")


def _merged(configs: Sequence[Any]) -> dict[str, Any]:
    merged: dict[str, Any] = {}
    for a in configs:
        if a.type_url != STRUCT_TYPE_URL:
            raise InvalidParameters(
                f"GENERATE config of type {a.type_url!r}: only {STRUCT_TYPE_URL} is accepted"
            )
        merged.update(_struct(a))
    for key in _DOCUMENTS:
        if key in merged:
            merged[key] = _integral(merged[key])
    for key, value in merged.items():
        want = _PARAM_TYPES.get(key)
        if want is None:
            raise InvalidParameters(
                f"unknown GENERATE config key {shown(key, 'a key')} (known: {', '.join(sorted(_PARAM_TYPES))})"
            )
        if not isinstance(value, want) or (isinstance(value, bool) and key not in _BOOLEAN):
            raise InvalidParameters(
                f"GENERATE config {key!r} has the wrong type ({type(value).__name__})"
            )
    return merged


def sampling_params(configs: Sequence[Any]) -> SamplingParams:
    """GENERATE's sampling parameters and constraint (its tools: :func:`generate_config`)."""
    return _sampling(_merged(configs))


def _sampling(merged: Mapping[str, Any]) -> SamplingParams:
    try:
        ints = {k: int(merged[k]) for k in ("max_tokens", "top_k") if k in merged}
        if any(float(merged[k]) != ints[k] for k in ints):
            raise ValueError("not an integer")
        seed = merged.get("seed")
        constraint = merged.get("constraint")
        return SamplingParams(
            max_tokens=ints.get("max_tokens", SamplingParams.max_tokens),
            temperature=float(merged.get("temperature", SamplingParams.temperature)),
            top_p=float(merged.get("top_p", SamplingParams.top_p)),
            top_k=ints.get("top_k", SamplingParams.top_k),
            seed=None if seed is None else int(seed),
            stop_token_ids=tuple(int(t) for t in merged.get("stop_token_ids", ())),
            from_model=frozenset(f for f in MODEL_SAMPLED if f not in merged),
            constraint=None if constraint is None else Constraint.from_wire(constraint),
        )
    except (TypeError, ValueError) as exc:
        raise InvalidParameters(f"bad GENERATE config: {exc}") from exc


def generate_config(configs: Sequence[Any]) -> GenerateConfig:
    """GENERATE's configs, read and checked: a bad key or value (InvalidParameters), tool
    (InvalidTool) or tool grammar (InvalidConstraint) raises before anything is recorded."""
    merged = _merged(configs)
    params = _sampling(merged)
    if "tools" not in merged:
        given = [k for k in ("tool_choice", "parallel_tool_calls") if k in merged]
        if given:
            raise InvalidTool(f"GENERATE config: {' and '.join(given)} without tools")
        return GenerateConfig(params)
    tools = [_tool(t) for t in merged["tools"]]
    choice = str(merged.get("tool_choice", "auto" if tools else "none"))
    use = use_of(tools, choice, bool(merged.get("parallel_tool_calls", True)), None)
    grammar = use.constraint()
    if grammar is not None:
        if params.constraint is not None:
            raise InvalidParameters(
                "GENERATE config: a constraint and tools the model may call (tool_choice"
                f" {choice!r}) cannot be combined"
            )
        grammar.check()  # a parameters schema llguidance refuses: InvalidConstraint
        params = dataclasses.replace(params, constraint=grammar)
    return GenerateConfig(params, use)


def _tool(spec: Any) -> Tool:
    """A tool from the config: ``{"name", "description", "parameters", "strict"}``, with an
    optional ``"type": "function"``, or OpenAI's chat shape ``{"type": "function",
    "function": {...}}``."""
    if not isinstance(spec, Mapping):
        raise InvalidTool(f"GENERATE config: a tool must be an object, not {shown(spec, 'a tool')}")
    if spec.get("type", "function") != "function":
        raise InvalidTool(
            f"GENERATE config: tool type {shown(spec.get('type'), 'a type')} (only function)"
        )
    f = spec.get("function", spec)
    if not isinstance(f, Mapping):
        raise InvalidTool("GENERATE config: a tool's function must be an object")
    known = {"type", "function", "name", "description", "parameters", "strict"}
    unknown = sorted(set(f) - known)
    if unknown:
        raise InvalidTool(
            f"GENERATE config: unknown tool keys [{', '.join(shown(k, 'a key') for k in unknown)}]"
        )
    return tool(f.get("name"), f.get("description"), f.get("parameters"), f.get("strict"))
