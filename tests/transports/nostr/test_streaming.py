"""Streamed D4 answers: stop strings, and partial results that never hold the generation."""

from __future__ import annotations

import itertools
import json
import time
from pathlib import Path
from typing import Any

import pytest

from sessiontape.core.errors import ConfigError
from sessiontape.core.events import T
from sessiontape.core.runtime import Runtime
from sessiontape.transports.nostr.settings import Settings
from sessiontape.transports.nostr.worker import D4Worker
from tests.helpers.nostr import (
    Caller,
    LocalRelay,
    WorkerFactory,
    call_body,
    chat,
    open_runtime,
)


def text_of(reply: dict[str, Any]) -> str:
    return str(chat(reply)["choices"][0]["message"]["content"])


async def test_stop_string_ends_the_answer_before_it(
    runtime: Runtime, make_worker: WorkerFactory, local_relay: LocalRelay
) -> None:
    worker = await make_worker(runtime, [local_relay.url])
    [fid] = worker.functions
    caller = await Caller(worker.pubkey).connect(local_relay.url)
    try:
        plain = await caller.wait_final(await caller.call(fid, call_body(args={"max_tokens": 40})))
        full = text_of(plain)
        assert chat(plain)["choices"][0]["finish_reason"] == "length" and len(full) >= 20
        stop = full[14:17]
        expected = full[: full.index(stop)]
        call_id = await caller.call(fid, call_body(args={"max_tokens": 40, "stop": [stop]}))
        final = await caller.wait_final(call_id)
        completion = chat(final)
        assert text_of(final) == expected
        assert completion["choices"][0]["finish_reason"] == "stop"
        # usage and cost count exactly the tokens in the log (the generation may have
        # run past the stop string before the answer read it), the stop string among them
        st = await runtime.get("d4_" + call_id[:48])
        [gen] = st.generations.values()
        n = completion["usage"]["completion_tokens"]
        assert n == len(gen.tokens) and final["body"]["total_cost"] == n * 1000
        assert stop in runtime.engine.detokenize(list(gen.tokens))
        # partial results only ever showed text of the answer, never the stop string
        partials = [r for r in caller.replies(call_id) if r["body"].get("partial")]
        assert partials
        for r in partials:
            assert expected.startswith(text_of(r)) and stop not in text_of(r)
    finally:
        await caller.close()


class SlowPartials(D4Worker):
    """A worker whose relays take a second to acknowledge each partial result."""

    delay_s = 1.0

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.partials_out: list[float] = []  # when each partial result's publish returned

    async def publish(self, event: Any) -> list[str]:
        import asyncio

        partial = json.loads(json.loads(event.as_json())["content"]).get("partial", False)
        if partial:
            await asyncio.sleep(self.delay_s)
        try:
            return await super().publish(event)
        finally:
            if partial:
                self.partials_out.append(time.time())


async def test_a_slow_relay_never_holds_the_generation(
    tmp_path: Path, make_worker: WorkerFactory, local_relay: LocalRelay
) -> None:
    """Partial results go out beside the generation: it commits at the engine's pace
    while a relay takes its time, partials wait for the one in flight instead of
    queueing, and the final result follows the last partial."""
    runtime = await open_runtime(f"sqlite+aiosqlite:///{tmp_path / 'slow.db'}", step_delay_s=0.005)
    try:
        worker = await make_worker(runtime, [local_relay.url], SlowPartials)
        assert isinstance(worker, SlowPartials)
        [fid] = worker.functions
        caller = await Caller(worker.pubkey).connect(local_relay.url)
        try:
            call_id = await caller.call(fid, call_body(args={"max_tokens": 40}))
            final = await caller.wait_final(call_id)
            assert chat(final)["usage"]["completion_tokens"] == 40
            evs = await runtime.log.read("d4_" + call_id[:48])
            [finished] = [e for e in evs if e.type == T.GENERATION_FINISHED]
            assert finished.body["completion_tokens"] == 40
            # 40 tokens at 5 ms each: done long before the first partial's relay answered
            assert worker.partials_out and finished.recorded_at < worker.partials_out[0]
            outs = [
                json.loads(e.body["payload"]["content"])
                for e in evs
                if e.type == T.WIRE and e.body["direction"] == "out"
            ]
            assert [o.get("partial", False) for o in outs] == [True] * (len(outs) - 1) + [False]
            # every 4 tokens was due, but never while one was in flight
            assert len(outs) - 1 == len(worker.partials_out) < 10
        finally:
            await caller.close()
    finally:
        await runtime.aclose()


async def test_partial_results_keep_their_gap_on_a_fast_relay(
    tmp_path: Path, make_worker: WorkerFactory, local_relay: LocalRelay
) -> None:
    """A relay that answers at once and an engine that makes a partial result due every
    few milliseconds still get partial results no closer than ``stream_gap_ms``: each
    is the whole answer so far, signed and recorded, and one per relay round trip
    would hold a fast engine back."""
    runtime = await open_runtime(f"sqlite+aiosqlite:///{tmp_path / 'gap.db'}", step_delay_s=0.002)
    try:
        worker = await make_worker(
            runtime, [local_relay.url], stream_every_tokens=1, stream_gap_ms=60
        )
        [fid] = worker.functions
        caller = await Caller(worker.pubkey).connect(local_relay.url)
        try:
            call_id = await caller.call(fid, call_body(args={"max_tokens": 120}))
            final = await caller.wait_final(call_id)
            assert chat(final)["usage"]["completion_tokens"] == 120
            evs = await runtime.log.read("d4_" + call_id[:48])
            outs = [
                e
                for e in evs
                if e.type == T.WIRE
                and e.body["direction"] == "out"
                and json.loads(e.body["payload"]["content"]).get("partial")
            ]
            times = [e.recorded_at for e in outs]
            assert len(times) >= 2  # 120 tokens at 2 ms or more each: 240 ms of answer
            assert all(b - a >= 0.055 for a, b in itertools.pairwise(times)), times
            assert len(times) < 120 // 2
        finally:
            await caller.close()
    finally:
        await runtime.aclose()


@pytest.mark.parametrize(
    "value", [float("nan"), float("inf"), -1, 2.5, "25", True, None, [25], 2**70]
)
def test_stream_gap_ms_refuses_what_is_not_a_whole_number_of_milliseconds(value: object) -> None:
    """The option is refused by name, as a ConfigError, before any key is read."""
    with pytest.raises(ConfigError, match=r"transports\.nostr\.stream_gap_ms"):
        Settings.from_options({"relays": ["ws://127.0.0.1:1"], "stream_gap_ms": value})
