"""Event-log benchmarks: append throughput, rebuild speed, snapshot loads,
commit-to-subscriber latency. Prints a table; ratios are against baselines
measured in the same run.

    .venv/bin/python bench/bench_log.py [--pg URL | --no-pg] [--events N] [--long N]
        [--rounds 3] [--replicas 1,2,3]

Baselines: raw ``sqlite3`` executemany of the same rows in one transaction
(the ceiling for SQLite), and raw asyncpg ``executemany`` in one transaction
for PostgreSQL. The SQLite rows run in interleaved rounds with their baseline
(the ratio is the median of the rounds' own ratios); the PostgreSQL rows are
medians of 3 runs. Method and figures: docs/performance.md, "Event log".
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sqlite3
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from sessiontape.core import gctune
from sessiontape.core.events import Event, NewEvent, T, canonical_json
from sessiontape.core.log import EventLog
from sessiontape.core.session.loader import load_state
from sessiontape.core.session.snapshot import state_to_json
from sessiontape.core.session.state import SessionState, apply

ROWS: list[tuple[str, float]] = []


def row(name: str, value: str, ratio: str = "") -> None:
    print(f"| {name:58} | {value:>18} | {ratio:>10} |", flush=True)


def token_event(start: int, tok: int) -> NewEvent:
    return NewEvent(T.TOKENS_APPENDED, {"start": start, "tokens": [tok]})


async def append_throughput(url: str, sessions: int, per_session: int, batch: int) -> float:
    log = await EventLog.open(url)
    try:

        async def writer(i: int) -> None:
            sid = f"b{i}-{os.getpid()}-{time.monotonic_ns()}"
            await log.append(sid, 0, [NewEvent(T.SESSION_OPENED, {"protocol": "bench"})])
            v, n = 1, 0
            while n < per_session:
                evs = [token_event(n + k, k % 250) for k in range(batch)]
                await log.append(sid, v, evs)
                v += batch
                n += batch

        t0 = time.perf_counter()
        await asyncio.gather(*(writer(i) for i in range(sessions)))
        dt = time.perf_counter() - t0
    finally:
        await log.close()
    return sessions * per_session / dt


async def replica_throughput(
    url: str, replicas: int, sessions: int, per_session: int, batch: int
) -> float:
    """Events/s appended by ``replicas`` separate processes (each its own EventLog and
    writer, as ``sessiontape serve`` replicas are) to one database at once."""
    procs = [
        await asyncio.create_subprocess_exec(
            sys.executable,
            __file__,
            "--append-worker",
            url,
            str(sessions),
            str(per_session),
            str(batch),
            stdout=asyncio.subprocess.PIPE,
        )
        for _ in range(replicas)
    ]
    spans = [tuple(float(x) for x in (await p.communicate())[0].split()) for p in procs]
    start, end = min(s[0] for s in spans), max(s[1] for s in spans)
    return replicas * sessions * per_session / (end - start)


async def append_worker(url: str, sessions: int, per_session: int, batch: int) -> None:
    log = await EventLog.open(url)
    await log.close()  # migrated; the timed part opens its own
    # start together: each worker waits for the next whole 0.5 s of the shared monotonic clock
    await asyncio.sleep(0.5 - time.perf_counter() % 0.5 + 0.5)
    t0 = time.perf_counter()
    await append_throughput(url, sessions, per_session, batch)
    print(t0, time.perf_counter())


def raw_sqlite_ceiling(n: int) -> float:
    with tempfile.TemporaryDirectory() as d:
        db = sqlite3.connect(os.path.join(d, "raw.db"))
        db.execute("PRAGMA journal_mode=WAL")
        db.execute("PRAGMA synchronous=NORMAL")
        db.execute(
            "CREATE TABLE events (position INTEGER PRIMARY KEY, session_id TEXT, version INTEGER, type TEXT,"
            " body TEXT, data BLOB, blob_sha TEXT, recorded_at REAL, hash TEXT, prev_hash TEXT,"
            " UNIQUE(session_id, version))"
        )
        body = canonical_json({"start": 0, "tokens": [1]})
        rows = [
            (i + 1, "s", i + 1, T.TOKENS_APPENDED, body, None, None, 1.0, "h" * 64, "p" * 64)
            for i in range(n)
        ]
        t0 = time.perf_counter()
        with db:
            db.executemany("INSERT INTO events VALUES (?,?,?,?,?,?,?,?,?,?)", rows)
        dt = time.perf_counter() - t0
        db.close()
    return n / dt


async def raw_pg_ceiling(url: str, n: int) -> float:
    import asyncpg

    dsn = url.replace("postgresql+asyncpg", "postgresql")
    conn = await asyncpg.connect(dsn)
    try:
        await conn.execute(
            "CREATE TEMP TABLE raw_events (position bigint primary key, session_id text, version int,"
            " type text, body text, data bytea, blob_sha text, recorded_at float8, hash text,"
            " prev_hash text, unique(session_id, version))"
        )
        body = canonical_json({"start": 0, "tokens": [1]})
        rows = [
            (i + 1, "s", i + 1, T.TOKENS_APPENDED, body, None, None, 1.0, "h" * 64, "p" * 64)
            for i in range(n)
        ]
        t0 = time.perf_counter()
        async with conn.transaction():
            await conn.executemany(
                "INSERT INTO raw_events VALUES ($1,$2,$3,$4,$5,$6,$7,$8,$9,$10)", rows
            )
        return n / (time.perf_counter() - t0)
    finally:
        await conn.close()


def synthetic_events(n: int) -> list[Event]:
    out = [Event(1, "s", 1, T.SESSION_OPENED, {"protocol": "bench"}, None, 0.0, "h", "p")]
    for i in range(1, n):
        out.append(
            Event(
                i + 1,
                "s",
                i + 1,
                T.TOKENS_APPENDED,
                {"start": i - 1, "tokens": [i % 250]},
                None,
                0.0,
                "h",
                "p",
            )
        )
    return out


def fold_speed(n: int) -> float:
    evs = synthetic_events(n)
    t0 = time.perf_counter()
    st = SessionState("s")
    for e in evs:
        apply(st, e)
    return n / (time.perf_counter() - t0)


async def long_session(url: str, n: int) -> tuple[float, float, float]:
    """Write an n-event session; return (rebuild events/s from the DB, load ms without, with snapshot)."""
    log = await EventLog.open(url, batch_max=5000)
    try:
        sid = f"long-{time.monotonic_ns()}"
        await log.append(sid, 0, [NewEvent(T.SESSION_OPENED, {"protocol": "bench"})])
        v = 1
        chunk = 5000
        while v < n:
            k = min(chunk, n - v)
            await log.append(sid, v, [token_event(v - 1 + j, j % 250) for j in range(k)])
            v += k
        t0 = time.perf_counter()
        st = await load_state(log, sid)
        cold = time.perf_counter() - t0
        assert st.version == n
        await log.save_snapshot(sid, *state_to_json(st))
        times = []
        for _ in range(5):
            t0 = time.perf_counter()
            st2 = await load_state(log, sid)
            times.append(time.perf_counter() - t0)
        assert st2.version == n and st2.head_hash == st.head_hash
        return n / cold, cold * 1000, statistics.median(times) * 1000
    finally:
        await log.close()


async def subscriber_latency(url: str, n: int = 300) -> tuple[float, float]:
    log = await EventLog.open(url)
    try:
        sid = f"lat-{time.monotonic_ns()}"
        await log.append(sid, 0, [NewEvent(T.SESSION_OPENED, {"protocol": "bench"})])
        commit_at: dict[int, float] = {}
        lat: list[float] = []
        done = asyncio.Event()

        async def hook(evs: list[Event]) -> None:
            for e in evs:
                commit_at[e.version] = time.perf_counter()  # just before COMMIT

        async def sub() -> None:
            async for e in log.subscribe(await log.last_position(), session_id=sid):
                lat.append(time.perf_counter() - commit_at[e.version])
                if len(lat) == n:
                    done.set()
                    return

        task = asyncio.create_task(sub())
        await asyncio.sleep(0.1)
        log.before_commit = hook
        for v in range(1, n + 1):
            await log.append(sid, v, [token_event(v - 1, 1)])
            await asyncio.sleep(0.002)
        await asyncio.wait_for(done.wait(), 30)
        await task
        lat.sort()
        return statistics.median(lat) * 1000, lat[int(len(lat) * 0.99) - 1] * 1000
    finally:
        await log.close()


async def fresh_pg_database(server: str) -> str:
    """A new empty database on ``server`` (a URL of an existing database) for this run."""
    import asyncpg

    name = f"sessiontape_bench_{os.getpid()}"
    conn = await asyncpg.connect(server.replace("postgresql+asyncpg", "postgresql"))
    try:
        await conn.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
        await conn.execute(f'CREATE DATABASE "{name}"')
    finally:
        await conn.close()
    return server.rsplit("/", 1)[0] + "/" + name


async def drop_pg_database(server: str, url: str) -> None:
    import asyncpg

    conn = await asyncpg.connect(server.replace("postgresql+asyncpg", "postgresql"))
    try:
        await conn.execute(f'DROP DATABASE IF EXISTS "{url.rsplit("/", 1)[1]}" WITH (FORCE)')
    finally:
        await conn.close()


async def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument(
        "--pg",
        default=os.environ.get("BENCH_PG_URL", "postgresql+asyncpg://postgres@127.0.0.1:5432/test"),
        help="an existing database on the server; the bench creates and drops its own beside it",
    )
    ap.add_argument("--no-pg", action="store_true")
    ap.add_argument("--events", type=int, default=200_000)
    ap.add_argument("--long", type=int, default=1_000_000)
    ap.add_argument("--rounds", type=int, default=3, help="interleaved rounds of the SQLite rows")
    ap.add_argument(
        "--replicas",
        default="1,2,3",
        help="PostgreSQL: numbers of concurrent appending processes (replicas) to measure",
    )
    ap.add_argument(
        "--append-worker",
        nargs=4,
        metavar=("URL", "SESSIONS", "PER_SESSION", "BATCH"),
        help=argparse.SUPPRESS,
    )
    ap.add_argument(
        "--default-gc",
        action="store_true",
        help="keep CPython's collector defaults instead of the server's (core/gctune.py)",
    )
    args = ap.parse_args()
    if not args.default_gc:
        gctune.tune_for_serving()  # as `sessiontape serve` runs with [server] tune_interpreter
    if args.append_worker:
        url, *nums = args.append_worker
        await append_worker(url, *(int(n) for n in nums))
        return
    print(f"python {sys.version.split()[0]}, {os.cpu_count()} cpus")
    print(f"| {'measurement':58} | {'value':>18} | {'ratio':>10} |")
    print(f"|{'-' * 60}|{'-' * 20}|{'-' * 12}|")
    with tempfile.TemporaryDirectory() as d:
        # interleaved rounds: the baseline and each log row once per round, the
        # ratio the median of the rounds' own ratios (the machine's speed drifts)
        shapes = ((200, 1), (100, 100))
        ceilings: list[float] = []
        rates: dict[tuple[int, int], list[float]] = {shape: [] for shape in shapes}
        for i in range(args.rounds):
            ceilings.append(raw_sqlite_ceiling(args.events))
            for sessions, batch in shapes:
                rates[(sessions, batch)].append(
                    await append_throughput(
                        f"sqlite+aiosqlite:///{d}/a{sessions}{batch}{i}.db",
                        sessions,
                        args.events // sessions,
                        batch,
                    )
                )
        ceiling = statistics.median(ceilings)
        row("raw sqlite3 executemany, one transaction (baseline)", f"{ceiling:,.0f} ev/s", "1.00x")
        for (sessions, batch), got in rates.items():
            ratio = statistics.median(r / c for r, c in zip(got, ceilings, strict=True))
            row(
                f"log API, SQLite, {sessions} appenders x {batch} ev/append",
                f"{statistics.median(got):,.0f} ev/s",
                f"{ratio:.2f}x",
            )
        if not args.no_pg:
            try:
                pg_ceiling = await raw_pg_ceiling(args.pg, args.events // 4)
            except Exception as exc:
                print(f"(PostgreSQL skipped: {exc})")
            else:
                row(
                    "raw asyncpg executemany, one transaction (PG baseline)",
                    f"{pg_ceiling:,.0f} ev/s",
                    "1.00x",
                )
                for sessions, batch in ((200, 1), (100, 100)):
                    rates = [
                        await append_throughput(
                            args.pg, sessions, args.events // 4 // sessions, batch
                        )
                        for _ in range(3)
                    ]
                    r = statistics.median(rates)
                    row(
                        f"log API, PostgreSQL, {sessions} appenders x {batch} ev/append",
                        f"{r:,.0f} ev/s",
                        f"{r / pg_ceiling:.2f}x",
                    )
                for k in (int(x) for x in args.replicas.split(",")):
                    r = statistics.median(
                        [
                            await replica_throughput(args.pg, k, 50, args.events // 8 // 50, 100)
                            for _ in range(3)
                        ]
                    )
                    row(
                        f"PostgreSQL, {k} replica process{'es' if k > 1 else ''} x 50 appenders x 100 ev",
                        f"{r:,.0f} ev/s",
                        f"{r / pg_ceiling:.2f}x",
                    )
        f = statistics.median([fold_speed(300_000) for _ in range(3)])
        row("fold (rebuild state from decoded events)", f"{f:,.0f} ev/s", "")
        rebuild, cold_ms, snap_ms = await long_session(
            f"sqlite+aiosqlite:///{d}/long.db", args.long
        )
        row(f"read + rebuild a {args.long:,}-event session, SQLite", f"{rebuild:,.0f} ev/s", "")
        row(f"load {args.long:,}-event session, no snapshot", f"{cold_ms:,.0f} ms", "1.00x")
        row(
            f"load {args.long:,}-event session, with snapshot (median of 5)",
            f"{snap_ms:,.1f} ms",
            f"{cold_ms / snap_ms:.0f}x faster",
        )
        med, p99 = await subscriber_latency(f"sqlite+aiosqlite:///{d}/lat.db")
        row("commit -> subscriber latency, SQLite (median / p99)", f"{med:.2f} / {p99:.2f} ms", "")
        if not args.no_pg:
            try:
                med, p99 = await subscriber_latency(args.pg)
                row(
                    "commit -> subscriber latency, PostgreSQL (median / p99)",
                    f"{med:.2f} / {p99:.2f} ms",
                    "",
                )
            except Exception as exc:
                print(f"(PostgreSQL latency skipped: {exc})")


if __name__ == "__main__":
    asyncio.run(main())
