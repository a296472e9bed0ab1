"""The OpenAPI description of the HTTP API (hand-written; docs/protocols/http.md is the prose)."""

from __future__ import annotations

from typing import Any

from sessiontape.transports.sse import openai_schema

_ERROR = {"$ref": "#/components/schemas/Error"}
_DOC = {"$ref": "#/components/schemas/SessionDocument"}


def _json(schema: dict[str, Any], desc: str = "OK") -> dict[str, Any]:
    return {"description": desc, "content": {"application/json": {"schema": schema}}}


def _sse(desc: str) -> dict[str, Any]:
    return {"description": desc, "content": {"text/event-stream": {"schema": {"type": "string"}}}}


_ERRORS = {
    "400": _json(_ERROR, "invalid argument"),
    "401": _json(_ERROR, "missing or wrong bearer token"),
    "404": _json(_ERROR, "unknown session (or image, or node)"),
    "409": _json(_ERROR, "failed precondition or busy"),
}
_SID = {"name": "sid", "in": "path", "required": True, "schema": {"type": "string"}}
_PATCH = {
    "name": "patch",
    "in": "query",
    "schema": {"type": "string", "enum": ["plus", "rfc6902"]},
    "description": "rfc6902 rewrites append ops as replace/add",
}


def _op(
    summary: str,
    responses: dict[str, Any],
    *,
    params: list[dict[str, Any]] | None = None,
    body: dict[str, Any] | None = None,
) -> dict[str, Any]:
    op: dict[str, Any] = {"summary": summary, "responses": {**responses, **_ERRORS}}
    if params:
        op["parameters"] = params
    if body is not None:
        op["requestBody"] = {"content": {"application/json": {"schema": body}}}
    return op


def _obj(**props: Any) -> dict[str, Any]:
    return {"type": "object", "properties": props}


_INT = {"type": "integer"}
_STR = {"type": "string"}
_PROTOCOL = {"type": "string", "maxLength": 32}
_LABEL = {"type": "string", "maxLength": 1000}
_BOOL = {"type": "boolean"}
_BYTES = {"type": "string", "format": "binary"}
#: a seed is in [0, 2**64): a number, or a string of digits (JSON numbers are exact only up to 2**53)
_SEED = {
    "oneOf": [{"type": "integer", "minimum": 0}, {"type": "string", "pattern": "^[0-9]{1,20}$"}]
}
_GEN = _obj(
    max_tokens=_INT,
    temperature={"type": "number"},
    top_p={"type": "number"},
    top_k=_INT,
    seed=_SEED,
    stop_token_ids={"type": "array", "items": _INT},
    logprob_top_k=_INT,
    logprob_ranges={"type": "array"},
    readout_ranges={"type": "array"},
    text=_STR,
    tokens={"type": "array", "items": _INT},
    stream={"type": "boolean"},
    background={"type": "boolean"},
)


#: the error statuses each native route answers (each is produced in tests/transports/sse/test_openapi.py);
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


def spec() -> dict[str, Any]:
    doc = _spec()
    for (path, method), codes in _ERRORS_OF.items():
        responses = doc["paths"][path][method]["responses"]
        for code in set(_ERRORS) - set(codes):
            responses.pop(code, None)
    return doc


def _spec() -> dict[str, Any]:
    return {
        "openapi": "3.1.0",
        "info": {"title": "sessiontape HTTP API", "version": "1"},
        "components": {
            "securitySchemes": {"bearer": {"type": "http", "scheme": "bearer"}},
            "schemas": {
                "Error": _obj(error=_obj(code=_STR, message=_STR)),
                "SessionDocument": {
                    "type": "object",
                    "description": "docs/protocols/session-document.md",
                },
                **openai_schema.SCHEMAS,
            },
        },
        "security": [{"bearer": []}],
        "paths": {
            "/": {
                "get": {
                    "summary": "the replay viewer (an HTML page; see docs/protocols/http.md, Viewer)",
                    "security": [],
                    "responses": {
                        "200": {
                            "description": "the viewer",
                            "content": {"text/html": {"schema": _STR}},
                        }
                    },
                }
            },
            "/static/{path}": {
                "get": {
                    "summary": "the viewer's scripts and styles",
                    "security": [],
                    "parameters": [
                        {"name": "path", "in": "path", "required": True, "schema": _STR}
                    ],
                    "responses": {
                        "200": {"description": "a static file (text/javascript, text/css, ...)"},
                        "404": {"description": "no such file"},
                    },
                }
            },
            "/openapi.json": {
                "get": {
                    "summary": "this document",
                    "security": [],
                    "responses": {"200": _json({"type": "object"}, "the OpenAPI 3.1 description")},
                }
            },
            "/healthz": {
                "get": {
                    "summary": "liveness",
                    "security": [],
                    "responses": {
                        "200": _json(_obj(status=_STR, engine=_STR)),
                        "503": _json(
                            _obj(status=_STR, engine=_STR, error=_STR),
                            "the engine can serve nothing more (its worker process died)",
                        ),
                    },
                }
            },
            "/metrics": {
                "get": {
                    "summary": "Prometheus metrics",
                    "security": [],
                    "responses": {"200": {"description": "text exposition format"}},
                }
            },
            "/v1/sessions": {
                "post": _op(
                    "open a session",
                    {"201": _json(_DOC)},
                    body=_obj(
                        protocol=_PROTOCOL,
                        label=_LABEL,
                        mode=_STR,
                        ttl_s={"type": "number"},
                        eos_token_ids={"type": "array", "items": _INT},
                        meta={"type": "object"},
                    ),
                ),
                "get": _op(
                    "list sessions",
                    {"200": _json(_obj(sessions={"type": "array"}))},
                    params=[
                        {"name": n, "in": "query", "schema": _STR}
                        for n in ("status", "protocol", "parent")
                    ]
                    + [{"name": n, "in": "query", "schema": _INT} for n in ("limit", "offset")],
                ),
            },
            "/v1/sessions/events": {
                "get": _op(
                    "SSE: the sessions list, snapshot then JSON Patch+",
                    {"200": _sse("snapshot, patch events")},
                    params=[_PATCH],
                )
            },
            "/v1/sessions/{sid}": {
                "get": _op(
                    "the session document",
                    {"200": _json(_DOC)},
                    params=[_SID, {"name": "version", "in": "query", "schema": _INT}],
                )
            },
            "/v1/sessions/{sid}/events": {
                "get": _op(
                    "SSE: snapshot then JSON Patch+ per committed event; id = log position",
                    {"200": _sse("snapshot, patch, end events; ': ping' heartbeats")},
                    params=[
                        _SID,
                        _PATCH,
                        {"name": "Last-Event-ID", "in": "header", "schema": _INT},
                    ],
                )
            },
            "/v1/sessions/{sid}/append": {
                "post": _op(
                    "append text or tokens",
                    {"200": _json(_obj(length=_INT, version=_INT))},
                    params=[_SID],
                    body=_obj(
                        text=_STR,
                        tokens={"type": "array", "items": _INT},
                        offset={"type": "integer", "minimum": 0},
                        truncating=_BOOL,
                    ),
                )
            },
            "/v1/sessions/{sid}/generate": {
                "post": _op(
                    "generate: an SSE stream of patches (default), JSON (stream=false) or 202 (background=true)",
                    {
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
                    },
                    params=[_SID, _PATCH],
                    body=_GEN,
                )
            },
            "/v1/sessions/{sid}/fork": {
                "post": _op(
                    "fork at a token position or event version",
                    {"201": _json(_DOC)},
                    params=[_SID],
                    body=_obj(at_position=_INT, at_version=_INT, label=_LABEL, protocol=_PROTOCOL),
                )
            },
            "/v1/sessions/{sid}/close": {
                "post": _op("close", {"200": _json(_DOC)}, params=[_SID], body=_obj(reason=_STR))
            },
            "/v1/sessions/{sid}/feedback": {
                "post": _op(
                    "record feedback",
                    {"201": _json(_obj(version=_INT))},
                    params=[_SID],
                    body={"type": "object"},
                )
            },
            "/v1/sessions/{sid}/export": {
                "get": _op(
                    "the session's events as NDJSON, one event per line (what `sessiontape import` reads)",
                    {
                        "200": {
                            "description": "attachment; filename=ID.ndjson",
                            "content": {"application/x-ndjson": {"schema": _STR}},
                        }
                    },
                    params=[_SID],
                )
            },
            "/v1/sessions/{sid}/audit": {
                "get": _op(
                    "verify the hash chain and the fold's invariants (sessiontape.core.audit.audit_session)",
                    {
                        "200": _json(
                            _obj(
                                session_id=_STR,
                                chain_ok=_BOOL,
                                invariants_ok=_BOOL,
                                problems={"type": "array", "items": _STR},
                                ok=_BOOL,
                            )
                        )
                    },
                    params=[_SID],
                )
            },
            "/v1/sessions/{sid}/replay": {
                "get": _op(
                    "base document and one patch per event (the scrubber)",
                    {"200": _json(_obj(base=_DOC, steps={"type": "array"}))},
                    params=[_SID],
                )
            },
            "/v1/sessions/{sid}/images/{sha}": {
                "get": _op(
                    "an attached image's bytes, by sha256, with its recorded MIME type",
                    {
                        "200": {
                            "description": "the image",
                            "content": {
                                "image/*": {"schema": _BYTES},
                                "application/octet-stream": {"schema": _BYTES},
                            },
                        }
                    },
                    params=[
                        _SID,
                        {
                            "name": "sha",
                            "in": "path",
                            "required": True,
                            "schema": {"type": "string", "pattern": "^[0-9a-f]{64}$"},
                        },
                    ],
                )
            },
            "/v1/sessions/{sid}/nodes/{nid}/content": {
                "get": _op(
                    "a leaf node's chunk bytes (Evergreen), with the chunk's mimetype",
                    {"200": {"description": "the chunk", "content": {"*/*": {"schema": _BYTES}}}},
                    params=[_SID, {"name": "nid", "in": "path", "required": True, "schema": _STR}],
                )
            },
            **openai_schema.paths(),
        },
    }
