"""The engine worker's pipe (core/engine/pipe.py): what the child writes arrives whole
and in order, however the reader falls behind; a write never stops the writer's loop;
a reader that went away breaks the outbox without raising; a close hands over the rest."""

from __future__ import annotations

import asyncio
import os
import pickle
import socket
from collections.abc import Iterator
from multiprocessing.connection import Connection

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from sessiontape.core.engine.pipe import Frames, Outbox, framed


@pytest.fixture
def pair() -> Iterator[tuple[socket.socket, socket.socket]]:
    a, b = socket.socketpair()
    try:
        yield a, b
    finally:
        a.close()
        b.close()


def read_all(frames: Frames, want: int) -> list[object]:
    got: list[object] = []
    while len(got) < want:
        got.extend(frames.read())
    return got


async def test_a_reader_that_falls_behind_gets_every_message_in_order_and_the_loop_runs_on(
    pair: tuple[socket.socket, socket.socket],
) -> None:
    mine, theirs = pair
    outbox = Outbox(mine.fileno(), asyncio.get_running_loop())
    big = os.urandom(3 << 20)  # far more than the socket buffers hold
    msgs = [("steps", i, big if i % 7 == 3 else i) for i in range(40)]
    for m in msgs:
        outbox.put(m)  # returns at once: nothing waits for the reader
    ticks = 0

    async def ticker() -> None:
        nonlocal ticks
        while True:
            ticks += 1
            await asyncio.sleep(0)

    task = asyncio.create_task(ticker())
    await asyncio.sleep(0.05)
    assert ticks > 10  # the loop ran while the pipe was full
    frames = Frames(theirs.fileno())
    got: list[object] = []
    while len(got) < len(msgs):
        got.extend(frames.read())
        await asyncio.sleep(0)  # the outbox writes more as the pipe drains
    task.cancel()
    assert got == msgs
    frames.close()
    outbox.close(1.0)


async def test_the_messages_of_one_loop_pass_go_in_one_write(
    pair: tuple[socket.socket, socket.socket],
) -> None:
    mine, theirs = pair
    outbox = Outbox(mine.fileno(), asyncio.get_running_loop())
    for i in range(5):
        outbox.put(("steps", i, [i]))
    theirs.setblocking(False)
    with pytest.raises(BlockingIOError):
        theirs.recv(1)  # nothing is written before the loop's pass ends
    await asyncio.sleep(0)
    data = theirs.recv(1 << 16)
    assert data == b"".join(
        framed(pickle.dumps(("steps", i, [i]), pickle.HIGHEST_PROTOCOL)) for i in range(5)
    )
    outbox.close(1.0)


async def test_the_connections_reader_reads_what_the_outbox_writes(
    pair: tuple[socket.socket, socket.socket],
) -> None:
    mine, theirs = pair
    outbox = Outbox(mine.fileno(), asyncio.get_running_loop())
    outbox.put(("ready", {"a": 1}))
    outbox.put(("end", 3, None, ("k", 1, 12, 0)))
    await asyncio.sleep(0)
    conn = Connection(os.dup(theirs.fileno()))
    assert conn.recv() == ("ready", {"a": 1})
    assert conn.recv() == ("end", 3, None, ("k", 1, 12, 0))
    conn.close()
    outbox.close(1.0)


async def test_a_reader_that_is_gone_breaks_the_outbox_and_later_puts_are_dropped(
    pair: tuple[socket.socket, socket.socket],
) -> None:
    mine, theirs = pair
    outbox = Outbox(mine.fileno(), asyncio.get_running_loop())
    theirs.shutdown(socket.SHUT_RDWR)
    theirs.close()
    outbox.put(("steps", 1, [1]))
    await asyncio.sleep(0)
    assert outbox.broken
    outbox.put(("steps", 2, [2]))  # no error: the child's reader sees the end itself
    await asyncio.sleep(0)
    outbox.close(1.0)


async def test_a_close_hands_over_what_is_left(
    pair: tuple[socket.socket, socket.socket],
) -> None:
    mine, theirs = pair
    outbox = Outbox(mine.fileno(), asyncio.get_running_loop())
    outbox.put(("end", 1, None, None))
    outbox.close(1.0)  # before the loop wrote it
    frames = Frames(theirs.fileno())
    assert read_all(frames, 1) == [("end", 1, None, None)]
    frames.close()


def test_an_end_of_pipe_is_eof_for_the_reader(pair: tuple[socket.socket, socket.socket]) -> None:
    mine, theirs = pair
    frames = Frames(theirs.fileno())
    assert frames.read() == []  # nothing yet: no wait
    mine.close()
    with pytest.raises(EOFError):
        frames.read()
    frames.close()


@settings(max_examples=60, deadline=None, derandomize=True)
@given(
    sizes=st.lists(st.integers(min_value=0, max_value=70_000), min_size=1, max_size=12),
    long_header=st.lists(st.booleans(), min_size=12, max_size=12),
    cuts=st.lists(st.integers(min_value=1, max_value=50_000), min_size=1, max_size=40),
)
def test_property_frames_cut_anywhere_read_back_whole(
    sizes: list[int], long_header: list[bool], cuts: list[int]
) -> None:
    """Messages in either header form (the 8-byte one is multiprocessing's for more
    than 2 GiB), arriving cut at any byte, are read back whole and in order."""
    msgs = [bytes([i % 251]) * n for i, n in enumerate(sizes)]
    stream = bytearray()
    for i, m in enumerate(msgs):
        body = pickle.dumps(m, pickle.HIGHEST_PROTOCOL)
        if long_header[i]:
            stream += b"\xff\xff\xff\xff" + len(body).to_bytes(8, "big") + body
        else:
            stream += framed(body)
    a, b = socket.socketpair()
    with a, b:
        a.setblocking(True)
        frames = Frames(b.fileno())
        got: list[object] = []
        pos, k = 0, 0
        while pos < len(stream):
            n = cuts[k % len(cuts)]
            a.sendall(stream[pos : pos + n])
            pos += n
            k += 1
            got.extend(frames.read())
            while len(got) < len(msgs) and pos >= len(stream):
                got.extend(frames.read())
        assert got == msgs
        frames.close()
