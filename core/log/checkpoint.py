"""SQLite checkpoints off the write path.

In WAL mode every commit appends pages to the ``-wal`` file, and a
*checkpoint* copies them back into the database file. SQLite's automatic
checkpoint runs inside the COMMIT that takes the WAL past
``wal_autocheckpoint`` pages (1,000, about 4 MB): that commit copies the pages
and syncs both files (``synchronous = NORMAL``) before it returns, so every
append waiting on it waits for the copy too, and on a machine with two cores
the copy competes with the event loop for the interpreter's time.

:class:`Checkpointer` runs the checkpoints on a thread of its own, with its own
connection: it is woken once the writer has written
:data:`CHANGES_PER_CHECKPOINT` rows since the last checkpoint (or after
:data:`IDLE_S` with fewer), and makes a ``PASSIVE`` checkpoint (which never
waits for, nor blocks, the writer or a reader), at most every
``interval_s``, with the interpreter lock released. A generation's small
commits so pay a checkpoint's two syncs once per couple of thousand rows,
not per commit. The writer's connection keeps an automatic checkpoint only
as a backstop (:data:`BACKSTOP_PAGES`), for a WAL the thread cannot keep
up with.
Durability is unchanged: a committed transaction is in the WAL either way,
and a process killed mid-checkpoint is recovered from the WAL on the next
open (SQLite's own recovery).
"""

from __future__ import annotations

import logging
import sqlite3
import threading

log = logging.getLogger("sessiontape.log")

#: the writer connection's own automatic checkpoint, in pages (about 40 MB at 4 KiB):
#: only reached when the checkpoint thread falls that far behind
BACKSTOP_PAGES = 10_000
#: rows written (``total_changes`` of the writer's connection) that call for a checkpoint
CHANGES_PER_CHECKPOINT = 2_000
#: the least time between two checkpoints of the thread
INTERVAL_S = 0.02
#: the longest fewer rows wait for their checkpoint
IDLE_S = 1.0


class Checkpointer:
    """Makes PASSIVE checkpoints of the database at ``path`` when told it committed."""

    def __init__(self, path: str, synchronous: str, *, interval_s: float = INTERVAL_S) -> None:
        self.path = path
        self.synchronous = synchronous
        self.interval_s = interval_s
        #: checkpoints made, and the last one's (busy, WAL frames, frames copied)
        self.runs = 0
        self.last: tuple[int, int, int] | None = None
        #: the writer's rows written, as of its last commit and of the last checkpoint
        self._changes = 0
        self._copied = 0
        self._dirty = threading.Event()
        self._closing = threading.Event()
        self._thread = threading.Thread(
            target=self._run, name="sessiontape-log-checkpoint", daemon=True
        )
        self._thread.start()

    @property
    def caught_up(self) -> bool:
        """Whether the last checkpoint copied every row the writer had written by then
        and everything in the WAL (nothing is left for the thread to do)."""
        last = self.last
        return self._copied == self._changes and last is not None and last[1] == last[2]

    def committed(self, total_changes: int) -> None:
        """A write transaction committed; ``total_changes``: the writer connection's
        count of rows written so far."""
        self._changes = total_changes
        if total_changes - self._copied >= CHANGES_PER_CHECKPOINT:
            self._dirty.set()

    def _run(self) -> None:
        conn: sqlite3.Connection | None = None
        try:
            while True:
                # enough rows to copy, or fewer that have waited IDLE_S
                self._dirty.wait(IDLE_S)
                if self._closing.is_set():
                    return
                self._dirty.clear()
                changes = self._changes
                if changes == self._copied:
                    continue
                try:
                    if conn is None:
                        conn = sqlite3.connect(
                            self.path, timeout=30, isolation_level=None, check_same_thread=False
                        )
                        # a checkpoint syncs (or not) as this connection's setting says
                        conn.execute(f"PRAGMA synchronous={self.synchronous}")
                    row = conn.execute("PRAGMA wal_checkpoint(PASSIVE)").fetchone()
                    self.last = (int(row[0]), int(row[1]), int(row[2]))
                    self.runs += 1
                    self._copied = changes
                except sqlite3.Error as exc:
                    # the writer's backstop checkpoint still bounds the WAL
                    log.warning("checkpointing %s failed: %s", self.path, exc)
                if self._closing.wait(self.interval_s):
                    return
        finally:
            if conn is not None:
                conn.close()

    def close(self) -> None:
        """Stop the thread (what is left is checkpointed when the last connection closes)."""
        self._closing.set()
        self._dirty.set()
        self._thread.join(10)
