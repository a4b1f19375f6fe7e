"""The worker process and its fleet: the loop (``loop``: read -> batch -> predict -> reply -> ack),
its sources and records, the generative lane, reclaim of dead consumers, heartbeats (``liveness``,
``beater``), the supervisor of ``rstreamer-worker`` and its local liveness stamp (``alive``), GPU
placement and start-up checks.

May import: ``ops``, ``jobs``, ``wire`` and below; never ``rstreamer.client``.
``rstreamer.worker.RedisWorker`` keeps the path it had before this became a package.
"""
from .loop import RedisWorker

__all__ = ["RedisWorker"]
