"""The gRPC transport: one ``grpc.aio`` server hosting Evergreen, Salience and Kakeya.

See docs/protocols/grpc.md. ``server.py`` builds the server, ``plugin.py`` is
the ``sessiontape.transports`` entry point, ``status.py`` maps core errors to
gRPC status codes, ``gen/`` holds the committed generated code.
"""
