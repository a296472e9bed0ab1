"""Find engines, transports and CLI commands by name, lazily.

Plugins register under entry-point groups (see pyproject.toml):
``sessiontape.engines``, ``sessiontape.transports`` and
``sessiontape.commands``. A name may also be a dotted ``module:attr`` path,
which lets tests and third parties plug in without installing anything.
Nothing is imported until asked for, so a missing optional dependency shows
up as a PluginNotFound naming what failed, not as a crash at import time.
"""

from __future__ import annotations

import importlib
from importlib.metadata import entry_points
from typing import Any

from sessiontape.core.errors import PluginNotFound

ENGINES = "sessiontape.engines"
TRANSPORTS = "sessiontape.transports"
COMMANDS = "sessiontape.commands"


def available(group: str) -> list[str]:
    return sorted({ep.name for ep in entry_points(group=group)})


def load(group: str, name: str) -> Any:
    """The object registered as ``name`` in ``group`` (or a ``module:attr`` path)."""
    target: str | None = None
    if ":" in name:
        target = name
    else:
        for ep in entry_points(group=group):
            if ep.name == name:
                target = ep.value
                break
    if target is None:
        known = ", ".join(available(group)) or "none"
        raise PluginNotFound(f"no {group.rsplit('.', 1)[-1][:-1]} named {name!r} (known: {known})")
    module_name, _, attr = target.partition(":")
    try:
        obj: Any = importlib.import_module(module_name)
    except ImportError as exc:
        raise PluginNotFound(f"cannot load {name!r} from {module_name}: {exc}") from exc
    for part in attr.split(".") if attr else ():
        try:
            obj = getattr(obj, part)
        except AttributeError as exc:
            raise PluginNotFound(f"{target} has no attribute {part!r}") from exc
    return obj


def options_class(group: str, name: str) -> type[Any] | None:
    """The options class a plugin declares (its ``options_class`` attribute: a frozen
    dataclass of :mod:`sessiontape.core.settings_framework`), or None when it declares none.

    Loads the plugin (raises PluginNotFound like :func:`load`); the configuration
    validates the plugin's table with the class before anything is built.
    """
    kind = getattr(load(group, name), "options_class", None)
    return kind if isinstance(kind, type) else None
