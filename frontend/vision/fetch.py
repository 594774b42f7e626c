"""Fetching an image's bytes: `data:` URLs, `http(s)://` (aiohttp, bounded in time, bytes and redirects,
the host checked against --allowed-media-domains at every hop), and `file://` under
--allowed-local-media-path only. Each failure is a MediaError: the door answers 400 naming the part.

vLLM's environment variables set the bounds: VLLM_IMAGE_FETCH_TIMEOUT (5 s a try), VLLM_MEDIA_URL_ALLOW_
REDIRECTS (1), VLLM_MEDIA_FETCH_MAX_RETRIES (3 tries; a timeout, a lost connection or a 5xx is tried again
with 4x the timeout after 4**try seconds, as vLLM does), VLLM_MAX_MEDIA_DOWNLOAD_SIZE_MB (32 here: vLLM
has none upstream; an image past it is cut off while it is read, not after).
"""

from __future__ import annotations

import asyncio
import base64
import binascii
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import unquote, urljoin, urlsplit

MIB = 1 << 20
MAX_REDIRECTS = 5
RETRY_BACKOFF = 4


class MediaError(ValueError):
    """An image that cannot be had: a sentence for the caller."""


@dataclass(frozen=True)
class FetchLimits:
    timeout_s: float = 5.0
    allow_redirects: bool = True
    max_tries: int = 3
    max_bytes: int = 32 * MIB
    allowed_domains: tuple[str, ...] = ()  # empty: any host
    allowed_local_path: str | None = None  # None: file:// refused

    @classmethod
    def from_env(
        cls, environ: Mapping[str, str], allowed_domains: list[str], allowed_local_path: str | None
    ) -> FetchLimits:
        def number(name: str, default: float) -> float:
            raw = environ.get(name, "").strip()
            try:
                return float(raw) if raw else default
            except ValueError:
                raise ValueError(f"{name} must be a number, got {raw!r}") from None

        local = None
        if allowed_local_path:
            path = Path(allowed_local_path).resolve()
            if not path.is_dir():
                raise ValueError(f"--allowed-local-media-path {allowed_local_path}: not a directory")
            local = str(path)
        return cls(
            timeout_s=number("VLLM_IMAGE_FETCH_TIMEOUT", cls.timeout_s),
            allow_redirects=bool(int(number("VLLM_MEDIA_URL_ALLOW_REDIRECTS", 1))),
            max_tries=max(int(number("VLLM_MEDIA_FETCH_MAX_RETRIES", cls.max_tries)), 1),
            max_bytes=int(number("VLLM_MAX_MEDIA_DOWNLOAD_SIZE_MB", cls.max_bytes / MIB) * MIB),
            allowed_domains=tuple(allowed_domains),
            allowed_local_path=local,
        )


class Retry(Exception):
    """A failure worth another try (a timeout, a lost connection, a 5xx)."""


class MediaFetcher:
    def __init__(self, limits: FetchLimits) -> None:
        self.limits = limits
        self._session: Any = None  # aiohttp.ClientSession, made on the first http(s) fetch in the loop

    async def fetch(self, url: str) -> bytes:
        scheme = urlsplit(url).scheme.lower()
        if scheme == "data":
            return self._data(url)
        if scheme == "file":
            return await asyncio.to_thread(self._file, url)
        if scheme in ("http", "https"):
            return await self._http(url)
        raise MediaError("The URL must be either a HTTP, data or file URL.")

    def _data(self, url: str) -> bytes:
        header, _, payload = url[5:].partition(",")
        if not header.endswith(";base64"):
            raise MediaError("Only base64 data URLs are supported for now.")
        if not header.startswith("image/"):
            raise MediaError(
                f"a data URL of type {header.removesuffix(';base64') or 'none'!r} is not an image"
            )
        if len(payload) * 3 // 4 > self.limits.max_bytes:
            raise MediaError(f"the image is larger than {self.limits.max_bytes} bytes")
        try:
            return base64.b64decode(payload, validate=True)
        except (binascii.Error, ValueError):
            raise MediaError("the data URL's payload is not valid base64") from None

    def _file(self, url: str) -> bytes:
        allowed = self.limits.allowed_local_path
        if allowed is None:
            raise MediaError("Cannot load local files without `--allowed-local-media-path`.")
        parts = urlsplit(url)
        path = Path(unquote(parts.netloc + parts.path)).resolve()
        if Path(allowed) not in path.parents:
            raise MediaError(
                f"The file path {path} must be a subpath of `--allowed-local-media-path {allowed}`."
            )
        try:
            size = path.stat().st_size
            if size > self.limits.max_bytes:
                raise MediaError(f"the image is larger than {self.limits.max_bytes} bytes")
            return path.read_bytes()
        except OSError as error:
            raise MediaError(f"cannot read {path}: {error.strerror}") from None

    def _check_host(self, url: str) -> None:
        host = urlsplit(url).hostname or ""
        allowed = self.limits.allowed_domains
        if allowed and host not in allowed:
            raise MediaError(
                f"The URL must be from one of the allowed domains: {list(allowed)}. Input URL domain: {host}"
            )

    async def _http(self, url: str) -> bytes:
        limits = self.limits
        for attempt in range(limits.max_tries):
            try:
                return await asyncio.wait_for(self._get(url), limits.timeout_s * RETRY_BACKOFF**attempt)
            except (Retry, TimeoutError) as error:
                if attempt + 1 == limits.max_tries:
                    reason = "timed out" if isinstance(error, TimeoutError) else str(error)
                    raise MediaError(f"Failed to fetch the image from {url}: {reason}") from None
                await asyncio.sleep(RETRY_BACKOFF**attempt)
        raise AssertionError("unreachable")

    async def _get(self, url: str) -> bytes:
        import aiohttp

        if self._session is None:
            self._session = aiohttp.ClientSession(headers={"User-Agent": "engine"})
        for _ in range(MAX_REDIRECTS + 1):
            self._check_host(url)  # every hop: a redirect cannot leave the allowed domains
            try:
                async with self._session.get(url, allow_redirects=False) as response:
                    if response.status in (301, 302, 303, 307, 308):
                        if not self.limits.allow_redirects:
                            raise MediaError(f"{url} redirects, and VLLM_MEDIA_URL_ALLOW_REDIRECTS=0")
                        url = urljoin(url, response.headers.get("Location", ""))
                        continue
                    if response.status >= 500 or response.status in (408, 429):
                        raise Retry(f"HTTP {response.status}")
                    if response.status >= 400:
                        raise MediaError(f"Failed to fetch the image from {url}: HTTP {response.status}")
                    return await self._read(response)
            except aiohttp.ClientError as error:
                raise Retry(f"{type(error).__name__}: {error}") from None
        raise MediaError(f"{url}: more than {MAX_REDIRECTS} redirects")

    async def _read(self, response: Any) -> bytes:
        limit = self.limits.max_bytes
        if response.content_length is not None and response.content_length > limit:
            raise MediaError(f"the image is larger than {limit} bytes")
        chunks, size = [], 0
        async for chunk in response.content.iter_chunked(1 << 16):
            size += len(chunk)
            if size > limit:
                raise MediaError(f"the image is larger than {limit} bytes")
            chunks.append(chunk)
        return b"".join(chunks)

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None
