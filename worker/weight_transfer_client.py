"""The trainer's side of weight updates for RL loops (docs/rl-weight-updates.md): join a running
`engine serve --weight-transfer-config ...` as rank 0 of its weight group and send it a model's weights.

    client = WeightTransferClient("http://127.0.0.1:8000")
    client.init()                      # the rendezvous: every worker rank of the engine joins
    client.send(model.named_parameters(), version="step-100")   # start, update (broadcast), finish
    # or step by step: client.start(mode="keep"); client.update(...); client.finish(version=...)
    client.close()

Each call drives the server's dev-mode routes over HTTP (urllib: nothing to install beyond torch) while
this process runs its side of the collective; a failure is a WeightTransferError with the server's
message, and leaves the server's weights as they were.
"""

from __future__ import annotations

import json
import socket
import threading
import urllib.error
import urllib.request
from collections.abc import Iterable
from typing import Any

import torch

from protocol.weight_transfer import DEFAULT_BUFFER_BYTES, DEFAULT_NUM_BUFFERS, InitInfo, UpdateInfo
from worker.weight_transfer import broadcast_all, join_group, pack


class WeightTransferError(RuntimeError):
    pass


class WeightTransferClient:
    def __init__(
        self,
        base_url: str,
        api_key: str | None = None,
        master_address: str = "127.0.0.1",
        master_port: int = 0,
        backend: str = "gloo",
        timeout_s: float = 300.0,
    ) -> None:
        """master_address: where the engine's ranks reach this process (its TCPStore and gloo pairs)."""
        self.base_url, self.api_key = base_url.rstrip("/"), api_key
        self.master_address, self.master_port = master_address, master_port
        self.backend, self.timeout_s = backend, timeout_s
        self.group: Any = None

    def request(self, method: str, path: str, body: dict[str, Any] | None = None) -> Any:
        data = json.dumps(body).encode() if body is not None else None
        headers = {"Content-Type": "application/json"}
        if self.api_key:
            headers["Authorization"] = f"Bearer {self.api_key}"
        call = urllib.request.Request(f"{self.base_url}{path}", data=data, headers=headers, method=method)
        try:
            with urllib.request.urlopen(call, timeout=self.timeout_s + 60) as answer:
                text = answer.read()
        except urllib.error.HTTPError as error:
            raise WeightTransferError(
                f"{method} {path}: {error.code} {error.read().decode(errors='replace')}"
            ) from None
        return json.loads(text) if text else None

    def init(self) -> dict[str, Any]:
        """Join the engine's weight group as rank 0 (the engine's worker ranks are 1..N)."""
        num_ranks = int(self.request("GET", "/get_world_size")["world_size"])
        port = self.master_port or _free_port(self.master_address)
        info = InitInfo(self.master_address, port, rank_offset=1, world_size=num_ranks + 1)
        body = {"init_info": {f: getattr(info, f) for f in info.__struct_fields__}}
        answer, thread = _in_background(lambda: self.request("POST", "/init_weight_transfer_engine", body))
        self.group = join_group(info, 0, self.backend, self.timeout_s)
        thread.join()
        group: dict[str, Any] = _result(answer)
        return group

    def start(self, mode: str = "keep") -> dict[str, Any]:
        """Open an update; the engine pauses in `mode` (as /pause: abort, wait or keep) until finish."""
        if self.group is None:
            raise WeightTransferError("call init() first")
        answer: dict[str, Any] = self.request(
            "POST", "/start_weight_update", {"is_checkpoint_format": True, "mode": mode}
        )
        return answer

    def update(
        self,
        weights: Iterable[tuple[str, torch.Tensor]],
        packed: bool = True,
        buffer_bytes: int = DEFAULT_BUFFER_BYTES,
        num_buffers: int = DEFAULT_NUM_BUFFERS,
    ) -> dict[str, Any]:
        """Broadcast weights, by their Hugging Face names, into the open update (several calls may add up)."""
        named = [(name, tensor.detach().cpu().contiguous()) for name, tensor in weights]
        info = UpdateInfo(
            names=[name for name, _ in named], dtype_names=[str(t.dtype).removeprefix("torch.") for _, t in named],
            shapes=[list(t.shape) for _, t in named], packed=packed, packed_buffer_size_bytes=buffer_bytes,
            packed_num_buffers=num_buffers,
        )  # fmt: skip
        body = {"update_info": {f: getattr(info, f) for f in info.__struct_fields__}}
        answer, thread = _in_background(lambda: self.request("POST", "/update_weights", body))
        try:
            broadcast_all(self.group, pack(info, [t for _, t in named]), num_buffers)
        finally:
            thread.join()
        state: dict[str, Any] = _result(answer)
        return state

    def finish(self, version: str | None = None) -> dict[str, Any]:
        """Serve the update (every weight of the checkpoint must have come) and resume."""
        done: dict[str, Any] = self.request("POST", "/finish_weight_update")
        if version is not None:
            done = self.request("POST", "/update_weight_version", {"version": version})
        return done

    def send(
        self,
        weights: Iterable[tuple[str, torch.Tensor]],
        packed: bool = True,
        buffer_bytes: int = DEFAULT_BUFFER_BYTES,
        num_buffers: int = DEFAULT_NUM_BUFFERS,
        mode: str = "keep",
        version: str | None = None,
    ) -> dict[str, Any]:
        """One whole update: start, every weight of the checkpoint (a model's named_parameters(), or a
        state dict's items()), finish."""
        self.start(mode)
        self.update(weights, packed, buffer_bytes, num_buffers)
        return self.finish(version)

    def close(self) -> None:
        self.group = None


def _free_port(host: str) -> int:
    with socket.socket() as probe:
        probe.bind((host, 0))
        return int(probe.getsockname()[1])


def _in_background(call: Any) -> tuple[dict[str, Any], threading.Thread]:
    """Run an HTTP call that blocks until this process's collective side is done."""
    answer: dict[str, Any] = {}

    def run() -> None:
        try:
            answer["value"] = call()
        except Exception as error:  # noqa: BLE001 (handed to the caller)
            answer["error"] = error

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return answer, thread


def _result(answer: dict[str, Any]) -> Any:
    if "error" in answer:
        raise answer["error"]
    return answer.get("value")
