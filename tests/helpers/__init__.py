"""What several test modules share: plain helpers, and fixture plugins that tests/conftest.py
loads (``pytest_plugins``). A test module imports from here or gets a fixture by name; it never
imports another test module."""
