"""The data-parallel router and stats, without processes: least load first, ties in turn, a long prefix
kept where it is cached while that engine is nearly as free, a short shared prefix (a system prompt)
never pulling traffic onto one engine; merged stats for admission; the engines' addresses."""

from __future__ import annotations

import asyncio
import weakref
from collections import OrderedDict

import pytest

from frontend.engine.data_parallel import merge_results, merge_stats
from frontend.engine.process import rank_addresses
from frontend.engine.router import Router, load_score
from protocol.errors import EngineDeadError, InvalidParameterError
from protocol.messages import AddRequest, SchedulerStats
from protocol.sampling import SamplingParams

BLOCK = 64


def test_least_loaded_first_and_ties_in_turn() -> None:
    router = Router(3, BLOCK)
    assert router.choose([1, 2, 3], [5, 0, 9]) == 1
    assert [router.choose([7], [0, 0, 0]) for _ in range(3)] != [0, 0, 0]  # short prompts spread on ties
    assert load_score(num_waiting=2, num_running=3) == 11  # vLLM's coordinator: waiting x 4 + running


def test_a_long_prefix_stays_where_it_is_cached_while_that_engine_is_nearly_as_free() -> None:
    router = Router(2, BLOCK)
    document = list(range(1000, 1000 + 600))  # 9 blocks: past the 256-token threshold
    first = router.choose(document + [1], [0, 0])
    other = 1 - first
    loads = [0, 0]
    loads[first] = 3  # busier, but within the slack of 4
    assert router.choose(document + [2], loads) == first
    assert router.num_by_prefix == 1
    loads[first] = 9  # too busy: the least loaded takes it, and now holds the prefix
    assert router.choose(document + [3], loads) == other
    assert router.choose(document + [4], [0, 0]) == other


def test_a_short_shared_prefix_does_not_pull_traffic() -> None:
    router = Router(2, BLOCK)
    system = list(range(200))  # three blocks, under 256 tokens
    chosen = [router.choose(system + [i] * 30, [0, 0]) for i in range(6)]
    assert set(chosen) == {0, 1} and router.num_by_prefix == 0


def test_the_prefix_table_is_bounded() -> None:
    router = Router(2, BLOCK, max_prefixes=10)
    for i in range(50):
        router.choose([i] * 1000, [0, 0])
    assert len(router.prefixes) == 10


def test_merged_stats_sum_counts_and_average_the_pool() -> None:
    a = SchedulerStats(num_running=2, num_waiting=1, kv_cache_usage=0.5, num_steps=10, running_loras=["x"])
    b = SchedulerStats(num_running=1, num_waiting=4, kv_cache_usage=0.1, num_steps=5, paused="abort")
    merged = merge_stats([a, b])
    assert (merged.num_running, merged.num_waiting, merged.num_steps) == (3, 5, 15)
    assert (
        abs(merged.kv_cache_usage - 0.3) < 1e-9 and merged.paused == "abort" and merged.running_loras == ["x"]
    )
    assert a.num_running == 2  # the engines' own stats are left alone


def test_each_engine_has_its_own_ports_or_paths() -> None:
    assert rank_addresses("tcp://10.0.0.1:29550", "tcp://10.0.0.1:29551", 2) == (
        "tcp://10.0.0.1:29554",
        "tcp://10.0.0.1:29555",
    )
    assert rank_addresses("ipc:///tmp/e/input", "ipc:///tmp/e/output", 1) == (
        "ipc:///tmp/e/input-dp1",
        "ipc:///tmp/e/output-dp1",
    )


# ---- the client over several engines, with stand-ins for the per-engine clients (no sockets) ----


class FakeEngine:
    """What DataParallelClient uses of an AsyncEngineClient: it records what it is sent."""

    def __init__(self, rank: int, answer: object = None) -> None:
        self.rank, self.answer = rank, answer
        self.added: list[str] = []
        self.aborted: list[tuple[list[str], str | None]] = []
        self.released: list[str] = []
        self.dead_reason: str | None = None
        self.last_stats: SchedulerStats | None = SchedulerStats()
        self.added_since_stats = 0
        self.num_open_requests = 0

    async def add_request(self, request, queue=None):  # type: ignore[no-untyped-def]
        self.added.append(request.request_id)
        self.added_since_stats += 1
        return queue

    def release(self, request_id: str) -> None:
        self.released.append(request_id)

    async def abort(self, request_ids: list[str], reason: str | None = None) -> None:
        self.aborted.append((list(request_ids), reason))

    async def call_utility(self, method: str, *args, timeout_s: float = 30.0):  # type: ignore[no-untyped-def]
        if isinstance(self.answer, Exception):
            raise self.answer
        return self.answer

    def mark_dead(self, reason: str) -> None:
        self.dead_reason = reason


def client_over(*engines: FakeEngine):  # type: ignore[no-untyped-def]
    from frontend.engine.data_parallel import DataParallelClient

    client = DataParallelClient.__new__(DataParallelClient)
    client.engines = list(engines)  # type: ignore[arg-type]
    client.router = Router(len(engines), BLOCK)
    client.owner, client.released, client.queue_engine = {}, OrderedDict(), weakref.WeakKeyDictionary()
    return client


def add(client, request_id: str, ids: list[int]) -> None:  # type: ignore[no-untyped-def]
    request = AddRequest(
        request_id=request_id,
        prompt_token_ids=ids,
        sampling_params=SamplingParams(max_tokens=1),
        arrival_time=0.0,
    )
    asyncio.run(client.add_request(request))


def test_requests_spread_and_their_aborts_go_to_their_engine_only() -> None:
    a, b = FakeEngine(0), FakeEngine(1)
    client = client_over(a, b)
    for i in range(4):
        add(client, f"r{i}", [i])
    assert len(a.added) == len(b.added) == 2  # each one's own sends count as its load
    owner = b if "r1" in b.added else a
    client.release("r1")  # a stop string matched: released, then aborted
    asyncio.run(client.abort(["r1"]))
    assert owner.aborted == [(["r1"], None)] and not (a if owner is b else b).aborted
    asyncio.run(client.abort(["someone-elses"], "cancelled"))  # another frontend's: every engine is asked
    assert a.aborted[-1] == b.aborted[-1] == (["someone-elses"], "cancelled")


def test_the_choices_of_one_prompt_share_an_engine() -> None:
    a, b = FakeEngine(0), FakeEngine(1)
    client = client_over(a, b)

    async def three_choices() -> None:
        queue: asyncio.Queue[object] = asyncio.Queue()
        for i in range(3):
            request = AddRequest(request_id=f"c{i}", prompt_token_ids=[5], sampling_params=SamplingParams(),
                                 arrival_time=0.0)  # fmt: skip
            await client.add_request(request, queue)

    asyncio.run(three_choices())
    assert sorted([len(a.added), len(b.added)]) == [0, 3]


def test_one_dead_engine_makes_the_deployment_dead() -> None:
    a, b = FakeEngine(0), FakeEngine(1)
    client = client_over(a, b)
    b.mark_dead("engine core failed")
    assert client.is_dead and client.dead_reason == "engine core failed"
    with pytest.raises(EngineDeadError):
        add(client, "r", [1])


def test_operator_answers_merge_and_a_failure_names_its_engine() -> None:
    a = FakeEngine(0, {"is_paused": True, "mode": "wait", "num_running": 2, "num_waiting": 0})
    b = FakeEngine(1, {"is_paused": True, "mode": "wait", "num_running": 3, "num_waiting": 1})
    state = asyncio.run(client_over(a, b).call_utility("is_paused"))
    assert (state["is_paused"], state["num_running"], state["num_waiting"]) == (True, 5, 1)
    assert [engine["num_running"] for engine in state["engines"]] == [2, 3]
    asleep = merge_results("is_sleeping", [{"is_sleeping": True, "level": 1, "sleeping": ["weights"]},
                                           {"is_sleeping": False, "level": None, "sleeping": []}])  # fmt: skip
    assert (asleep["is_sleeping"], asleep["level"], asleep["sleeping"]) == (False, 1, ["weights"])
    assert merge_results("reset_prefix_cache", [True, False]) is False
    ranks = merge_results("collective_rpc", [{"results": [1, 2]}, {"results": [3, 4]}])
    assert ranks == {"results": [1, 2, 3, 4]}
    b.answer = InvalidParameterError("lora_name", "no such adapter")
    with pytest.raises(InvalidParameterError, match="engine 1: no such adapter"):
        asyncio.run(client_over(a, b).call_utility("unload_lora", "x"))
