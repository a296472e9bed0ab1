"""The event loop polls, rather than sleeps, while a streamed gRPC message is in flight
(transports/grpc/spin.py): only while it is, and for at most ``spin_s``."""

from __future__ import annotations

import asyncio
import selectors
import threading
import time
from collections.abc import Iterator
from typing import Any

import grpc
import pytest

from sessiontape.transports.grpc.gen.kakeya.v1 import runtime_pb2 as kakeya_pb2
from sessiontape.transports.grpc.gen.kakeya.v1 import runtime_pb2_grpc as kakeya_grpc
from sessiontape.transports.grpc.spin import Spinner, SpinningContext
from tests.transports.grpc.conftest import Serve


class RecordingSelector(selectors.DefaultSelector):
    """The loop's selector, noting the timeout of every wait for I/O."""

    def __init__(self) -> None:
        super().__init__()
        self.timeouts: list[float | None] = []

    def select(self, timeout: float | None = None) -> Any:
        self.timeouts.append(timeout)
        return super().select(timeout)


class LateContext:
    """A servicer context whose write completes ``after_s`` later, signalled from another
    thread (as grpc's poller thread signals the loop), and whose other attributes are its own."""

    peer_name = "ipv4:127.0.0.1:1"

    def __init__(self, after_s: float) -> None:
        self.after_s = after_s
        self.written: list[Any] = []

    def peer(self) -> str:
        return self.peer_name

    def write(self, message: Any) -> asyncio.Future[None]:
        loop = asyncio.get_running_loop()
        done: asyncio.Future[None] = loop.create_future()

        def later() -> None:
            time.sleep(self.after_s)
            loop.call_soon_threadsafe(done.set_result, None)

        threading.Thread(target=later, daemon=True).start()
        self.written.append(message)
        return done


@pytest.fixture
def recorded() -> Iterator[tuple[asyncio.AbstractEventLoop, RecordingSelector]]:
    sel = RecordingSelector()
    loop = asyncio.SelectorEventLoop(sel)
    try:
        yield loop, sel
    finally:
        loop.close()


def _waits_during(
    loop: asyncio.AbstractEventLoop, sel: RecordingSelector, spin_s: float, after_s: float
) -> tuple[list[float | None], list[float | None], float]:
    """The selector's timeouts while one write through a spinner is in flight, those of
    the next 20 ms after it, and how long the write took."""
    ctx = SpinningContext(LateContext(after_s), Spinner(spin_s))

    async def run() -> tuple[int, float]:
        await asyncio.sleep(0)
        start = len(sel.timeouts)
        t0 = time.perf_counter()
        await ctx.write("m")
        return start, time.perf_counter() - t0

    start, took = loop.run_until_complete(run())
    during = sel.timeouts[start:]
    loop.run_until_complete(asyncio.sleep(0.02))
    after = sel.timeouts[start + len(during) :]
    return during, after, took


def test_the_loop_polls_while_a_write_is_in_flight(
    recorded: tuple[asyncio.AbstractEventLoop, RecordingSelector],
) -> None:
    loop, sel = recorded
    during, after, _ = _waits_during(loop, sel, spin_s=0.5, after_s=0.005)
    # every wait for I/O until the write completed was a poll, and there were many
    assert len(during) > 10
    assert all(t == 0 for t in during), during[:10]
    # once it completed the spinner stopped: the loop sleeps on its timer again
    assert any(t is None or t > 0 for t in after), after[:10]


def test_without_spin_the_loop_sleeps_until_the_write_completes(
    recorded: tuple[asyncio.AbstractEventLoop, RecordingSelector],
) -> None:
    loop, sel = recorded
    during, _, _ = _waits_during(loop, sel, spin_s=0.0, after_s=0.005)
    assert any(t is None or t > 0 for t in during), during


def test_the_loop_polls_for_at_most_spin_s(
    recorded: tuple[asyncio.AbstractEventLoop, RecordingSelector],
) -> None:
    loop, sel = recorded
    during, _, took = _waits_during(loop, sel, spin_s=0.002, after_s=0.05)
    assert took >= 0.05
    # it polled at first, then slept for the rest of the wait
    assert during[0] == 0
    assert any(t is None or t > 0 for t in during)


def test_a_spinning_context_is_the_context_but_for_write() -> None:
    inner = LateContext(0.0)
    ctx = SpinningContext(inner, Spinner(0.001))
    assert ctx.peer() == LateContext.peer_name
    assert ctx.peer_name == LateContext.peer_name
    asyncio.run(_write_twice(ctx))
    assert inner.written == ["a", "b"]


async def _write_twice(ctx: SpinningContext) -> None:
    await ctx.write("a")
    await ctx.write("b")


@pytest.mark.parametrize("spin_s", [0.0, 0.0005])
async def test_a_kakeya_generation_streams_its_tokens_either_way(
    serve: Serve, spin_s: float
) -> None:
    """On a server started with that ``spin_s`` (the servicer writing through the
    spinning context, or at 0 through grpc's own), every token and the done message
    arrive."""
    served = await serve(spin_s=spin_s)
    async with grpc.aio.insecure_channel(served.target) as ch:
        stub = kakeya_grpc.RuntimeServiceStub(ch)
        req = kakeya_pb2.CreateSessionRequest(eos_token_ids=[])
        sid = (await stub.CreateSession(req)).session_id
        await stub.AppendTokens(kakeya_pb2.AppendTokensRequest(session_id=sid, token_ids=[97, 98]))
        gen = kakeya_pb2.GenerateRequest(session_id=sid, max_tokens=12, seed=1, temperature=0.0)
        got = [m async for m in stub.Generate(gen)]
    assert [m.WhichOneof("payload") for m in got] == ["token_id"] * 12 + ["done"]
    assert got[-1].done.generated_token_count == 12
