"""Replicas as users run them: real `sessiontape serve` processes on one PostgreSQL database.

Requests alternate between the replicas over HTTP and gRPC (Kakeya); a tailer
on each replica follows the session's SSE stream; one replica is killed with
SIGKILL mid-generation and restarted. The log must show no spurious error,
no lost or duplicated event, chains that verify, and every tailer must see
each event exactly once, in log order.
"""

from __future__ import annotations

import asyncio
import os
import re
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import grpc
import httpx
import pytest

from sessiontape.core.events import Event, T
from sessiontape.core.log import EventLog
from sessiontape.core.log.store import verify_chain
from sessiontape.transports.grpc.gen.kakeya.v1 import runtime_pb2 as kpb
from sessiontape.transports.grpc.gen.kakeya.v1 import runtime_pb2_grpc as kgrpc
from tests.helpers.config import free_port

pytestmark = [pytest.mark.postgres, pytest.mark.slow]


class Replica:
    def __init__(self, tmp: Path, url: str, name: str, step_delay_s: float = 0.0) -> None:
        self.tmp, self.url, self.name, self.step_delay_s = tmp, url, name, step_delay_s
        self.http_port, self.grpc_port = free_port(), free_port()
        self.proc: subprocess.Popen[str] | None = None
        self.drain: threading.Thread | None = None

    @property
    def base(self) -> str:
        return f"http://127.0.0.1:{self.http_port}"

    def start(self) -> None:
        env = {
            **os.environ,
            "SESSIONTAPE_CACHE": str(self.tmp / "cache"),
            "SESSIONTAPE_ENGINE__OPTIONS__STEP_DELAY_S": str(self.step_delay_s),
            "SESSIONTAPE_ENGINE__OPTIONS__EOS_BIAS": "-1000.0",
            "SESSIONTAPE_LOG__POLL_INTERVAL_S": "0.1",
        }
        self.proc = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "sessiontape.core.cli",
                "serve",
                "--db",
                self.url,
                "--engine",
                "reference",
                "--http",
                f"127.0.0.1:{self.http_port}",
                "--grpc",
                f"127.0.0.1:{self.grpc_port}",
            ],
            stderr=subprocess.PIPE,
            stdout=subprocess.DEVNULL,
            text=True,
            env=env,
            cwd=self.tmp,
        )
        assert self.proc.stderr is not None
        deadline = time.monotonic() + 60
        lines = []
        while time.monotonic() < deadline:
            line = self.proc.stderr.readline()
            if not line:
                break
            lines.append(line)
            if "sessiontape ready" in line:
                # keep reading stderr so the pipe never fills
                self.drain = threading_drain(self.proc)
                return
        self.proc.kill()
        raise AssertionError(f"replica {self.name} did not start:\n" + "".join(lines))

    def kill(self) -> None:
        assert self.proc is not None
        self.proc.send_signal(signal.SIGKILL)
        self.proc.wait(timeout=30)
        self._reap()

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self._reap()

    def _reap(self) -> None:
        if self.drain is not None:
            self.drain.join(timeout=30)
            self.drain = None
        if self.proc is not None and self.proc.stderr is not None:
            self.proc.stderr.close()


def threading_drain(proc: subprocess.Popen[str]) -> threading.Thread:
    def drain() -> None:
        assert proc.stderr is not None
        for _ in proc.stderr:
            pass

    t = threading.Thread(target=drain, daemon=True)
    t.start()
    return t


@pytest.fixture
def replicas(tmp_path: Path, pg_url: str) -> Iterator[list[Replica]]:
    made = [
        Replica(tmp_path, pg_url, "A", step_delay_s=0.002),
        Replica(tmp_path, pg_url, "B"),
        Replica(tmp_path, pg_url, "C"),
    ]
    try:
        for r in made:
            r.start()
        yield made
    finally:
        for r in made:
            r.stop()


async def tail(base: str, sid: str, ids: list[int], stop: asyncio.Event) -> None:
    """Follow a session's SSE stream on one replica, resuming by Last-Event-ID when cut."""
    last: int | None = None
    pattern = re.compile(r"^id: ?(\d+)$", re.M)
    async with httpx.AsyncClient(base_url=base, timeout=None) as c:
        while not stop.is_set():
            headers = {} if last is None else {"Last-Event-ID": str(last)}
            try:
                async with c.stream("GET", f"/v1/sessions/{sid}/events", headers=headers) as r:
                    buf = ""
                    async for chunk in r.aiter_text():
                        buf += chunk
                        *done, buf = buf.split("\n\n")
                        for frame in done:
                            if frame.startswith("event: snapshot") or "\nevent: snapshot" in frame:
                                m = pattern.search(frame)
                                if m and last is None:
                                    last = int(m.group(1))
                                continue
                            m = pattern.search(frame)
                            if m:
                                ids.append(int(m.group(1)))
                                last = int(m.group(1))
                        if stop.is_set():
                            return
            except httpx.HTTPError:
                await asyncio.sleep(0.1)


async def read_all(url: str, sid: str) -> list[Event]:
    log = await EventLog.open(url, migrate=False)
    try:
        return await log.read(sid)
    finally:
        await log.close()


async def test_three_replicas_on_one_postgresql(replicas: list[Replica], pg_url: str) -> None:
    a, b, c = replicas
    http = {r.name: httpx.AsyncClient(base_url=r.base, timeout=60) for r in replicas}
    try:
        sid = (await http["A"].post("/v1/sessions", json={"label": "replicated"})).json()["id"]
        seen: dict[str, list[int]] = {r.name: [] for r in replicas}
        stop = asyncio.Event()
        tailers = [asyncio.create_task(tail(r.base, sid, seen[r.name], stop)) for r in (b, c)]
        # alternating writes: every request to another replica than the last write
        order = [a, b, c, b, a, c, a, b]
        for i, r in enumerate(order):
            resp = await http[r.name].post(f"/v1/sessions/{sid}/append", json={"text": f" part{i}"})
            assert resp.status_code == 200, resp.text
            resp = await http[r.name].post(
                f"/v1/sessions/{sid}/generate", json={"max_tokens": 5, "seed": i, "stream": False}
            )
            assert resp.status_code == 200, resp.text
            resp = await http[order[i - 1].name].post(
                f"/v1/sessions/{sid}/feedback", json={"score": i}
            )
            assert resp.status_code in (200, 201), resp.text
        fork = await http["C"].post(f"/v1/sessions/{sid}/fork", json={})
        assert fork.status_code in (200, 201), fork.text
        child = fork.json()["id"]
        forked_at = (await read_all(pg_url, child))[0].position

        # gRPC too: a Kakeya session created on A, appended on B, generated on C
        chans = {r.name: grpc.aio.insecure_channel(f"127.0.0.1:{r.grpc_port}") for r in replicas}
        try:
            k = {n: kgrpc.RuntimeServiceStub(ch) for n, ch in chans.items()}
            ksid = (
                await k["A"].CreateSession(kpb.CreateSessionRequest(eos_token_ids=[]))
            ).session_id
            await k["B"].AppendTokens(kpb.AppendTokensRequest(session_id=ksid, token_ids=[72, 105]))
            toks = [
                m
                async for m in k["C"].Generate(
                    kpb.GenerateRequest(session_id=ksid, max_tokens=4, seed=1)
                )
            ]
            assert toks[-1].WhichOneof("payload") == "done"
            info = await k["A"].GetSessionInfo(kpb.GetSessionInfoRequest(session_id=ksid))
            assert info.history_length == 6
        finally:
            for ch in chans.values():
                await ch.close()

        # one generation per session across replicas: A generates slowly, B is refused
        long_gen = asyncio.create_task(
            http["A"].post(
                f"/v1/sessions/{sid}/generate",
                json={"max_tokens": 2000, "seed": 99, "stream": False},
            )
        )
        for _ in range(100):
            st = (await http["B"].get(f"/v1/sessions/{sid}")).json()
            if (
                st["generations"]
                and st["generations"][-1].get("finish_reason") is None
                and len(st["generations"][-1]["tokens"]) > 5
            ):
                break
            await asyncio.sleep(0.05)
        busy = await http["B"].post(
            f"/v1/sessions/{sid}/generate", json={"max_tokens": 3, "stream": False}
        )
        assert busy.status_code == 409 and "session_busy" in busy.text
        # ... and A dies with SIGKILL in the middle of it
        a.kill()
        with pytest.raises(httpx.HTTPError):
            await long_gen
        a.start()
        # the next generation (on B) finds A's interrupted and carries on
        for _ in range(100):
            resp = await http["B"].post(
                f"/v1/sessions/{sid}/generate", json={"max_tokens": 3, "seed": 7, "stream": False}
            )
            if resp.status_code != 409:
                break
            await asyncio.sleep(0.1)  # until PostgreSQL noticed A's connection is gone
        assert resp.status_code == 200, resp.text
        await http["A"].aclose()
        http["A"] = httpx.AsyncClient(base_url=a.base, timeout=60)
        await http["A"].post(f"/v1/sessions/{sid}/append", json={"text": " after"})
        close = await http["C"].post(f"/v1/sessions/{sid}/close", json={})
        assert close.status_code == 200, close.text
        # what affinity would save shows on each replica: state cache hits and misses
        metrics_text = (await http["B"].get("/metrics")).text
        assert 'sessiontape_state_cache_total{result="miss"}' in metrics_text
        assert 'sessiontape_state_cache_total{result="hit"}' in metrics_text
        assert "sessiontape_stale_retries_total" in metrics_text

        # operations from another host while the replicas run: migrations and retention
        for cmd in (["db", "upgrade"], ["purge", child, "--force"]):
            proc = await asyncio.create_subprocess_exec(
                sys.executable,
                "-m",
                "sessiontape.core.cli",
                *cmd,
                "--db",
                pg_url,
                stderr=asyncio.subprocess.PIPE,
                stdout=asyncio.subprocess.DEVNULL,
            )
            _, err = await asyncio.wait_for(proc.communicate(), 120)
            assert proc.returncode == 0, err
        statuses = {
            (await http[r.name].get(f"/v1/sessions/{child}")).json()["status"] for r in (b, c)
        }
        assert statuses == {"purged"}
        refused = await http["B"].post(f"/v1/sessions/{child}/append", json={"text": "x"})
        assert refused.status_code in (404, 409), refused.text

        evs = await read_all(pg_url, sid)
        for _ in range(100):
            if all(len(seen[n]) >= len(evs) - 1 for n in ("B", "C")):
                break
            await asyncio.sleep(0.05)
        stop.set()
        for t in tailers:
            t.cancel()
        await asyncio.gather(*tailers, return_exceptions=True)

        verify_chain(evs)
        verify_chain(await read_all(pg_url, child))  # the tombstone vouches for the purged chain
        assert [e.version for e in evs] == list(range(1, len(evs) + 1))
        fins = [e.body["finish_reason"] for e in evs if e.type == T.GENERATION_FINISHED]
        assert fins.count("interrupted") == 1 and fins[-1] == "length"
        # the session's document also shows its forks: the child's session.opened is in its stream
        positions = sorted([e.position for e in evs] + [forked_at])
        for name in ("B", "C"):
            got = seen[name]
            assert got == sorted(got) and len(got) == len(set(got)), (
                f"{name} saw an event twice or out of order"
            )
            # every event after the tailer's snapshot, exactly once, none missing, none foreign
            assert got == [p for p in positions if p >= got[0]], name
    finally:
        for cl in http.values():
            await cl.aclose()
