"""The engine interface (:mod:`.interface`) and the worker process an engine runs in."""
