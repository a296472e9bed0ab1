"""The interpreter's settings for a long-running server: the garbage
collector's thresholds and the GIL's switch interval.

CPython's cyclic collector runs its youngest generation every 700 container
allocations and, now and then, walks every object that has survived. A
server allocates a few container objects per event (bodies, events, rows),
and its heap after startup (modules, config, the engine) never becomes
garbage: with the defaults, collections cost about a third of the log's
per-event Python time.
Reference counting frees almost everything anyway; the collector is only
for cycles, which a delay of tens of thousands of allocations does not make
a memory problem.

The log's writer thread runs SQLite with the GIL released and needs it back
for a moment after each statement; the event loop's thread, meanwhile, runs
Python (planning the next batch). CPython makes a thread that wants the GIL
wait up to the switch interval (5 ms by default) before the running thread
gives it up: several waits per batch kept SQLite's work from overlapping the
loop's. At 1 ms the writer thread gets the GIL back sooner
(docs/architecture.md, "Group commit"; bench/bench_log.py's ``--default-gc`` runs without).

Both change the whole process, the embedding application's code included, so
``sessiontape serve`` applies them only when ``[server] tune_interpreter`` asks
(:func:`apply`); off by default.
"""

from __future__ import annotations

import gc
import sys

from sessiontape.core.config import ServerSettings

#: allocations between collections of the youngest generation (CPython's default: 700)
YOUNG_THRESHOLD = 50_000

#: the GIL's switch interval, in seconds (CPython's default: 0.005)
SWITCH_INTERVAL_S = 0.001


def tune_for_serving() -> None:
    """Call once startup is done: move every object alive now out of the
    collector's sight (``gc.freeze``), collect the young generation less often,
    and hand the GIL between threads sooner."""
    gc.collect()
    gc.freeze()
    _, older, oldest = gc.get_threshold()
    gc.set_threshold(YOUNG_THRESHOLD, max(older, 20), max(oldest, 100))
    sys.setswitchinterval(SWITCH_INTERVAL_S)


def apply(server: ServerSettings) -> bool:
    """:func:`tune_for_serving` when ``[server] tune_interpreter`` asks for it; whether
    it did."""
    if not server.tune_interpreter:
        return False
    tune_for_serving()
    return True
