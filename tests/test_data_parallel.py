"""The data-parallel router and stats, without processes: least load first, ties in turn, a long prefix
kept where it is cached while that engine is nearly as free, a short shared prefix (a system prompt)
never pulling traffic onto one engine; merged stats for admission; the engines' addresses."""

from __future__ import annotations

from frontend.engine.data_parallel import merge_stats
from frontend.engine.process import rank_addresses
from frontend.engine.router import Router, load_score
from protocol.messages import SchedulerStats

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
