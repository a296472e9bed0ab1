"""A constraint on what a generation may produce: a JSON Schema, any JSON object, a
regular expression or a Lark grammar, applied by llguidance while sampling.

A :class:`Constraint` is a value: its kind and its canonical text (a schema as
canonical JSON, a regex or a grammar as given), and where the constrained text
begins (``start``: an absolute position, or None for where the generation begins).
It travels in :class:`~sessiontape.core.engine.SamplingParams`, so
``generation.started`` records it with its sha256 and re-execution reapplies it.

The engine turns it into a token mask (``engines/constrained.py``): llguidance
compiles the grammar against the engine's own tokenizer and, before each sampled
token, masks out every token the grammar does not allow. The grammar text here is
llguidance's (:attr:`Constraint.grammar`); nothing of a grammar engine is owned.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Literal, cast, get_args

from sessiontape.core.errors import InvalidConstraint

ConstraintKind = Literal["json_schema", "json_object", "regex", "grammar"]
KINDS: tuple[str, ...] = get_args(ConstraintKind)

#: what ``json_object`` allows: any JSON object
ANY_OBJECT = '{"type":"object"}'


#: the integers a schema's unbounded ``integer`` is generated within: the ones every JSON
#: reader holds exactly (an IEEE double), so a model repeating a digit ends its number
SAFE_INTEGER = 2**53 - 1


#: keywords whose values are data, not schemas: left as they are
_DATA_KEYWORDS = frozenset({"const", "enum", "default", "examples"})


def bounded_integers(node: Any) -> Any:
    """``node`` (a JSON Schema, or part of one) with every ``integer`` that lacks a bound
    given :data:`SAFE_INTEGER`'s; everything else as it is."""
    if isinstance(node, list):
        return [bounded_integers(v) for v in node]
    if not isinstance(node, Mapping):
        return node
    out = {k: v if k in _DATA_KEYWORDS else bounded_integers(v) for k, v in node.items()}
    kind = node.get("type")
    if kind == "integer" or (isinstance(kind, list) and "integer" in kind):
        if "minimum" not in node and "exclusiveMinimum" not in node:
            out["minimum"] = -SAFE_INTEGER
        if "maximum" not in node and "exclusiveMaximum" not in node:
            out["maximum"] = SAFE_INTEGER
    return out


def canonical_schema(schema: Mapping[str, Any]) -> str:
    """A JSON Schema as canonical JSON (compact, UTF-8): what is hashed. Keys keep their
    order: a schema's ``properties`` order is the order the output writes them in."""
    return json.dumps(schema, separators=(",", ":"), ensure_ascii=False)


@dataclass(frozen=True)
class Constraint:
    """What a generation's output must match (see the module docstring)."""

    kind: ConstraintKind
    #: the canonical text: a schema's canonical JSON, the regex, the Lark grammar
    text: str
    #: the absolute position where the constrained text begins (None: at the generation's
    #: start); the history from there on is fed to the grammar before the first token
    start: int | None = None

    @classmethod
    def json_schema(cls, schema: Mapping[str, Any]) -> Constraint:
        if not isinstance(schema, Mapping):
            raise InvalidConstraint("a JSON Schema constraint must be a JSON object")
        return cls("json_schema", canonical_schema(schema))

    @classmethod
    def json_object(cls) -> Constraint:
        return cls("json_object", ANY_OBJECT)

    @classmethod
    def regex(cls, pattern: str) -> Constraint:
        return cls("regex", pattern)

    @classmethod
    def lark(cls, grammar: str) -> Constraint:
        return cls("grammar", grammar)

    @classmethod
    def from_wire(cls, obj: Mapping[str, Any]) -> Constraint:
        """From a native wire's ``constraint``: exactly one of ``json_schema`` (an object),
        ``json_object`` (true), ``regex`` or ``grammar`` (strings), and optionally ``start``."""
        given = [k for k in KINDS if k in obj]
        unknown = set(obj) - {*KINDS, "start"}
        if len(given) != 1 or unknown:
            raise InvalidConstraint(
                "a constraint names exactly one of json_schema, json_object, regex, grammar"
                + (f" (unknown: {sorted(unknown)})" if unknown else "")
            )
        kind = given[0]
        value = obj[kind]
        if kind == "json_schema":
            if not isinstance(value, Mapping):
                raise InvalidConstraint("json_schema must be a JSON object")
            made = cls.json_schema(value)
        elif kind == "json_object":
            if value is not True:
                raise InvalidConstraint("json_object must be true")
            made = cls.json_object()
        else:
            if not isinstance(value, str) or not value:
                raise InvalidConstraint(f"{kind} must be a non-empty string")
            made = cls(cast(ConstraintKind, kind), value)
        start = obj.get("start")
        if start is not None:
            if not isinstance(start, int) or isinstance(start, bool) or start < 0:
                raise InvalidConstraint("constraint start must be an integer >= 0")
            made = cls(made.kind, made.text, start)
        made.check()
        return made

    @property
    def sha256(self) -> str:
        """The hash of the kind and the canonical text (what re-execution checks)."""
        return hashlib.sha256(f"{self.kind}\n{self.text}".encode()).hexdigest()

    @property
    def grammar(self) -> str:
        """The grammar in llguidance's form (what a matcher is built from)."""
        from llguidance import LLMatcher

        if self.kind in ("json_schema", "json_object"):
            try:
                schema = bounded_integers(json.loads(self.text))
                # compact JSON (no free whitespace a small model could fill a turn with);
                # keywords llguidance does not know are refused, not ignored
                return str(
                    LLMatcher.grammar_from_json_schema(
                        schema, defaults={"whitespace_flexible": False, "lenient": False}
                    )
                )
            except ValueError as exc:
                raise InvalidConstraint(f"bad JSON Schema: {exc}") from None
        if self.kind == "regex":
            return str(LLMatcher.grammar_from_regex(self.text))
        return str(LLMatcher.grammar_from_lark(self.text))

    def check(self) -> None:
        """Raise InvalidConstraint unless llguidance accepts the grammar."""
        from llguidance import LLMatcher

        error = LLMatcher.validate_grammar(self.grammar)
        if error:
            raise InvalidConstraint(f"bad {self.kind} constraint: {error}")

    def to_json(self) -> dict[str, Any]:
        """The form ``generation.started`` records (under ``params.constraint``)."""
        return {"kind": self.kind, "text": self.text, "sha256": self.sha256, "start": self.start}

    @classmethod
    def from_json(cls, obj: Mapping[str, Any]) -> Constraint:
        kind = obj.get("kind")
        if kind not in KINDS or not isinstance(obj.get("text"), str):
            raise InvalidConstraint(f"not a recorded constraint: {dict(obj)!r}")
        start = obj.get("start")
        made = cls(cast(ConstraintKind, kind), obj["text"], None if start is None else int(start))
        recorded = obj.get("sha256")
        if recorded is not None and recorded != made.sha256:
            raise InvalidConstraint("the recorded constraint's sha256 does not match its text")
        return made
