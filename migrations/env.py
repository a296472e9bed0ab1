"""Alembic environment: runs on the connection handed in by sessiontape.migrations.runner.

It imports nothing of the application: ``sessiontape.core.log`` runs the migrations, so
the dependency is one way. A caller that needs the models' metadata (to
autogenerate or compare) passes it in as ``target_metadata``.
"""

from __future__ import annotations

from alembic import context

connection = context.config.attributes.get("connection")
if connection is None:
    raise RuntimeError(
        "run migrations through `sessiontape db upgrade` (sessiontape.migrations.runner)"
    )

context.configure(
    connection=connection,
    target_metadata=context.config.attributes.get("target_metadata"),
    render_as_batch=True,
)
with context.begin_transaction():
    context.run_migrations()
