"""``HttpTransport``: the Starlette app served by uvicorn inside ``sessiontape serve``.

Options: ``[transports.http]``, declared by :class:`~sessiontape.transports.http.server.settings.HttpSettings`.
Request limits and timeouts come from ``[limits]`` (docs/security.md).
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
from collections.abc import Iterator, Mapping
from typing import TYPE_CHECKING, Any

from sessiontape.core.config import parse_listen
from sessiontape.core.errors import ConfigError
from sessiontape.core.transport import Transport
from sessiontape.transports.http.server.settings import HttpSettings

if TYPE_CHECKING:
    import uvicorn

    from sessiontape.core.config import Config
    from sessiontape.core.runtime import Runtime
    from sessiontape.transports.http.server.drain import Inflight


def listening_socket(host: str, port: int) -> socket.socket:
    """A bound TCP socket for uvicorn whose connections send small writes at once.

    asyncio turns Nagle's algorithm off (``TCP_NODELAY``) only on sockets
    whose ``proto`` is ``IPPROTO_TCP``; a socket made as
    ``socket(AF_INET, SOCK_STREAM)`` has proto 0 and so keeps Nagle on. A
    streaming response then holds its first body chunk until the client
    acknowledges the headers, which a client on a kept-alive connection
    delays by 40 ms: every SSE stream (generate, watch, chat) after the first
    request of a connection would start 40 ms late. Accepted connections
    inherit the option from the listening socket on Linux; the explicit proto
    makes asyncio set it on every platform.
    """
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        sock.bind((host, port))
    except OSError:
        sock.close()
        raise
    return sock


def _quiet_server(uvicorn: Any) -> Any:
    """uvicorn.Server without its signal capture: ``sessiontape serve`` owns SIGINT/SIGTERM."""

    class Server(uvicorn.Server):  # type: ignore[misc]
        @contextlib.contextmanager
        def capture_signals(self) -> Iterator[None]:
            yield

    return Server


class HttpTransport(Transport):
    name = "http"
    options_class = HttpSettings
    settings: HttpSettings

    def __init__(
        self, runtime: Runtime, options: Mapping[str, Any] | HttpSettings, config: Config
    ) -> None:
        super().__init__(runtime, options, config)
        self.host, self.port = parse_listen(self.settings.listen)
        self._server: uvicorn.Server | None = None
        self._task: asyncio.Task[None] | None = None
        self._inflight: Inflight | None = None

    async def start(self) -> str:
        import uvicorn

        from sessiontape.transports.http.server.app import create_app
        from sessiontape.transports.http.server.inputs import Limits
        from sessiontape.transports.http.server.protocol import with_head_deadline

        limit = self.config.limits
        limits = Limits(
            max_body_bytes=limit.max_body_bytes,
            max_json_depth=limit.max_json_depth,
            max_meta_bytes=limit.max_meta_bytes,
            body_timeout_s=limit.body_timeout_s,
            max_requests_per_client=limit.max_requests_per_client,
            max_header_bytes=limit.max_header_bytes,
        )
        app = create_app(
            self.runtime,
            auth_token=self.config.auth_token,
            heartbeat_s=self.settings.heartbeat_s,
            ring=self.settings.ring,
            ring_bytes=self.settings.ring_bytes,
            linger_s=self.settings.linger_s,
            limits=limits,
        )
        # Bind here so a taken port is a ConfigError, not uvicorn's sys.exit inside a task.
        try:
            sock = listening_socket(self.host, self.port)
        except OSError as exc:
            raise ConfigError(
                f"HTTP transport cannot listen on {self.host}:{self.port}: {exc}"
            ) from exc
        sock.set_inheritable(True)
        self.port = sock.getsockname()[1]
        cfg = uvicorn.Config(
            app,
            log_level="warning",
            lifespan="on",
            access_log=False,
            timeout_graceful_shutdown=5,
            http=with_head_deadline(limit.header_timeout_s),
            h11_max_incomplete_event_size=limit.max_header_bytes,
            timeout_keep_alive=max(1, round(limit.keep_alive_s)),
            limit_concurrency=limit.max_connections,
        )
        server = _quiet_server(uvicorn)(cfg)
        self._server = server
        self._inflight = app.state.inflight
        self._task = asyncio.create_task(server.serve(sockets=[sock]), name="sessiontape-http")
        while not server.started:
            if self._task.done():
                err = self._task.exception()
                raise ConfigError(
                    f"HTTP transport could not start on {self.host}:{self.port}: {err}"
                )
            await asyncio.sleep(0.01)
        return f"HTTP on http://{self.host}:{self.port} (viewer at /, API at /v1, /metrics)"

    async def stop(self, grace: float = 5.0) -> None:
        """Watch streams end at once, other requests get ``grace`` seconds, then end too (transports/http/server/drain.py);
        uvicorn's own deadline comes later, so it never has to cancel (and log) a request itself."""
        if self._server is None or self._task is None:
            return
        self._server.config.timeout_graceful_shutdown = int(grace) + 3
        if self._inflight is not None:
            self._inflight.end(watchers_only=True)
        self._server.should_exit = True
        try:
            await asyncio.wait_for(asyncio.shield(self._task), grace)
        except TimeoutError:
            if self._inflight is not None:
                self._inflight.end()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(asyncio.shield(self._task), 2.0)
        if not self._task.done():
            self._server.force_exit = True
            with contextlib.suppress(TimeoutError, asyncio.CancelledError):
                await asyncio.wait_for(self._task, 1.0)
        self._server = None
        self._task = None
