"""GENERATE's ``constraint`` config: the output node's text is generated under it and
the generation records it; a bad one is INVALID_ARGUMENT."""

from __future__ import annotations

import re

import grpc

from sessiontape.core.events import T
from sessiontape.transports.grpc.client import EvergreenClient, action, sampling_config
from sessiontape.transports.grpc.client import text_fragments as texts
from tests.helpers.evergreen import exchange, msg
from tests.transports.grpc.conftest import Served

PATTERN = "[0-9]{3}-[a-z]{2}"


def _generate(**params: object) -> object:
    return action(
        "GENERATE",
        inputs={"text": "prompt"},
        outputs={"text": "answer"},
        configs=[sampling_config(max_tokens=12, seed=3, **params)],
    )


async def test_generate_under_a_regex_constraint(client: EvergreenClient, server: Served) -> None:
    out = await exchange(
        client,
        server.runtime,
        msg(actions=[_generate(constraint={"regex": PATTERN})]),
        msg(fragments=texts("prompt", "Give me a code.", parts=1)),
    )
    assert out.code == grpc.StatusCode.OK, out.details
    assert re.fullmatch(PATTERN, out.nodes["answer"].decode()), out.nodes
    [started] = out.of(T.GENERATION_STARTED)
    assert started.body["params"]["constraint"]["text"] == PATTERN


async def test_a_bad_constraint_config_is_invalid_argument(
    client: EvergreenClient, server: Served
) -> None:
    out = await exchange(
        client,
        server.runtime,
        msg(actions=[_generate(constraint={"regex": "("})]),
        msg(fragments=texts("prompt", "Give me a code.", parts=1)),
    )
    assert out.code == grpc.StatusCode.INVALID_ARGUMENT, out.details
    assert not out.of(T.GENERATION_STARTED)


async def test_a_schema_s_whole_numbers_stay_integers_through_the_struct(
    client: EvergreenClient, server: Served
) -> None:
    # a Struct holds every number as a double: maxLength 4 arrives as 4.0, read back as 4
    schema = {"type": "object", "properties": {"a": {"type": "string", "maxLength": 4}}}
    out = await exchange(
        client,
        server.runtime,
        msg(actions=[_generate(constraint={"json_schema": schema})]),
        msg(fragments=texts("prompt", "Some JSON?", parts=1)),
    )
    assert out.code == grpc.StatusCode.OK, out.details
    [started] = out.of(T.GENERATION_STARTED)
    assert '"maxLength":4' in started.body["params"]["constraint"]["text"]
