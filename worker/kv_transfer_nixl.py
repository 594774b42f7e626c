"""The worker's side of the NIXL KV connector (protocol/kv_transfer.py): a producer keeps each prompt prefix's
blocks in a staging arena registered with NIXL until a consumer has read them or they expire; a consumer
reads them with one NIXL READ (UCX: shared memory on one machine, TCP between machines with UCX_TLS=tcp)
straight into its own KV pool's blocks, which it registers too.

What NIXL does not carry, a small side channel does (ZeroMQ, msgpack): a consumer asks the producer's
worker where an entry lies (its agent's metadata, the entry's address and layout), and says when it has
read it, which frees the entry. The data moves only through NIXL.

Invariants:
- an entry is published (answered for) only once its bytes are all in the arena; it is freed only after a
  consumer's "done" or its expiry, and a lookup renews its expiry, so no read races a reuse of its bytes;
- a consumer checks the entry's layout (layers, block shape, dtype, blocks) against its pool before it
  starts the READ; a failure is the request's load error (the engine's kv_load_failure_policy decides).
"""

from __future__ import annotations

import logging
import threading
import time
import uuid
from typing import Any

import msgspec
import torch
import zmq

from protocol.kv_transfer import KVLoad, KVSave, KVTransferConfig

logger = logging.getLogger("engine.worker")

POLL_S = 0.05  # the side channel's poll: how soon a "done" or an expiry frees an entry
ANSWER_TIMEOUT_MS = 10_000  # a producer that does not answer a lookup in this long fails the load
MAX_ANSWER_BYTES = (
    1 << 20
)  # a lookup's answer is an agent's metadata and a few numbers: a bigger one is refused
READ_TIMEOUT_S = 30.0  # a READ that takes longer fails (and its producer stops serving it)


class EntryInfo(msgspec.Struct):
    """A producer's answer to a lookup (decoded strictly: an answer of another shape fails the load)."""

    agent: str
    metadata: bytes
    address: int
    shape: list[int]
    dtype: str
    num_layers: int
    num_blocks: int


def block_bytes(cache: torch.Tensor) -> int:
    return cache[0].numel() * cache.element_size()


class Arena:
    """First-fit ranges of a byte buffer, coalesced when freed."""

    def __init__(self, size: int) -> None:
        self.free: list[tuple[int, int]] = [(0, size)]  # (offset, size), by offset

    def take(self, size: int) -> int | None:
        for i, (offset, room) in enumerate(self.free):
            if room >= size:
                self.free[i : i + 1] = [(offset + size, room - size)] if room > size else []
                return offset
        return None

    def give(self, offset: int, size: int) -> None:
        self.free.append((offset, size))
        self.free.sort()
        merged: list[tuple[int, int]] = []
        for start, room in self.free:
            if merged and merged[-1][0] + merged[-1][1] == start:
                merged[-1] = (merged[-1][0], merged[-1][1] + room)
            else:
                merged.append((start, room))
        self.free = merged


class NixlKV:
    def __init__(self, config: KVTransferConfig) -> None:
        from nixl._api import nixl_agent, nixl_agent_config

        self.config = config
        self.name = f"engine-{uuid.uuid4().hex[:12]}"
        self.context = zmq.Context()
        # the side channel binds first: UCX's TCP transport listens on ports of its own choosing, which could
        # take the side channel's; and a start that fails leaves no socket for the collector, whose
        # Context.__del__ would wait on it (a CI run hung 600 s in a later test's import that way)
        try:
            if config.is_producer:
                self.socket = self.context.socket(zmq.REP)
                self.socket.setsockopt(zmq.LINGER, 0)
                self.socket.bind(f"tcp://{config.side_channel_host}:{config.side_channel_port}")
            self._start(config, nixl_agent(self.name, nixl_agent_config(
                enable_prog_thread=False, enable_listen_thread=False, backends=["UCX"])))  # fmt: skip
        except BaseException:
            self.context.destroy(linger=0)
            raise

    def _start(self, config: KVTransferConfig, agent: Any) -> None:
        # NOTE: no progress thread (the agent's config above): NIXL's spins a core even when idle (its delay
        # is 0 and not exposed). A consumer progresses its READ by polling it; the producer's side channel
        # progresses the agent while a read it answered for is under way (UCX over TCP serves a READ from the
        # owner's side)
        self.agent = agent
        self.lock = threading.Lock()
        self.entries: dict[str, dict[str, Any]] = {}  # key -> offset, size, layout, deadline
        self.remotes: dict[str, Any] = {}  # side-channel address -> REQ socket
        self.known_agents: set[str] = set()
        self.pool_regs: Any = None  # the KV pool's registration (consumer), and the pointers it covers
        self.pool_ptrs: list[int] = []
        self.num_bytes_loaded = 0
        self.num_bytes_saved = 0
        self.seconds = 0.0
        self.stopping = threading.Event()
        self.thread: threading.Thread | None = None
        if config.is_producer:
            self.arena_tensor = torch.empty(config.kv_buffer_size, dtype=torch.uint8)
            self.arena_reg = self.agent.register_memory(self.arena_tensor)
            self.arena = Arena(config.kv_buffer_size)
            self.thread = threading.Thread(target=self._serve, name="kv-side-channel", daemon=True)
            self.thread.start()

    # ---- the producer ----

    def save(self, saves: list[KVSave], kv_caches: list[torch.Tensor]) -> None:
        for save in saves:
            with self.lock:
                if save.key in self.entries:
                    self.entries[save.key]["deadline"] = time.monotonic() + self.config.expiry_s
                    continue
                self._expire()
                sizes = [block_bytes(cache) * len(save.block_ids) for cache in kv_caches]
                offset = self.arena.take(sum(sizes))
            if offset is None:
                logger.error("request %s: the KV buffer (kv_buffer_size %d) is full; its entry is not kept",
                             save.request_id, self.config.kv_buffer_size)  # fmt: skip
                continue
            started = time.perf_counter()
            index = torch.tensor(save.block_ids, dtype=torch.long, device=kv_caches[0].device)
            at = offset
            for cache, size in zip(kv_caches, sizes, strict=True):
                blocks = cache.index_select(0, index).cpu().contiguous().view(torch.uint8).reshape(-1)
                self.arena_tensor[at : at + size].copy_(blocks)
                at += size
            layout = {"shape": list(kv_caches[0].shape[1:]), "dtype": str(kv_caches[0].dtype),
                      "num_layers": len(kv_caches), "num_blocks": len(save.block_ids)}  # fmt: skip
            with self.lock:  # published once its bytes are in
                self.entries[save.key] = {"offset": offset, "size": sum(sizes), "layout": layout,
                                          "deadline": time.monotonic() + self.config.expiry_s}  # fmt: skip
            self.num_bytes_saved += sum(sizes)
            self.seconds += time.perf_counter() - started

    def _expire(self) -> None:
        now = time.monotonic()
        for key in [k for k, entry in self.entries.items() if entry["deadline"] < now]:
            logger.warning("KV entry %s expired unread after %.0f s", key[:12], self.config.expiry_s)
            self._free(key)

    def _free(self, key: str) -> None:
        entry = self.entries.pop(key, None)
        if entry is not None:
            self.arena.give(entry["offset"], entry["size"])

    def _serve(self) -> None:
        """The side channel: lookups and "done"s from consumers, and expiries. While a read it answered for is
        under way (until its "done", or READ_TIMEOUT_S), it progresses the agent between polls."""
        poller = zmq.Poller()
        poller.register(self.socket, zmq.POLLIN)
        reading: dict[str, float] = {}  # key -> when its reader gives up
        while not self.stopping.is_set():
            if poller.poll(0 if reading else int(POLL_S * 1000)):
                request = msgspec.msgpack.decode(self.socket.recv())
                answer = self._answer(request)
                self.socket.send(msgspec.msgpack.encode(answer))
                key = request.get("key", "")
                if request.get("done"):
                    reading.pop(key, None)
                elif "error" not in answer:
                    reading[key] = time.monotonic() + READ_TIMEOUT_S
            if reading:
                self.agent.get_new_notifs()  # (progresses the UCX worker: the READ's bytes go out)
                now = time.monotonic()
                reading = {key: until for key, until in reading.items() if until > now}
            with self.lock:
                self._expire()

    def _answer(self, request: dict[str, Any]) -> dict[str, Any]:
        key = request.get("key", "")
        with self.lock:
            if request.get("done"):
                self._free(key)
                return {}
            entry = self.entries.get(key)
            if entry is None:
                return {"error": "no such entry (never written, already read, or expired)"}
            entry["deadline"] = time.monotonic() + self.config.expiry_s  # the reader's lease
            address = self.arena_tensor.data_ptr() + entry["offset"]
            return {"agent": self.name, "metadata": self.agent.get_agent_metadata(), "address": address,
                    **entry["layout"]}  # fmt: skip

    # ---- the consumer ----

    def load(self, loads: list[KVLoad], kv_caches: list[torch.Tensor]) -> dict[str, str]:
        errors = {}
        for load in loads:
            try:
                self._load_one(load, kv_caches)
            except Exception as error:  # a remote's answer, or NIXL on it, may fail any way: the load fails
                # NOTE: the engine lets a request name only producers on its remote_hosts allow-list
                errors[load.request_id] = f"entry {load.key[:12]} at {load.remote}: {error}"
        return errors

    def _ask(self, remote: str, request: dict[str, Any]) -> Any:
        socket = self.remotes.get(remote)
        if socket is None:
            socket = self.remotes[remote] = self.context.socket(zmq.REQ)
            socket.setsockopt(zmq.RCVTIMEO, ANSWER_TIMEOUT_MS)
            socket.setsockopt(zmq.LINGER, 0)
            socket.setsockopt(zmq.MAXMSGSIZE, MAX_ANSWER_BYTES)
            socket.connect(f"tcp://{remote}")
        try:
            socket.send(msgspec.msgpack.encode(request))
            return msgspec.msgpack.decode(socket.recv())
        except zmq.ZMQError:
            socket.close()  # a REQ socket whose answer never came cannot ask again
            del self.remotes[remote]
            raise OSError(
                f"the producer at {remote} did not answer in {ANSWER_TIMEOUT_MS / 1000:.0f} s"
            ) from None

    def _register_pool(self, kv_caches: list[torch.Tensor]) -> None:
        pointers = [cache.data_ptr() for cache in kv_caches]
        if pointers == self.pool_ptrs:
            return
        if self.pool_regs is not None:  # (a pool made again: a wake after sleep)
            self.agent.deregister_memory(self.pool_regs)
        self.pool_regs = self.agent.register_memory(list(kv_caches))
        self.pool_ptrs = pointers

    def _load_one(self, load: KVLoad, kv_caches: list[torch.Tensor]) -> None:
        started = time.perf_counter()
        answer = self._ask(load.remote, {"key": load.key})
        if isinstance(answer, dict) and isinstance(answer.get("error"), str):
            raise ValueError(answer["error"][:200])
        try:
            info = msgspec.convert(answer, EntryInfo, strict=True)
        except msgspec.ValidationError as error:
            raise ValueError(f"the producer's answer is not an entry's ({error})") from None
        first, count = load.first_block, len(load.block_ids)
        shape, dtype = list(kv_caches[0].shape[1:]), str(kv_caches[0].dtype)
        if (info.num_layers, info.shape, info.dtype) != (len(kv_caches), shape, dtype):
            raise ValueError(f"it holds {info.num_layers} layers of {info.shape} {info.dtype}; this pool has "
                             f"{len(kv_caches)} of {shape} {dtype}")  # fmt: skip
        if info.num_blocks < first + count:
            raise ValueError(f"it holds {info.num_blocks} blocks, not {first + count}")
        self._register_pool(kv_caches)
        if info.agent not in self.known_agents:
            self.agent.add_remote_agent(info.metadata)
            self.known_agents.add(info.agent)
        local, remote = [], []
        base = info.address
        for cache in kv_caches:
            size = block_bytes(cache)
            for j, block_id in enumerate(load.block_ids):
                local.append((cache.data_ptr() + block_id * size, size, 0))
                remote.append((base + (first + j) * size, size, 0))
            base += info.num_blocks * size
        handle = self.agent.initialize_xfer("READ", self.agent.get_xfer_descs(local, "DRAM"),
                                            self.agent.get_xfer_descs(remote, "DRAM"), info.agent)  # fmt: skip
        deadline = time.monotonic() + READ_TIMEOUT_S
        try:
            state = self.agent.transfer(handle)
            while state == "PROC" and time.monotonic() < deadline:
                state = self.agent.check_xfer_state(handle)
            if state != "DONE":
                raise RuntimeError(f"the NIXL READ ended {state}")
        finally:
            self.agent.release_xfer_handle(handle)
            self._ask(load.remote, {"key": load.key, "done": True})  # (the producer stops serving it)
        self.num_bytes_loaded += sum(size for _, size, _ in local)
        self.seconds += time.perf_counter() - started

    def close(self) -> None:
        self.stopping.set()
        if self.thread is not None:
            self.thread.join(timeout=5)
        self.context.destroy(linger=0)
