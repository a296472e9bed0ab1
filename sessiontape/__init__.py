"""sessiontape's Python client for the native HTTP API.

::

    from sessiontape import Client, AsyncClient, errors

See :mod:`sessiontape.client` and docs/clients.md.
"""

from sessiontape import errors
from sessiontape.client import AsyncClient, Client, Update

__all__ = ["AsyncClient", "Client", "Update", "errors"]
