"""The scheduler's side of KV transfer (protocol/kv_transfer.py), for the shared-storage connector: which
requests load remote KV and which write theirs, step by step.

A consumer request (kv_transfer_params.do_remote_prefill) is admitted like a prefix-cache hit that reaches
further: its local hit, then the entry's blocks past it, count as computed, and the step's KVLoad has the
worker read them before the forward. A producer request (do_remote_decode) has its entry written in the
step that computes its last prompt token (KVSave), and its final output carries the params a decode engine
needs. An entry is written once and read by any number of engines; the folder's owner prunes it (the
producer holds no block for it).

Invariants:
- an entry holds the block-aligned prefix before the last prompt token (the token whose logits sample the
  first output is always computed where the request decodes), and is named by the chain hash of its last
  block, which covers the prompt, its images and its cache salt: two requests share an entry only if they
  share that prefix;
- a load is planned only in the step that admits its request, into blocks the request holds past its local
  hit; those blocks are indexed for the prefix cache only after the step's output reports no load error;
- a failed load never shows a token: "fail" ends the request with an error, "recompute" frees its blocks
  unindexed and computes the prompt here.
"""

from __future__ import annotations

import logging
import uuid
from pathlib import Path
from typing import Any

import msgspec

from engine_core.request import Request, RequestStatus
from protocol.config import ParallelConfig
from protocol.errors import InvalidParameterError
from protocol.kv_transfer import KVLoad, KVSave, KVTransferConfig, check_kv_transfer_params, entry_path
from protocol.messages import ModelInfo, RequestError, RequestOutput

logger = logging.getLogger("engine.core")


def kv_transfer_for(
    config: KVTransferConfig | None, info: ModelInfo, parallel: ParallelConfig
) -> KVTransferScheduler | None:
    """The scheduler's connector for --kv-transfer-config, or a start error naming what it cannot carry."""
    if config is None:
        return None
    refused = (
        "a model with sliding-window layers" if info.kv_window or info.num_window_blocks else
        "an encoder-decoder model" if info.encoder_len else
        "a pooling model" if info.runner == "pooling" else
        "tensor parallel" if parallel.tensor_parallel_size > 1 else None
    )  # fmt: skip
    if refused:
        raise ValueError(f"--kv-transfer-config does not take {refused} yet")
    path = Path(config.storage_path)
    if not config.is_nixl and not path.is_dir():
        raise ValueError(f"--kv-transfer-config: shared_storage_path {path} is not a folder")
    engine_id = config.engine_id or f"engine-{uuid.uuid4().hex[:12]}"
    return KVTransferScheduler(msgspec.structs.replace(config, engine_id=engine_id), info.block_size)


class KVTransferScheduler:
    def __init__(self, config: KVTransferConfig, block_size: int) -> None:
        self.config = config
        self.block_size = block_size
        self.loads: list[KVLoad] = []  # planned this step (taken by the step's output)

    def entry_tokens(self, request: Request) -> int:
        """The prompt prefix an entry holds: the full blocks before the last prompt token."""
        return (request.num_prompt_tokens - 1) // self.block_size * self.block_size

    def entry_key(self, request: Request) -> str | None:
        num_blocks = self.entry_tokens(request) // self.block_size
        return request.block_hashes[num_blocks - 1].hex() if num_blocks else None

    def add(self, request: Request, params: dict[str, Any]) -> None:
        """A new request's kv_transfer_params: checked, and its load or save decided."""
        check_kv_transfer_params(params)
        config = self.config
        network = ["remote_block_ids", "remote_request_id", "tp_size"]
        network += [] if config.is_nixl else ["remote_host", "remote_port"]
        for name in network:
            if params.get(name) is not None:  # vLLM's NIXL connector's: ours find the KV by the prompt
                raise InvalidParameterError(
                    "kv_transfer_params",
                    f"kv_transfer_params.{name} is not {config.kv_connector}'s: it finds the "
                    "KV by the prompt (remote_key).",
                )
        if request.lora is not None or request.mm_inputs or request.pooling_params is not None:
            what = (
                "a LoRA adapter" if request.lora is not None else "images" if request.mm_inputs else "pooling"
            )
            raise InvalidParameterError(
                "kv_transfer_params", f"KV transfer does not take a request with {what} yet."
            )
        if params.get("do_remote_decode"):
            if not config.is_producer:
                raise InvalidParameterError(
                    "kv_transfer_params",
                    f"this engine's kv_role is {config.kv_role}: it does not produce KV.",
                )
            request.kv_save = True
        if not params.get("do_remote_prefill"):
            return
        if not config.is_consumer:
            raise InvalidParameterError(
                "kv_transfer_params", f"this engine's kv_role is {config.kv_role}: it does not load KV."
            )
        key, remote = self.entry_key(request), params.get("remote_key")
        if remote is not None and remote != key:
            raise InvalidParameterError(
                "kv_transfer_params", "kv_transfer_params.remote_key is another prompt's KV, not this one's."
            )
        if key is None:
            return  # a prompt shorter than a block and a token: nothing was written, all is computed here
        tokens = params.get("remote_num_tokens")
        if tokens is not None and tokens != self.entry_tokens(request):  # another block size, another prompt
            raise InvalidParameterError(
                "kv_transfer_params",
                f"remote_num_tokens {tokens} is not this engine's entry of the prompt ({self.entry_tokens(request)} "
                "tokens): the producer's block size must be this engine's.",
            )
        logger.debug("request %s loads entry %s from engine %s", request.request_id, key[:12],
                     params.get("remote_engine_id"))  # fmt: skip
        if config.is_nixl:
            if remote is None:
                return  # the producer kept nothing (its prompt was as short)
            host, port = params.get("remote_host"), params.get("remote_port")
            if not isinstance(host, str) or not isinstance(port, int) or not 0 < port < 65536:
                raise InvalidParameterError(
                    "kv_transfer_params",
                    "NixlConnector reads from remote_host and remote_port (the prefill's answer).",
                )
            if host not in config.remote_hosts:  # the worker connects only where the operator allows
                raise InvalidParameterError(
                    "kv_transfer_params",
                    f"remote_host {host!r} is not one this engine reads KV from (kv_connector_extra_config."
                    "remote_hosts).",
                )
            request.kv_load_key, request.kv_load_remote = key, f"{host}:{port}"
            return
        if not entry_path(config.storage_path, key).is_file():
            if config.kv_load_failure_policy == "fail":
                raise InvalidParameterError(
                    "kv_transfer_params",
                    f"no KV for this prompt in {config.storage_path} (kv_load_failure_policy is fail).",
                )
            logger.warning(
                "request %s: no KV entry %s; computing its prompt here", request.request_id, key[:12]
            )
            return
        request.kv_load_key = key

    def remote_tokens(self, request: Request, num_local: int) -> int:
        """Tokens past a waiting request's local hit that its entry holds (0: none to load)."""
        if request.kv_load_key is None or request.sampling_params.prompt_logprobs is not None:
            return 0  # (prompt logprobs need every prompt position's logits, as with a prefix hit)
        return max(self.entry_tokens(request) - num_local, 0)

    def plan_load(self, request: Request, block_ids: list[int], num_local: int, num_remote: int) -> None:
        first = num_local // self.block_size
        count = num_remote // self.block_size
        assert request.kv_load_key is not None and num_local % self.block_size == 0
        self.loads.append(
            KVLoad(
                request.request_id,
                request.kv_load_key,
                first,
                block_ids[first : first + count],
                request.kv_load_remote,
            )
        )

    def plan_save(self, request: Request, block_ids: list[int]) -> list[KVSave]:
        """The entry to write after the step that a producer request's prompt ends in (once), if any."""
        if request.kv_saved or request.num_computed_after_flight < request.num_prompt_tokens:
            return []
        request.kv_saved = True
        key = self.entry_key(request)
        if key is None:
            return []
        return [KVSave(request.request_id, key, block_ids[: self.entry_tokens(request) // self.block_size])]

    def take_loads(self) -> list[KVLoad]:
        loads, self.loads = self.loads, []
        return loads

    def finished_params(self, request: Request) -> dict[str, Any] | None:
        """A finished producer request's kv_transfer_params: what a decode engine's request carries."""
        if not request.kv_save:
            return None
        key = self.entry_key(request) if request.kv_saved else None
        return {
            "do_remote_prefill": True,
            "do_remote_decode": False,
            "remote_engine_id": self.config.engine_id,
            "remote_key": key,
            "remote_num_tokens": self.entry_tokens(request) if key is not None else 0,
            "remote_block_ids": None,
            "remote_host": self.config.side_channel_host if self.config.is_nixl else None,
            "remote_port": self.config.side_channel_port if self.config.is_nixl else None,
        }

    def load_failed(self, request: Request, reason: str) -> RequestOutput | None:
        """A load the worker could not do: under "fail" the request ends, with this output; under "recompute"
        (None) the scheduler preempts it, and it computes its prompt here."""
        logger.warning("request %s: KV load failed (%s)", request.request_id, reason)
        request.kv_load_key = None
        if self.config.kv_load_failure_policy != "fail":
            return None
        request.status = RequestStatus.FINISHED_ERROR
        error = RequestError("kv_transfer_params", f"the remote KV could not be loaded: {reason}")
        return RequestOutput(request.request_id, [], "error", error=error)
