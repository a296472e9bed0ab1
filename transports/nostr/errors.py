"""The one place core errors become a D4 ``err`` (DDIP-001 result content).

``err`` is serialized JSON: ``{"code": ..., "message": ...}``, where ``code``
is the stable :attr:`sessiontape.core.errors.SessiontapeError.code` every transport
shares. Anything else is reported as ``internal`` without its text, so a
stack detail never reaches a public relay.
"""

from __future__ import annotations

from sessiontape.core.errors import SessiontapeError


def to_err(exc: BaseException) -> dict[str, str]:
    if isinstance(exc, SessiontapeError):
        return {"code": exc.code, "message": exc.message}
    return {"code": "internal", "message": "internal worker error"}
