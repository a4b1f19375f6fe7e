"""Self-signed certificates (openssl CLI) and a TLS-only redis-server that requires client certificates."""
from __future__ import annotations

import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import quote, urlencode

import redis

from rstreamer.broker.embedded import find_server_binary
from support.servers import ServerProcess

USER, PASSWORD = "rstreamer", "tls-Pa55:w/rd"
# The least-privileged user docs/deploy.md recommends: rstreamer's keys only, no dangerous commands.
ACL_RULES = ("~rstreamer:*", "resetchannels", "+@all", "-@dangerous")


@dataclass(frozen=True)
class Certificates:
    ca: Path
    server_cert: Path
    server_key: Path
    client_cert: Path
    client_key: Path


def tls_unsupported_reason() -> str | None:
    """Why TLS cannot be tested here, or None when it can."""
    if shutil.which("openssl") is None:
        return "the openssl CLI is not on PATH (it makes the test certificates)"
    binary = find_server_binary()
    # A TLS build rejects this for the missing certificate; a build without TLS rejects the directive.
    done = subprocess.run([binary, "--port", "0", "--tls-port", "1"], capture_output=True, text=True, timeout=10)
    if "tls-cert-file" in done.stdout + done.stderr:
        return None
    return f"{binary} is built without TLS support (BUILD_TLS=no): {(done.stdout + done.stderr).strip()[-200:]}"


def make_certificates(directory: Path) -> Certificates:
    """A CA, a server certificate for 127.0.0.1/localhost and a client certificate, all signed by the CA."""
    ca_key, ca = directory / "ca.key", directory / "ca.crt"
    _openssl("genpkey", "-algorithm", "EC", "-pkeyopt", "ec_paramgen_curve:P-256", "-out", ca_key)
    _openssl("req", "-x509", "-new", "-key", ca_key, "-sha256", "-days", "2", "-subj", "/CN=rstreamer test CA",
             "-addext", "basicConstraints=critical,CA:TRUE", "-addext", "keyUsage=critical,keyCertSign,cRLSign",
             "-out", ca)
    server = _signed(directory, "server", ca, ca_key, "serverAuth", "subjectAltName=IP:127.0.0.1,DNS:localhost")
    client = _signed(directory, "client", ca, ca_key, "clientAuth", "")
    return Certificates(ca, *server, *client)


def _signed(directory: Path, name: str, ca: Path, ca_key: Path, usage: str, extra: str) -> tuple[Path, Path]:
    key, csr, cert, ext = (directory / f"{name}.{suffix}" for suffix in ("key", "csr", "crt", "ext"))
    ext.write_text("\n".join(line for line in (
        "basicConstraints=CA:FALSE", "keyUsage=critical,digitalSignature,keyEncipherment",
        f"extendedKeyUsage={usage}", "subjectKeyIdentifier=hash", "authorityKeyIdentifier=keyid,issuer", extra,
    ) if line) + "\n")
    _openssl("genpkey", "-algorithm", "EC", "-pkeyopt", "ec_paramgen_curve:P-256", "-out", key)
    _openssl("req", "-new", "-key", key, "-subj", f"/CN=rstreamer test {name}", "-out", csr)
    _openssl("x509", "-req", "-in", csr, "-CA", ca, "-CAkey", ca_key, "-CAcreateserial", "-days", "2", "-sha256",
             "-extfile", ext, "-out", cert)
    return cert, key


def _openssl(*args: object) -> None:
    subprocess.run(["openssl", *map(str, args)], check=True, capture_output=True, timeout=30)


class TlsRedis:
    """A redis-server listening on TLS only, requiring a client certificate and the ACL user USER."""

    def __init__(self, certs: Certificates) -> None:
        self.certs = certs
        self.server = ServerProcess("tls", [])

    def start(self) -> TlsRedis:
        c = self.certs
        self.server.args = [
            "--port", "0", "--tls-port", str(self.server.port), "--bind", "127.0.0.1",
            "--tls-cert-file", str(c.server_cert), "--tls-key-file", str(c.server_key),
            "--tls-ca-cert-file", str(c.ca), "--tls-auth-clients", "yes",
            "--user", "default", "off", "--user", USER, "on", f">{PASSWORD}", *ACL_RULES,
            "--save", "", "--appendonly", "no",
        ]
        self.server.start(self._ping)
        return self

    def _ping(self) -> bool:
        c = self.certs
        client = redis.Redis(port=self.server.port, ssl=True, ssl_ca_certs=str(c.ca), ssl_certfile=str(c.client_cert),
                             ssl_keyfile=str(c.client_key), username=USER, password=PASSWORD, socket_timeout=1)
        try:
            return bool(client.ping())
        finally:
            client.close()

    def url(self, *, ca: Path | None = None, client_cert: bool = True, password: str = PASSWORD) -> str:
        """A rediss:// URL with the TLS options as query parameters."""
        options = {"ssl_ca_certs": str(ca or self.certs.ca), "ssl_cert_reqs": "required"}
        if client_cert:
            options.update(ssl_certfile=str(self.certs.client_cert), ssl_keyfile=str(self.certs.client_key))
        return (f"rediss://{USER}:{quote(password, safe='')}@127.0.0.1:{self.server.port}/0?"
                + urlencode(options))

    def close(self) -> None:
        self.server.close()
