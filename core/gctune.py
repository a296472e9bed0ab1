"""The garbage collector's settings for a long-running server.

CPython's cyclic collector runs its youngest generation every 700 container
allocations and, now and then, walks every object that has survived. A
server allocates a few container objects per event (bodies, events, rows),
and its heap after startup (modules, config, the engine) never becomes
garbage: with the defaults, collections cost about a third of the log's
per-event Python time (docs/performance.md, "The log's batch append").
Reference counting frees almost everything anyway; the collector is only
for cycles, which a delay of tens of thousands of allocations does not make
a memory problem.
"""

from __future__ import annotations

import gc

#: allocations between collections of the youngest generation (CPython's default: 700)
YOUNG_THRESHOLD = 50_000


def tune_for_serving() -> None:
    """Call once startup is done: move every object alive now out of the
    collector's sight (``gc.freeze``) and collect the young generation less often."""
    gc.collect()
    gc.freeze()
    _, older, oldest = gc.get_threshold()
    gc.set_threshold(YOUNG_THRESHOLD, max(older, 20), max(oldest, 100))
