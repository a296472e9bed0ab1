"""The HTTP transport, by what it serves.

- :mod:`.native`: the native API (sessions, their documents, SSE feeds of JSON Patch+);
- :mod:`.openai`: the OpenAI-compatible API (``/v1/responses``, ``/v1/chat/completions``,
  ``/v1/models``);
- :mod:`.viewer`: the replay viewer's page and static files;
- :mod:`.server`: the plumbing under them (the app and its middleware, input limits, the
  error mapping, JSON encoding, the HTTP/1.1 protocol, the options);
- :mod:`.plugin`: ``HttpTransport``, the entry point ``sessiontape serve`` starts.
"""
