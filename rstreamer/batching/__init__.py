"""Pure batching policies: which items run together and in which order. Never imports Redis.

- ``batcher``: the one batching core (:class:`Batcher`, ``collect_batch``, answers and failures),
  shared by ThreadedStreamer, Streamer and the Redis worker.
- ``costing``: cost-aware batches (a cost budget beside count and latency).
- ``scheduler``: continuous batching of generative models (items join and leave between steps).
- ``priority``: priority levels and their weighted turns; ``quotas``: per-tenant token buckets.

May import: ``rstreamer.errors``, ``rstreamer.model``.
"""
from .batcher import Batcher, BatchHint, BatchPolicy, BatchStats, Failure, Outcome, collect_batch

__all__ = ["BatchHint", "BatchPolicy", "BatchStats", "Batcher", "Failure", "Outcome", "collect_batch"]
