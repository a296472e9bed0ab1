"""Request bodies are declared once, as models: the OpenAPI document's request schemas are the models'
(so the two cannot drift), every route validates through its model, and a body that breaks its
model (a wrong type, a string or a boolean for an integer, a missing required field, an unknown
field) is a typed 400 naming the field that leaves every stored session as it was.
"""

from __future__ import annotations

import json
import string
from typing import Any, get_args

import pytest
from hypothesis import given
from hypothesis import strategies as st
from openapi_schema_validator import OAS31Validator
from pydantic import BaseModel

from sessiontape.core.errors import SessiontapeError
from sessiontape.transports.http.native import bodies as rb
from sessiontape.transports.http.openai import bodies as openai_bodies
from sessiontape.transports.http.openai.chat_template import ROLES
from sessiontape.transports.http.server.openapi import BODIES, spec
from tests.helpers.fuzz import fuzz_settings
from tests.helpers.http_fuzz import Fuzzed, stored

SPEC = spec()
MODEL = "reference-bigram-v1"
#: a valid body per route, which each example breaks in one way
VALID: dict[str, dict[str, Any]] = {
    "/v1/sessions": {"label": "x"},
    "/v1/sessions/{sid}/append": {"text": "x"},
    "/v1/sessions/{sid}/generate": {"max_tokens": 1, "stream": False},
    "/v1/sessions/{sid}/fork": {"at_position": 1},
    "/v1/sessions/{sid}/close": {"reason": "x"},
    "/v1/sessions/{sid}/feedback": {"score": 1},
    "/v1/responses": {"model": MODEL, "input": "x", "max_output_tokens": 1},
    "/v1/chat/completions": {
        "model": MODEL,
        "messages": [{"role": "user", "content": "x"}],
        "max_tokens": 1,
    },
}
#: a value of each JSON kind (1.0 is a number, not an integer: the strict parser reads it as a float)
SAMPLES: dict[str, list[Any]] = {
    "integer": [1, 7, 2**40],
    "number": [1.5, 1.0, 0.25],
    "string": ["1", "x", "true"],
    "boolean": [True, False],
    "array": [[1], [], ["x"]],
    "object": [{"a": 1}, {}],
    "null": [None],
}
ROUTES = sorted(BODIES)
IDS = [f"{m.upper()} {p}" for p, m in ROUTES]


def _schema(path: str, method: str) -> dict[str, Any]:
    schema = SPEC["paths"][path][method]["requestBody"]["content"]["application/json"]["schema"]
    return _resolve(schema)


def _resolve(schema: dict[str, Any]) -> dict[str, Any]:
    ref = schema.get("$ref")
    if ref is None:
        return schema
    resolved: dict[str, Any] = SPEC["components"]["schemas"][ref.rsplit("/", 1)[1]]
    return resolved


# -- the document is the models -------------------------------------------------------------


@pytest.mark.parametrize(("path", "method"), ROUTES, ids=IDS)
def test_the_documented_body_is_the_models(path: str, method: str) -> None:
    model = BODIES[(path, method)]
    own = rb.schema_of(model)
    defs = own.pop("$defs", {})
    assert _schema(path, method) == own
    for name, schema in defs.items():  # nested models: in components, as the model has them
        assert SPEC["components"]["schemas"][name] == schema, name
    OAS31Validator.check_schema(own)


def test_every_body_the_document_describes_has_a_model() -> None:
    with_body = {
        (p, m) for p, ops in SPEC["paths"].items() for m, op in ops.items() if "requestBody" in op
    }
    assert with_body == set(BODIES)
    posts = {(p, m) for p, ops in SPEC["paths"].items() for m in ops if m == "post"}
    assert posts - set(BODIES) == {("/v1/responses/{rid}/cancel", "post")}  # takes no body
    assert set(VALID) == {p for p, _ in BODIES}
    for (path, _), model in BODIES.items():
        model.model_validate(VALID[path])  # the examples below start from a valid body


def test_roles_are_the_chat_templates() -> None:
    assert get_args(openai_bodies.Role) == ROLES


# -- what a refusal says ---------------------------------------------------------------------


@pytest.mark.parametrize(
    ("model", "body", "code", "message"),
    [
        (rb.Fork, {"at_position": "1"}, "invalid_parameters", "at_position must be a JSON integer, got a string ('1')"),
        (rb.Fork, {"at_version": True}, "invalid_parameters", "at_version must be a JSON integer, got a boolean (true)"),
        (rb.Append, {"tokens": [1, "2"]}, "invalid_parameters", "tokens[1] must be a JSON integer, got a string ('2')"),
        (rb.Append, {"text": None}, "invalid_parameters", "text must be a string"),
        (rb.Append, {}, "invalid_parameters", "append needs 'text' or 'tokens'"),
        (rb.Append, {"text": "a", "tokens": [1]}, "invalid_parameters", "text and tokens cannot be combined"),
        (rb.Generate, {"top_p": 0}, "invalid_parameters", "top_p must be greater than 0, got 0"),
        (rb.Generate, {"logprob_ranges": [[1]]}, "invalid_parameters", "logprob_ranges[0] must hold 2 items"),
        (rb.Generate, {"seed": "\uff11"}, "invalid_parameters", "seed must be an integer in [0, 2**64) or a string of its ASCII digits"),
        (rb.Generate, {"stop_token_ids": None}, "invalid_parameters", "stop_token_ids must be an array"),
        (rb.CreateSession, {"ttl_s": 1e12}, "invalid_parameters", "ttl_s must be at most 315360000, got 1000000000000"),
        (rb.CreateSession, {"meta": []}, "invalid_parameters", "meta must be an object"),
        (rb.Feedback, {}, "invalid_parameters", "feedback must not be empty"),
        (rb.Close, {"reason": "x", "force": True}, "unknown_field", "unknown field(s) 'force'; this route takes reason"),
    ],
)  # fmt: skip
def test_a_refusal_names_the_field_and_what_it_must_be(
    model: type[BaseModel], body: dict[str, Any], code: str, message: str
) -> None:
    with pytest.raises(SessiontapeError) as refused:
        rb.validate(model, body)
    assert (refused.value.code, refused.value.message) == (code, message)


@pytest.mark.parametrize(
    ("model", "body", "param", "message"),
    [
        (openai_bodies.ChatCompletionRequest, {"n": 2}, "n", "n must be 1 (one session per choice: send one request per choice)"),
        (openai_bodies.ChatCompletionRequest, {"messages": [{"role": "bot", "content": "x"}]}, "messages[0].role", "messages[0].role must be 'system', 'developer', 'user', 'assistant' or 'tool'"),
        (openai_bodies.ChatCompletionRequest, {"top_logprobs": 2}, "top_logprobs", "top_logprobs needs logprobs=true"),
        (openai_bodies.ChatCompletionRequest, {"metadata": {"k" * 65: "v"}}, "metadata", "metadata keys must be at most 64 characters, got 65"),
        (openai_bodies.ChatCompletionRequest, {"tools": [{"type": "function"}]}, "tools[0].function", "tools[0].function is required"),
        (openai_bodies.ChatCompletionRequest, {"functions": [{"name": "f"}]}, "functions", "functions is not supported by this server"),
        (openai_bodies.ChatCompletionRequest, {"messages": [{"role": "tool", "content": "x"}]}, "messages[0]", "messages[0] a tool message needs its tool_call_id"),
        # (found by fuzzing: a result for a call no message made was recorded)
        (openai_bodies.ChatCompletionRequest, {"messages": [{"role": "assistant", "tool_calls": [{"id": "c1", "function": {"name": "f", "arguments": "{}"}}]}, {"role": "tool", "tool_call_id": "c2", "content": "x"}]}, "messages[1].tool_call_id", "messages[1] answers tool call 'c2', which no earlier assistant message made"),
        (openai_bodies.ResponseCreateRequest, {"input": 5}, "input", "input must be a string or a non-empty array of messages"),
        (openai_bodies.ResponseCreateRequest, {"input": [{"type": "function_call_output", "call_id": "c2", "output": "x"}]}, "input[0].call_id", "input[0] answers call 'c2', which no earlier function_call item made"),
        (openai_bodies.ResponseCreateRequest, {"text": {"format": {"type": "json_schema"}}}, "text.format", "text.format a json_schema format needs its schema"),
        (openai_bodies.ResponseCreateRequest, {"background": True, "store": False}, "background", "background responses need store=true"),
    ],
)  # fmt: skip
def test_an_openai_refusal_names_its_param(
    model: type[openai_bodies.Request], body: dict[str, Any], param: str, message: str
) -> None:
    path = (
        "/v1/chat/completions" if model is openai_bodies.ChatCompletionRequest else "/v1/responses"
    )
    with pytest.raises(openai_bodies.BadParam) as refused:
        openai_bodies.parse(model, {**VALID[path], **body})
    assert (refused.value.param, refused.value.message) == (param, message)


# -- a broken body, over HTTP ----------------------------------------------------------------


def kinds(schema: dict[str, Any]) -> set[str]:
    """The JSON kinds a schema takes (``number`` takes integers too)."""
    schema = _resolve(schema)
    if "oneOf" in schema or "anyOf" in schema:
        return set().union(*(kinds(s) for s in schema.get("oneOf", schema.get("anyOf", []))))
    t = schema.get("type")
    if t is None:
        return set(SAMPLES)
    out = {t} if isinstance(t, str) else set(t)
    return out | {"integer"} if "number" in out else out


def _openai(path: str) -> bool:
    return issubclass(BODIES[(path, "post")], openai_bodies.Request)


@st.composite
def broken(draw: Any, path: str) -> tuple[dict[str, Any], str, str]:
    """(a body, the field it breaks, how: ``type``, ``missing`` or ``unknown``)."""
    schema = _schema(path, "post")
    body = dict(VALID[path])
    props: dict[str, Any] = schema.get("properties", {})
    openai = _openai(path)
    ways = ["unknown"] if schema.get("additionalProperties") is not True else []
    ways += ["type"] * 3 if props else []
    ways += ["missing"] if schema.get("required") else []
    if not ways:  # a free-form object (feedback): only its emptiness is wrong
        return {}, "", "empty"
    way = draw(st.sampled_from(ways))
    if way == "missing":
        name = draw(st.sampled_from(schema["required"]))
        del body[name]
        return body, name, way
    if way == "unknown":
        taken = set(props) | (
            openai_bodies.NO_OPS | set(BODIES[(path, "post")].unsupported) if openai else set()
        )
        letters = st.text(string.ascii_lowercase + "_", min_size=1, max_size=10)
        name = draw(letters.filter(lambda n: n not in taken))
        body[name] = draw(st.sampled_from([1, "x", True, [1], {"a": 1}]))
        return body, name, way
    name = draw(st.sampled_from(sorted(props)))
    wrong = sorted(set(SAMPLES) - kinds(props[name]) - ({"null"} if openai else set()))
    if not wrong:
        wrong = ["null"]
    body[name] = draw(st.sampled_from(SAMPLES[draw(st.sampled_from(wrong))]))
    return body, name, way


@pytest.mark.parametrize("path", [p for p, _ in ROUTES])
@fuzz_settings(40)
@given(data=st.data())
async def test_a_broken_body_is_a_typed_400_naming_its_field_and_changes_nothing(
    fuzzed: Fuzzed,
    path: str,
    data: Any,
) -> None:
    body, name, way = data.draw(broken(path))
    before = await stored(fuzzed)
    url = path.replace("{sid}", fuzzed.sids[0])
    r = await fuzzed.client.post(
        url, content=json.dumps(body), headers={"content-type": "application/json"}
    )
    assert r.status_code == 400, (body, r.text)
    error = r.json()["error"]
    assert error["code"] == ("unknown_field" if way == "unknown" else "invalid_parameters"), error
    if _openai(path):
        assert error["type"] == "invalid_request_error"
        assert str(error["param"]).startswith(name), (body, error)
    elif way == "unknown":
        assert error["fields"] == [name]
        taken = ", ".join(sorted(BODIES[(path, "post")].model_fields))
        assert error["message"].endswith(f"this route takes {taken}")
    elif way == "type":
        assert error["message"].startswith(name), (body, error)
    assert await stored(fuzzed) == before, (body, r.text)
