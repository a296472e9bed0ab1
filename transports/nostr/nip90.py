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
from collections.abc import AsyncGenerator, Mapping, Sequence
from contextlib import AbstractAsyncContextManager
from dataclasses import dataclass
from typing import Any, Protocol, cast

from sessiontape.core.errors import InvalidParameters, SessiontapeError
from sessiontape.core.events import Event
from sessiontape.core.generation.request import GenerateRequest
from sessiontape.engines.models.jinja_template import prompt_text
from sessiontape.transports.nostr import d4
from sessiontape.transports.nostr.errors import to_err
from sessiontape.transports.nostr.streaming import Answerer

KIND_JOB = 5050
KIND_RESULT = 6050
KIND_FEEDBACK = 7000


class Host(Answerer, Protocol):
    """What a job needs of the worker (:class:`sessiontape.transports.nostr.worker.D4Worker`'s public side)."""

    pubkey: str

    def knows_answer(self, call_id: str) -> bool: ...

    def call_slot(self, sid: str) -> AbstractAsyncContextManager[None]: ...

    async def is_answered(self, call_id: str, session_id: str) -> bool: ...

    async def claim_call(
        self, call_id: str, sid: str, meta: Mapping[str, Any] | None = None
    ) -> bool: ...

    async def record_incoming_call(self, sid: str, payload: Mapping[str, Any]) -> None: ...


@dataclass(frozen=True)
class Job:
    """A job as the worker answers it: its event, the session it runs in and the tags every reply carries."""

    payload: Mapping[str, Any]
    id: str
    customer: str
    sid: str
    reply_tags: list[list[str]]

    @classmethod
    def of(cls, payload: Mapping[str, Any]) -> Job:
        """The job that ``payload`` (a kind-5050 event) asks for."""
        job_id, customer = str(payload["id"]), str(payload["pubkey"])
        return cls(
            payload=payload,
            id=job_id,
            customer=customer,
            sid="d4_" + job_id[:48],
            reply_tags=[["e", job_id], ["p", customer]],
        )


def feedback_status(tags: Sequence[Sequence[str]]) -> str | None:
    """The status a kind-7000 event's tags carry (None: it has no ``status`` tag)."""
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


def addressed_elsewhere(worker: Host, tags: Sequence[Sequence[str]]) -> bool:
    """Whether the job names providers (``p`` tags) and this worker is not among them."""
    targets = [t[1] for t in tags if len(t) >= 2 and t[0] == "p"]
    return bool(targets) and worker.pubkey not in targets


async def handle_job(worker: Host, payload: Mapping[str, Any]) -> None:
    """Answer a kind-5050 job once: record it in its session, then run it or send its error status."""
    if addressed_elsewhere(worker, payload["tags"]):
        worker.stats["nip90_other_provider"] += 1
        return
    job = Job.of(payload)
    if worker.knows_answer(job.id):
        worker.stats["duplicate"] += 1
        return
    async with worker.call_slot(job.sid):
        meta = {"call_id": job.id, "caller": job.customer, "nip90": True}
        if not await worker.claim_call(job.id, job.sid, meta):
            worker.stats["duplicate"] += 1
            return
        await worker.record_incoming_call(job.sid, dict(payload))
        worker.stats["nip90_jobs"] += 1
        try:
            await run_job(worker, job)
        except SessiontapeError as exc:
            await fail_job(worker, job, exc)


async def run_job(worker: Host, job: Job) -> None:
    """Price the job within its bid, then generate its answer and send the result (or ask for payment)."""
    price = worker.settings.price_msat
    prompt, raw_args, bid = parse_job(job.payload["tags"])
    args = d4.parse_args({**raw_args, "prompt": prompt})
    wanted = args.max_tokens or worker.settings.default_max_tokens
    n, _ = d4.plan_tokens(price, bid if bid is not None else price * wanted, wanted)
    if n == 0:
        await worker.send(
            job.sid,
            "",
            [
                ["status", "payment-required", "bid below one token"],
                *job.reply_tags,
                ["amount", str(price * wanted)],
            ],
            kind=KIND_FEEDBACK,
            close="negotiation",
        )
        return
    await worker.send(job.sid, "", [["status", "processing"], *job.reply_tags], kind=KIND_FEEDBACK)
    text, produced = await generate_text(worker, job, prompt, args, n)
    worker.stats["answered"] += 1
    await worker.send(
        job.sid,
        text,
        [
            *job.reply_tags,
            ["request", json.dumps(dict(job.payload))],
            ["amount", str(produced * price)],
        ],
        kind=KIND_RESULT,
        call_id=job.id,
        final=True,
        caller=job.customer,
        close="complete",
    )


async def generate_text(
    worker: Host, job: Job, prompt: str, args: d4.GenArgs, n: int
) -> tuple[str, int]:
    """Generate up to ``n`` tokens of the answer (after the prompt, when the job opens its session): (text, tokens)."""
    st = await worker.runtime.get(job.sid)
    engine = worker.runtime.engine
    append = engine.tokenize(prompt_text(engine.info.chat, prompt)) if st.length == 0 else []
    start = st.length + len(append)
    params = args.sampling(n)
    gen = cast(
        AsyncGenerator[Event, None],
        worker.runtime.generate(job.sid, GenerateRequest(params, append=append, action_id=job.id)),
    )
    async with contextlib.aclosing(gen):
        async for _ in gen:
            pass
    return engine.detokenize(list(st.tokens[start:])), st.length - start


async def fail_job(worker: Host, job: Job, exc: SessiontapeError) -> None:
    """Record the job's error and send it as an ``error`` status, unless its result is recorded already."""
    if await worker.is_answered(job.id, job.sid):
        return  # the result is recorded: an error status now would contradict it
    err = to_err(exc)
    await worker.runtime.record_error(job.sid, err["code"], err["message"])
    await worker.send(
        job.sid,
        "",
        [["status", "error", f"{err['code']}: {err['message']}"], *job.reply_tags],
        kind=KIND_FEEDBACK,
        close="error",
    )
