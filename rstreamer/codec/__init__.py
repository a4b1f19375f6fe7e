"""Payload encoding: msgpack with typed extension types, never pickle. Never imports Redis.

- ``core``: ``packb``/``unpackb``, decoding limits, :func:`register_type` for your own classes.
- ``std``: the standard values a caller expects back (tuple, set, big int, datetime, Decimal, UUID).
- ``arrays``: numpy arrays and torch tensors (torch imported only when one is met).

``rstreamer.codec.register_type`` keeps the path it had before this became a package.
"""
from .core import DEFAULT_MAX_BYTES, packb, packb_legacy, register_type, unpackb

__all__ = ["DEFAULT_MAX_BYTES", "packb", "packb_legacy", "register_type", "unpackb"]
