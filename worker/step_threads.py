"""How many threads a small decode step runs on (--decode-threads auto): every core the worker has, or one
fewer, whichever this server measures faster for that batch size.

Where the worker's threads fill the machine's cores, the API servers and the engine core (about a
millisecond of CPU a token at c=1 on two cores, docs/performance.md) run by taking a core from one of
them, and the others wait for it at the step's next join. Leaving them a core costs a decode step a share
of its memory bandwidth instead. Which costs less depends on the step's bytes, the machine and the load
(on a two-core Zen 4 at c=1: SmolLM2's int8 step is faster on one thread, Gemma-3-270M's on two), so the
worker measures it. For each batch size of up to MAX_ROWS decode rows, blocks of BLOCK steps alternate
between the two counts until each has had ROUNDS blocks; the faster median then holds for HOLD steps of
that size, and it measures again. Prefill and mixed steps, and bigger decode batches, run on every core.
The csrc kernels give each output to one thread whatever the count, so the choice changes the time, not
the tokens (tests/test_step_threads.py).
"""

from __future__ import annotations

import logging
import os
import statistics
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch

from protocol.config import WorkerConfig
from protocol.worker_messages import SchedulerOutput
from worker.model_config import UnsupportedModelError

logger = logging.getLogger("engine.worker")

MAX_ROWS = 8  # decode batches of up to this many rows choose; bigger ones are compute, not bytes
BLOCK = 8  # steps a count runs before the other takes its turn
ROUNDS = 4  # blocks of each count before choosing
HOLD = 2048  # steps of a batch size on the chosen count before measuring again


def batch_size_of(scheduler_output: SchedulerOutput) -> int | None:
    """The step's rows where it is a decode step (one token a request) of at most MAX_ROWS; else None."""
    counts = scheduler_output.num_scheduled_tokens
    if not counts or len(counts) > MAX_ROWS or any(n != 1 for n in counts.values()):
        return None
    return len(counts)


@dataclass
class BatchTiming:
    """One batch size's measuring and choice: 0 every core, 1 one fewer."""

    seconds: tuple[list[float], list[float]] = field(default_factory=lambda: ([], []))
    measured: int = 0  # steps timed since this measuring began
    chosen: int | None = None
    held: int = 0  # steps run on the choice

    def choice(self) -> int:
        return self.chosen if self.chosen is not None else (self.measured // BLOCK) % 2

    def record(self, seconds: float) -> bool:
        """Counts a step of `seconds` on choice(); True where that made a new choice."""
        if self.chosen is not None:
            self.held += 1
            if self.held >= HOLD:  # measure again: the load or the machine may have changed
                self.seconds, self.measured, self.chosen, self.held = ([], []), 0, None, 0
            return False
        self.seconds[self.choice()].append(seconds)
        self.measured += 1
        if self.measured < 2 * BLOCK * ROUNDS:
            return False
        every, fewer = (statistics.median(times) for times in self.seconds)
        self.chosen = 1 if fewer < every else 0
        return True


class StepThreads:
    """Sets the threads of each step (torch.set_num_threads) and times the small decode steps."""

    def __init__(
        self,
        cores: int,
        set_threads: Callable[[int], None],
        clock: Callable[[], float] = time.perf_counter,
    ) -> None:
        assert cores >= 2, "one fewer than one core is none"
        self.counts = (cores, cores - 1)
        self.set_threads, self.clock = set_threads, clock
        self.current = cores
        self.sizes: dict[int, BatchTiming] = {}

    def _use(self, threads: int) -> None:
        if threads != self.current:
            self.set_threads(threads)
            self.current = threads

    @contextmanager
    def step(self, scheduler_output: SchedulerOutput) -> Iterator[None]:
        rows = batch_size_of(scheduler_output)
        if rows is None:
            self._use(self.counts[0])
            yield
            return
        timing = self.sizes.setdefault(rows, BatchTiming())
        self._use(self.counts[timing.choice()])
        start = self.clock()
        yield
        if timing.record(self.clock() - start):
            every, fewer = (statistics.median(times) * 1e3 for times in timing.seconds)
            logger.debug(
                "decode steps of %d row(s) run on %d threads: a median %.2f ms a step on %d, %.2f ms on %d",
                rows, self.counts[timing.chosen or 0], every, self.counts[0], fewer, self.counts[1],
            )  # fmt: skip


class FixedThreads:
    """--num-threads given, --decode-threads all, one core, several workers on the machine, or CUDA: every
    step on the threads the worker started with."""

    @contextmanager
    def step(self, scheduler_output: SchedulerOutput) -> Iterator[None]:
        yield


def fix_threads(config: WorkerConfig) -> None:
    """--num-threads, or each worker's share of the cores where several share the machine (ranks,
    data-parallel engines)."""
    workers = config.parallel.workers_per_node
    if config.num_threads or workers > 1:
        cores = len(os.sched_getaffinity(0))
        torch.set_num_threads(config.num_threads or max(1, cores // workers))


def step_threads_for(config: WorkerConfig, device_type: str) -> StepThreads | FixedThreads:
    """--decode-threads: auto (the default where nothing fixes the threads) or all. auto asked for where
    the threads are fixed is a start error naming what fixes them."""
    if config.decode_threads not in (None, "auto", "all"):
        raise UnsupportedModelError(
            f"--decode-threads {config.decode_threads!r}: the choices are auto and all"
        )
    fixed_by = [why for why, holds in (
        ("--num-threads", bool(config.num_threads)),
        ("several workers on this machine (their cores are shared out)", config.parallel.workers_per_node > 1),
        (f"a {device_type} worker (the choice is of CPU threads)", device_type != "cpu"),
    ) if holds]  # fmt: skip
    if config.decode_threads == "auto" and fixed_by:
        raise UnsupportedModelError(
            f"--decode-threads auto chooses the worker's threads, fixed here by {fixed_by[0]}"
        )
    cores = torch.get_num_threads()
    if config.decode_threads == "all" or fixed_by or cores < 2:
        return FixedThreads()
    return StepThreads(cores, torch.set_num_threads)
