"""A model's own Jinja chat template, rendered as transformers' ``apply_chat_template`` does.

Models ship their chat format as a Jinja template (``tokenizer_config.json``'s
``chat_template``, ``chat_template.jinja``, or a GGUF's ``tokenizer.chat_template``).
:class:`JinjaChatTemplate` renders one in the same environment transformers uses: an
``ImmutableSandboxedEnvironment`` with ``trim_blocks``, ``lstrip_blocks`` and loop controls;
a ``tojson`` that does not escape HTML and writes non-ASCII as is; ``raise_exception`` and
``strftime_now``; the ``{% generation %}`` tag (rendered as its body); and the variables
``messages``, ``add_generation_prompt``, ``tools``, ``documents``, ``bos_token`` and
``eos_token``. Templates are untrusted code: anything the sandbox refuses (dunder
attributes, methods that mutate, huge repetitions) raises
:class:`~sessiontape.core.errors.InvalidParameters` instead of running.

Continuing a session
--------------------
A session is one growing text, continued one request at a time, while a template renders
whole conversations. :func:`continuation` gives the text that one request's new messages
add to a session, ending with the generation prompt:

* ``at_start``: the session is empty, so it is the whole render of the messages with the
  generation prompt.
* Otherwise a fixed dummy conversation ``P = [user "\\x00u", assistant "\\x00a"]`` is
  rendered alone and followed by the new messages (with the generation prompt); the new
  text is the second render past the first. A template whose render of ``P`` is not a
  prefix of the longer one (it rewrites earlier turns) cannot continue a conversation and
  raises :class:`~sessiontape.core.errors.InvalidParameters`.
* ``after_generation``: the session ends right after a generated assistant turn, whose
  last token was the model's EOS (text ``eos_text``). The text that closes an assistant
  turn — what follows ``"\\x00a"`` in the render of ``P`` — goes first, less the EOS,
  which the session already has. (Where the template puts text between the reply and the
  EOS, as Llama 2's ``" </s>"``, that text is left out: the model chose to end there.)
  Without an EOS text (the turn stopped otherwise, e.g. at a length limit) the whole
  closing text goes first. When the session ended with text a client supplied, no
  closing text is added.

For SmolLM2 (ChatML), after ``<|im_start|>assistant\\nHello!<|im_end|>`` was generated,
the next user turn continues with ``"\\n<|im_start|>user\\n...<|im_end|>\\n<|im_start|>assistant\\n"``,
so the session equals the template's render of the whole conversation.
"""

from __future__ import annotations

import functools
import hashlib
import json
import operator
from collections.abc import Callable, Mapping, Sequence
from datetime import datetime
from typing import Any

import jinja2
import jinja2.ext
import jinja2.nodes
import jinja2.parser
import jinja2.utils
from jinja2.exceptions import SecurityError
from jinja2.sandbox import ImmutableSandboxedEnvironment

from sessiontape.core.engine.interface import ChatFormat
from sessiontape.core.errors import ConfigError, InvalidParameters, SessiontapeError

# Caps on what one template operation may build (the sandbox already caps range()).
MAX_REPEAT = 1 << 20  # items or characters made by `sequence * n`
MAX_EXPONENT = 4096  # n in `a ** n`

# The dummy conversation continuation() renders before the new messages.
DUMMY_USER = "\x00u"
DUMMY_REPLY = "\x00a"
_DUMMY = ({"role": "user", "content": DUMMY_USER}, {"role": "assistant", "content": DUMMY_REPLY})

# Names a message's reasoning goes under; templates read the first (transformers copies it).
_REASONING_FIELDS = ("reasoning_content", "thinking", "reasoning")


class _Sandbox(ImmutableSandboxedEnvironment):
    """Transformers' sandbox, stricter where it would only have printed nothing.

    Jinja's sandbox answers an unsafe attribute (``''.__class__``) with an undefined value
    that prints as ''; here it raises, so an attempt never passes silently. Repetition and
    powers are capped so a template cannot exhaust memory or CPU in one expression.
    """

    intercepted_binops = frozenset({"*", "**"})

    def unsafe_undefined(self, obj: Any, attribute: str) -> jinja2.Undefined:
        raise SecurityError(
            f"access to attribute {attribute!r} of a {type(obj).__name__!r} object is unsafe"
        )

    def call_binop(self, context: Any, op: str, left: Any, right: Any) -> Any:
        if op == "*":
            for seq, count in ((left, right), (right, left)):
                sized = isinstance(seq, str | list | tuple) and isinstance(count, int)
                if sized and len(seq) * count > MAX_REPEAT:
                    raise SecurityError(f"a repetition longer than {MAX_REPEAT} is refused")
            return operator.mul(left, right)
        if op == "**":
            if isinstance(right, int) and abs(right) > MAX_EXPONENT:
                raise SecurityError(f"an exponent above {MAX_EXPONENT} is refused")
            return operator.pow(left, right)
        return super().call_binop(context, op, left, right)


class _Generation(jinja2.ext.Extension):
    """``{% generation %}...{% endgeneration %}``: transformers marks assistant text with it;
    rendering keeps the body as is."""

    tags = {"generation"}

    def parse(self, parser: jinja2.parser.Parser) -> jinja2.nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        call = self.call_method("_body")
        return jinja2.nodes.CallBlock(call, [], [], body).set_lineno(lineno)

    def _body(self, caller: Callable[[], str]) -> str:
        return caller()


class _Namespace(jinja2.utils.Namespace):
    """``namespace()`` that refuses names starting with '_' (no reach into its internals)."""

    def __init__(*args: Any, **kwargs: Any) -> None:  # self comes in args, as in Namespace
        self, rest = args[0], args[1:]
        attrs = dict(*rest, **kwargs)
        for name in attrs:
            _Namespace._check(name)
        jinja2.utils.Namespace.__init__(self, attrs)

    def __setitem__(self, name: str, value: Any) -> None:
        _Namespace._check(name)
        jinja2.utils.Namespace.__setitem__(self, name, value)

    @staticmethod
    def _check(name: object) -> None:
        if isinstance(name, str) and name.startswith("_"):
            raise SecurityError(f"a namespace attribute may not start with '_': {name!r}")


def _tojson(
    value: Any,
    ensure_ascii: bool = False,
    indent: int | str | None = None,
    separators: tuple[str, str] | None = None,
    sort_keys: bool = False,
) -> str:
    """transformers' ``tojson``: plain ``json.dumps`` (Jinja's own escapes HTML)."""
    return json.dumps(
        value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
    )


def _raise_exception(message: object) -> None:
    """What a template calls to refuse a conversation (e.g. roles that do not alternate)."""
    raise InvalidParameters(f"chat template: {message}")


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


def _environment() -> _Sandbox:
    env = _Sandbox(
        trim_blocks=True, lstrip_blocks=True, extensions=[_Generation, jinja2.ext.loopcontrols]
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    env.globals["namespace"] = _Namespace
    return env


def _plain(value: Any) -> Any:
    """``value`` rebuilt from JSON types only, so a template sees no object with methods of
    its own; anything else becomes a placeholder naming its type."""
    if value is None or type(value) in (str, int, float, bool):
        return value
    if isinstance(value, str):
        return str.__str__(value)
    if isinstance(value, int):
        return int.__int__(value)
    if isinstance(value, float):
        return float.__float__(value)
    if isinstance(value, Mapping):
        return {_plain(k): _plain(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_plain(v) for v in value]
    return f"<{type(value).__name__}>"


def _message(message: Mapping[str, Any]) -> dict[str, Any]:
    """A message as transformers hands it to a template: keys whose value is None dropped,
    and its reasoning under both ``reasoning_content`` and ``thinking``."""
    if not isinstance(message, Mapping):
        raise InvalidParameters(f"a chat message must be an object, not {type(message).__name__}")
    plain = {str(k): _plain(v) for k, v in message.items() if v is not None}
    reasoning = next((plain[k] for k in _REASONING_FIELDS if k in plain), None)
    if reasoning is not None:
        plain = {"thinking": reasoning, **plain, "reasoning_content": reasoning}
    return plain


class JinjaChatTemplate:
    """A compiled chat template and the special token texts it may use."""

    def __init__(self, source: str, bos_token: str | None, eos_token: str | None) -> None:
        self.source = source
        self.bos_token = bos_token
        self.eos_token = eos_token
        self.sha256 = hashlib.sha256(source.encode("utf-8")).hexdigest()
        try:
            self._template = _environment().from_string(source)
        except jinja2.TemplateSyntaxError as exc:
            raise ConfigError(f"chat template: line {exc.lineno}: {exc.message}") from exc

    def render(self, messages: Sequence[Mapping[str, Any]], *, add_generation_prompt: bool) -> str:
        """The conversation as the model reads it, with its generation prompt if asked."""
        context: dict[str, Any] = {
            "messages": [_message(m) for m in messages],
            "add_generation_prompt": add_generation_prompt,
            "tools": None,
            "documents": None,
        }
        if self.bos_token is not None:
            context["bos_token"] = self.bos_token
        if self.eos_token is not None:
            context["eos_token"] = self.eos_token
        try:
            return self._template.render(context)
        except SessiontapeError:
            raise
        except jinja2.TemplateError as exc:
            raise InvalidParameters(f"chat template: {exc.message or exc}") from exc
        except Exception as exc:  # a template is code: whatever it hits is its failure
            raise InvalidParameters(
                f"chat template failed to render: {type(exc).__name__}: {exc}"
            ) from exc


def continuation(
    tpl: JinjaChatTemplate,
    messages: Sequence[Mapping[str, Any]],
    *,
    at_start: bool,
    after_generation: bool,
    eos_text: str | None,
) -> str:
    """The text one request's ``messages`` add to a session (see the module docstring)."""
    if at_start:
        return tpl.render(messages, add_generation_prompt=True)
    if not messages:
        raise InvalidParameters("no messages to add to the conversation")
    try:
        before = tpl.render(_DUMMY, add_generation_prompt=False)
    except InvalidParameters as exc:
        raise InvalidParameters(
            f"the chat template cannot continue a conversation: {exc.message}"
        ) from exc
    after = tpl.render([*_DUMMY, *messages], add_generation_prompt=True)
    if not after.startswith(before):
        raise InvalidParameters(
            "the chat template cannot continue a conversation: it renders earlier turns"
            " differently once more messages follow"
        )
    added = after[len(before) :]
    if not after_generation:
        return added
    return _closing(before, eos_text) + added


def _closing(rendered: str, eos_text: str | None) -> str:
    """What closes a generated assistant turn, less the EOS the model already wrote."""
    at = rendered.rfind(DUMMY_REPLY)
    if at < 0:
        raise InvalidParameters(
            "the chat template cannot continue a conversation: it leaves out the assistant's reply"
        )
    closing = rendered[at + len(DUMMY_REPLY) :]
    if eos_text:
        found = closing.find(eos_text)
        if found >= 0:
            closing = closing[found + len(eos_text) :]
    return closing


@functools.lru_cache(maxsize=8)
def _compiled(source: str, bos: str | None, eos: str | None) -> JinjaChatTemplate:
    return JinjaChatTemplate(source, bos, eos)


def prompt_text(chat: ChatFormat | None, prompt: str) -> str:
    """A one-message prompt as the served model reads a user's question.

    Rendered with the model's chat template and its generation prompt when the
    model has one (a chat model answers a question, instead of continuing its
    text); unchanged otherwise (the demo and reference engines).
    """
    if chat is None:
        return prompt
    tpl = _compiled(chat.template, chat.bos_token, chat.eos_token)
    return tpl.render([{"role": "user", "content": prompt}], add_generation_prompt=True)
