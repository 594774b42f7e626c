"""One transcription or translation on its way: audio -> 16 kHz samples -> windows of at most 30 s -> one
engine request each (its features, its decoder prompt) -> their texts, in order.

Decoding and feature extraction run in threads, off the event loop. When the request names no language
(and the model is multilingual), a one-token request over the first window, restricted to the language
tokens, picks it (as transformers' detect_language does). Every window runs at once, so the engine
batches them; a stream yields a window's text only once the windows before it are done, and a caller that
leaves closes the generators, which aborts every window's engine request.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncGenerator, AsyncIterator
from dataclasses import dataclass, field

import numpy as np

from frontend.audio.chunks import chunk_bounds
from frontend.audio.decode import decode_audio
from frontend.audio.form import AudioRequest, invalid
from frontend.audio.limits import AudioLimits, AudioTooLargeError, InvalidAudioError
from frontend.audio.speech_model import SAMPLE_RATE, TIME_PRECISION_S, SpeechModel
from frontend.engine.async_llm import AsyncLLM, final_state, gather_all, merged
from frontend.engine.output_processor import Delta, RequestState
from protocol.media import EncoderInput
from protocol.sampling import SamplingParams

NO_SPACE_LANGUAGES = ("ja", "zh")


@dataclass
class Window:
    """One window of the audio and its engine request."""

    index: int
    start_s: float
    end_s: float
    encoder_input: EncoderInput
    prompt_token_ids: list[int] = field(default_factory=list)
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)  # each output token's, when the answer has segments
    finish_reason: str | None = None

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids)


@dataclass
class AudioRun:
    request_id: str
    body: AudioRequest
    duration_s: float
    language: str | None
    windows: list[Window]
    params: SamplingParams

    @property
    def text(self) -> str:
        return "".join(self.separator(window.index, window.text) + window.text for window in self.windows)

    def separator(self, index: int, text: str) -> str:
        """What goes before a later window's text: a space where it has none (none in Japanese and
        Chinese, written without spaces), as vLLM joins its chunks."""
        glued = index == 0 or not text or text[0].isspace() or self.language in NO_SPACE_LANGUAGES
        return "" if glued else " "

    @property
    def num_prompt_tokens(self) -> int:
        return sum(len(window.prompt_token_ids) for window in self.windows)

    @property
    def num_output_tokens(self) -> int:
        return sum(window.num_output_tokens for window in self.windows)


async def prepare(
    llm: AsyncLLM,
    speech: SpeechModel,
    body: AudioRequest,
    request_id: str,
    limits: AudioLimits,
    max_model_len: int,
) -> AudioRun:
    """Decode, cut, extract features, settle the language and build each window's request."""
    try:
        samples = await asyncio.to_thread(decode_audio, body.file, limits, SAMPLE_RATE)
    except (InvalidAudioError, AudioTooLargeError) as error:
        raise invalid("file", str(error)) from None
    return await prepare_samples(llm, speech, body, request_id, samples, max_model_len)


async def prepare_samples(
    llm: AsyncLLM,
    speech: SpeechModel,
    body: AudioRequest,
    request_id: str,
    samples: np.ndarray,
    max_model_len: int,
) -> AudioRun:
    """prepare() of audio already decoded: float32 mono samples at 16 kHz."""
    bounds = chunk_bounds(samples, SAMPLE_RATE, chunk_s=speech.chunk_samples / SAMPLE_RATE)
    inputs = await asyncio.to_thread(lambda: [speech.features(samples[start:end]) for start, end in bounds])
    windows = [
        Window(i, start / SAMPLE_RATE, end / SAMPLE_RATE, encoder_input)
        for i, ((start, end), encoder_input) in enumerate(zip(bounds, inputs, strict=True))
    ]
    language = body.language
    if language is not None:
        if (why := speech.check_language(language)) is not None:
            raise invalid("language", why)
    elif speech.language_ids:
        language = await detect_language(llm, speech, windows[0].encoder_input, f"{request_id}-lang")
    task = body.task
    if task == "translate" and not speech.task_ids.get("translate"):
        raise invalid("model", "this model does not translate")
    for window in windows:
        window.prompt_token_ids = speech.decoder_prompt(language, task, body.prompt, body.timestamps)
    longest = max(len(window.prompt_token_ids) for window in windows)
    room = max_model_len - longest
    if body.max_completion_tokens is not None and body.max_completion_tokens > room:
        raise invalid("max_completion_tokens", f"at most {room} tokens follow this prompt (max_model_len {max_model_len}).")  # fmt: skip
    params = SamplingParams(
        temperature=body.temperature,
        top_p=1.0 if body.top_p is None else body.top_p,
        top_k=0 if body.top_k is None else body.top_k,
        min_p=body.min_p or 0.0,
        seed=body.seed,
        frequency_penalty=body.frequency_penalty or 0.0,
        presence_penalty=body.presence_penalty or 0.0,
        repetition_penalty=1.0 if body.repetition_penalty is None else body.repetition_penalty,
        max_tokens=body.max_completion_tokens or room,
        logprobs=0 if body.timestamps else None,  # a segment's avg_logprob
        bad_words_token_ids=[[token_id] for token_id in speech.suppress_ids],
        begin_suppress_token_ids=speech.begin_suppress_ids,
        timestamp_rules=speech.timestamp_rules() if body.timestamps else None,
    )
    params.validate()
    duration_s = len(samples) / SAMPLE_RATE
    return AudioRun(request_id, body, duration_s, language, windows, params)


async def detect_language(
    llm: AsyncLLM, speech: SpeechModel, encoder_input: EncoderInput, request_id: str
) -> str:
    params = SamplingParams(
        temperature=0.0, max_tokens=1, allowed_token_ids=sorted(speech.language_ids.values())
    )
    generation = llm.generate(
        request_id, [speech.start_id], params, encoder_input=encoder_input, incremental=False
    )
    state = await final_state(generation)
    return speech.language_of(state.choices[0].token_ids[0])


def _generate(
    llm: AsyncLLM, run: AudioRun, window: Window
) -> AsyncGenerator[tuple[RequestState, Delta], None]:
    return llm.generate(
        f"{run.request_id}-{window.index}",
        window.prompt_token_ids,
        run.params,
        encoder_input=window.encoder_input,
        log_id=run.body.request_id,
    )


async def run_all(llm: AsyncLLM, speech: SpeechModel, run: AudioRun) -> AudioRun:
    """Every window to its end (one batch in the engine); the run with their texts (with timestamps, the
    text of their segments: a tokenizer that spells the timestamp tokens does not put them in the text)."""
    states = await gather_all([final_state(_generate(llm, run, window)) for window in run.windows])
    for window, state in zip(run.windows, states, strict=True):
        _finish(window, state)
        if run.body.timestamps:
            window.text = "".join(segment.text for segment in segments_of(window, speech))
    return run


async def stream_texts(llm: AsyncLLM, run: AudioRun) -> AsyncIterator[tuple[Window, str]]:
    """(window, new text) in the audio's order, as it comes; every window runs at once meanwhile."""
    streams = [_generate(llm, run, window) for window in run.windows]
    pending: dict[int, list[str]] = {window.index: [] for window in run.windows}
    done: set[int] = set()
    current = 0  # the first window not yet fully yielded
    started: set[int] = set()  # windows whose first text went out (after its separator)

    def piece(index: int, text: str) -> str:
        if not text or index in started:
            return text
        started.add(index)
        return run.separator(index, text) + text

    async for index, (state, delta) in merged(streams):
        window = run.windows[index]
        if delta.finish_reason is not None:
            _finish(window, state)
            done.add(index)
        if index == current:
            if text := piece(index, delta.text):
                yield window, text
        else:
            pending[index].append(delta.text)
        while current in done:
            current += 1
            if current < len(run.windows):
                for text in pending.pop(current):
                    if text := piece(current, text):
                        yield run.windows[current], text


def _finish(window: Window, state: RequestState) -> None:
    choice = state.choices[0]
    window.text = choice.text
    window.token_ids = list(choice.token_ids)
    if choice.logprobs is not None:
        window.logprobs = [row[0] for row in choice.logprobs.logprobs]
    window.finish_reason = choice.finish_reason


@dataclass
class Segment:
    start_s: float
    end_s: float
    token_ids: list[int]
    logprobs: list[float]
    text: str = ""


def segments_of(window: Window, speech: SpeechModel) -> list[Segment]:
    """A window's output cut at its timestamp tokens (its prompt opened the first at <|0.00|>)."""
    begin, found = speech.timestamp_begin, []
    start, ids, logprobs = 0.0, [], []  # type: ignore[var-annotated]
    values = window.logprobs or [0.0] * len(window.token_ids)
    for token_id, logprob in zip(window.token_ids, values, strict=True):
        if token_id >= begin:
            time_s = (token_id - begin) * TIME_PRECISION_S
            if ids:
                found.append(Segment(start, time_s, ids, logprobs))
                ids, logprobs = [], []
            start = time_s
        elif token_id != speech.eos_id:
            ids.append(token_id)
            logprobs.append(logprob)
    if ids:
        found.append(Segment(start, window.end_s - window.start_s, ids, logprobs))
    for segment in found:
        segment.start_s = min(window.start_s + segment.start_s, window.end_s)
        segment.end_s = min(
            window.start_s + max(segment.end_s, segment.start_s - window.start_s), window.end_s
        )
        segment.text = speech.tokenizer.decode(segment.token_ids, skip_special_tokens=True)
    return found
