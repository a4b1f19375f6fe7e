"""One try of a webhook call, and the signature that lets a receiver trust it.

A try resolves the URL's host, checks every address it resolves to against the target policy
(:mod:`rstreamer.jobs.webhook_targets`), and connects to a checked address only: the URL is
rewritten to that address, with the ``Host`` header, TLS SNI and certificate check still on
the host name, so a DNS answer that changes between the check and the connection (DNS
rebinding) is never used. It follows no redirect (a 3xx is a failed try) and ignores proxy
variables (a proxy would make its own connection, unchecked). The whole try (DNS, connect,
TLS, sending the body, the answer's status line and headers) has one deadline: a receiver
that answers one byte at a time cannot hold a sender past it. The answer's body is not read.

httpx is imported by the sender thread when it starts (:func:`preload`), not by
``import rstreamer``: a web process that never sends a webhook does not pay for it.
"""
from __future__ import annotations

import asyncio
import hashlib
import hmac
import queue
import socket
import ssl
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING

from ..settings import IPAddress
from .webhook_targets import TargetPolicy, TargetRefused, parse_address

if TYPE_CHECKING:
    import httpx

SIGNATURE_HEADER = "X-Rstreamer-Signature"
DELIVERY_HEADER = "X-Rstreamer-Delivery"
SIGNATURE_TOLERANCE = 300.0
"""Seconds a receiver should accept between a signature's timestamp and its own clock."""

Resolve = Callable[[str, int], "list[IPAddress]"]


# signatures ------------------------------------------------------------------------------

def sign(secret: str, timestamp: int, delivery: str, body: bytes) -> str:
    """The ``X-Rstreamer-Signature`` value: ``t=<timestamp>,v1=<hex HMAC-SHA256>`` of
    ``"<timestamp>.<delivery>." + body`` with ``secret``."""
    message = f"{timestamp}.{delivery}.".encode() + body
    return f"t={timestamp},v1={hmac.new(secret.encode(), message, hashlib.sha256).hexdigest()}"


def verify_webhook_signature(secret: str, signature: str, delivery: str, body: bytes,
                             tolerance: float = SIGNATURE_TOLERANCE, now: float | None = None) -> bool:
    """True when a webhook call is genuine and fresh.

    Args:
        secret: the workers' ``RSTREAMER_WEBHOOK_SECRET``.
        signature: the ``X-Rstreamer-Signature`` header.
        delivery: the ``X-Rstreamer-Delivery`` header.
        body: the raw request body, before any JSON parsing.
        tolerance: seconds the signature's timestamp may differ from ``now``: an older call is
            a replay.
        now: the receiver's time (default: ``time.time()``).
    """
    fields = dict(part.split("=", 1) for part in signature.split(",") if "=" in part)
    try:
        timestamp = int(fields["t"])
    except (KeyError, ValueError):
        return False
    if abs((time.time() if now is None else now) - timestamp) > tolerance:
        return False
    expected = sign(secret, timestamp, delivery, body).rpartition("v1=")[2]
    return hmac.compare_digest(expected, fields.get("v1", ""))


# one try -----------------------------------------------------------------------------------

def preload() -> None:
    """Import httpx and its asyncio backend now. Done inside a try, these one-time imports
    (half a second and more on a loaded host) would eat that try's deadline."""
    import anyio
    import httpx  # noqa: F401

    asyncio.run(anyio.sleep(0))  # anyio loads its asyncio backend on first use


@dataclass(frozen=True)
class Attempt:
    """How one try went: the HTTP ``status`` (0 when no answer came) or the ``error``;
    ``refused``: the policy refuses the target, so no later try can do better."""

    status: int = 0
    error: str = ""
    refused: bool = False

    @property
    def delivered(self) -> bool:
        """True for a 2xx answer."""
        return 200 <= self.status < 300

    def describe(self) -> str:
        """The outcome for a log line."""
        if self.status:
            suffix = " (redirects are not followed)" if 300 <= self.status < 400 else ""
            return f"answered {self.status}{suffix}"
        return self.error


def system_resolve(host: str, port: int) -> list[IPAddress]:
    """Every address ``host`` resolves to, in the resolver's order, each once."""
    found: list[IPAddress] = []
    for *_, sockaddr in socket.getaddrinfo(host, port, type=socket.SOCK_STREAM):
        address = parse_address(str(sockaddr[0]))
        if address is not None and address not in found:
            found.append(address)
    return found


def resolve_within(resolve: Resolve, host: str, port: int, timeout: float) -> list[IPAddress]:
    """``resolve(host, port)``, given up after ``timeout`` seconds (raises TimeoutError).

    getaddrinfo cannot be interrupted, so it runs in a daemon thread that is left behind when
    it overruns: the try ends on time, the lookup ends when the resolver gives up.
    """
    literal = parse_address(host)
    if literal is not None:
        return [literal]
    answer: queue.Queue[tuple[list[IPAddress], Exception | None]] = queue.Queue(maxsize=1)

    def lookup() -> None:
        try:
            answer.put((resolve(host, port), None))
        except Exception as exc:  # gaierror, UnicodeError for a bad name: handed to the try
            answer.put(([], exc))

    threading.Thread(target=lookup, name="rstreamer-webhook-dns", daemon=True).start()
    try:
        addresses, error = answer.get(timeout=max(0.0, timeout))
    except queue.Empty:
        raise TimeoutError(f"the DNS lookup of {host} took over {timeout:.1f}s") from None
    if error is not None:
        raise error
    if not addresses:
        raise OSError(f"{host} resolves to no address")
    return addresses


@dataclass(frozen=True)
class Target:
    """A webhook URL, parsed: where to connect, and the names the request must carry."""

    url: httpx.URL
    host: str  # ASCII (IDNA) host name or address, without brackets: DNS, SNI, certificate check
    port: int
    netloc: str  # the Host header

    @classmethod
    def parse(cls, text: str) -> Target:
        """Parse ``text``; raises ValueError for a URL a webhook cannot have."""
        import httpx

        try:
            url = httpx.URL(text)
        except httpx.InvalidURL as exc:
            raise ValueError(f"invalid URL: {exc}") from None
        if url.scheme not in ("http", "https") or not url.raw_host:
            raise ValueError("not an http:// or https:// URL with a host")
        port = url.port or (443 if url.scheme == "https" else 80)
        return cls(url, url.raw_host.decode("ascii"), port, url.netloc.decode("ascii"))

    def pinned(self, address: IPAddress) -> httpx.URL:
        """The URL with ``address`` in place of the host name."""
        return self.url.copy_with(host=str(address))


class WebhookPoster:
    """Makes tries; ``resolve`` and ``ssl_context`` are replaceable for tests."""

    def __init__(self, policy: TargetPolicy, resolve: Resolve = system_resolve,
                 ssl_context: ssl.SSLContext | None = None) -> None:
        self.policy = policy
        self._resolve = resolve
        # The system's trust store, as urllib used before; httpx's own default is certifi.
        self._ssl = ssl_context or ssl.create_default_context()

    def post(self, url: str, body: bytes, headers: Mapping[str, str], timeout: float) -> Attempt:
        """One try of POSTing ``body`` to ``url``, all of it within ``timeout`` seconds; never raises."""
        deadline = time.monotonic() + timeout
        try:
            target = Target.parse(url)
        except ValueError as exc:  # no later try can do better
            return Attempt(error=str(exc), refused=True)
        try:
            addresses = resolve_within(self._resolve, target.host, target.port, timeout)
            self.policy.check(target.host, addresses)
        except TargetRefused as exc:
            return Attempt(error=str(exc), refused=True)
        except (OSError, ValueError) as exc:
            return Attempt(error=_describe(exc))
        try:
            status = asyncio.run(asyncio.wait_for(self._send(target, addresses, body, headers),
                                                  max(0.001, deadline - time.monotonic())))
        except asyncio.TimeoutError:
            return Attempt(error=f"no answer within {timeout:g}s")
        except Exception as exc:  # whatever one try meets (TLS, protocol, ...) fails that try, not the sender
            return Attempt(error=_describe(exc))
        return Attempt(status)

    async def _send(self, target: Target, addresses: list[IPAddress], body: bytes,
                    headers: Mapping[str, str]) -> int:
        import httpx

        # trust_env=False: no proxy from HTTP(S)_PROXY, no .netrc. No timeout of httpx's own:
        # the deadline around this coroutine bounds everything.
        async with httpx.AsyncClient(verify=self._ssl, trust_env=False, follow_redirects=False,
                                     timeout=None) as client:
            failure: Exception = OSError("no address")
            for address in addresses:
                try:
                    return await self._post_to(client, target, address, body, headers)
                except httpx.ConnectError as exc:  # the next checked address, if any
                    failure = exc
            raise failure

    @staticmethod
    async def _post_to(client: httpx.AsyncClient, target: Target, address: IPAddress, body: bytes,
                       headers: Mapping[str, str]) -> int:
        # SNI and the certificate check use the host name, not the address we connect to.
        extensions = {"sni_hostname": target.host} if target.url.scheme == "https" else {}
        async with client.stream("POST", target.pinned(address), content=body,
                                 headers={**headers, "Host": target.netloc}, extensions=extensions) as response:
            return response.status_code


def _describe(exc: BaseException) -> str:
    text = str(exc) or repr(exc)
    return f"{type(exc).__name__}: {text}"
