"""How ``sessiontape`` writes its log lines: text for people, or JSON for collectors.

``[logging] format = "json"`` (or ``serve --log-format json``) writes one JSON
object per line: ``ts`` (ISO 8601, UTC), ``level``, ``logger``, ``msg``, plus
whatever the record carries in ``extra`` (the HTTP access log adds
``request_id``, ``session_id``, ``method``, ``route``, ``path``, ``status``,
``duration_s``, ``bytes`` and ``client``). Exceptions come as ``exc``, one string.
"""

from __future__ import annotations

import json
import logging
import sys
from datetime import UTC, datetime
from typing import Any, TextIO

FORMATS = ("text", "json")
_HANDLER = "sessiontape"
TEXT_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"
#: attributes every LogRecord has; anything else on a record came from ``extra=``
_STANDARD = set(vars(logging.makeLogRecord({}))) | {"message", "asctime", "taskName"}


class JsonFormatter(logging.Formatter):
    """One JSON object per record, fields from ``extra`` at the top level."""

    def format(self, record: logging.LogRecord) -> str:
        out: dict[str, Any] = {
            "ts": datetime.fromtimestamp(record.created, UTC).isoformat(timespec="milliseconds"),
            "level": record.levelname,
            "logger": record.name,
            "msg": record.getMessage(),
        }
        for key, value in vars(record).items():
            if key not in _STANDARD and not key.startswith("_"):
                out[key] = value
        if record.exc_info:
            out["exc"] = self.formatException(record.exc_info)
        return json.dumps(out, default=str, ensure_ascii=False)


def configure(level: str = "INFO", fmt: str = "text", stream: TextIO | None = None) -> None:
    """Send every logger's records to ``stream`` (stderr) as ``fmt`` at ``level``."""
    if fmt not in FORMATS:
        from sessiontape.core.errors import ConfigError

        raise ConfigError(f"logging.format must be one of {', '.join(FORMATS)}, got {fmt!r}")
    handler = logging.StreamHandler(stream or sys.stderr)
    handler.setFormatter(JsonFormatter() if fmt == "json" else logging.Formatter(TEXT_FORMAT))
    handler.set_name(_HANDLER)
    root = logging.getLogger()
    for old in [
        h for h in root.handlers if h.get_name() == _HANDLER
    ]:  # ours from an earlier call only
        root.removeHandler(old)
    root.addHandler(handler)
    root.setLevel(getattr(logging, level.upper(), logging.INFO))
