"""Per-session KV caches: prefix reuse, fork sharing, a memory bound with LRU eviction.

A session's cache is an :class:`Entry`: the tokens whose keys and values
are cached (``tokens``; ``len(tokens)`` is the cached length) and a
:class:`KV` snapshot holding one tensor per layer and kind, each at least
that long.

With a static-layout model the snapshot is the session's buffer, written in
place by every pass; the engine copies a buffer that a fork shares before
writing into it (:meth:`KVCache.shared`), truncation keeps the buffer
(``keep_buffer``), and ``on_free`` hands a buffer no entry holds back to the
runner's pool. The rest of this docstring is the concat layout's story.

Concat snapshots are immutable: every forward pass produces new
``present`` tensors (the model concatenates past and new anyway), and the
entry then points at the new snapshot. That makes forks copy-on-write for
free: a fork points at its parent's snapshot with a shorter token list,
nothing is copied, and the first pass of either side produces its own
tensors while the other keeps the shared ones. Memory is counted once per
snapshot however many entries share it.

Validity is by comparison, never by trust: a call brings the whole history,
the cache keeps the longest common prefix of its tokens and the history, and
everything after it is recomputed. Truncation, rewinds and edited histories
therefore need no special case, and an evicted session is simply recomputed.

The bound (``max_bytes``) covers every snapshot. When it is exceeded, the
least recently used entries that are not in use by a running generation are
dropped; an entry in use is dropped once its generation ends if the bound
still does not hold.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np


@dataclass(eq=False)
class KV:
    """One immutable snapshot: ``tensors[2*i]`` is layer i's keys, ``[2*i+1]`` its values.

    ``length`` is the tensors' sequence length; positions past the owning
    entry's token count (a dropped padding row) are ignored.
    """

    tensors: tuple[Any, ...]
    length: int
    nbytes: int


@dataclass(eq=False)
class Entry:
    key: str
    tokens: list[int] = field(default_factory=list)
    kv: KV | None = None
    users: int = 0
    live: bool = True

    @property
    def length(self) -> int:
        return len(self.tokens) if self.kv is not None else 0


def common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    n = min(len(a), len(b))
    if n > 64:  # compared in numpy: a long history costs microseconds, not a Python loop
        diff = np.flatnonzero(
            np.asarray(a[:n], dtype=np.int64) != np.asarray(b[:n], dtype=np.int64)
        )
        return int(diff[0]) if diff.size else n
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i


class KVCache:
    def __init__(self, max_bytes: int, on_free: Callable[[KV], None] | None = None) -> None:
        self.max_bytes = int(max_bytes)
        #: called with a snapshot no entry holds any more (static buffers go back to a pool)
        self.on_free = on_free
        self._entries: OrderedDict[str, Entry] = OrderedDict()
        self._refs: dict[int, list[Any]] = {}  # id(KV) -> [KV, count]
        self.total_bytes = 0
        self.evictions = 0

    def __contains__(self, key: str) -> bool:
        return key in self._entries

    def get(self, key: str) -> Entry | None:
        return self._entries.get(key)

    def checkout(self, key: str) -> Entry:
        """The entry for ``key`` (created empty if none), marked in use and most recent."""
        e = self._entries.get(key)
        if e is None:
            e = self._entries[key] = Entry(key)
        self._entries.move_to_end(key)
        e.users += 1
        return e

    def release(self, entry: Entry) -> None:
        entry.users -= 1
        if not entry.live and entry.users == 0:
            # forgotten while a generation used it: its buffer is free only now
            self._unref(entry.kv)
            entry.kv = None
        self._enforce()

    def store(self, entry: Entry, tokens: list[int], kv: KV | None) -> None:
        """Point ``entry`` at ``kv``, which caches ``tokens``; then honour the bound."""
        if kv is not entry.kv:
            self._ref(kv)
            self._unref(entry.kv)
        entry.tokens, entry.kv = tokens, kv
        if entry.live:
            self._entries.move_to_end(entry.key)
            self._enforce()

    def truncate(self, entry: Entry, length: int, keep_buffer: bool = False) -> None:
        """Keep the first ``length`` tokens; an emptied entry drops its snapshot unless
        ``keep_buffer`` (a static buffer the caller goes on writing into)."""
        del entry.tokens[length:]
        if not entry.tokens and not keep_buffer:
            self.store(entry, [], None)

    def holds(self, kv: KV) -> bool:
        """Whether any entry holds ``kv``."""
        return id(kv) in self._refs

    def shared(self, kv: KV) -> bool:
        """Whether another entry (a fork) holds ``kv`` too."""
        slot = self._refs.get(id(kv))
        return slot is not None and slot[1] > 1

    def fork(self, parent: str, child: str, at: int) -> None:
        p = self._entries.get(parent)
        self.forget(child)
        if p is None or p.kv is None:
            return
        e = self._entries[child] = Entry(child, p.tokens[: max(0, min(at, p.length))], None)
        if e.tokens:
            self.store(e, e.tokens, p.kv)
        self._entries.move_to_end(parent)

    def forget(self, key: str) -> None:
        e = self._entries.pop(key, None)
        if e is not None:
            e.live = False
            if e.users == 0:
                self._unref(e.kv)
                e.kv = None

    def live_bytes(self, key: str) -> int:
        e = self._entries.get(key)
        return 0 if e is None or e.kv is None else e.kv.nbytes

    def cached_length(self, key: str) -> int | None:
        e = self._entries.get(key)
        return None if e is None or e.kv is None else e.length

    def _ref(self, kv: KV | None) -> None:
        if kv is None:
            return
        slot = self._refs.get(id(kv))
        if slot is None:
            self._refs[id(kv)] = [kv, 1]
            self.total_bytes += kv.nbytes
        else:
            slot[1] += 1

    def _unref(self, kv: KV | None) -> None:
        if kv is None:
            return
        slot = self._refs[id(kv)]
        slot[1] -= 1
        if slot[1] == 0:
            del self._refs[id(kv)]
            self.total_bytes -= kv.nbytes
            if self.on_free is not None:
                self.on_free(kv)

    def _enforce(self) -> None:
        if self.total_bytes <= self.max_bytes:
            return
        for key in list(self._entries):
            if self.total_bytes <= self.max_bytes:
                break
            e = self._entries[key]
            if e.users == 0 and e.kv is not None:
                self.forget(key)
                self.evictions += 1
