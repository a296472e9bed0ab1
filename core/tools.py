"""Function calling, whatever the wire: the tools a model may call, how it writes a call,
the grammar that constrains its calls, how calls are read back from its text, and the
events that record calls and results.

A :class:`Tool` is a function with a JSON Schema for its arguments. A model writes a call as
one JSON line ``{"name": ..., "arguments": {...}}`` (:class:`CallFormat`), in tags when its
chat template uses them (Hermes, Qwen2.5), its arguments under ``parameters`` when its
template asks for that (Llama 3.1+). A template that takes ``tools`` gets them as
transformers hands them; one without tool support (SmolLM2's, the role-marker templates),
and a wire with no template at all (Evergreen's raw prompts), gets the documented fallback:
the tools described in plain text (:data:`FALLBACK_PROMPT`), calls written as the JSON line,
earlier calls rendered as those lines and results as ``tool`` turns.

Either way the model's output is constrained by a Lark grammar (llguidance, through
:class:`~sessiontape.core.constraint.Constraint`): with ``tool_choice`` ``required`` or a
named function, to calls; with ``auto``, to either free text or calls; each call's
``arguments`` always to its function's JSON Schema.

A call the model made is recorded as a ``tool.called`` event in the same commit as its
generation's finish (function, arguments, call id, generation and token span:
:class:`CallRecorder`); calls and results a client supplies are ``tool.called`` /
``tool.result`` events with ``supplied_by: "client"`` (:func:`called_event`,
:func:`result_event`). The wires say how their messages map onto these:
transports/http/openai/tools.py and transports/grpc/evergreen_calls.py.
"""

from __future__ import annotations

import bisect
import hashlib
import json
import re
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from sessiontape.core.constraint import Constraint, bounded_integers
from sessiontape.core.errors import InvalidTool, shown
from sessiontape.core.events import NewEvent, T

#: OpenAI's rule for a function's name
NAME = re.compile(r"^[A-Za-z0-9_-]{1,64}$")
#: the most tools one request may give (OpenAI's limit too)
MAX_TOOLS = 128
#: the most characters the tools take as JSON, all together: their description is the
#: prompt's, and their grammar is compiled before the request is accepted
MAX_TOOLS_CHARS = 128 * 1024
#: the JSON compiler options every tool's arguments are generated under (compact JSON)
ARGUMENT_OPTIONS = {"whitespace_flexible": False}
FALLBACK_PROMPT = (
    "You can call these functions:\n{tools}\n"
    "To call a function, answer with only one line of JSON: "
    '{{"name": <the function\'s name>, "arguments": <an object of its arguments>}}.'
)


@dataclass(frozen=True)
class Tool:
    """A function the model may call."""

    name: str
    description: str
    parameters: Mapping[str, Any]
    strict: bool = False

    def to_json(self) -> dict[str, Any]:
        return {
            "type": "function",
            "function": {
                "name": self.name,
                "description": self.description,
                "parameters": dict(self.parameters),
                "strict": self.strict,
            },
        }


@dataclass(frozen=True)
class ToolCall:
    """A call read from a reply: its id, function, arguments (JSON text as generated) and
    where its JSON lies in the reply's text (``[start, end)`` characters)."""

    id: str
    name: str
    arguments: str
    start: int
    end: int


def tool(name: Any, description: Any, parameters: Any, strict: Any) -> Tool:
    """A :class:`Tool` from a request's fields; InvalidTool for a bad one."""
    if not isinstance(name, str) or not NAME.match(name):
        raise InvalidTool(f"tool name must match [A-Za-z0-9_-]{{1,64}}: {shown(name, 'a string')}")
    if description is not None and not isinstance(description, str):
        raise InvalidTool(f"tool {name}: description must be a string")
    if strict is not None and not isinstance(strict, bool):
        raise InvalidTool(f"tool {name}: strict must be a boolean")
    params = {"type": "object", "properties": {}} if parameters is None else parameters
    if not isinstance(params, Mapping):
        raise InvalidTool(f"tool {name}: parameters must be a JSON Schema object")
    return Tool(name, description or "", dict(params), bool(strict))


def call_id(generation_id: str, index: int) -> str:
    """The id of a generation's ``index``-th call: a function of the log, the same on replay."""
    digest = hashlib.sha256(f"{generation_id}:{index}".encode()).hexdigest()
    return "call_" + digest[:24]


def _lark_string(text: str) -> str:
    return json.dumps(text)


@dataclass(frozen=True)
class CallFormat:
    """How the model writes a call: the JSON line, in tags when its template uses them
    (Hermes, Qwen2.5), its arguments under ``parameters`` when its template asks for that
    (Llama 3.1+), else under ``arguments``."""

    open: str = ""
    close: str = ""
    key: str = "arguments"

    @classmethod
    def for_template(cls, source: str | None) -> CallFormat:
        if source is None:
            return cls()
        key = "parameters" if '"parameters": dictionary of argument' in source else "arguments"
        if "<tool_call>" in source:
            return cls("<tool_call>\n", "\n</tool_call>", key)
        return cls(key=key)

    def head(self, name: str) -> str:
        return f'{self.open}{{"name": "{name}", "{self.key}": '

    def grammar(self, tools: Sequence[Tool], *, text_allowed: bool, parallel: bool) -> Constraint:
        """The Lark grammar of a reply: calls (one, or several a line each with
        ``parallel``), or with ``text_allowed`` free text instead (which may not begin
        with ``{``, ``<`` or a space, so the first token decides)."""
        rules = []
        alts = []
        for i, t in enumerate(tools):
            schema = {**bounded_integers(t.parameters), "x-guidance": ARGUMENT_OPTIONS}
            rules.append(
                f"call_{i}: {_lark_string(self.head(t.name))} args_{i} "
                f"{_lark_string('}' + self.close)}"
            )
            rules.append(f"args_{i}: %json {json.dumps(schema)}")
            alts.append(f"call_{i}")
        calls = 'call ("\\n" call)*' if parallel else "call"
        top = "start: TEXT | calls" if text_allowed else "start: calls"
        lines = [top, f"calls: {calls}", f"call: {' | '.join(alts)}", *rules]
        if text_allowed:
            lines.append(r"TEXT: /[^{<\s](.|\n)*/")
        return Constraint.lark("\n".join(lines) + "\n")

    def parse(self, text: str, generation_id: str) -> list[ToolCall]:
        """The calls a reply holds (none when it is text, or a call is cut short)."""
        calls: list[ToolCall] = []
        at = 0
        decoder = json.JSONDecoder()
        while True:
            start = text.find(self.open + '{"name": "', at)
            if start < 0 or (not calls and text[:start].strip()):
                return calls
            name_at = start + len(self.open) + len('{"name": "')
            name_end = text.find('"', name_at)
            name = text[name_at:name_end]
            head = self.head(name)
            if name_end < 0 or not text.startswith(head, start):
                return calls
            args_at = start + len(head)
            try:
                _, args_end = decoder.raw_decode(text, args_at)
            except ValueError:
                return calls
            end = args_end + 1 + len(self.close)
            if text[args_end:end] != "}" + self.close:
                return calls
            calls.append(
                ToolCall(
                    call_id(generation_id, len(calls)), name, text[args_at:args_end], start, end
                )
            )
            at = end


@dataclass(frozen=True)
class ToolUse:
    """A request's tools and how it lets the model use them."""

    tools: tuple[Tool, ...]
    #: "auto", "none", "required", or a function's name
    choice: str
    parallel: bool
    format: CallFormat
    #: the template takes ``tools`` itself (else the fallback's system turn)
    native: bool

    def to_json(self) -> dict[str, Any]:
        fmt = self.format
        return {
            "tools": [t.to_json() for t in self.tools],
            "tool_choice": self.choice,
            "parallel_tool_calls": self.parallel,
            "call_format": {"open": fmt.open, "close": fmt.close, "key": fmt.key},
            "native": self.native,
        }

    @property
    def named(self) -> Tool | None:
        return next((t for t in self.tools if t.name == self.choice), None)

    def constraint(self) -> Constraint | None:
        """The grammar the reply is generated under (None: ``none``, free text)."""
        if self.choice == "none" or not self.tools:
            return None
        if self.choice in ("auto", "required"):
            return self.format.grammar(
                self.tools, text_allowed=self.choice == "auto", parallel=self.parallel
            )
        named = self.named
        assert named is not None
        return self.format.grammar((named,), text_allowed=False, parallel=False)

    def system_text(self) -> str:
        """The fallback's description of the tools (:data:`FALLBACK_PROMPT`)."""
        return FALLBACK_PROMPT.format(tools=described(self.tools))

    def template_tools(self) -> list[dict[str, Any]] | None:
        return [t.to_json() for t in self.tools] if self.native else None


def described(tools: Sequence[Tool]) -> str:
    """The tools as the fallback lists them: one JSON line per function."""
    return "\n".join(json.dumps(t.to_json()["function"]) for t in tools)


def use_of(
    tools: Sequence[Tool], choice: str, parallel: bool, template_source: str | None
) -> ToolUse:
    """The request's :class:`ToolUse`; InvalidTool for more than :data:`MAX_TOOLS` tools or
    :data:`MAX_TOOLS_CHARS` of them, two tools of one name, or a choice naming no tool."""
    if len(tools) > MAX_TOOLS:
        raise InvalidTool(f"tools: {len(tools):,} functions (at most {MAX_TOOLS})")
    size = len(json.dumps([t.to_json() for t in tools]))
    if size > MAX_TOOLS_CHARS:
        raise InvalidTool(f"tools: {size:,} characters as JSON (at most {MAX_TOOLS_CHARS:,})")
    names = {t.name for t in tools}
    if len(names) != len(tools):
        raise InvalidTool("tools: two functions have the same name")
    if choice not in ("auto", "none", "required") and choice not in names:
        raise InvalidTool(
            f"tool_choice names {shown(choice, 'a function')}, which is not among the tools"
        )
    if choice == "required" and not tools:
        raise InvalidTool("tool_choice 'required' needs tools")
    native = template_source is not None and "tools" in template_source
    return ToolUse(tuple(tools), choice, parallel, CallFormat.for_template(template_source), native)


def prompt_messages(
    messages: Sequence[Mapping[str, Any]], use: ToolUse | None, fmt: CallFormat, at_start: bool
) -> list[dict[str, Any]]:
    """The messages as the template renders them: for the fallback, calls written as the
    model writes them, results as ``tool`` turns, and (at a session's start) the tools
    described in a system turn; for a template that takes tools, as given."""
    if use is not None and use.native:
        return [_for_template(m) for m in messages]
    out: list[dict[str, Any]] = []
    for m in messages:
        role = str(m.get("role"))
        content = m.get("content") or ""
        calls = m.get("tool_calls") or ()
        if role == "assistant" and calls:
            lines = [
                fmt.head(c["function"]["name"]) + c["function"]["arguments"] + "}" + fmt.close
                for c in calls
            ]
            content = (content + "\n" if content else "") + "\n".join(lines)
        out.append({"role": role, "content": content})
    if use is not None and use.tools and at_start:
        if out and out[0]["role"] in ("system", "developer"):
            out[0] = {**out[0], "content": out[0]["content"] + "\n\n" + use.system_text()}
        else:
            out.insert(0, {"role": "system", "content": use.system_text()})
    return out


def _for_template(m: Mapping[str, Any]) -> dict[str, Any]:
    """A message as transformers hands it to a template that takes tools: a call's
    ``arguments`` as an object (the templates write it with ``tojson``), not JSON text."""
    out = dict(m)
    calls = m.get("tool_calls")
    if calls:
        out["tool_calls"] = [
            {**c, "function": {**c["function"], "arguments": _object(c["function"]["arguments"])}}
            for c in calls
        ]
    return out


def _object(arguments: Any) -> Any:
    if not isinstance(arguments, str):
        return arguments
    try:
        return json.loads(arguments)
    except ValueError:
        return arguments


def called_event(
    call: str,
    name: str,
    arguments: str,
    supplied_by: str,
    generation_id: str | None = None,
    span: Sequence[int] | None = None,
) -> NewEvent:
    """A ``tool.called`` event: a call the model made (with its generation and the token
    span ``[start, end)`` its JSON came from) or one a client supplied (neither)."""
    return NewEvent(
        T.TOOL_CALLED,
        {
            "call_id": call,
            "name": name,
            "arguments": arguments,
            "generation_id": generation_id,
            "span": None if span is None else list(span),
            "supplied_by": supplied_by,
        },
    )


def result_event(call: str, name: str | None, content: str, supplied_by: str) -> NewEvent:
    """A ``tool.result`` event: what call ``call`` returned, as ``supplied_by`` gave it."""
    return NewEvent(
        T.TOOL_RESULT,
        {"call_id": call, "name": name, "content": content, "supplied_by": supplied_by},
    )


def called_events(
    calls: Sequence[ToolCall],
    generation_id: str,
    prompt_length: int,
    tokens: Sequence[int],
    detokenize: Callable[[Sequence[int]], str],
) -> list[NewEvent]:
    """``tool.called`` events for the calls a generation made, each with the token span
    (absolute positions ``[start, end)``) its JSON came from."""
    out = []
    for c in calls:
        first, last = token_span(tokens, detokenize, c.start, c.end)
        span = (prompt_length + first, prompt_length + last)
        out.append(called_event(c.id, c.name, c.arguments, "model", generation_id, span))
    return out


class CallRecorder:
    """A generation's run hook part (:data:`~sessiontape.core.generation.request.RunHook`):
    it gathers the generated tokens and, with the last run, reads the calls the reply makes
    (:attr:`calls`) and returns their ``tool.called`` events, which then commit with the
    generation's finish."""

    def __init__(self, detokenize: Callable[[Sequence[int]], str], use: ToolUse | None) -> None:
        self.detokenize = detokenize
        self.use = use
        #: whether the reply may hold calls (a choice other than ``none``)
        self.wanted = use is not None and use.choice != "none"
        self.tokens: list[int] = []
        self.generation_id = ""
        self.prompt_length = 0
        #: the calls the reply made, once its last run was seen
        self.calls: list[ToolCall] = []

    def started(self, generation_id: str, prompt_length: int) -> None:
        self.generation_id = generation_id
        self.prompt_length = prompt_length

    def __call__(self, _: Any, tokens: list[int], last: bool) -> list[NewEvent]:
        self.tokens.extend(tokens)
        if not last or self.use is None or not self.wanted:
            return []
        self.calls = self.use.format.parse(self.detokenize(self.tokens), self.generation_id)
        return called_events(
            self.calls, self.generation_id, self.prompt_length, self.tokens, self.detokenize
        )


def token_span(
    tokens: Sequence[int], detokenize: Callable[[Sequence[int]], str], start: int, end: int
) -> tuple[int, int]:
    """The tokens ``[first, last)`` whose text covers characters ``[start, end)``: ``first``
    the token whose text holds character ``start``, ``last`` the fewest tokens whose text
    reaches ``end`` (a prefix's text grows with it: found by bisection)."""
    n = len(tokens)

    def chars(i: int) -> int:
        return len(detokenize(tokens[:i]))

    first = max(0, bisect.bisect_right(range(n + 1), start, key=chars) - 1)
    last = min(n, bisect.bisect_left(range(n + 1), end, key=chars))
    return min(first, last), last
