"""ProxyArgs: the flags of `engine proxy` (frontend/scale_out/proxy.py), written once."""

from __future__ import annotations

from dataclasses import dataclass

from frontend.config.flags import option


@dataclass(frozen=True)
class ProxyArgs:
    prefill: list[str] = option(
        default_factory=list, help="the prefill instances' base URLs (kv_role kv_producer)", nargs="+"
    )
    decode: list[str] = option(
        default_factory=list, help="the decode instances' base URLs (kv_role kv_consumer)", nargs="+"
    )
    host: str = option("127.0.0.1", "the address the proxy listens on")
    port: int = option(8000, "its port")
    timeout_s: float = option(600.0, "seconds an instance may take to answer (a prefill, a whole decode)",
                              flag="--timeout")  # fmt: skip

    def __post_init__(self) -> None:
        for name in ("prefill", "decode"):
            urls = getattr(self, name)
            if not urls:
                raise ValueError(f"--{name} needs at least one URL")
            if bad := [url for url in urls if not url.startswith(("http://", "https://"))]:
                raise ValueError(f"--{name}: {bad[0]!r} is not an http(s) URL")
