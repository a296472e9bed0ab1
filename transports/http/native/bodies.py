"""The native routes' request bodies, declared once: each is a strict pydantic model, from which both
the route's validation and its schema in the OpenAPI document (:mod:`..server.openapi`) come.

Strict means: a JSON integer is a JSON integer (``"1"``,
``true`` and ``1.0`` are refused, not converted), a number is finite, a string is a string, and a
field the model does not name is refused by name (400 ``unknown_field``). A field left out takes its
default; one typed ``X | None`` takes ``null`` as "left out" too, while ``null`` for any other
(``meta``, ``stop_token_ids``, and ``text`` and ``tokens``, which say ``NotNull``) is refused.

A refusal is a core error (:func:`validate`): ``UnknownFields`` for unknown names, else
``InvalidParameters`` whose message names the field's path and what it must be. The OpenAI routes'
bodies (:mod:`..openai.bodies`) are models too, refused with the same messages and OpenAI's ``param``.

Usage in a handler::

    b = validate(Generate, await inputs.body(request, limits))
    params, options = b.sampling()
"""

from __future__ import annotations

import re
from collections.abc import Callable, Collection, Mapping
from typing import Annotated, Any, ClassVar, TypeVar, Union, get_args

from pydantic import (
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    GetCoreSchemaHandler,
    RootModel,
    ValidationError,
    WithJsonSchema,
    model_validator,
)
from pydantic.json_schema import GenerateJsonSchema, JsonSchemaValue
from pydantic_core import CoreSchema, ErrorDetails, PydanticCustomError, core_schema
from pydantic_core.core_schema import ErrorType

from sessiontape.core.engine.interface import (
    MAX_TOKENS_LIMIT,
    OutputOptions,
    SamplingParams,
    left_to_model,
)
from sessiontape.core.errors import InvalidArgument, InvalidParameters

INT64 = (-(2**63), 2**63 - 1)
#: the sessions index's column sizes (core/log/schema.py): longer values are refused here, as 400s
MAX_PROTOCOL = 32
MAX_LABEL = 1000
MAX_REASON = 1000
#: ten years: a longer idle TTL is a mistake, not a policy
MAX_TTL_S = 10 * 365 * 86400.0


# -- declaring fields ----------------------------------------------------------------


#: JSON integers: any 64-bit one, one >= 0 (token ids, positions), one >= 1 (versions)
Int64 = Annotated[int, Field(ge=INT64[0], le=INT64[1])]
NonNegative = Annotated[int, Field(ge=0, le=INT64[1])]
Positive = Annotated[int, Field(ge=1, le=INT64[1])]
Protocol = Annotated[str, Field(max_length=MAX_PROTOCOL)]
Label = Annotated[str, Field(max_length=MAX_LABEL)]


class NotNull:
    """For ``Annotated[X | None, NotNull()] = None``: the field may be left out (``None``), but
    ``null`` sent for it is refused as not an X; its schema is X's, without ``null``."""

    def __get_pydantic_core_schema__(
        self, source: Any, handler: GetCoreSchemaHandler
    ) -> CoreSchema:
        kept = tuple(a for a in get_args(source) if a is not type(None))
        return handler.generate_schema(kept[0] if len(kept) == 1 else Union[kept])  # noqa: UP007


def _seed(value: Any) -> Any:
    if isinstance(value, str):
        if not re.fullmatch(r"[0-9]{1,20}", value.strip()):
            raise PydanticCustomError(
                "seed", "must be an integer in [0, 2**64) or a string of its ASCII digits"
            )
        return int(value.strip())
    return value


#: a seed is in [0, 2**64): a JSON integer, or a string of its digits (JSON numbers are exact only
#: up to 2**53, and some clients cannot write larger integers)
Seed = Annotated[
    int,
    Field(ge=0, le=2**64 - 1),
    BeforeValidator(_seed),
    WithJsonSchema(
        {
            "oneOf": [
                {"type": "integer", "minimum": 0, "maximum": 2**64 - 1},
                {"type": "string", "pattern": "^[0-9]{1,20}$"},
            ]
        }
    ),
]
#: a half-open ``[start, end]`` pair of token positions (start <= end is the runtime's check)
Range = Annotated[list[NonNegative], Field(min_length=2, max_length=2)]


class Body(BaseModel):
    """A request body: strict types, no unknown fields."""

    model_config = ConfigDict(strict=True, extra="forbid", frozen=True, allow_inf_nan=False)
    #: what a refusal of the body as a whole calls it
    what: ClassVar[str] = "request body"


# -- the native bodies -----------------------------------------------------------------


class CreateSession(Body):
    """Open a session: its protocol, label, write mode, idle TTL in seconds, end-of-sequence
    token ids and free-form `meta` (at most `limits.max_meta_bytes` as JSON)."""

    protocol: Protocol | None = None
    label: Label | None = None
    mode: Annotated[str, Field(max_length=32)] | None = None
    ttl_s: Annotated[float, Field(gt=0, le=MAX_TTL_S)] | None = None
    eos_token_ids: list[NonNegative] | None = None
    meta: dict[str, Any] = Field(default_factory=dict)


class Append(Body):
    """Append `text` (tokenized by the engine) or `tokens`, one of them. With `offset`, only if
    the session is that long (`truncating`: cut it back to `offset` first)."""

    text: Annotated[str | None, NotNull()] = None
    tokens: Annotated[list[Int64] | None, NotNull()] = None
    offset: NonNegative | None = None
    truncating: bool | None = False

    @model_validator(mode="after")
    def _one_of_text_or_tokens(self) -> Append:
        if self.text is None and self.tokens is None:
            raise PydanticCustomError("text_or_tokens", "append needs 'text' or 'tokens'")
        if self.text is not None and self.tokens is not None:
            raise PydanticCustomError("text_or_tokens", "text and tokens cannot be combined")
        return self


_SAMPLING = SamplingParams()


class Generate(Body):
    """Generate, after appending `text` or `tokens` if given. `stream` (the default) answers
    with the session's SSE stream, `stream=false` with JSON once the generation is done,
    `background=true` with 202 at once."""

    max_tokens: Annotated[int, Field(ge=0, le=MAX_TOKENS_LIMIT)] | None = _SAMPLING.max_tokens
    #: unset (or null): the served model's recommendation, else 1 / 1 / 0
    temperature: Annotated[float, Field(ge=0, le=1e6)] | None = None
    top_p: Annotated[float, Field(gt=0, le=1)] | None = None
    top_k: NonNegative | None = None
    seed: Seed | None = None
    stop_token_ids: list[NonNegative] = Field(default_factory=list)
    #: unset: the served model's recommendation, else 1 / 0 / 64 (docs/engines.md)
    repetition_penalty: Annotated[float, Field(gt=0, le=1e6)] | None = None
    frequency_penalty: Annotated[float, Field(ge=-2, le=2)] | None = None
    presence_penalty: Annotated[float, Field(ge=-2, le=2)] | None = None
    min_p: Annotated[float, Field(ge=0, le=1)] | None = None
    penalty_last_n: Annotated[int, Field(ge=-1, lt=2**31)] | None = None
    logprob_top_k: Annotated[int, Field(ge=0, le=2**31)] | None = None
    logprob_ranges: list[Range] | None = None
    readout_ranges: list[Range] | None = None
    text: Annotated[str | None, NotNull()] = None
    tokens: Annotated[list[Int64] | None, NotNull()] = None
    stream: bool | None = True
    background: bool | None = False

    @model_validator(mode="after")
    def _text_or_tokens(self) -> Generate:
        if self.text is not None and self.tokens is not None:
            raise PydanticCustomError("text_or_tokens", "text and tokens cannot be combined")
        return self

    def sampling(self) -> tuple[SamplingParams, OutputOptions]:
        """The generation's parameters, defaulted (``SamplingParams.check`` passed)."""
        d = _SAMPLING  # for a field sent as null
        params = SamplingParams(
            max_tokens=d.max_tokens if self.max_tokens is None else self.max_tokens,
            temperature=d.temperature if self.temperature is None else self.temperature,
            top_p=d.top_p if self.top_p is None else self.top_p,
            top_k=d.top_k if self.top_k is None else self.top_k,
            seed=self.seed,
            stop_token_ids=tuple(self.stop_token_ids),
            repetition_penalty=(
                d.repetition_penalty if self.repetition_penalty is None else self.repetition_penalty
            ),
            frequency_penalty=self.frequency_penalty or 0.0,
            presence_penalty=self.presence_penalty or 0.0,
            min_p=d.min_p if self.min_p is None else self.min_p,
            penalty_last_n=d.penalty_last_n if self.penalty_last_n is None else self.penalty_last_n,
            from_model=left_to_model(
                temperature=self.temperature,
                top_p=self.top_p,
                top_k=self.top_k,
                repetition_penalty=self.repetition_penalty,
                min_p=self.min_p,
                penalty_last_n=self.penalty_last_n,
            ),
        )
        params.check()
        options = OutputOptions(
            logprob_top_k=self.logprob_top_k or 0,
            logprob_ranges=_pairs(self.logprob_ranges),
            readout_ranges=_pairs(self.readout_ranges),
        )
        return params, options

    @property
    def mode(self) -> str:
        """``background`` (202 at once), ``stream`` (the default) or ``json``."""
        if self.background:
            return "background"
        return "json" if self.stream is False else "stream"


def _pairs(ranges: list[list[int]] | None) -> tuple[tuple[int, int], ...]:
    return tuple((a, b) for a, b in ranges or ())


class Fork(Body):
    """Fork at a token position (`at_position`) or an event version (`at_version`)."""

    at_position: NonNegative | None = None
    at_version: Positive | None = None
    label: Label | None = None
    protocol: Protocol | None = None


class Close(Body):
    """Close the session; `reason` is recorded (`client` when none is given)."""

    reason: Annotated[str, Field(max_length=MAX_REASON)] | None = None


class Feedback(RootModel[Annotated[dict[str, Any], Field(min_length=1)]]):
    """Any non-empty JSON object, recorded as given (at most `limits.max_meta_bytes` as JSON)."""

    model_config = ConfigDict(strict=True, frozen=True, allow_inf_nan=False)
    what: ClassVar[str] = "feedback"


# -- refusals --------------------------------------------------------------------------


class UnknownFields(InvalidArgument):
    code = "unknown_field"

    def __init__(self, fields: Collection[str], allowed: Collection[str]) -> None:
        names = ", ".join(sorted(repr(f) for f in fields))
        super().__init__(
            f"unknown field(s) {names}; this route takes {', '.join(sorted(allowed)) or 'no fields'}"
        )
        self.fields = sorted(fields)


M = TypeVar("M", bound=BaseModel)


def validate(model: type[M], value: Mapping[str, Any]) -> M:
    """``value`` as ``model``, or the core error naming what is wrong with it."""
    try:
        return model.model_validate(value)
    except ValidationError as exc:
        errors = exc.errors(include_url=False, include_context=True)
        unknown = [str(e["loc"][0]) for e in errors if e["type"] == "extra_forbidden"]
        if unknown:
            raise UnknownFields(unknown, model.model_fields) from None
        _, message = describe(errors[0], getattr(model, "what", "request body"))
        raise InvalidParameters(message) from None


def path_of(loc: tuple[int | str, ...]) -> str:
    """``("messages", 0, "role")`` as ``messages[0].role``; union tags (``@...``) are left out."""
    out = ""
    for part in loc:
        if isinstance(part, int):
            out += f"[{part}]"
        elif not part.startswith("@"):
            out += f".{part}" if out else part
    return out


def describe(error: ErrorDetails, what: str) -> tuple[str, str]:
    """(the field's path, a message naming it and what it must be) for one pydantic error;
    ``what`` names the body itself."""
    loc = error["loc"]
    key = "[key]" in loc  # a mapping's key, not its value: name the mapping
    if key:
        loc = loc[: loc.index("[key]") - 1]
    path = path_of(loc)
    predicate = _predicate(error)
    if predicate is None:  # a check of our own (PydanticCustomError): its message
        if not path:  # a model's check across its fields: a sentence of its own
            return path, error["msg"]
        predicate = error["msg"]
    return path, f"{path + ' keys' if key else path or what} {predicate}"


def _predicate(error: ErrorDetails) -> str | None:
    kind = error["type"]
    ctx: dict[str, Any] = dict(error.get("ctx") or {})
    got = error.get("input")
    if kind in _MESSAGES:
        return _MESSAGES[kind](ctx, got)
    if kind in _BOUNDS:
        word, key = _BOUNDS[kind]
        return f"must be {word} {_num(ctx[key])}, got {_num(got)}"
    if kind in _BUILTIN:  # one of pydantic's own that no model here is meant to produce
        return f"is invalid ({error['msg']})"
    return None


def _num(value: Any) -> str:
    if isinstance(value, float) and value.is_integer() and abs(value) < 1e16:
        return str(int(value))
    return f"{value:g}" if isinstance(value, float) else repr(value)


def json_kind(value: Any) -> str:
    """What a JSON value is, in words, for a message."""
    if isinstance(value, str):
        return f"a string ({value[:40]!r})"
    if isinstance(value, bool):
        return f"a boolean ({'true' if value else 'false'})"
    if isinstance(value, float):
        return f"a number with a fraction or exponent ({value!r})"
    if isinstance(value, list):
        return "an array"
    if value is None:
        return "null"
    return "an object" if isinstance(value, dict) else type(value).__name__


_Predicate = Callable[[dict[str, Any], Any], str]
_MESSAGES: dict[str, _Predicate] = {
    "int_type": lambda _, got: f"must be a JSON integer, got {json_kind(got)}",
    "float_type": lambda _, got: "must be a finite number",
    "finite_number": lambda _, got: "must be a finite number",
    "string_type": lambda _, got: "must be a string",
    "bool_type": lambda _, got: "must be true or false",
    "list_type": lambda _, got: "must be an array",
    "dict_type": lambda _, got: "must be an object",
    "model_type": lambda _, got: "must be an object",
    "missing": lambda _, got: "is required",
    "literal_error": lambda ctx, got: f"must be {ctx['expected']}",
    "string_too_long": lambda ctx, got: (
        f"must be at most {ctx['max_length']} characters, got {len(got)}"
    ),
    "string_too_short": lambda ctx, got: (
        "must not be empty"
        if ctx["min_length"] == 1
        else f"must be at least {ctx['min_length']} characters"
    ),
    "too_long": lambda ctx, got: f"must hold at most {ctx['max_length']} items",
    "too_short": lambda ctx, got: (
        "must not be empty" if ctx["min_length"] == 1 else f"must hold {ctx['min_length']} items"
    ),
    "string_pattern_mismatch": lambda ctx, got: f"must match {ctx['pattern']}",
}
_BOUNDS = {
    "greater_than_equal": ("at least", "ge"),
    "greater_than": ("greater than", "gt"),
    "less_than_equal": ("at most", "le"),
    "less_than": ("less than", "lt"),
}
_BUILTIN = frozenset(get_args(ErrorType))


# -- schemas ---------------------------------------------------------------------------


class Schema(GenerateJsonSchema):
    """JSON Schema as the OpenAPI document shows it: no generated titles, ``null`` folded into
    ``type`` where it can be, and no ``"default": null`` (absent and null mean the same)."""

    def field_title_should_be_set(self, schema: Any) -> bool:
        return False

    def nullable_schema(self, schema: core_schema.NullableSchema) -> JsonSchemaValue:
        inner = self.generate_inner(schema["schema"])
        if isinstance(inner.get("type"), str) and not {"const", "enum"} & set(inner):
            return {**inner, "type": [inner["type"], "null"]}
        if set(inner) == {"oneOf"}:
            return {"oneOf": [*inner["oneOf"], {"type": "null"}]}
        return {"anyOf": [inner, {"type": "null"}]}

    def default_schema(self, schema: core_schema.WithDefaultSchema) -> JsonSchemaValue:
        if schema.get("default", ...) is None:
            return self.generate_inner(schema["schema"])
        return super().default_schema(schema)


REF = "#/components/schemas/{model}"


def schema_of(model: type[BaseModel]) -> dict[str, Any]:
    """The model's JSON Schema; nested models as ``$ref`` into ``components/schemas``."""
    return model.model_json_schema(ref_template=REF, schema_generator=Schema)
