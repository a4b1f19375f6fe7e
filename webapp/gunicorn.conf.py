"""gunicorn settings for the rstreamer web app: ``gunicorn -c webapp/gunicorn.conf.py``.

Every value can be overridden on the command line (``--bind``, ``--workers``, ``-k gevent``...)
or through ``GUNICORN_CMD_ARGS``; the app itself reads ``RSTREAMER_*`` (docs/webapp.md).
"""
import os
import sys
from pathlib import Path
from typing import Any

try:
    from webapp import multiproc
except ImportError:  # a checkout that is not installed, run from elsewhere
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from webapp import multiproc

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

# Prometheus multiprocess mode, set up here: gunicorn reads this file in the master before the app
# (or prometheus-client) is imported, and the workers it forks inherit the directory. /metrics then
# adds up every worker process (webapp/multiproc.py).
_metrics_dir, _created_metrics_dir = multiproc.prepare()


def on_exit(server: Any) -> None:
    """Remove this master's metrics directory."""
    multiproc.cleanup(_metrics_dir, _created_metrics_dir)


def on_starting(server: Any) -> None:  # gunicorn's Arbiter (untyped)
    """Refuse to start, in one line and before any worker forks, when a setting of the app is
    invalid: workers that fail to build the app would only end the server with a traceback, and a
    broker URL that is not Redis's would fail every request. Then say where the metrics of every
    worker process are added up."""
    from webapp.config import settings_or_exit

    settings_or_exit("rstreamer web app (gunicorn)")
    if _metrics_dir is not None:
        server.log.info("Prometheus multiprocess metrics in %s", _metrics_dir)


def post_fork(server: Any, worker: Any) -> None:  # gunicorn's Arbiter and Worker (untyped)
    """Each worker gets its own Redis clients, even when the app was built in the master (--preload)."""
    app_module = sys.modules.get("webapp.app")
    if app_module is not None:
        app_module.after_fork()


def child_exit(server: Any, worker: Any) -> None:
    """Drop a dead worker's live gauges from the multiprocess metrics directory."""
    multiproc.worker_exited(worker.pid)
