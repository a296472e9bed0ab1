"""A generation: from a request to its committed runs (docs/architecture.md, "Generation").

- :mod:`~sessiontape.core.generation.request`: what a generation is asked to do
  (:class:`GenerateRequest`, the transport's :data:`RunHook`) and its first append;
- :mod:`~sessiontape.core.generation.generations`: the runtime's generation part
  (:class:`Generations`: ``runtime.generations``), which runs requests;
- :mod:`~sessiontape.core.generation.lifecycle`: one generation from its check and
  writer lock to its recorded end;
- :mod:`~sessiontape.core.generation.pipeline`: its token path (engine, committer, caller);
- :mod:`~sessiontape.core.generation.policy`: the run policy (how many steps a run holds,
  how long a commit lingers), pure;
- :mod:`~sessiontape.core.generation.scheduler`: who runs when (admission, priority gate);
- :mod:`~sessiontape.core.generation.running`: which sessions generate now;
- :mod:`~sessiontape.core.generation.host`: what a generation needs of the runtime.

Nothing is imported here, so the session cache can name the running generations
without importing the whole package.
"""
