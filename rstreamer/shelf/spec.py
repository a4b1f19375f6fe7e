"""The shelf file: the models a fleet of shelf workers may serve, each under its own prefix.

A JSON object (see docs/shelf.md)::

    {"name": "default",
     "models": {"sentiment-fr": {"model": "pkg.mod:Class", "init_kwargs": {}, "batch_size": 32,
                                 "max_latency": 0.02}}}

Each key of ``models`` is a prefix, so clients do not change. It is validated eagerly and
completely when it is read: every error names the file, the model and the field.
"""
from __future__ import annotations

import hashlib
import json
import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..errors import ConfigError
from ..model.managed import split_import_string
from ..settings import WorkerSettings, parse_bytes, parse_cost_model_name
from ..wire.keys import DEFAULT_SHELF, validate_prefix, validate_shelf_name

TOP_KEYS = ("name", "models")
MODEL_KEYS = ("model", "init_args", "init_kwargs", "batch_size", "max_latency", "max_batch_cost", "cost_model",
              "load_seconds", "memory")
# What a model's entry may set of the worker's settings (the rest are the worker's own).
SETTINGS_KEYS = ("batch_size", "max_latency", "max_batch_cost", "cost_model")


class ShelfError(ConfigError):
    """The shelf file is unreadable or invalid; the message names the file, the model and the field."""


@dataclass(frozen=True)
class ShelfModel:
    """One model of the shelf: how to build it, and the batch settings it is served with.

    ``load_seconds`` and ``memory`` (bytes) are hints used until the fleet has measured a load;
    None (and None for a batch setting) takes the worker's own.
    """

    name: str
    model: str
    init_args: tuple[Any, ...] = ()
    init_kwargs: dict[str, Any] = field(default_factory=dict, hash=False)
    batch_size: int | None = None
    max_latency: float | None = None
    max_batch_cost: int | None = None
    cost_model: str | None = None
    load_seconds: float | None = None
    memory: int | None = None

    def settings(self, base: WorkerSettings) -> WorkerSettings:
        """The worker settings this model is served with: ``base`` with the model's own batch settings."""
        own = {key: getattr(self, key) for key in SETTINGS_KEYS if getattr(self, key) is not None}
        return base.replace(**own)

    def public(self) -> dict[str, Any]:
        """What the fleet publishes of this model (never its init arguments: they may name paths or secrets)."""
        shown = {key: getattr(self, key) for key in (*SETTINGS_KEYS, "load_seconds", "memory")}
        return {"model": self.model, **{key: value for key, value in shown.items() if value is not None}}


@dataclass(frozen=True)
class Shelf:
    """A validated shelf: its name (its workers share it in Redis) and its models, in file order."""

    name: str
    models: dict[str, ShelfModel] = field(hash=False)
    source: str = "shelf"

    def public(self) -> dict[str, Any]:
        """The shelf as it is published in Redis (see :meth:`ShelfModel.public`)."""
        return {"name": self.name, "models": {name: model.public() for name, model in self.models.items()}}

    @property
    def digest(self) -> str:
        """A short hash of the published shelf: workers of one shelf name should agree on it."""
        text = json.dumps(self.public(), sort_keys=True, separators=(",", ":"))
        return hashlib.sha256(text.encode()).hexdigest()[:12]


def load_shelf(path: str | Path, base: WorkerSettings | None = None) -> Shelf:
    """Read and validate the shelf file at ``path``; raises ShelfError.

    ``base``: the worker settings each model's own batch settings are checked against.
    """
    source = str(path)
    try:
        text = Path(path).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise ShelfError(f"{source}: cannot read the shelf file: {exc}") from None
    try:
        data = json.loads(text)
    except ValueError as exc:
        raise ShelfError(f"{source}: not valid JSON: {exc}") from None
    return parse_shelf(data, source, base)


def parse_shelf(data: Any, source: str = "shelf", base: WorkerSettings | None = None) -> Shelf:
    """Validate a decoded shelf file (see the module); raises ShelfError naming the model and field."""
    if not isinstance(data, dict):
        raise ShelfError(f"{source}: must be a JSON object with a \"models\" object")
    _no_unknown(data, TOP_KEYS, source)
    name = data.get("name", DEFAULT_SHELF)
    try:
        name = validate_shelf_name(name)
    except ConfigError as exc:
        raise ShelfError(f"{source}: field 'name': {exc}") from None
    entries = data.get("models")
    if not isinstance(entries, dict) or not entries:
        raise ShelfError(f"{source}: field 'models' must be a non-empty object of model name -> model entry")
    base = base or WorkerSettings()
    models = {model: _model(model, entry, source, base) for model, entry in entries.items()}
    canonical = [model.name for model in models.values()]
    if len(set(canonical)) != len(canonical):
        raise ShelfError(f"{source}: two models have the same prefix: {', '.join(sorted(canonical))}")
    return Shelf(name, {model.name: model for model in models.values()}, source)


def _model(name: str, entry: Any, source: str, base: WorkerSettings) -> ShelfModel:
    where = f"{source}: model {name!r}"
    try:
        prefix = validate_prefix(name)
    except ConfigError as exc:
        raise ShelfError(f"{where}: {exc}") from None
    if not isinstance(entry, dict):
        raise ShelfError(f"{where}: must be an object with at least a \"model\" field")
    _no_unknown(entry, MODEL_KEYS, where)
    fields = {key: _field(key, entry[key], where) for key in MODEL_KEYS if key in entry}
    if "model" not in fields:
        raise ShelfError(f"{where}: field 'model' is required (\"package.module:Class\")")
    model = ShelfModel(prefix, **fields)
    try:
        model.settings(base)
    except ConfigError as exc:
        raise ShelfError(f"{where}: {exc}") from None
    return model


def _field(key: str, value: Any, where: str) -> Any:
    try:
        return _CHECKS[key](value)
    except (ValueError, TypeError) as exc:
        raise ShelfError(f"{where}: field {key!r}: {exc}") from None


def _no_unknown(data: Mapping[str, Any], known: tuple[str, ...], where: str) -> None:
    unknown = sorted(set(data) - set(known))
    if unknown:
        raise ShelfError(f"{where}: unknown field {unknown[0]!r} (known fields: {', '.join(known)})")


# field checks: each returns the value to keep, or raises ValueError saying what is wrong ---------

def _reference(value: Any) -> str:
    if not isinstance(value, str):
        raise ValueError(f"must be a string \"package.module:Class\", got {value!r}")
    try:
        split_import_string(value)
    except ConfigError as exc:
        raise ValueError(str(exc)) from None
    return value


def _arguments(value: Any) -> tuple[Any, ...]:
    if not isinstance(value, list):
        raise ValueError(f"must be a JSON array, got {value!r}")
    return tuple(value)


def _keywords(value: Any) -> dict[str, Any]:
    if not isinstance(value, dict):
        raise ValueError(f"must be a JSON object, got {value!r}")
    return dict(value)


def _integer(minimum: int) -> Any:
    def check(value: Any) -> int:
        if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
            raise ValueError(f"must be an integer >= {minimum}, got {value!r}")
        return value
    return check


def _seconds(positive: bool) -> Any:
    def check(value: Any) -> float:
        ok = isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
        if not ok or value < 0 or (positive and value == 0):
            raise ValueError(f"must be a number of seconds {'> 0' if positive else '>= 0'}, got {value!r}")
        return float(value)
    return check


def _cost_model(value: Any) -> str:
    if not isinstance(value, str):
        raise ValueError(f"must be \"padded\" or \"sum\", got {value!r}")
    return parse_cost_model_name(value)


def _memory(value: Any) -> int:
    if isinstance(value, int) and not isinstance(value, bool) and value >= 0:
        return value
    if isinstance(value, str):
        return parse_bytes(value)
    raise ValueError(f"must be a number of bytes or a size such as \"2GiB\", got {value!r}")


_CHECKS: dict[str, Any] = {
    "model": _reference, "init_args": _arguments, "init_kwargs": _keywords, "batch_size": _integer(1),
    "max_latency": _seconds(positive=False), "max_batch_cost": _integer(0), "cost_model": _cost_model,
    "load_seconds": _seconds(positive=True), "memory": _memory,
}
