"""gunicorn settings for the rstreamer web app: ``gunicorn -c webapp/gunicorn.conf.py``.

Every value can be overridden on the command line (``--bind``, ``--workers``, ``-k gevent``...)
or through ``GUNICORN_CMD_ARGS``; the app itself reads ``RSTREAMER_*`` (docs/webapp.md).
"""
import os
import sys
from typing import Any

wsgi_app = "webapp.app:create_app()"
bind = os.environ.get("GUNICORN_BIND", "127.0.0.1:8000")
workers = int(os.environ.get("WEB_CONCURRENCY", "2"))
# gthread: each request blocks one thread in BLPOP while the workers run the model, so a web
# process needs many threads, not many processes. gevent (-k gevent) scales further.
worker_class = "gthread"
threads = int(os.environ.get("GUNICORN_THREADS", "32"))
worker_connections = 1000  # gevent: concurrent requests per process
# A request waits at most RSTREAMER_TIMEOUT (20 s by default) for its answer.
timeout = 60
graceful_timeout = 30
keepalive = 5
# gunicorn 27's control socket has one default path per user, which several servers on one host
# would fight over; the app has no use for it.
control_socket_disable = True


def on_starting(server: Any) -> None:  # gunicorn's Arbiter (untyped)
    """Refuse to start, in one line and before any worker forks, when a setting of the app is
    invalid: workers that fail to build the app would only end the server with a traceback, and a
    broker URL that is not Redis's would fail every request."""
    from webapp.config import settings_or_exit

    settings_or_exit("rstreamer web app (gunicorn)")


def post_fork(server: Any, worker: Any) -> None:  # gunicorn's Arbiter and Worker (untyped)
    """Each worker gets its own Redis clients, even when the app was built in the master (--preload)."""
    app_module = sys.modules.get("webapp.app")
    if app_module is not None:
        app_module.after_fork()


def child_exit(server: Any, worker: Any) -> None:
    """Drop a dead worker's live gauges from the multiprocess metrics directory."""
    if os.environ.get("PROMETHEUS_MULTIPROC_DIR"):
        from prometheus_client import multiprocess

        multiprocess.mark_process_dead(worker.pid)
