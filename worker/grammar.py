"""Structured outputs in the worker: each constrained request's matcher, and the bitmask of each step.

- Compilation runs on a thread pool, cached by spec, from the moment the request arrives, so it
  overlaps the request's prefill; a step waits for a grammar only when the request samples before it is
  ready, and a grammar not ready within grammar_compile_timeout_s fails its request (never a hang).
- The bitmask of a step is filled on another thread while the step's forward runs (llguidance drops the
  GIL), and joined before sampling.
- A request with start_after_token_ids (the end of a reasoning section) is free until its output
  contains them; the matcher sees only what follows.

Invariant: a request's matcher has accepted exactly its output tokens after the start marker.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field

import numpy as np
import torch

from protocol.config import WorkerConfig
from protocol.messages import RequestError
from protocol.structured_outputs import StructuredOutputsParams
from structured_outputs import Backend, GrammarCompileError, Matcher, get_backend
from structured_outputs.base import bitmask_width
from structured_outputs.tokenizer import load_tokenizer

logger = logging.getLogger("engine.worker")

PARAM = "structured_outputs"
MAX_CACHED_GRAMMARS = 256


@dataclass
class RequestGrammar:
    spec: StructuredOutputsParams
    compiled: Future[Matcher]  # the cached grammar at its start state, shared by equal specs
    deadline: float  # time.monotonic() by which the grammar must be ready
    pending: list[int] = field(default_factory=list)  # output tokens the matcher has not seen yet
    started: bool = False  # the start marker has appeared (always, without one)
    matcher: Matcher | None = None  # this request's own copy, made on first use
    error: str = ""


class GrammarManager:
    def __init__(self, config: WorkerConfig, vocab_size: int, eos_token_ids: list[int]) -> None:
        self.config = config
        self.vocab_size = vocab_size
        self.eos_token_ids = eos_token_ids
        self.pool = ThreadPoolExecutor(max_workers=2, thread_name_prefix="grammar-compile")
        # its own thread, so a step's bitmask never queues behind compilations
        self.mask_thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix="grammar-mask")
        self._backend: Backend | None = None  # the tokenizer's trie, built on first use (about 0.6 s)
        self.backend_lock = threading.Lock()
        self.cache: OrderedDict[bytes, Future[Matcher]] = OrderedDict()
        self.requests: dict[str, RequestGrammar] = {}

    # ---- request lifecycle ----

    def add(self, request_id: str, spec: StructuredOutputsParams, output_token_ids: list[int]) -> None:
        """A request arrives (or resumes after preemption, with the output it already has)."""
        state = RequestGrammar(
            spec, self._compiled(spec), time.monotonic() + self.config.grammar_compile_timeout_s
        )
        state.started = not spec.start_after_token_ids
        for token_id in output_token_ids:
            self._note_token(state, token_id)
        self.requests[request_id] = state

    def remove(self, request_id: str) -> None:
        self.requests.pop(request_id, None)

    def accept(self, request_id: str, token_id: int) -> None:
        state = self.requests.get(request_id)
        if state is not None:
            self._note_token(state, token_id)

    def _note_token(self, state: RequestGrammar, token_id: int) -> None:
        if state.started:
            state.pending.append(token_id)
            return
        state.pending.append(token_id)  # kept only to find the marker
        marker = state.spec.start_after_token_ids
        if state.pending[-len(marker) :] == marker:
            state.started = True
        state.pending = [] if state.started else state.pending[-len(marker) :]

    # ---- one step ----

    def constrained(self, request_ids: list[str]) -> list[int]:
        """Positions in request_ids (the rows sampling this step) whose grammar applies now."""
        return [i for i, r in enumerate(request_ids) if r in self.requests and self.requests[r].started]

    def start_bitmask(self, request_ids: list[str]) -> Future[tuple[np.ndarray, dict[str, str]]] | None:
        """Fill the bitmask of the rows about to sample on a pool thread (while the forward runs)."""
        if not self.constrained(request_ids):
            return None
        return self.mask_thread.submit(self._fill, list(request_ids))

    def _fill(self, request_ids: list[str]) -> tuple[np.ndarray, dict[str, str]]:
        """bitmask [B, words] (unconstrained rows all ones) and the requests that failed."""
        bitmask = np.full((len(request_ids), bitmask_width(self.vocab_size)), -1, dtype=np.int32)
        errors = {}
        for row in self.constrained(request_ids):
            request_id = request_ids[row]
            state = self.requests[request_id]
            matcher = self._ready_matcher(state)
            if matcher is None:
                errors[request_id] = state.error
                continue
            if matcher.is_terminated:
                words = bitmask.view(np.uint32)
                words[row] = 0
                for token_id in self.eos_token_ids:  # the grammar is complete: only EOS may follow
                    words[row, token_id // 32] |= np.uint32(1 << (token_id % 32))
            else:
                matcher.fill_bitmask(bitmask, row)
        return bitmask, errors

    def _ready_matcher(self, state: RequestGrammar) -> Matcher | None:
        """The request's matcher, caught up with its output; None (and state.error) on failure."""
        if state.error:
            return None
        if state.matcher is None:
            try:
                compiled = state.compiled.result(timeout=max(state.deadline - time.monotonic(), 0.0))
                state.matcher = self.backend().copy(compiled)
            except TimeoutError:
                state.error = (
                    f"the {state.spec.kind} grammar did not compile within "
                    f"{self.config.grammar_compile_timeout_s:g} s."
                )
                return None
            except (GrammarCompileError, ValueError, OSError) as error:
                state.error = str(error)
                return None
        for token_id in state.pending:
            if state.matcher.is_terminated:
                break  # complete: what follows is EOS (kept sampling under ignore_eos), not grammar
            if not state.matcher.accept_token(token_id):
                state.error = f"the output left the grammar: {state.matcher.error}"
                return None
        state.pending.clear()
        return state.matcher

    def apply(
        self, future: Future[tuple[np.ndarray, dict[str, str]]] | None
    ) -> tuple[torch.Tensor | None, dict[str, RequestError]]:
        """Join the step's bitmask: an allowed-token mask [B, vocab] bool, and the failed requests."""
        if future is None:
            return None, {}
        bitmask, errors = future.result()
        bits = torch.from_numpy(bitmask).unsqueeze(-1) >> torch.arange(32, dtype=torch.int32)  # [B, W, 32]
        allowed = (bits & 1).bool().flatten(1)[:, : self.vocab_size]  # [B, vocab]
        return allowed, {r: RequestError(PARAM, message) for r, message in errors.items()}

    # ---- compilation ----

    def backend(self) -> Backend:
        with self.backend_lock:  # NOTE: built inline, not on the pool: a compile task waiting for a
            if self._backend is None:  # pool task could deadlock the pool
                self._backend = self._load_backend()
            return self._backend

    def _load_backend(self) -> Backend:
        started = time.monotonic()
        tokenizer = load_tokenizer(self.config.tokenizer or self.config.model, self.config.cache_dir)
        if tokenizer is None:
            raise GrammarCompileError("structured outputs need the model's tokenizer, and it has none")
        backend = get_backend(
            self.config.structured_outputs_backend, tokenizer, self.vocab_size, self.eos_token_ids
        )
        logger.info(
            "structured outputs: %s backend ready in %.2f s", backend.name, time.monotonic() - started
        )
        return backend

    def _compiled(self, spec: StructuredOutputsParams) -> Future[Matcher]:
        key = spec.cache_key()
        future = self.cache.get(key)
        if future is not None and not (future.done() and future.exception() is not None):
            self.cache.move_to_end(key)
            return future
        future = self.pool.submit(lambda: self.backend().compile(spec))
        self.cache[key] = future
        while len(self.cache) > MAX_CACHED_GRAMMARS:
            self.cache.popitem(last=False)
        return future

    def shutdown(self) -> None:
        self.pool.shutdown(wait=False, cancel_futures=True)
        self.mask_thread.shutdown(wait=False, cancel_futures=True)
