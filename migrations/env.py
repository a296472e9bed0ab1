"""Alembic environment: runs on the connection handed in by migrations.runner."""

from __future__ import annotations

from alembic import context

from core.log.schema import metadata

connection = context.config.attributes.get("connection")
if connection is None:
    raise RuntimeError("run migrations through `sessiontape db upgrade` (migrations.runner)")

context.configure(connection=connection, target_metadata=metadata, render_as_batch=True)
with context.begin_transaction():
    context.run_migrations()
