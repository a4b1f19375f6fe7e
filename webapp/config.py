"""The web app's settings, read once from ``RSTREAMER_*`` variables."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from rstreamer.errors import ConfigError
from rstreamer.keys import validate_prefix
from rstreamer.settings import DEFAULT_REDIS_URL, ClientSettings, EnvSettings, WorkerSettings

DEFAULT_MAX_BODY = 16 * 1024 * 1024


@dataclass(frozen=True)
class WebConfig(EnvSettings):
    """What a web process needs: the broker, the prefix, call limits and the request-body limit.

    Each field comes from ``RSTREAMER_<FIELD>`` (``RSTREAMER_REDIS_URL``, ``RSTREAMER_PREFIX``,
    ``RSTREAMER_MAX_BODY`` in bytes); ``client`` carries the call limits of ClientSettings
    (``RSTREAMER_TIMEOUT``, ``RSTREAMER_MAX_QUEUE``...); ``dead_after`` is the workers'
    liveness window (``RSTREAMER_DEAD_AFTER``, as the workers read it), used by ``/readyz``.
    """

    redis_url: str = DEFAULT_REDIS_URL
    prefix: str = ""
    client: ClientSettings = field(default_factory=ClientSettings)
    max_body: int = DEFAULT_MAX_BODY
    dead_after: float = WorkerSettings.dead_after

    def __post_init__(self) -> None:
        object.__setattr__(self, "prefix", validate_prefix(self.prefix))
        if self.max_body < 1:
            raise ConfigError(f"max_body must be > 0, got {self.max_body!r}")

    @classmethod
    def from_env(cls, **overrides: Any) -> WebConfig:
        """The settings from the environment (see the class); raises ConfigError."""
        derived = {"client": ClientSettings.from_env(), "dead_after": WorkerSettings.from_env().dead_after}
        return super().from_env(**{**derived, **overrides})
