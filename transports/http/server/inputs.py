"""The HTTP input boundary: the raw body, strict JSON, and the numbers of query strings and headers.

A malformed value becomes a core error (400 ``invalid_argument`` and its
family; 413 ``payload_too_large``; 408 ``request_timeout``) before anything
reaches the runtime, so no bad input is stored and no parser error is a 500:

- the body is read while it streams in, refused once it passes
  ``limits.max_body_bytes`` (or at once when Content-Length says so), and
  refused when no chunk arrives for ``limits.body_timeout_s``;
- JSON is strict: no NaN/Infinity, finite numbers, integers within 64 bits,
  valid Unicode (no lone surrogates), nesting at most ``limits.max_json_depth``;
- numbers in query strings and headers are ASCII digits only, in range.

What a route's body must hold is its model's to say (:mod:`sessiontape.transports.http.native.bodies`,
:mod:`sessiontape.transports.http.openai.bodies`). Usage in a handler::

    b = validate(Fork, await inputs.body(request, limits))
    version = inputs.integer(request.query_params.get("version"), "version", lo=1)
"""

from __future__ import annotations

import asyncio
import json
import math
import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from starlette.requests import ClientDisconnect, Request

from sessiontape.core.errors import InvalidArgument, InvalidParameters
from sessiontape.core.events import check_body
from sessiontape.transports.http.server.errors import ClientGone, PayloadTooLarge, RequestTimeout

INT64 = (-(2**63), 2**63 - 1)
_DIGITS = re.compile(r"-?[0-9]{1,19}")
#: bodies above this size are parsed off the event loop
_THREAD_PARSE_BYTES = 256 * 1024


@dataclass(frozen=True)
class Limits:
    max_body_bytes: int = 16 * 1024 * 1024
    max_json_depth: int = 64
    max_meta_bytes: int = 64 * 1024
    body_timeout_s: float = 30.0
    max_requests_per_client: int = 64
    max_header_bytes: int = 16 * 1024


# -- the body -------------------------------------------------------------------


async def read_body(request: Request, limits: Limits) -> bytes:
    """The raw body, bounded in size and in the time between chunks."""
    declared = request.headers.get("content-length")
    if declared is not None:
        if not _DIGITS.fullmatch(declared) or declared.startswith("-"):
            raise InvalidArgument("Content-Length must be a non-negative integer")
        if int(declared) > limits.max_body_bytes:
            raise PayloadTooLarge(
                f"request body of {declared} bytes exceeds the limit of {limits.max_body_bytes}"
            )
    chunks: list[bytes] = []
    size = 0
    stream = request.stream().__aiter__()
    while True:
        try:
            async with asyncio.timeout(
                limits.body_timeout_s
            ):  # not wait_for: 3.11's can lose a cancel
                chunk = await anext(stream)
        except StopAsyncIteration:
            break
        except TimeoutError:
            raise RequestTimeout(f"no request body data for {limits.body_timeout_s:g} s") from None
        except ClientDisconnect:
            raise ClientGone("client disconnected while sending its body") from None
        size += len(chunk)
        if size > limits.max_body_bytes:
            raise PayloadTooLarge(
                f"request body exceeds the limit of {limits.max_body_bytes} bytes"
            )
        chunks.append(chunk)
    return b"".join(chunks)


async def body(request: Request, limits: Limits) -> dict[str, Any]:
    """The JSON object body (``{}`` when empty)."""
    raw = await read_body(request, limits)
    if not raw.strip():
        return {}
    if len(raw) > _THREAD_PARSE_BYTES:
        value = await asyncio.to_thread(parse_json, raw, limits.max_json_depth)
    else:
        value = parse_json(raw, limits.max_json_depth)
    if not isinstance(value, dict):
        raise InvalidArgument("request body must be a JSON object")
    return value


def _refuse_constant(name: str) -> Any:
    raise InvalidArgument(f"{name} is not a JSON number (NaN and infinities are refused)")


def _strict_float(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):
        raise InvalidArgument(f"number {text[:40]} is out of range")
    return value


def _strict_int(text: str) -> int:
    if (
        len(text) > 20
    ):  # beyond 64 bits whatever the digits are; also stops int()'s digit-limit ValueError
        raise InvalidArgument(f"integer {text[:24]}... is out of the 64-bit range")
    value = int(text)
    if not INT64[0] <= value < 2**64:
        raise InvalidArgument(f"integer {text} is out of the 64-bit range")
    return value


def parse_json(raw: bytes, max_depth: int) -> Any:
    """Strict JSON: UTF-8, finite numbers, 64-bit integers, valid Unicode, bounded depth."""
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise InvalidArgument(
            f"request body is not UTF-8: {exc.reason} at byte {exc.start}"
        ) from None
    try:
        value = json.loads(
            text, parse_constant=_refuse_constant, parse_float=_strict_float, parse_int=_strict_int
        )
    except RecursionError:
        raise InvalidArgument(f"request body is nested deeper than {max_depth} levels") from None
    except ValueError as exc:  # json.JSONDecodeError included
        raise InvalidArgument(f"request body is not JSON: {exc}") from None
    _check_tree(value, max_depth)
    return value


def _check_tree(value: Any, max_depth: int) -> None:
    stack: list[tuple[Any, int]] = [(value, 1)]
    while stack:
        v, depth = stack.pop()
        if isinstance(v, str):
            check_text(v, "a string in the body")
        elif isinstance(v, dict | list):
            if depth > max_depth:
                raise InvalidArgument(f"request body is nested deeper than {max_depth} levels")
            if isinstance(v, dict):
                for k, item in v.items():
                    check_text(k, "an object key in the body")
                    stack.append((item, depth + 1))
            else:
                stack.extend((item, depth + 1) for item in v)


def check_text(s: str, what: str) -> str:
    """``s`` unless it holds a lone surrogate (not valid Unicode; cannot be stored or streamed)."""
    if not s.isascii():
        try:
            s.encode("utf-8")
        except UnicodeEncodeError:
            raise InvalidArgument(f"{what} is not valid Unicode (lone surrogate)") from None
    return s


def sized(value: Mapping[str, Any], name: str, limit: int) -> dict[str, Any]:
    """A free-form object (meta, feedback) that must store as strict JSON within ``limit`` bytes."""
    check_body(value)
    size = len(json.dumps(value, separators=(",", ":"), ensure_ascii=False).encode())
    if size > limit:
        raise PayloadTooLarge(f"{name} is {size} bytes as JSON; the limit is {limit}")
    return dict(value)


# -- scalars ----------------------------------------------------------------------


def integer(value: Any, name: str, *, lo: int = INT64[0], hi: int = INT64[1]) -> int | None:
    """An optional integer from a query string or header: ASCII digits only, in ``[lo, hi]``.

    A JSON body's integers are its model's (strict: no strings).
    """
    if value is None:
        return None
    out: int
    if isinstance(value, str):
        raw = value.strip()
        if not _DIGITS.fullmatch(raw):
            raise InvalidParameters(f"{name} must be an integer (ASCII digits), got {value[:40]!r}")
        out = int(raw)
    elif isinstance(value, bool) or not isinstance(value, int):
        raise InvalidParameters(f"{name} must be an integer")
    else:
        out = value
    if not lo <= out <= hi:
        raise InvalidParameters(f"{name} must be in [{lo}, {hi}], got {out}")
    return out
