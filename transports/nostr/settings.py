"""The worker's options (``[transports.nostr]``) and its secret key.

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
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from sessiontape.core.errors import ConfigError
from sessiontape.transports.nostr.d4 import SAMPLE_NEGOTIATE_FUNCTION_ID

_HEX64 = re.compile(r"^[0-9a-f]{64}$")


@dataclass(frozen=True)
class FunctionSpec:
    name: str
    description: str
    #: an already-published function event; None: publish one (or reuse the log's)
    id: str | None = None


@dataclass(frozen=True)
class Settings:
    relays: tuple[str, ...]
    #: the secret key (nsec or hex); kept out of repr so it is never logged
    secret: str = field(repr=False)
    price_msat: int = 1000
    functions: tuple[FunctionSpec, ...] = ()
    stream_every_tokens: int = 16
    stream_every_ms: int = 500
    negotiate_function_id: str = SAMPLE_NEGOTIATE_FUNCTION_ID
    default_max_tokens: int = 256
    #: re-subscribe this many seconds before the last call seen (client clocks drift)
    since_slack_s: int = 300
    max_concurrent_calls: int = 8
    publish_retries: int = 5
    retry_base_s: float = 0.2
    reconnect_min_s: float = 1.0
    connect_timeout_s: float = 5.0
    nip90: bool = True
    #: calls, results and event ids the worker keeps in memory (each); older ones are asked of the log
    index_size: int = 10_000
    #: how often answers no relay took are published again (also on every relay reconnect)
    republish_every_s: float = 30.0

    @classmethod
    def from_options(cls, options: Mapping[str, Any]) -> Settings:
        relays = options.get("relays") or []
        if isinstance(relays, str):
            relays = [relays]
        if (
            not isinstance(relays, list)
            or not relays
            or not all(isinstance(r, str) for r in relays)
        ):
            raise ConfigError("transports.nostr.relays must be a non-empty list of relay URLs")
        secret = _read_secret(options)
        functions = [_function(f) for f in options.get("functions") or []]
        for fid in options.get("function_ids") or []:
            functions.append(
                FunctionSpec(name=f"function-{str(fid)[:8]}", description="", id=_hex_id(fid))
            )
        if not functions:
            functions = [
                FunctionSpec("text-generation", "Text generation on the configured engine")
            ]
        try:
            s = cls(
                relays=tuple(relays),
                secret=secret,
                price_msat=int(options.get("price_msat", 1000)),
                functions=tuple(functions),
                stream_every_tokens=int(options.get("stream_every_tokens", 16)),
                stream_every_ms=int(options.get("stream_every_ms", 500)),
                negotiate_function_id=_hex_id(
                    options.get("negotiate_function_id", SAMPLE_NEGOTIATE_FUNCTION_ID)
                ),
                default_max_tokens=int(options.get("default_max_tokens", 256)),
                since_slack_s=int(options.get("since_slack_s", 300)),
                max_concurrent_calls=int(options.get("max_concurrent_calls", 8)),
                publish_retries=int(options.get("publish_retries", 5)),
                retry_base_s=float(options.get("retry_base_s", 0.2)),
                reconnect_min_s=float(options.get("reconnect_min_s", 1.0)),
                connect_timeout_s=float(options.get("connect_timeout_s", 5.0)),
                nip90=bool(options.get("nip90", True)),
                index_size=int(options.get("index_size", 10_000)),
                republish_every_s=float(options.get("republish_every_s", 30.0)),
            )
        except (TypeError, ValueError) as exc:
            raise ConfigError(f"transports.nostr: {exc}") from exc
        if (
            s.price_msat < 0
            or s.stream_every_tokens < 1
            or s.stream_every_ms < 1
            or s.default_max_tokens < 1
        ):
            raise ConfigError(
                "transports.nostr: price_msat >= 0, stream_every_* >= 1, default_max_tokens >= 1"
            )
        if s.index_size < 1 or not s.republish_every_s > 0:
            raise ConfigError("transports.nostr: index_size >= 1, republish_every_s > 0")
        return s


def _function(raw: Any) -> FunctionSpec:
    if not isinstance(raw, Mapping) or not isinstance(raw.get("name"), str) or not raw["name"]:
        raise ConfigError("transports.nostr.functions entries need a name")
    fid = raw.get("id")
    return FunctionSpec(
        str(raw["name"]), str(raw.get("description", "")), None if fid is None else _hex_id(fid)
    )


def _hex_id(value: Any) -> str:
    text = str(value).lower()
    if not _HEX64.match(text):
        raise ConfigError(f"expected a 64-hex-digit event id, got {value!r}")
    return text


def _read_secret(options: Mapping[str, Any]) -> str:
    if options.get("key_file"):
        path = Path(str(options["key_file"]))
        try:
            secret = path.read_text().strip()
        except OSError as exc:
            raise ConfigError(
                f"transports.nostr.key_file {path} is unreadable: {exc.strerror}"
            ) from exc
    elif options.get("key_env"):
        name = str(options["key_env"])
        secret = os.environ.get(name, "").strip()
        if not secret:
            raise ConfigError(f"transports.nostr.key_env: environment variable {name} is empty")
    else:
        raise ConfigError("transports.nostr needs key_file or key_env (a secret key, nsec or hex)")
    return secret
