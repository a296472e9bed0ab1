"""JSON Patch+: RFC 6902 plus an ``append`` op, with a generator and an applier.

Pure functions over JSON values (dict, list, str, int, float, bool, None).
Pointers follow RFC 6901 (``~1`` is ``/``, ``~0`` is ``~``; ``-`` names the
end of an array in ``add``). The extra op::

    {"op": "append", "path": "/text", "value": " more"}   # string: concatenate
    {"op": "append", "path": "/tokens", "value": 42}      # array: push one value

Usage::

    ops = diff(before, after)            # appends where strings/arrays grew
    assert apply_patch(before, ops) == after
    rfc = to_rfc6902(ops, after)         # the same change without ``append``

:func:`apply_patch` is all-or-nothing: it works on a copy and raises
:class:`sessiontape.core.errors.InvalidPatch` (the input untouched) on a malformed op, a
missing target or a failed ``test``.
"""

from __future__ import annotations

import copy
from collections.abc import Mapping, Sequence
from typing import Any

from sessiontape.core.errors import InvalidPatch

Op = dict[str, Any]

OPS = frozenset({"add", "remove", "replace", "move", "copy", "test", "append"})
_NEEDS_VALUE = frozenset({"add", "replace", "test", "append"})
_NEEDS_FROM = frozenset({"move", "copy"})


# -- pointers ---------------------------------------------------------------


def escape(token: str) -> str:
    return token.replace("~", "~0").replace("/", "~1")


def pointer(*tokens: str | int) -> str:
    return "".join("/" + escape(str(t)) for t in tokens)


def parse_pointer(ptr: str) -> list[str]:
    """RFC 6901 reference tokens of ``ptr`` ("" is the whole document)."""
    if not isinstance(ptr, str):
        raise InvalidPatch(f"pointer must be a string, got {type(ptr).__name__}")
    if ptr == "":
        return []
    if not ptr.startswith("/"):
        raise InvalidPatch(f"pointer {ptr!r} must be empty or start with '/'")
    out = []
    for raw in ptr[1:].split("/"):
        i = raw.find("~")
        while i != -1:
            if i + 1 >= len(raw) or raw[i + 1] not in "01":
                raise InvalidPatch(f"pointer {ptr!r}: '~' must be followed by 0 or 1")
            i = raw.find("~", i + 2)
        out.append(raw.replace("~1", "/").replace("~0", "~"))
    return out


def _index(token: str, length: int, ptr: str, *, allow_end: bool) -> int:
    if token == "-" and allow_end:
        return length
    # RFC 6901: decimal digits, no leading zeros, no sign
    if not token.isascii() or not token.isdigit() or (len(token) > 1 and token[0] == "0"):
        raise InvalidPatch(f"pointer {ptr!r}: {token!r} is not an array index")
    idx = int(token)
    if idx > length or (idx == length and not allow_end):
        raise InvalidPatch(f"pointer {ptr!r}: index {idx} is out of range (length {length})")
    return idx


def _child(container: Any, token: str, ptr: str) -> Any:
    if isinstance(container, dict):
        if token not in container:
            raise InvalidPatch(f"pointer {ptr!r}: no member {token!r}")
        return container[token]
    if isinstance(container, list):
        return container[_index(token, len(container), ptr, allow_end=False)]
    raise InvalidPatch(f"pointer {ptr!r}: cannot descend into a {_kind(container)}")


def resolve(doc: Any, ptr: str) -> Any:
    """The value ``ptr`` names in ``doc``; raises InvalidPatch when absent."""
    node = doc
    for token in parse_pointer(ptr):
        node = _child(node, token, ptr)
    return node


def _kind(v: Any) -> str:
    if v is None:
        return "null"
    if isinstance(v, bool):
        return "boolean"
    if isinstance(v, int | float):
        return "number"
    if isinstance(v, str):
        return "string"
    if isinstance(v, list):
        return "array"
    if isinstance(v, dict):
        return "object"
    return type(v).__name__


def json_equal(a: Any, b: Any) -> bool:
    """Equality as RFC 6902 ``test`` means it: booleans are not numbers, 1 == 1.0."""
    ka, kb = _kind(a), _kind(b)
    if ka != kb:
        return False
    if ka == "array":
        return len(a) == len(b) and all(json_equal(x, y) for x, y in zip(a, b, strict=True))
    if ka == "object":
        return a.keys() == b.keys() and all(json_equal(a[k], b[k]) for k in a)
    return bool(a == b)


# -- applying ---------------------------------------------------------------


def _check_op(op: Any, n: int) -> tuple[str, str]:
    if not isinstance(op, Mapping):
        raise InvalidPatch(f"operation {n} is not an object")
    name = op.get("op")
    if not isinstance(name, str) or name not in OPS:
        raise InvalidPatch(f"operation {n}: unknown op {name!r}")
    path = op.get("path")
    if not isinstance(path, str):
        raise InvalidPatch(f"operation {n} ({name}): 'path' must be a string")
    if name in _NEEDS_VALUE and "value" not in op:
        raise InvalidPatch(f"operation {n} ({name}): 'value' is required")
    if name in _NEEDS_FROM and not isinstance(op.get("from"), str):
        raise InvalidPatch(f"operation {n} ({name}): 'from' must be a string")
    return str(name), path


def _parent(doc: Any, ptr: str) -> tuple[Any, str]:
    tokens = parse_pointer(ptr)
    node = doc
    for token in tokens[:-1]:
        node = _child(node, token, ptr)
    if not isinstance(node, dict | list):
        raise InvalidPatch(f"pointer {ptr!r}: parent is a {_kind(node)}, not a container")
    return node, tokens[-1]


def _add(doc: Any, ptr: str, value: Any) -> Any:
    if ptr == "":
        return value
    parent, token = _parent(doc, ptr)
    if isinstance(parent, list):
        parent.insert(_index(token, len(parent), ptr, allow_end=True), value)
    else:
        parent[token] = value
    return doc


def _remove(doc: Any, ptr: str) -> tuple[Any, Any]:
    if ptr == "":
        raise InvalidPatch("cannot remove the whole document")
    parent, token = _parent(doc, ptr)
    if isinstance(parent, list):
        return doc, parent.pop(_index(token, len(parent), ptr, allow_end=False))
    if token not in parent:
        raise InvalidPatch(f"pointer {ptr!r}: no member {token!r}")
    return doc, parent.pop(token)


def _replace(doc: Any, ptr: str, value: Any) -> Any:
    if ptr == "":
        return value
    parent, token = _parent(doc, ptr)
    if isinstance(parent, list):
        parent[_index(token, len(parent), ptr, allow_end=False)] = value
    else:
        if token not in parent:
            raise InvalidPatch(f"pointer {ptr!r}: no member {token!r}")
        parent[token] = value
    return doc


def _append(doc: Any, ptr: str, value: Any) -> Any:
    target = resolve(doc, ptr)
    if isinstance(target, list):
        target.append(value)
        return doc
    if isinstance(target, str):
        if not isinstance(value, str):
            raise InvalidPatch(
                f"append to the string at {ptr!r} needs a string value, got {_kind(value)}"
            )
        return _replace(doc, ptr, target + value)
    raise InvalidPatch(f"append at {ptr!r}: target is a {_kind(target)}, not a string or array")


def apply_op(doc: Any, op: Mapping[str, Any], n: int = 0) -> Any:
    """Apply one op to ``doc`` in place where possible; returns the new root."""
    name, path = _check_op(op, n)
    if name == "add":
        return _add(doc, path, copy.deepcopy(op["value"]))
    if name == "remove":
        return _remove(doc, path)[0]
    if name == "replace":
        return _replace(doc, path, copy.deepcopy(op["value"]))
    if name == "append":
        return _append(doc, path, copy.deepcopy(op["value"]))
    if name == "test":
        if not json_equal(resolve(doc, path), op["value"]):
            raise InvalidPatch(f"operation {n} (test): value at {path!r} differs")
        return doc
    src = str(op["from"])
    if name == "copy":
        return _add(doc, path, copy.deepcopy(resolve(doc, src)))
    # move
    if path != src and path.startswith(src + "/"):
        raise InvalidPatch(f"operation {n} (move): cannot move {src!r} into its own child {path!r}")
    if path == src:
        resolve(doc, src)
        return doc
    doc, value = _remove(doc, src)
    return _add(doc, path, value)


def apply_patch(doc: Any, patch: Any) -> Any:
    """``doc`` with ``patch`` applied; ``doc`` itself is never modified."""
    if not isinstance(patch, Sequence) or isinstance(patch, str | bytes):
        raise InvalidPatch("a patch must be an array of operations")
    out = copy.deepcopy(doc)
    for n, op in enumerate(patch):
        out = apply_op(out, op, n)
    return out


# -- generating -------------------------------------------------------------


def diff(a: Any, b: Any, *, plus: bool = True, path: str = "") -> list[Op]:
    """Operations that turn ``a`` into ``b``.

    ``path`` is the pointer of ``a`` inside a larger document: the ops are
    then that document's (``diff(a, b, path="/x")`` patches ``{"x": a}``).

    With ``plus`` (the default) a string that grew by a suffix becomes one
    ``append`` and an array that grew at the end one ``append`` per new
    item; without it the same changes are ``replace`` and ``add .../-``.
    Unchanged subtrees are skipped by identity first, so a document built
    with structural sharing diffs in time proportional to what changed.
    Each path appears in at most one op.
    """
    out: list[Op] = []
    _diff(a, b, path, out, plus)
    return out


def _diff(a: Any, b: Any, path: str, out: list[Op], plus: bool) -> None:
    if a is b:
        return
    if isinstance(a, dict) and isinstance(b, dict):
        for k in a:
            if k not in b:
                out.append({"op": "remove", "path": path + "/" + escape(k)})
        for k, vb in b.items():
            sub = path + "/" + escape(k)
            if k in a:
                _diff(a[k], vb, sub, out, plus)
            else:
                out.append({"op": "add", "path": sub, "value": vb})
        return
    if isinstance(a, list) and isinstance(b, list):
        la, lb = len(a), len(b)
        for i in range(min(la, lb)):
            if a[i] is not b[i]:
                _diff(a[i], b[i], f"{path}/{i}", out, plus)
        if lb > la:
            for v in b[la:]:
                if plus:
                    out.append({"op": "append", "path": path, "value": v})
                else:
                    out.append({"op": "add", "path": path + "/-", "value": v})
        else:
            for i in range(la - 1, lb - 1, -1):
                out.append({"op": "remove", "path": f"{path}/{i}"})
        return
    if plus and isinstance(a, str) and isinstance(b, str) and len(b) > len(a) and b.startswith(a):
        out.append({"op": "append", "path": path, "value": b[len(a) :]})
        return
    if not json_equal(a, b):
        out.append({"op": "replace", "path": path, "value": b})


def to_rfc6902(ops: Sequence[Op], after: Any) -> list[Op]:
    """Rewrite ``append`` ops as plain RFC 6902 ops.

    ``after`` is the document the patch produces. A string ``append``
    becomes a ``replace`` with the final string, which is exact for patches
    from :func:`diff` (one op per path); an array ``append`` becomes ``add``
    at ``path/-``, which is exact for any patch.
    """
    out: list[Op] = []
    for op in ops:
        if op.get("op") != "append":
            out.append(op)
            continue
        if isinstance(op.get("value"), str) and isinstance(resolve(after, op["path"]), str):
            out.append({"op": "replace", "path": op["path"], "value": resolve(after, op["path"])})
        else:
            out.append({"op": "add", "path": op["path"] + "/-", "value": op["value"]})
    return out
