"""One step of a pooling model: run the scheduled tokens, pool each request whose prompt the step ends.

An encoder (worker/models/bert.py) gets each input whole in one step and attends within it; a causal LM
served as an embedder runs on the paged cache like a generative one, chunked prefill included. Across a
causal LM's chunks what a pooling type needs is kept here: CLS the first row, MEAN and ALL the rows
(MEAN sums them once, when the last chunk is in, so the sum's order never depends on the chunks); LAST needs only the last chunk's last row (and is the one type whose
requests may start from the prefix cache: the engine turns the cache off for the others).
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch
import torch.nn.functional as F

from protocol.pooling import PooledOutput, PoolerConfig, PoolingParams
from protocol.worker_messages import ModelRunnerOutput
from worker.input_batch import InputBatch, RequestState, StepInputs


class PoolingStep:
    def __init__(self, pooler: PoolerConfig, num_labels: int) -> None:
        self.pooler = pooler
        self.num_labels = num_labels
        # a causal LM's requests between chunks: CLS's first row, MEAN's sum, ALL's rows (float32)
        self.partial: dict[str, list[torch.Tensor]] = {}

    def remove(self, request_id: str) -> None:
        self.partial.pop(request_id, None)

    def execute(
        self,
        model: Any,
        inputs: StepInputs,
        batch: InputBatch,
        kv_caches: list[torch.Tensor],
        backend: Any,
        lora: Any = None,
    ) -> ModelRunnerOutput:
        """model: a BertModel or a CausalLM (its `norm` after the last layer); lora: the step's
        LoraBatch (a causal LM's adapters)."""
        counts, starts = inputs.counts, inputs.starts
        ends = np.cumsum(counts)
        firsts = ends - counts
        states = [batch.requests[request_id] for request_id in inputs.request_ids]
        finishing = [i for i, s in enumerate(states) if starts[i] + counts[i] >= s.num_prompt_tokens]
        kind = self.pooler.pooling_type
        if getattr(model, "is_encoder", False):
            segments = [(int(firsts[i]), int(ends[i])) for i in range(len(states))]
            hidden = model(inputs.input_ids, inputs.positions, segments, _token_types(inputs, states, firsts))
            row_of = np.arange(len(inputs.input_ids))  # every row returned, in step order
        else:
            if kind == "LAST":
                wanted = [int(ends[i]) - 1 for i in finishing]
            elif kind == "CLS":
                wanted = [int(firsts[i]) for i in range(len(states)) if starts[i] == 0]
            else:
                wanted = list(range(len(inputs.input_ids)))
            out_rows = torch.tensor(wanted, dtype=torch.long)
            hidden = model(
                inputs.input_ids,
                inputs.positions,
                kv_caches,
                inputs.metadata,
                backend,
                out_rows,
                lora,
            )
            hidden = model.norm(hidden)  # HF's last_hidden_state is after the final norm
            row_of = np.full(len(inputs.input_ids), -1)
            row_of[wanted] = np.arange(len(wanted))
        model_dtype, hidden = hidden.dtype, hidden.float()
        output = ModelRunnerOutput({})
        values: dict[int, torch.Tensor] = {}
        for i, state in enumerate(states):
            first, end = int(firsts[i]), int(ends[i])
            kept = self.partial.setdefault(state.request_id, [])
            if kind == "CLS" and starts[i] == 0:
                kept.append(hidden[row_of[first]])
            elif kind in ("MEAN", "ALL"):  # the rows; MEAN sums them once, at the end, in one order
                kept.append(hidden[row_of[first] : row_of[end - 1] + 1])
            if i not in finishing:
                continue
            del self.partial[state.request_id]
            if kind == "LAST":
                values[i] = hidden[row_of[end - 1]]
            elif kind == "MEAN":
                values[i] = torch.cat(kept).sum(0) / state.num_prompt_tokens
            elif kind == "ALL":
                values[i] = torch.cat(kept)
            else:
                values[i] = kept[0]
        if not values:
            return output
        order = sorted(values)
        params = [states[i].pooling_params or PoolingParams() for i in order]
        if self.num_labels:
            rows = torch.stack([values[i] for i in order]).to(model_dtype)
            pooled = model.classify(rows).float()
            results = [self._activate(row, p) for row, p in zip(pooled, params, strict=True)]
        else:
            results = [self._embedding(values[i], p) for i, p in zip(order, params, strict=True)]
        for i, value in zip(order, results, strict=True):
            value = value.contiguous()
            output.pooled[states[i].request_id] = PooledOutput(value.numpy().tobytes(), list(value.shape))
        return output

    def _embedding(self, value: torch.Tensor, params: PoolingParams) -> torch.Tensor:
        """Matryoshka: the first `dimensions` values, then (if asked) unit length, as vLLM does."""
        dimensions = params.dimensions or self.pooler.dimensions
        if dimensions is not None:
            value = value[..., :dimensions]
        normalize = self.pooler.normalize if params.normalize is None else params.normalize
        return F.normalize(value, p=2, dim=-1) if normalize else value

    def _activate(self, logits: torch.Tensor, params: PoolingParams) -> torch.Tensor:
        activation = self.pooler.activation if params.activation is None else params.activation
        if not activation:
            return logits
        return torch.sigmoid(logits) if self.num_labels == 1 else torch.softmax(logits, dim=-1)


def _token_types(inputs: StepInputs, states: list[RequestState], firsts: np.ndarray) -> torch.Tensor | None:
    """Type 1 from each input's token_type_start on (a cross-encoder's second text); None if all are 0."""
    starts = [s.pooling_params.token_type_start if s.pooling_params else None for s in states]
    if all(start is None for start in starts):
        return None
    types = torch.zeros(len(inputs.input_ids), dtype=torch.long)
    for i, start in enumerate(starts):
        if start is not None:
            types[int(firsts[i]) + start : int(firsts[i] + inputs.counts[i])] = 1
    return types
