"""What ``rstreamer-worker`` checks before it starts a worker: the mistakes ``--check`` finds,
found without importing the model (the supervisor stays light: no torch, no CUDA context).

Each failure is a :class:`~rstreamer.errors.ConfigError` or
:class:`~rstreamer.errors.BrokerUnavailable` whose message is one line, so that a misspelt
class or an unreachable Redis stops the command at once with that line, instead of worker
processes crash-looping for 20 s with tracebacks.
"""
from __future__ import annotations

import ast
import difflib
import importlib.util
import logging
import time

from ..broker.connection import ping_broker, redacted
from ..errors import BrokerUnavailable, ConfigError
from ..model.managed import split_import_string

logger = logging.getLogger(__name__)


def check_model_name(ref: str) -> None:
    """Raise ConfigError when ``ref``'s module is missing, or when its source plainly does not
    define the name (a misspelt class), with the closest names it does define.

    Only what the source shows for certain is refused: a module that defines names dynamically
    (``__getattr__``, ``from x import *``, ``globals()``) or has no readable source passes, and
    its import is checked by the worker process itself.
    """
    module_name, attr = split_import_string(ref)
    try:
        spec = importlib.util.find_spec(module_name)
    except (ImportError, ValueError) as exc:
        raise ConfigError(f"cannot import {ref!r}: {exc}") from None
    if spec is None:
        raise ConfigError(f"cannot import {ref!r}: no module named {module_name!r}")
    names = _top_level_names(spec.origin)
    first = attr.split(".", 1)[0]
    if names is None or first in names:
        return
    close = difflib.get_close_matches(first, sorted(names), n=3)
    hint = f"; did you mean {' or '.join(repr(name) for name in close)}?" if close else ""
    raise ConfigError(f"cannot import {ref!r}: module {module_name!r} ({spec.origin}) defines no {first!r}{hint}")


def _top_level_names(origin: str | None) -> set[str] | None:
    """The names a module's source binds at top level; None when that cannot be known for sure."""
    if not origin or not origin.endswith(".py"):
        return None  # a namespace package, an extension module, a frozen one
    try:
        with open(origin, "rb") as source:
            tree = ast.parse(source.read(), origin)
    except (OSError, SyntaxError, ValueError):
        return None  # the worker's own import reports a syntax error better
    names: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Name) and node.id in ("globals", "vars", "exec", "setattr"):
            return None
        if isinstance(node, ast.ImportFrom) and any(alias.name == "*" for alias in node.names):
            return None
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            names.update((alias.asname or alias.name).split(".", 1)[0] for alias in node.names)
        elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
            names.add(node.id)
    # Every bound name anywhere in the file is accepted, a conservative superset of the top level.
    return None if "__getattr__" in names else names


def wait_for_broker(url: str, wait: float) -> None:
    """PING ``url``; while it does not answer, retry for up to ``wait`` seconds (0: once).

    Raises:
        ConfigError: the URL is not one rstreamer can connect with (never retried).
        BrokerUnavailable: Redis did not answer within ``wait`` seconds.
    """
    deadline = time.monotonic() + wait
    pause, logged = 0.25, False
    while True:
        try:
            ping_broker(url)
            return
        except BrokerUnavailable as exc:
            if time.monotonic() + pause > deadline:
                suffix = f" (waited {wait:g}s; --wait-for-redis)" if wait else ""
                raise BrokerUnavailable(f"{exc}{suffix}") from None
            if not logged:
                logger.warning("Redis at %s does not answer; waiting up to %gs for it", redacted(url), wait)
                logged = True
        time.sleep(pause)
        pause = min(pause * 2, 2.0)
