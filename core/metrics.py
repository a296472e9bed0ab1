"""Prometheus metrics, defined once; transports expose them (``/metrics``)."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from prometheus_client import Counter, Gauge, Histogram

EVENTS_APPENDED = Counter("sessiontape_events_appended_total", "Events committed to the log")
COMMIT_SECONDS = Histogram(
    "sessiontape_commit_seconds",
    "Group-commit latency",
    buckets=(0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 1.0),
)
BATCH_SIZE = Histogram(
    "sessiontape_commit_batch_events",
    "Events per group commit",
    buckets=(1, 2, 5, 10, 50, 100, 500, 1000, 2000, 5000),
)
SUBSCRIBERS = Gauge("sessiontape_subscribers", "Live log subscribers")
SESSIONS_OPEN = Gauge("sessiontape_sessions_open", "Sessions open in this process")
GENERATIONS_WAITING = Gauge(
    "sessiontape_generations_waiting",
    "Generations waiting for their place ([generation] max_active)",
)
#: protocols a session may be labelled with in metrics; any other client-chosen name counts as "other"
KNOWN_PROTOCOLS = frozenset({"http", "evergreen", "salience", "kakeya", "nostr", "openai", "d4"})


class _ProtocolCounter(Counter):
    """A counter whose one label is a protocol from a closed set: a client cannot grow the series."""

    def labels(self, *values: Any, **kw: Any) -> Any:
        if values:
            values = tuple(v if v in KNOWN_PROTOCOLS else "other" for v in values)
        kw = {k: (v if v in KNOWN_PROTOCOLS else "other") for k, v in kw.items()}
        return super().labels(*values, **kw)


SESSIONS_OPENED = _ProtocolCounter(
    "sessiontape_sessions_opened_total", "Sessions opened", ["protocol"]
)
TTFT_SECONDS = Histogram(
    "sessiontape_time_to_first_token_seconds",
    "Time from generate to first committed token",
    buckets=(0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 10.0),
)
TOKENS_GENERATED = Counter("sessiontape_tokens_generated_total", "Tokens generated and committed")
TOKENS_PER_SECOND = Histogram(
    "sessiontape_generation_tokens_per_second",
    "Decode speed per generation",
    buckets=(1, 5, 10, 25, 50, 100, 250, 500, 1000, 5000),
)
KV_BYTES = Gauge("sessiontape_kv_cache_bytes", "Bytes held in engine KV caches")
INVARIANT_VIOLATIONS = Counter(
    "sessiontape_cache_invariant_violations_total", "Kakeya INV-1/INV-2 violations", ["invariant"]
)
ENGINE_PROVIDER = Gauge(
    "sessiontape_engine_info", "Engine in use", ["engine", "provider", "model_id"]
)
ERRORS = Counter("sessiontape_errors_total", "Errors returned to clients", ["code"])
STATE_CACHE = Counter(
    "sessiontape_state_cache_total",
    "Session state lookups by this process, by result (hit: cached; miss: loaded from the log)",
    ["result"],
)
STALE_RETRIES = Counter(
    "sessiontape_stale_retries_total",
    "Commands re-run on a reloaded state after another process moved the session on",
)
#: a batching engine's scheduler (engines whose ``scheduler_stats`` is empty leave these at 0)
BATCH_SLOTS_IN_USE = Gauge(
    "sessiontape_engine_batch_slots_in_use", "KV slots held by generating sessions"
)
BATCH_SLOTS = Gauge("sessiontape_engine_batch_slots", "KV slots in the engine's pool")
BATCH_QUEUE = Gauge("sessiontape_engine_batch_queue", "Generations waiting for a free KV slot")
BATCH_OCCUPANCY = Gauge(
    "sessiontape_engine_batch_pass_occupancy",
    "Sessions in the last batched pass over the slots that pass spanned",
)
BATCH_PASSES = Gauge("sessiontape_engine_batch_passes", "Batched decode passes run")


def watch_engine(stats: Callable[[], Mapping[str, float]]) -> None:
    """Read the scheduler gauges from ``stats`` (an engine's ``scheduler_stats``) at scrape time."""
    for gauge, key in (
        (BATCH_SLOTS_IN_USE, "slots_in_use"),
        (BATCH_SLOTS, "slots"),
        (BATCH_QUEUE, "queue"),
        (BATCH_OCCUPANCY, "pass_occupancy"),
        (BATCH_PASSES, "passes"),
    ):
        gauge.set_function(lambda key=key: float(stats().get(key, 0.0)))  # type: ignore[misc]
