"""The standard chat templates (engines/models/family_templates.py) and end-of-turn stops.

Each family's template renders a conversation in the format its models were trained on
(the expected texts are written out here), continues it turn by turn the way a session
grows, and its end-of-turn token becomes the first EOS id. A GGUF without a template is
imported with its family's, and one INFO line says which.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest

from sessiontape.engines.models.family_templates import (
    CHATML,
    FAMILIES,
    GEMMA,
    LLAMA3,
    PHI3,
    Family,
    family_of,
)
from sessiontape.engines.models.jinja_template import JinjaChatTemplate, continuation
from sessiontape.engines.models.tokenizer import Specials, with_turn_ends
from sessiontape.engines.onnx.importer import import_model
from tests.helpers import checkpoints as ck
from tests.helpers.mixed_gguf import write_mixed

CONVERSATION = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "Hi!"},
    {"role": "assistant", "content": "Hello."},
    {"role": "user", "content": "Capital of France?"},
]
EXPECTED = {
    "gemma": "<bos><start_of_turn>user\nBe brief.\n\nHi!<end_of_turn>\n"
    "<start_of_turn>model\nHello.<end_of_turn>\n"
    "<start_of_turn>user\nCapital of France?<end_of_turn>\n<start_of_turn>model\n",
    "llama3": "<|begin_of_text|><|start_header_id|>system<|end_header_id|>\n\nBe brief.<|eot_id|>"
    "<|start_header_id|>user<|end_header_id|>\n\nHi!<|eot_id|>"
    "<|start_header_id|>assistant<|end_header_id|>\n\nHello.<|eot_id|>"
    "<|start_header_id|>user<|end_header_id|>\n\nCapital of France?<|eot_id|>"
    "<|start_header_id|>assistant<|end_header_id|>\n\n",
    "chatml": "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi!<|im_end|>\n"
    "<|im_start|>assistant\nHello.<|im_end|>\n<|im_start|>user\nCapital of France?<|im_end|>\n"
    "<|im_start|>assistant\n",
    "phi3": "<|system|>\nBe brief.<|end|>\n<|user|>\nHi!<|end|>\n<|assistant|>\nHello.<|end|>\n"
    "<|user|>\nCapital of France?<|end|>\n<|assistant|>\n",
}
BOS = {"gemma": "<bos>", "llama3": "<|begin_of_text|>"}
END = {"gemma": "<end_of_turn>", "llama3": "<|eot_id|>", "chatml": "<|im_end|>", "phi3": "<|end|>"}


@pytest.mark.parametrize("family", FAMILIES, ids=lambda f: f.name)
def test_each_family_renders_its_format(family: Family) -> None:
    tpl = JinjaChatTemplate(family.template, BOS.get(family.name), "</s>")
    assert tpl.render(CONVERSATION, add_generation_prompt=True) == EXPECTED[family.name]


@pytest.mark.parametrize("family", FAMILIES, ids=lambda f: f.name)
def test_a_session_continued_turn_by_turn_is_the_whole_render(family: Family) -> None:
    """Generated turns end with the end-of-turn token (the EOS text); what each request adds
    makes the session equal the template's render of the whole conversation."""
    end = END[family.name]
    tpl = JinjaChatTemplate(family.template, BOS.get(family.name), end)
    session = continuation(
        tpl, CONVERSATION[:2], at_start=True, after_generation=False, eos_text=end
    )
    session += "Hello." + end
    session += continuation(
        tpl, CONVERSATION[3:], at_start=False, after_generation=True, eos_text=end
    )
    assert session == EXPECTED[family.name]


@pytest.mark.parametrize(
    ("arch", "tokens", "want"),
    [
        ("gemma3", ["<start_of_turn>", "<end_of_turn>", "<|im_start|>", "<|im_end|>"], GEMMA),
        ("llama", ["<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"], LLAMA3),
        ("llama", ["<|im_start|>", "<|im_end|>"], CHATML),  # SmolLM
        ("qwen3", ["<|im_start|>", "<|im_end|>", "<|user|>", "<|assistant|>", "<|end|>"], CHATML),
        ("phi3", ["<|user|>", "<|assistant|>", "<|end|>", "<|im_start|>", "<|im_end|>"], PHI3),
        ("mistral", ["<|user|>", "<|assistant|>", "<|end|>"], PHI3),  # by the tokens alone
        ("gemma3", ["<start_of_turn>"], None),  # its end-of-turn token is missing
        ("llama", ["[INST]", "[/INST]"], None),
    ],
)
def test_the_family_is_told_by_architecture_and_tokens(
    arch: str, tokens: list[str], want: Family | None
) -> None:
    assert family_of({"general.architecture": arch}, set(tokens)) is want


def test_the_end_of_turn_token_becomes_the_first_eos() -> None:
    ids = {"<eos>": 1, "<end_of_turn>": 106, "<|im_end|>": 7}
    base = Specials(2, (1,), 0, 3, "<bos>", "<eos>", True)
    got = with_turn_ends(base, GEMMA.template, ids.get)
    assert got.eos_ids == (106, 1) and got.eos_token == "<end_of_turn>"
    assert with_turn_ends(base, None, ids.get) == base
    assert with_turn_ends(base, "{{ messages }}", ids.get) == base  # no turn token written
    assert with_turn_ends(base, PHI3.template, ids.get) == base  # <|end|> is not in the vocab


def test_a_gguf_without_a_template_gets_its_familys(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    write_mixed(tmp_path / "qwen.gguf")  # qwen2, ChatML tokens, no tokenizer.chat_template
    with caplog.at_level(logging.INFO, logger="sessiontape.engines.models"):
        out = import_model(tmp_path / "qwen.gguf", tmp_path / "out", "auto", concepts=False)
    said = [r.getMessage() for r in caplog.records if "chat template" in r.getMessage()]
    assert said == ["qwen.gguf has no chat template; using the standard chatml template"]
    assert (out.folder / "chat_template.jinja").read_text() == CHATML.template
    cfg = json.loads((out.folder / "config.json").read_text())
    im_end = ck.TOKENS.index("<|im_end|>")
    assert cfg["eos_token_id"][0] == im_end and cfg["eos_token"] == "<|im_end|>"
