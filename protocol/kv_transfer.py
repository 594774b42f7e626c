"""KV transfer between engines (disaggregated prefill and decode): vLLM's `--kv-transfer-config` and the
`kv_transfer_params` a request carries, and the load and save jobs a step hands its worker.

A prefill engine (kv_role kv_producer or kv_both) computes a prompt for a request whose params say
`do_remote_decode`, and writes the KV of its block-aligned prefix (every full block before the last
prompt token) to the connector; its answer's `kv_transfer_params` tell a decode engine (kv_consumer or
kv_both) where to read it (`do_remote_prefill`). The decode engine loads those blocks before the request's
first step, as if they were a prefix-cache hit, and computes the rest of the prompt and the output.

Two connectors: the shared-storage one writes each entry to a file in a folder both engines see (one
machine, or a shared file system); the NIXL one keeps each entry in the producer worker's registered host
buffer until a consumer has read it with a NIXL READ (UCX) or it expires.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import msgspec

from protocol.errors import InvalidParameterError

# one connector under vLLM's two names (ExampleConnector was SharedStorageConnector before v0.11)
SHARED_STORAGE = ("SharedStorageConnector", "ExampleConnector")
NIXL = "NixlConnector"
CONNECTORS = (*SHARED_STORAGE, NIXL)
EXTRA_KEYS = {  # kv_connector_extra_config, by connector
    SHARED_STORAGE: {"shared_storage_path"},
    (NIXL,): {"side_channel_host", "side_channel_port", "expiry_s", "remote_hosts"},
}
KV_ROLES = ("kv_producer", "kv_consumer", "kv_both")
FAILURE_POLICIES = ("fail", "recompute")
# vLLM's KVTransferConfig fields for what our connectors do not do: refused unless left at vLLM's default
UNSUPPORTED_KEYS = {
    "kv_rank": None,
    "kv_parallel_size": 1,
    "kv_ip": "127.0.0.1",
    "kv_port": 14579,
    "kv_connector_module_path": None,
    "enable_permute_local_kv": False,
}
# kv_transfer_params keys: ours, and the ones vLLM's proxies send (accepted where null or ours to read)
PARAM_KEYS = frozenset(
    {
        "do_remote_decode",
        "do_remote_prefill",
        "remote_engine_id",
        "remote_block_ids",
        "remote_host",
        "remote_port",
        "remote_request_id",
        "tp_size",
        "remote_key",  # the entry the producer wrote (the prompt prefix's chain hash)
        "remote_num_tokens",  # how many prompt tokens it holds
    }
)


class KVTransferConfig(msgspec.Struct, kw_only=True, frozen=True):
    """--kv-transfer-config, vLLM's JSON (its fields we implement; validate() refuses the rest)."""

    kv_connector: str  # "SharedStorageConnector" (alias "ExampleConnector")
    kv_role: str  # "kv_producer", "kv_consumer" or "kv_both"
    engine_id: str = ""  # this engine's name in the params it returns ("" : set at start)
    kv_connector_extra_config: dict[str, Any] = {}  # shared storage: {"shared_storage_path": folder}
    kv_load_failure_policy: str = "fail"  # a load that fails: "fail" ends the request, "recompute" redoes it
    kv_buffer_device: str = "cpu"  # where KV is staged (vLLM's default is "cuda"; ours is the host)
    kv_buffer_size: int = 1_000_000_000  # NIXL: the producer's staging buffer, in bytes (vLLM's default)

    @property
    def is_producer(self) -> bool:
        return self.kv_role in ("kv_producer", "kv_both")

    @property
    def is_consumer(self) -> bool:
        return self.kv_role in ("kv_consumer", "kv_both")

    @property
    def storage_path(self) -> str:
        return str(self.kv_connector_extra_config.get("shared_storage_path", "/tmp"))

    @property
    def is_nixl(self) -> bool:
        return self.kv_connector == NIXL

    @property
    def side_channel_host(self) -> str:
        """NIXL: where the producer's worker answers lookups (vLLM's VLLM_NIXL_SIDE_CHANNEL_HOST)."""
        return str(self.kv_connector_extra_config.get("side_channel_host", "127.0.0.1"))

    @property
    def side_channel_port(self) -> int:
        return int(self.kv_connector_extra_config.get("side_channel_port", 5600))

    @property
    def remote_hosts(self) -> list[str]:
        """NIXL: the hosts a consumer reads from (a request naming another is refused): loopback by default."""
        hosts = self.kv_connector_extra_config.get("remote_hosts", ["127.0.0.1", "localhost"])
        return [str(host) for host in hosts] if isinstance(hosts, list) else []

    @property
    def expiry_s(self) -> float:
        """NIXL: an entry no consumer read is freed after this long (vLLM's VLLM_NIXL_ABORT_REQUEST_TIMEOUT)."""
        return float(self.kv_connector_extra_config.get("expiry_s", 480.0))


def parse_kv_transfer_config(value: dict[str, Any]) -> KVTransferConfig:
    """vLLM's JSON object -> KVTransferConfig; ValueError naming the key for what we do not do."""
    for key, default in UNSUPPORTED_KEYS.items():
        if value.get(key) not in (default, None):
            raise ValueError(f"{key} is not supported (the connectors here: {', '.join(CONNECTORS)})")
    known = {"kv_connector", "kv_role", "engine_id", "kv_connector_extra_config", "kv_load_failure_policy",
             "kv_buffer_device", "kv_buffer_size"}  # fmt: skip
    if isinstance(value.get("kv_buffer_size"), float) and value["kv_buffer_size"].is_integer():
        value = {**value, "kv_buffer_size": int(value["kv_buffer_size"])}  # (vLLM's is a float: 1e9)
    fields = {k: v for k, v in value.items() if k not in UNSUPPORTED_KEYS}
    if unknown := sorted(set(fields) - known):
        raise ValueError(f"unknown key {unknown[0]!r}")
    fields = {k: v for k, v in fields.items() if v is not None}
    try:
        config = msgspec.convert(fields, KVTransferConfig)
    except msgspec.ValidationError as error:
        raise ValueError(str(error)) from None
    if config.kv_connector not in CONNECTORS:
        raise ValueError(f"kv_connector {config.kv_connector!r} is not one of ours: {', '.join(CONNECTORS)}")
    if config.kv_role not in KV_ROLES:
        raise ValueError(f"kv_role must be one of {', '.join(KV_ROLES)}, got {config.kv_role!r}")
    if config.kv_load_failure_policy not in FAILURE_POLICIES:
        raise ValueError(
            f"kv_load_failure_policy must be 'fail' or 'recompute', got {config.kv_load_failure_policy!r}"
        )
    if config.kv_buffer_device != "cpu":
        raise ValueError(
            f"kv_buffer_device {config.kv_buffer_device!r}: KV is staged on the host ('cpu') here"
        )
    if not config.is_nixl and config.kv_buffer_size != 1_000_000_000:
        raise ValueError(
            f"kv_buffer_size is NixlConnector's (its staging buffer), not {config.kv_connector}'s"
        )
    allowed = next(keys for names, keys in EXTRA_KEYS.items() if config.kv_connector in names)
    if extra := sorted(set(config.kv_connector_extra_config) - allowed):
        raise ValueError(f"kv_connector_extra_config key {extra[0]!r} is not one {config.kv_connector} reads")
    hosts = config.kv_connector_extra_config.get("remote_hosts", [])
    if not isinstance(hosts, list) or not all(isinstance(host, str) and host for host in hosts):
        raise ValueError("kv_connector_extra_config.remote_hosts must be a list of host names")
    if config.kv_buffer_size < 1 or config.expiry_s <= 0 or not 0 < config.side_channel_port < 65536:
        raise ValueError(
            "kv_buffer_size, expiry_s and side_channel_port must be positive (a port below 65536)"
        )
    return config


def check_kv_transfer_params(params: dict[str, Any]) -> None:
    """A request's kv_transfer_params: known keys and types (the engine decides what it can do)."""
    if unknown := sorted(set(params) - PARAM_KEYS):
        raise InvalidParameterError(
            "kv_transfer_params", f"unknown key {unknown[0]!r} in kv_transfer_params."
        )
    for key in ("do_remote_decode", "do_remote_prefill"):
        if not isinstance(params.get(key, False), bool):
            raise InvalidParameterError("kv_transfer_params", f"kv_transfer_params.{key} must be a boolean.")
    if params.get("do_remote_decode") and params.get("do_remote_prefill"):
        raise InvalidParameterError(
            "kv_transfer_params",
            "a request either produces KV (do_remote_decode) or consumes it (do_remote_prefill).",
        )
    remote = params.get("remote_key")
    if remote is not None and not (
        isinstance(remote, str) and len(remote) == 64 and all(c in "0123456789abcdef" for c in remote)
    ):
        raise InvalidParameterError(
            "kv_transfer_params", "kv_transfer_params.remote_key must be 64 hex digits."
        )


def entry_path(folder: str, key: str) -> Path:
    """Where the shared-storage connector keeps an entry (the worker writes and reads it, the scheduler looks)."""
    return Path(folder) / f"engine-kv-{key}.safetensors"


class KVLoad(msgspec.Struct, array_like=True):
    """engine -> worker: before the step, read blocks [first_block, first_block + len(block_ids)) of the
    entry `key` into these blocks of the request's table."""

    request_id: str
    key: str
    first_block: int
    block_ids: list[int]
    remote: str = ""  # NIXL: the producer's side channel, host:port ("": the shared-storage folder)


class KVSave(msgspec.Struct, array_like=True):
    """engine -> worker: after the step, write these blocks (a prompt prefix, in order) as the entry `key`."""

    request_id: str
    key: str
    block_ids: list[int]
