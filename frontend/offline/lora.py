"""LoRA in the offline API: `LLM.generate(prompts, params, lora_request=LoRARequest(name, id, path))`,
vLLM's spelling. The adapter is loaded into the engine's table on first use (as POST
/v1/load_lora_adapter would), and a request names it by `lora_name` from then on."""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

from frontend.engine.data_parallel import EngineClient
from protocol.errors import InvalidParameterError


@dataclass(frozen=True)
class LoRARequest:
    """vLLM's LoRARequest. lora_int_id: vLLM's identity of the adapter; here the engine gives its own ids,
    so it must only be positive, and one id must keep one name (a different name under it is an error)."""

    lora_name: str
    lora_int_id: int
    lora_path: str
    base_model_name: str | None = None

    def __post_init__(self) -> None:
        if self.lora_int_id < 1:
            raise ValueError(f"lora_int_id must be positive, got {self.lora_int_id}")


class LoraLoader:
    """Loads each LoRARequest's adapter into the engine once; remembers the names of the ids it saw."""

    def __init__(self) -> None:
        self.names: dict[int, str] = {}

    async def ensure(self, client: EngineClient, lora: LoRARequest, base: str) -> str:
        """The adapter's name, loaded (again, in place, where its folder changed)."""
        known = self.names.setdefault(lora.lora_int_id, lora.lora_name)
        if known != lora.lora_name:
            raise InvalidParameterError(
                "lora_request", f"lora_int_id {lora.lora_int_id} is {known!r}, not {lora.lora_name!r}"
            )
        loaded: list[dict[str, Any]] = await client.call_utility("list_loras")
        paths = {adapter["name"]: adapter["path"] for adapter in loaded}
        if lora.lora_name not in paths or not _same_folder(paths[lora.lora_name], lora.lora_path):
            replace = lora.lora_name in paths
            await client.call_utility(
                "load_lora", lora.lora_name, lora.lora_path, lora.base_model_name or base, replace
            )
        return lora.lora_name


def _same_folder(a: str, b: str) -> bool:
    return os.path.abspath(os.path.expanduser(a)) == os.path.abspath(os.path.expanduser(b))
