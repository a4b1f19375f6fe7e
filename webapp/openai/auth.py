"""API keys per tenant: ``Authorization: Bearer <key>`` names the tenant of a ``/v1`` request.

Keys are configured by their sha256 digest only (``tenant=<hex>``), so neither the settings nor
a log line ever holds one. ``python -m webapp.openai.auth TENANT`` makes a new key and prints
it once, with the line to configure.
"""
from __future__ import annotations

import hashlib
import secrets
import sys
from collections.abc import Mapping

from .errors import OpenAIError

KEY_BYTES = 32


def digest(key: str) -> str:
    """The sha256 of a key, as configured."""
    return hashlib.sha256(key.encode("utf-8", "surrogatepass")).hexdigest()


def tenant_of(authorization: str | None, keys: Mapping[str, str]) -> str | None:
    """The tenant an ``Authorization`` header's key names; None when no key is configured.

    Raises a 401 OpenAIError when keys are configured and the header has none, or an unknown one.
    The lookup is by digest: the key itself is compared to nothing and kept nowhere.
    """
    if not keys:
        return None
    scheme, _, key = (authorization or "").strip().partition(" ")
    key = key.strip()
    if scheme.lower() != "bearer" or not key:
        raise OpenAIError(401, "You didn't provide an API key: send the header Authorization: Bearer <key>.",
                          "invalid_request_error", code="missing_api_key")
    tenant = keys.get(digest(key))
    if tenant is None:
        raise OpenAIError(401, "Incorrect API key provided.", "invalid_request_error", code="invalid_api_key")
    return tenant


def new_key() -> str:
    """A fresh random key (``sk-`` and 43 URL-safe characters)."""
    return "sk-" + secrets.token_urlsafe(KEY_BYTES)


def main(argv: list[str]) -> int:
    """``python -m webapp.openai.auth TENANT``: a new key for TENANT and its configuration line."""
    if len(argv) != 1:
        print("usage: python -m webapp.openai.auth TENANT", file=sys.stderr)
        return 2
    key = new_key()
    print(f"key (give it to the client; it is shown only now): {key}")
    print(f"RSTREAMER_API_KEYS entry (or a line of RSTREAMER_API_KEYS_FILE): {argv[0]}={digest(key)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
