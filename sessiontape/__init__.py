"""sessiontape's Python client: ``from sessiontape import Client, AsyncClient``.

See :mod:`sessiontape.client` and docs/clients.md.
"""
