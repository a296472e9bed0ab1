"""The HTTP transport: JSON API, SSE streams of JSON Patch+, the replay viewer, /metrics."""
