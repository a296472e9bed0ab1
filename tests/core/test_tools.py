"""core/tools.py on its own: how calls are written, read back and constrained, and
how a request's tools reach a template with and without tool support."""

from __future__ import annotations

import json

import pytest

from sessiontape.core.engine.interface import ChatFormat
from sessiontape.core.errors import MAX_QUOTED_CHARS, InvalidTool
from sessiontape.core.tools import (
    MAX_TOOLS,
    MAX_TOOLS_CHARS,
    CallFormat,
    call_id,
    prompt_messages,
    tool,
    use_of,
)
from sessiontape.engines.constrained import byte_tokenizer
from sessiontape.transports.http.openai.chat_template import ModelTemplate
from sessiontape.transports.http.openai.tools import supplied_events

ARGS = {
    "type": "object",
    "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
    "required": ["city", "days"],
    "additionalProperties": False,
}
WEATHER = tool("weather", "the forecast", ARGS, True)
CLOCK = tool("clock", "", None, False)

HERMES = (
    "{% if tools %}<tools>{% for t in tools %}{{ t.function.name }};{% endfor %}</tools>{% endif %}"
    "{% for m in messages %}<|{{ m.role }}|>{{ m.content or '' }}"
    "{% for c in m.tool_calls or [] %}<tool_call>\n{{ c.function.name }}\n</tool_call>{% endfor %}"
    "{% endfor %}{% if add_generation_prompt %}<|assistant|>{% endif %}"
)


def _matches(constraint_grammar: str, text: str) -> bool:
    from llguidance import LLMatcher

    m = LLMatcher(byte_tokenizer(259, (257,)), constraint_grammar, log_level=0)
    return bool(m.consume_tokens(list(text.encode())) and m.is_accepting())


def test_calls_are_written_read_back_and_constrained() -> None:
    fmt = CallFormat()
    one = fmt.head("weather") + '{"city":"Oslo","days":3}}'
    two = one + "\n" + fmt.head("clock") + "{}}"
    calls = fmt.parse(two, "g_1")
    assert [(c.name, json.loads(c.arguments)) for c in calls] == [
        ("weather", {"city": "Oslo", "days": 3}),
        ("clock", {}),
    ]
    assert [c.id for c in calls] == [call_id("g_1", 0), call_id("g_1", 1)]
    assert two[calls[1].start : calls[1].end] == fmt.head("clock") + "{}}"
    assert fmt.parse("Sunny today.", "g_1") == []
    assert fmt.parse(fmt.head("weather") + '{"city":"Os', "g_1") == []  # cut short
    required = use_of([WEATHER, CLOCK], "required", True, None).constraint()
    auto = use_of([WEATHER, CLOCK], "auto", False, None).constraint()
    named = use_of([WEATHER, CLOCK], "clock", True, None).constraint()
    assert required is not None and auto is not None and named is not None
    assert _matches(required.grammar, two)
    assert not _matches(required.grammar, "Sunny today.")
    assert _matches(auto.grammar, "Sunny today.") and _matches(auto.grammar, one)
    assert not _matches(auto.grammar, two)  # parallel_tool_calls false: one call
    assert not _matches(auto.grammar, fmt.head("weather") + '{"city":"Oslo"}}')  # days missing
    assert _matches(named.grammar, fmt.head("clock") + "{}}")
    assert not _matches(named.grammar, one)
    assert use_of([WEATHER], "none", True, None).constraint() is None


def test_bad_tools_and_choices_are_refused() -> None:
    with pytest.raises(InvalidTool):
        tool("no spaces allowed", "", None, False)
    with pytest.raises(InvalidTool):
        use_of([WEATHER], "clock", True, None)
    with pytest.raises(InvalidTool):
        use_of([WEATHER, WEATHER], "auto", True, None)


def test_tools_are_bounded_in_number_and_size() -> None:
    # (found by fuzzing: 400 tools were accepted and their description overflowed the context)
    many = [tool(f"f{i}", "", None, False) for i in range(MAX_TOOLS + 1)]
    assert use_of(many[:MAX_TOOLS], "auto", True, None).tools == tuple(many[:MAX_TOOLS])
    with pytest.raises(InvalidTool, match=f"tools: 129 functions \\(at most {MAX_TOOLS}\\)"):
        use_of(many, "auto", True, None)
    big = tool("big", "x" * MAX_TOOLS_CHARS, None, False)
    with pytest.raises(InvalidTool, match="characters as JSON"):
        use_of([big], "auto", True, None)


def test_a_description_or_strict_of_another_type_is_refused() -> None:
    # (found by fuzzing: a dict description was kept as its str(), "yes" read as strict)
    with pytest.raises(InvalidTool, match="f: description must be a string"):
        tool("f", {"a": 1}, None, False)
    with pytest.raises(InvalidTool, match="f: strict must be a boolean"):
        tool("f", "", None, "yes")
    assert tool("f", None, None, None) == tool("f", "", None, False)


def test_a_huge_name_or_choice_is_described_not_quoted() -> None:
    for call in (
        lambda: tool("x" * 100_000, "", None, False),
        lambda: use_of([WEATHER], "y" * 100_000, True, None),
    ):
        with pytest.raises(InvalidTool) as err:
            call()
        assert "of 100,000 characters" in err.value.message
        assert len(err.value.message) < 2 * MAX_QUOTED_CHARS + 100


def test_the_fallback_describes_tools_and_writes_calls_as_the_model_does() -> None:
    use = use_of([WEATHER], "auto", True, None)
    assert not use.native
    call = {"id": "c1", "type": "function", "function": {"name": "weather", "arguments": "{}"}}
    messages = [
        {"role": "user", "content": "forecast?"},
        {"role": "assistant", "content": None, "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "c1", "content": "rain"},
    ]
    out = prompt_messages(messages, use, use.format, at_start=True)
    assert out[0]["role"] == "system" and '"name": "weather"' in out[0]["content"]
    assert out[2] == {"role": "assistant", "content": use.format.head("weather") + "{}}"}
    assert out[3] == {"role": "tool", "content": "rain"}
    # not at the session's start: the tools were described when it began
    assert prompt_messages(messages, use, use.format, at_start=False)[0]["role"] == "user"
    events = supplied_events(messages)
    assert [(e.type, e.body["call_id"], e.body["supplied_by"]) for e in events] == [
        ("tool.called", "c1", "client"),
        ("tool.result", "c1", "client"),
    ]


def test_a_template_that_takes_tools_gets_them_and_its_call_tags() -> None:
    use = use_of([WEATHER, CLOCK], "auto", True, HERMES)
    assert use.native and use.format == CallFormat("<tool_call>\n", "\n</tool_call>")
    template = ModelTemplate(ChatFormat(HERMES))
    call = {"id": "c1", "type": "function", "function": {"name": "clock", "arguments": "{}"}}
    messages = prompt_messages(
        [
            {"role": "user", "content": "time?"},
            {"role": "assistant", "content": None, "tool_calls": [call]},
        ],
        use,
        use.format,
        at_start=True,
    )
    text = template.render(
        messages, at_start=True, after_generation=False, tools=use.template_tools()
    )
    assert text.startswith("<tools>weather;clock;</tools>")
    assert "<tool_call>\nclock\n</tool_call>" in text
    written = use.format.head("clock") + "{}}" + use.format.close
    assert written.startswith("<tool_call>\n{") and written.endswith("}\n</tool_call>")
    [parsed] = use.format.parse(written, "g")
    assert parsed.name == "clock" and parsed.arguments == "{}"
    grammar = use.constraint()
    assert grammar is not None and _matches(grammar.grammar, written)


LLAMA = (
    '{% if tools %}Respond in the format {"name": function name, "parameters": dictionary of '
    "argument name and its value}.{% endif %}"
    "{% for m in messages %}<|{{ m.role }}|>{{ m.content or '' }}"
    "{% for c in m.tool_calls or [] %}{{ c.function.arguments | tojson }}{% endfor %}"
    "{% endfor %}{% if add_generation_prompt %}<|assistant|>{% endif %}"
)


def test_a_template_that_asks_for_parameters_gets_calls_written_so() -> None:
    use = use_of([WEATHER], "required", False, LLAMA)
    assert use.native and use.format == CallFormat(key="parameters")
    written = use.format.head("weather") + '{"city":"Rome","days":1}}'
    assert written.startswith('{"name": "weather", "parameters": {')
    [parsed] = use.format.parse(written, "g")
    assert json.loads(parsed.arguments) == {"city": "Rome", "days": 1}
    grammar = use.constraint()
    assert grammar is not None and _matches(grammar.grammar, written)
    # the history's calls reach the template with their arguments as an object
    call = {"id": "c", "type": "function", "function": {"name": "weather", "arguments": '{"a":1}'}}
    messages = prompt_messages(
        [{"role": "assistant", "content": None, "tool_calls": [call]}], use, use.format, True
    )
    text = ModelTemplate(ChatFormat(LLAMA)).render(
        messages, at_start=True, after_generation=False, tools=use.template_tools()
    )
    assert '{"a": 1}' in text and '"{' not in text
