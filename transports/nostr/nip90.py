"""NIP-90 text generation (kind 5050 jobs -> 6050 results, 7000 status) on the D4 session model.

A job is a session like a D4 call (``d4_<job id>``), recorded the same way
(every event in and out as ``wire.message``). Inputs are the job's ``i``
tags of type ``text`` joined by newlines; ``param`` tags carry
``max_tokens``, ``temperature``, ``top_p``, ``top_k`` and ``seed``; ``bid``
(msat) caps the price exactly as D4's ``max_total_cost`` does. A job whose
bid cannot pay one token gets a ``payment-required`` status with the
amount; a job addressed (``p`` tag) to another provider is ignored.
"""

from __future__ import annotations

import contextlib
import json
from collections import Counter
from collections.abc import AsyncGenerator, Mapping, Sequence
from contextlib import AbstractAsyncContextManager
from typing import Any, Protocol, cast

from sessiontape.core.engine import SamplingParams
from sessiontape.core.errors import InvalidParameters, SessiontapeError
from sessiontape.core.events import Event
from sessiontape.core.runtime import Runtime
from sessiontape.engines.models.chat_template import prompt_text
from sessiontape.transports.nostr import d4
from sessiontape.transports.nostr.errors import to_err
from sessiontape.transports.nostr.settings import Settings

KIND_JOB = 5050
KIND_RESULT = 6050
KIND_FEEDBACK = 7000


class Host(Protocol):
    """What a job needs of the worker (:class:`sessiontape.transports.nostr.worker.D4Worker`'s public side)."""

    runtime: Runtime
    settings: Settings
    pubkey: str
    stats: Counter[str]

    def knows_answer(self, call_id: str) -> bool: ...

    def call_slot(self, sid: str) -> AbstractAsyncContextManager[None]: ...

    async def is_answered(self, call_id: str, session_id: str) -> bool: ...

    async def open_call_session(self, sid: str, meta: Mapping[str, Any]) -> None: ...

    async def record_incoming_call(self, sid: str, payload: Mapping[str, Any]) -> None: ...

    async def send(
        self,
        sid: str,
        content: str,
        tags: list[list[str]],
        *,
        kind: int = 1,
        call_id: str | None = None,
        final: bool = False,
        caller: str = "",
        more_results: bool = False,
        close: str | None = None,
    ) -> str: ...


def feedback_status(tags: Sequence[Sequence[str]]) -> str | None:
    for t in tags:
        if len(t) >= 2 and t[0] == "status":
            return str(t[1])
    return None


def parse_job(tags: Sequence[Sequence[str]]) -> tuple[str, dict[str, Any], int | None]:
    """(prompt, D4-style args, bid msat) from a job's tags; raises InvalidParameters."""
    texts = [
        str(t[1]) for t in tags if len(t) >= 2 and t[0] == "i" and (len(t) < 3 or t[2] == "text")
    ]
    if not texts:
        raise InvalidParameters("job has no text input (an 'i' tag of type text)")
    args: dict[str, Any] = {}
    for t in tags:
        if (
            len(t) >= 3
            and t[0] == "param"
            and t[1] in ("max_tokens", "temperature", "top_p", "top_k", "seed")
        ):
            try:
                args[t[1]] = json.loads(t[2])
            except ValueError as exc:
                raise InvalidParameters(f"param {t[1]} is not a number: {t[2]!r}") from exc
    bid: int | None = None
    for t in tags:
        if len(t) >= 2 and t[0] == "bid":
            if not t[1].isdigit() or int(t[1]) <= 0:
                raise InvalidParameters(f"bid must be a positive integer (msat), got {t[1]!r}")
            bid = int(t[1])
    return "\n".join(texts), args, bid


async def handle_job(worker: Host, payload: Mapping[str, Any]) -> None:
    tags = payload["tags"]
    targets = [t[1] for t in tags if len(t) >= 2 and t[0] == "p"]
    if targets and worker.pubkey not in targets:
        worker.stats["nip90_other_provider"] += 1
        return
    job_id = str(payload["id"])
    customer = str(payload["pubkey"])
    if worker.knows_answer(job_id):
        worker.stats["duplicate"] += 1
        return
    sid = "d4_" + job_id[:48]
    reply_tags = [["e", job_id], ["p", customer]]
    price = worker.settings.price_msat
    async with worker.call_slot(sid):
        if await worker.is_answered(job_id, sid):
            worker.stats["duplicate"] += 1
            return
        await worker.open_call_session(sid, {"call_id": job_id, "caller": customer, "nip90": True})
        await worker.record_incoming_call(sid, dict(payload))
        worker.stats["nip90_jobs"] += 1
        try:
            prompt, raw_args, bid = parse_job(tags)
            args = d4.parse_args({**raw_args, "prompt": prompt})
            wanted = args.max_tokens or worker.settings.default_max_tokens
            n, _ = d4.plan_tokens(price, bid if bid is not None else price * wanted, wanted)
            if n == 0:
                await worker.send(
                    sid,
                    "",
                    [
                        ["status", "payment-required", "bid below one token"],
                        *reply_tags,
                        ["amount", str(price * wanted)],
                    ],
                    kind=KIND_FEEDBACK,
                    close="negotiation",
                )
                return
            await worker.send(sid, "", [["status", "processing"], *reply_tags], kind=KIND_FEEDBACK)
            st = await worker.runtime.get(sid)
            chat = worker.runtime.engine.info.chat
            append = (
                worker.runtime.engine.tokenize(prompt_text(chat, prompt)) if st.length == 0 else []
            )
            start = st.length + len(append)
            params = SamplingParams(
                max_tokens=n,
                temperature=args.temperature,
                top_p=args.top_p,
                top_k=args.top_k,
                seed=args.seed,
            )
            gen = cast(
                AsyncGenerator[Event, None],
                worker.runtime.generate(sid, params, append=append, action_id=job_id),
            )
            async with contextlib.aclosing(gen):
                async for _ in gen:
                    pass
            text = worker.runtime.engine.detokenize(list(st.tokens[start:]))
            produced = st.length - start
            worker.stats["answered"] += 1
            await worker.send(
                sid,
                text,
                [
                    *reply_tags,
                    ["request", json.dumps(dict(payload))],
                    ["amount", str(produced * price)],
                ],
                kind=KIND_RESULT,
                call_id=job_id,
                final=True,
                caller=customer,
                close="complete",
            )
        except SessiontapeError as exc:
            if await worker.is_answered(job_id, sid):
                return  # the result is recorded: an error status now would contradict it
            err = to_err(exc)
            await worker.runtime.record_error(sid, err["code"], err["message"])
            await worker.send(
                sid,
                "",
                [["status", "error", f"{err['code']}: {err['message']}"], *reply_tags],
                kind=KIND_FEEDBACK,
                close="error",
            )
