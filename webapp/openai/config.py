"""The OpenAI layer's settings, read once from ``RSTREAMER_*`` variables (see docs/openai.md)."""
from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from rstreamer.batching.quotas import check_tenant
from rstreamer.errors import ConfigError
from rstreamer.settings import MAX_JOB_TTL, EnvSettings, check_timeout, parse_seconds
from rstreamer.wire.keys import validate_prefix

_SHA256 = re.compile(r"[0-9a-f]{64}")
_TRUE, _FALSE = ("1", "true", "yes", "on"), ("0", "false", "no", "off", "")


def parse_flag(text: str) -> bool:
    """``1/true/yes/on`` or ``0/false/no/off`` (any case)."""
    value = text.strip().lower()
    if value in _TRUE or value in _FALSE:
        return value in _TRUE
    raise ValueError(f"expected true or false, got {text!r}")


def _entries(text: str) -> list[str]:
    """The entries of a list setting: separated by commas or new lines; ``#`` starts a comment."""
    lines = (line.split("#", 1)[0] for line in text.splitlines())
    return [entry.strip() for line in lines for entry in line.split(",") if entry.strip()]


def parse_models(text: str) -> dict[str, str]:
    """``name=prefix,other=prefix2``: the model names a request may give that are not prefixes."""
    mapping: dict[str, str] = {}
    for entry in _entries(text):
        name, sep, prefix = entry.partition("=")
        if not sep or not name.strip():
            raise ConfigError(f"openai_models: expected name=prefix, got {entry!r}")
        mapping[name.strip()] = validate_prefix(prefix.strip())
    return mapping


def parse_api_keys(text: str, where: str) -> dict[str, str]:
    """``tenant=<sha256 of the key, 64 hex digits>`` entries: sha256 -> tenant.

    Only digests are accepted, so that a configuration file never holds a usable key.
    """
    keys: dict[str, str] = {}
    for entry in _entries(text):
        tenant, sep, digest = entry.partition("=")
        digest = digest.strip().lower().removeprefix("sha256:")
        if not sep or not _SHA256.fullmatch(digest):
            # Never echo the entry: it may be a key pasted by mistake.
            raise ConfigError(f"{where}: every entry is tenant=<sha256 of the key, 64 hex digits> "
                              f"(python -m webapp.openai.auth TENANT makes one)")
        try:
            keys[digest] = str(check_tenant(tenant.strip()))
        except ConfigError as exc:
            raise ConfigError(f"{where}: {exc}") from None
    return keys


@dataclass(frozen=True)
class OpenAIConfig(EnvSettings):
    """Settings of the ``/v1`` routes (each from ``RSTREAMER_<FIELD>``).

    openai_models: ``name=prefix`` pairs mapping model names to prefixes; any other name is
        taken as a prefix itself. openai_models_only: only those names are served (``/v1/models``
        lists them alone, other names are 404). api_keys: ``tenant=<sha256 hex>`` pairs, comma
        or newline separated; api_keys_file: a file of such lines. With either, every ``/v1``
        request needs ``Authorization: Bearer <key>``, and the key's tenant is the request's.
    openai_timeout: seconds a chat or completion may take, queueing included.
    openai_file_max_bytes: the largest file ``POST /v1/files`` takes. openai_file_ttl: seconds
        files and batches (and their jobs) are kept. openai_store: the prefix whose hash tag
        holds files and batches (their keys are built in rstreamer.wire.keys).
    """

    openai_models: str = ""
    openai_models_only: bool = field(default=False, metadata={"parse": parse_flag})
    api_keys: str = field(default="", repr=False)
    api_keys_file: str = ""
    openai_timeout: float = field(default=300.0, metadata={"parse": parse_seconds})
    openai_file_max_bytes: int = 64 * 1024 * 1024
    openai_file_ttl: float = field(default=24 * 3600.0, metadata={"parse": parse_seconds})
    openai_store: str = "openai"
    models: dict[str, str] = field(init=False, repr=False, compare=False)
    keys: dict[str, str] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "models", parse_models(self.openai_models))
        object.__setattr__(self, "keys", self._load_keys())
        object.__setattr__(self, "openai_store", validate_prefix(self.openai_store))
        try:
            check_timeout(self.openai_timeout)
        except ConfigError as exc:
            raise ConfigError(f"openai_timeout: {exc}") from None
        if self.openai_file_max_bytes < 1:
            raise ConfigError(f"openai_file_max_bytes must be > 0, got {self.openai_file_max_bytes!r}")
        if not 0 < self.openai_file_ttl <= MAX_JOB_TTL:  # the batches' jobs live as long
            raise ConfigError(f"openai_file_ttl must be > 0 and at most {MAX_JOB_TTL:.0f} s (30 days), "
                              f"got {self.openai_file_ttl!r}")
        if self.openai_models_only and not self.models:
            raise ConfigError("openai_models_only is set but openai_models names no model")

    def _load_keys(self) -> dict[str, str]:
        keys = parse_api_keys(self.api_keys, "RSTREAMER_API_KEYS")
        if self.api_keys_file:
            try:
                text = Path(self.api_keys_file).read_text()
            except OSError as exc:
                raise ConfigError(f"RSTREAMER_API_KEYS_FILE: cannot read {self.api_keys_file}: "
                                  f"{exc.strerror}") from None
            keys.update(parse_api_keys(text, f"RSTREAMER_API_KEYS_FILE ({self.api_keys_file})"))
        return keys

    @property
    def keyed(self) -> bool:
        """True when requests need an API key."""
        return bool(self.keys)

    def summary(self) -> dict[str, Any]:
        """What the start-up line says (never a key or a digest)."""
        return {"models": len(self.models), "api_keys": len(self.keys), "only_mapped": self.openai_models_only}
