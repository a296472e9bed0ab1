"""The ``sessiontape`` subcommands, one module per group: ``serve``, ``sessions``
(ls, show), ``replay``, ``audit``, ``transfer`` (export, import) and
``maintenance`` (purge, db upgrade); ``common`` holds what they share. Each
module has the commands (``cmd_*``) and a ``register(subparsers)`` that adds
its parsers; :mod:`sessiontape.core.cli` wires them into one parser and runs ``main``.
"""
