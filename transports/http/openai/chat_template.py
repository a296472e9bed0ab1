"""Chat templates: how OpenAI-style messages become the text a model continues.

A template is plain data (no code), so it can be recorded in the log with
every turn it rendered and re-applied by anyone replaying the session::

    message = "<|{role}|>\\n{content}\\n"     # one message
    generation_prompt = "<|assistant|>\\n"    # opens the assistant's turn
    after_generation = "\\n"                  # closes a generated turn before the next message
    prefix = ""                              # once, at the start of a session
    stop = ["<|user|>", "<|system|>"]         # text that ends an assistant turn

Where it comes from, first match wins: ``[transports.http.chat_template]``
in the config (a table, or the path of a JSON file), then the served
model's own Jinja template (:class:`ModelTemplate`: a GGUF's
``tokenizer.chat_template`` or a Hugging Face ``chat_template``, which the
importer keeps as ``chat_template.jinja``), then ``chat_template.json`` in
the engine's model folder (``[engine.options] model_dir``), then
:data:`ROLE_MARKERS`, the plain role-marker template of the demo models.

A model's template renders whole conversations; a session grows one
request at a time, so :class:`ModelTemplate` renders the text one request's
messages add (:func:`sessiontape.engines.models.jinja_template.continuation`),
and the session's tokens stay equal to the template's render of the whole
conversation. Generation ends at the model's end-of-turn token (its EOS ids).

The template is applied once, when a request's messages are turned into
tokens; the tokens are what the log keeps, and the template itself is
recorded in the session's ``meta`` and in each request's ``wire.message``.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from sessiontape.core.config import Config
from sessiontape.core.engine.interface import ChatFormat
from sessiontape.core.errors import ConfigError, InvalidParameters

ROLES = ("system", "developer", "user", "assistant")


@dataclass(frozen=True)
class ChatTemplate:
    name: str = "role-markers"
    message: str = "<|{role}|>\n{content}\n"
    generation_prompt: str = "<|assistant|>\n"
    after_generation: str = "\n"
    prefix: str = ""
    stop: tuple[str, ...] = field(
        default=("<|user|>", "<|system|>", "<|developer|>", "<|assistant|>")
    )

    @classmethod
    def from_json(cls, data: Mapping[str, Any], source: str = "config") -> ChatTemplate:
        known = {"name", "message", "generation_prompt", "after_generation", "prefix", "stop"}
        unknown = set(data) - known
        if unknown:
            raise ConfigError(f"chat template ({source}): unknown keys {sorted(unknown)}")
        try:
            tpl = cls(
                name=str(data.get("name", "custom")),
                message=str(data.get("message", cls.message)),
                generation_prompt=str(data.get("generation_prompt", cls.generation_prompt)),
                after_generation=str(data.get("after_generation", cls.after_generation)),
                prefix=str(data.get("prefix", "")),
                stop=tuple(str(s) for s in data.get("stop", ())),
            )
            tpl.message.format(role="user", content="x")
        except (KeyError, IndexError, ValueError, TypeError) as exc:
            raise ConfigError(
                f"chat template ({source}): 'message' must use only {{role}} and {{content}}: {exc}"
            ) from exc
        return tpl

    def to_json(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "message": self.message,
            "generation_prompt": self.generation_prompt,
            "after_generation": self.after_generation,
            "prefix": self.prefix,
            "stop": list(self.stop),
        }

    def render(
        self, messages: Sequence[tuple[str, str]], *, at_start: bool, after_generation: bool
    ) -> str:
        """The text of one request's messages, ending with the generation prompt.

        ``at_start``: the session holds no tokens yet (the prefix goes first);
        ``after_generation``: the session ends with a generated turn, which is
        closed first.
        """
        parts = [self.prefix if at_start else "", self.after_generation if after_generation else ""]
        for role, content in messages:
            parts.append(self.message.format(role=role, content=content))
        parts.append(self.generation_prompt)
        return "".join(parts)


ROLE_MARKERS = ChatTemplate()


class ModelTemplate:
    """The served model's own Jinja chat template, continued request by request."""

    name = "model"
    stop: tuple[str, ...] = ()

    def __init__(self, chat: ChatFormat) -> None:
        from sessiontape.engines.models.jinja_template import JinjaChatTemplate

        self.jinja = JinjaChatTemplate(chat.template, chat.bos_token, chat.eos_token)
        self.eos_text = chat.eos_token

    def to_json(self) -> dict[str, Any]:
        return {"name": self.name, "format": "jinja", "sha256": self.jinja.sha256}

    def render(
        self,
        messages: Sequence[tuple[str, str]],
        *,
        at_start: bool,
        after_generation: bool,
        ended_with_eos: bool = True,
    ) -> str:
        """The text of one request's messages, ending with the generation prompt.

        ``ended_with_eos``: the generated turn that ends the session stopped at
        the model's EOS (else its whole closing text is added).
        """
        from sessiontape.engines.models.jinja_template import continuation

        return continuation(
            self.jinja,
            [{"role": role, "content": content} for role, content in messages],
            at_start=at_start,
            after_generation=after_generation,
            eos_text=self.eos_text if ended_with_eos else None,
        )


AnyTemplate = ChatTemplate | ModelTemplate


def load_template(config: Config, chat: ChatFormat | None = None) -> AnyTemplate:
    """The chat template for the configured model (see the module docstring).

    ``chat``: the served engine's own template (``EngineInfo.chat``).
    """
    configured = getattr(config.transports.get("http"), "chat_template", None)
    if isinstance(configured, Mapping):
        return ChatTemplate.from_json(configured, "transports.http.chat_template")
    if isinstance(configured, str) and configured:
        return _from_file(Path(configured))
    if configured not in (None, ""):
        raise ConfigError("transports.http.chat_template must be a table or a file path")
    if chat is not None:
        return ModelTemplate(chat)
    model_dir = config.engine_options.get("model_dir")
    if model_dir:
        path = Path(str(model_dir)) / "chat_template.json"
        if path.is_file():
            return _from_file(path)
    return ROLE_MARKERS


def _from_file(path: Path) -> ChatTemplate:
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise ConfigError(f"chat template {path}: {exc}") from exc
    if not isinstance(data, dict):
        raise ConfigError(f"chat template {path}: not a JSON object")
    return ChatTemplate.from_json(data, str(path))


def message_text(content: Any, where: str) -> str:
    """The text of an OpenAI message's ``content``: a string or a list of text parts."""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        out = []
        for part in content:
            if isinstance(part, str):
                out.append(part)
                continue
            if not isinstance(part, dict) or part.get("type") not in (
                "text",
                "input_text",
                "output_text",
            ):
                kind = part.get("type") if isinstance(part, dict) else type(part).__name__
                raise InvalidParameters(
                    f"{where}: content part of type {kind!r} is not supported (text only)"
                )
            text = part.get("text")
            if not isinstance(text, str):
                raise InvalidParameters(f"{where}: a text part needs a string 'text'")
            out.append(text)
        return "".join(out)
    raise InvalidParameters(f"{where}: content must be a string or an array of text parts")
