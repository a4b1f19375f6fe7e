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
import importlib.machinery
import importlib.util
import logging
import pkgutil
import time
from collections.abc import Callable

from ..broker.connection import ping_broker, redacted
from ..errors import BrokerUnavailable, ConfigError
from ..model.managed import split_import_string

logger = logging.getLogger(__name__)


def check_model_name(ref: str) -> None:
    """Raise ConfigError when ``ref``'s module is missing, or when its source plainly does not
    define the name (a misspelt class), with the closest names it does define.

    Each message is one line with what to type instead: the closest module names for a misspelt
    module, the dotted form for a file path (``workers/embedding.py:Model``), the classes of the
    module for a missing or misspelt class (``workers.embedding:`` or ``workers.embedding``).
    Only what the source shows for certain is refused: a module that defines names dynamically
    (``__getattr__``, ``from x import *``, ``globals()``) or has no readable source passes, and
    its import is checked by the worker process itself.
    """
    _refuse_file_path(ref)
    module_name, attr = _split(ref)
    spec = _module_spec(ref, module_name)
    names = _top_level_names(spec.origin)
    first = attr.split(".", 1)[0]
    if names is None or first in names:
        return
    classes = _top_level_classes(spec.origin)
    hint = _closest(first, classes, _defined_names(spec.origin))
    raise ConfigError(f"cannot import {ref!r}: module {module_name!r} ({spec.origin}) defines no {first!r}{hint}")


def _refuse_file_path(ref: str) -> None:
    """A file path where a module name belongs: say the dotted name to use instead."""
    module_part, colon, attr = ref.partition(":")
    if "/" not in module_part and "\\" not in module_part and not module_part.endswith(".py"):
        return
    dotted = module_part.removesuffix(".py").replace("\\", "/").strip("/").replace("/", ".")
    raise ConfigError(f"cannot import {ref!r}: name the module with dots, as Python imports it, not as a file: "
                      f"{dotted}:{attr if colon else 'ClassName'} (run from the folder that holds "
                      f"{dotted.split('.', 1)[0]})")


def _split(ref: str) -> tuple[str, str]:
    """``(module, name)`` of ``ref``; a module named alone (``pkg.mod:`` or ``pkg.mod``) is refused
    with the classes it defines."""
    module_name, colon, attr = ref.partition(":")
    whole = module_name if colon else ref
    spec = _find_spec(whole) if (whole and not attr.strip()) or not colon else None
    if spec is not None:
        raise ConfigError(f"cannot import {ref!r}: {whole!r} is a module; name the model in it after a colon: "
                          f"{whole}:ClassName{_defined_classes(spec)}")
    return split_import_string(ref)


def _find_spec(module_name: str) -> importlib.machinery.ModuleSpec | None:
    try:
        return importlib.util.find_spec(module_name)
    except (ImportError, ValueError):
        return None


def _module_spec(ref: str, module_name: str) -> importlib.machinery.ModuleSpec:
    """The spec of ``module_name``, or ConfigError naming the first missing part and the closest
    existing modules (``worker.embedding`` → did you mean ``workers``?)."""
    try:
        spec = importlib.util.find_spec(module_name)
    except (ImportError, ValueError) as exc:
        spec, error = None, str(exc)
    else:
        error = ""
    if spec is not None:
        return spec
    parts = module_name.split(".")
    for depth in range(1, len(parts) + 1):
        if _find_spec(".".join(parts[:depth])) is None:
            parent = ".".join(parts[:depth - 1])
            missing = ".".join(parts[:depth])
            wanted = parts[depth - 1]
            candidates = [name for name in _submodules(parent) if wanted.startswith("_") or not name.startswith("_")]
            close = difflib.get_close_matches(wanted, candidates, n=3)
            hint = ("; did you mean " + " or ".join(repr(f"{parent}.{c}" if parent else c) for c in close) + "?"
                    if close else "")
            raise ConfigError(f"cannot import {ref!r}: no module named {missing!r}{hint}")
    raise ConfigError(f"cannot import {ref!r}: {error or f'no module named {module_name!r}'}")


def _submodules(parent: str) -> list[str]:
    """The modules directly under package ``parent`` (top-level modules on sys.path when empty)."""
    if not parent:
        return sorted({module.name for module in pkgutil.iter_modules()})
    spec = _find_spec(parent)
    locations = list(spec.submodule_search_locations or []) if spec is not None else []
    return sorted({module.name for module in pkgutil.iter_modules(locations)})


def _closest(name: str, classes: list[str], names: set[str]) -> str:
    """"; did you mean ...?" with the likeliest meant names (classes first), or the module's classes."""
    close = difflib.get_close_matches(name, classes, n=3)
    close += [c for c in classes if name.lower() in c.lower() and c not in close][:3 - len(close)]
    close += [c for c in difflib.get_close_matches(name, sorted(names), n=3) if c not in close][:3 - len(close)]
    if close:
        return f"; did you mean {' or '.join(repr(c) for c in close)}?"
    return f"; it defines the classes {', '.join(classes[:10])}" if classes else ""


def _defined_classes(spec: importlib.machinery.ModuleSpec | None) -> str:
    classes = _top_level_classes(spec.origin if spec is not None else None)
    return f" (it defines the classes {', '.join(classes[:10])})" if classes else ""


def _defined_names(origin: str | None) -> set[str]:
    """The classes, functions and variables a module's source defines at top level."""
    tree = _parse(origin)
    names: set[str] = set()
    for node in tree.body if tree is not None else []:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, (ast.Assign, ast.AnnAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            names.update(target.id for target in targets if isinstance(target, ast.Name))
    return names


def _top_level_classes(origin: str | None) -> list[str]:
    """The classes a module's source defines at top level, in source order (none when unreadable)."""
    tree = _parse(origin)
    return [node.name for node in tree.body if isinstance(node, ast.ClassDef)] if tree is not None else []


def _parse(origin: str | None) -> ast.Module | None:
    if not origin or not origin.endswith(".py"):
        return None  # a namespace package, an extension module, a frozen one
    try:
        with open(origin, "rb") as source:
            return ast.parse(source.read(), origin)
    except (OSError, SyntaxError, ValueError):
        return None  # the worker's own import reports a syntax error better


def _top_level_names(origin: str | None) -> set[str] | None:
    """The names a module's source binds at top level; None when that cannot be known for sure."""
    tree = _parse(origin)
    if tree is None:
        return None
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


def wait_for_broker(url: str, wait: float, tick: Callable[[], None] | None = None) -> None:
    """PING ``url``; while it does not answer, retry for up to ``wait`` seconds (0: once).

    ``tick`` is called before every attempt: waiting for Redis is being alive (see rstreamer.alive).

    Raises:
        ConfigError: the URL is not one rstreamer can connect with (never retried).
        BrokerUnavailable: Redis did not answer within ``wait`` seconds.
    """
    deadline = time.monotonic() + wait
    pause, logged = 0.25, False
    while True:
        if tick is not None:
            tick()
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
