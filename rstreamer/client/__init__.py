"""The web side over Redis: the sans-I/O call core (``core``), futures, the sync streamer with its
coalescer (``sync``, ``coalescer``), the asyncio streamer (``aio``) and streamed replies (``streams``).

May import: ``ops``, ``jobs``, ``wire`` and below; never ``rstreamer.worker``.
``rstreamer.client.RedisStreamer`` keeps the path it had before this became a package.
"""
from .future import RedisFuture
from .sync import RedisStreamer

__all__ = ["RedisFuture", "RedisStreamer"]
