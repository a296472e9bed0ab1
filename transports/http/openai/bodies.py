"""The OpenAI-compatible routes' request bodies, declared once (as the native ones are, in
:mod:`..native.bodies`): strict pydantic models from which both validation and the
``ResponseCreateRequest`` and ``ChatCompletionRequest`` schemas of the OpenAPI document come.

OpenAI's API is wider than what this server does, so a body is read in steps, each a typed 400
with OpenAI's ``param``:

1. :func:`check_fields`: a field neither the model nor OpenAI's API knows is ``unknown_field``
   (unless it is null: some clients send every field they know, unset ones as null);
   :data:`NO_OPS` are taken and dropped;
2. the route checks ``model`` (404 ``model_not_found`` before any other field is looked at);
3. :func:`parse`: a feature this server does not have (``tools`` ...) is refused unless it asks
   for nothing; then the model validates what is left (a null field is an absent one).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import Annotated, Any, ClassVar, Literal, TypeVar, Union

from pydantic import (
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Discriminator,
    Field,
    Tag,
    ValidationError,
    model_validator,
)
from pydantic_core import PydanticCustomError

from sessiontape.core.constraint import Constraint
from sessiontape.core.engine.interface import SamplingParams, left_to_model
from sessiontape.core.errors import shown
from sessiontape.core.tools import Tool, tool
from sessiontape.transports.http.native.bodies import describe
from sessiontape.transports.http.openai.shared import DEFAULT_MAX_TOKENS, BadParam

#: the roles a message may have (chat_template.ROLES)
Role = Literal["system", "developer", "user", "assistant"]
#: the one ``include`` value served: per-token logprobs of the output text
LOGPROBS = "message.output_text.logprobs"
MAX_OUTPUT = 1 << 20


class Part(BaseModel):
    """Fields this server does not read are ignored, as OpenAI's clients send many."""

    model_config = ConfigDict(strict=True, extra="ignore", frozen=True, allow_inf_nan=False)


class TextPart(Part):
    type: Literal["text", "input_text", "output_text"]
    text: str


def _kind(*tags: tuple[type, str]) -> Any:
    """A discriminator by the value's JSON type: ``@``-tags, which error paths leave out."""

    def tag(value: Any) -> str | None:
        return next((t for cls, t in tags if isinstance(value, cls)), None)

    return tag


_PART = Annotated[
    Union[Annotated[str, Tag("@text")], Annotated[TextPart, Tag("@part")]],  # noqa: UP007
    Discriminator(
        _kind((str, "@text"), (dict, "@part")),
        custom_error_type="content_part",
        custom_error_message="must be a string or a text part",
    ),
]
#: a message's content: a string, or an array of strings and text parts
Content = Annotated[
    Union[Annotated[str, Tag("@text")], Annotated[list[_PART], Tag("@parts")]],  # noqa: UP007
    Discriminator(
        _kind((str, "@text"), (list, "@parts")),
        custom_error_type="content",
        custom_error_message="must be a string or an array of text parts",
    ),
]


def text_of(content: str | list[str | TextPart]) -> str:
    if isinstance(content, str):
        return content
    return "".join(p if isinstance(p, str) else p.text for p in content)


Metadata = Annotated[
    dict[Annotated[str, Field(max_length=64)], Annotated[str, Field(max_length=512)]],
    Field(max_length=16),
]
Temperature = Annotated[float, Field(ge=0, le=2)]
TopP = Annotated[float, Field(gt=0, le=1)]
TopLogprobs = Annotated[int, Field(ge=0, le=20)]
Penalty = Annotated[float, Field(ge=-2, le=2)]
#: the repetition penalty of a chat request that names none, when the model recommends
#: none: llama.cpp's default (1.1 over the last 64 tokens, here the answer's), which stops
#: the small chat models' loops (docs/models.md, Penalties against loops)
CHAT_REPETITION_PENALTY = 1.1
Seed = Annotated[
    int,
    Field(
        ge=0,
        le=2**63 - 1,
        description="extension: the seed (drawn and recorded when none is given)",
    ),
]


class Request(BaseModel):
    """A request body: strict types; unknown fields are :func:`check_fields`' to refuse."""

    model_config = ConfigDict(strict=True, extra="ignore", frozen=True, allow_inf_nan=False)
    #: OpenAI features this server does not have: refused unless they ask for nothing
    unsupported: ClassVar[tuple[str, ...]] = ()

    model: str = Field(min_length=1, description="GET /v1/models; the engine's name also works")
    #: unset: the served model's recommendation (docs/models.md), else 1
    temperature: Temperature | None = None
    top_p: TopP | None = None
    seed: Seed | None = None
    metadata: Metadata | None = None
    stream: bool | None = False
    frequency_penalty: Penalty | None = Field(
        None,
        description="subtracted from a token's score per occurrence in the answer's last 64 tokens",
    )
    presence_penalty: Penalty | None = Field(
        None, description="subtracted from the score of a token among the answer's last 64"
    )
    repetition_penalty: Annotated[float, Field(gt=0, le=10)] | None = Field(
        None,
        description=(
            "extension: divides (multiplies if negative) the score of a token among the"
            f" answer's last 64; unset: the model's recommendation, else {CHAT_REPETITION_PENALTY}"
        ),
    )
    min_p: Annotated[float, Field(ge=0, le=1)] | None = Field(
        None, description="extension: drop tokens below min_p times the most probable one's"
    )

    def sampling(self, max_tokens: int | None) -> SamplingParams:
        """The request's sampling; what it leaves unset (and top_k and the penalties'
        window, which OpenAI's API does not name) the served model's recommendation sets
        when the generation begins."""
        return SamplingParams(
            max_tokens=max_tokens or DEFAULT_MAX_TOKENS,
            temperature=1.0 if self.temperature is None else self.temperature,
            top_p=1.0 if self.top_p is None else self.top_p,
            seed=self.seed,
            frequency_penalty=self.frequency_penalty or 0.0,
            presence_penalty=self.presence_penalty or 0.0,
            repetition_penalty=(
                CHAT_REPETITION_PENALTY
                if self.repetition_penalty is None
                else self.repetition_penalty
            ),
            min_p=self.min_p or 0.0,
            from_model=left_to_model(
                temperature=self.temperature,
                top_p=self.top_p,
                top_k=None,
                repetition_penalty=self.repetition_penalty,
                min_p=self.min_p,
                penalty_last_n=None,
            ),
        )


def _refuse(param: str, message: str) -> PydanticCustomError:
    return PydanticCustomError("refused", message, {"param": param})


# -- /v1/responses ----------------------------------------------------------------------


class InputMessage(Part):
    type: Literal["message"] = "message"
    role: Role
    content: Content


class FunctionCallItem(Part):
    """A call the model made earlier (an output item sent back as input)."""

    type: Literal["function_call"]
    call_id: Annotated[str, Field(min_length=1)]
    name: str
    arguments: str


class FunctionCallOutput(Part):
    """What a call returned, from the client that ran it."""

    type: Literal["function_call_output"]
    call_id: Annotated[str, Field(min_length=1)]
    output: str


def _item_kind(value: Any) -> str | None:
    if not isinstance(value, dict):
        return None
    return {"function_call": "@call", "function_call_output": "@output"}.get(
        value.get("type", "message"), "@message"
    )


_INPUT_ITEM = Annotated[
    Union[  # noqa: UP007
        Annotated[InputMessage, Tag("@message")],
        Annotated[FunctionCallItem, Tag("@call")],
        Annotated[FunctionCallOutput, Tag("@output")],
    ],
    Discriminator(
        _item_kind,
        custom_error_type="input_item",
        custom_error_message="must be a message, a function_call or a function_call_output",
    ),
]


def _function_tools(value: Any) -> Any:
    if isinstance(value, list):
        for t in value:
            if not isinstance(t, dict) or t.get("type") != "function":
                kind = t.get("type") if isinstance(t, dict) else type(t).__name__
                raise _refuse("tools", f"tools of type {kind!r} are not supported (function only)")
    return value


class ResponseTool(Part):
    type: Literal["function"]
    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class ResponseToolChoice(Part):
    type: Literal["function"]
    name: str


#: ``tool_choice``: a mode, or a function by name (in each API's shape)
_MODE = Annotated[Literal["auto", "none", "required"], Tag("@mode")]
_CHOICE = Discriminator(
    _kind((str, "@mode"), (dict, "@named")),
    custom_error_type="tool_choice",
    custom_error_message='must be "auto", "none", "required" or a named function',
)
ResponseChoice = Annotated[Union[_MODE, Annotated[ResponseToolChoice, Tag("@named")]], _CHOICE]  # noqa: UP007


def format_constraint(kind: str, schema: dict[str, Any] | None) -> Constraint | None:
    """An output format's constraint (None for text)."""
    if kind == "json_object":
        return Constraint.json_object()
    if kind == "json_schema":
        return Constraint.json_schema(schema or {})
    return None


class TextFormat(Part):
    """``text``, ``json_object``, or ``json_schema`` (generated to match the schema)."""

    type: Literal["text", "json_object", "json_schema"]
    name: str | None = None
    description: str | None = None
    schema_: dict[str, Any] | None = Field(None, alias="schema")
    strict: bool | None = None

    @model_validator(mode="after")
    def _schema_given(self) -> TextFormat:
        if self.type == "json_schema" and self.schema_ is None:
            raise PydanticCustomError("schema", "a json_schema format needs its schema")
        return self

    def constraint(self) -> Constraint | None:
        return format_constraint(self.type, self.schema_)


class TextConfig(Part):
    format: TextFormat | None = None


class ResponseCreateRequest(Request):
    """Tools other than functions, conversation, prompt, a reasoning that asks for something
    and a truncation other than disabled are refused (400), not ignored; so is any non-null
    field not listed here (unknown_field), except user, service_tier, safety_identifier,
    prompt_cache_key and prompt_cache_retention, which change nothing."""

    unsupported = ("conversation", "prompt", "reasoning")

    input: Annotated[
        Union[  # noqa: UP007
            Annotated[str, Tag("@text")],
            Annotated[list[_INPUT_ITEM], Field(min_length=1), Tag("@messages")],
        ],
        Discriminator(
            _kind((str, "@text"), (list, "@messages")),
            custom_error_type="input",
            custom_error_message="must be a string or a non-empty array of messages",
        ),
    ]
    instructions: str | None = None
    previous_response_id: str | None = Field(
        None, description="continue that response's session (or fork it there)"
    )
    store: bool | None = True
    background: bool | None = False
    stream_options: dict[str, Any] | None = Field(None, description="taken; changes nothing")
    max_output_tokens: Annotated[int, Field(ge=1, le=MAX_OUTPUT)] | None = Field(
        None, description=f"default {DEFAULT_MAX_TOKENS}"
    )
    include: list[Literal["message.output_text.logprobs"]] | None = None
    top_logprobs: TopLogprobs | None = None
    text: TextConfig | None = None
    truncation: Literal["disabled"] | None = None
    tools: (
        Annotated[list[ResponseTool], Field(max_length=128), BeforeValidator(_function_tools)]
        | None
    ) = None
    tool_choice: ResponseChoice | None = None
    parallel_tool_calls: bool | None = None

    @model_validator(mode="after")
    def _background_is_stored(self) -> ResponseCreateRequest:
        if self.background and self.store is False:
            raise _refuse("background", "background responses need store=true")
        if self.previous_response_id is None and not isinstance(self.input, str):
            # (with previous_response_id, the calls answered are that response's)
            calls: set[str] = set()
            for i, m in enumerate(self.input):
                if isinstance(m, FunctionCallItem):
                    calls.add(m.call_id)
                elif not isinstance(m, InputMessage) and m.call_id not in calls:
                    raise _refuse(
                        f"input[{i}].call_id",
                        f"input[{i}] answers call {shown(m.call_id, 'an id')}, which no earlier"
                        " function_call item made",
                    )
        return self

    def messages(self) -> list[dict[str, Any]]:
        """The input as chat messages (a string is one user message; consecutive function
        calls are one assistant message's ``tool_calls``, an output a ``tool`` message)."""
        if isinstance(self.input, str):
            return [{"role": "user", "content": self.input}]
        out: list[dict[str, Any]] = []
        for m in self.input:
            if isinstance(m, InputMessage):
                out.append({"role": m.role, "content": text_of(m.content)})
            elif isinstance(m, FunctionCallItem):
                call = {
                    "id": m.call_id,
                    "type": "function",
                    "function": {"name": m.name, "arguments": m.arguments},
                }
                if out and out[-1]["role"] == "assistant" and out[-1].get("tool_calls"):
                    out[-1]["tool_calls"].append(call)
                else:
                    out.append({"role": "assistant", "content": None, "tool_calls": [call]})
            else:
                out.append({"role": "tool", "tool_call_id": m.call_id, "content": m.output})
        return out

    def tool_list(self) -> list[Tool]:
        return [tool(t.name, t.description, t.parameters, t.strict) for t in self.tools or ()]

    def choice(self) -> str:
        """``tool_choice`` as "auto", "none", "required" or a function's name."""
        c = self.tool_choice
        if c is None:
            return "auto" if self.tools else "none"
        return c if isinstance(c, str) else c.name

    def format_constraint(self) -> Constraint | None:
        f = self.text.format if self.text is not None else None
        return None if f is None else f.constraint()


# -- /v1/chat/completions -----------------------------------------------------------------


class CalledFunction(Part):
    name: str
    arguments: str


class ToolCallIn(Part):
    """A call in an assistant message of the history (as the model, or the client, made it)."""

    id: Annotated[str, Field(min_length=1)]
    type: Literal["function"] = "function"
    function: CalledFunction


class ChatMessage(Part):
    """A message: ``tool_calls`` on an assistant message (content may then be null), and a
    ``tool`` message answering one of them by ``tool_call_id``."""

    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: Content | None = None
    name: str | None = None
    tool_calls: list[ToolCallIn] | None = None
    tool_call_id: str | None = None

    @model_validator(mode="before")
    @classmethod
    def _no_function_call(cls, value: Any) -> Any:
        if isinstance(value, dict) and value.get("function_call"):
            raise PydanticCustomError(
                "function_call", "function_call is deprecated: send tool_calls instead"
            )
        return value

    @model_validator(mode="after")
    def _consistent(self) -> ChatMessage:
        if self.tool_calls and self.role != "assistant":
            raise PydanticCustomError("tool_calls", "only an assistant message has tool_calls")
        if self.role == "tool" and not self.tool_call_id:
            raise PydanticCustomError("tool_call_id", "a tool message needs its tool_call_id")
        if self.content is None and not (self.role == "assistant" and self.tool_calls):
            raise PydanticCustomError("content", "content is required")
        return self

    def to_json(self) -> dict[str, Any]:
        """The message as the request records it (content as text)."""
        keys = {"role", "name", "tool_calls", "tool_call_id"}
        out = self.model_dump(include=keys, exclude_none=True)
        return {**out, "content": None if self.content is None else text_of(self.content)}


class FunctionDef(Part):
    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


def _answers_calls(messages: Sequence[ChatMessage]) -> None:
    """Every ``tool`` message answers a call of an earlier assistant message (OpenAI's rule)."""
    calls: set[str] = set()
    for i, m in enumerate(messages):
        calls.update(c.id for c in m.tool_calls or ())
        if m.role == "tool" and m.tool_call_id not in calls:
            raise _refuse(
                f"messages[{i}].tool_call_id",
                f"messages[{i}] answers tool call {shown(m.tool_call_id, 'an id')}, which no"
                " earlier assistant message made",
            )


class ChatTool(Part):
    type: Literal["function"]
    function: FunctionDef


class NamedFunction(Part):
    name: str


class ChatToolChoice(Part):
    type: Literal["function"]
    function: NamedFunction


ChatChoice = Annotated[Union[_MODE, Annotated[ChatToolChoice, Tag("@named")]], _CHOICE]  # noqa: UP007


class JsonSchemaFormat(Part):
    name: Annotated[str, Field(min_length=1, max_length=64)]
    description: str | None = None
    schema_: dict[str, Any] = Field(default_factory=dict, alias="schema")
    strict: bool | None = None


def _one(value: Any) -> Any:
    if type(value) is not int or value != 1:  # 1.0 and True are not the integer 1
        raise PydanticCustomError(
            "n", "must be 1 (one session per choice: send one request per choice)"
        )
    return value


def _text_only(value: Any) -> Any:
    if value != ["text"]:
        raise PydanticCustomError("modalities", 'must be ["text"]: only text is supported')
    return value


class StreamOptions(Part):
    include_usage: bool | None = None


class ResponseFormat(Part):
    """``text``, ``json_object`` (any JSON object) or ``json_schema`` (the schema, by
    constrained decoding: strict or not, the output is generated to match it)."""

    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None

    @model_validator(mode="after")
    def _schema_given(self) -> ResponseFormat:
        if self.type == "json_schema" and self.json_schema is None:
            raise PydanticCustomError("json_schema", "json_schema needs its json_schema object")
        return self

    def constraint(self) -> Constraint | None:
        schema = None if self.json_schema is None else self.json_schema.schema_
        return format_constraint(self.type, schema)


_Stop = Annotated[str, Field(min_length=1)]


class ChatCompletionRequest(Request):
    """functions, function_call, logit_bias, audio, prediction and reasoning_effort are
    refused (400), not ignored; so is any field not listed here and not null
    (unknown_field), except user, service_tier, safety_identifier, prompt_cache_key and
    prompt_cache_retention, which change nothing."""

    unsupported = (
        "functions",
        "function_call",
        "logit_bias",
        "audio",
        "prediction",
        "reasoning_effort",
        "web_search_options",
    )

    messages: Annotated[list[ChatMessage], Field(min_length=1)]
    n: Annotated[Literal[1], BeforeValidator(_one)] | None = None
    max_completion_tokens: Annotated[int, Field(ge=1, le=MAX_OUTPUT)] | None = Field(
        None, description="max_tokens' newer name; it wins when both are given"
    )
    max_tokens: Annotated[int, Field(ge=1, le=MAX_OUTPUT)] | None = Field(
        None, description=f"default {DEFAULT_MAX_TOKENS}"
    )
    stop: (
        Annotated[
            Union[  # noqa: UP007
                Annotated[_Stop, Tag("@one")],
                Annotated[list[_Stop], Field(max_length=4), Tag("@list")],
            ],
            Discriminator(
                _kind((str, "@one"), (list, "@list")),
                custom_error_type="stop",
                custom_error_message="must be a non-empty string or an array of at most 4",
            ),
        ]
        | None
    ) = None
    logprobs: bool | None = None
    top_logprobs: TopLogprobs | None = None
    stream_options: StreamOptions | None = None
    response_format: ResponseFormat | None = None
    tools: Annotated[list[ChatTool], Field(max_length=128)] | None = None
    tool_choice: ChatChoice | None = None
    parallel_tool_calls: bool | None = None
    session_id: str | None = Field(
        None, description="extension: continue this session without resending history"
    )
    store: bool | None = Field(None, description="taken; every completion is recorded")
    modalities: (
        Annotated[
            list[Literal["text"]], Field(min_length=1, max_length=1), BeforeValidator(_text_only)
        ]
        | None
    ) = None

    @model_validator(mode="after")
    def _consistent(self) -> ChatCompletionRequest:
        if self.stream_options is not None and not self.stream:
            raise _refuse("stream_options", "stream_options is taken only with stream=true")
        if self.top_logprobs is not None and not self.logprobs:
            raise _refuse("top_logprobs", "top_logprobs needs logprobs=true")
        if self.session_id is None:  # (a continued session's calls are in its log)
            _answers_calls(self.messages)
        return self

    def turn(self) -> list[dict[str, Any]]:
        """The messages as the request records them."""
        return [m.to_json() for m in self.messages]

    def tool_list(self) -> list[Tool]:
        return [
            tool(t.function.name, t.function.description, t.function.parameters, t.function.strict)
            for t in self.tools or ()
        ]

    def choice(self) -> str:
        """``tool_choice`` as "auto", "none", "required" or a function's name (default:
        "auto" with tools, "none" without)."""
        c = self.tool_choice
        if c is None:
            return "auto" if self.tools else "none"
        return c if isinstance(c, str) else c.function.name

    def stops(self) -> list[str]:
        return [self.stop] if isinstance(self.stop, str) else list(self.stop or ())


# -- reading a body ----------------------------------------------------------------------


class UnknownParam(BadParam):
    """A field neither OpenAI's API nor this server knows (a typo, most often): refused, as OpenAI
    refuses it, rather than silently ignored."""

    code = "unknown_field"

    def __init__(self, names: Iterable[str]) -> None:
        names = sorted(names)
        super().__init__(names[0], f"Unrecognized request argument supplied: {', '.join(names)}")
        self.fields = names


#: OpenAI request fields that change nothing here, taken and dropped: an end-user id, a service
#: tier, caching and safety hints (a session caches by itself); parallel_tool_calls (a field of
#: the routes that take tools, dropped by those that do not)
NO_OPS = frozenset(
    {
        "user",
        "service_tier",
        "safety_identifier",
        "prompt_cache_key",
        "prompt_cache_retention",
        "parallel_tool_calls",
    }
)

R = TypeVar("R", bound=Request)


def check_fields(b: Mapping[str, Any], model: type[Request]) -> None:
    """Refuse a non-null field that is neither the model's, nor one it refuses by name, nor one of
    :data:`NO_OPS`."""
    unknown = {k for k, v in b.items() if v is not None} - set(model.model_fields)
    unknown -= NO_OPS | set(model.unsupported)
    if unknown:
        raise UnknownParam(unknown)


def parse(model: type[R], b: Mapping[str, Any]) -> R:
    """The body as ``model``: unsupported features refused, then every field validated."""
    for name in model.unsupported:
        if b.get(name) not in (None, [], {}, 0, 0.0, "auto", "none", False):
            raise BadParam(name, f"{name} is not supported by this server")
    fields = model.model_fields
    try:
        return model.model_validate({k: v for k, v in b.items() if v is not None and k in fields})
    except ValidationError as exc:
        error = exc.errors(include_url=False)[0]
        path, message = describe(error, "request body")
        raise BadParam(path or dict(error.get("ctx") or {}).get("param", ""), message) from None
