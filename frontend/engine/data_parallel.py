"""One frontend in front of several data-parallel engines: the engine client's interface over N of them.

Each engine is an AsyncEngineClient of its own (sockets, liveness, its requests' queues); this class
routes each request to one (frontend/engine/router.py), sends its aborts there, sends operator calls to
every engine (they act on each, and the first's answer stands for the rest: they agree), and merges the
engines' stats for admission and /load. Per-engine stats stay available for /metrics' `engine` label.

Invariants: a request id is owned by exactly one engine from add_request until release or abort; one
dead engine makes the whole deployment dead (its requests fail, the others' new requests are refused
with 503, as with one engine), so no request is lost silently.
"""

from __future__ import annotations

import asyncio
import logging
import weakref
from collections import OrderedDict
from collections.abc import Callable
from contextvars import ContextVar
from typing import Any

import msgspec

from frontend.engine.client import HEARTBEAT_TIMEOUT_S, AsyncEngineClient
from frontend.engine.router import Router, load_score
from protocol.errors import EngineDeadError, InvalidParameterError
from protocol.messages import AddRequest, EngineSet, ModelInfo, RequestOutput, SchedulerStats

logger = logging.getLogger("engine.frontend")
# the engine the current HTTP request names (X-data-parallel-rank, set by the edge middleware for the
# request's task and the tasks it starts): it overrides the router
REQUESTED_RANK: ContextVar[int | None] = ContextVar("requested_rank", default=None)
MAX_RELEASED = 4096  # released requests whose engine is remembered for a late abort

SUMMED = (
    "num_running", "num_waiting", "prefix_cache_queries", "prefix_cache_hits", "num_preemptions",
    "num_prompt_tokens", "num_generation_tokens", "num_waiting_tokens", "num_steps", "iteration_tokens_sum",
)  # fmt: skip


def merge_stats(all_stats: list[SchedulerStats]) -> SchedulerStats:
    """The deployment's stats: counts summed, KV usage averaged (every engine has the same pool), paused or
    asleep if any engine is."""
    merged = msgspec.structs.replace(all_stats[0])
    for name in SUMMED:
        setattr(merged, name, sum(getattr(stats, name) for stats in all_stats))
    merged.kv_cache_usage = sum(stats.kv_cache_usage for stats in all_stats) / len(all_stats)
    merged.iteration_tokens_buckets = [
        sum(counts) for counts in zip(*(s.iteration_tokens_buckets for s in all_stats), strict=True)
    ]
    merged.running_loras = sorted({name for stats in all_stats for name in stats.running_loras})
    merged.waiting_loras = sorted({name for stats in all_stats for name in stats.waiting_loras})
    merged.paused = next((stats.paused for stats in all_stats if stats.paused), "")
    merged.sleeping = sorted({tag for stats in all_stats for tag in stats.sleeping})
    return merged


async def connect_engines(
    input_address: str,
    output_address: str,
    client_id: str | None,
    timeout_s: float,
    is_alive: Callable[[], bool] | None = None,
    heartbeat_timeout_s: float = HEARTBEAT_TIMEOUT_S,
) -> AsyncEngineClient | DataParallelClient:
    """Register with the engine at these addresses and, when it is one of several data-parallel engines
    (its ModelInfo lists them), with every other one too (each judged gone after heartbeat_timeout_s of
    silence)."""
    first = AsyncEngineClient(input_address, output_address, client_id, heartbeat_timeout_s)
    try:
        info = await first.register(timeout_s, is_alive)
    except BaseException:
        first.close()
        raise
    if not info.data_parallel_addresses:  # one engine (an elastic deployment of one lists itself)
        return first
    client = DataParallelClient(first, [(i, o) for i, o in info.data_parallel_addresses])
    try:
        await client.register(timeout_s, is_alive)
    except BaseException:
        client.close()
        raise
    return client


def merge_results(method: str, results: list[Any]) -> Any:
    """The deployment's answer from each engine's: collective_rpc's ranks one after another; in a state
    (pause, sleep, stats), counts summed, flags true only when true of every engine, tags united, and each
    engine's own answer under "engines"; a bool (reset_prefix_cache) true only when true everywhere; any
    other answer (the LoRA table, which every engine shares) engine 0's."""
    if method == "collective_rpc":
        return {"results": [item for result in results for item in result["results"]]}
    first = results[0]
    if isinstance(first, bool):
        return all(results)
    if not isinstance(first, dict):
        return first
    merged: dict[str, Any] = {}
    for key, value in first.items():
        values = [result.get(key) for result in results]
        if isinstance(value, bool):
            merged[key] = all(values)
        elif isinstance(value, int) and (key.startswith("num_") or key in SUMMED):  # counts, not a level
            merged[key] = sum(v for v in values if isinstance(v, int))
        elif isinstance(value, list) and all(isinstance(item, str) for v in values for item in v or []):
            merged[key] = sorted({item for v in values for item in v or []})
        else:
            merged[key] = value
    merged["engines"] = results
    return merged


class DataParallelClient:
    def __init__(self, first: AsyncEngineClient, addresses: list[tuple[str, str]]) -> None:
        """first: a client registered with one of the engines; addresses: every engine's, rank order."""
        assert first.model_info is not None, "register the first client before"
        self.client_id = first.client_id
        rank = first.model_info.data_parallel_rank
        self.engines = [
            first if index == rank else AsyncEngineClient(i, o, first.client_id, first.heartbeat_timeout_s)
            for index, (i, o) in enumerate(addresses)
        ]
        self.model_info: ModelInfo | None = None
        self.router: Router | None = None
        self.owner: dict[str, int] = {}  # request id -> engine index
        # released requests' engines, most recent last: an abort right after a release (a stop string
        # matched) still goes to the one engine, not to all
        self.released: OrderedDict[str, int] = OrderedDict()
        self.queue_engine: weakref.WeakKeyDictionary[Any, int] = weakref.WeakKeyDictionary()
        self.scaling = False  # elastic data parallel: engine 0 says the set is changing (admission 503s)
        self.timeout_s = 60.0  # registering with an engine the set gains
        self._changes: asyncio.Lock | None = None
        self._change_tasks: set[asyncio.Task[None]] = set()
        self.engines[0].on_engine_set = self._on_engine_set
        if self.engines[0].pending_engine_set is not None:  # it came during registration
            self._on_engine_set(self.engines[0].pending_engine_set)

    @property
    def dead_reason(self) -> str | None:
        return next((engine.dead_reason for engine in self.engines if engine.dead_reason is not None), None)

    @property
    def is_dead(self) -> bool:
        return self.dead_reason is not None

    @property
    def num_open_requests(self) -> int:
        return sum(engine.num_open_requests for engine in self.engines)

    @property
    def last_stats(self) -> SchedulerStats | None:
        all_stats = [engine.last_stats for engine in self.engines]
        present = [stats for stats in all_stats if stats is not None]
        return merge_stats(present) if present else None

    @property
    def engine_stats(self) -> list[SchedulerStats | None]:
        """Each engine's latest stats, in rank order (/metrics labels them engine="0", "1"...)."""
        return [engine.last_stats for engine in self.engines]

    @property
    def added_since_stats(self) -> int:
        return sum(engine.added_since_stats for engine in self.engines)

    async def register(self, timeout_s: float, is_alive: Callable[[], bool] | None = None) -> ModelInfo:
        async def registered(engine: AsyncEngineClient) -> ModelInfo:
            return engine.model_info or await engine.register(timeout_s, is_alive)

        infos = await asyncio.gather(*(registered(engine) for engine in self.engines))
        for rank, info in enumerate(infos):
            if (info.model, info.served_model_names, info.max_model_len) != (
                infos[0].model, infos[0].served_model_names, infos[0].max_model_len,
            ):  # fmt: skip
                raise EngineDeadError(f"engine {rank} serves {info.model}, engine 0 {infos[0].model}")
        self.model_info = infos[0]
        self.router = Router(len(self.engines), infos[0].block_size)
        self.timeout_s = timeout_s
        return infos[0]

    def _on_engine_set(self, message: EngineSet) -> None:
        self.scaling = message.scaling or self.scaling  # at once: new requests get 503 from now
        task = asyncio.get_running_loop().create_task(self._apply(message))
        self._change_tasks.add(task)
        task.add_done_callback(self._change_tasks.discard)

    async def _apply(self, message: EngineSet) -> None:
        """Connect to the engines the set gains, drop those it lost (the launcher drained them first). The
        engines keep their ranks: a scale changes only the highest."""
        self._changes = self._changes or asyncio.Lock()
        async with self._changes:
            wanted = [list(pair) for pair in message.addresses]
            keep = 0
            while keep < min(len(wanted), len(self.engines)) and self.engines[keep].addresses == wanted[keep]:
                keep += 1
            timeout_s = self.engines[0].heartbeat_timeout_s
            added = [AsyncEngineClient(i, o, self.client_id, timeout_s) for i, o in wanted[keep:]]
            try:
                await asyncio.gather(*(engine.register(self.timeout_s) for engine in added))
            except Exception as error:  # noqa: BLE001 (logged; the set stays as it was)
                logger.error("could not join the data-parallel engines %s: %s", wanted[keep:], error)
                for engine in added:
                    engine.close()
                self.scaling = message.scaling
                return
            removed, self.engines = self.engines[keep:], [*self.engines[:keep], *added]
            for engine in removed:
                if engine.num_open_requests:  # the launcher drained it: none, unless a frontend was late
                    engine.mark_dead("its engine left the deployment (scaled down)")  # fails what is left
                engine.close()
            size = len(self.engines)
            for table in (self.owner, self.released):
                for request_id in [r for r, index in table.items() if index >= size]:
                    del table[request_id]
            for queue in [q for q, index in self.queue_engine.items() if index >= size]:
                del self.queue_engine[queue]
            if self.router is not None and (added or removed):
                self.router = Router(size, self.router.block_size)
            self.scaling = message.scaling
            if added or removed:
                logger.info("data-parallel engines: %d", size)

    def loads(self) -> list[int]:
        return [
            load_score(
                (stats.num_waiting if stats is not None else 0) + engine.added_since_stats,
                stats.num_running if stats is not None else 0,
            )
            for engine, stats in ((engine, engine.last_stats) for engine in self.engines)
        ]

    async def add_request(
        self, request: AddRequest, queue: asyncio.Queue[RequestOutput | Exception] | None = None
    ) -> asyncio.Queue[RequestOutput | Exception]:
        if (reason := self.dead_reason) is not None:
            raise EngineDeadError(reason)
        assert self.router is not None, "register first"
        index = self.queue_engine.get(queue) if queue is not None else None
        if index is None:
            index = REQUESTED_RANK.get()
        if index is None:  # n > 1: the choices share one queue, and one engine (their prompt's blocks)
            index = self.router.choose(request.prompt_token_ids, self.loads())
        if queue is not None:
            self.queue_engine[queue] = index
        self.owner[request.request_id] = index
        return await self.engines[index].add_request(request, queue)

    def engine_index(self, request_id: str) -> int:
        """The engine (its rank) that runs this open request: the metrics' `engine` label."""
        return self.owner.get(request_id, 0)

    def release(self, request_id: str) -> None:
        index = self.owner.pop(request_id, None)
        if index is not None:
            self.engines[index].release(request_id)
            self.released[request_id] = index
            if len(self.released) > MAX_RELEASED:
                self.released.popitem(last=False)

    async def abort(self, request_ids: list[str], reason: str | None = None) -> None:
        """Ours go to their engine; another frontend's (a cancel by id) to every engine (one owns it)."""
        by_engine: dict[int, list[str]] = {}
        unknown = []
        for request_id in request_ids:
            index = self.owner.pop(request_id, None)
            if index is None:
                index = self.released.pop(request_id, None)
            if index is None:
                unknown.append(request_id)
            else:
                by_engine.setdefault(index, []).append(request_id)
        for index, ids in by_engine.items():
            await self.engines[index].abort(ids, reason)
        if unknown:
            for engine in self.engines:
                await engine.abort(unknown, reason)

    async def cancel(self, request_ids: list[str], reason: str) -> None:
        ours = {request_id: self.owner.get(request_id) for request_id in request_ids}
        for index, engine in enumerate(self.engines):
            await engine.cancel([r for r, owner in ours.items() if owner in (index, None)], reason)
        for request_id in request_ids:
            self.owner.pop(request_id, None)

    async def call_utility(self, method: str, *args: Any, timeout_s: float = 30.0) -> Any:
        """Every engine runs the call, and the answers merge (merge_results). An engine's failure is the
        call's, named by the engine; the engines that succeeded keep what they did (a pause, a load)."""
        results = await asyncio.gather(
            *(engine.call_utility(method, *args, timeout_s=timeout_s) for engine in self.engines),
            return_exceptions=True,
        )
        for rank, result in enumerate(results):
            if isinstance(result, InvalidParameterError):
                others = "" if len(results) == 1 else " (the other engines did it)"
                raise InvalidParameterError(
                    result.param, f"engine {rank}: {result.message}{others}", result.code
                )
            if isinstance(result, BaseException):
                raise result
        return merge_results(method, results)

    def mark_dead(self, reason: str) -> None:
        for engine in self.engines:
            engine.mark_dead(reason)

    def stalled_for(self) -> float:
        return max(engine.stalled_for() for engine in self.engines)

    async def abort_all(self, reason: str) -> int:
        self.owner.clear()
        return sum([await engine.abort_all(reason) for engine in self.engines])

    async def aclose(self) -> None:
        await asyncio.gather(*(engine.aclose() for engine in self.engines))

    def close(self) -> None:
        for engine in self.engines:
            engine.close()


EngineClient = AsyncEngineClient | DataParallelClient  # what a frontend speaks to: one engine, or several
