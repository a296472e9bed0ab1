"""The HTTP server's sockets send small writes at once (no Nagle delay).

Without TCP_NODELAY a streaming response's first chunk waited for the client
to acknowledge the headers, which a client on a kept-alive connection delays
by 40 ms: every stream after a connection's first request started late.
"""

from __future__ import annotations

import socket

import httpx

from sessiontape.transports.http.plugin import listening_socket
from tests.helpers.http import Served


def test_the_listening_socket_and_what_it_accepts_have_nagle_off() -> None:
    sock = listening_socket("127.0.0.1", 0)
    try:
        assert sock.proto == socket.IPPROTO_TCP
        assert sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY) == 1
        sock.listen(1)
        with socket.create_connection(sock.getsockname()[:2], timeout=5):
            conn, _ = sock.accept()
            with conn:
                assert conn.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY) == 1
    finally:
        sock.close()


async def test_every_connection_of_the_running_server_has_nagle_off(server: Served) -> None:
    async with httpx.AsyncClient(base_url=server.url, timeout=10) as c:
        sid = (await c.post("/v1/sessions", json={})).json()["id"]
        # a second request on the kept-alive connection, streamed
        async with c.stream("GET", f"/v1/sessions/{sid}/events") as r:
            assert r.status_code == 200
            uv = server.transport._server
            assert uv is not None
            conns = list(uv.server_state.connections)
            assert conns
            for proto in conns:
                sk = proto.transport.get_extra_info("socket")
                assert sk.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY) == 1
