"""HTTP/2, the server side of a connection, as the gRPC endpoint needs it (RFC 9113).

What it does: the client's preface and settings, HEADERS and CONTINUATION (HPACK
through the ``hpack`` package), DATA with both flow-control windows each way, PING,
RST_STREAM, WINDOW_UPDATE, GOAWAY; a stream per request, handed to a :class:`Handler`
that starts a call on it; a keepalive PING after two hours of silence (gRPC's
server default), the connection closed if it goes unanswered. What it leaves out, as
a gRPC server may: server push, priorities (read and ignored), and the optional
RST_STREAM (NO_ERROR) after a complete answer to a client still sending (its bytes
are taken and dropped).

Flow control: the connection's window takes bytes back as they arrive, a stream's
(1 MiB) as its call reads them, so what a connection holds unread is bounded by its
streams' windows and no stream holds up another (architecture.md, "The gRPC server").

Why not h2 and grpclib's protocol layer, which it replaces: a served Kakeya turn (two
unary-request calls) spent about a quarter of the event loop's time in them
(``H2Connection.receive_data`` alone 21% of the loop's samples, 2.6 points of it
formatting each received frame for a trace log nobody reads), and grpclib made three
``asyncio.Event`` objects and a queue for every stream.

Errors: a connection error (RFC 9113 section 5.4.1) sends GOAWAY with its code and closes
the connection, cancelling its calls; a stream error sends RST_STREAM and cancels that
stream's call. A call's stream raises :class:`StreamGone` once it cannot go on.
"""

from sessiontape.transports.grpc.http2.connection import Connection, Handler
from sessiontape.transports.grpc.http2.frames import StreamEndedShort, StreamGone
from sessiontape.transports.grpc.http2.stream import Stream

__all__ = ["Connection", "Handler", "Stream", "StreamEndedShort", "StreamGone"]
