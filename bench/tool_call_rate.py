"""How likely the default model is to call a tool under ``tool_choice: "auto"``, by the
wording of the fallback prompt (core/tools.py's FALLBACK_PROMPT). Not a speed benchmark: a
measurement of the model, for docs/protocols/openai.md (Tools).

Run (about half a minute on an idle 2-core machine once the model is imported):

    .venv/bin/python bench/tool_call_rate.py [--threads 2]

The engine is ``OnnxEngine`` on SmolLM2-135M-Instruct, whose chat template has no tool
support, so a request's tools reach it as the fallback renders them: described in a system
turn. Under ``auto`` the reply's grammar lets it begin either a call (``{``) or text (any
first character but ``{``, ``<`` or a space), so the first token decides. For each question
the script reads the model's distribution over its first token (the top 100, unconstrained)
and prints the share of the allowed mass that begins a call: P(call). Six questions a tool
answers and six it does not; the mean of each, per wording: the fallback's own and a few
rewordings (instructions first, ``<tools>`` tags, "when the user asks", a helpful-assistant
or an expert-composer preamble).
"""

from __future__ import annotations

import argparse
import asyncio
import math
from typing import Any

from sessiontape.core import tools
from sessiontape.core.engine.interface import OutputOptions, SamplingParams
from sessiontape.engines.models.registry import DEFAULT_MODEL
from sessiontape.engines.onnx.engine import OnnxEngine
from sessiontape.engines.onnx.importer import ensure_imported
from sessiontape.transports.http.openai.chat_template import ModelTemplate

WEATHER = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "maxLength": 20},
        "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
    },
    "required": ["city", "unit"],
    "additionalProperties": False,
}
TIME = {
    "type": "object",
    "properties": {"city": {"type": "string", "maxLength": 20}},
    "required": ["city"],
    "additionalProperties": False,
}
TOOLS = [
    tools.tool("get_weather", "The current weather in a city", WEATHER, True),
    tools.tool("get_time", "The local time in a city", TIME, True),
]
NEEDS_A_TOOL = [
    "What is the weather in Paris?",
    "What time is it in Tokyo?",
    "Is it raining in London right now?",
    "Tell me the current temperature in Berlin in celsius.",
    "What's the local time in New York?",
    "How hot is it in Madrid today?",
]
NEEDS_NONE = [
    "Write a haiku about the sea.",
    "What is 2 + 2?",
    "Who wrote Hamlet?",
    "Say hello.",
    "Translate 'cat' into French.",
    "Name three colors.",
]
_CALL = '{{"name": <the function\'s name>, "arguments": <an object of its arguments>}}.'
WORDINGS = {
    "fallback": tools.FALLBACK_PROMPT,
    "instructions first": (
        f"To call a function, answer with only one line of JSON: {_CALL}\n"
        "You can call these functions:\n{tools}"
    ),
    "<tools> tags": (
        "You have access to the following tools:\n<tools>\n{tools}\n</tools>\n"
        f"To call a tool, answer with only one line of JSON: {_CALL}"
    ),
    "when the user asks": (
        "You can call these functions:\n{tools}\nWhen the user asks for something a function"
        f" provides, call it: answer with only one line of JSON: {_CALL}"
    ),
    "helpful assistant": (
        "You are a helpful assistant with access to these functions:\n{tools}\n"
        f"To call a function, answer with only one line of JSON: {_CALL}"
    ),
    "expert composer": (
        "You are an expert in composing functions. You are given a question and a set of"
        " possible functions. Based on the question, you will need to make one or more function"
        " calls to achieve the purpose.\nYou can call these functions:\n{tools}\n"
        f"To call a function, answer with only one line of JSON: {_CALL}"
    ),
}


async def p_call(
    eng: OnnxEngine, template: ModelTemplate, wording: str, question: str, key: str
) -> float:
    """The share of the first token's allowed probability mass that begins a call."""
    system = wording.format(tools=tools.described(TOOLS))
    messages = [{"role": "system", "content": system}, {"role": "user", "content": question}]
    text = template.render(messages, at_start=True, after_generation=False, ended_with_eos=False)
    top: tuple[tuple[int, float], ...] = ()
    params = SamplingParams(max_tokens=1, seed=0)
    async for step in eng.generate(key, eng.tokenize(text), params, OutputOptions(100)):
        top = step.top_logprobs
    call = other = 0.0
    for token, logprob in top:
        piece = eng.detokenize([token])
        if piece.startswith("{"):
            call += math.exp(logprob)
        elif piece and piece[0] != "<" and not piece[0].isspace():
            other += math.exp(logprob)
    return call / (call + other)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    eng = OnnxEngine(model_dir=ensure_imported(DEFAULT_MODEL), intra_op_threads=args.threads)
    assert eng.info.chat is not None
    template = ModelTemplate(eng.info.chat)

    async def measure() -> list[tuple[str, Any, Any]]:
        rows = []
        for name, wording in WORDINGS.items():
            need = [
                await p_call(eng, template, wording, q, f"{name}/need/{i}")
                for i, q in enumerate(NEEDS_A_TOOL)
            ]
            none = [
                await p_call(eng, template, wording, q, f"{name}/none/{i}")
                for i, q in enumerate(NEEDS_NONE)
            ]
            rows.append((name, sum(need) / len(need), sum(none) / len(none)))
        return rows

    rows = asyncio.run(measure())
    print(f"{'wording':<20} {'P(call) needs a tool':>22} {'P(call) needs none':>20}")
    for name, need, none in rows:
        print(f"{name:<20} {need:>22.3f} {none:>20.3f}")


if __name__ == "__main__":
    main()
