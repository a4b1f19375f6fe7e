"""The contracts a user implements: :class:`ManagedModel` (batch in, batch out) and
:class:`GenerativeModel` (step by step). Pure: imports only ``rstreamer.errors``, never Redis.

``rstreamer.model.ManagedModel`` keeps the path it had before this became a package.
"""
from .generative import GenerativeModel, Step
from .managed import ManagedModel, ModelSpec, Predictor, resolve_model

__all__ = ["GenerativeModel", "ManagedModel", "ModelSpec", "Predictor", "Step", "resolve_model"]
