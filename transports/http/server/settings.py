"""The HTTP transport's options (``[transports.http]``); request limits are ``[limits]``."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from sessiontape.core.config import host_port
from sessiontape.core.settings_framework import option
from sessiontape.core.transport import TransportSettings


@dataclass(frozen=True)
class HttpSettings(TransportSettings):
    """``[transports.http]``: the JSON API, SSE streams, the viewer and the OpenAI routes."""

    enabled: bool = option(True, "serve this transport")
    listen: str = option(
        "127.0.0.1:8080", "HOST:PORT to serve on (port 0: any free one)", check=host_port
    )
    heartbeat_s: float = option(15.0, "seconds between SSE comment lines on an idle stream", gt=0)
    ring: int = option(4096, "patches a live feed keeps for a fast resume", ge=1)
    ring_bytes: int = option(
        65536, "... and at most this many bytes of them (the newest patch always)", ge=1
    )
    linger_s: float = option(30.0, "seconds a live feed outlives its last watcher", ge=0)
    chat_template: str | dict[str, Any] | None = option(
        None,
        "the OpenAI routes' chat template: a table, or the path of a JSON file "
        "(docs/protocols/openai.md)",
        shown="the model's own, else `chat_template.json` in `model_dir`, else role markers",
    )
