"""A live feed (transports/http/native/feeds.py): its ring of patches, what a stream resumed after a
position is given from memory and when it must go to the log instead, and who waits for
it to fold a version."""

from __future__ import annotations

from typing import Any, cast

from hypothesis import given, settings
from hypothesis import strategies as st

from sessiontape.core.document.fold import DocumentBuilder
from sessiontape.core.runtime import Runtime
from sessiontape.core.session.state import SessionState
from sessiontape.transports.http.native.feeds import Entry, Feeds, SessionFeed


def _feed(ring: int, start: int, ring_bytes: int = 1 << 20) -> SessionFeed:
    # the ring needs neither the runtime nor the feed's task
    return SessionFeed(cast(Any, None), DocumentBuilder("s"), start, ring, None, ring_bytes)


def _push(feed: SessionFeed, position: int, rfc: bool, text: str = "") -> None:
    """What ``publish`` does with an event's patch once it is serialised."""
    feed.keep(Entry(position, f"p{position}{text}", f"r{position}{text}" if rfc else None))
    feed.position = position


@settings(max_examples=300, derandomize=True, database=None)
@given(
    ring=st.integers(min_value=1, max_value=12),
    start=st.integers(min_value=0, max_value=5),
    gaps=st.lists(st.integers(min_value=1, max_value=4), max_size=40),
    after=st.integers(min_value=0, max_value=200),
)
def test_the_backlog_is_every_entry_past_the_position_in_order(
    ring: int, start: int, gaps: list[int], after: int
) -> None:
    feed = _feed(ring, start)
    position = start
    for gap in gaps:  # a session's events are some of the log's positions, rising
        position += gap
        _push(feed, position, rfc=True)
    got = feed.backlog(after, rfc=False)
    if after < feed.floor:
        assert got is None  # the ring no longer reaches back that far: the log answers
        return
    assert got is not None
    assert [en.position for en in got] == [en.position for en in feed.ring if en.position > after]
    assert feed.backlog(after, rfc=True) == got


def test_a_backlog_without_the_rfc_form_of_an_entry_is_refused_for_rfc_watchers() -> None:
    feed = _feed(8, 0)
    _push(feed, 1, rfc=False)
    _push(feed, 2, rfc=True)
    assert feed.backlog(1, rfc=True) == [feed.ring[1]]
    assert feed.backlog(0, rfc=True) is None
    assert [en.position for en in feed.backlog(0, rfc=False) or []] == [1, 2]
    assert feed.backlog(2, rfc=False) == []


async def test_a_feed_wakes_who_waits_for_a_version_once_it_folds_it(runtime: Runtime) -> None:
    st = await runtime.open_session("http", label="fold")
    await runtime.append_tokens(st.session_id, [1, 2, 3])
    await runtime.close(st.session_id)
    opened, appended, closed = await runtime.reads.read_events(st.session_id)
    feed = SessionFeed(runtime, DocumentBuilder(st.session_id), 0, 16)
    early, late = feed.folded(2), feed.folded(3)
    gone = feed.folded(3)
    gone.cancel()  # a caller that gave up (its wait timed out)
    feed.publish(opened)
    assert not early.done() and not late.done()
    feed.publish(appended)
    assert early.done() and not late.done()
    feed.publish(closed)
    assert late.done() and feed.ended and feed._folding == []
    assert feed.folded(1).done()  # what it holds already, or an ended feed: at once


async def _watched(runtime: Runtime) -> tuple[SessionState, Feeds, SessionFeed]:
    """An open session and the live feed a watcher would get of it."""
    st = await runtime.open_session("http", label="watched")
    feeds = Feeds(runtime)
    return st, feeds, await feeds.get(st.session_id)


async def test_a_feed_that_stops_short_wakes_its_waiters_and_closing_reads_the_log(
    runtime: Runtime,
) -> None:
    st, feeds, feed = await _watched(runtime)
    waiting = feed.folded(99)
    await feed.stop()  # a feed that failed or was reaped before the end came
    assert waiting.done()
    closed = await runtime.close(st.session_id)
    assert await feeds.final_document(st.session_id, closed.version) is None
    assert await feeds.final_document("s_unknown", 1) is None
    await feeds.close()


async def test_closing_waits_a_bounded_time_for_a_feed_that_has_not_folded_the_end(
    runtime: Runtime,
) -> None:
    st, feeds, feed = await _watched(runtime)
    # a version the feed never reaches (as if it lagged): the log answers instead
    assert await feeds.final_document(st.session_id, 99, wait_s=0.05) is None
    await runtime.append_tokens(st.session_id, [4, 5])
    closed = await runtime.close(st.session_id)
    doc = await feeds.final_document(st.session_id, closed.version)
    assert doc is not None and doc["status"] == "closed" and doc["version"] == closed.version
    assert feed._folding == []  # the waiter that gave up was dropped
    await feeds.close()


@settings(max_examples=200, derandomize=True, database=None)
@given(
    budget=st.integers(min_value=1, max_value=400),
    sizes=st.lists(st.integers(min_value=0, max_value=120), min_size=1, max_size=40),
    rfc=st.booleans(),
)
def test_the_ring_keeps_the_newest_patches_within_its_bytes(
    budget: int, sizes: list[int], rfc: bool
) -> None:
    feed = _feed(4096, 0, ring_bytes=budget)
    for position, size in enumerate(sizes, start=1):
        _push(feed, position, rfc, "x" * size)
    kept = [en.position for en in feed.ring]
    # the newest patches, in order, the newest always, within the budget unless alone
    assert kept == list(range(len(sizes) - len(kept) + 1, len(sizes) + 1))
    total = sum(len(en.plus) + len(en.rfc or "") for en in feed.ring)
    assert total == feed.ring_bytes
    assert len(kept) == 1 or total <= budget
    # and no fewer than fit: the one before the oldest kept would have passed the budget
    dropped = len(sizes) - len(kept)
    if dropped:
        extra = len(f"p{dropped}") + sizes[dropped - 1]
        extra += len(f"r{dropped}") + sizes[dropped - 1] if rfc else 0
        assert total + extra > budget
        # a resume from before the floor goes to the log; from the floor on, the ring answers
        assert feed.floor == dropped
        assert feed.backlog(dropped - 1, rfc=False) is None
        assert [en.position for en in feed.backlog(dropped, rfc=False) or []] == kept
