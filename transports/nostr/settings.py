"""The worker's options (``[transports.nostr]``, :class:`NostrOptions`) and what it runs on
(:class:`Settings`: the options with the secret key read and the functions resolved).

Example::

    [transports.nostr]
    enabled = true
    relays = ["wss://relay.example"]
    key_file = "/etc/sessiontape/nostr.key"   # nsec1... or 64 hex chars; or key_env = "NOSTR_KEY"
    price_msat = 1000                         # per iteration = per generated token
    functions = [{ name = "text-generation", description = "Text completion" }]
    function_ids = []                         # already-published function events to serve
    stream_every_tokens = 16
    stream_every_ms = 500
    negotiate_function_id = "321ddf..."       # the "negotiate price" function
    index_size = 10000                        # calls/results kept in memory; older ones come from the log
    republish_every_s = 30                    # retry answers no relay took
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping
from dataclasses import dataclass, field, fields, replace
from pathlib import Path
from typing import Any

from sessiontape.core.errors import ConfigError
from sessiontape.core.settings_framework import load_section, option
from sessiontape.core.transport import TransportSettings
from sessiontape.transports.nostr.d4 import SAMPLE_NEGOTIATE_FUNCTION_ID

_HEX64 = re.compile(r"^[0-9a-f]{64}$")


def _hex_check(value: str) -> str | None:
    return None if _HEX64.match(value.lower()) else "must be a 64-hex-digit event id"


def _hex_ids(value: tuple[str, ...]) -> str | None:
    bad = [v for v in value if not _HEX64.match(v.lower())]
    return f"must be 64-hex-digit event ids ({bad[0]!r} is not)" if bad else None


@dataclass(frozen=True)
class FunctionSpec:
    name: str = option(doc="the function's name")
    description: str = option("", "what it does, as published")
    #: an already-published function event; None: publish one (or reuse the log's)
    id: str | None = option(None, "an already-published function event to serve", check=_hex_check)

    def __post_init__(self) -> None:
        if not self.name:
            raise ConfigError("transports.nostr.functions entries need a name")


@dataclass(frozen=True)
class NostrOptions(TransportSettings):
    """``[transports.nostr]``: the D4 (DDIP-001) worker and NIP-90 text generation."""

    relays: str | tuple[str, ...] = option(
        (), "relay URLs to serve on (one string: one relay); needed when enabled"
    )
    key_file: str | None = option(None, "the worker's secret key file (nsec or 64 hex digits)")
    key_env: str | None = option(None, "or the environment variable that holds it")
    price_msat: int = option(1000, "price per iteration (one generated token), msat", ge=0)
    functions: tuple[FunctionSpec, ...] = option(
        (),
        "functions to publish: tables of `name`, `description` and optionally `id`",
        shown="one `text-generation` function",
    )
    function_ids: tuple[str, ...] = option(
        (), "already-published function events to serve", check=_hex_ids
    )
    stream_every_tokens: int = option(16, "a partial result every this many tokens ...", ge=1)
    stream_every_ms: int = option(500, "... or milliseconds", ge=1)
    stream_gap_ms: int = option(
        25,
        "... but never sooner than this after the last (a fast engine's cap)",
        ge=0,
        le=60_000,
    )
    negotiate_function_id: str = option(
        SAMPLE_NEGOTIATE_FUNCTION_ID, "the price-negotiation function", check=_hex_check
    )
    default_max_tokens: int = option(256, "tokens generated when a call names no limit", ge=1)
    since_slack_s: int = option(
        300, "re-subscribe this many seconds before the last call seen (clocks drift)", ge=0
    )
    max_concurrent_calls: int = option(8, "calls served at once", ge=1)
    publish_retries: int = option(5, "tries to publish an event per relay", ge=0)
    retry_base_s: float = option(0.2, "first back-off between publish tries", ge=0)
    reconnect_min_s: float = option(1.0, "first back-off before reconnecting a relay", gt=0)
    connect_timeout_s: float = option(5.0, "seconds to connect to a relay", gt=0)
    nip90: bool = option(True, "also serve NIP-90 text-generation jobs")
    index_size: int = option(
        10_000, "calls, results and event ids kept in memory (each); older come from the log", ge=1
    )
    republish_every_s: float = option(
        30.0, "how often answers no relay took are published again (and on reconnect)", gt=0
    )


@dataclass(frozen=True)
class Settings:
    """What the worker runs on: :class:`NostrOptions` with the relays checked, the
    secret key read and the functions resolved."""

    relays: tuple[str, ...]
    #: the secret key (nsec or hex); kept out of repr so it is never logged
    secret: str = field(repr=False)
    functions: tuple[FunctionSpec, ...]
    price_msat: int
    stream_every_tokens: int
    stream_every_ms: int
    stream_gap_ms: int
    negotiate_function_id: str
    default_max_tokens: int
    since_slack_s: int
    max_concurrent_calls: int
    publish_retries: int
    retry_base_s: float
    reconnect_min_s: float
    connect_timeout_s: float
    nip90: bool
    index_size: int
    republish_every_s: float

    @classmethod
    def from_options(cls, options: Mapping[str, Any] | NostrOptions) -> Settings:
        """The worker's settings from its ``[transports.nostr]`` table, or ConfigError."""
        opts = load_section(NostrOptions, options, "transports.nostr")
        relays = (opts.relays,) if isinstance(opts.relays, str) else opts.relays
        if not relays:
            raise ConfigError("transports.nostr.relays must be a non-empty list of relay URLs")
        functions = list(opts.functions)
        for fid in opts.function_ids:
            functions.append(
                FunctionSpec(name=f"function-{fid[:8]}", description="", id=fid.lower())
            )
        if not functions:
            functions = [
                FunctionSpec("text-generation", "Text generation on the configured engine")
            ]
        shared = {f.name: getattr(opts, f.name) for f in fields(cls) if hasattr(opts, f.name)}
        shared.update(
            relays=relays,
            secret=_read_secret(opts),
            functions=tuple(
                replace(f, id=f.id.lower()) if f.id is not None else f for f in functions
            ),
            negotiate_function_id=opts.negotiate_function_id.lower(),
        )
        return cls(**shared)


def _read_secret(options: NostrOptions) -> str:
    if options.key_file:
        path = Path(options.key_file)
        try:
            secret = path.read_text().strip()
        except OSError as exc:
            raise ConfigError(
                f"transports.nostr.key_file {path} is unreadable: {exc.strerror}"
            ) from exc
    elif options.key_env:
        name = options.key_env
        secret = os.environ.get(name, "").strip()
        if not secret:
            raise ConfigError(f"transports.nostr.key_env: environment variable {name} is empty")
    else:
        raise ConfigError("transports.nostr needs key_file or key_env (a secret key, nsec or hex)")
    return secret
