"""The configuration machinery every command shares.

Each component declares its settings as a dataclass beside its own code (``SamplingParams`` in
``rollout/sampling.py``, ``OptimConfig`` in ``training/optim.py``, ...), with a docstring per field and
an ``errors()`` method that checks its own fields. A command's config is a tree of them rooted at a
subclass of ``RunConfig`` (``config/run.py``). ``config/loader.py`` merges schema defaults, a YAML
preset or file and dotlist overrides, then collects every ``errors()`` of the tree in one pass;
checks that span components live in one function per command.
"""
