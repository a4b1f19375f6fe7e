"""The one logging set-up: stderr, with the process's role and pid on every line.

Only process entry points call it: the CLI (``rstreamer``, ``rstreamer-worker``) and the
processes that the supervisor and a worker start (a spawned child begins with no logging
set-up of its own). Library modules only call ``logging.getLogger(__name__)``.
"""
from __future__ import annotations

import logging

FORMAT = "%(asctime)s %(levelname)s [{role} pid %(process)d] %(name)s: %(message)s"


def configure_logging(level: str | int, role: str) -> None:
    """Log at ``level`` to stderr; ``role`` (supervisor, worker 0 gpu 1, heartbeat) tags every line."""
    logging.basicConfig(level=level, format=FORMAT.format(role=role))
