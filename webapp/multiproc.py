"""Prometheus multiprocess mode for the web app under a server with several processes.

A gunicorn or uwsgi server runs the app in several processes, each with its own counters; without
multiprocess mode ``/metrics`` answers from whichever process takes the scrape (counters 1, 2, 1,
1 across scrapes). In multiprocess mode every process writes its values into files of one
directory (``PROMETHEUS_MULTIPROC_DIR``) and ``/metrics`` adds them up.

``webapp/gunicorn.conf.py`` calls :func:`prepare` when gunicorn reads it, in the master, before the
app or prometheus-client is imported anywhere (prometheus-client picks its mode when it is first
imported): a fresh directory per master, removed when the master exits (:func:`cleanup`); a dead
worker's live gauges are dropped (:func:`worker_exited`). A directory given in
``PROMETHEUS_MULTIPROC_DIR`` is used instead, emptied at start: one directory per master, never
shared. The app checks at start (:func:`check`) and says loudly why ``/metrics`` is per process
when it cannot be otherwise. This module imports nothing of prometheus-client at import time.
"""
from __future__ import annotations

import logging
import os
import shutil
import sys
import tempfile
from pathlib import Path

ENV = "PROMETHEUS_MULTIPROC_DIR"

logger = logging.getLogger("webapp")

_prepared: tuple[Path | None, bool] | None = None  # gunicorn reads its config again on HUP: set up once


def prepare() -> tuple[Path | None, bool]:
    """Set up the directory for this server; returns it and whether it was created here (then
    :func:`cleanup` removes it). ``(None, False)`` when it cannot be: the reason is logged and
    ``/metrics`` stays per process. Once per process: a reload keeps the directory and its values."""
    global _prepared
    if _prepared is None:
        _prepared = _prepare()
    return _prepared


def _prepare() -> tuple[Path | None, bool]:
    given = os.environ.get(ENV)
    if "prometheus_client" in sys.modules and not given:
        _log_error("prometheus-client was imported before the server set up multiprocess mode "
                   "(--preload of an app that imports it?): /metrics answers for one process only")
        return None, False
    try:
        if given:
            directory, created = Path(given), False
            directory.mkdir(parents=True, exist_ok=True)
            for stale in directory.glob("*.db"):  # a previous run's values would be added to ours
                stale.unlink()
        else:
            directory, created = Path(tempfile.mkdtemp(prefix="rstreamer-web-metrics-")), True
    except OSError as exc:
        _log_error(f"cannot prepare {ENV} ({exc}): /metrics answers for one process only")
        os.environ.pop(ENV, None)
        return None, False
    os.environ[ENV] = str(directory)
    return directory, created


def cleanup(directory: Path | None, created: bool) -> None:
    """Remove the directory :func:`prepare` created (a given one is emptied at the next start)."""
    if directory is not None and created:
        shutil.rmtree(directory, ignore_errors=True)


def worker_exited(pid: int) -> None:
    """Drop a dead worker process's live gauges (items in flight) from the directory."""
    if os.environ.get(ENV):
        from prometheus_client import multiprocess

        multiprocess.mark_process_dead(pid)


def check(server: str) -> None:
    """Log how ``/metrics`` adds up this server's processes; loudly when it cannot."""
    directory = os.environ.get(ENV)
    if directory:
        if not os.access(directory, os.W_OK):
            _log_error(f"{ENV}={directory} is not a writable directory: metrics cannot be recorded")
        return
    if _several_processes():
        _log_error(f"{server}: {ENV} is not set, so /metrics answers for whichever process takes the scrape; "
                   f"run gunicorn with -c webapp/gunicorn.conf.py (it sets multiprocess mode up), or point "
                   f"{ENV} at an empty directory of this server's own")


def _several_processes() -> bool:
    """Whether this process is one of several of a gunicorn or uwsgi server."""
    if "gunicorn" in os.environ.get("SERVER_SOFTWARE", ""):
        return True  # gunicorn's master sets it; its workers are forked from it
    uwsgi = sys.modules.get("uwsgi")
    return uwsgi is not None and int(getattr(uwsgi, "numproc", 1)) > 1


def _log_error(message: str) -> None:
    if not logger.handlers and not logging.getLogger().handlers:
        handler = logging.StreamHandler()
        handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s [web pid %(process)d] %(message)s"))
        logger.addHandler(handler)
    logger.error("metrics: %s", message)
