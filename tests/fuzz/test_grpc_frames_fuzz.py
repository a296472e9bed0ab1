"""Fuzz the gRPC endpoint below the messages: raw HTTP/2 requests whose bodies are
random gRPC framing (a flag byte, a declared length, bytes that may fall short of it
or run past it) under a random ``grpc-encoding``, to a unary, a server-streaming and a
bidi method. The answer must be a typed status (never UNKNOWN, INTERNAL, DATA_LOSS or
UNIMPLEMENTED), the server must log no internal error, and a refused call must leave
every session that existed before it as it was."""

from __future__ import annotations

import struct
from typing import Any

import grpc
import pytest
from hypothesis import given
from hypothesis import strategies as st

from tests.fuzz.conftest import LONG, QUICK, fuzz_settings
from tests.fuzz.test_grpc_fuzz import FORBIDDEN, Fuzzed, _stored, fuzzed  # noqa: F401
from tests.transports.grpc.test_calls import raw_call as h2_call

PATHS = (
    "/kakeya.v1.RuntimeService/AppendTokens",
    "/salience.v1.Salience/Generate",
    "/evergreen.v2.EvergreenService/StartSession",
)
ENCODINGS = (None, "identity", "gzip", "deflate", "snappy")


@st.composite
def frames(draw: Any) -> bytes:
    """One to three gRPC frames, each with any flag, a length that may lie, and bytes."""
    out = b""
    for _ in range(draw(st.integers(1, 3))):
        flag = draw(st.sampled_from((0, 0, 1, 2, 255)))
        data = draw(st.binary(max_size=64))
        declared = draw(
            st.one_of(
                st.just(len(data)),
                st.integers(0, 128),
                st.integers(1 << 20, (1 << 32) - 1),
            )
        )
        out += struct.pack(">BI", flag, declared) + data
    cut = draw(st.integers(0, len(out)))
    return out if draw(st.booleans()) else out[:cut]


async def _check(f: Fuzzed, path: str, body: bytes, encoding: str | None) -> None:
    before = await _stored(f)
    f.errors.clear()
    extra = () if encoding is None else (("grpc-encoding", encoding),)
    answer = await h2_call(f.port, path, body, extra=extra)
    assert answer.status is not None, (path, body, answer)
    code = {c.value[0]: c for c in grpc.StatusCode}[answer.status]
    assert code not in FORBIDDEN, (path, body, encoding, answer, f.errors)
    assert not f.errors, (path, body, encoding, f.errors)
    if code is not grpc.StatusCode.OK:
        assert await _stored(f) == before, (path, body, encoding, code)


@pytest.mark.parametrize("path", PATHS)
@fuzz_settings(QUICK)
@given(body=frames(), encoding=st.sampled_from(ENCODINGS))
async def test_grpc_frame_fuzz(
    fuzzed: Fuzzed,  # noqa: F811
    path: str,
    body: bytes,
    encoding: str | None,
) -> None:
    await _check(fuzzed, path, body, encoding)


@pytest.mark.fuzz
@pytest.mark.parametrize("path", PATHS)
@fuzz_settings(LONG)
@given(body=frames(), encoding=st.sampled_from(ENCODINGS))
async def test_grpc_frame_fuzz_long(
    fuzzed: Fuzzed,  # noqa: F811
    path: str,
    body: bytes,
    encoding: str | None,
) -> None:
    await _check(fuzzed, path, body, encoding)
