"""Developer tools: ``rstreamer bench``, ``demo``, ``chaos`` and the Redis capacity probe.

The library's core never imports this package; these tools import the core, the ``workers``
models and the ``webapp``.
"""
