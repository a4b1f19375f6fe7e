"""One webhook try against real HTTP(S) servers on loopback: the checked address is the one
connected to, redirects are not followed, one deadline bounds the whole try (no Redis)."""
from __future__ import annotations

import http.server
import shutil
import socket
import ssl
import threading
from pathlib import Path

import pytest

from rstreamer.jobs.webhook_http import Attempt, WebhookPoster, resolve_within, system_resolve
from rstreamer.jobs.webhook_targets import TargetPolicy, parse_address
from support.polling import wait_until
from support.tls import make_certificates

LOOPBACK = TargetPolicy.parse("127.0.0.0/8")


class Server:
    """An HTTP server on 127.0.0.1 answering ``status`` (with ``location``); records each request."""

    def __init__(self, status: int = 204, location: str = "", tls: ssl.SSLContext | None = None) -> None:
        self.requests: list[tuple[str, str, dict[str, str]]] = []
        server = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def _answer(self) -> None:
                self.rfile.read(int(self.headers.get("Content-Length") or 0))
                server.requests.append((self.command, self.path, dict(self.headers)))
                self.send_response(status)
                if location:
                    self.send_header("Location", location)
                self.send_header("Content-Length", "0")
                self.end_headers()

            do_GET = do_POST = _answer

            def log_message(self, *args: object) -> None:
                pass

        self.http = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        if tls is not None:
            self.http.socket = tls.wrap_socket(self.http.socket, server_side=True)
        self.port = self.http.server_address[1]
        threading.Thread(target=self.http.serve_forever, daemon=True).start()

    def close(self) -> None:
        self.http.shutdown()
        self.http.server_close()


@pytest.fixture
def servers():
    made: list[Server] = []

    def make(*args, **kwargs) -> Server:
        made.append(Server(*args, **kwargs))
        return made[-1]

    yield make
    for server in made:
        server.close()


class Resolver:
    """A DNS stand-in: the answers it gives, and the names it was asked."""

    def __init__(self, *answers: str) -> None:
        self.answers = [parse_address(a) for a in answers]
        self.asked: list[str] = []

    def __call__(self, host: str, port: int) -> list:
        self.asked.append(host)
        return list(self.answers)


def post(poster: WebhookPoster, url: str, timeout: float = 10.0) -> Attempt:
    return poster.post(url, b'{"type": "job.done"}', {"Content-Type": "application/json"}, timeout)


def test_the_connection_goes_to_the_checked_address_with_the_host_name_kept(servers):
    server = servers()
    resolver = Resolver("127.0.0.1")
    # hooks.test exists in no DNS: only a connection to the address the check saw can reach the server.
    attempt = post(WebhookPoster(LOOPBACK, resolve=resolver), f"http://hooks.test:{server.port}/hook?x=1")
    assert attempt.delivered, attempt
    assert resolver.asked == ["hooks.test"]  # resolved once: no second lookup to rebind
    ((method, path, headers),) = server.requests
    assert (method, path, headers["Host"]) == ("POST", "/hook?x=1", f"hooks.test:{server.port}")


def test_a_name_that_resolves_to_an_internal_address_is_refused_without_a_connection(servers):
    server = servers()
    for answers in (["127.0.0.1"], ["8.8.8.8", "127.0.0.1"], ["::ffff:127.0.0.1"]):
        attempt = post(WebhookPoster(TargetPolicy(), resolve=Resolver(*answers)), f"http://hooks.test:{server.port}/")
        assert attempt.refused and not attempt.delivered and "loopback" in attempt.error, attempt
    attempt = post(WebhookPoster(TargetPolicy()), f"http://localhost:{server.port}/")  # the real resolver
    assert attempt.refused and "localhost resolves to" in attempt.error
    assert server.requests == []


def test_the_allow_list_admits_an_internal_receiver(servers):
    server = servers()
    assert post(WebhookPoster(TargetPolicy.parse("localhost")), f"http://localhost:{server.port}/").delivered
    assert post(WebhookPoster(LOOPBACK), f"http://127.0.0.1:{server.port}/").delivered
    assert len(server.requests) == 2


def test_a_url_that_cannot_be_called_is_refused_for_good():
    for url in ("ftp://hooks.example.com/", "http://", "http://[::1/", "http://hooks.example.com:x/"):
        attempt = post(WebhookPoster(LOOPBACK), url)
        assert attempt.refused and not attempt.delivered, (url, attempt)


def test_a_redirect_is_not_followed(servers):
    inside = servers()
    bouncer = servers(303, location=f"http://127.0.0.1:{inside.port}/admin")
    attempt = post(WebhookPoster(LOOPBACK), f"http://127.0.0.1:{bouncer.port}/hook")
    assert attempt.status == 303 and not attempt.delivered and "not followed" in attempt.describe()
    assert inside.requests == [] and len(bouncer.requests) == 1


def test_a_slow_drip_answer_is_cut_at_the_deadline():
    listener = socket.create_server(("127.0.0.1", 0))
    closed = threading.Event()
    stop = threading.Event()

    def drip() -> None:
        conn, _ = listener.accept()
        with conn:
            data = b""
            while b"\r\n\r\n" not in data:
                chunk = conn.recv(4096)
                if not chunk:  # hung up before its request was whole
                    closed.set()
                    return
                data += chunk
            try:
                conn.sendall(b"HTTP/1.1 200 OK\r\nX-Slow: ")
                while not stop.wait(0.1):  # one byte every 0.1 s: no read ever times out
                    conn.sendall(b"a")
            except OSError:
                closed.set()

    threading.Thread(target=drip, daemon=True).start()
    result: list[Attempt] = []
    sender = threading.Thread(target=lambda: result.append(
        post(WebhookPoster(LOOPBACK), f"http://127.0.0.1:{listener.getsockname()[1]}/", timeout=1.0)), daemon=True)
    try:
        sender.start()
        sender.join(30)  # without a deadline the try never ends
        assert result, "the try did not return"
        assert not result[0].delivered and "no answer within 1s" in result[0].error
        wait_until(closed.is_set, 10, what="the sender to close the connection")
    finally:
        stop.set()
        listener.close()


def test_a_dns_lookup_that_hangs_is_cut_at_the_deadline():
    release = threading.Event()

    def hanging(host: str, port: int) -> list:
        release.wait(30)
        return []

    try:
        with pytest.raises(TimeoutError, match="DNS lookup of hooks.test"):
            resolve_within(hanging, "hooks.test", 80, 0.2)
        attempt = post(WebhookPoster(LOOPBACK, resolve=hanging), "http://hooks.test/", timeout=0.2)
        assert not attempt.delivered and not attempt.refused and "DNS lookup" in attempt.error
    finally:
        release.set()
    assert resolve_within(system_resolve, "::1", 80, 1.0) == [parse_address("::1")]  # a literal needs no DNS


@pytest.mark.skipif(shutil.which("openssl") is None, reason="the openssl CLI makes the test certificates")
def test_https_keeps_sni_and_the_certificate_check_on_the_host_name(servers, tmp_path: Path):
    certs = make_certificates(tmp_path)  # the server's certificate names 127.0.0.1 and localhost
    names: list[str | None] = []
    tls = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    tls.load_cert_chain(certs.server_cert, certs.server_key)
    tls.sni_callback = lambda sock, name, ctx: names.append(name)
    server = servers(tls=tls)
    trusting = ssl.create_default_context(cafile=str(certs.ca))
    poster = WebhookPoster(LOOPBACK, resolve=Resolver("127.0.0.1"), ssl_context=trusting)
    assert post(poster, f"https://localhost:{server.port}/hook").delivered
    assert names == ["localhost"] and server.requests[0][2]["Host"] == f"localhost:{server.port}"
    # Connected to 127.0.0.1, which the certificate names too: only a check against the host name fails.
    refused = post(poster, f"https://hooks.test:{server.port}/hook")
    assert not refused.delivered and "certificate" in refused.error.lower(), refused
    assert len(server.requests) == 1
    # and an untrusted certificate fails whatever the name
    assert not post(WebhookPoster(LOOPBACK, resolve=Resolver("127.0.0.1")), f"https://localhost:{server.port}/").delivered
