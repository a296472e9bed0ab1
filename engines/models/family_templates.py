"""The standard chat templates of the model families served, for a GGUF that carries none.

llama.cpp falls back on built-in templates when a file has no ``tokenizer.chat_template``
(Gemma 3 270M's Q4_K_M file has none); this does the same, as Jinja templates rendered by
:mod:`jinja_template` like any model's own. A family is recognised by its architecture
(``general.architecture``) and by its turn tokens being in the vocabulary, or, for another
architecture, by the turn tokens alone:

==========  ==================================  ===========================================
family      architectures                       turns
==========  ==================================  ===========================================
gemma       gemma, gemma2, gemma3               ``<start_of_turn>user|model\\n ... <end_of_turn>\\n``
                                                (a system message opens the next user turn)
llama3      llama                               ``<|start_header_id|>role<|end_header_id|>\\n\\n
                                                ... <|eot_id|>``
chatml      qwen2, qwen3 (Qwen, SmolLM)         ``<|im_start|>role\\n ... <|im_end|>\\n``
phi3        phi3                                ``<|role|>\\n ... <|end|>\\n``
==========  ==================================  ===========================================

Gemma and Llama 3 start with the BOS token, as their own templates do (the engine
tokenizes the rendered text as it is). The token that ends a turn also stops generation
(:func:`sessiontape.engines.models.tokenizer.with_turn_ends`).
"""

from __future__ import annotations

from collections.abc import Container, Mapping
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class Family:
    name: str
    archs: tuple[str, ...]
    tokens: tuple[str, ...]  # what the vocabulary must hold
    template: str


GEMMA = Family(
    "gemma",
    ("gemma", "gemma2", "gemma3"),
    ("<start_of_turn>", "<end_of_turn>"),
    "{{- bos_token -}}\n"
    "{%- set ns = namespace(prefix='') -%}\n"
    "{%- for message in messages -%}\n"
    "{%- if message['role'] == 'system' -%}\n"
    "{%- set ns.prefix = ns.prefix + message['content'] + '\\n\\n' -%}\n"
    "{%- else -%}\n"
    "{{- '<start_of_turn>' + ('model' if message['role'] == 'assistant' else 'user') + '\\n'"
    " + ns.prefix + (message['content'] | trim) + '<end_of_turn>\\n' -}}\n"
    "{%- set ns.prefix = '' -%}\n"
    "{%- endif -%}\n"
    "{%- endfor -%}\n"
    "{%- if add_generation_prompt -%}{{- '<start_of_turn>model\\n' -}}{%- endif -%}\n",
)
LLAMA3 = Family(
    "llama3",
    ("llama",),
    ("<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"),
    "{{- bos_token -}}\n"
    "{%- for message in messages -%}\n"
    "{{- '<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n'"
    " + (message['content'] | trim) + '<|eot_id|>' -}}\n"
    "{%- endfor -%}\n"
    "{%- if add_generation_prompt -%}"
    "{{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' -}}"
    "{%- endif -%}\n",
)
CHATML = Family(
    "chatml",
    ("qwen2", "qwen3", "qwen2moe", "qwen3moe", "llama"),
    ("<|im_start|>", "<|im_end|>"),
    "{%- for message in messages -%}\n"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' -}}\n"
    "{%- endfor -%}\n"
    "{%- if add_generation_prompt -%}{{- '<|im_start|>assistant\\n' -}}{%- endif -%}\n",
)
PHI3 = Family(
    "phi3",
    ("phi3",),
    ("<|user|>", "<|assistant|>", "<|end|>"),
    "{%- for message in messages -%}\n"
    "{{- '<|' + message['role'] + '|>\\n' + message['content'] + '<|end|>\\n' -}}\n"
    "{%- endfor -%}\n"
    "{%- if add_generation_prompt -%}{{- '<|assistant|>\\n' -}}{%- endif -%}\n",
)
FAMILIES = (GEMMA, LLAMA3, CHATML, PHI3)


def family_of(meta: Mapping[str, Any], vocabulary: Container[str]) -> Family | None:
    """The family of a GGUF's metadata whose turn tokens ``vocabulary`` holds: by its
    architecture first, else by the tokens alone; None when no family fits."""
    arch = str(meta.get("general.architecture", ""))
    fits = [f for f in FAMILIES if all(t in vocabulary for t in f.tokens)]
    for family in fits:
        if arch in family.archs:
            return family
    return fits[0] if fits else None
