"""Typed settings: a frozen dataclass per configuration section, validated strictly.

A section is a frozen dataclass whose fields are its options, each declared
with :func:`option`: its one default, a line of documentation and its bounds::

    @dataclass(frozen=True)
    class HttpSettings:
        listen: str = option("127.0.0.1:8080", "HOST:PORT to serve on", check=host_port)
        ring: int = option(4096, "patches a live feed keeps for fast resume", ge=1)

:func:`load_section` builds one from a TOML table. An unknown key is refused
with the nearest known name; a value of the wrong type is refused with what
was expected and what came (no coercion from strings: ``"12"`` is not an
integer; an integer is a number); bounds, choices and checks are applied.
Every refusal is a :class:`~sessiontape.core.errors.ConfigError` that names
``section.key``. :func:`markdown_table` renders a section's options for
docs/configuration.md, and a test holds that page to the classes.
"""

from __future__ import annotations

import dataclasses
import difflib
import json
import math
import os
import types
from collections.abc import Callable, Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any, TypeVar, Union, get_args, get_origin, get_type_hints

from sessiontape.core.errors import ConfigError

T = TypeVar("T")
#: a check on a value of the right type: an error phrase ("must be HOST:PORT"), or None when fine
Check = Callable[[Any], str | None]


def option(
    default: Any = dataclasses.MISSING,
    doc: str = "",
    *,
    factory: Callable[[], Any] | None = None,
    ge: float | None = None,
    gt: float | None = None,
    le: float | None = None,
    choices: Sequence[Any] | None = None,
    check: Check | None = None,
    shown: str | None = None,
    repr: bool = True,
) -> Any:
    """A settings field: its default (or ``factory``), what it does, and what it accepts.

    ``ge``/``gt``/``le`` bound every number in the value; ``choices`` lists the values
    allowed; ``check`` tests the value further; ``shown`` is the default as the docs
    say it where the value is computed (``None`` standing for "the model's", say).
    """
    meta = {
        "doc": doc,
        "ge": ge,
        "gt": gt,
        "le": le,
        "choices": None if choices is None else tuple(choices),
        "check": check,
        "shown": shown,
    }
    if factory is not None:
        return dataclasses.field(default_factory=factory, metadata=meta, repr=repr)
    return dataclasses.field(default=default, metadata=meta, repr=repr)


def nearest(name: str, known: Iterable[str]) -> str | None:
    """The known name closest to a misspelled one, if any is close."""
    found = difflib.get_close_matches(name, sorted(known), n=1)
    return found[0] if found else None


def unknown(kind: str, name: str, known: Iterable[str], where: str) -> ConfigError:
    """``unknown key `listn` in [transports.http]; did you mean `listen`?``"""
    names = sorted(known)
    near = nearest(name, names)
    hint = f"did you mean `{near}`?" if near else f"known: {', '.join(names) or 'none'}"
    return ConfigError(f"unknown {kind} `{name}` in {where}; {hint}")


def load_section(
    cls: type[T],
    raw: Mapping[str, Any] | T | None,
    section: str,
    *,
    texts: Mapping[str, str] | None = None,
) -> T:
    """``raw`` (a TOML table; None for all defaults) as ``cls``, or ConfigError.

    ``texts`` maps a dotted key to the string the environment gave it: where a
    string option got a value that parsed as a TOML number or boolean
    (``SESSIONTAPE_AUTH__TOKEN=123``), the string is taken as it was.
    """
    if isinstance(raw, cls):
        return raw
    if raw is None:
        raw = {}
    if not isinstance(raw, Mapping):
        raise ConfigError(f"[{section}] must be a table, got {_got(raw)}")
    fields = {f.name: f for f in dataclasses.fields(cls) if f.init}  # type: ignore[arg-type]
    for key in raw:
        if key not in fields:
            raise unknown("key", str(key), fields, f"[{section}]")
    hints = _hints(cls)
    values: dict[str, Any] = {}
    for name, f in fields.items():
        where = f"{section}.{name}"
        if name in raw:
            try:
                values[name] = _value(raw[name], hints[name], f.metadata, where, texts or {})
            except _Mismatch as exc:  # as the ConfigError it is, not the private class
                raise ConfigError(exc.message) from None
        elif f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING:
            raise ConfigError(f"[{section}] needs `{name}`")
    try:
        return cls(**values)
    except ConfigError:
        raise
    except (TypeError, ValueError) as exc:  # a __post_init__ that refuses a combination
        raise ConfigError(f"[{section}]: {exc}") from exc


def _hints(cls: type[Any]) -> dict[str, Any]:
    return get_type_hints(cls, include_extras=False)


class _Mismatch(ConfigError):
    """The value at ``where`` is not of the type asked for (a union tries its next arm)."""

    def __init__(self, where: str, tp: Any, value: Any) -> None:
        super().__init__(f"{where} must be {describe(tp)}, got {_got(value)}")
        self.where = where


def _value(
    value: Any, tp: Any, meta: Mapping[str, Any], where: str, texts: Mapping[str, str]
) -> Any:
    if not isinstance(value, str) and where in texts and _accepts_str(tp):
        value = texts[where]
    choices = meta.get("choices")
    if choices is not None and value is not None and not _among(value, choices):
        key = where.rpartition(".")[2]
        listed = ", ".join(str(c) for c in choices)
        raise ConfigError(f"unknown {key} {str(value)!r}: {where} must be one of {listed}")
    out = _coerce(value, tp, where, meta)
    check: Check | None = meta.get("check")
    if check is not None and out is not None and (problem := check(out)):
        raise ConfigError(f"{where} {problem}, got {value!r}")
    return out


def _among(value: Any, choices: Sequence[Any]) -> bool:
    return any(type(value) is type(c) and value == c for c in choices)


def _accepts_str(tp: Any) -> bool:
    if tp is str or tp is Path or tp is Any:
        return True
    return _is_union(tp) and any(_accepts_str(arm) for arm in get_args(tp))


def _is_union(tp: Any) -> bool:
    return get_origin(tp) in (Union, types.UnionType)


def _coerce(value: Any, tp: Any, where: str, meta: Mapping[str, Any]) -> Any:
    """``value`` as ``tp`` (bounds in ``meta`` checked on every number), or _Mismatch."""
    origin, args = get_origin(tp), get_args(tp)
    if tp is Any:
        return value
    if _is_union(tp):
        return _coerce_union(value, tp, where, meta)
    if tp is bool:
        if not isinstance(value, bool):
            raise _Mismatch(where, tp, value)
        return value
    if tp is int or tp is float:
        return _number(value, tp, where, meta)
    if tp is str:
        if not isinstance(value, str):
            raise _Mismatch(where, tp, value)
        return value
    if tp is Path:
        if not isinstance(value, str | os.PathLike):
            raise _Mismatch(where, tp, value)
        return Path(value)
    if origin is tuple and len(args) == 2 and args[1] is Ellipsis:
        if not isinstance(value, list | tuple):
            raise _Mismatch(where, tp, value)
        return tuple(_coerce(v, args[0], f"{where}[{i}]", meta) for i, v in enumerate(value))
    if origin in (dict, Mapping) or tp in (dict, Mapping):
        if not isinstance(value, Mapping):
            raise _Mismatch(where, tp, value)
        item = args[1] if len(args) == 2 else Any
        return {str(k): _coerce(v, item, f"{where}.{k}", meta) for k, v in value.items()}
    if dataclasses.is_dataclass(tp) and isinstance(tp, type):
        if not isinstance(value, Mapping):
            raise _Mismatch(where, tp, value)
        return load_section(tp, value, where)
    raise TypeError(f"{where}: settings cannot hold a {tp!r}")  # a class declared wrong


def _coerce_union(value: Any, tp: Any, where: str, meta: Mapping[str, Any]) -> Any:
    arms = [a for a in get_args(tp) if a is not type(None)]
    if value is None and len(arms) < len(get_args(tp)):
        return None
    deeper: ConfigError | None = None
    for arm in arms:
        try:
            return _coerce(value, arm, where, meta)
        except _Mismatch as exc:
            if exc.where != where:  # the container fit, an item in it did not: say which
                deeper = exc
        except ConfigError as exc:  # the right type, out of bounds
            deeper = exc
    raise deeper or _Mismatch(where, tp, value)


def _number(value: Any, tp: type[Any], where: str, meta: Mapping[str, Any]) -> Any:
    ok = int if tp is int else int | float
    if isinstance(value, bool) or not isinstance(value, ok):
        raise _Mismatch(where, tp, value)
    if tp is float:
        try:
            value = float(value)
        except OverflowError:  # an integer past the float range
            value = math.inf
        if not math.isfinite(value):
            raise ConfigError(f"{where} must be a finite number, got {value!r}")
    ge, gt, le = meta.get("ge"), meta.get("gt"), meta.get("le")
    for limit, fails, sign in ((ge, value < (ge or 0), ">="), (gt, value <= (gt or 0), ">")):
        if limit is not None and fails:
            raise ConfigError(f"{where} must be {sign} {_num(limit)}, got {value!r}")
    if le is not None and value > le:
        raise ConfigError(f"{where} must be <= {_num(le)}, got {value!r}")
    return value


def _got(value: Any) -> str:
    return f"{value!r} ({type(value).__name__})"


def _num(x: float) -> str:
    return str(int(x)) if float(x).is_integer() else str(x)


def describe(tp: Any) -> str:
    """What a type asks for, as an error message says it: ``an integer``, ``a list of strings``."""
    if _is_union(tp):
        arms = [describe(a) for a in get_args(tp) if a is not type(None)]
        return " or ".join(arms)
    names = {
        bool: "a boolean",
        int: "an integer",
        float: "a number",
        str: "a string",
        Path: "a path (a string)",
        Any: "any value",
    }
    if tp in names:
        return names[tp]
    origin, args = get_origin(tp), get_args(tp)
    if origin is tuple:
        return f"a list of {_plural(args[0])}"
    return "a table"


def _plural(tp: Any) -> str:
    one = describe(tp)
    plural = {
        "a boolean": "booleans",
        "an integer": "integers",
        "a number": "numbers",
        "a string": "strings",
        "a path (a string)": "paths",
        "a table": "tables",
    }
    return plural.get(one, one)


# -- documentation ------------------------------------------------------------


def type_name(tp: Any) -> str:
    """A type as the docs' tables name it: ``integer``, ``list of strings``, ``number or table``."""
    if _is_union(tp):
        return " or ".join(type_name(a) for a in get_args(tp) if a is not type(None))
    text = describe(tp)
    for article in ("a ", "an "):
        if text.startswith(article):
            return text[len(article) :].replace(" (a string)", "")
    return text


def toml_value(value: Any) -> str:
    """A default as TOML writes it."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, str | Path):
        return json.dumps(str(value))
    if isinstance(value, list | tuple):
        return "[" + ", ".join(toml_value(v) for v in value) + "]"
    if isinstance(value, Mapping):
        return "{" + ", ".join(f"{k} = {toml_value(v)}" for k, v in value.items()) + "}"
    return repr(value)


def _default(f: dataclasses.Field[Any]) -> Any:
    if f.default_factory is not dataclasses.MISSING:
        return f.default_factory()
    return None if f.default is dataclasses.MISSING else f.default


def _accepts(f: dataclasses.Field[Any]) -> str:
    m = f.metadata
    parts = []
    if m.get("choices"):
        parts.append(" \\| ".join(f"`{c}`" for c in m["choices"]))
    for bound, sign in (("gt", ">"), ("ge", ">="), ("le", "<=")):
        if m.get(bound) is not None:
            parts.append(f"{sign} {_num(m[bound])}")
    return ", ".join(parts)


def markdown_table(cls: type[Any]) -> str:
    """The options of a settings class as a Markdown table (docs/configuration.md)."""
    hints = _hints(cls)
    rows = ["| option | type | default | accepts | meaning |", "|---|---|---|---|---|"]
    for f in dataclasses.fields(cls):
        if not f.init:
            continue
        shown = f.metadata.get("shown")
        if shown is not None:
            default = shown
        elif f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING:
            default = "required"
        else:
            value = _default(f)
            default = "unset" if value is None else f"`{toml_value(value)}`"
        doc = str(f.metadata.get("doc", "")).replace("|", "\\|")
        rows.append(
            f"| `{f.name}` | {type_name(hints[f.name])} | {default} | {_accepts(f)} | {doc} |"
        )
    return "\n".join(rows)
