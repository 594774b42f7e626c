"""Which data-parallel engine takes a request: the least loaded, unless one that already holds a long
prefix of its prompt is nearly as free.

Load is vLLM's DP coordinator's score, waiting x 4 + running, from each engine's own published counts
(every engine sends its SchedulerStats to every frontend with its outputs and once a second when idle),
plus the requests this frontend sent since that engine's last stats (counted as waiting). Prefix affinity:
each routed prompt records its prefixes of 1, 2, 4, 8... KV blocks against the engine it went to; a new
prompt's longest recorded prefix names the engine whose prefix cache most likely holds it. It pays only
for a long prefix (min_affinity_tokens) and only while that engine's load is within `slack` of the least:
otherwise a prefix every prompt shares (a system prompt) would pull all traffic onto one engine.
"""

from __future__ import annotations

import itertools
from collections import OrderedDict
from collections.abc import Sequence

MIN_AFFINITY_TOKENS = 256  # a prefix shorter than this is cheap to recompute on another engine
AFFINITY_SLACK = (
    4  # load units (a waiting request counts 4) an engine holding the prefix may be above the least
)
MAX_PREFIXES = 1 << 16  # recorded prefixes, least recently used out first


def load_score(num_waiting: int, num_running: int) -> int:
    return num_waiting * 4 + num_running


class Router:
    def __init__(
        self,
        num_engines: int,
        block_size: int,
        min_affinity_tokens: int = MIN_AFFINITY_TOKENS,
        slack: int = AFFINITY_SLACK,
        max_prefixes: int = MAX_PREFIXES,
    ) -> None:
        self.num_engines = num_engines
        self.block_size = block_size
        self.min_affinity_blocks = max(1, -(-min_affinity_tokens // block_size))
        self.slack = slack
        self.max_prefixes = max_prefixes
        self.prefixes: OrderedDict[int, int] = OrderedDict()  # hash of a block-aligned prefix -> engine
        self._turn = itertools.count()  # breaks ties between equally loaded engines in turn
        self.num_routed = [0] * num_engines
        self.num_by_prefix = 0  # requests sent where their prefix was rather than to the least loaded

    def choose(self, prompt_token_ids: Sequence[int], loads: Sequence[int]) -> int:
        """The engine for a prompt, given each engine's load score; records the prompt's prefixes there."""
        start = next(self._turn) % self.num_engines
        order = [(start + i) % self.num_engines for i in range(self.num_engines)]
        least = min(order, key=lambda engine: loads[engine])
        keys = self._prefix_keys(prompt_token_ids)
        choice = least
        for blocks, key in reversed(keys):
            if blocks < self.min_affinity_blocks:
                break
            holder = self.prefixes.get(key)
            if holder is not None:
                if loads[holder] <= loads[least] + self.slack:
                    choice = holder
                    self.num_by_prefix += holder != least
                break  # the longest recorded prefix decides, whether it is taken or not
        for _, key in keys:
            self.prefixes[key] = choice
            self.prefixes.move_to_end(key)
        while len(self.prefixes) > self.max_prefixes:
            self.prefixes.popitem(last=False)
        self.num_routed[choice] += 1
        return choice

    def _prefix_keys(self, prompt_token_ids: Sequence[int]) -> list[tuple[int, int]]:
        """(blocks, hash) of the prompt's prefixes of 1, 2, 4... whole blocks (the last token excluded: a
        prompt of exactly k blocks still computes its last token, as the prefix cache counts it)."""
        full = (len(prompt_token_ids) - 1) // self.block_size
        keys = []
        blocks = 1
        while blocks <= full:
            keys.append((blocks, hash(tuple(prompt_token_ids[: blocks * self.block_size]))))
            blocks *= 2
        return keys
