"""HTTPS for the API servers: the TLS files checked once in the launcher, and CertRefresher, which
reloads them into the live SSL context when they change (vLLM's --enable-ssl-refresh).

Standard library only, so the launcher can check the files without the server's stack.
"""

from __future__ import annotations

import asyncio
import logging
import os
import ssl

logger = logging.getLogger("engine.api")

# How often the refresher looks at the files' modification times. A renewed certificate is served within
# this long (certificate renewals are planned days ahead; a stat() of three files costs microseconds).
REFRESH_POLL_S = 2.0


def server_context(keyfile: str, certfile: str, ca_certs: str | None, cert_reqs: int) -> ssl.SSLContext:
    """The context uvicorn would build from the same files: raises OSError or ssl.SSLError."""
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    context.load_cert_chain(certfile, keyfile)
    context.verify_mode = ssl.VerifyMode(cert_reqs)
    if ca_certs:
        context.load_verify_locations(ca_certs)
    return context


def check_tls_files(keyfile: str | None, certfile: str | None, ca_certs: str | None, cert_reqs: int) -> None:
    """One clear line (SystemExit) for a missing, unreadable or mismatched key, certificate or CA file,
    before the engine is started."""
    if not (keyfile and certfile):
        return
    try:
        server_context(keyfile, certfile, ca_certs, cert_reqs)
    except (OSError, ssl.SSLError) as error:
        raise SystemExit(
            f"engine: cannot serve HTTPS with --ssl-keyfile {keyfile} --ssl-certfile {certfile}"
            f"{f' --ssl-ca-certs {ca_certs}' if ca_certs else ''}: {error}"
        ) from None


class CertRefresher:
    """Watches the key, certificate and CA files (their mtime and size, every poll_s) and loads them
    into `context` in place when they change: the handshakes that follow use the new certificate, open
    connections keep theirs. A half-written pair (key and certificate not matching yet) fails to load and
    is retried at the next change or poll, so the old certificate serves until both are in place."""

    def __init__(
        self,
        context: ssl.SSLContext,
        keyfile: str,
        certfile: str,
        ca_certs: str | None = None,
        poll_s: float = REFRESH_POLL_S,
    ) -> None:
        self.context = context
        self.keyfile, self.certfile, self.ca_certs = keyfile, certfile, ca_certs
        self.poll_s = poll_s
        self.num_reloads = 0
        self._seen = self._stamps()
        self._task: asyncio.Task[None] | None = None

    def _stamps(self) -> dict[str, tuple[int, int] | None]:
        stamps: dict[str, tuple[int, int] | None] = {}
        for path in (self.keyfile, self.certfile, self.ca_certs):
            if path:
                try:
                    stat = os.stat(path)
                    stamps[path] = (stat.st_mtime_ns, stat.st_size)
                except OSError:
                    stamps[path] = None  # being replaced: try again at the next poll
        return stamps

    def check(self) -> bool:
        """Reload what changed since the last successful load; True when something was reloaded."""
        stamps = self._stamps()
        if stamps == self._seen or None in stamps.values():
            return False
        try:
            # NOTE: a fresh context first: a failed load into the live one can leave it holding the new
            # certificate with the old key, which fails every handshake.
            server_context(self.keyfile, self.certfile, self.ca_certs, int(self.context.verify_mode))
            self.context.load_cert_chain(self.certfile, self.keyfile)
            if self.ca_certs:
                self.context.load_verify_locations(self.ca_certs)
        except (OSError, ssl.SSLError) as error:
            logger.warning("TLS: could not reload the certificate files (keeping the old ones): %s", error)
            return False
        logger.info(
            "TLS: reloaded %s", ", ".join(path for path in stamps if stamps[path] != self._seen.get(path))
        )
        self._seen = stamps
        self.num_reloads += 1
        return True

    def start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self._watch())

    def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            self._task = None

    async def _watch(self) -> None:
        while True:
            await asyncio.sleep(self.poll_s)
            self.check()
