"""The dashboard's HTTP side: a static page, a JSON state endpoint, the dead-letter actions, and
``/metrics``: the queue gauges of every prefix as read from Redis (``rstreamer_queue_*``), which no
worker can export once every worker is gone.

Actions (replay, purge) exist only with ``allow_actions``; each POST must carry the session's
CSRF token in ``X-CSRF-Token``. A cross-site form cannot set that header, a cross-origin script
cannot read the token (no CORS headers are sent), and the Host check stops a DNS-rebinding page
from becoming "same origin" with the dashboard, whatever address it is bound to: a rebound page
sends its own host name, which is none of the names the dashboard answers to (421).
"""
from __future__ import annotations

import ipaddress
import re
import secrets
import urllib.parse
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST
from starlette.applications import Starlette
from starlette.concurrency import run_in_threadpool
from starlette.datastructures import Headers
from starlette.middleware import Middleware
from starlette.requests import Request
from starlette.responses import FileResponse, JSONResponse, Response
from starlette.routing import Mount, Route
from starlette.staticfiles import StaticFiles
from starlette.types import ASGIApp, Receive, Scope, Send

from ...errors import ConfigError
from ...wire.keys import Keys
from .. import deadletters
from ..metrics import QueueCollector
from .sampler import Sampler

STATIC = Path(__file__).parent / "static"
LETTER_ID = re.compile(r"[0-9]{1,20}-[0-9]{1,20}")
MAX_IDS = 1000
# The page loads only its own script and style: no inline code, nothing from elsewhere.
SECURITY_HEADERS = {
    "Content-Security-Policy": "default-src 'self'; img-src 'self' data:; frame-ancestors 'none'",
    "X-Content-Type-Options": "nosniff",
    "Referrer-Policy": "no-referrer",
}


LOOPBACK_NAMES = ("127.0.0.1", "localhost", "::1")


@dataclass(frozen=True)
class Options:
    """What the dashboard may do and where it may be reached.

    ``allowed_hosts``: the host names (or addresses) a request's ``Host`` may name, port aside;
    ``any_address``: the dashboard is bound to every address (0.0.0.0, ::), so a Host that is an
    IP address is accepted too (a browser that names an address is on that address's origin: no
    DNS rebinding can make it send one).
    """

    allow_actions: bool = False
    replay_timeout: float = 60.0
    allowed_hosts: tuple[str, ...] = LOOPBACK_NAMES
    any_address: bool = False


def host_allowed(header: str, options: Options) -> bool:
    """Whether a request's ``Host`` header names this dashboard (see :class:`Options`)."""
    try:
        host = urllib.parse.urlsplit(f"//{header}").hostname
    except ValueError:
        return False
    if not host:
        return False
    host = host.rstrip(".")
    if host in {name.lower().strip("[]").rstrip(".") for name in options.allowed_hosts}:
        return True
    try:
        ipaddress.ip_address(host)
    except ValueError:
        return False
    return options.any_address


class HostCheck:
    """Refuse (421 Misdirected Request) a request whose ``Host`` is not one the dashboard answers
    to: the guard against DNS rebinding, which reaches the dashboard under the attacker's name."""

    def __init__(self, app: ASGIApp, options: Options) -> None:
        self.app = app
        self.options = options

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        """Answer 421 to a request for a Host the dashboard does not answer to, else pass it on."""
        if scope["type"] in ("http", "websocket") and not host_allowed(Headers(scope=scope).get("host", ""),
                                                                        self.options):
            message = ("this Host is not a name the dashboard answers to (a guard against DNS rebinding); "
                       "start it with --allowed-host NAME to allow a name")
            await JSONResponse({"error": message}, status_code=421)(scope, receive, send)
            return
        await self.app(scope, receive, send)


def create_app(sampler: Sampler, options: Options) -> Starlette:
    """The Starlette app around a started ``sampler``."""
    csrf = secrets.token_urlsafe(32)
    registry = CollectorRegistry()
    registry.register(QueueCollector(lambda: list(sampler.state()["prefixes"]), lambda: sampler.state()["error"]))

    def index(request: Request) -> Response:
        return FileResponse(STATIC / "index.html", headers=SECURITY_HEADERS)

    def state(request: Request) -> Response:
        return JSONResponse({**sampler.state(), "interval": sampler.interval, "allow_actions": options.allow_actions})

    def scrape(request: Request) -> Response:
        return Response(generate_latest(registry), media_type=CONTENT_TYPE_LATEST)

    def session(request: Request) -> Response:
        return JSONResponse({"allow_actions": options.allow_actions, "csrf": csrf if options.allow_actions else None})

    async def action(request: Request) -> Response:
        refused = _refusal(request, options, csrf)
        if refused is not None:
            return refused
        try:
            keys = Keys(request.path_params["prefix"])
            ids = _letter_ids(await request.json())
        except (ValueError, ConfigError) as exc:
            return JSONResponse({"error": str(exc)}, status_code=400)
        done = await _run(sampler, request.path_params["verb"], keys, ids, options.replay_timeout)
        return JSONResponse({"done": done})

    routes = [
        Route("/", index), Route("/api/state", state), Route("/api/session", session), Route("/metrics", scrape),
        Route("/api/prefixes/{prefix}/dead/{verb:str}", action, methods=["POST"]),
        Mount("/static", StaticFiles(directory=STATIC), name="static"),
    ]
    return Starlette(routes=routes, middleware=[Middleware(HostCheck, options=options)])


def _refusal(request: Request, options: Options, csrf: str) -> Response | None:
    if not options.allow_actions:
        return JSONResponse({"error": "read-only dashboard (start it with --allow-actions)"}, status_code=403)
    if not secrets.compare_digest(request.headers.get("x-csrf-token", ""), csrf):
        return JSONResponse({"error": "missing or wrong CSRF token"}, status_code=403)
    if request.path_params["verb"] not in ("replay", "purge"):
        return JSONResponse({"error": "unknown action"}, status_code=404)
    return None


def _letter_ids(body: Any) -> list[str]:
    ids = body.get("ids") if isinstance(body, dict) else None
    if not isinstance(ids, list) or not 0 < len(ids) <= MAX_IDS:
        raise ValueError(f"body must be {{\"ids\": [...]}} with 1 to {MAX_IDS} dead-letter ids")
    if not all(isinstance(i, str) and LETTER_ID.fullmatch(i) for i in ids):
        raise ValueError("invalid dead-letter id")
    return ids


async def _run(sampler: Sampler, verb: str, keys: Keys, ids: list[str], replay_timeout: float) -> int:
    if verb == "replay":
        done = await run_in_threadpool(deadletters.replay, sampler.client, keys, ids, replay_timeout)
    else:
        done = await run_in_threadpool(deadletters.purge, sampler.client, keys, ids)
    await run_in_threadpool(sampler.sample)  # the next refresh shows the result
    return int(done)
