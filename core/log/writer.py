"""The log's single writer: group commit of every session's appends.

Appends from every session queue up as requests; the writer task drains
what is queued (up to ``batch_max`` events) and commits it in one
transaction (:meth:`Dialect.transaction`): position lock, the events in
multi-row INSERTs (SQLite) or one COPY (PostgreSQL, 32 rows or more), one
statement for the sessions index per shape of change, blobs deduplicated by
sha256.
Each body is encoded to canonical JSON once, for both the hash and the
stored column. Only after COMMIT are the appenders' futures resolved and
the events handed on (``on_commit``): durable before visible. A batch that
fails is retried request by request, so only the guilty request fails.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections import OrderedDict
from collections.abc import Awaitable, Callable
from typing import Any

from sqlalchemy.exc import DBAPIError, OperationalError

from sessiontape.core import metrics
from sessiontape.core.errors import (
    ConcurrencyError,
    InvalidArgument,
    LogClosed,
    LogUnavailable,
)
from sessiontape.core.events import Event
from sessiontape.core.log.dialect import Dialect, NotNow
from sessiontape.core.log.plan import (
    CacheMiss,
    Moved,
    Plan,
    Planner,
    Request,
    RequestKind,
    batch_args,
)

#: how long the writer must have been idle (since its last commit landed) for
#: :meth:`Writer.commit_now` to commit an append on the spot: generations of a fast
#: engine, each committing every millisecond or so, would otherwise commit every idle
#: moment's append at once (runs of a token or two, where the write loop's hand-offs
#: let more steps gather), and run slower. An append that follows its own
#: session's commit alone has no one to gather with and is not held to it.
NOW_IDLE_S = 0.001


def unavailable(exc: BaseException) -> LogUnavailable:
    """The error a caller gets when the database cannot be used: no SQL, no driver text."""
    err = LogUnavailable(
        f"the event log's database is unavailable ({type(exc).__name__}); try again"
    )
    err.__cause__ = exc
    return err


class Writer:
    """One per log: the task that commits every append of this process."""

    def __init__(
        self,
        dialect: Dialect,
        on_commit: Callable[[list[Event]], None],
        *,
        batch_max: int,
        inline_max_bytes: int,
        on_expect: Callable[[int], None] | None = None,
    ) -> None:
        self.dialect = dialect
        self.on_commit = on_commit
        #: told the log's end a one-call commit will leave, before it is sent: this
        #: process hands those events on itself (its own NOTIFY wakes no tail read)
        self.on_expect = on_expect
        self.batch_max = batch_max
        self.inline_max_bytes = inline_max_bytes
        self.planner = Planner(dialect, inline_max_bytes)
        self._queue: asyncio.Queue[Request | None] = asyncio.Queue()
        #: session heads this writer knows (version, hash); read from the database when not
        self._heads: OrderedDict[str, tuple[int, str]] = OrderedDict()
        #: the last position this writer committed (None until its first commit)
        self._last_position: int | None = None
        self._task: asyncio.Task[None] | None = None
        self._closing = False
        #: the write loop has a batch waiting for the transaction before it to end
        self._next_waiting = False
        #: the write loop's batch in flight (its events are not all handed on while it runs)
        self._committing: asyncio.Task[bool] | None = None
        #: an append committed right away (:meth:`commit_now`) in this turn of the loop:
        #: the appends after it in the same turn queue up, to be committed together
        self._now_this_turn = False
        #: when the last commit landed (perf_counter), and its one session (None when
        #: it carried several)
        self._landed_at = 0.0
        self._landed_session: str | None = None
        #: test hook: awaited inside the write transaction, just before COMMIT
        self.before_commit: Callable[[list[Event]], Awaitable[None]] | None = None

    def start(self) -> None:
        self._task = asyncio.create_task(self._write_loop(), name="sessiontape-log-writer")

    @property
    def running(self) -> bool:
        return self._task is not None and not self._closing

    async def close(self) -> None:
        """Commit what is queued, refuse what comes after, stop."""
        if self._task is None:
            return
        self._closing = True
        await self._queue.put(None)
        with contextlib.suppress(asyncio.CancelledError):
            await self._task
        self._task = None
        while not self._queue.empty():
            left = self._queue.get_nowait()
            if left is not None and not left.future.done():
                left.future.set_exception(
                    LogClosed("the event log closed before this append committed")
                )

    async def submit(self, req: Request) -> list[Event]:
        if not self.running:
            raise LogClosed("the event log is closed")
        await self._queue.put(req)
        return await req.future

    def commit_now(self, req: Request) -> list[Event] | None:
        """Commit an append right here, without a turn of the loop, when the writer
        is idle; its events, or None when it must be submitted instead.

        The write loop's path costs an append several turns of the loop and
        hand-offs between tasks (queue, write loop, commit task, the appender's
        future), a few hundred microseconds of CPU each time: what one slow
        generation (a step every few milliseconds, each its own commit) pays
        for every token. When nothing is queued or in flight, nothing can come
        between: the append is planned and committed synchronously (SQLite's
        inline transaction, which does not wait for a lock) and handed on at
        once. Only one append per turn of the loop goes this way; the appends
        after it in the same turn (other sessions woken by the same commit)
        queue up and commit together, as before. So do appends that come within
        :data:`NOW_IDLE_S` of another session's commit: appends that follow each
        other closely (several generations of a fast engine) are better left to
        the write loop, whose hand-offs give the next ones time to gather. An
        append that follows its own session's commit (a short turn's generation
        after the turn's append, a millisecond apart on a fast machine) commits
        at once: waiting gathers nobody, and the write loop's path would cost a
        served turn more CPU and time.

        Anything unusual (an unknown session head, a version that does not
        match, a write lock held elsewhere, an error) gives None, and
        :meth:`submit` then does it the usual way: errors are found and
        reported there, with nothing written here.
        """
        if (
            req.kind != RequestKind.APPEND
            or (
                time.perf_counter() - self._landed_at < NOW_IDLE_S
                and req.session_id != self._landed_session
            )
            or self._now_this_turn
            or not self.running
            or self.before_commit is not None
            or not self._queue.empty()
            or (self._committing is not None and not self._committing.done())
        ):
            return None
        t0 = time.perf_counter()
        plan = self._plan_from_cache([req], after=None)
        if plan is None:
            return None
        try:
            results = self.dialect.transaction_now(
                lambda cur: self.planner.apply(cur, plan, expect_position=True)
            )
        except NotNow:
            return None
        except Exception:
            self._heads.pop(req.session_id, None)
            return None
        self._now_this_turn = True
        asyncio.get_running_loop().call_soon(self._next_turn)
        self._landed(results)
        self._finish([req], results, t0)
        return results[0]

    def _next_turn(self) -> None:
        self._now_this_turn = False

    async def _write_loop(self) -> None:
        """Take what is queued as one batch, plan it, commit it; repeat.

        A batch is planned while the one before it is still committing (on the
        writer thread), from what the log will be once that commits: the
        Python work of the next batch overlaps SQLite's work of this one. If
        the earlier batch did not commit exactly as planned, the later plan is
        dropped and made again inside its own transaction.
        """
        committing: asyncio.Task[bool] | None = None
        landed: asyncio.Future[bool] | None = None  # ``committing``'s transaction is over
        ahead: Plan | None = None  # the plan ``committing`` carries out
        try:
            while True:
                first = await self._queue.get()
                if first is None:
                    return
                batch, n = [first], len(first.events)
                stop = False
                while n < self.batch_max and not self._queue.empty():
                    nxt = self._queue.get_nowait()
                    if nxt is None:
                        stop = True
                        break
                    batch.append(nxt)
                    n += len(nxt.events)
                if landed is not None and not landed.done():
                    plan = None if ahead is None else self._plan_from_cache(batch, after=ahead)
                    self._next_waiting = True
                    try:
                        if not await landed:
                            plan = None
                    finally:
                        self._next_waiting = False
                else:
                    plan = self._plan_from_cache(batch, after=None)
                landed = asyncio.get_running_loop().create_future()
                committing = self._committing = asyncio.create_task(
                    self._commit_batch(batch, plan, landed)
                )
                ahead = plan
                # let the commit reach the writer thread before planning the next batch
                await asyncio.sleep(0)
                if stop:
                    return
        finally:
            if committing is not None:
                await committing

    async def _commit_batch(
        self, batch: list[Request], plan: Plan | None, landed: asyncio.Future[bool]
    ) -> bool:
        """Commit ``batch``; True when it committed whole, as ``plan`` said.

        ``landed`` is given that answer as soon as the transaction is over, before
        the batch's appenders are told: the write loop hands its next batch to
        the writer thread first. Told first, the appenders would run (and make
        their next events) while the writer thread waited for the loop.
        """
        try:
            return await self._commit(batch, plan, landed)
        finally:
            if not landed.done():
                landed.set_result(False)

    async def _commit(
        self, batch: list[Request], plan: Plan | None, landed: asyncio.Future[bool]
    ) -> bool:
        t0 = time.perf_counter()
        try:
            results, as_planned = await self._run_tx(batch, plan)
        except Exception as exc:
            if self.dialect.is_unavailable(exc):
                # the database went away: nothing of the batch was written, and
                # no request of it is to blame
                await self.dialect.reset_pool()
                for req in batch:
                    self._fail(req, exc)
                return False
            # Something in the batch failed (a conflict with another process,
            # a stale cache, one bad request): retry each request alone so
            # only the guilty one fails.
            self._heads.clear()
            if len(batch) == 1:
                self._fail(batch[0], exc)
                return False
            for req in batch:
                try:
                    res, _ = await self._run_tx([req], None)
                except Exception as one_exc:
                    self._heads.pop(req.session_id, None)
                    self._fail(req, one_exc)
                else:
                    self._finish([req], [res[0]], t0)
            return False
        landed.set_result(as_planned)
        if self._next_waiting:
            # one turn of the loop: the write loop starts the next transaction
            await asyncio.sleep(0)
        self._finish(batch, results, t0)
        return as_planned

    def _fail(self, req: Request, exc: BaseException) -> None:
        if self.dialect.is_conflict(exc):
            exc = ConcurrencyError(
                f"session {req.session_id}: concurrent append (version conflict)"
            )
        elif self.dialect.is_unavailable(exc):
            exc = unavailable(exc)
        elif isinstance(exc, DBAPIError) and not isinstance(exc, OperationalError):
            exc = InvalidArgument(
                f"session {req.session_id}: the database refused the write: {exc.orig}"
            )
        if not req.future.done():
            req.future.set_exception(exc)

    def _finish(self, batch: list[Request], results: list[list[Event]], t0: float) -> None:
        all_events: list[Event] = []
        for req, evs in zip(batch, results, strict=True):
            all_events.extend(evs)
            if not req.future.done():
                req.future.set_result(evs)
        if all_events:
            metrics.EVENTS_APPENDED.inc(len(all_events))
            metrics.COMMIT_SECONDS.observe(time.perf_counter() - t0)
            metrics.BATCH_SIZE.observe(len(all_events))
            self.on_commit(all_events)

    def _head(self, cur: Any, session_id: str) -> tuple[int, str] | None:
        head = self._heads.get(session_id)
        if head is not None:
            self._heads.move_to_end(session_id)
            return head
        cur.execute(
            self.dialect.sql("SELECT version, head_hash FROM sessions WHERE id = ?"), (session_id,)
        )
        row = cur.fetchone()
        if row is None:
            return None
        return int(row[0]), str(row[1])

    def _remember(self, session_id: str, head: tuple[int, str]) -> None:
        self._heads[session_id] = head
        self._heads.move_to_end(session_id)
        while len(self._heads) > 100_000:
            self._heads.popitem(last=False)

    async def _run_tx(
        self, batch: list[Request], plan: Plan | None
    ) -> tuple[list[list[Event]], bool]:
        """Commit ``batch``, by ``plan`` when one was made and still holds; the
        results, and whether the plan was used."""
        hook = self.before_commit

        async def before(results: list[list[Event]]) -> None:
            assert hook is not None
            await hook([e for r in results for e in r])

        def run(work: Callable[[Any], list[list[Event]]]) -> Awaitable[list[list[Event]]]:
            return self.dialect.transaction(
                work, None if hook is None else before, small=len(batch) == 1
            )

        results: list[list[Event]] | None = None
        args = None
        if plan is not None and hook is None and self.dialect.one_call_append:
            args = batch_args(plan)
        if plan is not None and args is not None:
            if self.on_expect is not None:
                self.on_expect(plan.end)
            if await self.dialect.append_batch(args):
                results = plan.results
            else:
                plan = self._moved()  # None: planned again inside the transaction
        if plan is not None and results is None:
            planned = plan
            try:
                results = await run(
                    lambda cur: self.planner.apply(cur, planned, expect_position=True)
                )
            except Moved:
                plan = self._moved()
        if results is None:
            results = await run(lambda cur: self._write(cur, batch))
        self._landed(results)
        return results, plan is not None

    def _moved(self) -> Plan | None:
        """Another process wrote since a plan was made: no plan (it is made again inside
        the transaction), and the cached heads forgotten (that process may have written
        to any of them; each is read again when next used)."""
        self._heads.clear()
        return None

    def _landed(self, results: list[list[Event]]) -> None:
        """What a commit tells the planner: the session heads and the log's end."""
        self._landed_at = time.perf_counter()
        alone: str | None = None
        for n, evs in enumerate(evs for evs in results if evs):
            sid = evs[-1].session_id
            alone = sid if n == 0 or alone == sid else None
            self._remember(sid, (evs[-1].version, evs[-1].hash))
            self._last_position = max(self._last_position or 0, evs[-1].position)
        self._landed_session = alone

    @property
    def last_position(self) -> int | None:
        """The log's end as of this writer's last commit (None before its first)."""
        return self._last_position

    def _plan_from_cache(self, batch: list[Request], *, after: Plan | None) -> Plan | None:
        """The batch's rows, hashes and events, computed before its transaction from
        what this writer knows (session heads, the last position; or, ``after``,
        what the log will be once that plan commits), or None when something
        must be read from the database first.

        Run on the event loop's thread, so that the writer thread (SQLite) does
        little but SQL: SQLite's work, which releases the GIL, overlaps this
        Python work. :meth:`Planner.apply` checks, under the write lock, that the log
        still ends where the plan assumed (:class:`Moved`). On a database shared by
        several processes (PostgreSQL) another process's write moves the log's end,
        so a plan made from a stale cache never commits: it is made again inside
        the transaction, and the cached heads are forgotten (:meth:`_moved`).
        """
        start = self._last_position if after is None else after.end
        if start is None or any(
            req.kind not in (RequestKind.APPEND, RequestKind.TOUCH) for req in batch
        ):
            return None
        heads = self._heads
        later = {} if after is None else after.heads

        def head_of(_cur: Any, sid: str) -> tuple[int, str] | None:
            head = later.get(sid) or heads.get(sid)
            if head is not None:
                return head
            raise CacheMiss

        try:
            return self.planner.plan(None, batch, start, head_of, recheck=None)
        except Exception:
            # an unknown session, a version that does not match, a request that
            # cannot be planned at all: planned inside the transaction instead,
            # where what fails fails only its own request
            return None

    def _write(self, cur: Any, batch: list[Request]) -> list[list[Event]]:
        """The batch's statements on a DBAPI cursor, inside the caller's transaction:
        plan with the database at hand, then apply."""
        self.dialect.lock_positions(cur)
        cur.execute("SELECT COALESCE(MAX(position), 0) FROM events")
        pos = int(cur.fetchone()[0])

        def recheck(cur: Any, sid: str) -> tuple[int, str] | None:
            # the cached head may be stale (another process wrote): ask the database
            if self._heads.pop(sid, None) is None:
                raise CacheMiss  # it came from the database already
            return self._head(cur, sid)

        plan = self.planner.plan(cur, batch, pos, self._head, recheck=recheck)
        return self.planner.apply(cur, plan, expect_position=False)
