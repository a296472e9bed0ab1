"""The OpenAI-compatible API over sessions: ``/v1/responses``, ``/v1/chat/completions``, ``/v1/models``."""
