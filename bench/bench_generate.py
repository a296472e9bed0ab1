"""Token-path benchmark: tokens per second through the log against the engine alone.

    .venv/bin/python bench/bench_generate.py [--engine reference|onnx] [--size small]
        [--tokens 400] [--sessions 1,8] [--rounds 5] [--pg URL | --no-pg] [--wires]
        [--wire-rows sse,kakeya,salience,evergreen,openai,nostr,ceilings]
        [--engine-process inline|worker] [--client-cpu last|none|N] [--linger-s S]
        [--nostr-relay nostr-relay|nostr-sdk]

Every row is measured in interleaved rounds in one run: a round generates the
same greedy tokens once with the engine alone (``Engine.generate`` driven
directly, nothing stored) and once through ``Runtime.generate`` (every token
committed to the log before it is yielded), the two back to back, the first
of them alternating. The table shows each path's median rate and the median
of the rounds' own ratios. ``--wires`` adds one row per transport: the same generation received
by a client over the wire (SSE, Kakeya, Salience, Evergreen, an OpenAI chat
completion stream read with the ``openai`` package, and a Nostr D4 call's
streamed results through a relay in its own process), with the median and 95th percentile time
from a token's commit to its arrival at the client (for Nostr, at the
partial result that first holds it) and the CPU time per token of the
server (``time.process_time`` of this process, all its threads, while the
client receives the stream) and of the client process: steadier measures
than tokens per second on a machine whose speed drifts. ``--wire-rows``
picks some of them. The client process is pinned to one CPU (the last, unless
``--client-cpu`` says otherwise; the server is not pinned): left to float on
a 2-core machine, the client's gRPC threads and the server's wake each other
across cores, which costs the gRPC rows a third of their rate. Each client makes its calls before the
clock starts (opens its session, appends the prompt; the OpenAI client makes a
short streamed request, so the package's first-use costs in a fresh process
are not counted as the wire's).
"""

from __future__ import annotations

import argparse
import asyncio
import bisect
import contextlib
import os
import re
import statistics
import sys
import tempfile
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from sessiontape.core import gctune
from sessiontape.core.config import Config
from sessiontape.core.document.text import TextStream
from sessiontape.core.engine.interface import Engine, SamplingParams
from sessiontape.core.events import T
from sessiontape.core.generation.request import GenerateRequest
from sessiontape.core.plugins import ENGINES, TRANSPORTS, load
from sessiontape.core.runtime import Runtime

PROMPT = "The quick brown fox jumps over the lazy dog. " * 2


def row(name: str, alone: str, through: str, ratio: str, extra: str = "") -> None:
    print(f"| {name:44} | {alone:>14} | {through:>14} | {ratio:>7} | {extra:>26} |", flush=True)


#: ``--model``: the onnx engine's model source (a registry name, a GGUF file, a folder)
MODEL: str | None = None


def make_engine(name: str, size: str, process: str = "inline", **extra: Any) -> Engine:
    """The engine ``name`` in this process, or (``process="worker"``) served from a worker
    process as ``[engine] process = "worker"`` serves it."""
    source = {"model": MODEL} if MODEL else {"size": size}
    opts: dict[str, Any] = source if name == "onnx" else {"max_length": 8192}
    opts.update(extra)
    if process == "worker":
        from sessiontape.core.engine.worker import WorkerEngine

        return WorkerEngine(name, opts)
    return load(ENGINES, name)(**opts)  # type: ignore[no-any-return]


def params(tokens: int) -> SamplingParams:
    return SamplingParams(max_tokens=tokens, temperature=0.0, seed=1)


async def engine_alone(engine: Engine, sessions: int, tokens: int) -> float:
    """Total tok/s of ``sessions`` concurrent generations, engine only."""
    prompt = engine.tokenize(PROMPT)

    async def one(i: int) -> int:
        key = f"alone-{i}-{time.monotonic_ns()}"
        n = 0
        async for step in engine.generate(key, prompt, params(tokens)):
            n += not step.is_prefill
        engine.forget(key)
        return n

    t0 = time.perf_counter()
    counts = await asyncio.gather(*(one(i) for i in range(sessions)))
    return sum(counts) / (time.perf_counter() - t0)


async def through_log(rt: Runtime, sessions: int, tokens: int) -> float:
    """Total tok/s of ``sessions`` concurrent generations through Runtime.generate."""
    prompt = rt.engine.tokenize(PROMPT)
    sids = []
    for _ in range(sessions):
        st = await rt.open_session("bench", eos_token_ids=[])
        await rt.append_tokens(st.session_id, prompt)
        sids.append(st.session_id)

    async def one(sid: str) -> int:
        n = 0
        async for e in rt.generate(sid, GenerateRequest(params(tokens))):
            n += e.type == T.GENERATION_TOKEN and not e.body["is_prefill"]
        return n

    t0 = time.perf_counter()
    counts = await asyncio.gather(*(one(s) for s in sids))
    dt = time.perf_counter() - t0
    for sid in sids:
        await rt.close(sid)
    return sum(counts) / dt


async def open_runtime(url: str, engine: Engine) -> Runtime:
    cfg = Config.load(environ={}, overrides={"database": {"url": url}})
    return await Runtime.create(cfg, engine=engine)


async def compare(
    name: str,
    rounds: int,
    alone: Callable[[], Awaitable[float]],
    through: Callable[[], Awaitable[float]],
    extra: Callable[[], str] = lambda: "",
) -> float:
    """One row: the medians of each path's rates, and the median of the rounds' own
    ratios (each round measures both paths back to back, the first of them
    alternating, so a drift in the machine's speed cancels within a round;
    a ratio of the two medians would pair rates from different moments)."""
    a, b = [], []
    await alone()  # warm up both paths once
    await through()
    for i in range(rounds):
        if i % 2:
            b.append(await through())
            a.append(await alone())
        else:
            a.append(await alone())
            b.append(await through())
    ma, mb = statistics.median(a), statistics.median(b)
    ratio = statistics.median(y / x for x, y in zip(a, b, strict=True))
    row(name, f"{ma:,.0f} tok/s", f"{mb:,.0f} tok/s", f"{ratio:.3f}", extra())
    return ratio


# -- wires -----------------------------------------------------------------


class _Clock:
    """Commit times of generated tokens (taken when the log's writer settles a
    commit, before anything sees it), and how long the generation's text was
    after each token (decoded as the transports decode it, once the round is
    over: the server's loop pays only for noting the time), so an arrival
    keyed by characters (a text chunk) finds the token that completed it."""

    def __init__(self, detokenize: Callable[[Sequence[int]], str]) -> None:
        self.detokenize = detokenize
        self.by_position: dict[int, float] = {}  # log position -> commit time
        self.in_order: list[float] = []  # commit times of this generation's tokens, in order
        self.tokens: list[int] = []  # those tokens
        self._chars: list[int] = []  # the text's length after each of them (decoded lazily)
        self._length = 0
        self.text = TextStream(detokenize)
        self.lat: list[float] = []

    def watch(self, rt: Runtime) -> None:
        writer = rt.log.writer
        on_commit = writer.on_commit

        def timed(evs: list[Any]) -> None:
            self.committed(evs)
            on_commit(evs)

        writer.on_commit = timed

    def committed(self, evs: list[Any]) -> None:
        now = time.perf_counter()
        for e in evs:
            if e.type == T.GENERATION_TOKEN and not e.body["is_prefill"]:
                self.by_position[e.position] = now
                self.in_order.append(now)
                self.tokens.append(int(e.body["token"]))

    @property
    def chars(self) -> list[int]:
        for tok in self.tokens[len(self._chars) :]:
            self._length += len(self.text.push(tok))
            self._chars.append(self._length)
        return self._chars

    def start(self) -> None:
        self.in_order.clear()
        self.by_position.clear()
        self.tokens.clear()
        self._chars.clear()
        self._length = 0
        self.text = TextStream(self.detokenize)

    def committed_at(self, wire: str, key: int) -> float | None:
        """When the token an arrival stands for committed: ``key`` is a log position
        (SSE), a text length (Evergreen, OpenAI: the token that made the text that
        long), or the token's index (Kakeya, Salience, Nostr)."""
        if wire == "sse":
            return self.by_position.get(key)
        if wire in ("evergreen", "openai"):
            key = bisect.bisect_left(self.chars, key)
        return self.in_order[key] if key < len(self.in_order) else None


def _mark(what: str) -> None:
    """Tell the server process (reading this client's stdout) that the timed part
    starts or ends, so its CPU count covers the stream alone."""
    print(what, flush=True)


async def wire_client(
    wire: str, gport: int, hport: int, tokens: int, nostr: str = ""
) -> dict[str, Any]:
    """One generation received over ``wire`` (run in a separate process, as a real client is).

    Returns the token count, the time from request to last token, and each
    token's arrival time (``time.perf_counter``, one clock for every process on
    this machine) keyed by its index (gRPC, OpenAI, Nostr) or its log position
    (SSE). ``nostr``: "relay url,function id,worker pubkey" for the Nostr wire."""
    if wire == "openai":
        return await _openai_client(hport, tokens)
    if wire == "nostr":
        url, fid, worker = nostr.split(",")
        return await _nostr_client(url, fid, worker, tokens)
    import grpc
    import httpx

    from sessiontape.engines.byte_tokenizer import ByteTokenizer
    from sessiontape.transports.grpc.client import (
        EvergreenClient,
        action,
        sampling_config,
        text_fragments,
    )
    from sessiontape.transports.grpc.gen.kakeya.v1 import runtime_pb2 as kpb
    from sessiontape.transports.grpc.gen.kakeya.v1 import runtime_pb2_grpc as kgrpc
    from sessiontape.transports.grpc.gen.salience.v1 import salience_pb2 as spb
    from sessiontape.transports.grpc.gen.salience.v1 import salience_pb2_grpc as sgrpc

    prompt = ByteTokenizer(259).encode(PROMPT)
    arrivals: list[tuple[int, float]] = []
    n = 0
    if wire == "sse":
        async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{hport}", timeout=60) as http:
            sid = (await http.post("/v1/sessions", json={"eos_token_ids": []})).json()["id"]
            await http.post(f"/v1/sessions/{sid}/append", json={"tokens": prompt})
            _mark("start")
            t0, c0 = time.perf_counter(), time.process_time()
            ids = re.compile(rb"(?:^|\n)id: ?(\d+)")
            tail = b""
            async with http.stream(
                "POST",
                f"/v1/sessions/{sid}/generate",
                json={"max_tokens": tokens, "temperature": 0, "seed": 1},
            ) as resp:
                # a client that reads what it needs from each chunk (event ids), as a browser's
                # EventSource does in native code, rather than a Python line iterator
                async for chunk in resp.aiter_raw():
                    now = time.perf_counter()
                    buf = tail + chunk
                    cut = buf.rfind(b"\n\n") + 2
                    arrivals.extend((int(m), now) for m in ids.findall(buf[:cut]))
                    tail = buf[cut:]
            dt, cpu = time.perf_counter() - t0, time.process_time() - c0
            _mark("end")
            doc = (await http.get(f"/v1/sessions/{sid}")).json()
            n = len(doc["generations"][-1]["tokens"])
        return {"n": n, "dt": dt, "client_cpu": cpu, "arrivals": arrivals}
    async with grpc.aio.insecure_channel(f"127.0.0.1:{gport}") as chan:
        if wire == "kakeya":
            kakeya = kgrpc.RuntimeServiceStub(chan)
            sid = (
                await kakeya.CreateSession(kpb.CreateSessionRequest(eos_token_ids=[]))
            ).session_id
            await kakeya.AppendTokens(kpb.AppendTokensRequest(session_id=sid, token_ids=prompt))
            _mark("start")
            t0, c0 = time.perf_counter(), time.process_time()
            async for m in kakeya.Generate(
                kpb.GenerateRequest(session_id=sid, max_tokens=tokens, seed=1, temperature=0.0)
            ):
                if m.WhichOneof("payload") == "token_id":
                    arrivals.append((n, time.perf_counter()))
                    n += 1
        elif wire == "salience":
            salience = sgrpc.SalienceStub(chan)
            sid = (await salience.OpenSession(spb.OpenSessionRequest())).session_id
            # the prompt goes in first, as the other rows append theirs before the clock
            # starts (Salience appends with a Generate of no tokens)
            async for _ in salience.Generate(
                spb.GenerateRequest(session_id=sid, offset=0, append_tokens=prompt)
            ):
                pass
            _mark("start")
            t0, c0 = time.perf_counter(), time.process_time()
            async for m in salience.Generate(
                spb.GenerateRequest(session_id=sid, offset=len(prompt), max_tokens=tokens, top_k=1)
            ):
                if m.WhichOneof("event") == "token" and not m.token.is_prefill:
                    arrivals.append((n, time.perf_counter()))
                    n += 1
        else:
            async with EvergreenClient(f"127.0.0.1:{gport}") as ev, ev.session() as s:
                _mark("start")
                t0, c0 = time.perf_counter(), time.process_time()
                await s.send(
                    actions=[
                        action(
                            "GENERATE",
                            inputs={"p": "p"},
                            outputs={"text": "r"},
                            configs=[sampling_config(max_tokens=tokens, seed=1, temperature=0.0)],
                        )
                    ],
                    fragments=text_fragments("p", PROMPT),
                )
                await s.done_writing()
                async for m in s:
                    for f in m.node_fragments:
                        if f.id == "r" and f.HasField("chunk_fragment") and f.chunk_fragment.data:
                            n += len(f.chunk_fragment.data.decode("utf-8", "replace"))
                            arrivals.append((n, time.perf_counter()))  # by text length
        dt, cpu = time.perf_counter() - t0, time.process_time() - c0
        _mark("end")
    return {"n": n, "dt": dt, "client_cpu": cpu, "arrivals": arrivals}


async def _openai_client(hport: int, tokens: int) -> dict[str, Any]:
    """A streamed chat completion read with the official ``openai`` package."""
    import openai

    arrivals: list[tuple[int, float]] = []
    async with openai.AsyncOpenAI(
        base_url=f"http://127.0.0.1:{hport}/v1", api_key="bench", max_retries=0
    ) as client:
        model = (await client.models.list()).data[0].id
        # A short streamed request first, as the other rows' clients make their calls
        # before the clock: the package builds its chunk models on first use, and in a
        # fresh process that puts milliseconds between the first chunk's arrival and
        # its delivery, which the row would count as the wire's latency and time.
        warm = await client.chat.completions.create(
            model=model,
            messages=[{"role": "user", "content": PROMPT}],
            max_tokens=2,
            temperature=0,
            seed=1,
            stream=True,
            stream_options={"include_usage": True},
        )
        async for _ in warm:
            pass
        _mark("start")
        t0, c0 = time.perf_counter(), time.process_time()
        stream = await client.chat.completions.create(
            model=model,
            messages=[{"role": "user", "content": PROMPT}],
            max_tokens=tokens,
            temperature=0,
            seed=1,
            stream=True,
            stream_options={"include_usage": True},
        )
        chars, n = 0, 0
        async for chunk in stream:
            if chunk.choices and chunk.choices[0].delta.content:
                chars += len(chunk.choices[0].delta.content)
                arrivals.append((chars, time.perf_counter()))  # by text length
            if chunk.usage is not None:
                n = chunk.usage.completion_tokens
        dt, cpu = time.perf_counter() - t0, time.process_time() - c0
        _mark("end")
    return {"n": n, "dt": dt, "client_cpu": cpu, "arrivals": arrivals}


async def _nostr_client(relay: str, fid: str, worker: str, tokens: int) -> dict[str, Any]:
    """A D4 call published to ``relay`` for function ``fid``, read until its final
    result: each partial result's arrival is keyed by the tokens it holds."""
    import datetime
    import json

    import nostr_sdk as ns

    ns.uniffi_set_event_loop(asyncio.get_running_loop())
    keys = ns.Keys.generate()
    client = ns.ClientBuilder().build()
    await client.add_relay(ns.RelayUrl.parse(relay))
    await client.connect(datetime.timedelta(seconds=5))
    notes = client.notifications()
    await client.subscribe(
        ns.ReqTarget.auto(
            [
                ns.Filter()
                .author(ns.PublicKey.parse(worker))
                .kinds([ns.Kind(1)])
                .since(ns.Timestamp.from_secs(int(time.time()) - 60))
            ]
        )
    )
    # the connection and the subscription are set up before the clock, as the other
    # rows' clients make their calls first: the relay's end of stored events says both are
    while True:
        note = await asyncio.wait_for(notes.next(), 60)
        if note.is_message() and note.message.as_enum().is_end_of_stored_events():
            break
    body = {
        "max_iteration_cost": 1000,
        "max_total_cost": 1000 * tokens,
        "results": 1,
        "version": "0.1.0",
        "args": {"prompt": PROMPT, "temperature": 0.0, "seed": 1, "max_tokens": tokens},
    }
    call = (
        ns.EventBuilder(ns.Kind(1), json.dumps(body))
        .tags([ns.Tag.parse(["e", fid])])
        .finalize(keys)
    )
    call_id = json.loads(call.as_json())["id"]
    arrivals: list[tuple[int, float]] = []
    _mark("start")
    t0, c0 = time.perf_counter(), time.process_time()
    out = await client.send_event(call)
    assert out.success, f"the relay refused the call: {out.failed}"
    n = 0
    while True:
        note = await asyncio.wait_for(notes.next(), 60)
        if not note.is_new_event():
            continue
        ev = json.loads(note.event.as_json())
        if [t[1] for t in ev["tags"] if t[0] == "e"][:1] != [call_id]:
            continue
        content = json.loads(ev["content"])
        if content.get("err"):
            raise RuntimeError(f"the worker answered with an error: {content['err']}")
        if content.get("result") is None:
            continue
        got = json.loads(content["result"])["usage"]["completion_tokens"]
        arrivals.append((got - 1, time.perf_counter()))
        if not content.get("partial"):
            n = got
            break
    dt, cpu = time.perf_counter() - t0, time.process_time() - c0
    _mark("end")
    await client.shutdown()
    return {"n": n, "dt": dt, "client_cpu": cpu, "arrivals": arrivals}


RELAYS = ("nostr-relay", "nostr-sdk")


async def start_relay(kind: str, workdir: Path) -> tuple[asyncio.subprocess.Process, str]:
    """A loopback relay in a process of its own: the ``nostr-relay`` package (Python,
    SQLite storage, signatures checked) or nostr-sdk's ``LocalRelay``; returns it and its URL.

    nostr-sdk's relay leaves Nagle's algorithm on its sockets: a result it sends a client
    within about 40 ms of its last message to that client (the call's ``OK``) waits for
    the client's delayed acknowledgement, which adds about 20 ms to each of this row's
    400-token answers. ``nostr-relay`` writes at once.
    """
    if kind == "nostr-sdk":
        proc = await asyncio.create_subprocess_exec(
            sys.executable,
            __file__,
            "--relay",
            stdin=asyncio.subprocess.PIPE,
            stdout=asyncio.subprocess.PIPE,
        )
        assert proc.stdout is not None
        return proc, (await proc.stdout.readline()).decode().strip()
    import json
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = int(sock.getsockname()[1])
    from tests.helpers.nostr_relay_config import nostr_relay_config

    config = workdir / "relay.json"
    config.write_text(json.dumps(nostr_relay_config(workdir, port)))
    proc = await asyncio.create_subprocess_exec(
        str(Path(sys.executable).parent / "nostr-relay"),
        "-c",
        str(config),
        "serve",
        "--use-uvicorn",
        cwd=workdir,
        stdin=asyncio.subprocess.DEVNULL,
        stdout=asyncio.subprocess.DEVNULL,
        stderr=asyncio.subprocess.DEVNULL,
        preexec_fn=_die_with_parent,
    )
    deadline = time.monotonic() + 30
    while True:
        try:
            _, writer = await asyncio.open_connection("127.0.0.1", port)
        except OSError:
            if proc.returncode is not None or time.monotonic() > deadline:
                await stop_relay(proc)
                raise RuntimeError("nostr-relay did not start") from None
            await asyncio.sleep(0.1)
            continue
        writer.close()
        return proc, f"ws://127.0.0.1:{port}"


def _die_with_parent() -> None:
    """In the relay's process before it runs: SIGTERM when the benchmark's process ends,
    however it ends (Linux's ``PR_SET_PDEATHSIG``; elsewhere nothing)."""
    import ctypes
    import signal

    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM)  # 1: PR_SET_PDEATHSIG


async def stop_relay(proc: asyncio.subprocess.Process) -> None:
    """Stop a relay :func:`start_relay` started (killed if it has not ended in 10 s)."""
    if proc.returncode is not None:
        return
    if proc.stdin is not None:  # nostr-sdk's stops when its stdin closes
        proc.stdin.close()
    else:
        proc.terminate()
    try:
        await asyncio.wait_for(proc.wait(), 10)
    except TimeoutError:
        proc.kill()
        await proc.wait()


async def run_relay() -> None:
    """A nostr-sdk relay on a free loopback port (printed), until stdin closes."""
    import nostr_sdk as ns

    ns.uniffi_set_event_loop(asyncio.get_running_loop())
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = int(sock.getsockname()[1])
    relay = (
        ns.LocalRelayBuilder()
        .addr("127.0.0.1")
        .port(port)
        .rate_limit(ns.RateLimit(max_reqs=1000, notes_per_minute=1_000_000))
        .build()
    )
    await relay.run()
    print(f"ws://127.0.0.1:{port}", flush=True)
    await asyncio.get_running_loop().run_in_executor(None, sys.stdin.read)
    relay.shutdown()


async def run_client(
    wire: str,
    gport: int,
    hport: int,
    tokens: int,
    nostr: str = "",
    on_start: Callable[[], None] | None = None,
) -> dict[str, Any]:
    """:func:`wire_client` in a separate process (as a real client is); its result, with
    ``server_cpu``: this process's CPU seconds while the client received the stream
    (from its request to its last token, not its setup or what it reads after).
    ``on_start`` runs when the client says its timed part starts: what it committed
    before (the OpenAI client's warm-up request) is not the timed generation's."""
    import json

    proc = await asyncio.create_subprocess_exec(
        sys.executable,
        __file__,
        "--client",
        wire,
        "--client-cpu",
        "none" if CLIENT_CPU is None else str(CLIENT_CPU),
        "--ports",
        f"{gport},{hport}",
        "--tokens",
        str(tokens),
        *(["--nostr", nostr] if nostr else []),
        stdin=asyncio.subprocess.PIPE,
        stdout=asyncio.subprocess.PIPE,
    )
    assert proc.stdin is not None and proc.stdout is not None
    await proc.stdout.readline()  # imported and ready
    proc.stdin.write(b"go\n")
    await proc.stdin.drain()
    assert (await proc.stdout.readline()).strip() == b"start"  # the session is set up
    if on_start is not None:
        on_start()
    c0 = time.process_time()
    assert (await proc.stdout.readline()).strip() == b"end"  # the last token is in
    cpu = time.process_time() - c0
    out = await proc.stdout.read()
    await proc.wait()
    res: dict[str, Any] = json.loads(out)
    res["server_cpu"] = cpu
    return res


#: the CPU the wire clients are pinned to (``--client-cpu``); None: not pinned
CLIENT_CPU: int | None = None


def client_cpu(arg: str) -> int | None:
    """``--client-cpu``: ``last`` (the last CPU this process may run on, when it may
    run on two or more), ``none``, or one of those CPUs' numbers."""
    if arg == "none" or not hasattr(os, "sched_getaffinity"):
        return None
    cpus = sorted(os.sched_getaffinity(0))
    if arg == "last":
        return cpus[-1] if len(cpus) >= 2 else None
    if not arg.isdigit() or int(arg) not in cpus:
        raise ValueError(f"--client-cpu: {arg!r} is not last, none or one of CPUs {cpus}")
    return int(arg)


WIRES = ("sse", "kakeya", "salience", "evergreen", "openai", "nostr", "ceilings")


async def wire_rows(
    engine: Engine,
    served: Engine,
    url: str,
    tokens: int,
    rounds: int,
    only: frozenset[str] = frozenset(WIRES),
    generation: dict[str, Any] | None = None,
    relay_kind: str = "nostr-relay",
) -> None:
    """The wire rows (those named in ``only``): ``engine`` alone against the server's
    path with ``served`` (the same engine object, or the same engine in a worker process);
    ``generation``: the server's ``[generation]`` settings beyond the defaults;
    ``relay_kind``: the Nostr row's relay (:func:`start_relay`)."""

    def free() -> int:
        import socket

        with socket.socket() as sock:
            sock.bind(("127.0.0.1", 0))
            return int(sock.getsockname()[1])

    if hasattr(served, "eos_bias"):
        served.eos_bias = -1000.0  # every wire generates its full count (Salience has no "no EOS")
    gport, hport = free(), free()
    cfg = Config.load(
        environ={},
        overrides={
            "database": {"url": url},
            "generation": generation or {},
            "transports": {
                "grpc": {"enabled": True, "listen": f"127.0.0.1:{gport}"},
                "http": {"enabled": True, "listen": f"127.0.0.1:{hport}"},
            },
        },
    )
    rt = await Runtime.create(cfg, engine=served)
    clock = _Clock(served.detokenize)
    clock.watch(rt)
    cpu: list[float] = []  # server CPU seconds per token of each round
    client_cpu: list[float] = []  # the client's, from its request to its last token
    grpc_t = load(TRANSPORTS, "grpc")(rt, cfg.transports["grpc"], cfg)
    http_t = load(TRANSPORTS, "http")(rt, cfg.transports["http"], cfg)
    # the Nostr wire: a relay in its own process, the D4 worker with its default pacing
    key_dir = tempfile.TemporaryDirectory()
    # the relay ends with this process even when a start below fails (_die_with_parent)
    relay, relay_url = await start_relay(relay_kind, Path(key_dir.name))
    key_file = Path(key_dir.name) / "worker.key"
    import nostr_sdk as ns

    ns.uniffi_set_event_loop(asyncio.get_running_loop())
    key_file.write_text(ns.Keys.generate().secret_key().to_bech32())
    nostr_t = load(TRANSPORTS, "nostr")(
        rt,
        {"relays": [relay_url], "key_file": str(key_file), "default_max_tokens": tokens},
        cfg,
    )
    await grpc_t.start()
    await http_t.start()
    await nostr_t.start()
    worker = nostr_t.worker
    nostr = f"{relay_url},{next(iter(worker.functions))},{worker.keys.public_key().to_hex()}"
    try:

        def via(wire: str) -> Callable[[], Awaitable[float]]:
            async def run() -> float:
                clock.start()
                # the OpenAI client's warm-up generation is not the timed one (its
                # timed generation commits nothing before its start line is read:
                # generation.started comes first, apart)
                warmed = clock.start if wire == "openai" else None
                res = await run_client(wire, gport, hport, tokens, nostr, on_start=warmed)
                if wire == "evergreen":
                    # its client sees text, not tokens: count the generation's tokens here
                    res["n"] = len(clock.in_order)
                cpu.append(res["server_cpu"] / max(1, res["n"]))
                client_cpu.append(res["client_cpu"] / max(1, res["n"]))
                for key, t in res["arrivals"]:
                    committed = clock.committed_at(wire, key)
                    if committed is not None:
                        clock.lat.append(t - committed)
                return float(res["n"]) / float(res["dt"])

            return run

        async def alone() -> float:
            return await engine_alone(engine, 1, tokens)

        def extra() -> str:
            lat = "n/a"
            if len(clock.lat) >= 2:
                p95 = statistics.quantiles(clock.lat, n=20)[-1]
                lat = f"{statistics.median(clock.lat) * 1e3:.2f} / {p95 * 1e3:.2f} ms"
            if not cpu:
                return lat
            us = statistics.median(cpu) * 1e6, statistics.median(client_cpu) * 1e6
            return f"{lat}, {us[0]:.0f} / {us[1]:.0f} us"

        for name, wire in (
            ("SSE generate stream", "sse"),
            ("Kakeya Generate", "kakeya"),
            ("Salience Generate", "salience"),
            ("Evergreen GENERATE", "evergreen"),
            ("OpenAI chat completion stream (openai)", "openai"),
            ("Nostr D4 call, streamed results", "nostr"),
        ):
            if wire not in only:
                continue
            clock.lat.clear()
            cpu.clear()
            client_cpu.clear()
            await compare(f"{name}, 1 session", rounds, alone, via(wire), extra)
        # the wire's own ceilings, to the same client: the same Kakeya messages from a
        # servicer that generates nothing (no engine, no log), from one that sends each
        # step of this engine as it comes (the engine and the wire, no log), and from one
        # whose engine runs ahead in a task of its own while the handler writes (the
        # pipelining of the server's path, without the log)
        for name, with_engine, pipelined in (
            ("Kakeya messages, no generation (ceiling)", False, False),
            ("Kakeya messages of engine steps, no log", True, False),
            ("Kakeya messages of engine steps run ahead, no log", True, True),
        ):
            if "ceilings" not in only:
                continue
            ceiling = await _bare_kakeya(tokens, engine if with_engine else None, pipelined)
            try:

                async def bare(port: int = ceiling.port) -> float:
                    res = await run_client("kakeya", port, hport, tokens)
                    cpu.append(res["server_cpu"] / max(1, res["n"]))
                    client_cpu.append(res["client_cpu"] / max(1, res["n"]))
                    return float(res["n"]) / float(res["dt"])

                clock.lat.clear()
                cpu.clear()
                client_cpu.clear()
                await compare(name, rounds, alone, bare, extra)
            finally:
                await ceiling.server.stop(0)
    finally:
        await nostr_t.stop()
        await http_t.stop()
        await grpc_t.stop()
        await rt.aclose()
        await stop_relay(relay)
        key_dir.cleanup()


class _Bare:
    def __init__(self, server: Any, port: int) -> None:
        self.server, self.port = server, port


async def generated_ids(engine: Engine, tokens: int) -> AsyncIterator[int]:
    """The token ids ``engine`` generates for the bench's prompt, with nothing stored."""
    key = f"bare-{time.monotonic_ns()}"
    try:
        async for step in engine.generate(key, engine.tokenize(PROMPT), params(tokens)):
            if not step.is_prefill:
                yield step.token_id
    finally:
        engine.forget(key)


async def _bare_kakeya(tokens: int, engine: Engine | None = None, pipelined: bool = False) -> _Bare:
    """A grpc.aio server (no runtime behind it) whose Kakeya Generate streams
    ``tokens`` ready-made messages,
    or, given ``engine``, one message per step of ``engine`` as it generates (no log);
    ``pipelined``: the engine generates in a task of its own, ahead of the writes."""
    import grpc

    from sessiontape.transports.grpc.gen.kakeya.v1 import runtime_pb2 as kpb
    from sessiontape.transports.grpc.gen.kakeya.v1 import runtime_pb2_grpc as kgrpc
    from sessiontape.transports.grpc.guard import GuardInterceptor

    class Bare(kgrpc.RuntimeServiceServicer):  # type: ignore[misc]
        async def CreateSession(self, request: Any, context: Any) -> Any:
            return kpb.CreateSessionResponse(session_id="bare")

        async def AppendTokens(self, request: Any, context: Any) -> Any:
            return kpb.AppendTokensResponse()

        async def Generate(self, request: Any, context: Any) -> Any:
            if engine is None:
                for i in range(request.max_tokens):
                    yield kpb.GenerateResponse(token_id=i % 250)
            elif not pipelined:
                async for tok in generated_ids(engine, request.max_tokens):
                    yield kpb.GenerateResponse(token_id=tok)
            else:
                ahead: asyncio.Queue[int | None] = asyncio.Queue()

                async def produce() -> None:
                    assert engine is not None
                    async for tok in generated_ids(engine, request.max_tokens):
                        ahead.put_nowait(tok)
                    ahead.put_nowait(None)

                producer = asyncio.create_task(produce())
                while (tok := await ahead.get()) is not None:
                    yield kpb.GenerateResponse(token_id=tok)
                await producer
            yield kpb.GenerateResponse(done=kpb.GenerateDone())

    server = grpc.aio.server(interceptors=[GuardInterceptor()])
    kgrpc.add_RuntimeServiceServicer_to_server(Bare(), server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    return _Bare(server, port)


async def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--engine", default="reference", choices=["reference", "onnx"])
    ap.add_argument("--size", default="small", help="demo model size for --engine onnx")
    ap.add_argument(
        "--model",
        default=None,
        help="--engine onnx: a model source instead of a demo size"
        " (smollm2-135m-instruct, a .gguf file, a folder)",
    )
    ap.add_argument("--tokens", type=int, default=400, help="tokens per generation")
    ap.add_argument("--sessions", default="1,8", help="comma-separated concurrent session counts")
    ap.add_argument("--rounds", type=int, default=5, help="interleaved rounds per row (median)")
    ap.add_argument(
        "--pg",
        default=os.environ.get("BENCH_PG_URL", "postgresql+asyncpg://postgres@127.0.0.1:5432/test"),
        help="PostgreSQL URL for the PostgreSQL rows",
    )
    ap.add_argument("--no-pg", action="store_true", help="skip the PostgreSQL rows")
    ap.add_argument(
        "--wires",
        action="store_true",
        help="add one row per transport (a client process over loopback)",
    )
    ap.add_argument(
        "--wire-rows",
        default=",".join(WIRES),
        help=f"with --wires: which wire rows (comma-separated among {', '.join(WIRES)})",
    )
    ap.add_argument(
        "--engine-process",
        default="inline",
        choices=["inline", "worker"],
        help="where the server's engine runs ([engine] process); the engine alone always "
        "runs in this process",
    )
    ap.add_argument(
        "--linger-s",
        type=float,
        default=None,
        help="with --wires: the server's [generation] linger_s (the default: the config's)",
    )
    ap.add_argument(
        "--client-cpu",
        default="last",
        help="the CPU the wire rows' client processes are pinned to: last (the default, "
        "when there are two or more), none, or a CPU number",
    )
    ap.add_argument(
        "--event-loop",
        default="auto",
        choices=("auto", "uvloop", "asyncio"),
        help="the server's event loop, as [server] event_loop (default auto: uvloop where "
        "installed, as `sessiontape serve` runs)",
    )
    ap.add_argument(
        "--nostr-relay",
        default="nostr-relay",
        choices=RELAYS,
        help="the Nostr row's relay: the nostr-relay package (the default) or nostr-sdk's "
        "LocalRelay, whose sockets leave Nagle's algorithm on",
    )
    ap.add_argument("--client", help=argparse.SUPPRESS)  # internal: be the client of one wire
    ap.add_argument("--ports", help=argparse.SUPPRESS)
    ap.add_argument("--nostr", default="", help=argparse.SUPPRESS)
    ap.add_argument("--relay", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument(
        "--default-gc",
        action="store_true",
        help="keep CPython's collector defaults instead of the server's (core/gctune.py)",
    )
    args = ap.parse_args()
    global MODEL
    MODEL = args.model
    unknown = set(args.wire_rows.split(",")) - set(WIRES)
    if unknown:
        ap.error(f"--wire-rows: no such row {', '.join(sorted(unknown))}")
    if not args.default_gc:
        gctune.tune_for_serving()  # as `sessiontape serve` runs with [server] tune_interpreter
    if args.relay:
        await run_relay()
        return
    global CLIENT_CPU
    try:
        CLIENT_CPU = client_cpu(args.client_cpu)
    except ValueError as exc:
        ap.error(str(exc))
    if args.client:
        import json

        if CLIENT_CPU is not None:
            os.sched_setaffinity(0, {CLIENT_CPU})
        gport, hport = (int(p) for p in args.ports.split(","))
        print("ready", flush=True)  # the server's CPU count starts now
        sys.stdin.readline()
        print(json.dumps(await wire_client(args.client, gport, hport, args.tokens, args.nostr)))
        return

    engine = make_engine(args.engine, args.size)
    worker = args.engine_process == "worker"

    def served(alone: Engine) -> Engine:
        """The engine the server runs: ``alone`` itself, or the same engine in a worker
        process (one that never samples EOS, as the wire rows need: Salience has no
        "no EOS"; the through-log rows open sessions without EOS ids, so it changes
        no count there)."""
        if not worker:
            return alone
        extra = {"eos_bias": -1000.0} if args.engine == "reference" else {}
        return make_engine(args.engine, args.size, "worker", **extra)

    print(
        f"engine {engine.info.name} ({engine.info.model_id}, {engine.info.provider}), "
        f"{args.tokens} greedy tokens per generation, {args.rounds} interleaved rounds, medians "
        "(ratio: of the rounds' ratios); "
        f"{os.cpu_count()} CPUs; event loop {type(asyncio.get_running_loop()).__module__}; "
        "the server's engine "
        + ("in a worker process" if worker else "in its process")
        + " (engine alone: in this process)\n"
    )
    if args.wires:
        pinned = "not pinned" if CLIENT_CPU is None else f"pinned to CPU {CLIENT_CPU}"
        print(f"wire rows: CPU per token of the server / of the client process ({pinned})\n")
    row("path", "engine alone", "through log", "ratio", "commit->client median / p95, CPU/token")
    row("-" * 44, "-" * 14, "-" * 14, "-" * 7, "-" * 26)
    counts = [int(x) for x in args.sessions.split(",")]
    with tempfile.TemporaryDirectory() as tmp:
        urls = [("SQLite", f"sqlite+aiosqlite:///{tmp}/bench.db")]
        if not args.no_pg:
            urls.append(("PostgreSQL", args.pg))
        for k, (label, url) in enumerate(urls):
            if k and not worker:  # closing a runtime closes its engine: each database gets its own
                engine = make_engine(args.engine, args.size)
            try:
                rt = await open_runtime(url, served(engine))
            except Exception as exc:  # PostgreSQL not answering
                row(f"{label}: skipped ({type(exc).__name__})", "", "", "")
                continue
            try:
                for n in counts:
                    await compare(
                        f"{label}, {n} session{'s' if n > 1 else ''}",
                        args.rounds,
                        lambda n=n, e=engine: engine_alone(e, n, args.tokens),  # type: ignore[misc]
                        lambda n=n, rt=rt: through_log(rt, n, args.tokens),
                    )  # type: ignore[misc]
            finally:
                with contextlib.suppress(Exception):
                    await rt.aclose()
            if args.wires and label == "SQLite":
                wire_engine = make_engine(args.engine, args.size)
                await wire_rows(
                    wire_engine,
                    served(wire_engine),
                    f"sqlite+aiosqlite:///{tmp}/wires.db",
                    args.tokens,
                    args.rounds,
                    frozenset(args.wire_rows.split(",")),
                    {} if args.linger_s is None else {"linger_s": args.linger_s},
                    args.nostr_relay,
                )


def _loop_factory() -> Any:
    """The benchmark's event loop: the server's (``--event-loop``, as ``[server] event_loop``;
    uvloop by default, as ``sessiontape serve`` runs); a wire client always runs asyncio's."""
    from sessiontape.core.commands.serve import loop_factory

    pre = argparse.ArgumentParser(add_help=False)
    pre.add_argument("--event-loop", default="auto")
    pre.add_argument("--client")
    known, _ = pre.parse_known_args()
    return None if known.client else loop_factory(known.event_loop)


if __name__ == "__main__":
    with asyncio.Runner(loop_factory=_loop_factory()) as runner:
        runner.run(main())
