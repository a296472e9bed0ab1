"""A session's state: the fold of its events, and what keeps and reads it.

- :mod:`~sessiontape.core.session.state`: the fold (``apply``: one event into a
  :class:`SessionState`), forks' overlays;
- :mod:`~sessiontape.core.session.loader`: a state rebuilt from the log (a
  snapshot, then the events after it; a fork through its parent);
- :mod:`~sessiontape.core.session.snapshot`: states to and from their stored form;
- :mod:`~sessiontape.core.session.cache`: the runtime's cache of folded states
  (``runtime.sessions``), the session locks, commits that fold what they append,
  idle expiry;
- :mod:`~sessiontape.core.session.reads`: the runtime's reads of the log (``runtime.reads``).
"""
