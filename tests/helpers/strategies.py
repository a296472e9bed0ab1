"""Hypothesis strategies for hostile input: JSON an attacker can write, and protobuf messages by descriptor."""

from __future__ import annotations

import json
from typing import Any

from google.protobuf import any_pb2, message_factory
from google.protobuf.descriptor import Descriptor, FieldDescriptor
from hypothesis import strategies as st

#: every code point, lone surrogates included
ANY_CHAR = st.characters(min_codepoint=0, max_codepoint=0x10FFFF, exclude_categories=())
HOSTILE_TEXT = st.one_of(
    st.text(max_size=12),
    st.text(ANY_CHAR, max_size=6),
    st.sampled_from(
        ["\ud800", "a\udfffb", "\u00b2", "\u0663", "--1", "-0", "1e400", "NaN", "9" * 30, "", " 7 "]
    ),
)
HOSTILE_INT = st.one_of(
    st.integers(-3, 300),
    st.integers(),
    st.sampled_from(
        [2**31, 2**32, 2**53 + 1, 2**63 - 1, 2**63, 2**64 - 1, 2**64, -(2**63) - 1, 10**30, -1]
    ),
)
HOSTILE_FLOAT = st.one_of(
    st.floats(), st.sampled_from([float("nan"), float("inf"), -float("inf"), -0.0, 1e308])
)
SCALAR = st.one_of(st.none(), st.booleans(), HOSTILE_INT, HOSTILE_FLOAT, HOSTILE_TEXT)
HOSTILE_JSON: st.SearchStrategy[Any] = st.recursive(
    SCALAR,
    lambda inner: st.one_of(
        st.lists(inner, max_size=4), st.dictionaries(HOSTILE_TEXT, inner, max_size=4)
    ),
    max_leaves=12,
)


def encode(value: Any) -> bytes:
    """JSON as a hostile client writes it: NaN/Infinity literals, big integers, surrogate escapes."""
    return json.dumps(value, allow_nan=True).encode()


def plausible(schema: dict[str, Any]) -> st.SearchStrategy[Any]:
    """A value of the schema's type, small and mostly valid (so requests get past the first check)."""
    t = schema.get("type")
    if isinstance(t, list):
        t = t[0]
    if t == "integer":
        return st.integers(0, 8)
    if t == "number":
        return st.floats(0, 2)
    if t == "boolean":
        return st.booleans()
    if t == "string":
        enum = schema.get("enum")
        return st.sampled_from(enum) if enum else st.text(max_size=8)
    if t == "array":
        return st.lists(st.integers(0, 200), max_size=4)
    if t == "object":
        return st.dictionaries(st.text(max_size=5), SCALAR, max_size=3)
    return SCALAR


def body_for(schema: dict[str, Any] | None) -> st.SearchStrategy[bytes]:
    """A request body for an OpenAPI object schema: its fields plausible or hostile, extra fields, or junk."""
    props: dict[str, Any] = (schema or {}).get("properties", {})
    fields = st.fixed_dictionaries(
        {}, optional={k: st.one_of(plausible(v), HOSTILE_JSON) for k, v in props.items()}
    )
    with_extra = st.builds(
        lambda d, extra: {**d, **extra}, fields, st.dictionaries(HOSTILE_TEXT, SCALAR, max_size=2)
    )
    return st.one_of(
        fields.map(encode),
        fields.map(encode),
        with_extra.map(encode),
        HOSTILE_JSON.map(encode),
        st.binary(max_size=64),
        st.integers(1, 3000).map(lambda n: b'{"a":' + b"[" * n + b"]" * n + b"}"),
    )


# -- protobuf ----------------------------------------------------------------------

_INT_RANGES = {
    FieldDescriptor.TYPE_INT32: (-(2**31), 2**31 - 1),
    FieldDescriptor.TYPE_SINT32: (-(2**31), 2**31 - 1),
    FieldDescriptor.TYPE_SFIXED32: (-(2**31), 2**31 - 1),
    FieldDescriptor.TYPE_UINT32: (0, 2**32 - 1),
    FieldDescriptor.TYPE_FIXED32: (0, 2**32 - 1),
    FieldDescriptor.TYPE_INT64: (-(2**63), 2**63 - 1),
    FieldDescriptor.TYPE_SINT64: (-(2**63), 2**63 - 1),
    FieldDescriptor.TYPE_SFIXED64: (-(2**63), 2**63 - 1),
    FieldDescriptor.TYPE_UINT64: (0, 2**64 - 1),
    FieldDescriptor.TYPE_FIXED64: (0, 2**64 - 1),
}


def _scalar(field: FieldDescriptor, ids: list[str]) -> st.SearchStrategy[Any]:
    t = field.type
    if t in _INT_RANGES:
        lo, hi = _INT_RANGES[t]
        small = (
            st.integers(max(lo, 0), min(hi, 8))
            if "max_tokens" in field.name
            else st.integers(max(lo, -2), min(hi, 300))
        )
        return st.one_of(small, small, st.integers(lo, hi), st.sampled_from([lo, hi]))
    if t == FieldDescriptor.TYPE_FLOAT:
        return st.one_of(st.floats(0, 2, width=32), st.floats(width=32))
    if t == FieldDescriptor.TYPE_DOUBLE:
        return st.one_of(st.floats(0, 2), st.floats())
    if t == FieldDescriptor.TYPE_BOOL:
        return st.booleans()
    if t == FieldDescriptor.TYPE_STRING:
        base = st.text(max_size=10)
        return st.one_of(st.sampled_from(ids), base) if field.name.endswith("id") and ids else base
    if t == FieldDescriptor.TYPE_BYTES:
        return st.binary(max_size=32)
    if t == FieldDescriptor.TYPE_ENUM:
        return st.one_of(
            st.sampled_from([v.number for v in field.enum_type.values]), st.integers(-5, 2**31 - 1)
        )
    raise AssertionError(f"no strategy for field type {t}")


def message(descriptor: Descriptor, ids: list[str], depth: int = 2) -> st.SearchStrategy[Any]:
    """Random instances of the message type: any value in each field's wire range, NaN and huge ints included."""
    cls = message_factory.GetMessageClass(descriptor)
    if descriptor.full_name == "google.protobuf.Any":
        return st.builds(
            lambda url, v: any_pb2.Any(type_url=url, value=v),
            st.sampled_from(["type.googleapis.com/google.protobuf.Struct", "x/y", ""]),
            st.binary(max_size=24),
        )
    parts: dict[str, st.SearchStrategy[Any]] = {}
    for field in descriptor.fields:
        if field.message_type is not None:
            if field.message_type.GetOptions().map_entry or depth <= 0:
                continue
            one: st.SearchStrategy[Any] = st.deferred(
                lambda f=field: message(f.message_type, ids, depth - 1)
            )
        else:
            one = _scalar(field, ids)
        parts[field.name] = st.lists(one, max_size=3) if field.is_repeated else one

    def build(values: dict[str, Any]) -> Any:
        msg = cls()
        for name, value in values.items():
            field = descriptor.fields_by_name[name]
            if field.is_repeated:
                target = getattr(msg, name)
                for v in value:
                    target.add().CopyFrom(v) if field.message_type is not None else target.append(v)
            elif field.message_type is not None:
                getattr(msg, name).CopyFrom(value)
            else:
                setattr(msg, name, value)
        return msg

    return st.fixed_dictionaries({}, optional=parts).map(build)
