"""OpenAIServing: what every OpenAI door of an API server shares (the engine, the tokenizer, the model's
limits, sampling defaults, admission limits), and the checks each request passes first."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from frontend.audio.limits import AudioLimits
from frontend.audio.speech_model import SpeechModel
from frontend.engine.async_llm import AsyncLLM
from frontend.engine.data_parallel import EngineClient
from frontend.openai.format import TokenText
from frontend.openai.structured import SpecValidator
from frontend.parsers.registry import Parsers
from frontend.responses.mcp_client import ToolServers
from frontend.responses.store import ResponseStore
from frontend.server.admission import AdmissionLimits, admit
from frontend.server.errors import OpenAIError
from frontend.vision.loader import ImageLoader
from protocol.messages import ModelInfo


@dataclass
class OpenAIServing:
    llm: AsyncLLM
    model_info: ModelInfo
    chat_template: str | None = None
    defaults: dict[str, Any] = field(default_factory=dict)  # generation-config values for unset fields
    limits: AdmissionLimits = field(default_factory=AdmissionLimits)
    draining: bool = False  # set on SIGTERM: new requests get 503, open ones may finish
    parsers: Parsers = field(default_factory=Parsers)
    enable_auto_tool_choice: bool = False
    tool_call_parser: str | None = None  # a name in parsers
    reasoning_parser: str | None = None  # a name in parsers
    responses: ResponseStore = field(default_factory=lambda: ResponseStore(":memory:", 1000, 64 << 20))
    tool_servers: ToolServers = field(default_factory=lambda: ToolServers([], 30.0))  # --tool-server
    mcp_allowed_urls: list[str] = field(default_factory=list)  # --mcp-allowed-urls
    system_fingerprint: str | None = None  # of every chat and completion body and chunk (fingerprint.py)
    response_role: str = "assistant"  # of chat answers (--response-role)
    force_include_usage: bool = (
        False  # usage in every stream, asked for or not (--enable-force-include-usage)
    )
    speech: SpeechModel | None = None  # a speech-to-text model's features and prompts (frontend/audio/)
    audio_limits: AudioLimits = field(default_factory=AudioLimits)  # the audio doors' upload limits
    images: ImageLoader | None = None  # a vision-language model's image parts (frontend/vision/)

    def __post_init__(self) -> None:
        self.token_text = TokenText(self.tokenizer)
        self.validator = SpecValidator(self.model_info.structured_outputs_backend)
        if self.tool_call_parser is not None:
            self.parsers.tool_parser(self.tool_call_parser)  # ValueError now, not on the first request
        if self.reasoning_parser is not None:
            self.parsers.reasoning_parser(self.reasoning_parser)

    @property
    def client(self) -> EngineClient:
        return self.llm.client

    @property
    def tokenizer(self) -> Any | None:
        return self.llm.tokenizer

    def include_usage(self, options: Any) -> bool:
        """Whether a stream ends with a usage chunk: stream_options.include_usage, or the server's force."""
        return self.force_include_usage or (options is not None and bool(options.include_usage))

    def admit(self) -> None:
        admit(self.limits, self.client, self.draining)

    def check_priority(self, priority: int) -> None:
        """vLLM's rule: a priority only means something under the priority policy."""
        if priority != 0 and self.model_info.scheduling_policy != "priority":
            raise OpenAIError(
                "priority is only supported with --scheduling-policy priority.", param="priority"
            )

    def require_tokenizer(self, param: str) -> Any:
        if self.tokenizer is None:
            raise OpenAIError("This model has no tokenizer: send token ids.", param=param)
        return self.tokenizer

    def model_name(self, requested: str | None) -> str:
        """The name a body's `model` answers with: a served name, or (with LoRA on) an adapter's, which
        check_model has found in the engine's table."""
        names = self.model_info.served_model_names
        if requested is None or requested in names or self.model_info.max_loras:
            return requested or names[0]
        raise self.not_found(requested)

    def lora_name(self, requested: str | None) -> str | None:
        """The adapter a body's `model` names (None: the base model)."""
        if requested is None or requested in self.model_info.served_model_names:
            return None
        return requested

    async def check_model(self, requested: str | None) -> None:
        """404 model_not_found unless `model` is a served name or an adapter the engine has now (it owns
        the table, so every API server sees a load or unload at once; the engine checks again on add)."""
        if self.lora_name(requested) is None:
            return
        assert requested is not None
        if not self.model_info.max_loras or requested not in await self.lora_names():
            raise self.not_found(requested)

    async def lora_names(self) -> list[str]:
        return [adapter["name"] for adapter in await self.loras()]

    async def loras(self) -> list[dict[str, Any]]:
        """The engine's adapters (LoraAdapter's fields), none when LoRA is off."""
        if not self.model_info.max_loras:
            return []
        adapters: list[dict[str, Any]] = await self.client.call_utility("list_loras")
        return adapters

    def not_found(self, requested: str) -> OpenAIError:
        return OpenAIError(
            f"The model `{requested}` does not exist.",
            status=404,
            type="NotFoundError",
            param="model",
            code="model_not_found",
        )
