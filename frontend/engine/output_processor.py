"""Engine outputs -> per-choice deltas: the one output path of every door and of the offline `LLM`.

Socket-free: `add_request` turns one prompt with n choices into the n engine requests to send, and
`process` folds one RequestOutput into its choice and says what it added. Incremental detokenization
with stop strings (and their hold-back), logprobs, prompt logprobs, finish reasons, typed engine
errors, per-request metrics, and the reading of the text as pieces (content, reasoning, tool calls:
frontend/engine/pieces.py) are decided here, once; each door only formats the deltas.

Invariants: a choice's `text` is the concatenation of the `text` of its deltas; after a choice's final
delta (finish_reason set) no later output changes it; prompt logprobs are reported on choice 0 only.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

from frontend.engine.detokenizer import IncrementalDetokenizer
from frontend.engine.pieces import Block, ChoicePieces, Pieces, TextParser
from frontend.metrics import Metrics, RequestTiming
from frontend.parsers.base import Parsed
from protocol.errors import EngineDeadError, InvalidParameterError
from protocol.media import EncoderInput, MultiModalInput
from protocol.messages import AddRequest, Logprobs, RequestOutput
from protocol.sampling import SamplingParams

SHUTDOWN_REASON = "server_shutdown"  # stop_reason of requests aborted by a draining API server


@dataclass
class Choice:
    """One of a prompt's n completions, as far as it has come."""

    index: int
    detokenizer: IncrementalDetokenizer
    pieces: ChoicePieces  # the text read as content, reasoning and calls
    text: str = ""  # shown so far: never a held-back prefix of a stop string
    token_ids: list[int] = field(default_factory=list)
    finish_reason: str | None = None  # "stop", "length" or "abort" (the engine's or a stop string's)
    stop_reason: int | str | None = None  # the stop string or stop token id that matched
    logprobs: Logprobs | None = None  # every position so far, when asked
    timing: RequestTiming | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    @property
    def parsed(self) -> Parsed:
        """The answer as its pieces built it (content, reasoning, calls)."""
        return self.pieces.result

    @property
    def blocks(self) -> list[Block]:
        """The answer's blocks in the order they came (when read incrementally: ChoicePieces)."""
        return self.pieces.blocks

    @property
    def reported_finish_reason(self) -> str | None:
        """The finish reason a door reports: "tool_calls" where the reading found calls that ended it."""
        return self.pieces.finish_reason if self.finished else None


@dataclass
class Delta:
    """What one engine output added to one choice."""

    index: int  # the choice
    text: str  # new text that may be shown now
    token_ids: list[int]  # new token ids
    logprobs: Logprobs | None  # for token_ids, when asked
    prompt_logprobs: Logprobs | None  # prompt positions computed this step (choice 0 only)
    finish_reason: str | None  # as the doors report it: "tool_calls" where the reading found calls
    stop_reason: int | str | None
    num_cached_tokens: int
    abort: bool = False  # a stop string ended the choice before the engine did: abort its request
    pieces: Pieces = field(default_factory=Pieces)  # new content, reasoning and call fragments


@dataclass
class RequestState:
    """One prompt and its n choices; its engine requests are `{request_id}-{index}`."""

    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    choices: list[Choice]
    arrival_time: float
    num_cached_tokens: int = 0
    prompt_logprobs: Logprobs | None = None  # positions 1.. of the prompt (position 0 has none)
    lora_name: str | None = None  # the adapter it runs with (the request counters' model_name)
    engine_index: int = 0  # the data-parallel engine that runs its choices (the metrics' engine label)
    kv_transfer_params: dict[str, Any] | None = (
        None  # a prefill's, once finished: what its decode request carries
    )

    def child_id(self, index: int) -> str:
        return f"{self.request_id}-{index}"

    def choice_of(self, child_id: str) -> Choice | None:
        prefix, _, index = child_id.rpartition("-")
        if prefix != self.request_id or not index.isdigit() or int(index) >= len(self.choices):
            return None
        return self.choices[int(index)]

    @property
    def open_child_ids(self) -> list[str]:
        return [self.child_id(c.index) for c in self.choices if not c.finished]

    @property
    def finished(self) -> bool:
        return all(c.finished for c in self.choices)

    @property
    def num_output_tokens(self) -> int:
        return sum(len(c.token_ids) for c in self.choices)


class OutputProcessor:
    def __init__(self, tokenizer: Any | None, metrics: Metrics | None = None) -> None:
        self.tokenizer = tokenizer
        self.metrics = metrics

    def add_request(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        *,
        priority: int = 0,
        cache_salt: str | None = None,
        parser: TextParser | None = None,
        incremental: bool = True,
        lora_name: str | None = None,
        encoder_input: EncoderInput | None = None,
        mm_inputs: list[MultiModalInput] | None = None,
        kv_transfer_params: dict[str, Any] | None = None,
    ) -> tuple[RequestState, list[AddRequest]]:
        """The state of a new prompt and the engine requests that run its n choices. parser: how the
        door reads each choice's text (None: all of it is content); incremental False: the door reads
        only the finished answer (not streamed), so the text is parsed once, at the end."""
        now = time.monotonic()
        state = RequestState(
            request_id,
            prompt_token_ids,
            params,
            [
                Choice(
                    index,
                    IncrementalDetokenizer(self.tokenizer, params),
                    ChoicePieces(parser, incremental),
                    logprobs=Logprobs([], [], []) if params.logprobs is not None else None,
                    timing=RequestTiming(now),
                )
                for index in range(params.n)
            ],
            arrival_time=time.time(),
            lora_name=lora_name,
        )
        requests = [
            AddRequest(
                request_id=state.child_id(index),
                prompt_token_ids=prompt_token_ids,
                sampling_params=params.for_choice(index),
                arrival_time=state.arrival_time,
                priority=priority,
                cache_salt=cache_salt,
                lora_name=lora_name,
                encoder_input=encoder_input,
                mm_inputs=mm_inputs or [],
                kv_transfer_params=kv_transfer_params,
            )
            for index in range(params.n)
        ]
        return state, requests

    def process(self, state: RequestState, output: RequestOutput) -> Delta | None:
        """Fold one engine output into its choice; None when it changes nothing (a stale output after
        the choice ended). Raises InvalidParameterError when the engine refused the request and
        EngineDeadError when it aborted it for no reason the frontend gave."""
        choice = state.choice_of(output.request_id)
        if choice is None or choice.finished:
            return None
        if output.error is not None:
            raise InvalidParameterError(output.error.param, output.error.message, output.error.code)
        finished = output.finish_reason is not None
        if output.finish_reason == "abort" and output.stop_reason is None:
            raise EngineDeadError("the engine aborted the request")  # a deliberate abort has a reason
        state.num_cached_tokens = output.num_cached_tokens
        if output.kv_transfer_params is not None:
            state.kv_transfer_params = output.kv_transfer_params
        text = choice.detokenizer.update(output.new_token_ids, finished)
        choice.text += text
        choice.token_ids.extend(output.new_token_ids)
        if choice.logprobs is not None and output.new_logprobs is not None:
            _extend(choice.logprobs, output.new_logprobs)
        prompt_logprobs = output.new_prompt_logprobs if choice.index == 0 else None
        if prompt_logprobs is not None:
            if state.prompt_logprobs is None:
                state.prompt_logprobs = Logprobs([], [], [])
            _extend(state.prompt_logprobs, prompt_logprobs)
        abort = False
        if choice.detokenizer.stop_matched is not None:
            choice.finish_reason, choice.stop_reason = "stop", choice.detokenizer.stop_matched
            abort = not finished
        elif finished:
            choice.finish_reason, choice.stop_reason = output.finish_reason, output.stop_reason
        self._observe(state, choice, output)
        pieces = choice.pieces.update(choice.text, text, choice.finish_reason)
        return Delta(
            choice.index,
            text,
            list(output.new_token_ids),
            output.new_logprobs,
            prompt_logprobs,
            choice.reported_finish_reason,
            choice.stop_reason,
            output.num_cached_tokens,
            abort,
            pieces,
        )

    def _observe(self, state: RequestState, choice: Choice, output: RequestOutput) -> None:
        if self.metrics is None or choice.timing is None:
            return
        now = time.monotonic()
        self.metrics.observe_token(choice.timing, now, len(output.new_token_ids), state.engine_index)
        if choice.finish_reason is not None:
            self.metrics.observe_finished(
                choice.timing,
                output,
                choice.finish_reason,
                len(state.prompt_token_ids),
                len(choice.token_ids),
                now,
                # the request's parameters once, with the last of its choices to finish
                n=state.params.n if state.finished else None,
                model_name=state.lora_name,
                max_tokens=state.params.max_tokens,
                engine=state.engine_index,
            )


def _extend(total: Logprobs, part: Logprobs) -> None:
    total.token_ids.extend(part.token_ids)
    total.logprobs.extend(part.logprobs)
    total.ranks.extend(part.ranks)
