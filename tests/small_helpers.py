"""Helpers for the server-options tests: self-signed certificates (with the `cryptography` package),
a Hugging Face hub cache laid out by hand (nothing downloads), and a middleware for --middleware."""

from __future__ import annotations

import datetime
import ipaddress
import os
import pathlib
import shutil
from typing import Any

MIDDLEWARE_HEADER = "x-test-middleware"


def make_certificate(key_path: str, cert_path: str, common_name: str) -> None:
    """A self-signed certificate for 127.0.0.1 and localhost, written atomically (key, then cert)."""
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, common_name)])
    now = datetime.datetime.now(datetime.UTC)
    certificate = (
        x509.CertificateBuilder()
        .subject_name(name)
        .issuer_name(name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=1))
        .add_extension(
            x509.SubjectAlternativeName(
                [x509.DNSName("localhost"), x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]
            ),
            critical=False,
        )
        .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
        .sign(key, hashes.SHA256())
    )
    key_pem = key.private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
    )
    for path, data in (
        (key_path, key_pem),
        (cert_path, certificate.public_bytes(serialization.Encoding.PEM)),
    ):
        tmp = f"{path}.tmp"
        with open(tmp, "wb") as f:
            f.write(data)
        os.replace(tmp, path)


def common_name_of(pem: str) -> str:
    from cryptography import x509
    from cryptography.x509.oid import NameOID

    certificate = x509.load_pem_x509_certificate(pem.encode())
    return str(certificate.subject.get_attributes_for_oid(NameOID.COMMON_NAME)[0].value)


def hub_cache(cache_dir: pathlib.Path, repo_id: str, source: str, commit: str = "a" * 40) -> pathlib.Path:
    """huggingface_hub's cache layout for `repo_id` at `commit`, holding a copy of the `source` folder's
    files: models--ORG--NAME/{refs/main, snapshots/COMMIT/...}. Returns the snapshot folder."""
    repo = cache_dir / ("models--" + repo_id.replace("/", "--"))
    snapshot = repo / "snapshots" / commit
    snapshot.mkdir(parents=True)
    for name in os.listdir(source):
        shutil.copy(os.path.join(source, name), snapshot / name)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(commit)
    return snapshot


class TaggingMiddleware:
    """A pure ASGI middleware (a class, so --middleware adds it with app.add_middleware) that marks every
    HTTP response with a header."""

    def __init__(self, app: Any) -> None:
        self.app = app

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return

        async def tagged(message: Any) -> None:
            if message["type"] == "http.response.start":
                message["headers"] = [*message.get("headers", []), (MIDDLEWARE_HEADER.encode(), b"class")]
            await send(message)

        await self.app(scope, receive, tagged)


async def function_middleware(request: Any, call_next: Any) -> Any:
    """A function middleware (added as `@app.middleware("http")`)."""
    response = await call_next(request)
    response.headers["x-test-function-middleware"] = "function"
    return response
