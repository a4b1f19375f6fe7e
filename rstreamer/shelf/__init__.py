"""Many models, one fleet: the shelf file (``spec``) and the placement policy (``policy``) that
shelf workers follow to load and evict models on demand, guided by the queue.

Pure: neither module imports Redis (the Redis side is :mod:`rstreamer.wire.shelf`, the worker
side :mod:`rstreamer.worker.shelf`). See docs/shelf.md.

May import: ``wire.keys`` (the names of prefixes and shelves), ``settings``, ``model``, ``errors``.
"""
from .policy import Decision, ModelEvidence, Policy, Resident, WorkerView, policy_for
from .spec import Shelf, ShelfError, ShelfModel, load_shelf, parse_shelf

__all__ = ["Decision", "ModelEvidence", "Policy", "Resident", "Shelf", "ShelfError", "ShelfModel", "WorkerView",
           "load_shelf", "parse_shelf", "policy_for"]
