"""Load benchmark: many sessions doing short turns at once, on every wire, against the engine alone.

    .venv/bin/python bench/bench_load.py [--mode load|turns|both] [--sessions 10,100,1000]
        [--seconds 20] [--tokens 16] [--append 3] [--wires http,sse,salience,kakeya,evergreen]
        [--db sqlite|URL] [--clients 1] [--client-cpu last|none|N] [--turn-count 1000]

The server is ``sessiontape serve`` in a process of its own, as it runs by default
(reference engine with EOS biased away, so every turn generates its full count; access
log on), on free loopback ports, with a fresh SQLite file (or, given ``--db
postgresql+asyncpg://...``, a fresh database on that server) for each row. The clients
are asyncio tasks, one per session, in ``--clients`` other processes pinned to one CPU
(the last, as bench_generate.py pins its wire clients), sharing what a client library
shares: gRPC channels (each channel its own connection), at most ``--per-channel``
sessions each (the server takes 100 concurrent streams a connection, and an Evergreen
session holds one for its life), and HTTP keep-alive pools, at most ``--per-pool``
sessions each (httpx scans its whole pool on every request, which with tens of
connections made the client the bottleneck: see ``Pool``).

A turn appends ``--append`` tokens and generates ``--tokens``, read to the end of the
answer: HTTP JSON (``POST /generate`` with ``tokens`` and ``stream: false``), SSE (the
same POST, streamed), Salience (one ``Generate`` with ``append_tokens``), Kakeya
(``AppendTokens`` then ``Generate``) and Evergreen (one message: a text node and a
GENERATE reading it, until the output's last fragment; Evergreen prompts are
self-contained, so each turn's prompt is its new text and the session's history is
replaced, keeping the common prefix); with ``--wires`` naming ``openai``, also the
OpenAI Responses API (``POST /v1/responses``, the turn's text as the user's message,
continuing the previous response). A turn's latency runs from its first request to
the end of its answer. A session that reaches ``--max-history`` tokens is closed and a
new one opened in its place (not timed; the server's CPU for it is counted; an HTTP
close asks for ``Prefer: return=minimal``, as a client that does not read the
document would).

``load``: for each count in ``--sessions``, the sessions are spread over ``--wires``
round-robin (a mixed fleet); each creates its session, takes one turn and waits; then
all of them send turns back to back for ``--seconds``. Per wire and in all: turns/s,
p50 / p99 / max latency, errors, and the fewest and the median turns one session
completed (a session that completed none starved). Server CPU per turn is the server
process's CPU time (all its threads, ``/proc/<pid>/stat``) from the start of the timed
part to the last answer, over the turns; memory per idle session is the server's RSS
once every session has taken its first turn, less its RSS before (after one warm-up
session per wire), over the sessions.

``turns``: one client sending turns one after another over ``--turn-wire`` (Kakeya):
the median time of a turn and the server's CPU per turn, then the same for a
generation of one token and no append (its time from request to end of stream).

Engine alone: the same engine generating the same tokens by itself in this process
(``Engine.generate`` driven directly, nothing stored), timed in the same run while the
server is idle; the tables give each row's ratio to it.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import math
import os
import re
import secrets
import statistics
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_generate import client_cpu, generated_ids, make_engine

from sessiontape.core import gctune
from sessiontape.core.engine.interface import Engine

WIRES = ("http", "sse", "salience", "kakeya", "evergreen", "openai")
#: the fleet's wires unless ``--wires`` names others (the issue's five)
DEFAULT_WIRES = ("http", "sse", "salience", "kakeya", "evergreen")
LABELS = {
    "http": "HTTP JSON",
    "sse": "SSE",
    "salience": "Salience",
    "kakeya": "Kakeya",
    "evergreen": "Evergreen",
    "openai": "OpenAI Responses",
}


def say(*lines: str) -> None:
    """A line to the orchestrating process (a client's stdout is its channel)."""
    print(*lines, sep="\n", flush=True)


async def heard() -> str:
    """The orchestrator's next line (a client waits on it between phases)."""
    return await asyncio.get_running_loop().run_in_executor(None, sys.stdin.readline)


def text_of(n: int) -> str:
    """``n`` characters of ASCII text: ``n`` tokens of the reference engine (one per byte)."""
    return ("hi there " * (n // 9 + 1))[:n]


# -- one session on one wire (client side) --------------------------------------------


class WireError(Exception):
    """A wire answered with a refusal or ended an answer early."""


class Session(Protocol):
    #: each turn's prompt replaces the session's history (Evergreen), which so never fills
    replaces_history: bool

    async def open(self) -> None: ...

    async def turn(self, append: str, tokens: int) -> int | None:
        """Append ``append`` (if any), generate ``tokens``; the count generated, if the wire says."""
        ...

    async def close(self) -> None: ...


def _ok(r: Any) -> Any:
    if r.status_code >= 400:
        raise WireError(f"HTTP {r.status_code}: {r.text[:160]}")
    return r


#: a close's answer without the document, which a fleet's client does not read (the
#: gRPC wires' closes answer a length): folding a full session's document from the log
#: is work that grows with the session (docs/protocols/http.md)
MINIMAL = {"Prefer": "return=minimal"}

#: an SSE frame's id line (a log position)
SSE_ID = re.compile(rb"(?:^|\n)id: (\d+)\n")


class HttpSession:
    """The native HTTP API: ``stream`` False reads the JSON answer, True the SSE stream.

    A streaming session resumes each turn's stream from the last ``id`` of the one
    before (``Last-Event-ID``), as a client that keeps the document does: no snapshot
    after the first turn."""

    replaces_history = False

    def __init__(self, http: Any, stream: bool) -> None:
        self.http, self.stream, self.sid = http, stream, ""
        self.last_id: int | None = None

    async def open(self) -> None:
        self.sid = _ok(await self.http.post("/v1/sessions", json={"eos_token_ids": []})).json()[
            "id"
        ]

    async def turn(self, append: str, tokens: int) -> int | None:
        body: dict[str, Any] = {"max_tokens": tokens, "temperature": 0, "seed": 1}
        if append:
            body["tokens"] = list(append.encode())
        url = f"/v1/sessions/{self.sid}/generate"
        if not self.stream:
            gen = _ok(await self.http.post(url, json={**body, "stream": False})).json()
            return len(gen["generation"]["tokens"])
        headers = {} if self.last_id is None else {"Last-Event-ID": str(self.last_id)}
        async with self.http.stream("POST", url, json=body, headers=headers) as resp:
            if resp.status_code >= 400:
                await resp.aread()
                _ok(resp)
            tail = b""
            async for chunk in resp.aiter_raw():
                seen = tail + chunk
                if b"event: error" in seen:
                    raise WireError(f"SSE error event: {seen[-200:]!r}")
                ids = SSE_ID.findall(seen)
                if ids:
                    self.last_id = int(ids[-1])
                tail = seen[-32:]
        return None

    async def close(self) -> None:
        _ok(await self.http.post(f"/v1/sessions/{self.sid}/close", headers=MINIMAL))


class KakeyaSession:
    replaces_history = False

    def __init__(self, channel: Any) -> None:
        from sessiontape.transports.grpc.gen.kakeya.v1 import runtime_pb2 as kpb
        from sessiontape.transports.grpc.gen.kakeya.v1 import runtime_pb2_grpc as kgrpc

        self.pb, self.stub, self.sid = kpb, kgrpc.RuntimeServiceStub(channel), ""

    async def open(self) -> None:
        resp = await self.stub.CreateSession(self.pb.CreateSessionRequest(eos_token_ids=[]))
        self.sid = resp.session_id

    async def turn(self, append: str, tokens: int) -> int | None:
        if append:
            await self.stub.AppendTokens(
                self.pb.AppendTokensRequest(session_id=self.sid, token_ids=list(append.encode()))
            )
        n = 0
        req = self.pb.GenerateRequest(
            session_id=self.sid, max_tokens=tokens, seed=1, temperature=0.0
        )
        async for m in self.stub.Generate(req):
            n += m.WhichOneof("payload") == "token_id"
        return n

    async def close(self) -> None:
        await self.stub.CloseSession(self.pb.CloseSessionRequest(session_id=self.sid))


class SalienceSession:
    replaces_history = False

    def __init__(self, channel: Any) -> None:
        from sessiontape.transports.grpc.gen.salience.v1 import salience_pb2 as spb
        from sessiontape.transports.grpc.gen.salience.v1 import salience_pb2_grpc as sgrpc

        self.pb, self.stub, self.sid, self.offset = spb, sgrpc.SalienceStub(channel), "", 0

    async def open(self) -> None:
        self.sid = (await self.stub.OpenSession(self.pb.OpenSessionRequest())).session_id
        self.offset = 0

    async def turn(self, append: str, tokens: int) -> int | None:
        req = self.pb.GenerateRequest(
            session_id=self.sid,
            offset=self.offset,
            append_tokens=list(append.encode()),
            max_tokens=tokens,
            top_k=1,
        )
        n = 0
        async for m in self.stub.Generate(req):
            if m.WhichOneof("event") == "token":
                n += not m.token.is_prefill
            else:
                self.offset = m.done.total_tokens
        return n

    async def close(self) -> None:
        await self.stub.CloseSession(self.pb.CloseSessionRequest(session_id=self.sid))


class EvergreenSession:
    """One StartSession stream; turn k sends text node ``p{k}`` and a GENERATE reading it
    (a turn that appends nothing reads the last one again)."""

    replaces_history = True

    def __init__(self, client: Any) -> None:
        self.client, self.s, self.k = client, None, 0

    async def open(self) -> None:
        self.s, self.k = self.client.session(), 0

    async def turn(self, append: str, tokens: int) -> int | None:
        import grpc

        from sessiontape.transports.grpc.client import action, sampling_config, text_fragments

        assert self.s is not None
        if append:
            self.k += 1
        out = f"r{self.k}-{time.monotonic_ns()}"
        gen = action(
            "GENERATE",
            inputs={"p": f"p{self.k}"},
            outputs={"text": out},
            configs=[sampling_config(max_tokens=tokens, seed=1, temperature=0.0)],
        )
        await self.s.send(
            fragments=text_fragments(f"p{self.k}", append) if append else [], actions=[gen]
        )
        while True:
            m = await self.s.call.read()
            if m is grpc.aio.EOF:
                raise WireError("the Evergreen stream ended mid-turn")
            if any(f.id == out and not f.continued for f in m.node_fragments):
                return None

    async def close(self) -> None:
        import grpc

        assert self.s is not None
        await self.s.done_writing()
        while await self.s.call.read() is not grpc.aio.EOF:
            pass


class OpenAISession:
    """The OpenAI Responses API (``POST /v1/responses``, not streamed), each turn continuing
    the one before (``previous_response_id``): the turn's text as the user's message, its
    reply ``tokens`` long (``max_output_tokens``). JSON over the pool's httpx client, not
    the ``openai`` package (whose models cost the client more than the server spends):
    the server's path is the same. The chat template wraps each message, so the session's
    history grows by more than the text; ``history_per_turn`` counts that."""

    replaces_history = False
    #: tokens a turn adds to the history besides its text and reply: the reference
    #: engine's template around the user's message and the assistant's reply
    history_per_turn = 48

    def __init__(self, http: Any) -> None:
        self.http, self.sid, self.prev = http, "", None

    async def open(self) -> None:
        self.sid, self.prev = "", None

    async def turn(self, append: str, tokens: int) -> int | None:
        body: dict[str, Any] = {
            "model": "reference",
            "input": append or ".",
            "max_output_tokens": tokens,
            "temperature": 0,
            "seed": 1,
        }
        if self.prev is not None:
            body["previous_response_id"] = self.prev
        resp = _ok(await self.http.post("/v1/responses", json=body)).json()
        self.prev, self.sid = resp["id"], resp["session_id"]
        return int(resp["usage"]["output_tokens"])

    async def close(self) -> None:
        if self.sid:
            _ok(await self.http.post(f"/v1/sessions/{self.sid}/close", headers=MINIMAL))


class Pool:
    """What one client process shares, as a client library would: gRPC channels (each its
    own connection), at most ``per_channel`` sessions each, and HTTP keep-alive pools, at
    most ``per_pool`` sessions each, taken round-robin. httpx scans every connection of a
    pool on each request (``has_expired``, a ``getpeername`` each): one large pool of
    fleet sessions takes much of the client's CPU, and the client's loop, busy
    scanning, holds the gRPC sessions' messages back."""

    def __init__(
        self,
        ports: tuple[int, int],
        wires: Sequence[str],
        per_channel: int,
        timeout: float,
        per_pool: int = 8,
    ) -> None:
        import httpx

        from sessiontape.transports.grpc.client import EvergreenClient

        gport, hport = ports
        n_http = sum(w in ("http", "sse", "openai") for w in wires)
        n_grpc = len(wires) - n_http
        limits = httpx.Limits(max_connections=per_pool, max_keepalive_connections=per_pool)
        self.https = [
            httpx.AsyncClient(base_url=f"http://127.0.0.1:{hport}", timeout=timeout, limits=limits)
            for _ in range(max(1, math.ceil(n_http / per_pool)))
        ]
        self.channels = [
            EvergreenClient(f"127.0.0.1:{gport}", options=[("grpc.use_local_subchannel_pool", 1)])
            for _ in range(max(1, math.ceil(n_grpc / per_channel)))
        ]
        self._next = Counter[str]()

    def session(self, wire: str) -> Session:
        kind = "http" if wire in ("http", "sse", "openai") else "grpc"
        k = self._next[kind]
        self._next[kind] += 1
        if wire == "openai":
            return OpenAISession(self.https[k % len(self.https)])
        if kind == "http":
            return HttpSession(self.https[k % len(self.https)], wire == "sse")
        client = self.channels[k % len(self.channels)]
        if wire == "evergreen":
            return EvergreenSession(client)
        return (KakeyaSession if wire == "kakeya" else SalienceSession)(client.channel)

    async def aclose(self) -> None:
        for h in self.https:
            await h.aclose()
        for c in self.channels:
            await c.close()


def describe(exc: BaseException) -> str:
    code = getattr(exc, "code", None)
    if callable(code) and hasattr(exc, "details"):  # grpc.aio.AioRpcError
        return f"{code().name}: {str(exc.details())[:120]}"
    return f"{type(exc).__name__}: {str(exc)[:120]}"


@dataclass
class Slot:
    """One session of the fleet, reopened when its history is full."""

    wire: str
    make: Callable[[], Session]
    max_history: int
    limit_s: float
    session: Session | None = None
    length: int = 0
    turns: int = 0
    opens: int = 0

    async def step(self, append: str, tokens: int) -> float:
        """One turn (opening a session first where needed, untimed); its latency."""
        async with asyncio.timeout(self.limit_s):
            if self.session is not None and self.length + len(append) + tokens > self.max_history:
                old, self.session = self.session, None
                await old.close()
            if self.session is None:
                self.session, self.length = self.make(), 0
                self.opens += 1
                await self.session.open()
            t0 = time.perf_counter()
            n = await self.session.turn(append, tokens)
            dt = time.perf_counter() - t0
        if not self.session.replaces_history:
            self.length += len(append) + tokens + getattr(self.session, "history_per_turn", 0)
        if n is not None and n != tokens:
            raise WireError(f"{n} of {tokens} tokens")
        return dt


@dataclass
class Tally:
    lat: list[float] = field(default_factory=list)
    errors: Counter[str] = field(default_factory=Counter)

    async def run(self, slot: Slot, append: str, tokens: int) -> None:
        """One turn of ``slot``, counted here: its latency, or its error (after which the
        slot opens a new session, the old one perhaps broken, after a pause)."""
        try:
            self.lat.append(await slot.step(append, tokens))
        except Exception as exc:
            self.errors[describe(exc)] += 1
            slot.session = None
            await asyncio.sleep(0.05)
            return
        slot.turns += 1


# -- the client processes -----------------------------------------------------------


def client_setup(args: argparse.Namespace) -> None:
    cpu = client_cpu(args.client_cpu)
    if cpu is not None:
        os.sched_setaffinity(0, {cpu})
    gctune.tune_for_serving()


async def load_client(args: argparse.Namespace) -> None:
    """Client process ``args.index`` of ``args.clients``: its share of the sessions."""
    client_setup(args)
    wires = args.wires.split(",")
    mine = [wires[i % len(wires)] for i in range(args.index, args.sessions, args.clients)]
    ports = (int(args.ports.split(",")[0]), int(args.ports.split(",")[1]))
    pool = Pool(ports, mine + wires, args.per_channel, args.timeout, args.per_pool)
    append = text_of(args.append)

    def slot(wire: str) -> Slot:
        return Slot(wire, lambda: pool.session(wire), args.max_history, args.timeout)

    tallies = {w: Tally() for w in wires}
    setup = Tally()
    gate = asyncio.Semaphore(50)  # sessions arriving at once

    async def first_turn(s: Slot) -> None:
        async with gate:
            await setup.run(s, append, args.tokens)

    say("ready")
    await heard()
    for w in wires:  # one warm-up session per wire: what the server sets up once
        warm = slot(w)
        for _ in range(3):
            await setup.run(warm, append, args.tokens)
    say("warm")
    await heard()
    slots = [slot(w) for w in mine]
    await asyncio.gather(*(first_turn(s) for s in slots))
    say("idle")
    await heard()
    c0, deadline = time.process_time(), time.perf_counter() + args.seconds

    async def drive(s: Slot) -> None:
        s.turns = 0
        while time.perf_counter() < deadline:
            await tallies[s.wire].run(s, append, args.tokens)

    await asyncio.gather(*(drive(s) for s in slots))
    cpu = time.process_time() - c0
    await pool.aclose()
    say(
        json.dumps(
            {
                "client_cpu": cpu,
                "setup_errors": setup.errors,
                "wires": {w: {"lat": t.lat, "errors": t.errors} for w, t in tallies.items()},
                "per_session": [[s.wire, s.turns] for s in slots],
                "opens": sum(s.opens for s in slots),
            }
        )
    )


async def turns_client(args: argparse.Namespace) -> None:
    """One session's turns one after another, then its one-token generations."""
    client_setup(args)
    ports = (int(args.ports.split(",")[0]), int(args.ports.split(",")[1]))
    pool = Pool(ports, [args.turn_wire], 1, args.timeout)
    s = Slot(args.turn_wire, lambda: pool.session(args.turn_wire), args.max_history, args.timeout)
    t = Tally()
    say("ready")
    await heard()
    for _ in range(20):  # warm-up
        await t.run(s, text_of(args.append), args.tokens)
    out = []
    for append, tokens in ((text_of(args.append), args.tokens), ("", 1)):
        t = Tally()
        say("start")
        c0, deadline = time.process_time(), time.perf_counter() + args.seconds
        while len(t.lat) + t.errors.total() < args.turn_count and time.perf_counter() < deadline:
            await t.run(s, append, tokens)
        say("end")
        out.append({"lat": t.lat, "errors": t.errors, "client_cpu": time.process_time() - c0})
    await pool.aclose()
    say(json.dumps(out))


# -- the server and the orchestration -------------------------------------------------


def free_port() -> int:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def proc_cpu(pid: int) -> float:
    """CPU seconds (user + system, every thread) process ``pid`` has used."""
    stat = Path(f"/proc/{pid}/stat").read_text()
    fields = stat[stat.rindex(")") + 2 :].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def tree_cpu(pid: int) -> float:
    """CPU seconds process ``pid`` and its live children (an engine worker) have used."""
    total = proc_cpu(pid)
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            text = stat.read_text()
        except OSError:  # gone meanwhile
            continue
        if int(text[text.rindex(")") + 2 :].split()[1]) == pid:
            total += proc_cpu(int(stat.parent.name))
    return total


def proc_rss(pid: int) -> int:
    """Resident bytes of process ``pid``."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError(f"no VmRSS for process {pid}")


class Server:
    """``sessiontape serve`` in a process of its own, on free loopback ports."""

    def __init__(self, proc: Any, ports: tuple[int, int], log: Path) -> None:
        self.proc, self.ports, self.log = proc, ports, log

    @classmethod
    async def start(
        cls,
        tmp: Path,
        url: str,
        sessions: int,
        event_loop: str = "auto",
        engine_process: str = "inline",
        env: dict[str, str] | None = None,
    ) -> Server:
        """``env``: the server process's environment (default: this one's)."""
        ports = free_port(), free_port()
        config = tmp / "sessiontape.toml"
        config.write_text(
            f"[database]\nurl = {json.dumps(url)}\n"
            '[engine]\nname = "reference"\noptions = { eos_bias = -1000.0 }\n'
            f"process = {json.dumps(engine_process)}\n"
            f'[transports.grpc]\nlisten = "127.0.0.1:{ports[0]}"\n'
            f'[transports.http]\nlisten = "127.0.0.1:{ports[1]}"\n'
            # the whole fleet comes from one loopback address; a real one from many
            f"[limits]\nmax_requests_per_client = {sessions + 64}\n"
            f"[server]\nevent_loop = {json.dumps(event_loop)}\n"
        )
        log = tmp / "server.log"
        with log.open("wb") as err:
            proc = await asyncio.create_subprocess_exec(
                sys.executable,
                "-m",
                "sessiontape.core.cli",
                "serve",
                "--config",
                str(config),
                stdin=asyncio.subprocess.DEVNULL,
                stdout=asyncio.subprocess.DEVNULL,
                stderr=err,
                cwd=tmp,
                env=env,
            )
        server = cls(proc, ports, log)
        deadline = time.monotonic() + 60
        while "sessiontape ready" not in server.log_text():
            if proc.returncode is not None or time.monotonic() > deadline:
                await server.stop()
                raise RuntimeError(f"the server did not start:\n{server.log_text()[-2000:]}")
            await asyncio.sleep(0.05)
        return server

    def log_text(self) -> str:
        return self.log.read_text(errors="replace")

    def cpu(self) -> float:
        return tree_cpu(self.proc.pid)

    def rss(self) -> int:
        return proc_rss(self.proc.pid)

    async def stop(self) -> None:
        if self.proc.returncode is None:
            self.proc.terminate()
            try:
                await asyncio.wait_for(self.proc.wait(), 30)
            except TimeoutError:
                self.proc.kill()
                await self.proc.wait()


class Client:
    """A client process (this file with ``--role``), spoken to line by line."""

    def __init__(self, proc: Any) -> None:
        self.proc = proc

    @classmethod
    async def start(cls, args: argparse.Namespace, server: Server, *extra: str) -> Client:
        proc = await asyncio.create_subprocess_exec(
            sys.executable,
            __file__,
            *extra,
            "--ports",
            f"{server.ports[0]},{server.ports[1]}",
            *(f"--{k.replace('_', '-')}={v}" for k, v in vars(args).items() if k in PASSED),
            stdin=asyncio.subprocess.PIPE,
            stdout=asyncio.subprocess.PIPE,
        )
        return cls(proc)

    async def expect(self, line: str) -> None:
        got = (await self.proc.stdout.readline()).decode().strip()
        if got != line:
            raise RuntimeError(f"a client said {got!r} where {line!r} was due")

    async def tell(self, line: str = "go") -> None:
        self.proc.stdin.write(line.encode() + b"\n")
        await self.proc.stdin.drain()

    async def end(self) -> None:
        if self.proc.returncode is None:
            self.proc.kill()
            await self.proc.wait()

    async def result(self) -> Any:
        out = await self.proc.stdout.read()
        await self.proc.wait()
        return json.loads(out)


#: the options a client process takes from the orchestrator's
PASSED = (
    "seconds",
    "tokens",
    "append",
    "wires",
    "client_cpu",
    "per_channel",
    "per_pool",
    "timeout",
    "max_history",
    "turn_wire",
    "turn_count",
)


@contextlib.asynccontextmanager
async def database(arg: str, tmp: Path) -> Any:
    """A fresh database for one row: a SQLite file in ``tmp``, or a new database on the
    PostgreSQL server of ``arg`` (created through its database, dropped afterwards)."""
    if arg == "sqlite":
        yield f"sqlite+aiosqlite:///{tmp / 'load.db'}"
        return
    if not arg.startswith("postgresql"):
        yield arg
        return
    import asyncpg
    from sqlalchemy.engine import make_url

    u = make_url(arg)
    name = f"bench_load_{secrets.token_hex(4)}"
    where = {"host": u.host, "port": u.port or 5432, "user": u.username, "password": u.password}
    conn = await asyncpg.connect(database=u.database, **where)
    try:
        await conn.execute(f'CREATE DATABASE "{name}"')
    finally:
        await conn.close()
    try:
        yield u.set(database=name).render_as_string(hide_password=False)
    finally:
        conn = await asyncpg.connect(database=u.database, **where)
        try:
            await conn.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
        finally:
            await conn.close()


async def engine_alone(
    engine: Engine, tokens: int, reps: int = 150, budget_s: float = 1.0
) -> list[float]:
    """Seconds of ``engine`` generating ``tokens`` by itself (nothing stored), each time.
    Each row takes them before and after its timed part, the medians of both together."""
    times: list[float] = []
    stop = time.perf_counter() + budget_s
    while len(times) < reps and (len(times) < 5 or time.perf_counter() < stop):
        t0 = time.perf_counter()
        async for _ in generated_ids(engine, tokens):
            pass
        times.append(time.perf_counter() - t0)
    return times


def pct(values: Sequence[float], q: float) -> float:
    """The ``q`` quantile (nearest rank) of ``values``, NaN for none."""
    if not values:
        return math.nan
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, math.ceil(q * len(ordered)) - 1))]


def ms(s: float) -> str:
    return "n/a" if math.isnan(s) else f"{s * 1e3:,.1f}"


def table(header: Sequence[str], rows: Sequence[Sequence[str]]) -> None:
    print("| " + " | ".join(header) + " |")
    print("|" + "|".join("---" for _ in header) + "|")
    for r in rows:
        print("| " + " | ".join(r) + " |")
    print(flush=True)


# -- the rows -------------------------------------------------------------------------


async def load_row(args: argparse.Namespace, sessions: int, engine: Engine) -> dict[str, Any]:
    """One count of sessions: a fresh server and database, the fleet's clients, the figures."""
    n = min(args.clients, sessions)
    with tempfile.TemporaryDirectory() as tmp_s:
        tmp = Path(tmp_s)
        async with database(args.db, tmp) as url:
            server = await Server.start(tmp, url, sessions, args.event_loop, args.engine_process)
            clients: list[Client] = []
            try:
                for k in range(n):
                    role = ("--role=load", f"--index={k}", f"--clients={n}")
                    clients.append(
                        await Client.start(args, server, *role, f"--sessions={sessions}")
                    )
                got: dict[str, Any] = {}
                for phase in ("ready", "warm", "idle"):
                    await asyncio.gather(*(c.expect(phase) for c in clients))
                    if phase == "warm":
                        got["rss0"] = server.rss()
                    elif phase == "idle":
                        await asyncio.sleep(1.0)
                        got["rss1"] = server.rss()
                        got["engine"] = await engine_alone(engine, args.tokens)
                        cpu0, t0 = server.cpu(), time.perf_counter()
                    for c in clients:
                        await c.tell()
                results = await asyncio.gather(*(c.result() for c in clients))
                got["elapsed"], got["cpu"] = time.perf_counter() - t0, server.cpu() - cpu0
                got["engine"] = statistics.median(
                    got["engine"] + await engine_alone(engine, args.tokens)
                )
            finally:
                for c in clients:
                    await c.end()
                await server.stop()
    return {"sessions": sessions, "results": results, **got}


def load_report(args: argparse.Namespace, row: dict[str, Any]) -> list[str]:
    """Print one count's table (per wire and in all); return its line of the summary."""
    results, elapsed = row["results"], row["elapsed"]
    wires = args.wires.split(",")
    lat: dict[str, list[float]] = {w: [] for w in wires}
    errors: dict[str, Counter[str]] = {w: Counter() for w in wires}
    turns: dict[str, list[int]] = {w: [] for w in wires}
    for res in results:
        for w, t in res["wires"].items():
            lat[w] += t["lat"]
            errors[w].update(t["errors"])
        for w, k in res["per_session"]:
            turns[w].append(k)
    setup_errors: Counter[str] = sum((Counter(r["setup_errors"]) for r in results), Counter())

    def line(name: str, ls: list[float], err: Counter[str], per: list[int]) -> list[str]:
        fair = f"{min(per)} / {statistics.median(per):g}" if per else "n/a"
        starved = sum(k == 0 for k in per)
        return [
            name,
            str(len(per)),
            f"{len(ls):,}",
            f"{len(ls) / elapsed:,.1f}",
            ms(pct(ls, 0.5)),
            ms(pct(ls, 0.99)),
            ms(max(ls, default=math.nan)),
            str(err.total()),
            fair + (f" ({starved} starved)" if starved else ""),
        ]

    every = [x for w in wires for x in lat[w]]
    every_err = sum(errors.values(), Counter())
    every_turns = [k for w in wires for k in turns[w]]
    replaced = sum(r["opens"] for r in results) - len(every_turns)
    print(
        f"{row['sessions']:,} sessions, {elapsed:.1f} s from the first turn to the last answer"
        + (f"; {replaced} sessions reopened (full, or after an error)" if replaced > 0 else "")
        + "\n"
    )
    table(
        [
            "wire",
            "sessions",
            "turns",
            "turns/s",
            "p50 ms",
            "p99 ms",
            "max ms",
            "errors",
            "turns a session: fewest / median",
        ],
        [line(LABELS[w], lat[w], errors[w], turns[w]) for w in wires]
        + [line("all", every, every_err, every_turns)],
    )
    for what, err in (("errors", every_err), ("errors setting up", setup_errors)):
        if err:
            print(f"{what}: " + "; ".join(f"{m} (x{k})" for m, k in err.most_common(5)) + "\n")
    done = max(1, len(every))
    per_turn = row["cpu"] / done
    engine_t = row["engine"]
    client = sum(r["client_cpu"] for r in results)
    return [
        f"{row['sessions']:,}",
        f"{len(every) / elapsed:,.1f}",
        f"{ms(pct(every, 0.5))} / {ms(pct(every, 0.99))}",
        str(every_err.total() + setup_errors.total()),
        f"{per_turn * 1e3:.2f} ms ({per_turn / engine_t:.1f}x)",
        f"{row['cpu'] / elapsed:.2f} / {client / elapsed:.2f}",
        f"{engine_t * 1e3:.3f} ms",
        f"{len(every) / elapsed * engine_t:.3f}",
        f"{(row['rss1'] - row['rss0']) / row['sessions'] / 1024:,.1f} KiB",
    ]


SUMMARY = [
    "sessions",
    "turns/s",
    "p50 / p99 ms",
    "errors",
    "server CPU / turn (x engine)",
    "cores: server / clients",
    "engine alone / turn",
    "turns/s vs engine alone's",
    "memory / idle session",
]


async def _turns_on(args: argparse.Namespace, server: Any) -> tuple[Any, list[float]]:
    """The turns client's two series against ``server``, and the server's CPU for each."""
    client = await Client.start(args, server, "--role=turns")
    cpu: list[float] = []
    try:
        await client.expect("ready")
        await client.tell()
        for _ in range(2):
            await client.expect("start")
            c0 = server.cpu()
            await client.expect("end")
            cpu.append(server.cpu() - c0)
        return await client.result(), cpu
    finally:
        await client.end()


class BareServer:
    """bench/bare_kakeya.py in a process of its own: the gRPC floor of a Kakeya turn."""

    def __init__(self, proc: Any, port: int) -> None:
        self.proc, self.ports = proc, (port, free_port())

    @classmethod
    async def start(cls, event_loop: str) -> BareServer:
        port = free_port()
        proc = await asyncio.create_subprocess_exec(
            sys.executable,
            str(Path(__file__).with_name("bare_kakeya.py")),
            str(port),
            "--event-loop",
            event_loop,
            stdout=asyncio.subprocess.PIPE,
        )
        assert proc.stdout is not None
        line = await asyncio.wait_for(proc.stdout.readline(), 60)
        if line.strip() != b"ready":
            proc.kill()
            raise RuntimeError("bench/bare_kakeya.py did not start")
        return cls(proc, port)

    def cpu(self) -> float:
        return tree_cpu(self.proc.pid)

    async def stop(self) -> None:
        self.proc.kill()
        await self.proc.wait()


async def turns_row(args: argparse.Namespace, engine: Engine) -> None:
    """One client's turns one after another, then one-token generations; printed, with the
    same turns against a bare Kakeya server (the wire's floor) when the wire is Kakeya."""
    alone = [await engine_alone(engine, args.tokens), await engine_alone(engine, 1)]
    with tempfile.TemporaryDirectory() as tmp_s:
        tmp = Path(tmp_s)
        async with database(args.db, tmp) as url:
            server = await Server.start(tmp, url, 1, args.event_loop, args.engine_process)
            try:
                results, cpu = await _turns_on(args, server)
            finally:
                await server.stop()
    floor: tuple[Any, list[float]] | None = None
    if args.turn_wire == "kakeya":
        bare = await BareServer.start(args.event_loop)
        try:
            floor = await _turns_on(args, bare)
        finally:
            await bare.stop()
    alone[0] += await engine_alone(engine, args.tokens)
    alone[1] += await engine_alone(engine, 1)
    rows = []
    names = (f"turn: append {args.append}, generate {args.tokens}", "generation of 1 token")
    for name, res, c, times in zip(names, results, cpu, alone, strict=True):
        e = statistics.median(times)
        ls, done = res["lat"], max(1, len(res["lat"]))
        med = pct(ls, 0.5)
        rows.append(
            [
                name,
                f"{len(ls):,}",
                ms(med),
                ms(pct(ls, 0.99)),
                f"{c / done * 1e3:.2f}",
                f"{res['client_cpu'] / done * 1e3:.2f}",
                f"{e * 1e3:.3f}",
                f"{e / med:.3f}" if ls else "n/a",
                str(sum(res["errors"].values())),
            ]
        )
        if res["errors"]:
            print(f"{name}: errors " + "; ".join(f"{m} (x{k})" for m, k in res["errors"].items()))
    if floor is not None:
        for name, res, c in zip(names, *floor, strict=True):
            ls, done = res["lat"], max(1, len(res["lat"]))
            rows.append(
                [
                    f"{name}, bare Kakeya server (no runtime)",
                    f"{len(ls):,}",
                    ms(pct(ls, 0.5)),
                    ms(pct(ls, 0.99)),
                    f"{c / done * 1e3:.2f}",
                    f"{res['client_cpu'] / done * 1e3:.2f}",
                    "",
                    "",
                    str(sum(res["errors"].values())),
                ]
            )
    print(f"one client, turns one after another over {LABELS[args.turn_wire]}\n")
    table(
        [
            "sequential",
            "count",
            "median ms",
            "p99 ms",
            "server CPU / turn ms",
            "client CPU / turn ms",
            "engine alone ms",
            "engine alone / median",
            "errors",
        ],
        rows,
    )


# -- command line ---------------------------------------------------------------------


def parse() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    ap.add_argument("--mode", default="both", choices=["load", "turns", "both"])
    ap.add_argument("--sessions", default="10,100,1000", help="comma-separated session counts")
    ap.add_argument("--seconds", type=float, default=20.0, help="timed part of each row")
    ap.add_argument("--tokens", type=int, default=16, help="tokens generated a turn")
    ap.add_argument("--append", type=int, default=3, help="tokens appended a turn")
    ap.add_argument(
        "--wires",
        default=",".join(DEFAULT_WIRES),
        help=f"the fleet's wires, round-robin, of {', '.join(WIRES)}",
    )
    ap.add_argument(
        "--db",
        default="sqlite",
        help="sqlite (a fresh file a row), a postgresql+asyncpg://... URL (a fresh database "
        "on that server a row, dropped afterwards) or another URL, used as it is",
    )
    ap.add_argument("--clients", type=int, default=1, help="client processes for the load rows")
    ap.add_argument(
        "--client-cpu",
        default="last",
        help="the CPU the client processes are pinned to: last (the default), none, or a number",
    )
    ap.add_argument("--per-channel", type=int, default=50, help="gRPC sessions a connection")
    ap.add_argument("--per-pool", type=int, default=8, help="HTTP sessions a keep-alive pool")
    ap.add_argument("--timeout", type=float, default=30.0, help="seconds before a turn fails")
    ap.add_argument(
        "--max-history", type=int, default=2048, help="tokens before a session is replaced"
    )
    ap.add_argument("--turn-wire", default="kakeya", choices=WIRES, help="the turns mode's wire")
    ap.add_argument(
        "--turn-count", type=int, default=1000, help="turns mode: turns (and 1-token generations)"
    )
    ap.add_argument(
        "--event-loop",
        default="auto",
        choices=("auto", "uvloop", "asyncio"),
        help="the server's [server] event_loop (default auto: uvloop where installed)",
    )
    ap.add_argument(
        "--engine-process",
        default="inline",
        choices=("inline", "worker"),
        help="the server's [engine] process: its event loop, or a worker process of its own",
    )
    ap.add_argument("--role", help=argparse.SUPPRESS)  # internal: be a client process
    ap.add_argument("--index", type=int, default=0, help=argparse.SUPPRESS)
    ap.add_argument("--ports", help=argparse.SUPPRESS)
    args = ap.parse_args()
    unknown = set(args.wires.split(",")) - set(WIRES)
    if unknown:
        ap.error(f"--wires: no such wire {', '.join(sorted(unknown))}")
    try:
        client_cpu(args.client_cpu)
    except ValueError as exc:
        ap.error(str(exc))
    if args.role is None and not sys.platform.startswith("linux"):
        ap.error("the server's CPU and memory are read from /proc: Linux only")
    return args


async def main() -> None:
    args = parse()
    if args.role == "load":
        args.sessions = int(args.sessions)
        await load_client(args)
        return
    if args.role == "turns":
        await turns_client(args)
        return
    engine = make_engine("reference", "small", eos_bias=-1000.0)
    load = ", ".join(f"{x:.2f}" for x in os.getloadavg())
    print(
        f"engine {engine.info.name} ({engine.info.model_id}); {os.cpu_count()} CPUs, load {load}; "
        f"database {args.db.split('://')[0]}; a turn appends {args.append} tokens and generates "
        f"{args.tokens}; client processes pinned to CPU {client_cpu(args.client_cpu)}; "
        f"the server's event loop: {args.event_loop}; the engine: {args.engine_process}\n",
        flush=True,
    )
    if args.mode in ("turns", "both"):
        await turns_row(args, engine)
    if args.mode in ("load", "both"):
        summary = []
        for n in (int(x) for x in args.sessions.split(",")):
            summary.append(load_report(args, await load_row(args, n, engine)))
        print(f"fleet over {', '.join(LABELS[w] for w in args.wires.split(','))}, round-robin\n")
        table(SUMMARY, summary)
    print("load at the end: " + ", ".join(f"{x:.2f}" for x in os.getloadavg()))


if __name__ == "__main__":
    asyncio.run(main())
