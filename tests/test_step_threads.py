"""--decode-threads (worker/step_threads.py): small decode steps on every core or one fewer, whichever the
worker measures faster, and the same tokens and logprobs either way."""

from __future__ import annotations

import pytest
import torch

from frontend.cli.main import build_parser
from frontend.config.engine_args import EngineArgs
from frontend.config.flags import ConfigError
from frontend.offline.llm import LLM
from protocol.config import WorkerConfig
from protocol.sampling import SamplingParams
from protocol.worker_messages import SchedulerOutput
from worker.model_config import UnsupportedModelError
from worker.step_threads import BLOCK, HOLD, MAX_ROWS, ROUNDS, FixedThreads, StepThreads, step_threads_for

MEASURING = 2 * BLOCK * ROUNDS  # steps of one batch size before it chooses


def scheduled(*counts: int) -> SchedulerOutput:
    return SchedulerOutput([], [], {f"r{i}": n for i, n in enumerate(counts)}, sum(counts), [])


class FakeMachine:
    """A clock that a step on each thread count advances by that count's step time."""

    def __init__(self, seconds: dict[int, float]) -> None:
        self.seconds, self.now, self.threads = seconds, 0.0, 4
        self.calls: list[int] = []

    def clock(self) -> float:
        return self.now

    def set_threads(self, threads: int) -> None:
        self.threads = threads
        self.calls.append(threads)

    def run(self, chooser: StepThreads, output: SchedulerOutput) -> int:
        with chooser.step(output):
            self.now += self.seconds[self.threads]
        return self.threads


@pytest.mark.parametrize(("seconds", "chosen"), [({4: 5e-3, 3: 4e-3}, 3), ({4: 5e-3, 3: 7e-3}, 4)])
def test_a_batch_size_runs_on_the_count_measured_faster(seconds: dict[int, float], chosen: int) -> None:
    machine = FakeMachine(seconds)
    chooser = StepThreads(4, machine.set_threads, machine.clock)
    used = [machine.run(chooser, scheduled(1)) for _ in range(MEASURING)]
    assert used == ([4] * BLOCK + [3] * BLOCK) * ROUNDS  # blocks in turn while it measures
    assert [machine.run(chooser, scheduled(1)) for _ in range(100)] == [chosen] * 100
    changes = [3, 4] * (ROUNDS - 1) + [3] + ([4] if chosen == 4 else [])
    assert machine.calls == changes  # torch.set_num_threads only where the count changes


def test_prefill_mixed_and_big_decode_steps_take_every_core() -> None:
    machine = FakeMachine({4: 9e-3, 3: 1e-3})
    chooser = StepThreads(4, machine.set_threads, machine.clock)
    for _ in range(MEASURING):
        machine.run(chooser, scheduled(1, 1))
    assert machine.run(chooser, scheduled(1, 1)) == 3  # two rows chose one fewer
    assert machine.run(chooser, scheduled(17)) == 4  # a prefill chunk
    assert machine.run(chooser, scheduled(1, 5)) == 4  # a mixed step
    assert machine.run(chooser, scheduled(*[1] * (MAX_ROWS + 1))) == 4  # more rows than it chooses for
    assert machine.run(chooser, scheduled(1)) == 4  # one row has not measured yet: its first block


def test_a_choice_is_measured_again_after_hold_steps() -> None:
    machine = FakeMachine({4: 5e-3, 3: 4e-3})
    chooser = StepThreads(4, machine.set_threads, machine.clock)
    for _ in range(MEASURING + HOLD):
        machine.run(chooser, scheduled(1))
    machine.seconds = {4: 4e-3, 3: 6e-3}  # the load changed
    used = [machine.run(chooser, scheduled(1)) for _ in range(MEASURING + 10)]
    assert used[:MEASURING] == ([4] * BLOCK + [3] * BLOCK) * ROUNDS
    assert used[MEASURING:] == [4] * 10


def test_fixed_where_the_user_or_the_machine_fixes_the_threads(smollm2_gguf: str) -> None:
    def config(**fields: object) -> WorkerConfig:
        return WorkerConfig(model=smollm2_gguf, **fields)  # type: ignore[arg-type]

    for fixed in (config(decode_threads="all"), config(num_threads=2)):  # --num-threads fixes the default
        assert isinstance(step_threads_for(fixed, "cpu"), FixedThreads)
    assert isinstance(step_threads_for(config(), "cuda"), FixedThreads)
    chooser = step_threads_for(config(), "cpu")
    assert isinstance(chooser, FixedThreads if torch.get_num_threads() < 2 else StepThreads)


def test_auto_asked_for_where_it_cannot_choose_is_a_start_error(smollm2_gguf: str) -> None:
    auto = {"model": smollm2_gguf, "decode_threads": "auto"}
    with pytest.raises(UnsupportedModelError, match="fixed here by --num-threads"):
        step_threads_for(WorkerConfig(**auto, num_threads=2), "cpu")  # type: ignore[arg-type]
    with pytest.raises(UnsupportedModelError, match="fixed here by a cuda worker"):
        step_threads_for(WorkerConfig(**auto), "cuda")  # type: ignore[arg-type]
    with pytest.raises(UnsupportedModelError, match="the choices are auto and all"):
        step_threads_for(WorkerConfig(model=smollm2_gguf, decode_threads="half"), "cpu")
    with pytest.raises(ConfigError, match="--decode-threads: must be one of auto, all, got 'half'"):
        EngineArgs(model=smollm2_gguf, decode_threads="half")  # the LLM API's keyword arguments
    with pytest.raises(SystemExit) as exit_:  # argparse's choices
        build_parser().parse_args(["serve", "--decode-threads", "half"])
    assert exit_.value.code == 2


@pytest.mark.slow
@pytest.mark.skipif(torch.get_num_threads() < 2, reason="needs two cores: one thread fewer than one is none")
@pytest.mark.parametrize("activations", [None, "int8"])
def test_the_tokens_do_not_depend_on_the_count(smollm2_gguf: str, activations: str | None) -> None:
    """While it measures, a batch size's steps alternate between the counts: the first MEASURING tokens of a
    request run half on each. They are the tokens and logprobs of every step on every core."""
    params = SamplingParams(temperature=0.0, max_tokens=MEASURING + 8, logprobs=2, ignore_eos=True)
    prompts = ["The capital of France is", "def fibonacci(n):"]
    runs = {}
    for mode in ("auto", "all"):
        with LLM(smollm2_gguf, dtype="bfloat16", max_model_len=256, num_kv_blocks=32, decode_threads=mode,
                 activation_quantization=activations) as llm:  # fmt: skip
            # one prompt at a time: one row a step, so its steps measure (and alternate) from the first
            runs[mode] = [llm.generate(prompt, params)[0].outputs[0] for prompt in prompts]
    for auto, every in zip(runs["auto"], runs["all"], strict=True):
        assert auto.token_ids == every.token_ids
        assert auto.logprobs is not None and every.logprobs is not None
        assert [{k: v.logprob for k, v in step.items()} for step in auto.logprobs] == [
            {k: v.logprob for k, v in step.items()} for step in every.logprobs
        ]
