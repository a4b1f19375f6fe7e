"""The model contract a worker runs."""
from __future__ import annotations

import importlib
import inspect
import os
import sys
from collections.abc import Callable, Sequence
from typing import Any, Union

from ..errors import ConfigError


class ManagedModel:
    """A model built inside its worker process, after the GPU is chosen.

    Subclass it and implement :meth:`init_model` (load weights) and :meth:`predict`
    (a batch in, one output per input out). ``gpu_id`` is the device index the process was
    placed on, or None on CPU; ``CUDA_VISIBLE_DEVICES`` is already set when it is built.
    """

    oom_errors: tuple[type[BaseException], ...] = ()
    """Exceptions that mean "out of memory" besides torch's: the worker splits the batch and
    learns a lower cost cap instead of failing the callers."""

    def __init__(self, gpu_id: int | None = None) -> None:
        self.model: Any = None
        self.gpu_id = gpu_id
        self.set_gpu_id(gpu_id)

    @staticmethod
    def set_gpu_id(gpu_id: int | None = None) -> None:
        """Make only ``gpu_id`` visible to CUDA (service-streamer compatible)."""
        if gpu_id is not None:
            os.environ["CUDA_VISIBLE_DEVICES"] = str(gpu_id)

    def init_model(self, *args: Any, **kwargs: Any) -> None:
        """Load the model; called once per worker process with the model init args."""
        raise NotImplementedError

    def predict(self, batch: list[Any]) -> list[Any]:
        """Return one output per item of ``batch``, in order."""
        raise NotImplementedError

    def cost(self, item: Any) -> int:
        """What one input costs the model (e.g. its number of tokens), an integer >= 1.

        Override it to batch by cost: batches then close on ``max_batch_cost`` too, and items
        of similar cost batch together. The default, 1, batches by count.
        """
        return 1


CostFunction = Callable[[Any], int]
"""The cost of one input item (e.g. its number of tokens); 1 for every item by default."""

Predictor = Callable[[list[Any]], Sequence[Any]]
ModelSpec = Union[type[ManagedModel], Predictor, str]


def split_import_string(ref: str) -> tuple[str, str]:
    """``package.module:Name`` (or ``package.module.Name``) → ``(module, name)``."""
    module_name, sep, attr = ref.partition(":")
    if not sep:
        module_name, _, attr = ref.rpartition(".")
    if not module_name or not attr:
        raise ConfigError(f"expected 'package.module:Name', got {ref!r}")
    return module_name, attr


def import_from_working_directory() -> None:
    """Put the working directory first on the import path, as gunicorn and uvicorn do.

    A console script's path starts with its own folder, not the one it runs in, so
    ``rstreamer-worker mymodels:Model`` could not import ``mymodels.py`` next to the user.
    Worker processes started with ``spawn`` inherit the path.
    """
    cwd = os.getcwd()
    if cwd not in sys.path:
        sys.path.insert(0, cwd)


def import_string(ref: str) -> Any:
    """Import ``package.module:Name`` (or ``package.module.Name``)."""
    module_name, attr = split_import_string(ref)
    try:
        target: Any = importlib.import_module(module_name)
        for part in attr.split("."):
            target = getattr(target, part)
    except (ImportError, AttributeError) as exc:
        raise ConfigError(f"cannot import {ref!r}: {exc}") from exc
    return target


def model_ref(model: ModelSpec) -> ModelSpec:
    """An import string for ``model`` when it has one, so a child process imports its module
    only after CUDA_VISIBLE_DEVICES is set; otherwise ``model`` itself."""
    if isinstance(model, str):
        return model
    importable = inspect.isclass(model) or inspect.isfunction(model)  # a bool: narrows nothing
    if not importable:
        # A bound method, partial or callable instance: its names would import something else.
        return model
    module = getattr(model, "__module__", None)
    qualname = getattr(model, "__qualname__", "")
    if module and module != "__main__" and "<" not in qualname:
        return f"{module}:{qualname}"
    return model


def resolve_model(model: ModelSpec) -> Any:
    """The ManagedModel subclass or batch function ``model`` names (imported if a string).

    Raises:
        ConfigError: it does not import, or is neither a ManagedModel subclass nor a function.
    """
    target = import_string(model) if isinstance(model, str) else model
    if isinstance(target, type) and not issubclass(target, ManagedModel):
        raise ConfigError(f"{target.__name__} is not a ManagedModel subclass")
    if not isinstance(target, type) and not callable(target):
        raise ConfigError(f"{model!r} is neither a ManagedModel class nor a batch function")
    return target


def load_predictor(
    model: ModelSpec,
    gpu_id: int | None = None,
    init_args: Sequence[Any] | None = None,
    init_kwargs: dict[str, Any] | None = None,
) -> Predictor:
    """Build the batch predict function of a worker.

    ``model`` is a ManagedModel subclass (built with ``gpu_id``, then ``init_model``), a plain
    batch function, or an import string naming either.
    """
    target = resolve_model(model)
    if isinstance(target, type) and issubclass(target, ManagedModel):
        instance = target(gpu_id)
        instance.init_model(*(init_args or ()), **(init_kwargs or {}))
        return instance.predict
    if init_args or init_kwargs:
        raise ConfigError("model init args need a ManagedModel class, not a plain function")
    return target  # type: ignore[no-any-return]


def model_costing(predict: Predictor) -> tuple[CostFunction | None, tuple[type[BaseException], ...]]:
    """The cost function (None when the model does not define one) and extra out-of-memory
    errors of the ManagedModel behind ``predict``; ``(None, ())`` for a plain function."""
    owner = getattr(predict, "__self__", None)
    if not isinstance(owner, ManagedModel):
        return None, ()
    cost = owner.cost if type(owner).cost is not ManagedModel.cost else None
    return cost, tuple(owner.oom_errors)

