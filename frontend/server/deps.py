"""What an API server's routes depend on, in one typed object (FastAPI reads it from app.state), and the
OpenAIServing a ServerConfig describes."""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass, field

from frontend.audio.limits import AudioLimits
from frontend.audio.speech_model import SpeechModel
from frontend.engine.async_llm import AsyncLLM
from frontend.engine.data_parallel import DataParallelClient, EngineClient
from frontend.metrics import EngineStatsCollector, Metrics
from frontend.model_files import load_generation_defaults
from frontend.openai.fingerprint import output_settings, system_fingerprint
from frontend.openai.serving import OpenAIServing
from frontend.parsers.registry import Parsers
from frontend.responses.mcp_client import ToolServers
from frontend.responses.store import ResponseStore
from frontend.server.admission import AdmissionLimits
from frontend.server.config import ServerConfig
from frontend.vision.decode import max_pixels_from_env
from frontend.vision.fetch import FetchLimits, MediaFetcher
from frontend.vision.limits import DEFAULT_LIMIT
from frontend.vision.loader import ImageLoader
from frontend.vision.processing import VisionModel
from protocol.messages import ModelInfo

__all__ = ["AppDeps", "ServerConfig", "build_serving"]

logger = logging.getLogger("engine.api")


@dataclass
class AppDeps:
    config: ServerConfig
    serving: OpenAIServing
    metrics: Metrics | None = None
    stats_collector: EngineStatsCollector = field(init=False)

    def __post_init__(self) -> None:
        client = self.serving.client
        self.stats_collector = EngineStatsCollector(
            lambda: client.engine_stats if isinstance(client, DataParallelClient) else [client.last_stats],
            self.serving.model_info.served_model_names[0],
            prefix=self.config.metrics_prefix,
        )

    @property
    def client(self) -> EngineClient:
        return self.serving.client


def build_serving(config: ServerConfig, llm: AsyncLLM, model_info: ModelInfo) -> OpenAIServing:
    """The doors' shared state a ServerConfig describes: an API server's, and `engine run-batch`'s (which
    runs the same app in-process)."""
    defaults = load_generation_defaults(config.model or model_info.model, config.generation_config)
    if defaults:
        logger.info("sampling defaults from the generation config: %s", defaults)
    speech = None
    if model_info.runner == "transcription":  # its feature extractor and special tokens (frontend/audio/)
        folder = config.model or model_info.model
        speech = SpeechModel.load(folder, llm.tokenizer, model_info.encoder_len)
    images = None
    if model_info.image_token_id >= 0:  # a vision-language model: its processor, the fetching bounds
        images = ImageLoader(
            VisionModel.load(config.model or model_info.model, model_info.image_token_id,
                             config.mm_processor_cache_gb),
            MediaFetcher(FetchLimits.from_env(os.environ, config.allowed_media_domains,
                                              config.allowed_local_media_path)),
            max_pixels_from_env(os.environ),
            config.limit_mm_per_prompt.get("image", DEFAULT_LIMIT),
            llm.processor.metrics,
        )  # fmt: skip
    llm.log_requests = config.log_requests
    llm.max_log_len = config.max_log_len
    limits = AdmissionLimits(
        max_queued_requests=config.max_queued_requests,
        max_queued_tokens=config.max_queued_tokens,
        max_inflight_requests=config.max_inflight_requests,
    )
    return OpenAIServing(
        llm,
        model_info,
        config.chat_template,
        defaults,
        limits,
        parsers=Parsers.with_plugin(config.tool_parser_plugin),
        enable_auto_tool_choice=config.enable_auto_tool_choice,
        tool_call_parser=config.tool_call_parser,
        reasoning_parser=config.reasoning_parser,
        responses=ResponseStore(
            config.responses_store_path, config.responses_store_max_count, config.responses_store_max_bytes
        ),
        system_fingerprint=system_fingerprint(
            config.fingerprint_mode, model_info, output_settings(config), config.fingerprint_value
        ),
        tool_servers=ToolServers(config.tool_servers, config.mcp_timeout_s),
        mcp_allowed_urls=config.mcp_allowed_urls,
        force_include_usage=config.force_include_usage,
        response_role=config.response_role,
        speech=speech,
        audio_limits=AudioLimits.from_env(os.environ),
        images=images,
    )
