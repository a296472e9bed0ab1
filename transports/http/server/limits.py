"""Bounds the HTTP server's protocol leaves to the application.

:class:`PerClientLimit`: what one client holds open at once, concurrent requests (SSE
streams included) per address.

Beyond ``limits.max_requests_per_client`` the next request is answered 429
``too_many_requests`` at once, before its body is read; the others go on.
``/healthz`` is exempt.
Behind a proxy every client has the proxy's address, so the bound is then
per proxy (set it accordingly, or enforce per-user limits in the proxy).

:class:`HeadLimit`: a request line and headers past ``[limits] max_header_bytes`` are
answered 431 and the connection closed. h11 bounds only a head still arriving
(``h11_max_incomplete_event_size``, the same limit); one that arrives whole in a single
read is measured here, from the ASGI scope, before any route runs.
"""

from __future__ import annotations

from collections import Counter

from starlette.types import ASGIApp, Receive, Scope, Send

from sessiontape.transports.http.server import errors


class HeadLimit:
    def __init__(self, app: ASGIApp, max_header_bytes: int) -> None:
        self.app = app
        self.max_header_bytes = max_header_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http":
            size = (
                len(scope["method"])
                + len(scope.get("raw_path") or b"")
                + len(scope.get("query_string") or b"")
            )
            size += sum(len(name) + len(value) + 4 for name, value in scope["headers"])
            if size > self.max_header_bytes:
                await errors.error_response(
                    "header_too_large",
                    f"request head of {size:,} bytes (at most {self.max_header_bytes:,})",
                    431,
                    {"Connection": "close"},
                )(scope, receive, send)
                return
        await self.app(scope, receive, send)


class PerClientLimit:
    def __init__(self, app: ASGIApp, max_requests: int) -> None:
        self.app = app
        self.max_requests = max_requests
        self.active: Counter[str] = Counter()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["path"] == "/healthz":  # probes are never turned away
            await self.app(scope, receive, send)
            return
        client = scope.get("client")
        key = str(client[0]) if client else "?"
        if self.active[key] >= self.max_requests:
            await errors.error_response(
                "too_many_requests",
                f"at most {self.max_requests} concurrent requests per client",
                429,
                {"Retry-After": "1"},
            )(scope, receive, send)
            return
        self.active[key] += 1
        try:
            await self.app(scope, receive, send)
        finally:
            self.active[key] -= 1
            if self.active[key] <= 0:
                del self.active[key]
