"""A small Evergreen client over grpc.aio, for tests, scripts and as an example.

Usage::

    async with EvergreenClient("127.0.0.1:50051", token="secret") as client:
        async with client.session() as s:
            await s.send(actions=[action("GENERATE", inputs={"prompt": "p1"},
                                         outputs={"text": "r1"},
                                         configs=[sampling_config(max_tokens=8, seed=1)])],
                         fragments=text_fragments("p1", "Hello"))
            await s.done_writing()
            nodes = await s.collect()          # {"r1": b"..."} once the stream ends
            print(await s.session_id(), nodes["r1"].decode())

``session()`` opens one StartSession stream (one server session). Replies
are :class:`SessionMessage` objects; ``collect`` assembles leaf payloads by
node id and seq. A stream the server aborts raises ``grpc.aio.AioRpcError``
with the mapped status code.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterable, Mapping, Sequence
from types import TracebackType
from typing import Any

import grpc
from google.protobuf import any_pb2, json_format, struct_pb2

from sessiontape.transports.grpc.gen.evergreen.v2 import evergreen_pb2, evergreen_pb2_grpc

SessionMessage = evergreen_pb2.SessionMessage
NodeFragment = evergreen_pb2.NodeFragment
Action = evergreen_pb2.Action


def fragment(
    node_id: str,
    *,
    seq: int = 0,
    continued: bool = False,
    child_ids: Sequence[str] = (),
    data: bytes | None = None,
    ref: str | None = None,
    mimetype: str | None = None,
    leaf: bool | None = None,
) -> evergreen_pb2.NodeFragment:
    """One NodeFragment. A leaf when it has data, a ref or a mimetype (or ``leaf=True``)."""
    f = evergreen_pb2.NodeFragment(
        id=node_id, seq=seq, continued=continued, child_ids=list(child_ids)
    )
    if leaf or (leaf is None and (data is not None or ref is not None or mimetype is not None)):
        f.chunk_fragment.SetInParent()
        if mimetype is not None:
            f.chunk_fragment.metadata.mimetype = mimetype
        if ref is not None:
            f.chunk_fragment.ref = ref
        elif data is not None:
            f.chunk_fragment.data = data
    return f


def text_fragments(
    node_id: str, text: str, *, parts: int = 1, mimetype: str = "text/plain"
) -> list[evergreen_pb2.NodeFragment]:
    """A text leaf split into ``parts`` fragments (metadata on seq 0 only)."""
    raw = text.encode()
    step = max(1, -(-len(raw) // max(1, parts)))
    pieces = [raw[i : i + step] for i in range(0, len(raw), step)] or [b""]
    return [
        fragment(
            node_id,
            seq=i,
            continued=i < len(pieces) - 1,
            data=p,
            mimetype=mimetype if i == 0 else None,
            leaf=True,
        )
        for i, p in enumerate(pieces)
    ]


def sampling_config(**params: Any) -> any_pb2.Any:
    """GENERATE's config: the sampling parameters as a Struct packed in Any."""
    s = struct_pb2.Struct()
    json_format.ParseDict(params, s)
    packed = any_pb2.Any()
    packed.Pack(s)
    return packed


def action(
    name: str,
    *,
    inputs: Mapping[str, str] | Iterable[tuple[str, str]] = (),
    outputs: Mapping[str, str] | Iterable[tuple[str, str]] = (),
    configs: Sequence[any_pb2.Any] = (),
    target: str = "",
) -> evergreen_pb2.Action:
    """An Action; inputs/outputs map parameter names to node ids."""
    ins = inputs.items() if isinstance(inputs, Mapping) else inputs
    outs = outputs.items() if isinstance(outputs, Mapping) else outputs
    return evergreen_pb2.Action(
        name=name,
        inputs=[evergreen_pb2.NamedParameter(name=n, id=i) for n, i in ins],
        outputs=[evergreen_pb2.NamedParameter(name=n, id=i) for n, i in outs],
        configs=list(configs),
        target_spec=evergreen_pb2.TargetSpec(id=target),
    )


class EvergreenSession:
    """One StartSession stream."""

    def __init__(self, call: Any) -> None:
        self.call = call
        self.received: list[evergreen_pb2.SessionMessage] = []
        self._session_id: str | None = None

    async def send(
        self,
        *,
        fragments: Sequence[evergreen_pb2.NodeFragment] = (),
        actions: Sequence[evergreen_pb2.Action] = (),
    ) -> None:
        await self.call.write(
            evergreen_pb2.SessionMessage(node_fragments=list(fragments), actions=list(actions))
        )

    async def done_writing(self) -> None:
        """Half-close: the server finishes pending actions, then ends the stream."""
        await self.call.done_writing()

    async def session_id(self) -> str:
        """The server's session id (initial metadata ``x-session-id``)."""
        if self._session_id is None:
            md = await self.call.initial_metadata()
            self._session_id = str(dict(md or ()).get("x-session-id", ""))
        return self._session_id

    async def __aiter__(self) -> AsyncIterator[evergreen_pb2.SessionMessage]:
        while True:
            msg = await self.call.read()
            if msg is grpc.aio.EOF:
                return
            self.received.append(msg)
            yield msg

    async def collect(self) -> dict[str, bytes]:
        """Read to the end; return each received leaf's bytes (seq order)."""
        async for _ in self:
            pass
        return assemble(self.received)

    def cancel(self) -> None:
        self.call.cancel()

    async def __aenter__(self) -> EvergreenSession:
        return self

    async def __aexit__(
        self, et: type[BaseException] | None, e: BaseException | None, tb: TracebackType | None
    ) -> None:
        if not self.call.done():
            self.call.cancel()


def assemble(messages: Iterable[evergreen_pb2.SessionMessage]) -> dict[str, bytes]:
    """Leaf payloads by node id, fragments joined in seq order (first of a seq wins)."""
    parts: dict[str, dict[int, bytes]] = {}
    for m in messages:
        for f in m.node_fragments:
            if f.HasField("chunk_fragment"):
                parts.setdefault(f.id, {}).setdefault(f.seq, f.chunk_fragment.data)
    return {nid: b"".join(p[s] for s in sorted(p)) for nid, p in parts.items()}


class EvergreenClient:
    """A channel to a sessiontape gRPC server, with the bearer token attached."""

    def __init__(
        self,
        target: str,
        *,
        token: str | None = None,
        credentials: Any = None,
        options: Sequence[tuple[str, Any]] = (),
    ) -> None:
        self.channel = (
            grpc.aio.secure_channel(target, credentials, options=list(options))
            if credentials is not None
            else grpc.aio.insecure_channel(target, options=list(options))
        )
        self.metadata = (("authorization", f"Bearer {token}"),) if token else ()
        self.stub = evergreen_pb2_grpc.EvergreenServiceStub(self.channel)

    def session(self, *, metadata: Sequence[tuple[str, str]] | None = None) -> EvergreenSession:
        md = self.metadata if metadata is None else tuple(metadata)
        return EvergreenSession(self.stub.StartSession(metadata=md))

    async def close(self) -> None:
        await self.channel.close()

    async def __aenter__(self) -> EvergreenClient:
        return self

    async def __aexit__(
        self, et: type[BaseException] | None, e: BaseException | None, tb: TracebackType | None
    ) -> None:
        await self.close()
