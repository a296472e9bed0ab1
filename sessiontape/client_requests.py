"""The HTTP request behind each client method, and its reply read back (docs/protocols/http.md).

Built once for :class:`~sessiontape.client.Client` and
:class:`~sessiontape.client.AsyncClient`, which only send what :class:`Calls`
builds and hand the response to :func:`parse`. Import the public names from
:mod:`sessiontape.client`.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import httpx

from sessiontape.errors import from_response

#: the generation fields the server takes (docs/protocols/http.md)
GENERATE_FIELDS = frozenset(
    {
        "max_tokens",
        "temperature",
        "top_p",
        "top_k",
        "seed",
        "stop_token_ids",
        "logprob_top_k",
        "logprob_ranges",
        "readout_ranges",
        "text",
        "tokens",
    }
)


@dataclass(frozen=True)
class Call:
    method: str
    path: str
    json: dict[str, Any] | None = None
    params: dict[str, Any] | None = None
    ndjson: bool = False


def _given(**fields: Any) -> dict[str, Any]:
    return {k: v for k, v in fields.items() if v is not None}


def _generation(params: Mapping[str, Any], **mode: Any) -> dict[str, Any]:
    unknown = set(params) - GENERATE_FIELDS
    if unknown:
        raise TypeError(
            f"unknown generation parameters: {sorted(unknown)} (known: {sorted(GENERATE_FIELDS)})"
        )
    return {**_given(**params), **mode}


def session_path(sid: str, tail: str = "") -> str:
    """The path of a session's resource (``tail`` such as ``/append``, ``/events``)."""
    return f"/v1/sessions/{sid}{tail}"


class Calls:
    """The requests behind each method, built once for both clients."""

    @staticmethod
    def health() -> Call:
        return Call("GET", "/healthz")

    @staticmethod
    def create(
        protocol: str | None,
        label: str | None,
        mode: str | None,
        ttl_s: float | None,
        eos_token_ids: list[int] | None,
        meta: Mapping[str, Any] | None,
    ) -> Call:
        return Call(
            "POST",
            "/v1/sessions",
            _given(
                protocol=protocol,
                label=label,
                mode=mode,
                ttl_s=ttl_s,
                eos_token_ids=eos_token_ids,
                meta=None if meta is None else dict(meta),
            ),
        )

    @staticmethod
    def listing(
        status: str | None,
        protocol: str | None,
        parent: str | None,
        limit: int | None,
        offset: int | None,
    ) -> Call:
        return Call(
            "GET",
            "/v1/sessions",
            params=_given(
                status=status, protocol=protocol, parent=parent, limit=limit, offset=offset
            ),
        )

    @staticmethod
    def get(sid: str, version: int | None) -> Call:
        return Call("GET", session_path(sid), params=_given(version=version))

    @staticmethod
    def append(
        sid: str,
        text: str | None,
        tokens: list[int] | None,
        offset: int | None,
        truncating: bool | None,
    ) -> Call:
        if text is None and tokens is None:
            raise TypeError("append needs text or tokens")
        return Call(
            "POST",
            session_path(sid, "/append"),
            _given(text=text, tokens=tokens, offset=offset, truncating=truncating),
        )

    @staticmethod
    def generate(sid: str, params: Mapping[str, Any], **mode: Any) -> Call:
        """A generation with ``params`` (refused unless in GENERATE_FIELDS); ``mode`` as
        ``stream=False`` or ``background=True``."""
        return Call("POST", session_path(sid, "/generate"), _generation(params, **mode))

    @staticmethod
    def fork(
        sid: str,
        at_position: int | None,
        at_version: int | None,
        label: str | None,
        protocol: str | None,
    ) -> Call:
        return Call(
            "POST",
            session_path(sid, "/fork"),
            _given(at_position=at_position, at_version=at_version, label=label, protocol=protocol),
        )

    @staticmethod
    def close(sid: str, reason: str | None) -> Call:
        return Call("POST", session_path(sid, "/close"), _given(reason=reason))

    @staticmethod
    def feedback(sid: str, feedback: Mapping[str, Any]) -> Call:
        return Call("POST", session_path(sid, "/feedback"), dict(feedback))

    @staticmethod
    def export(sid: str) -> Call:
        return Call("GET", session_path(sid, "/export"), ndjson=True)

    @staticmethod
    def audit(sid: str) -> Call:
        return Call("GET", session_path(sid, "/audit"))


def auth_headers(token: str | None) -> dict[str, str]:
    """The headers every request carries: the bearer token, when there is one."""
    return {"Authorization": f"Bearer {token}"} if token else {}


def parse(call: Call, response: httpx.Response) -> Any:
    """The reply's JSON (a list of them for NDJSON), or the typed error of a refusal."""
    if response.status_code >= 400:
        raise from_response(response.status_code, response.content)
    if call.ndjson:
        return [json.loads(line) for line in response.text.splitlines() if line.strip()]
    return response.json()
