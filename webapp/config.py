"""The web app's settings, read once from ``RSTREAMER_*`` variables."""
from __future__ import annotations

import logging
import sys
from dataclasses import dataclass, field
from typing import Any

from rstreamer.broker.connection import normalize_broker_url, parse_broker_url, redacted
from rstreamer.client.gate import NO_WORKER_GRACE, WorkerGate
from rstreamer.errors import ConfigError
from rstreamer.settings import DEFAULT_REDIS_URL, ClientSettings, EnvSettings, WorkerSettings
from rstreamer.wire.keys import validate_prefix

from .openai.config import OpenAIConfig

logger = logging.getLogger("webapp")

DEFAULT_MAX_BODY = 16 * 1024 * 1024
# Long enough for a crashed worker to be restarted and reload its model before calls are refused.
DEFAULT_NO_WORKER_GRACE = NO_WORKER_GRACE


@dataclass(frozen=True)
class WebConfig(EnvSettings):
    """What a web process needs: the broker, the prefix, call limits and the request-body limit.

    Each field comes from ``RSTREAMER_<FIELD>`` (``RSTREAMER_REDIS_URL``, ``RSTREAMER_PREFIX``,
    ``RSTREAMER_MAX_BODY`` in bytes); ``client`` carries the call limits of ClientSettings
    (``RSTREAMER_TIMEOUT``, ``RSTREAMER_MAX_QUEUE``...); ``dead_after`` is the workers'
    liveness window (``RSTREAMER_DEAD_AFTER``, as the workers read it), used by ``/readyz``.
    ``no_worker_grace`` (``RSTREAMER_NO_WORKER_GRACE``): seconds without a live worker on the
    prefix after which ``/predict`` answers 503 at once. ``prefix_from_default``: no prefix was
    configured, so ``default`` is used (logged loudly). ``openai``: the settings of the ``/v1``
    routes (webapp.openai.config.OpenAIConfig: model names, API keys, the Batch API's files).
    """

    redis_url: str = DEFAULT_REDIS_URL
    prefix: str = ""
    client: ClientSettings = field(default_factory=ClientSettings)
    max_body: int = DEFAULT_MAX_BODY
    dead_after: float = WorkerSettings.dead_after
    no_worker_grace: float = DEFAULT_NO_WORKER_GRACE
    prefix_from_default: bool = False
    openai: OpenAIConfig = field(default_factory=OpenAIConfig)

    def __post_init__(self) -> None:
        # Parsed now (no connection): a URL no client can use would fail every request with a 500.
        try:
            parse_broker_url(self.redis_url)
        except ConfigError as exc:
            raise ConfigError(f"the broker URL (RSTREAMER_REDIS_URL): {exc}") from None
        object.__setattr__(self, "redis_url", normalize_broker_url(self.redis_url))
        object.__setattr__(self, "prefix_from_default", self.prefix_from_default or not self.prefix)
        object.__setattr__(self, "prefix", validate_prefix(self.prefix))
        if self.max_body < 1:
            raise ConfigError(f"max_body must be > 0, got {self.max_body!r}")
        if not self.no_worker_grace >= 0:
            raise ConfigError(f"no_worker_grace must be >= 0, got {self.no_worker_grace!r}")

    @classmethod
    def from_env(cls, **overrides: Any) -> WebConfig:
        """The settings from the environment (see the class); raises ConfigError."""
        derived = {"client": ClientSettings.from_env(), "dead_after": WorkerSettings.from_env().dead_after,
                   "openai": OpenAIConfig.from_env()}
        return super().from_env(**{**derived, **overrides})

    def announce(self, server: str) -> None:
        """Log where this web process sends its calls (password hidden), loudly if the prefix
        was not chosen: workers serve the prefix they were started with, never ``default`` by
        themselves."""
        _ensure_log_handler()
        logger.info("%s: broker %s, prefix %r, timeout %gs, max queue %d, 503 after %gs without a live worker",
                    server, redacted(self.redis_url), self.prefix, self.client.timeout, self.client.max_queue,
                    self.no_worker_grace)
        openai = self.openai.summary()
        logger.info("%s: /v1 (OpenAI API): %d mapped model names%s, %s", server, openai["models"],
                    " (only those served)" if openai["only_mapped"] else "",
                    f"{openai['api_keys']} API keys required" if openai["api_keys"] else "no API key required")
        if self.prefix_from_default:
            logger.warning("%s: RSTREAMER_PREFIX is not set: using prefix %r; calls reach only workers started "
                           "with --prefix %s", server, self.prefix, self.prefix)


def settings_or_exit(server: str) -> WebConfig:
    """``WebConfig.from_env()``; an invalid setting (a broker URL that is not Redis's, a bad
    number...) prints one line on stderr and raises ``SystemExit(2)``, as ``rstreamer-worker``
    does: a server that could only answer 500 must not start. The gunicorn config's
    ``on_starting`` hook and the Starlette factory call it."""
    try:
        return WebConfig.from_env()
    except ConfigError as exc:
        print(f"{server}: {exc}", file=sys.stderr, flush=True)
        raise SystemExit(2) from None


def _ensure_log_handler() -> None:
    # Under gunicorn or uvicorn nothing handles this logger's info lines; a server or an app
    # that configured logging itself keeps its own handlers.
    if not logger.handlers and not logging.getLogger().handlers:
        handler = logging.StreamHandler()
        handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s [web pid %(process)d] %(message)s"))
        logger.addHandler(handler)
        logger.setLevel(logging.INFO)


def web_gate(config: WebConfig) -> WorkerGate:
    """The worker gate of a web process's streamer (rstreamer.client.gate): 503 after
    ``no_worker_grace`` seconds without a live worker, unless calls wait for a cold start. Its
    refusals do not name the Redis's other prefixes: an HTTP caller need not learn them."""
    return WorkerGate.for_settings(config.prefix, config.client, config.no_worker_grace, config.dead_after,
                                   name_known=False)
