"""The HTTP server's plumbing: the app and its middleware, the input boundary, the error mapping, JSON encoding, the HTTP/1.1 protocol, the options."""
