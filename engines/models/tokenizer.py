"""A model's tokenizer as a Hugging Face ``tokenizer.json``, plus its special tokens.

The engine tokenizes with the ``tokenizers`` package only, so every source is turned into
one ``tokenizer.json`` text:

* a Hugging Face folder already has one (:func:`tokenizer_from_hf` returns it unchanged and
  reads the special tokens and the chat template from the files around it);
* a GGUF file has none: llama.cpp stores the vocabulary, merges, scores and token types as
  metadata, and :func:`tokenizer_from_gguf` rebuilds the tokenizer from them.

Two GGUF tokenizer models are supported:

``gpt2``
    byte-level BPE. ``tokenizer.ggml.pre`` names how text is split before the merges
    (the regexes of llama.cpp's ``src/llama-vocab.cpp``, written the way the models' own
    ``tokenizer.json`` files write them): see :data:`PRE_TOKENIZERS`.
``llama``
    SentencePiece-style vocabularies with byte fallback (Llama 2, TinyLlama, Mistral): BPE
    with ``byte_fallback`` whose merges are derived from the token scores the way
    transformers' GGUF loader derives them, ``▁`` for spaces (``Metaspace``, prepending one
    to the first word when ``tokenizer.ggml.add_space_prefix`` says so) and ``<0xXX>``
    byte tokens.

Tokens typed CONTROL become special added tokens and USER_DEFINED ones plain added
tokens, so ``<|im_start|>`` in a text is one id, as in transformers and llama.cpp.
Where the models' own tokenizers, llama.cpp and transformers' GGUF loader disagree, the
choice is noted where it is made.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

from sessiontape.core.errors import ConfigError

if TYPE_CHECKING:
    from tokenizers import Tokenizer

# llama.cpp's token types (gguf.TokenType)
NORMAL, UNKNOWN, CONTROL, USER_DEFINED, UNUSED, BYTE = 1, 2, 3, 4, 5, 6

SPACE = "\u2581"  # SentencePiece's ▁

# The GPT-2 split (also what ByteLevel(use_regex=True) applies by itself).
_GPT2_SPLIT = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"
# Llama 3's split, as its tokenizer.json writes it (llama.cpp spells the (?i:) group out).
_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
# Qwen2's: Llama 3's with single digits.
_QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)


@dataclass(frozen=True)
class _PreTokenizer:
    """How a byte-level vocabulary splits text before its merges."""

    split: str | None  # a regex applied first (None: ByteLevel's own GPT-2 regex)
    digits: bool = False  # every digit on its own first (llama.cpp's "\p{N}" pass)
    ignore_merges: bool = False  # a whole word that is a token is taken as is


# tokenizer.ggml.pre -> pre-tokenizer. llama.cpp's "default" is a four-regex cascade of its
# own; a byte-level GGUF naming it is loaded by transformers with GPT-2's split, as here.
PRE_TOKENIZERS: Mapping[str, _PreTokenizer] = {
    "gpt2": _PreTokenizer(split=None),
    "default": _PreTokenizer(split=None),
    # SmolLM / StarCoder: Sequence[Digits(individual_digits=True), ByteLevel] in their own
    # tokenizer.json; llama.cpp runs "\p{N}" then the GPT-2 regex, which is the same.
    "smollm": _PreTokenizer(split=None, digits=True),
    "starcoder": _PreTokenizer(split=None, digits=True),
    # Llama 3's tokenizer.json and llama.cpp both take a word that is a token whole
    # (ignore_merges); transformers' GGUF loader does not.
    "llama-bpe": _PreTokenizer(split=_LLAMA3_SPLIT, ignore_merges=True),
    "llama3": _PreTokenizer(split=_LLAMA3_SPLIT, ignore_merges=True),
    "llama-v3": _PreTokenizer(split=_LLAMA3_SPLIT, ignore_merges=True),
    # Qwen2's tokenizer.json also NFC-normalizes; llama.cpp and transformers' GGUF loader
    # do not, and neither does this.
    "qwen2": _PreTokenizer(split=_QWEN2_SPLIT),
    "deepseek-r1-qwen": _PreTokenizer(split=_QWEN2_SPLIT),
}


@dataclass(frozen=True)
class Specials:
    """A tokenizer's special tokens: the ids the engine needs and the texts templates use."""

    bos_id: int | None
    eos_ids: tuple[int, ...]  # the EOS first, then any other token that ends a turn
    pad_id: int | None
    unk_id: int | None
    bos_token: str | None
    eos_token: str | None
    add_bos: bool  # a fresh prompt starts with BOS


#: the tokens that end a turn in the chat templates of the families served
TURN_ENDS = ("<end_of_turn>", "<|eot_id|>", "<|im_end|>", "<|end|>")


def with_turn_ends(
    specials: Specials, template: str | None, token_id: Callable[[str], int | None]
) -> Specials:
    """``specials`` with the end-of-turn tokens that ``template`` writes (:data:`TURN_ENDS`)
    first among the EOS ids, so they stop generation, and the first as the EOS text (what a
    generated turn ends with, which continuing the conversation must not write again)."""
    if not template:
        return specials
    ends = [i for t in TURN_ENDS if t in template and (i := token_id(t)) is not None]
    if not ends:
        return specials
    ids = tuple(dict.fromkeys([*ends, *specials.eos_ids]))
    first = next(t for t in TURN_ENDS if t in template and token_id(t) == ids[0])
    return replace(specials, eos_ids=ids, eos_token=first)


# -- GGUF ----------------------------------------------------------------------------------


def tokenizer_from_gguf(meta: Mapping[str, Any]) -> tuple[str, Specials]:
    """The ``tokenizer.json`` text and the specials of a GGUF file's tokenizer.

    ``meta`` is the file's metadata as plain Python values, keyed as llama.cpp names them
    (``tokenizer.ggml.tokens``, ``tokenizer.ggml.merges``, ...).
    """
    model = meta.get("tokenizer.ggml.model")
    tokens = _str_list(meta, "tokenizer.ggml.tokens")
    if not tokens:
        raise ConfigError("GGUF tokenizer: tokenizer.ggml.tokens is missing or empty")
    specials = _gguf_specials(meta, tokens, model)
    types = _token_types(meta, tokens, specials)
    if model == "gpt2":
        tokenizer = _byte_level_bpe(meta, tokens, types)
    elif model == "llama":
        tokenizer = _sentencepiece_bpe(meta, tokens, types, specials.unk_id)
    else:
        raise ConfigError(
            f"GGUF tokenizer: tokenizer model {model!r} (tokenizer.ggml.model) is not supported;"
            " supported: 'gpt2' (byte-level BPE), 'llama' (SentencePiece BPE)"
        )
    return tokenizer.to_str(), specials


def _gguf_specials(meta: Mapping[str, Any], tokens: Sequence[str], model: object) -> Specials:
    """The special token ids of a GGUF, checked against the vocabulary."""

    def token_id(name: str) -> int | None:
        value = meta.get(f"tokenizer.ggml.{name}_token_id")
        if value is None:
            return None
        if isinstance(value, bool) or not isinstance(value, int):
            raise ConfigError(f"GGUF tokenizer: tokenizer.ggml.{name}_token_id is not an integer")
        if not 0 <= value < len(tokens):
            raise ConfigError(
                f"GGUF tokenizer: tokenizer.ggml.{name}_token_id {value} is outside the"
                f" vocabulary of {len(tokens)} tokens"
            )
        return value

    bos, eos, eot = token_id("bos"), token_id("eos"), token_id("eot")
    eos_ids = tuple(dict.fromkeys(i for i in (eos, eot) if i is not None))
    add_bos = meta.get("tokenizer.ggml.add_bos_token")
    if add_bos is None:
        # llama.cpp's defaults: on for SentencePiece vocabularies and Llama 3, off otherwise
        pre = meta.get("tokenizer.ggml.pre")
        add_bos = model == "llama" or pre in ("llama-bpe", "llama3", "llama-v3")
    return Specials(
        bos_id=bos,
        eos_ids=eos_ids,
        pad_id=token_id("padding"),
        unk_id=token_id("unknown"),
        bos_token=tokens[bos] if bos is not None else None,
        eos_token=tokens[eos_ids[0]] if eos_ids else None,
        add_bos=bool(add_bos) and bos is not None,
    )


def _str_list(meta: Mapping[str, Any], key: str) -> list[str]:
    value = meta.get(key)
    if value is None:
        return []
    if not isinstance(value, Sequence) or not all(isinstance(v, str) for v in value):
        raise ConfigError(f"GGUF tokenizer: {key} is not a list of strings")
    return list(value)


def _token_types(meta: Mapping[str, Any], tokens: Sequence[str], specials: Specials) -> list[int]:
    """Each token's llama.cpp type; without the key, the special ids count as CONTROL."""
    raw = meta.get("tokenizer.ggml.token_type")
    if raw is None:
        types = [NORMAL] * len(tokens)
        for i in (specials.bos_id, *specials.eos_ids, specials.pad_id, specials.unk_id):
            if i is not None:
                types[i] = CONTROL
        return types
    if not isinstance(raw, Sequence) or len(raw) != len(tokens):
        raise ConfigError(
            "GGUF tokenizer: tokenizer.ggml.token_type does not give one type per token"
        )
    return [int(t) for t in raw]


def _add_tokens(
    tokenizer: Tokenizer, tokens: Sequence[str], types: Sequence[int], special: Iterable[int]
) -> None:
    """CONTROL (and the ``special`` types) as special added tokens, USER_DEFINED as plain ones.

    They go in apart: ``add_special_tokens`` marks every token it is given special, and a
    plain added token (Gemma's ``"\n"``, ``"  "`` or ``"<table>"``) must stay in text
    decoded without the special tokens."""
    from tokenizers import AddedToken

    special_types = set(special)
    specials, plain = [], []
    for token, kind in zip(tokens, types, strict=True):
        if kind in special_types:
            specials.append(AddedToken(token, special=True, normalized=False))
        elif kind == USER_DEFINED:
            plain.append(AddedToken(token, special=False, normalized=False))
    tokenizer.add_special_tokens(specials)
    tokenizer.add_tokens(plain)


def _byte_level_bpe(
    meta: Mapping[str, Any], tokens: Sequence[str], types: Sequence[int]
) -> Tokenizer:
    """A GPT-2 style byte-level BPE tokenizer (``tokenizer.ggml.model`` = ``gpt2``)."""
    from tokenizers import Regex, Tokenizer, decoders, pre_tokenizers
    from tokenizers.models import BPE

    pre_name = meta.get("tokenizer.ggml.pre", "default")
    pre = PRE_TOKENIZERS.get(str(pre_name))
    if pre is None:
        raise ConfigError(
            f"GGUF tokenizer: pre-tokenizer {pre_name!r} (tokenizer.ggml.pre) is not supported;"
            f" supported: {', '.join(sorted(PRE_TOKENIZERS))}"
        )
    merges = [_merge_pair(m) for m in _str_list(meta, "tokenizer.ggml.merges")]
    if not merges:
        raise ConfigError("GGUF tokenizer: a gpt2 tokenizer needs tokenizer.ggml.merges")
    vocab = _byte_level_vocab(tokens, types)
    tokenizer = Tokenizer(BPE(vocab, merges, ignore_merges=pre.ignore_merges))
    steps: list[Any] = []
    if pre.digits:
        steps.append(pre_tokenizers.Digits(individual_digits=True))
    if pre.split is not None:
        steps.append(pre_tokenizers.Split(Regex(pre.split), behavior="isolated"))
    steps.append(pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=pre.split is None))
    tokenizer.pre_tokenizer = steps[0] if len(steps) == 1 else pre_tokenizers.Sequence(steps)
    tokenizer.decoder = decoders.ByteLevel()
    _add_tokens(tokenizer, tokens, types, (CONTROL,))
    return tokenizer


def _merge_pair(merge: str) -> tuple[str, str]:
    parts = merge.split(" ")
    if len(parts) != 2 or not all(parts):
        raise ConfigError(f"GGUF tokenizer: merge {merge!r} is not two tokens with one space")
    return parts[0], parts[1]


def _byte_level_vocab(tokens: Sequence[str], types: Sequence[int]) -> dict[str, int]:
    """Token -> id, each normal token spelled in GPT-2's byte alphabet.

    Added tokens (CONTROL, USER_DEFINED) keep their text, which is what they match. A
    normal token with characters outside the byte alphabet is respelled from its UTF-8
    bytes, as transformers' GGUF loader does. A repeated token keeps its last id (llama.cpp
    and transformers alike).
    """
    spelling = _bytes_to_unicode()
    alphabet = set(spelling)
    vocab: dict[str, int] = {}
    for index, (token, kind) in enumerate(zip(tokens, types, strict=True)):
        if kind not in (CONTROL, USER_DEFINED) and not set(token) <= alphabet:
            token = "".join(spelling[b] for b in token.encode("utf-8"))
        vocab[token] = index
    return vocab


def _bytes_to_unicode() -> list[str]:
    """GPT-2's byte alphabet: byte ``b`` is spelled ``_bytes_to_unicode()[b]``.

    Printable Latin-1 bytes stand for themselves; the others (controls, space, ...) are
    moved to U+0100 and up, in byte order.
    """
    printable = [*range(0x21, 0x7F), *range(0xA1, 0xAD), *range(0xAE, 0x100)]
    spelled: dict[int, str] = {b: chr(b) for b in printable}
    shifted = 0
    for b in range(256):
        if b not in spelled:
            spelled[b] = chr(256 + shifted)
            shifted += 1
    return [spelled[b] for b in range(256)]


def _sentencepiece_bpe(
    meta: Mapping[str, Any], tokens: Sequence[str], types: Sequence[int], unk_id: int | None
) -> Tokenizer:
    """A SentencePiece-style BPE tokenizer with byte fallback (``tokenizer.ggml.model`` = ``llama``).

    Like transformers' Llama tokenizer: no normalizer, a ``Metaspace`` pre-tokenizer that
    turns spaces into ``▁`` and, with ``add_space_prefix`` (the default), puts one before
    the first word (not after each special token: transformers' non-legacy behaviour), and
    a decoder that undoes both and joins ``<0xXX>`` byte tokens back into UTF-8.
    """
    from tokenizers import Tokenizer, decoders, pre_tokenizers
    from tokenizers.models import BPE

    scores = meta.get("tokenizer.ggml.scores")
    if not isinstance(scores, Sequence) or len(scores) != len(tokens):
        raise ConfigError(
            "GGUF tokenizer: a llama tokenizer needs one tokenizer.ggml.scores per token"
        )
    given = _str_list(meta, "tokenizer.ggml.merges")
    if given:
        merges = [_merge_pair(m) for m in given]
    else:
        merges = derive_merges(tokens, [float(s) for s in scores])
    vocab = {token: index for index, token in enumerate(tokens)}
    unk = tokens[unk_id] if unk_id is not None else None
    tokenizer = Tokenizer(BPE(vocab, merges, unk_token=unk, fuse_unk=True, byte_fallback=True))
    prefix = bool(meta.get("tokenizer.ggml.add_space_prefix", True))
    tokenizer.pre_tokenizer = pre_tokenizers.Metaspace(
        replacement=SPACE, prepend_scheme="first" if prefix else "never", split=False
    )
    steps = [decoders.Replace(SPACE, " "), decoders.ByteFallback(), decoders.Fuse()]
    if prefix:
        steps.append(decoders.Strip(content=" ", left=1, right=0))
    tokenizer.decoder = decoders.Sequence(steps)
    # <unk> is special too, as in Llama's own tokenizer.json and llama.cpp (transformers'
    # GGUF loader leaves it to be spelled out of pieces).
    _add_tokens(tokenizer, tokens, types, (CONTROL, UNKNOWN))
    return tokenizer


def derive_merges(tokens: Sequence[str], scores: Sequence[float]) -> list[tuple[str, str]]:
    """BPE merges implied by a SentencePiece vocabulary, best first.

    Every way of cutting a token into two tokens is a merge that makes it; merges are
    ranked by the made token's score, then the longer left and right parts first; ties
    keep vocabulary order (and, for one token, the order of the parts' ids). This is the
    order transformers' ``generate_merges`` gives, so ids match its GGUF loader.
    """
    ids = {token: index for index, token in enumerate(tokens)}
    score_of = dict(zip(tokens, scores, strict=True))
    candidates: list[tuple[float, int, int, str, str]] = []
    for token, score in score_of.items():
        cuts = [
            (token[:i], token[i:])
            for i in range(1, len(token))
            if token[:i] in ids and token[i:] in ids
        ]
        cuts.sort(key=lambda pair: (ids[pair[0]], ids[pair[1]]))
        candidates.extend((score, len(left), len(right), left, right) for left, right in cuts)
    candidates.sort(key=lambda c: (c[0], c[1], c[2]), reverse=True)  # stable: ties keep order
    return [(left, right) for _, _, _, left, right in candidates]


# -- Hugging Face folder -----------------------------------------------------------------


def tokenizer_from_hf(folder: Path) -> tuple[str, Specials, str | None]:
    """A Hugging Face model folder's ``tokenizer.json`` (unchanged), specials and chat template.

    Reads ``tokenizer_config.json`` (special token texts, ``add_bos_token``,
    ``chat_template``), ``chat_template.jinja`` (the template, preferred when present),
    ``generation_config.json`` and ``config.json`` (ids, notably every id that ends a turn).
    """
    from tokenizers import Tokenizer

    path = folder / "tokenizer.json"
    if not path.is_file():
        raise ConfigError(f"{folder}: no tokenizer.json (a Hugging Face model folder needs one)")
    text = path.read_text(encoding="utf-8")
    try:
        tokenizer = Tokenizer.from_str(text)
    except Exception as exc:  # the Rust side raises plain Exceptions
        raise ConfigError(f"{path}: not a tokenizer the tokenizers package loads: {exc}") from exc
    config = _read_json(folder / "tokenizer_config.json")
    generation = _read_json(folder / "generation_config.json")
    model_config = _read_json(folder / "config.json")
    specials = _hf_specials(tokenizer, json.loads(text), config, generation, model_config)
    template_file = folder / "chat_template.jinja"
    if template_file.is_file():
        template: str | None = template_file.read_text(encoding="utf-8")
    else:
        template = _chat_template(config.get("chat_template"), folder)
    return text, specials, template


def _read_json(path: Path) -> dict[str, Any]:
    if not path.is_file():
        return {}
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (ValueError, UnicodeDecodeError) as exc:
        raise ConfigError(f"{path}: not valid JSON: {exc}") from exc
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: expected a JSON object")
    return data


def _token_text(value: object) -> str | None:
    """A special token as tokenizer_config.json writes it: a string or {"content": ...}."""
    if isinstance(value, str):
        return value
    if isinstance(value, Mapping) and isinstance(value.get("content"), str):
        return str(value["content"])
    return None


def _ids(value: object) -> list[int]:
    """An id or a list of ids, as the config files write them."""
    if isinstance(value, bool):
        return []
    if isinstance(value, int):
        return [value]
    if isinstance(value, list):
        return [v for v in value if isinstance(v, int) and not isinstance(v, bool)]
    return []


def _hf_specials(
    tokenizer: Tokenizer,
    data: Mapping[str, Any],
    config: Mapping[str, Any],
    generation: Mapping[str, Any],
    model_config: Mapping[str, Any],
) -> Specials:
    """Specials from the folder's files; texts from tokenizer_config.json come first."""

    def lookup(name: str) -> tuple[str | None, list[int]]:
        text = _token_text(config.get(f"{name}_token"))
        found = tokenizer.token_to_id(text) if text is not None else None
        ids = [found] if found is not None else []
        ids += _ids(generation.get(f"{name}_token_id")) + _ids(model_config.get(f"{name}_token_id"))
        ids = [i for i in dict.fromkeys(ids) if tokenizer.id_to_token(i) is not None]
        if text is None and ids:
            text = tokenizer.id_to_token(ids[0])
        return text, ids

    bos_token, bos_ids = lookup("bos")
    eos_token, eos_ids = lookup("eos")
    _, pad_ids = lookup("pad")
    _, unk_ids = lookup("unk")
    if not unk_ids:
        model_unk = data.get("model", {}).get("unk_token")
        found = tokenizer.token_to_id(model_unk) if isinstance(model_unk, str) else None
        unk_ids = [found] if found is not None else []
    add_bos = config.get("add_bos_token")
    if not isinstance(add_bos, bool):
        add_bos = bos_token is not None and _post_processor_adds(
            data.get("post_processor"), bos_token
        )
    return Specials(
        bos_id=bos_ids[0] if bos_ids else None,
        eos_ids=tuple(eos_ids),
        pad_id=pad_ids[0] if pad_ids else None,
        unk_id=unk_ids[0] if unk_ids else None,
        bos_token=bos_token,
        eos_token=eos_token,
        add_bos=add_bos and bool(bos_ids),
    )


def _post_processor_adds(processor: object, token: str) -> bool:
    """Whether tokenizer.json's post-processor puts ``token`` before a single sequence."""
    if not isinstance(processor, Mapping):
        return False
    if processor.get("type") == "Sequence":
        return any(_post_processor_adds(p, token) for p in processor.get("processors", []))
    if processor.get("type") != "TemplateProcessing":
        return False
    single = processor.get("single") or []
    first = single[0] if single else None
    return isinstance(first, Mapping) and (first.get("SpecialToken") or {}).get("id") == token


def _chat_template(value: object, folder: Path) -> str | None:
    """tokenizer_config.json's chat_template: a string, or named templates (take "default")."""
    if value is None or isinstance(value, str):
        return value
    if isinstance(value, list):
        named = {
            t.get("name"): t.get("template")
            for t in value
            if isinstance(t, Mapping) and isinstance(t.get("template"), str)
        }
        if "default" in named:
            return str(named["default"])
        raise ConfigError(
            f"{folder}/tokenizer_config.json: chat templates {sorted(map(str, named))}"
            " but none named 'default'"
        )
    raise ConfigError(f"{folder}/tokenizer_config.json: chat_template is neither text nor a list")
