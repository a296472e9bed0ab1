"""NIP-90 jobs that do not end in a result: a bid below one token, a bad parameter, another provider's job."""

from __future__ import annotations

import asyncio
from typing import Any

import nostr_sdk as ns
import pytest

from sessiontape.core.errors import SessionNotFound
from sessiontape.core.events import T
from sessiontape.core.runtime import Runtime
from tests.helpers.nostr import Caller, LocalRelay, WorkerFactory, eventually


def tag(event: dict[str, Any], name: str) -> list[str]:
    """The values of ``event``'s first tag called ``name``."""
    return next(t[1:] for t in event["tags"] if t[0] == name)


async def closed_reason(runtime: Runtime, sid: str) -> str | None:
    return next(
        (e.body["reason"] for e in await runtime.log.read(sid) if e.type == T.SESSION_CLOSED),
        None,
    )


async def test_a_bid_below_one_token_is_asked_for_payment(
    runtime: Runtime, make_worker: WorkerFactory, local_relay: LocalRelay
) -> None:
    worker = await make_worker(runtime, [local_relay.url])
    caller = await Caller(worker.pubkey).connect(local_relay.url)
    try:
        tags = [["i", "Tell me", "text"], ["param", "max_tokens", "5"], ["bid", "999"]]
        job = await caller.publish(caller.sign("", tags, kind=5050))
        [status] = await eventually(lambda: caller.replies(job), what="the job's status")
        assert status["kind"] == 7000 and status["content"] == ""
        assert tag(status, "status") == ["payment-required", "bid below one token"]
        # the amount is what the job asked for at the worker's price
        assert tag(status, "amount") == ["5000"] and tag(status, "p") == [caller.pubkey]
        sid = "d4_" + job[:48]
        await eventually(lambda: worker.stats["nip90_jobs"] == 1)
        st = await runtime.get(sid)
        assert not st.generations and st.length == 0
        assert await closed_reason(runtime, sid) == "negotiation"
        await asyncio.sleep(0.3)
        assert [r["kind"] for r in caller.replies(job)] == [7000]  # no result followed
    finally:
        await caller.close()


@pytest.mark.parametrize(
    ("tags", "message"),
    [
        (
            [["i", "Tell me", "text"], ["param", "temperature", "hot"]],
            "param temperature is not a number: 'hot'",
        ),
        (
            [["i", "Tell me", "text"], ["bid", "-5"]],
            "bid must be a positive integer (msat), got '-5'",
        ),
        ([["i", "a picture", "url"]], "job has no text input (an 'i' tag of type text)"),
    ],
)
async def test_a_bad_job_gets_an_error_status_and_a_recorded_error(
    runtime: Runtime,
    make_worker: WorkerFactory,
    local_relay: LocalRelay,
    tags: list[list[str]],
    message: str,
) -> None:
    worker = await make_worker(runtime, [local_relay.url])
    caller = await Caller(worker.pubkey).connect(local_relay.url)
    try:
        job = await caller.publish(caller.sign("", tags, kind=5050))
        [status] = await eventually(lambda: caller.replies(job), what="the job's status")
        assert status["kind"] == 7000
        assert tag(status, "status") == ["error", f"invalid_parameters: {message}"]
        sid = "d4_" + job[:48]
        events = await runtime.log.read(sid)
        errors = [e.body for e in events if e.type == T.ERROR]
        assert [(b["code"], b["message"]) for b in errors] == [("invalid_parameters", message)]
        assert await closed_reason(runtime, sid) == "error"
        assert not (await runtime.get(sid)).generations
    finally:
        await caller.close()


async def test_a_job_for_another_provider_is_left_alone(
    runtime: Runtime, make_worker: WorkerFactory, local_relay: LocalRelay
) -> None:
    worker = await make_worker(runtime, [local_relay.url])
    caller = await Caller(worker.pubkey).connect(local_relay.url)
    other = ns.Keys.generate().public_key().to_hex()  # a provider that is not this worker
    try:
        tags = [["i", "Tell me", "text"], ["p", other]]
        job = await caller.publish(caller.sign("", tags, kind=5050))
        await eventually(lambda: worker.stats["nip90_other_provider"] == 1)
        with pytest.raises(SessionNotFound):
            await runtime.get("d4_" + job[:48])
        assert worker.stats["nip90_jobs"] == 0 and caller.replies(job) == []
        # addressed to this worker among others, the same job is answered
        both = await caller.publish(
            caller.sign("", [*tags, ["p", worker.pubkey], ["param", "max_tokens", "3"]], kind=5050)
        )
        await eventually(lambda: [r for r in caller.replies(both) if r["kind"] == 6050])
    finally:
        await caller.close()
