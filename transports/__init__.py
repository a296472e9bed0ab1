"""Transports: gRPC, HTTP (JSON API, SSE, viewer) and Nostr (installed as ``sessiontape.transports``)."""
