"""Streaming a D4 call's answer: generate within the price caps, send partial results, then the final one.

Partial results (``partial: true``) go out every ``stream_every_tokens``
tokens or ``stream_every_ms``, each published while the generation goes on
(never two at once: a slow relay gets fewer, longer ones); the final result
follows the last of them and says ``more_results`` when
the answer stopped at its length budget and the model has room, so the
caller can continue it with a funded call.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections import Counter
from collections.abc import AsyncGenerator
from typing import Any, Protocol, cast

from sessiontape.core.bodies import GenerationFinished, generated_token
from sessiontape.core.bodies import body as typed_body
from sessiontape.core.document.text import TextStream
from sessiontape.core.engine import SamplingParams
from sessiontape.core.errors import InvalidParameters
from sessiontape.core.events import Event, T
from sessiontape.core.runtime import Runtime
from sessiontape.engines.models.chat_template import prompt_text
from sessiontape.transports.nostr import d4
from sessiontape.transports.nostr.settings import Settings


class Send(Protocol):
    """The worker's :meth:`~sessiontape.transports.nostr.worker.D4Worker.send`."""

    async def __call__(
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


async def stream_answer(
    runtime: Runtime,
    settings: Settings,
    send: Send,
    stats: Counter[str],
    sid: str,
    call_id: str,
    caller: str,
    call: d4.Call,
    tags: list[list[str]],
) -> None:
    """Answer ``call`` in session ``sid``: partial results while generating, then the final result."""
    rt = runtime
    price = settings.price_msat
    st = await rt.get(sid)
    append: list[int] = []
    if st.length == 0:
        if call.args.prompt is None:
            raise InvalidParameters("args.prompt is required")
        append = rt.engine.tokenize(prompt_text(rt.engine.info.chat, call.args.prompt))
    gens = list(st.generations.values())
    answer_start = gens[0].prompt_length if gens else st.length + len(append)
    # a call resumed after a restart has already charged for these
    charged = sum(len(g.tokens) for g in gens if g.action_id == call_id)
    wanted = (call.args.max_tokens or settings.default_max_tokens) - charged
    n, _budget_limited = d4.plan_tokens(
        price, call.max_total_cost - charged * price, max(0, wanted)
    )
    model = rt.engine.info.model_id
    created = int(time.time())
    answer = list(st.tokens[answer_start:])
    produced = charged
    # the answer's text, decoded as it grows and cut before a stop string (a pure function
    # of the tokens: a resumed call's text is the uninterrupted one's)
    text = TextStream(rt.engine.detokenize, call.args.stop)
    text.extend(answer)
    finish: str | None = "stop" if text.stopped else None

    def body(reason: str | None) -> dict[str, Any]:
        return d4.completion(
            completion_id="chatcmpl-" + call_id[:32],
            model=model,
            created=created,
            text=text.text,
            finish_reason=reason,
            prompt_tokens=answer_start,
            completion_tokens=len(answer),
        )

    # A partial result is signed, recorded and published by a task of its own, so the
    # generation never waits for a relay; the next one is due only once it is out (a
    # slow relay gets fewer, longer partial results), and the final result after it.
    partial: asyncio.Task[str] | None = None
    try:
        if n > 0 and finish is None:
            params = SamplingParams(
                max_tokens=n,
                temperature=call.args.temperature,
                top_p=call.args.top_p,
                top_k=call.args.top_k,
                seed=call.args.seed,
            )
            last_n, last_t = produced, time.monotonic()
            every_n, every_s = settings.stream_every_tokens, settings.stream_every_ms / 1000
            gen = cast(
                AsyncGenerator[Event, None],
                rt.generate(sid, params, append=append, action_id=call_id),
            )
            async with contextlib.aclosing(gen):
                async for e in gen:
                    if (tok := generated_token(e)) is not None:
                        produced += 1
                        answer.append(int(tok))
                        text.push(int(tok))
                        if text.stopped:
                            finish = "stop"
                            break
                        if (partial is None or partial.done()) and (
                            produced - last_n >= every_n or time.monotonic() - last_t >= every_s
                        ):
                            if partial is not None:
                                partial.result()  # a partial result that failed fails the answer
                            last_n, last_t = produced, time.monotonic()
                            content = d4.result_content(
                                result=body(None),
                                iteration_cost=price,
                                total_cost=produced * price,
                                more_results=True,
                                partial=True,
                            )
                            partial = asyncio.create_task(
                                send(sid, content, tags, call_id=call_id, caller=caller),
                                name=f"d4-partial-{call_id[:12]}",
                            )
                    elif e.type == T.GENERATION_FINISHED:
                        reason = typed_body(e, GenerationFinished)["finish_reason"]
                        finish = "stop" if reason in ("eos", "stop") else "length"
        if partial is not None:
            await partial
    finally:
        if partial is not None and not partial.done():  # the answer failed or was cancelled
            partial.cancel()
            with contextlib.suppress(BaseException):
                await partial
    if finish is None:
        finish = "length"
    text.finish()
    if finish == "stop" and n > 0:
        # The generation may have committed tokens past the stop string before this
        # loop read it (it runs ahead of its reader): the answer counts, and charges,
        # what the log holds, as a resumed call does; its text still ends at the stop.
        st = await rt.get(sid)
        answer = list(st.tokens[answer_start:])
        produced = sum(len(g.tokens) for g in st.generations.values() if g.action_id == call_id)
    room = st.length < rt.engine.info.max_length
    more = finish == "length" and room
    content = d4.result_content(
        result=body(finish),
        iteration_cost=price,
        total_cost=produced * price,
        more_results=more,
    )
    stats["answered"] += 1
    await send(
        sid,
        content,
        tags,
        call_id=call_id,
        final=True,
        caller=caller,
        more_results=more,
        close=None if more else "complete",
    )
