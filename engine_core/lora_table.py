"""The engine's LoRA table: the adapters requests may name, one state for every frontend.

Loading asks the worker first (it reads and checks the folder; nothing is kept when it refuses), then
adds the row. Unloading takes the name out at once (new requests naming it get a 404, and the name may
be loaded again); the adapter itself retires: requests already running or waiting on it finish, and
the worker frees it when the last one has (`sweep`, after each step that ended a request).

Invariants: names are unique; ids are never reused (a name loaded again gets a new id, so neither the
worker's weights nor the prefix cache's blocks of the old one can serve it); a retiring adapter has at
least one unfinished request once a sweep has run.
"""

from __future__ import annotations

import os
from collections.abc import Iterable

import msgspec

from engine_core.executor import Executor
from engine_core.request import Request
from protocol.errors import InvalidParameterError
from protocol.lora import LoraAdapter, LoraConfig, LoraRequest
from protocol.worker_messages import WorkerCall


class LoraTable:
    def __init__(self, config: LoraConfig | None, executor: Executor, served_names: list[str]) -> None:
        self.config = config
        self.executor = executor
        self.served_names = served_names  # an adapter may not take one: requests naming it reach the base
        self.adapters: dict[str, LoraAdapter] = {}  # by name: what new requests may name
        self.retiring: dict[int, LoraAdapter] = {}  # by id: unloaded (or replaced) while requests use them
        self.next_id = 1

    def _require_enabled(self, param: str) -> None:
        if self.config is None:
            raise InvalidParameterError(param, "LoRA is not enabled: start the server with --enable-lora.")

    def load(
        self,
        name: str,
        path: str,
        base_model_name: str | None = None,
        replace: bool = False,
        requests: Iterable[Request] = (),
    ) -> LoraAdapter:
        """replace: a loaded `name` gives way to the new folder (vLLM's load_inplace); its running
        requests finish on the old weights."""
        self._require_enabled("lora_name")
        if not name:
            raise InvalidParameterError("lora_name", "lora_name must not be empty.")
        if name in self.served_names:
            raise InvalidParameterError(
                "lora_name", f"`{name}` is the served model's name; give the adapter another."
            )
        if name in self.adapters and not replace:
            raise InvalidParameterError(
                "lora_name",
                f"The LoRA adapter `{name}` is already loaded (unload it first, or load_inplace).",
            )
        path = os.path.abspath(os.path.expanduser(path))
        adapter = LoraAdapter(name=name, path=path, base_model_name=base_model_name, lora_id=self.next_id)
        request = LoraRequest(adapter.lora_id, name, path)
        answer = self.executor.call(WorkerCall("add_lora", [msgspec.to_builtins(request)]))
        if answer.error is not None:
            raise InvalidParameterError(answer.param or "lora_path", answer.error)
        self.next_id += 1
        if name in self.adapters:
            self._retire(self.adapters[name], requests)
        self.adapters[name] = adapter
        return adapter

    def unload(self, name: str, requests: Iterable[Request]) -> LoraAdapter:
        """Drop `name` now, or once the requests that use it are done; the name is free at once."""
        self._require_enabled("lora_name")
        adapter = self.adapters.get(name)
        if adapter is None:
            raise InvalidParameterError(
                "lora_name", f"The LoRA adapter `{name}` is not loaded.", code="model_not_found"
            )
        self._retire(adapter, requests)
        return adapter

    def _retire(self, adapter: LoraAdapter, requests: Iterable[Request]) -> None:
        del self.adapters[adapter.name]
        self.retiring[adapter.lora_id] = msgspec.structs.replace(adapter, unloading=True)
        self.sweep(requests)

    def resolve(self, name: str) -> LoraRequest:
        """The adapter a new request names, or the 404 it gets."""
        adapter = self.adapters.get(name)
        if adapter is None:
            raise InvalidParameterError(
                "model", f"The model `{name}` does not exist.", code="model_not_found"
            )
        return LoraRequest(adapter.lora_id, adapter.name, adapter.path)

    def sweep(self, requests: Iterable[Request]) -> None:
        """Free the retiring adapters no unfinished request uses any more (the worker drops them)."""
        if not self.retiring:
            return
        done = dict(self.retiring)
        for request in requests:
            if request.lora is not None:
                done.pop(request.lora.lora_id, None)
        for lora_id in done:
            del self.retiring[lora_id]
            self.executor.call(WorkerCall("remove_lora", [lora_id]))

    def listed(self) -> list[LoraAdapter]:
        return list(self.adapters.values())
