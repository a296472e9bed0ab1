"""The ``nostr-relay`` package's configuration for a loopback relay: the tests' second
relay and the token-path benchmark's (bench/bench_generate.py)."""

from __future__ import annotations

from pathlib import Path
from typing import Any


def nostr_relay_config(
    workdir: Path, port: int, *, verify_signatures: bool = True
) -> dict[str, Any]:
    """A relay on ``127.0.0.1:port`` storing into ``workdir/relay.sqlite3``; it checks the
    events' signatures unless told not to (a relay that stores forged events)."""
    validators = ["nostr_relay.validators.is_not_too_large"]
    if verify_signatures:
        validators.append("nostr_relay.validators.is_signed")
    return {
        "DEBUG": False,
        "storage": {
            "sqlalchemy.url": f"sqlite+aiosqlite:///{workdir / 'relay.sqlite3'}",
            "num_concurrent_reqs": 4,
            "num_concurrent_adds": 1,
            "validators": validators,
        },
        "gunicorn": {"bind": f"127.0.0.1:{port}", "workers": 1, "loglevel": "warning"},
        "authentication": {"enabled": False},
        "message_timeout": 1800,
        "subscription_limit": 32,
        "max_limit": 6000,
        "hellthread_limit": 100,
    }
