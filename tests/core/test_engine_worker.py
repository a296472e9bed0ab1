"""The engine served from a worker process (core/engine/worker.py): the same steps as the
engine in this process, errors as their own class, stops that rewind the child's cache,
back-pressure, and a child that dies."""

from __future__ import annotations

import asyncio
import os
import signal
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from sessiontape.core.config import Config
from sessiontape.core.engine.interface import Engine, OutputOptions, SamplingParams, Step
from sessiontape.core.engine.worker import WorkerEngine
from sessiontape.core.errors import (
    ConfigError,
    ContextOverflow,
    EngineError,
    InvalidImage,
    PluginNotFound,
)
from sessiontape.core.events import T
from sessiontape.core.generation.request import GenerateRequest
from sessiontape.core.runtime import Runtime
from sessiontape.engines.reference import ReferenceEngine
from tests.helpers.config import make_config

HISTORY = [72, 101, 108, 108, 111, 44, 32, 119, 111, 114, 108, 100]


@pytest.fixture
async def worker() -> AsyncIterator[WorkerEngine]:
    engine = WorkerEngine("reference", {"eos_bias": -1000.0})
    try:
        yield engine
    finally:
        await engine.aclose()


async def steps(
    engine: Engine, key: str, params: SamplingParams, options: OutputOptions
) -> list[Step]:
    return [s async for s in engine.generate(key, HISTORY, params, options)]


@pytest.mark.parametrize(
    ("params", "options"),
    [
        (SamplingParams(max_tokens=300, temperature=0.0, seed=1), OutputOptions()),
        (
            SamplingParams(max_tokens=40, temperature=0.9, top_p=0.8, top_k=20, seed=7),
            OutputOptions(logprob_top_k=3, logprob_ranges=((0, 5),), readout_ranges=((2, 60),)),
        ),
    ],
)
async def test_the_worker_yields_the_steps_of_the_engine_in_this_process(
    worker: WorkerEngine, params: SamplingParams, options: OutputOptions
) -> None:
    here = ReferenceEngine(eos_bias=-1000.0)
    want = await steps(here, "a", params, options)
    got = await steps(worker, "a", params, options)
    assert got == want
    assert any(s.is_prefill for s in got) == bool(options.logprob_ranges)
    assert worker.info == here.info
    assert worker.detokenize(worker.tokenize("héllo")) == here.detokenize(here.tokenize("héllo"))


async def test_a_runtime_configured_with_a_worker_logs_what_the_inline_engine_logs(
    tmp_path: Path,
) -> None:
    logged = {}
    for process in ("inline", "worker"):
        cfg = make_config(
            f"sqlite+aiosqlite:///{tmp_path / process}.db",
            engine={"name": "reference", "process": process, "options": {"eos_bias": -1000.0}},
        )
        rt = await Runtime.create(cfg)
        try:
            assert isinstance(rt.engine, WorkerEngine) == (process == "worker")
            sid = (await rt.open_session("t")).session_id
            await rt.append_text(sid, "the worker")
            params = SamplingParams(max_tokens=500, temperature=0.7, seed=11)
            evs = [e async for e in rt.generate(sid, GenerateRequest(params))]
            logged[process] = [
                e.body["token"] for e in await rt.log.read(sid) if e.type == T.GENERATION_TOKEN
            ]
            assert [e.body["token"] for e in evs if e.type == T.GENERATION_TOKEN] == logged[process]
            fin = evs[-1]
            assert fin.type == T.GENERATION_FINISHED and fin.body["completion_tokens"] == 500
        finally:
            await rt.aclose()
    assert logged["inline"] == logged["worker"]


def _uvloop_loaded(pid: int) -> bool:
    """Whether uvloop's extension is mapped into process ``pid``."""
    return "uvloop" in Path(f"/proc/{pid}/maps").read_text()


@pytest.mark.parametrize("event_loop", ["asyncio", "uvloop"])
async def test_the_child_runs_the_event_loop_the_server_is_configured_with(
    tmp_path: Path, event_loop: str
) -> None:
    pytest.importorskip("uvloop")
    cfg = make_config(
        f"sqlite+aiosqlite:///{tmp_path / 'loop'}.db",
        engine={"name": "reference", "process": "worker", "options": {"eos_bias": -1000.0}},
        server={"event_loop": event_loop},
    )
    rt = await Runtime.create(cfg)
    try:
        assert isinstance(rt.engine, WorkerEngine)
        params = SamplingParams(max_tokens=50, temperature=0.0, seed=1)
        want = await steps(ReferenceEngine(eos_bias=-1000.0), "a", params, OutputOptions())
        assert await steps(rt.engine, "a", params, OutputOptions()) == want
        assert _uvloop_loaded(rt.engine._proc.pid) == (event_loop == "uvloop")
    finally:
        await rt.aclose()


def test_the_engine_process_is_checked_in_config() -> None:
    with pytest.raises(ConfigError, match=r"engine\.process must be one of inline, worker"):
        Config.load(environ={}, overrides={"engine": {"name": "reference", "process": "thread"}})
    cfg = Config.load(environ={"SESSIONTAPE_ENGINE__PROCESS": "worker"})
    assert cfg.engine_process == "worker"


async def test_errors_of_the_engine_arrive_as_their_own_class(tmp_path: Path) -> None:
    engine = WorkerEngine("reference", {"max_length": 8, "image_tokens": None})
    try:
        with pytest.raises(ContextOverflow, match="leaves no room in 8") as info:
            await steps(engine, "a", SamplingParams(max_tokens=1), OutputOptions())
        assert info.value.code == "context_overflow"
        with pytest.raises(InvalidImage, match="takes no images"):
            engine.image_block_length(b"\x89PNG", "image/png")
        # the worker goes on serving after an error
        ok = [s async for s in engine.generate("b", [1, 2, 3], SamplingParams(max_tokens=3))]
        assert len(ok) == 3
    finally:
        await engine.aclose()


class LocalReference(ReferenceEngine):
    """An engine that lives in the tests (``module:Class``), not in an entry point."""

    def __init__(self, **options: object) -> None:
        super().__init__(eos_bias=-1000.0, **options)  # type: ignore[arg-type]


async def test_a_module_class_engine_the_server_can_import_loads_in_the_worker(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # started elsewhere than the checkout: the worker imports this module by the server's path
    monkeypatch.chdir(tmp_path)
    engine = WorkerEngine("tests.core.test_engine_worker:LocalReference")
    try:
        got = [s async for s in engine.generate("m", HISTORY, SamplingParams(max_tokens=50))]
        want = [
            s async for s in LocalReference().generate("m", HISTORY, SamplingParams(max_tokens=50))
        ]
        assert got == want and len(got) == 50
    finally:
        await engine.aclose()


def test_a_worker_that_cannot_load_its_engine_fails_at_start() -> None:
    with pytest.raises(PluginNotFound, match="no engine named 'nope'"):
        WorkerEngine("nope")
    with pytest.raises(ConfigError, match=r"unknown key `colour` in \[engine.options\]"):
        WorkerEngine("reference", {"colour": "blue"})


async def test_a_caller_that_stops_leaves_the_childs_cache_at_what_it_took(tmp_path: Path) -> None:
    from sessiontape.engines.onnx.demo import build_demo

    folder = tmp_path / "tiny"
    build_demo("tiny", folder)
    engine = WorkerEngine("onnx", {"model_dir": str(folder), "intra_op_threads": 1})
    try:
        params = SamplingParams(max_tokens=24, temperature=0.0, seed=2)
        for k in (0, 1, 5):
            key = f"s{k}"
            received = 0
            agen = engine.generate(key, HISTORY, params)
            async for _ in agen:
                received += 1
                if received == k + 1:
                    break
            await agen.aclose()  # type: ignore[attr-defined]
            # the stop is settled before the next call is answered; the child ran ahead,
            # its cache holds no more than the steps handed over
            cached = engine.cached_length(key)
            assert cached is not None and len(HISTORY) <= cached <= len(HISTORY) + received
            # and what comes next is what a cold cache computes
            more = [s.token_id async for s in engine.generate(key, HISTORY, params)]
            cold = [s.token_id async for s in engine.generate(f"cold{k}", HISTORY, params)]
            assert more == cold
    finally:
        await engine.aclose()


async def test_the_worker_runs_at_most_a_window_ahead_of_a_caller_that_waits() -> None:
    engine = WorkerEngine("reference", {"eos_bias": -1000.0}, window=8, flush_s=0.0)
    try:
        agen = engine.generate("w", HISTORY, SamplingParams(max_tokens=200))
        first = await anext(agen)  # type: ignore[call-overload]
        await asyncio.sleep(0.3)  # the child would have finished all 200 by now
        [inbox] = engine._inboxes.values()
        waiting = 0
        while not inbox.empty():
            item = inbox.get_nowait()
            assert isinstance(item, list)
            waiting += len(item)
        assert first.position == len(HISTORY)
        assert 0 < waiting <= 8
        await agen.aclose()  # type: ignore[attr-defined]
    finally:
        await engine.aclose()


async def test_a_worker_that_dies_fails_its_generation_and_every_later_call(
    sqlite_url: str,
) -> None:
    cfg = make_config(
        sqlite_url,
        engine={"name": "reference", "process": "worker", "options": {"step_delay_s": 0.01}},
    )
    rt = await Runtime.create(cfg)
    try:
        assert isinstance(rt.engine, WorkerEngine)
        sid = (await rt.open_session("t", eos_token_ids=[])).session_id
        await rt.append_text(sid, "abc")
        seen = []
        with pytest.raises(EngineError, match="engine worker process exited"):
            async for e in rt.generate(
                sid, GenerateRequest(SamplingParams(max_tokens=500, temperature=0.0))
            ):
                seen.append(e)
                if sum(x.type == T.GENERATION_TOKEN for x in seen) == 3:
                    os.kill(rt.engine._proc.pid, signal.SIGKILL)
        evs = await rt.log.read(sid)
        fin = [e for e in evs if e.type == T.GENERATION_FINISHED]
        assert [f.body["finish_reason"] for f in fin] == ["error"]
        assert fin[0].body["completion_tokens"] == sum(e.type == T.GENERATION_TOKEN for e in evs)
        with pytest.raises(EngineError):
            rt.engine.cached_length(sid)
        assert rt.engine.failure() == "engine worker process exited (code -9)"
    finally:
        await rt.aclose()


async def test_healthz_answers_503_once_the_worker_is_gone(sqlite_url: str) -> None:
    """A worker that dies while idle (nothing reading its pipe) is noticed by the probe."""
    import httpx

    from sessiontape.transports.http.server.app import create_app

    cfg = make_config(sqlite_url, engine={"name": "reference", "process": "worker"})
    rt = await Runtime.create(cfg)
    app = create_app(rt)
    try:
        async with httpx.AsyncClient(
            transport=httpx.ASGITransport(app=app), base_url="http://test"
        ) as c:
            ok = await c.get("/healthz")
            assert (ok.status_code, ok.json()["status"]) == (200, "ok")
            assert isinstance(rt.engine, WorkerEngine)
            rt.engine._proc.kill()
            rt.engine._proc.wait(10)
            gone = await c.get("/healthz")
            assert gone.status_code == 503
            assert gone.json() == {
                "status": "unavailable",
                "engine": "reference",
                "error": "engine worker process exited (code -9)",
            }
    finally:
        await app.state.api.aclose()
        await rt.aclose()


async def test_the_grpc_health_service_turns_not_serving_once_the_worker_is_gone(
    sqlite_url: str, port: int
) -> None:
    import grpc
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    from sessiontape.transports.grpc.plugin import GrpcTransport

    cfg = make_config(
        sqlite_url,
        engine={"name": "reference", "process": "worker"},
        transports={"grpc": {"enabled": True, "listen": f"127.0.0.1:{port}"}},
    )
    rt = await Runtime.create(cfg)
    transport = GrpcTransport(rt, cfg.transports["grpc"], cfg)
    await transport.start()
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{transport.port}") as ch:
            health = health_pb2_grpc.HealthStub(ch)
            check = health_pb2.HealthCheckRequest
            Status = health_pb2.HealthCheckResponse
            assert (await health.Check(check(service=""))).status == Status.SERVING
            assert isinstance(rt.engine, WorkerEngine)
            rt.engine._proc.kill()
            rt.engine._proc.wait(10)
            for service in ("", "kakeya.v1.RuntimeService"):
                assert (await health.Check(check(service=service))).status == Status.NOT_SERVING
    finally:
        await transport.stop(1.0)
        await rt.aclose()


@pytest.fixture(scope="module", params=[(2, 0.0), (256, 0.0005)], ids=["window2", "window256"])
def shared_worker(request: pytest.FixtureRequest) -> Iterator[WorkerEngine]:
    """One worker for every example of a property (a tiny window exercises credit)."""
    window, flush_s = request.param
    engine = WorkerEngine("reference", window=window, flush_s=flush_s)
    yield engine
    asyncio.run(engine.aclose())


@settings(
    max_examples=25,
    deadline=None,
    derandomize=True,
    suppress_health_check=[HealthCheck.function_scoped_fixture],
)
@given(
    history=st.lists(st.integers(0, 255), min_size=1, max_size=40),
    temperature=st.sampled_from([0.0, 0.7, 1.3]),
    top_k=st.sampled_from([0, 5]),
    seed=st.integers(0, 2**63 - 1),
    max_tokens=st.integers(0, 30),
    logprob_top_k=st.sampled_from([0, 2]),
    stop=st.integers(0, 35),
)
async def test_property_any_stop_takes_a_prefix_of_the_inline_steps_and_leaves_the_worker_whole(
    shared_worker: WorkerEngine,
    history: list[int],
    temperature: float,
    top_k: int,
    seed: int,
    max_tokens: int,
    logprob_top_k: int,
    stop: int,
) -> None:
    params = SamplingParams(max_tokens=max_tokens, temperature=temperature, top_k=top_k, seed=seed)
    options = OutputOptions(logprob_top_k=logprob_top_k, logprob_ranges=((0, 3),))
    here = ReferenceEngine()
    want = [s async for s in here.generate("k", history, params, options)]
    key = f"p{seed}-{stop}"
    got: list[Step] = []
    agen = shared_worker.generate(key, history, params, options)
    async for s in agen:
        got.append(s)
        if len(got) > stop:
            break
    await agen.aclose()  # type: ignore[attr-defined]
    assert got == want[: len(got)] and len(got) == min(stop + 1, len(want))
    # the stop settled: the same worker goes on with the whole generation, identical
    again = [s async for s in shared_worker.generate(key, history, params, options)]
    assert again == want
    shared_worker.forget(key)


async def test_a_generations_end_brings_the_cache_state_and_later_changes_ask_the_child(
    tmp_path: Path,
) -> None:
    """What the runtime asks as every generation ends (``cached_length``,
    ``kv_total_bytes``) is answered from the state the end carried, without waiting on
    the child; after anything that changes the session's cache (a stop, a rewind, a
    fork, a forget) the answer is the child's again, never the old copy."""
    from sessiontape.engines.onnx.demo import build_demo

    folder = tmp_path / "tiny"
    build_demo("tiny", folder)
    engine = WorkerEngine("onnx", {"model_dir": str(folder), "intra_op_threads": 1})
    asked: list[str] = []
    real_call = engine._call

    def call(method: str, *args: object) -> object:
        asked.append(method)
        return real_call(method, *args)

    engine._call = call  # type: ignore[method-assign]

    def truth(key: str) -> tuple[int | None, int]:
        before = len(asked)
        value = (real_call("cached_length", key), real_call("kv_total_bytes"))
        del asked[before:]
        return value

    params = SamplingParams(max_tokens=10, temperature=0.0, seed=3)
    try:
        got = [s async for s in engine.generate("a", HISTORY, params)]
        assert len(got) == 10
        assert (engine.cached_length("a"), engine.kv_total_bytes()) == truth("a")
        assert engine.cached_length("a") is not None
        assert asked == []  # both from the end's state
        engine.rewind("a", 5)
        assert engine.cached_length("a") == truth("a")[0] == 5
        assert asked == ["rewind", "cached_length"]
        engine.fork("a", "b", 4)
        assert engine.cached_length("b") == truth("b")[0]
        agen = engine.generate("a", HISTORY, params)
        await anext(agen)  # type: ignore[call-overload]
        await agen.aclose()  # type: ignore[attr-defined]
        asked.clear()
        assert engine.cached_length("a") == truth("a")[0]
        assert asked == ["cached_length"]  # a stop made the copy stale
        [s async for s in engine.generate("a", HISTORY, params)]
        engine.forget("a")
        asked.clear()
        assert engine.cached_length("a") == truth("a")[0]
        assert asked == ["cached_length"]
    finally:
        await engine.aclose()


async def test_a_sessions_later_histories_reach_the_child_whole(worker: WorkerEngine) -> None:
    """A generation sends the child what its history adds to the one sent before for that
    session (the child keeps that); a history that grew, changed, shrank or follows a
    forget must still reach the engine whole: the steps are the inline engine's."""
    here = ReferenceEngine(eos_bias=-1000.0)
    params = SamplingParams(max_tokens=6, temperature=0.8, seed=11)
    grown = [*HISTORY, 33, 34]
    changed = [*HISTORY[:-1], 7, 33, 34]
    for history in (HISTORY, grown, grown, changed, HISTORY[:3], [], HISTORY):
        got = [s async for s in worker.generate("h", history, params)]
        want = [s async for s in here.generate("h", history, params)]
        assert got == want, history
        if history == grown:
            worker.forget("h")


def _counting_batches(engine: WorkerEngine) -> dict[int, int]:
    """Steps messages by generation id, as the server's side receives them."""
    seen: dict[int, int] = {}
    dispatch = engine._dispatch

    def counted(msg: tuple[object, ...]) -> None:
        if msg[0] == "steps":
            gid = msg[1]
            assert isinstance(gid, int)
            seen[gid] = seen.get(gid, 0) + 1
        dispatch(msg)

    engine._dispatch = counted  # type: ignore[method-assign]
    return seen


async def test_a_short_generation_within_the_servers_linger_comes_in_one_batch() -> None:
    """Steps slower than ``flush_s / 2`` were sent one a write; a short generation whose
    rest comes within the server's ``linger_s`` at its pace is held to its end (the runtime
    commits it as one run anyway). A slow engine's short generation streams."""
    params = SamplingParams(max_tokens=8, temperature=0.0, seed=1)
    # steps of about 0.4 ms: more than flush_s / 2, 7 of them well within linger_s (5 ms)
    engine = WorkerEngine("reference", {"eos_bias": -1000.0, "step_delay_s": 0.0004})
    seen = _counting_batches(engine)
    try:
        # the child's first generation is slower than its pace (its first steps' timers)
        assert len([s async for s in engine.generate("f", HISTORY, params)]) == 8
        for _ in range(3):
            seen.clear()
            assert len([s async for s in engine.generate("f", HISTORY, params)]) == 8
            assert list(seen.values()) == [1]
    finally:
        await engine.aclose()
    slow = WorkerEngine("reference", {"eos_bias": -1000.0, "step_delay_s": 0.01})
    seen = _counting_batches(slow)
    try:
        got = [s async for s in slow.generate("s", HISTORY, SamplingParams(max_tokens=16))]
        assert len(got) == 16 and sum(seen.values()) >= 10  # as they come, but the last
    finally:
        await slow.aclose()


async def test_a_short_generation_at_the_engines_pace_comes_in_one_batch() -> None:
    """Steps faster than ``flush_s`` are held for others to share their write; a
    generation whose rest comes within twice that at its pace is held to its end, so
    the server takes it as one run (one commit). A long one still comes in batches."""
    # steps of about 8 ms: held (faster than flush_s / 2); 16 of them outlast flush_s
    # (0.1 s), which flushed them in two batches, but fit in 2 * flush_s
    engine = WorkerEngine("reference", {"eos_bias": -1000.0, "step_delay_s": 0.008}, flush_s=0.1)
    batches: list[int] = []
    dispatch = engine._dispatch

    def counted(msg: tuple[object, ...]) -> None:
        if msg[0] == "steps":
            batches.append(len(msg[2]))  # type: ignore[arg-type]
        dispatch(msg)

    engine._dispatch = counted  # type: ignore[method-assign]
    try:
        for _ in range(2):
            batches.clear()
            got = [s async for s in engine.generate("b", HISTORY, SamplingParams(max_tokens=16))]
            assert len(got) == 16 and batches == [16]
        batches.clear()  # 40 steps outlast 2 * flush_s: batches as before
        got = [s async for s in engine.generate("b", HISTORY, SamplingParams(max_tokens=40))]
        assert len(got) == 40 and len(batches) > 1 and sum(batches) == 40
    finally:
        await engine.aclose()
