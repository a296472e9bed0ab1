"""``HttpTransport``: the Starlette app served by uvicorn inside ``sessiontape serve``.

Options (``[transports.http]``): ``listen`` (HOST:PORT, default
127.0.0.1:8080), ``heartbeat_s`` (SSE comment interval, default 15),
``ring`` (patches a live feed keeps for fast resume, default 4096),
``linger_s`` (how long a feed outlives its last watcher, default 30).
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
from collections.abc import Iterator, Mapping
from typing import TYPE_CHECKING, Any

from core.config import parse_listen
from core.errors import ConfigError
from core.transport import Transport

if TYPE_CHECKING:
    import uvicorn

    from core.config import Config
    from core.runtime import Runtime


def _quiet_server(uvicorn: Any) -> Any:
    """uvicorn.Server without its signal capture: ``sessiontape serve`` owns SIGINT/SIGTERM."""

    class Server(uvicorn.Server):  # type: ignore[misc]
        @contextlib.contextmanager
        def capture_signals(self) -> Iterator[None]:
            yield

    return Server


class HttpTransport(Transport):
    name = "http"

    def __init__(self, runtime: Runtime, options: Mapping[str, Any], config: Config) -> None:
        super().__init__(runtime, options, config)
        self.host, self.port = parse_listen(str(self.options.get("listen", "127.0.0.1:8080")))
        try:
            self.heartbeat_s = float(self.options.get("heartbeat_s", 15.0))
            self.ring = int(self.options.get("ring", 4096))
            self.linger_s = float(self.options.get("linger_s", 30.0))
        except (TypeError, ValueError) as exc:
            raise ConfigError(f"transports.http: {exc}") from exc
        if self.heartbeat_s <= 0 or self.ring < 1:
            raise ConfigError("transports.http: heartbeat_s must be > 0 and ring >= 1")
        self._server: uvicorn.Server | None = None
        self._task: asyncio.Task[None] | None = None

    async def start(self) -> str:
        import uvicorn

        from transports.sse.app import create_app

        app = create_app(self.runtime, auth_token=self.config.auth_token, heartbeat_s=self.heartbeat_s,
                         ring=self.ring, linger_s=self.linger_s)
        # Bind here so a taken port is a ConfigError, not uvicorn's sys.exit inside a task.
        family = socket.AF_INET6 if ":" in self.host else socket.AF_INET
        sock = socket.socket(family, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((self.host, self.port))
        except OSError as exc:
            sock.close()
            raise ConfigError(f"HTTP transport cannot listen on {self.host}:{self.port}: {exc}") from exc
        sock.set_inheritable(True)
        self.port = sock.getsockname()[1]
        cfg = uvicorn.Config(app, log_level="warning", lifespan="on", access_log=False,
                             timeout_graceful_shutdown=5)
        server = _quiet_server(uvicorn)(cfg)
        self._server = server
        self._task = asyncio.create_task(server.serve(sockets=[sock]), name="sessiontape-http")
        while not server.started:
            if self._task.done():
                err = self._task.exception()
                raise ConfigError(f"HTTP transport could not start on {self.host}:{self.port}: {err}")
            await asyncio.sleep(0.01)
        return f"HTTP on http://{self.host}:{self.port} (viewer at /, API at /v1, /metrics)"

    async def stop(self, grace: float = 5.0) -> None:
        if self._server is None or self._task is None:
            return
        self._server.should_exit = True
        try:
            await asyncio.wait_for(asyncio.shield(self._task), grace)
        except TimeoutError:
            self._server.force_exit = True
            with contextlib.suppress(TimeoutError, asyncio.CancelledError):
                await asyncio.wait_for(self._task, 1.0)
        self._server = None
        self._task = None
