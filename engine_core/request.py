"""One request's state inside the EngineCore.

Invariants:
- num_computed_tokens <= num_tokens; the KV of the first num_computed_tokens tokens is written.
- num_computed_after_flight <= num_tokens_after_flight: a step in flight computes only tokens that are
  known, or that the step before it samples.
- status only moves forward through the finished states: once finished, a request never runs again.
- block_hashes[i] is the chained hash of full block i of all_token_ids (prompt then output), keyed by the
  request's extra keys and by the content hash of every image whose span the block touches.
- encoder_held holds images whose tower output the worker keeps: scheduled, span not yet computed past.
"""

from __future__ import annotations

import enum
import time

from engine_core.block_hash import BlockHash, hash_block_tokens
from protocol.config import DEFAULT_BLOCK_SIZE
from protocol.lora import LoraRequest
from protocol.media import EncoderInput, MultiModalInput
from protocol.messages import AddRequest
from protocol.pooling import PoolingParams
from protocol.sampling import SamplingParams


class RequestStatus(enum.IntEnum):
    """Ordered so that `status > PREEMPTED` means finished."""

    WAITING = 0
    RUNNING = 1
    PREEMPTED = 2
    FINISHED_STOPPED = 3
    FINISHED_LENGTH_CAPPED = 4
    FINISHED_ABORTED = 5
    FINISHED_ERROR = 6  # the worker could not go on (a grammar that failed): RequestOutput.error says why

    @property
    def is_finished(self) -> bool:
        return self > RequestStatus.PREEMPTED

    @property
    def finish_reason(self) -> str | None:
        return _FINISH_REASONS.get(self)


_FINISH_REASONS = {
    RequestStatus.FINISHED_STOPPED: "stop",
    RequestStatus.FINISHED_LENGTH_CAPPED: "length",
    RequestStatus.FINISHED_ABORTED: "abort",
    RequestStatus.FINISHED_ERROR: "error",
}


class Request:
    def __init__(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        sampling_params: SamplingParams,
        *,
        arrival_time: float = 0.0,
        priority: int = 0,
        client_id: str = "",
        block_size: int = DEFAULT_BLOCK_SIZE,
        extra_keys: tuple[str, ...] = (),
        pooling_params: PoolingParams | None = None,
        lora: LoraRequest | None = None,
        encoder_input: EncoderInput | None = None,
        mm_inputs: list[MultiModalInput] | None = None,
    ) -> None:
        self.request_id = request_id
        self.client_id = client_id
        self.prompt_token_ids = prompt_token_ids
        self.sampling_params = sampling_params
        self.pooling_params = pooling_params  # a pooling request: finished when its prompt is computed
        self.lora = lora  # the adapter it runs with (None: the base model)
        self.encoder_input = encoder_input  # an encoder-decoder model's input (Whisper's features)
        self.encoder_done = False  # the worker holds its encoder's output (from its first schedule)
        self.mm_inputs = mm_inputs or []  # a vision-language model's images, in prompt order
        self.encoder_held: set[int] = set()  # images whose tower output the worker keeps (see above)
        self.arrival_time = arrival_time
        self.priority = priority
        self.status = RequestStatus.WAITING
        self.stop_reason: int | str | None = None
        self.output_token_ids: list[int] = []
        self.all_token_ids: list[int] = list(prompt_token_ids)
        self.num_computed_tokens = 0
        # Scheduled in steps whose outputs have not come back yet (async scheduling: at most one step
        # ahead): their tokens, and how many of those steps sample an output token.
        self.num_tokens_ahead = 0
        self.num_outputs_ahead = 0
        self.num_cached_tokens = -1  # set at first schedule; -1 means not yet looked up
        self.num_preemptions = 0
        self.block_size = block_size
        self.extra_keys = extra_keys
        self.num_runs = 0  # preemptions so far, the LongRoPE switch's included: which run a step belongs to
        self.long_rope = False  # a LongRoPE model's request past its switch length (passes_rope_switch)
        self.block_hashes: list[BlockHash] = []
        self._update_block_hashes()
        # KV transfer (engine_core/kv_transfer.py): the entry it loads at admission, and whether it writes one
        self.kv_load_key: str | None = None
        self.kv_load_remote = ""  # NIXL: the producer's side channel (host:port)
        self.kv_save = False
        self.kv_saved = False  # planned (the step that ends its prompt writes it)
        # engine clock (time.monotonic): for the queue/prefill/decode histograms
        self.received_time = time.monotonic()
        self.first_scheduled_time: float | None = None
        self.first_token_time: float | None = None

    def timings(self) -> tuple[float, float, float]:
        """(queue, prefill, decode) seconds so far."""
        now = time.monotonic()
        scheduled = self.first_scheduled_time or now
        first_token = self.first_token_time or now
        return scheduled - self.received_time, first_token - scheduled, now - first_token

    @classmethod
    def from_add(
        cls, message: AddRequest, client_id: str, block_size: int, lora: LoraRequest | None = None
    ) -> Request:
        """lora: the adapter message.lora_name resolved to (engine_core/lora_table.py)."""
        # keyed by the adapter's id, not its name: a name loaded again from another folder shares no KV
        lora_key = f"lora:{lora.lora_id}" if lora is not None else None
        # the decoder's KV depends on the audio it attends to: blocks of another audio are not these
        media_key = f"encoder:{message.encoder_input.content_hash}" if message.encoder_input else None
        extra_keys = tuple(k for k in (lora_key, message.cache_salt, media_key) if k is not None)
        return cls(
            message.request_id,
            message.prompt_token_ids,
            message.sampling_params,
            arrival_time=message.arrival_time,
            priority=message.priority,
            client_id=client_id,
            block_size=block_size,
            extra_keys=extra_keys,
            pooling_params=message.pooling_params,
            lora=lora,
            encoder_input=message.encoder_input,
            mm_inputs=message.mm_inputs,
        )

    @property
    def encoder_tokens_needed(self) -> int:
        """Encoder positions its next admission computes: its input's, unless the worker holds them."""
        if self.encoder_input is None or self.encoder_done:
            return 0
        return self.encoder_input.num_tokens

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def num_computed_after_flight(self) -> int:
        """Tokens with KV once the steps in flight come back."""
        return self.num_computed_tokens + self.num_tokens_ahead

    @property
    def num_tokens_after_flight(self) -> int:
        """Tokens known once the steps in flight come back (their sampled outputs included)."""
        return self.num_tokens + self.num_outputs_ahead

    @property
    def is_finished(self) -> bool:
        return self.status.is_finished

    def append_output_token_ids(self, token_ids: list[int]) -> None:
        self.output_token_ids.extend(token_ids)
        self.all_token_ids.extend(token_ids)
        self._update_block_hashes()

    def passes_rope_switch(self, switch: int) -> bool:
        """Whether the request just went past a LongRoPE model's switch length (0: none): from now on every
        position runs on the long factors, so its blocks get keys of their own (the same tokens' KV
        differs), hashed again."""
        if not switch or self.long_rope or self.num_tokens <= switch:
            return False
        self.long_rope = True
        self.extra_keys = (*self.extra_keys, "long-rope")
        self.block_hashes = []
        self._update_block_hashes()
        return True

    def key_dynamic_rope(self, limit: int) -> None:
        """A dynamic NTK rope (limit: max_position_embeddings, 0: none): a prompt longer than the limit has
        every key rotated on its own length's frequencies (as transformers runs it), so the same tokens'
        KV differs between prompts of different lengths: its blocks get a key of that length."""
        if limit and self.num_prompt_tokens > limit:
            self.extra_keys = (*self.extra_keys, f"dynamic-rope:{self.num_prompt_tokens}")
            self.block_hashes = []
            self._update_block_hashes()

    def _update_block_hashes(self) -> None:
        size = self.block_size
        parent = self.block_hashes[-1] if self.block_hashes else None
        for start in range(len(self.block_hashes) * size, len(self.all_token_ids) - size + 1, size):
            keys = self.extra_keys
            if self.mm_inputs:  # the images the block's tokens stand for (the same text, another image)
                keys = keys + tuple(
                    f"mm:{item.content_hash}"
                    for item in self.mm_inputs
                    if item.offset < start + size and item.offset + item.length > start
                )
            parent = hash_block_tokens(parent, self.all_token_ids[start : start + size], keys)
            self.block_hashes.append(parent)

    def encoder_items_in(self, start: int, num_tokens: int) -> list[int]:
        """Images whose span meets positions [start, start + num_tokens) and whose tower output the worker
        does not hold: what computing those positions needs run first."""
        return [
            index
            for index, item in enumerate(self.mm_inputs)
            if item.offset < start + num_tokens
            and item.offset + item.length > start
            and index not in self.encoder_held
        ]

    def release_encoder_outputs(self) -> None:
        """Forget the images whose span the computed tokens (those in flight included) have passed: the
        worker frees their outputs once it computes past them."""
        done = self.num_computed_after_flight
        self.encoder_held = {
            index for index in self.encoder_held
            if self.mm_inputs[index].offset + self.mm_inputs[index].length > done
        }  # fmt: skip

    def __lt__(self, other: Request) -> bool:
        """Priority order: lower priority value first, then earlier arrival, then id."""
        return (self.priority, self.arrival_time, self.request_id) < (
            other.priority,
            other.arrival_time,
            other.request_id,
        )

    def __repr__(self) -> str:
        return (
            f"Request({self.request_id!r}, {self.status.name}, computed={self.num_computed_tokens}/"
            f"{self.num_tokens}, out={self.num_output_tokens}, ahead={self.num_tokens_ahead}/"
            f"{self.num_outputs_ahead})"
        )
