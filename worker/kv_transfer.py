"""The worker's side of the shared-storage KV connector (protocol/kv_transfer.py): a step's loads read an
entry's blocks into the KV pool before the forward; its saves write a prompt prefix's blocks after it.

An entry is one safetensors file: per layer, the blocks in prefix order, in the pool's own layout and dtype
(`layer.{i}`: [num_blocks, *the layer's block shape]). A file is written under a temporary name and renamed,
so a reader sees a whole entry or none (a producer that dies mid-write leaves no entry). A load checks every
layer's shape and dtype against this pool before it writes a block: an entry of another model, block size
or dtype fails its request by the engine's kv_load_failure_policy, and never reaches the forward.
"""

from __future__ import annotations

import logging
import os
import time
from typing import TYPE_CHECKING

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file

from protocol.kv_transfer import KVLoad, KVSave, KVTransferConfig, entry_path

if TYPE_CHECKING:
    from worker.kv_transfer_nixl import NixlKV

logger = logging.getLogger("engine.worker")


class SharedStorageKV:
    def __init__(self, config: KVTransferConfig) -> None:
        self.folder = config.storage_path
        self.num_bytes_loaded = 0
        self.num_bytes_saved = 0
        self.seconds = 0.0  # spent in loads and saves

    def load(self, loads: list[KVLoad], kv_caches: list[torch.Tensor]) -> dict[str, str]:
        """Read each load's blocks into the pool ([num_blocks, *block shape] per layer); the requests whose
        load failed, and why."""
        errors = {}
        for load in loads:
            try:
                self._load_one(load, kv_caches)
            except (OSError, ValueError, SafetensorError) as error:
                errors[load.request_id] = f"entry {load.key[:12]}: {error}"
        return errors

    def _load_one(self, load: KVLoad, kv_caches: list[torch.Tensor]) -> None:
        started = time.perf_counter()
        first, count = load.first_block, len(load.block_ids)
        path = entry_path(self.folder, load.key)
        with safe_open(path, framework="pt") as entry:
            names = set(entry.keys())
            if names != {f"layer.{i}" for i in range(len(kv_caches))}:
                raise ValueError(f"it holds {len(names)} layers; this model has {len(kv_caches)}")
            parts = []
            for i, cache in enumerate(kv_caches):
                part = entry.get_slice(f"layer.{i}")
                shape = part.get_shape()
                if shape[1:] != list(cache.shape[1:]) or shape[0] < first + count:
                    raise ValueError(f"layer {i} is {shape}; this pool's blocks are {list(cache.shape[1:])}")
                blocks = part[first : first + count]  # [count, *block shape]
                if blocks.dtype != cache.dtype:
                    raise ValueError(f"its KV is {blocks.dtype}; this pool's is {cache.dtype}")
                parts.append(blocks)
        # NOTE: every layer is read and checked before any block is written
        index = torch.tensor(load.block_ids, dtype=torch.long, device=kv_caches[0].device)
        for cache, blocks in zip(kv_caches, parts, strict=True):
            cache.index_copy_(0, index, blocks.to(cache.device))
            self.num_bytes_loaded += blocks.numel() * blocks.element_size()
        self.seconds += time.perf_counter() - started

    def save(self, saves: list[KVSave], kv_caches: list[torch.Tensor]) -> None:
        """Write each save's blocks as its entry (an entry already there is the same KV: kept)."""
        for save in saves:
            path = entry_path(self.folder, save.key)
            if path.is_file():
                continue
            started = time.perf_counter()
            index = torch.tensor(save.block_ids, dtype=torch.long, device=kv_caches[0].device)
            tensors = {f"layer.{i}": cache.index_select(0, index).cpu() for i, cache in enumerate(kv_caches)}
            temporary = path.with_name(f".{path.name}.{os.getpid()}.tmp")
            try:
                save_file(tensors, str(temporary))
                os.replace(temporary, path)
            except OSError as error:
                # NOTE: the producer's answer still names the entry; the consumer's policy decides
                logger.error("request %s: KV entry %s not written: %s", save.request_id, save.key[:12], error)
                temporary.unlink(missing_ok=True)
                continue
            self.num_bytes_saved += sum(t.numel() * t.element_size() for t in tensors.values())
            self.seconds += time.perf_counter() - started


def kv_connector_for(config: KVTransferConfig | None) -> SharedStorageKV | NixlKV | None:
    """The worker's side of --kv-transfer-config's connector (None without one)."""
    if config is None:
        return None
    if config.is_nixl:
        from worker.kv_transfer_nixl import NixlKV

        return NixlKV(config)
    return SharedStorageKV(config)
