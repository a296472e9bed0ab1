"""Audit: verify a session's hash chain and invariants, and optionally
re-execute every recorded generation on an engine and diff the tokens.

The invariants are the fold's own checks: every event must apply to the
state before it (versions contiguous, appends at the end, tokens inside the
vocabulary, generated tokens at the next position, no event after close).
Re-execution rebuilds the exact history each generation saw, runs the
engine with the recorded parameters, and reports the first diverging token
(id or log-probability, bitwise) per generation.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from sessiontape.core.bodies import (
    GenerationFinished,
    GenerationStarted,
    GenerationToken,
    body,
    generation_id_of,
)
from sessiontape.core.engine.interface import Engine, OutputOptions, SamplingParams
from sessiontape.core.errors import ChainBroken, SessiontapeError
from sessiontape.core.events import T
from sessiontape.core.handback import handing_back
from sessiontape.core.log.store import ChainCheck, EventLog
from sessiontape.core.runtime import Runtime
from sessiontape.core.session.loader import base_state
from sessiontape.core.session.state import apply


@dataclass
class RecordedGeneration:
    generation_id: str
    history: list[int]
    params: SamplingParams
    options: OutputOptions
    eos: tuple[int, ...]
    steps: list[GenerationToken] = field(default_factory=list)
    finish_reason: str | None = None


@dataclass
class AuditReport:
    session_id: str
    chain_ok: bool = True
    invariants_ok: bool = True
    problems: list[str] = field(default_factory=list)
    generations: int = 0
    divergences: list[dict[str, Any]] = field(default_factory=list)
    reexecuted: bool = False
    #: False when a generation could not be re-run at all (its problem says why)
    reexecution_ok: bool = True

    @property
    def ok(self) -> bool:
        return self.chain_ok and self.invariants_ok and self.reexecution_ok and not self.divergences

    @classmethod
    def failed(cls, session_id: str, reason: str) -> AuditReport:
        """A session the audit could not even read: reported failing, with the reason."""
        return cls(session_id, invariants_ok=False, problems=[reason])

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            "session_id": self.session_id,
            "chain_ok": self.chain_ok,
            "invariants_ok": self.invariants_ok,
            "problems": self.problems,
            "ok": self.ok,
        }
        if self.reexecuted:
            out["generations"] = self.generations
            out["divergences"] = self.divergences
            out["reexecution_ok"] = self.reexecution_ok
        return out


EngineFor = Callable[[Mapping[str, Any]], Engine]


async def audit_session(
    source: Runtime | EventLog,
    session_id: str,
    *,
    reexecute: bool = False,
    engine: Engine | None = None,
    engine_for: EngineFor | None = None,
) -> AuditReport:
    """Audit one session from the log.

    Re-execution runs on ``engine`` when given, else on ``engine_for(provenance)``
    (the engine the session recorded), else on the runtime's engine.
    """
    report = AuditReport(session_id)
    log = source.log if isinstance(source, Runtime) else source
    evs = await log.read(session_id)
    if not evs:
        from sessiontape.core.errors import SessionNotFound

        raise SessionNotFound(session_id)
    try:
        check = ChainCheck()
        async for e in handing_back(evs):
            check(e)
    except ChainBroken as exc:
        report.chain_ok = False
        report.problems.append(str(exc))
    try:
        st = await base_state(log, evs[0])
    except (SessiontapeError, TypeError, ValueError, KeyError) as exc:
        report.invariants_ok = False
        report.problems.append(f"v1 {evs[0].type}: fork base cannot be rebuilt: {_reason(exc)}")
        return report
    gens: dict[str, RecordedGeneration] = {}
    async for e in handing_back(evs):
        try:
            if e.type == T.GENERATION_STARTED:
                g = _recorded(body(e, GenerationStarted), st.tokens, st.eos_token_ids)
                gens[g.generation_id] = g
            elif (rec := gens.get(str(generation_id_of(e)))) is not None:
                if e.type == T.GENERATION_TOKEN:
                    rec.steps.append(body(e, GenerationToken))
                elif e.type == T.GENERATION_FINISHED:
                    rec.finish_reason = str(body(e, GenerationFinished).get("finish_reason"))
            apply(st, e)
        except (SessiontapeError, TypeError, ValueError, KeyError, AttributeError) as exc:
            # A body the fold or the parameter check cannot take is the session failing a check,
            # never the audit crashing (one bad session must not stop a multi-session audit).
            report.invariants_ok = False
            report.problems.append(f"v{e.version} {e.type}: {_reason(exc)}")
            break
    if reexecute:
        report.reexecuted = True
        if engine is not None:
            eng = engine
        elif engine_for is not None:
            eng = engine_for(st.engine)
        elif isinstance(source, Runtime):
            eng = source.engine
        else:
            raise ValueError("re-execution needs an engine")
        for g in gens.values():
            report.generations += 1
            try:
                div = await reexecute_generation(eng, session_id, g)
            except (SessiontapeError, TypeError, ValueError, KeyError) as exc:
                report.reexecution_ok = False
                report.problems.append(
                    f"generation {g.generation_id}: cannot be re-executed: {_reason(exc)}"
                )
                continue
            if div is not None:
                report.divergences.append(div)
    return report


def _reason(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {exc}" if not isinstance(exc, SessiontapeError) else str(exc)


def _recorded(
    started: GenerationStarted, tokens: Sequence[int], eos: Sequence[int]
) -> RecordedGeneration:
    """A ``generation.started`` body as a re-executable generation; raises when its parameters are unusable."""
    opts: Mapping[str, Any] = started.get("options") or {}
    params = SamplingParams.from_json(started.get("params") or {})
    params.check()
    return RecordedGeneration(
        generation_id=str(started["generation_id"]),
        history=list(tokens),
        params=params,
        options=OutputOptions(
            logprob_top_k=int(opts.get("logprob_top_k", 0)),
            logprob_ranges=tuple((int(a), int(b)) for a, b in opts.get("logprob_ranges", ())),
            readout_ranges=tuple((int(a), int(b)) for a, b in opts.get("readout_ranges", ())),
            generated_logprobs=bool(opts.get("generated_logprobs", True)),
        ),
        eos=tuple(eos),
    )


async def reexecute_generation(
    engine: Engine, session_id: str, g: RecordedGeneration
) -> dict[str, Any] | None:
    """Run ``g`` again; None when every recorded step matches bitwise."""
    eos = set(g.eos)
    recorded_decode = [s for s in g.steps if not s.get("is_prefill")]
    max_tokens = g.params.max_tokens
    if g.finish_reason == "cancelled":
        max_tokens = len(recorded_decode)
    params = dataclasses.replace(
        g.params,
        max_tokens=min(max_tokens, engine.info.max_length - len(g.history)),
        stop_token_ids=tuple(sorted(eos | set(g.params.stop_token_ids))),
    )
    key = f"audit:{session_id}:{g.generation_id}"
    got: list[dict[str, Any]] = []
    try:
        async for step in engine.generate(key, g.history, params, g.options):
            got.append(
                {
                    "token": step.token_id,
                    "position": step.position,
                    "is_prefill": step.is_prefill,
                    "logprob": step.logprob,
                }
            )
            if len(got) >= len(g.steps) and g.finish_reason == "cancelled":
                break
    finally:
        engine.forget(key)
    return first_divergence(g.generation_id, g.steps, got, complete=g.finish_reason != "cancelled")


def first_divergence(
    gid: str, recorded: Sequence[GenerationToken], got: Sequence[dict[str, Any]], complete: bool
) -> dict[str, Any] | None:
    for i, (r, x) in enumerate(zip(recorded, got, strict=False)):
        logprob = r.get("logprob")
        same = (
            int(r["token"]) == x["token"]
            and int(r["position"]) == x["position"]
            and bool(r.get("is_prefill")) == x["is_prefill"]
            and (logprob is None or x["logprob"] is None or float(logprob) == float(x["logprob"]))
        )
        if not same:
            return {
                "generation_id": gid,
                "index": i,
                "position": int(r["position"]),
                "recorded": {"token": int(r["token"]), "logprob": r.get("logprob")},
                "reexecuted": {"token": x["token"], "logprob": x["logprob"]},
            }
    if len(recorded) > len(got) or (complete and len(got) != len(recorded)):
        i = min(len(recorded), len(got))
        return {
            "generation_id": gid,
            "index": i,
            "position": None,
            "recorded": {"count": len(recorded)},
            "reexecuted": {"count": len(got)},
        }
    return None
