"""The core: events, the log, the session model, the runtime (installed as ``sessiontape.core``)."""
