"""Run Alembic programmatically on a connection (used at start and by ``db upgrade``).

``sessiontape.core.log`` calls this; nothing in ``migrations`` imports ``core`` back.
"""

from __future__ import annotations

from pathlib import Path

from alembic import command
from alembic.config import Config
from sqlalchemy import MetaData
from sqlalchemy.engine import Connection

HERE = Path(__file__).resolve().parent


def alembic_config(
    connection: Connection | None = None, metadata: MetaData | None = None
) -> Config:
    """An Alembic config for this folder; ``metadata`` is the models' (for autogenerate)."""
    cfg = Config()
    cfg.set_main_option("script_location", str(HERE))
    if connection is not None:
        cfg.attributes["connection"] = connection
    if metadata is not None:
        cfg.attributes["target_metadata"] = metadata
    return cfg


def upgrade_connection(connection: Connection, revision: str = "head") -> None:
    """Upgrade the database behind ``connection`` (a sync connection) to ``revision``."""
    command.upgrade(alembic_config(connection), revision)


def current_revision(connection: Connection) -> str | None:
    from alembic.runtime.migration import MigrationContext

    return MigrationContext.configure(connection).get_current_revision()
