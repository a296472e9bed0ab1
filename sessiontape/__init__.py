"""sessiontape's Python client for the native HTTP API.

::

    from sessiontape import Client, AsyncClient, errors

See :mod:`sessiontape.client` and docs/clients.md.

This is also the package the server installs under (``sessiontape.core``,
``sessiontape.engines``, ...), and the server's install has no httpx: the client
classes are imported on first use, so importing ``sessiontape.core`` does not load them.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from sessiontape import errors

if TYPE_CHECKING:
    from sessiontape.client import AsyncClient, Client, Update

__all__ = ["AsyncClient", "Client", "Update", "errors"]

_CLIENT_NAMES = frozenset({"AsyncClient", "Client", "Update"})


def __getattr__(name: str) -> Any:
    if name in _CLIENT_NAMES:
        from sessiontape import client

        return getattr(client, name)
    raise AttributeError(f"module 'sessiontape' has no attribute {name!r}")
