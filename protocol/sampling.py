"""SamplingParams: how one request is sampled and when it stops. Validated once, at the edge."""

from __future__ import annotations

import msgspec

from protocol.errors import InvalidParameterError
from protocol.structured_outputs import StructuredOutputsParams

# NOTE: hard caps keep one hostile request from costing every other request: a huge top-k gather per
# step, thousands of stop strings scanned per token, a logit-bias scatter over the whole vocabulary.
MAX_LOGPROBS = 20
MAX_LOGPROB_TOKEN_IDS = 128  # vLLM's bound
MAX_N = 128  # completions per request (each is an engine request)
MAX_STOP_STRINGS = 64
MAX_STOP_STRING_CHARS = 1024
MAX_STOP_TOKEN_IDS = 1024
MAX_LOGIT_BIAS = 1024  # entries
MAX_ALLOWED_TOKEN_IDS = 1 << 17
MAX_BAD_WORDS = 256


class TimestampRules(msgspec.Struct, array_like=True):
    """Whisper's timestamp tokens (transformers' WhisperTimeStampLogitsProcessor): the output opens with a
    timestamp of at most max_initial_index steps; timestamps come in pairs (a segment's end, the next one's
    start), except right before EOS; they never go back; a timestamp is taken whenever the timestamps'
    probabilities together beat every text token's."""

    timestamp_begin: int  # <|0.00|>: every id from it on is a timestamp
    no_timestamps: int  # <|notimestamps|>: never sampled
    eos: int  # ids below it are text
    max_initial_index: int = 50  # the first timestamp's greatest step


class SamplingParams(msgspec.Struct, kw_only=True, omit_defaults=True, array_like=True):
    """Per-request sampling and stop settings. Field order is an ABI: append defaulted fields only."""

    n: int = 1  # number of completions; the frontend fans n > 1 out into n engine requests
    temperature: float = 1.0  # 0 means greedy
    top_p: float = 1.0  # nucleus mass kept, in (0, 1]
    top_k: int = 0  # 0 (or -1) disables; else keep the k most likely tokens
    min_p: float = 0.0  # drop tokens whose probability < min_p * max probability
    seed: int | None = None  # per-request seed: same seed, same output
    presence_penalty: float = 0.0  # subtracted once from every token already in the output
    frequency_penalty: float = 0.0  # subtracted per occurrence in the output
    repetition_penalty: float = 1.0  # HF/CTRL style, over prompt and output tokens
    logit_bias: dict[int, float] | None = None  # token id -> bias added to the logit
    max_tokens: int | None = 16  # None: up to max_model_len
    min_tokens: int = 0  # EOS and stop_token_ids are masked until this many tokens exist
    stop: list[str] = []  # stop strings, matched by the frontend's detokenizer
    stop_token_ids: list[int] = []  # extra token ids that finish the request (engine side)
    ignore_eos: bool = False  # keep going past the model's EOS
    logprobs: int | None = None  # sampled-token logprob plus this many top alternatives
    prompt_logprobs: int | None = None  # the same for every prompt token
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    allowed_token_ids: list[int] | None = None  # only these tokens may be sampled
    bad_words_token_ids: list[list[int]] = []  # token sequences never generated (their last token is banned
    # whenever the output ends with the rest of the sequence)
    structured_outputs: StructuredOutputsParams | None = None  # JSON schema, regex, choice, grammar, ...
    begin_suppress_token_ids: list[int] = []  # never the first output token (Whisper's begin_suppress_tokens)
    timestamp_rules: TimestampRules | None = None  # Whisper's timestamp tokens, when it places text in time
    # vLLM's: each position's logprobs are the sampled token's and exactly these tokens' (in this order) in
    # place of the top ones; logprobs is then their number
    logprob_token_ids: list[int] | None = None

    def for_choice(self, index: int) -> SamplingParams:
        """Completion `index` of an n > 1 request: its own engine request (n = 1), its own seed."""
        seed = None if self.seed is None else self.seed + index
        return msgspec.structs.replace(self, n=1, seed=seed)

    @property
    def is_greedy(self) -> bool:
        return self.temperature < 1e-5

    @property
    def argmax_only(self) -> bool:
        """Every token is the argmax of the model's logits, and nothing else of them is asked for: greedy,
        no logprobs, nothing that changes the logits at any step (penalties, bias, min_tokens' and bad
        words' bans, begin_suppress, allowed tokens, timestamp rules, a grammar)."""
        return (
            self.is_greedy
            and self.logprobs is None
            and self.logprob_token_ids is None
            and not (self.presence_penalty or self.frequency_penalty)
            and self.repetition_penalty == 1.0
            and not self.logit_bias
            and self.min_tokens == 0
            and not self.bad_words_token_ids
            and not self.begin_suppress_token_ids
            and self.allowed_token_ids is None
            and self.timestamp_rules is None
            and self.structured_outputs is None
        )

    def validate(self, vocab_size: int | None = None) -> None:
        """Raise InvalidParameterError naming the first bad field."""
        _check(1 <= self.n <= MAX_N, "n", f"n must be in [1, {MAX_N}], got {self.n}.")
        _check(
            self.temperature >= 0.0,
            "temperature",
            f"temperature must be non-negative, got {self.temperature}.",
        )
        _check(0.0 < self.top_p <= 1.0, "top_p", f"top_p must be in (0, 1], got {self.top_p}.")
        _check(
            self.top_k >= -1,
            "top_k",
            f"top_k must be -1 (disable), 0 (disable) or positive, got {self.top_k}.",
        )
        _check(0.0 <= self.min_p <= 1.0, "min_p", f"min_p must be in [0, 1], got {self.min_p}.")
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            _check(-2.0 <= value <= 2.0, name, f"{name} must be in [-2, 2], got {value}.")
        _check(
            self.repetition_penalty > 0.0,
            "repetition_penalty",
            f"repetition_penalty must be positive, got {self.repetition_penalty}.",
        )
        if self.max_tokens is not None:
            _check(
                self.max_tokens >= 1, "max_tokens", f"max_tokens must be at least 1, got {self.max_tokens}."
            )
        _check(self.min_tokens >= 0, "min_tokens", f"min_tokens must be non-negative, got {self.min_tokens}.")
        if self.max_tokens is not None:
            _check(
                self.min_tokens <= self.max_tokens,
                "min_tokens",
                f"min_tokens ({self.min_tokens}) must not exceed max_tokens ({self.max_tokens}).",
            )
        if self.logprob_token_ids is not None:
            count = len(self.logprob_token_ids)
            _check(0 < count <= MAX_LOGPROB_TOKEN_IDS, "logprob_token_ids",
                   f"logprob_token_ids must have 1 to {MAX_LOGPROB_TOKEN_IDS} entries, got {count}.")  # fmt: skip
            _check(self.logprobs == count, "logprob_token_ids",
                   f"logprobs must equal len(logprob_token_ids) ({count}), got {self.logprobs}.")  # fmt: skip
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            if value is not None and not (name == "logprobs" and self.logprob_token_ids is not None):
                _check(
                    0 <= value <= MAX_LOGPROBS, name, f"{name} must be in [0, {MAX_LOGPROBS}], got {value}."
                )
        _check(all(s for s in self.stop), "stop", "stop strings must not be empty.")
        _check(
            len(self.stop) <= MAX_STOP_STRINGS,
            "stop",
            f"at most {MAX_STOP_STRINGS} stop strings, got {len(self.stop)}.",
        )
        _check(
            all(len(s) <= MAX_STOP_STRING_CHARS for s in self.stop),
            "stop",
            f"stop strings must be at most {MAX_STOP_STRING_CHARS} characters.",
        )
        _check(
            len(self.stop_token_ids) <= MAX_STOP_TOKEN_IDS,
            "stop_token_ids",
            f"at most {MAX_STOP_TOKEN_IDS} stop_token_ids, got {len(self.stop_token_ids)}.",
        )
        _check(
            len(self.logit_bias or {}) <= MAX_LOGIT_BIAS,
            "logit_bias",
            f"at most {MAX_LOGIT_BIAS} logit_bias entries, got {len(self.logit_bias or {})}.",
        )
        if self.allowed_token_ids is not None:
            _check(
                0 < len(self.allowed_token_ids) <= MAX_ALLOWED_TOKEN_IDS,
                "allowed_token_ids",
                f"allowed_token_ids must have 1 to {MAX_ALLOWED_TOKEN_IDS} entries.",
            )
        _check(
            len(self.bad_words_token_ids) <= MAX_BAD_WORDS,
            "bad_words",
            f"at most {MAX_BAD_WORDS} bad words, got {len(self.bad_words_token_ids)}.",
        )
        _check(all(self.bad_words_token_ids), "bad_words", "bad words must not be empty.")
        _check(len(self.begin_suppress_token_ids) <= MAX_BAD_WORDS, "begin_suppress_token_ids",
               f"at most {MAX_BAD_WORDS} begin_suppress_token_ids.")  # fmt: skip
        if self.structured_outputs is not None:
            self.structured_outputs.validate()
        if vocab_size is not None:
            for name, ids in (
                ("allowed_token_ids", self.allowed_token_ids or []),
                ("bad_words", [t for word in self.bad_words_token_ids for t in word]),
                ("begin_suppress_token_ids", self.begin_suppress_token_ids),
                ("timestamp_rules", _rule_ids(self.timestamp_rules)),
                ("logprob_token_ids", self.logprob_token_ids or []),
            ):
                for token_id in ids:
                    _check(0 <= token_id < vocab_size, name, f"token id {token_id} is out of vocabulary.")
            for token_id in self.stop_token_ids:
                _check(
                    0 <= token_id < vocab_size, "stop_token_ids", f"token id {token_id} is out of vocabulary."
                )
            for token_id, bias in (self.logit_bias or {}).items():
                _check(0 <= token_id < vocab_size, "logit_bias", f"token id {token_id} is out of vocabulary.")
                _check(-100.0 <= bias <= 100.0, "logit_bias", f"bias {bias} must be in [-100, 100].")


def _check(ok: bool, param: str, message: str) -> None:
    if not ok:
        raise InvalidParameterError(param, message)


def _rule_ids(rules: TimestampRules | None) -> list[int]:
    return [] if rules is None else [rules.timestamp_begin, rules.no_timestamps, rules.eos]
