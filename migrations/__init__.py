"""Alembic environment and versions for the sessiontape schema."""
