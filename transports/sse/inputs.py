"""The HTTP input boundary: every request value is parsed here, strictly, before a handler uses it.

A malformed value becomes a core error (400 ``invalid_argument`` and its
family; 413 ``payload_too_large``; 408 ``request_timeout``) before anything
reaches the runtime, so no bad input is stored and no parser error is a 500:

- the body is read while it streams in, refused once it passes
  ``limits.max_body_bytes`` (or at once when Content-Length says so), and
  refused when no chunk arrives for ``limits.body_timeout_s``;
- JSON is strict: no NaN/Infinity, finite numbers, integers within 64 bits,
  valid Unicode (no lone surrogates), nesting at most ``limits.max_json_depth``;
- each route names its fields; an unknown one is a 400 naming it;
- numbers in query strings and headers are ASCII digits only, in range; a JSON body's
  integers are JSON integers (``"1"``, ``true`` and ``1.0`` are refused, not converted).

Usage in a handler::

    b = await inputs.body(request, CREATE_FIELDS)
    ttl = inputs.number(b.get("ttl_s"), "ttl_s", lo=0, hi=MAX_TTL_S, lo_open=True)
"""

from __future__ import annotations

import asyncio
import json
import math
import re
from collections.abc import Collection, Mapping
from dataclasses import dataclass
from typing import Any

from starlette.requests import ClientDisconnect, Request

from sessiontape.core.errors import InvalidArgument, InvalidParameters
from sessiontape.core.events import check_body
from sessiontape.transports.sse.errors import ClientGone, PayloadTooLarge, RequestTimeout

INT64 = (-(2**63), 2**63 - 1)
_DIGITS = re.compile(r"-?[0-9]{1,19}")
#: bodies above this size are parsed off the event loop
_THREAD_PARSE_BYTES = 256 * 1024


class UnknownFields(InvalidArgument):
    code = "unknown_field"

    def __init__(self, fields: Collection[str], allowed: Collection[str]) -> None:
        names = ", ".join(sorted(repr(f) for f in fields))
        super().__init__(
            f"unknown field(s) {names}; this route takes {', '.join(sorted(allowed)) or 'no fields'}"
        )
        self.fields = sorted(fields)


@dataclass(frozen=True)
class Limits:
    max_body_bytes: int = 16 * 1024 * 1024
    max_json_depth: int = 64
    max_meta_bytes: int = 64 * 1024
    body_timeout_s: float = 30.0
    max_requests_per_client: int = 64


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


async def body(request: Request, limits: Limits, fields: Collection[str] | None) -> dict[str, Any]:
    """The JSON object body (``{}`` when empty); ``fields`` None accepts any key (free-form bodies)."""
    raw = await read_body(request, limits)
    if not raw.strip():
        return {}
    if len(raw) > _THREAD_PARSE_BYTES:
        value = await asyncio.to_thread(parse_json, raw, limits.max_json_depth)
    else:
        value = parse_json(raw, limits.max_json_depth)
    if not isinstance(value, dict):
        raise InvalidArgument("request body must be a JSON object")
    if fields is not None:
        unknown = set(value) - set(fields)
        if unknown:
            raise UnknownFields(unknown, fields)
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

    A JSON body's integers go through :func:`json_integer`, which takes no strings.
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


def json_integer(value: Any, name: str, *, lo: int = INT64[0], hi: int = INT64[1]) -> int | None:
    """An optional integer from a JSON body, in ``[lo, hi]``: a JSON integer and nothing else.

    A string of digits (``"1"``), a boolean or a number written with a fraction or exponent
    (``1.0``, which the strict parser reads as a float) is refused, not converted.
    """
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int):
        raise InvalidParameters(f"{name} must be a JSON integer, got {_json_kind(value)}")
    return integer(value, name, lo=lo, hi=hi)


def _json_kind(value: Any) -> str:
    if isinstance(value, str):
        return f"a string ({value[:40]!r})"
    if isinstance(value, bool):
        return f"a boolean ({'true' if value else 'false'})"
    if isinstance(value, float):
        return f"a number with a fraction or exponent ({value!r})"
    if isinstance(value, list):
        return "an array"
    return "an object" if isinstance(value, dict) else type(value).__name__


def number(value: Any, name: str, *, lo: float, hi: float, lo_open: bool = False) -> float | None:
    """An optional finite JSON number in ``[lo, hi]`` (``(lo, hi]`` with ``lo_open``)."""
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        raise InvalidParameters(f"{name} must be a finite number")
    if value > hi or value < lo or (lo_open and value == lo):
        raise InvalidParameters(
            f"{name} must be in {'(' if lo_open else '['}{lo:g}, {hi:g}], got {value:g}"
        )
    return float(value)


def text(value: Any, name: str, max_len: int) -> str | None:
    """An optional string of at most ``max_len`` characters, valid Unicode."""
    if value is None:
        return None
    if not isinstance(value, str):
        raise InvalidParameters(f"{name} must be a string")
    if len(value) > max_len:
        raise InvalidParameters(f"{name} must be at most {max_len} characters, got {len(value)}")
    return check_text(value, name)


def boolean(value: Any, name: str, default: bool = False) -> bool:
    if value is None:
        return default
    if not isinstance(value, bool):
        raise InvalidParameters(f"{name} must be true or false")
    return value


def int_list(value: Any, name: str, *, lo: int = INT64[0], hi: int = INT64[1]) -> list[int]:
    if not isinstance(value, list) or any(
        isinstance(v, bool) or not isinstance(v, int) for v in value
    ):
        raise InvalidParameters(f"{name} must be an array of integers")
    if value and not (lo <= min(value) and max(value) <= hi):
        raise InvalidParameters(f"{name} must hold integers in [{lo}, {hi}]")
    return list(value)


def ranges(value: Any, name: str) -> tuple[tuple[int, int], ...]:
    if value is None:
        return ()
    if not isinstance(value, list) or any(not isinstance(r, list) or len(r) != 2 for r in value):
        raise InvalidParameters(f"{name} must be an array of [start, end] pairs")
    # start <= end and the positions themselves are the runtime's checks (InvalidRange)
    return tuple((a, b) for a, b in (int_list(r, name, lo=0) for r in value))


def seed(value: Any) -> int | None:
    """A seed: an integer or a string of ASCII digits, in [0, 2**64)."""
    if value is None:
        return None
    if isinstance(value, str):
        if not re.fullmatch(r"[0-9]{1,20}", value.strip()):
            raise InvalidParameters(f"seed must be an integer in [0, 2**64), got {value[:40]!r}")
        value = int(value.strip())
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value < 2**64:
        raise InvalidParameters("seed must be an integer in [0, 2**64)")
    return value
