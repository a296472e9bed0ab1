"""The long run of the gRPC endpoint's HTTP/2 frame fuzz (its seeded slice is in
tests/transports/grpc/test_http2.py): random frames among well-formed requests after a
valid preface end in an answer, nothing, or a GOAWAY, never in a fault of the server's,
and store nothing."""

from __future__ import annotations

import pytest
from hypothesis import given

from tests.fuzz.conftest import LONG, fuzz_settings
from tests.fuzz.test_grpc_fuzz import Fuzzed, fuzzed  # noqa: F401
from tests.transports.grpc.test_http2 import frame_soup, soup_check


@pytest.mark.fuzz
@fuzz_settings(LONG)
@given(soup=frame_soup())
async def test_http2_frame_soup_long(fuzzed: Fuzzed, soup: bytes) -> None:  # noqa: F811
    await soup_check(fuzzed, soup)
