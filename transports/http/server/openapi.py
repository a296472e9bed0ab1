"""The OpenAPI description of the HTTP API (docs/protocols/http.md is the prose).

Request bodies are not written here: each route's schema is its model's (:data:`BODIES`, from
:mod:`..native.bodies` and :mod:`..openai.bodies`, which also validate them), so the document and
the validation cannot drift apart. Paths, parameters and responses are written by hand.
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel
from pydantic.json_schema import models_json_schema

from sessiontape.transports.http.native import bodies as rb
from sessiontape.transports.http.openai import bodies as openai_bodies
from sessiontape.transports.http.openai import schema as openai_schema

#: the body each route takes, by (path, method): the document's schema for it is the model's
BODIES: dict[tuple[str, str], type[BaseModel]] = {
    ("/v1/sessions", "post"): rb.CreateSession,
    ("/v1/sessions/{sid}/append", "post"): rb.Append,
    ("/v1/sessions/{sid}/generate", "post"): rb.Generate,
    ("/v1/sessions/{sid}/fork", "post"): rb.Fork,
    ("/v1/sessions/{sid}/close", "post"): rb.Close,
    ("/v1/sessions/{sid}/feedback", "post"): rb.Feedback,
    ("/v1/responses", "post"): openai_bodies.ResponseCreateRequest,
    ("/v1/chat/completions", "post"): openai_bodies.ChatCompletionRequest,
}

_ERROR = {"$ref": "#/components/schemas/Error"}
_DOC = {"$ref": "#/components/schemas/SessionDocument"}
_INT = {"type": "integer"}
_STR = {"type": "string"}
_BOOL = {"type": "boolean"}
_BYTES = {"type": "string", "format": "binary"}


def _json(schema: dict[str, Any], desc: str = "OK") -> dict[str, Any]:
    return {"description": desc, "content": {"application/json": {"schema": schema}}}


def _sse(desc: str) -> dict[str, Any]:
    return {"description": desc, "content": {"text/event-stream": {"schema": _STR}}}


def _obj(**props: Any) -> dict[str, Any]:
    return {"type": "object", "properties": props}


_ERRORS = {
    "400": _json(_ERROR, "invalid argument"),
    "401": _json(_ERROR, "missing or wrong bearer token"),
    "404": _json(_ERROR, "unknown session (or image, or node)"),
    "409": _json(_ERROR, "failed precondition or busy"),
}
_SID: dict[str, Any] = {"name": "sid", "in": "path", "required": True, "schema": _STR}
_PATCH: dict[str, Any] = {
    "name": "patch",
    "in": "query",
    "schema": {"type": "string", "enum": ["plus", "rfc6902"]},
    "description": "rfc6902 rewrites append ops as replace/add",
}

#: the error statuses each native route answers (each is produced in tests/transports/http/test_openapi.py);
#: a route not listed here documents all four of ``_ERRORS``
_ERRORS_OF: dict[tuple[str, str], tuple[str, ...]] = {
    ("/v1/sessions", "post"): ("400", "401"),
    ("/v1/sessions", "get"): ("400", "401"),
    ("/v1/sessions/events", "get"): ("400", "401"),
    ("/v1/sessions/{sid}", "get"): ("400", "401", "404"),
    ("/v1/sessions/{sid}/events", "get"): ("400", "401", "404"),
    ("/v1/sessions/{sid}/append", "post"): ("400", "401", "404", "409"),
    ("/v1/sessions/{sid}/generate", "post"): ("400", "401", "404", "409"),
    ("/v1/sessions/{sid}/fork", "post"): ("400", "401", "404"),
    ("/v1/sessions/{sid}/close", "post"): ("400", "401", "404"),
    ("/v1/sessions/{sid}/feedback", "post"): ("400", "401", "404"),
    ("/v1/sessions/{sid}/export", "get"): ("401", "404"),
    ("/v1/sessions/{sid}/audit", "get"): ("401", "404"),
    ("/v1/sessions/{sid}/replay", "get"): ("401", "404"),
    ("/v1/sessions/{sid}/images/{sha}", "get"): ("401", "404"),
    ("/v1/sessions/{sid}/nodes/{nid}/content", "get"): ("401", "404"),
}


def _op(
    path: str,
    method: str,
    summary: str,
    responses: dict[str, Any],
    *,
    params: list[dict[str, Any]] | None = None,
) -> dict[str, Any]:
    """A native route, with the errors ``_ERRORS_OF`` gives it."""
    errors = {k: v for k, v in _ERRORS.items() if k in _ERRORS_OF.get((path, method), _ERRORS)}
    op: dict[str, Any] = {"summary": summary, "responses": {**responses, **errors}}
    if params:
        op["parameters"] = params
    return op


def request_body(model: type[BaseModel]) -> dict[str, Any]:
    """A route's ``requestBody``: an OpenAI route's by reference into ``components/schemas`` (and
    required); a native one's inline (an empty body is ``{}``)."""
    if issubclass(model, openai_bodies.Request):
        return {
            "required": True,
            "content": {
                "application/json": {"schema": {"$ref": rb.REF.format(model=model.__name__)}}
            },
        }
    return {"content": {"application/json": {"schema": rb.schema_of(model)}}}


def request_schemas() -> dict[str, Any]:
    """``components/schemas`` of the bodies given by reference: the OpenAI routes', their parts."""
    models = [m for m in BODIES.values() if issubclass(m, openai_bodies.Request)]
    _, defs = models_json_schema(
        [(m, "validation") for m in models], ref_template=rb.REF, schema_generator=rb.Schema
    )
    return dict(defs["$defs"])


def spec() -> dict[str, Any]:
    schemas = {
        "Error": _obj(error=_obj(code=_STR, message=_STR)),
        "SessionDocument": {
            "type": "object",
            "description": "docs/protocols/session-document.md",
        },
        **openai_schema.SCHEMAS,
    }
    requests = request_schemas()
    assert not set(requests) & set(schemas), "a request model named as a response schema"
    paths = {**_site(), **_sessions(), **_writes(), **_reads(), **openai_schema.paths()}
    for (path, method), model in BODIES.items():
        paths[path][method]["requestBody"] = request_body(model)
    return {
        "openapi": "3.1.0",
        "info": {"title": "sessiontape HTTP API", "version": "1"},
        "components": {
            "securitySchemes": {"bearer": {"type": "http", "scheme": "bearer"}},
            "schemas": {**schemas, **requests},
        },
        "security": [{"bearer": []}],
        "paths": paths,
    }


def _site() -> dict[str, Any]:
    """The routes without a token: the viewer, this document, health, metrics."""

    def public(summary: str, responses: dict[str, Any], **more: Any) -> dict[str, Any]:
        return {"get": {"summary": summary, "security": [], **more, "responses": responses}}

    return {
        "/": public(
            "the replay viewer (an HTML page; see docs/protocols/http.md, Viewer)",
            {"200": {"description": "the viewer", "content": {"text/html": {"schema": _STR}}}},
        ),
        "/static/{path}": public(
            "the viewer's scripts and styles",
            {
                "200": {"description": "a static file (text/javascript, text/css, ...)"},
                "404": {"description": "no such file"},
            },
            parameters=[{"name": "path", "in": "path", "required": True, "schema": _STR}],
        ),
        "/openapi.json": public(
            "this document", {"200": _json({"type": "object"}, "the OpenAPI 3.1 description")}
        ),
        "/healthz": public(
            "liveness",
            {
                "200": _json(_obj(status=_STR, engine=_STR)),
                "503": _json(
                    _obj(status=_STR, engine=_STR, error=_STR),
                    "the engine can serve nothing more (its worker process died)",
                ),
            },
        ),
        "/metrics": public(
            "Prometheus metrics", {"200": {"description": "text exposition format"}}
        ),
    }


def _sessions() -> dict[str, Any]:
    """Opening and listing sessions, a session's document, the SSE feeds."""
    query = [{"name": n, "in": "query", "schema": _STR} for n in ("status", "protocol", "parent")]
    query += [{"name": n, "in": "query", "schema": _INT} for n in ("limit", "offset")]
    return {
        "/v1/sessions": {
            "post": _op("/v1/sessions", "post", "open a session", {"201": _json(_DOC)}),
            "get": _op(
                "/v1/sessions",
                "get",
                "list sessions",
                {"200": _json(_obj(sessions={"type": "array"}))},
                params=query,
            ),
        },
        "/v1/sessions/events": {
            "get": _op(
                "/v1/sessions/events",
                "get",
                "SSE: the sessions list, snapshot then JSON Patch+",
                {"200": _sse("snapshot, patch events")},
                params=[_PATCH],
            )
        },
        "/v1/sessions/{sid}": {
            "get": _op(
                "/v1/sessions/{sid}",
                "get",
                "the session document",
                {"200": _json(_DOC)},
                params=[_SID, {"name": "version", "in": "query", "schema": _INT}],
            )
        },
        "/v1/sessions/{sid}/events": {
            "get": _op(
                "/v1/sessions/{sid}/events",
                "get",
                "SSE: snapshot then JSON Patch+ per committed event; id = log position",
                {"200": _sse("snapshot, patch, end events; ': ping' heartbeats")},
                params=[_SID, _PATCH, {"name": "Last-Event-ID", "in": "header", "schema": _INT}],
            )
        },
    }


def _writes() -> dict[str, Any]:
    """The routes that change a session."""
    generated = {
        "200": {
            "description": "stream (default): text/event-stream, snapshot, patches, end; "
            "stream=false: JSON once the generation is done",
            "content": {
                "text/event-stream": {"schema": _STR},
                "application/json": {
                    "schema": _obj(
                        session_id=_STR,
                        version=_INT,
                        generation={
                            "type": "object",
                            "description": "the document's generations[] entry",
                        },
                    )
                },
            },
        },
        "202": _json(
            _obj(session_id=_STR, generation_id={"type": ["string", "null"]}),
            "background=true: started",
        ),
    }
    ops = {
        "append": ("append text or tokens", {"200": _json(_obj(length=_INT, version=_INT))}),
        "generate": (
            "generate: an SSE stream of patches (default), JSON (stream=false) or 202 "
            "(background=true)",
            generated,
        ),
        "fork": ("fork at a token position or event version", {"201": _json(_DOC)}),
        "close": (
            "close; the document, or with Prefer: return=minimal its id, status and version",
            {
                "200": _json(
                    {"oneOf": [_DOC, _obj(id=_STR, status=_STR, version=_INT)]},
                    "the closed session's document, or (return=minimal) its id, status, version",
                )
            },
        ),
        "feedback": ("record feedback", {"201": _json(_obj(version=_INT))}),
    }
    out: dict[str, Any] = {}
    for name, (summary, responses) in ops.items():
        path = f"/v1/sessions/{{sid}}/{name}"
        params: list[dict[str, Any]] = [_SID, _PATCH] if name == "generate" else [_SID]
        if name == "close":
            params.append({"name": "Prefer", "in": "header", "schema": _STR})
        out[path] = {"post": _op(path, "post", summary, responses, params=params)}
    return out


def _reads() -> dict[str, Any]:
    """A session's log as NDJSON, its audit, its replay, its images and node contents."""
    sha = {
        "name": "sha",
        "in": "path",
        "required": True,
        "schema": {"type": "string", "pattern": "^[0-9a-f]{64}$"},
    }
    nid = {"name": "nid", "in": "path", "required": True, "schema": _STR}
    audit = _obj(
        session_id=_STR,
        chain_ok=_BOOL,
        invariants_ok=_BOOL,
        problems={"type": "array", "items": _STR},
        ok=_BOOL,
    )
    image = {"image/*": {"schema": _BYTES}, "application/octet-stream": {"schema": _BYTES}}
    ops: list[tuple[str, str, dict[str, Any], list[dict[str, Any]]]] = [
        (
            "/v1/sessions/{sid}/export",
            "the session's events as NDJSON, one event per line (what `sessiontape import` reads)",
            {
                "200": {
                    "description": "attachment; filename=ID.ndjson",
                    "content": {"application/x-ndjson": {"schema": _STR}},
                }
            },
            [_SID],
        ),
        (
            "/v1/sessions/{sid}/audit",
            "verify the hash chain and the fold's invariants (sessiontape.core.audit.audit_session)",
            {"200": _json(audit)},
            [_SID],
        ),
        (
            "/v1/sessions/{sid}/replay",
            "base document and one patch per event (the scrubber)",
            {"200": _json(_obj(base=_DOC, steps={"type": "array"}))},
            [_SID],
        ),
        (
            "/v1/sessions/{sid}/images/{sha}",
            "an attached image's bytes, by sha256, with its recorded MIME type",
            {"200": {"description": "the image", "content": image}},
            [_SID, sha],
        ),
        (
            "/v1/sessions/{sid}/nodes/{nid}/content",
            "a leaf node's chunk bytes (Evergreen), with the chunk's mimetype",
            {"200": {"description": "the chunk", "content": {"*/*": {"schema": _BYTES}}}},
            [_SID, nid],
        ),
    ]
    return {
        path: {"get": _op(path, "get", summary, responses, params=params)}
        for path, summary, responses, params in ops
    }
