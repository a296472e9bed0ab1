"""The native HTTP API: sessions, their documents and SSE feeds of JSON Patch+, and the request bodies."""
