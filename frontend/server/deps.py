"""What an API server's routes depend on, in one typed object (FastAPI reads it from app.state)."""

from __future__ import annotations

from dataclasses import dataclass, field

from frontend.engine.client import AsyncEngineClient
from frontend.metrics import EngineStatsCollector, Metrics
from frontend.openai.serving import OpenAIServing
from frontend.server.config import ServerConfig

__all__ = ["AppDeps", "ServerConfig"]


@dataclass
class AppDeps:
    config: ServerConfig
    serving: OpenAIServing
    metrics: Metrics | None = None
    stats_collector: EngineStatsCollector = field(init=False)

    def __post_init__(self) -> None:
        client = self.serving.client
        self.stats_collector = EngineStatsCollector(
            lambda: client.last_stats,
            self.serving.model_info.served_model_names[0],
            prefix=self.config.metrics_prefix,
        )

    @property
    def client(self) -> AsyncEngineClient:
        return self.serving.client
