"""The model runner: persistent batch state, inputs for one step, the model, the sampler.

Each step: apply the SchedulerOutput diff, flatten the scheduled tokens (decode requests first,
then prefill chunks), run the model over the paged KV cache, score the rows that sample (and the
prompt positions whose logprobs were asked for), sample, and append the sampled tokens.
"""

from __future__ import annotations

import logging
from typing import Any

import numpy as np
import torch

from protocol.config import ParallelConfig, WorkerConfig
from protocol.messages import Logprobs, ModelInfo, RequestError
from protocol.startup import StartupPhases
from protocol.version import __version__
from protocol.worker_messages import ModelRunnerOutput, SchedulerOutput
from structured_outputs import resolve_backend_name
from worker.attention import AttentionBackend, get_attention_backend
from worker.attention.torch_ref import TorchAttentionBackend
from worker.cross_attention import CrossAttentionStore, check_encoder_decoder, plan_cross_entries
from worker.dtypes import resolve_dtype
from worker.gguf_cache import load_model_files
from worker.gpu.device import cuda_dtype, worker_device
from worker.gpu.graph_runner import DecodeGraphs, captured_graphs, decode_graph_sizes
from worker.gpu.setup import cuda_backend, kv_cache_plan, to_device
from worker.grammar import GrammarManager
from worker.host_memory import keep_freed_memory, trim_freed_memory, zeroed_pool
from worker.input_batch import InputBatch, StepInputs
from worker.kernel_table import log_kernel_table
from worker.kv_groups import KVPools, plan_pools
from worker.kv_transfer import kv_connector_for
from worker.lora.manager import LoraManager
from worker.lora.slots import LoraBatch
from worker.mm_inputs import ImageInputs, check_vision
from worker.models import build_model
from worker.models.bert import BertModel
from worker.models.causal_lm import CausalLM
from worker.models.rope import rope_length_limit, rope_position_limit, rope_switch_length
from worker.models.whisper import WhisperModel
from worker.parallel.group import TensorParallelGroup
from worker.parallel.sharding import Shard, ShardingError, check_shardable, shard_config
from worker.pooling import resolve_pooling
from worker.pooling_runner import PoolingStep
from worker.quant.method import int8_activations, packed_blocks
from worker.sampler import SamplerOutput, argmax, gather_logprobs, sample, sampled_logprobs
from worker.sampling_batch import sampling_batch
from worker.step_threads import fix_threads, step_threads_for

logger = logging.getLogger("engine.worker")

# /health's detail and the start's log when the worker runs on the torch paths
NO_KERNELS = (
    "serving without the csrc CPU kernels (--attention-backend torch, or they did not build for this CPU): "
    "the torch paths are slower and batch-variant; `python -m worker.csrc_ops` builds the kernels"
)


class ModelRunner:
    def __init__(self, config: WorkerConfig, phases: StartupPhases | None = None) -> None:
        phases = phases or StartupPhases("worker")
        parallel = config.parallel
        fix_threads(config)
        self.config = config
        self.packed = packed_blocks(config)  # a GGUF file's quantized weights served as its blocks
        self.int8_activations = int8_activations(config, self.packed)  # --activation-quantization int8
        self.model_config, weights = load_model_files(config.model, config.cache_dir, self.packed)
        self.pooling = resolve_pooling(config, self.model_config)  # None: the model generates
        self.device = worker_device(config, self.pooling is not None)  # worker/gpu/device.py
        self.step_threads = step_threads_for(config, self.device.type)  # --decode-threads
        self.dtype = (
            resolve_dtype(config.dtype, self.model_config)
            if self.device.type == "cpu"
            else cuda_dtype(config.dtype, self.model_config.torch_dtype)
        )
        limit = self.model_config.max_position_embeddings
        # a sentence-transformers folder's max_seq_length is its longest input, as vLLM takes it
        longest = self.pooling.max_seq_length if self.pooling is not None else None
        # dynamic NTK stretches the positions by its factor (vLLM's derived max_model_len)
        limit = rope_position_limit(self.model_config.rope_scaling, limit)
        self.max_model_len = config.max_model_len or min(limit, longest or limit)
        if self.max_model_len > limit:
            raise ValueError(f"max_model_len {self.max_model_len} exceeds the model's {limit} positions")
        dynamic = rope_length_limit(self.model_config.rope_scaling) or 0  # where a dynamic rope changes
        self.rope_dynamic = dynamic if self.max_model_len > dynamic else 0
        self.block_size = config.block_size
        switch = rope_switch_length(self.model_config.rope_scaling)  # longrope's (0: none)
        self.rope_switch = switch if self.max_model_len > switch else 0
        phases.mark("config")
        # the CUDA backend is chosen once the rank's shape is known (below)
        self.backend: AttentionBackend = (
            get_attention_backend(config.attention_backend, self.dtype, config.batch_invariant is not False)
            if self.device.type == "cpu"
            else TorchAttentionBackend()
        )
        ops = self.ops = getattr(
            self.backend, "ops", None
        )  # the csrc kernels (None on CUDA and without them)
        self.notices = [] if ops is not None or self.device.type == "cuda" else [NO_KERNELS]
        if config.batch_invariant and ops is None:
            raise ValueError(
                "--batch-invariant needs the csrc CPU kernels, and this worker serves without them ("
                + (
                    "--attention-backend torch"
                    if config.attention_backend == "torch"
                    else "they did not build"
                )
                + "): leave the flag out to serve batch-variant on the torch paths"
            )
        self.batch_invariant = ops is not None and config.batch_invariant is not False
        phases.mark("kernels")
        self.tp: TensorParallelGroup | None = None
        self.shard: Shard | None = None
        if parallel.tensor_parallel_size > 1:
            self._join_group(parallel)
            phases.mark("group")
        if self.device.type == "cuda":
            self.backend = cuda_backend(config.attention_backend, self.model_config, self.dtype, self.device,
                                        self.block_size)  # fmt: skip
        encoder_decoder = self.model_config.is_encoder_decoder
        if encoder_decoder:
            check_encoder_decoder(config, self.device.type)  # worker/cross_attention.py
        if self.model_config.vision is not None:  # worker/mm_inputs.py
            check_vision(config, self.device.type, self.pooling is not None)
        self.model = self._build_model(weights, phases)
        self.images = ImageInputs.of(self.model, self.model_config)
        self.cross: CrossAttentionStore | None = None
        log_kernel_table(self.model, self.backend, self.dtype)
        phases.mark("packing")
        mc = self.model_config
        self.pooling_step = (
            PoolingStep(self.pooling.pooler, mc.num_labels) if self.pooling is not None else None
        )
        graph_sizes = (
            decode_graph_sizes(config, self.backend, parallel.tensor_parallel_size)
            if self.device.type == "cuda"
            and not mc.is_encoder
            and not self.rope_switch
            and not self.rope_dynamic
            else []  # (a graph's staged inputs have no long-rope rows, nor dynamic NTK's)
        )
        # NOTE: before the KV pool: NIXL's UCX patches the C library's memory calls as it starts, and the
        # pool's fault-in thread (worker/host_memory.py) calling madvise meanwhile crashed the worker
        self.kv_transfer = kv_connector_for(config.kv_transfer)  # worker/kv_transfer.py
        if mc.is_encoder:
            # no cache (worker/models/bert.py): the engine's blocks only count the inputs in flight
            self.num_kv_blocks = config.max_num_seqs * -(-self.max_model_len // self.block_size)
            self.pools = KVPools(self.num_kv_blocks, 0, 0)
            self.kv_caches: list[torch.Tensor] = []
        else:
            if self.tp is not None:
                self.tp.wait_for_all()  # the collectives below run once every rank has loaded
            budget = config.kv_cache_memory_bytes
            if encoder_decoder:  # the encoder outputs' store takes its share of the KV budget first
                assert isinstance(self.model, WhisperModel)
                entries, budget = plan_cross_entries(
                    self.model, config, self._bytes_per_block(), self.max_model_len
                )
                self.cross = CrossAttentionStore(self.model, entries, self.block_size)
            self.num_kv_blocks = config.num_kv_blocks or self._num_blocks_for(budget)
            if self.device.type == "cuda" and not config.num_kv_blocks:  # from the device's free memory
                self.num_kv_blocks = kv_cache_plan(self.model, mc, self.dtype, self.device, self.block_size,
                    min(config.max_num_batched_tokens, self.max_model_len), config.max_num_seqs, self.max_model_len,
                    config.gpu_memory_utilization, self.backend).num_blocks  # fmt: skip
            if self.tp is not None:
                self.num_kv_blocks = self.tp.min_int(self.num_kv_blocks)  # one pool size for every rank
            self.pools = self._plan_pools(self.num_kv_blocks, bool(graph_sizes))
            self.num_kv_blocks = self.pools.num_blocks
            # a CUDA graph's padding rows write into one block past the engine's pool (worker/gpu/graph_runner.py)
            shapes: list[tuple[int, ...]] = [
                (
                    self.pools.blocks_of(mc, i) + bool(graph_sizes),
                    mc.kv_entry[0],
                    self.block_size,
                    *mc.kv_entry[1:],
                )
                for i in range(mc.num_layers)
            ]
            self.kv_caches = (
                zeroed_pool(shapes, self.dtype)  # worker/host_memory.py
                if self.device.type == "cpu"
                else [torch.zeros(shape, dtype=self.dtype, device=self.device) for shape in shapes]
            )
        trim_freed_memory()  # what loading freed, e.g. the weights' copies before they moved to huge pages
        keep_freed_memory()  # after loading: steps reuse their activations' memory (worker/host_memory.py)
        phases.mark("kv cache")
        self.graphs: DecodeGraphs | None = None
        if graph_sizes:
            self.graphs = captured_graphs(DecodeGraphs(self.model, self.kv_caches, self.backend, graph_sizes,
                                          self.max_model_len, self.block_size, self.num_kv_blocks, self.device))  # fmt: skip
            phases.mark("cuda graphs")
        self.lora = LoraManager(config.lora, mc, self.dtype, ops) if config.lora is not None else None
        self.batch = InputBatch(
            config.max_num_seqs, self.max_model_len, self.block_size, self.rope_switch, self.rope_dynamic > 0
        )
        self.generator = torch.Generator().manual_seed(config.seed)
        self.eos_token_ids = mc.eos_token_ids
        # NOTE: the grammar backend (the tokenizer's trie, 1-3 s) is built by the first constrained
        # request, as vLLM does, not at start: most engines never serve one
        self.grammar = GrammarManager(config, mc.vocab_size, self.eos_token_ids)
        logger.info(
            "loaded %s (%s, %s), %d KV blocks of %d tokens%s",
            config.model,
            mc.family,
            self.dtype,
            self.num_kv_blocks,
            self.block_size,
            f" (the windowed layers: {self.pools.num_window_blocks})" if self.pools.num_window_blocks else "",
        )

    def _join_group(self, parallel: ParallelConfig) -> None:
        """A tensor-parallel rank: refuse what does not shard, join the others, keep this rank's shape."""
        size = parallel.tensor_parallel_size
        check_shardable(self.model_config, size)
        if self.pooling is not None:
            raise ShardingError(f"--tensor-parallel-size {size}: a pooling runner runs on one worker")
        if self.config.lora is not None:
            raise ShardingError(f"--tensor-parallel-size {size}: LoRA adapters run on one worker so far")
        self.tp = TensorParallelGroup(parallel, self.config.rank, self.batch_invariant, self.device)
        self.shard = Shard(self.model_config, self.config.rank, size)
        self.model_config = shard_config(self.model_config, size)

    def _build_model(
        self, weights: Any, phases: StartupPhases | None = None
    ) -> CausalLM | BertModel | WhisperModel:
        """The model from the checkpoint's weights, packed for the kernels (at start, and on a level-2 wake)."""
        model = build_model(self.model_config, self.dtype, self.ops, self.tp)
        if isinstance(model, CausalLM):
            model.load_weights(weights if self.shard is None else self.shard.weights(weights), self.packed)
        else:
            model.load_weights(weights)
        if phases is not None:
            phases.mark("weights")
        pack = self.device.type == "cpu"
        model.finalize(self.batch_invariant, pack=pack, int8_activations=self.int8_activations)
        model = model.to(self.device)
        if isinstance(model, CausalLM):
            model.init_rotary(self.max_model_len, self.device)
        return model.eval()

    def build_from(self, weights: Any) -> CausalLM | BertModel | WhisperModel:
        """A second copy of the model from (checkpoint name, tensor) pairs: a weight update's (its TP shard
        cut here, as at start)."""
        return self._build_model(weights)

    def reload_model(self) -> CausalLM | BertModel | WhisperModel:
        """A second copy of the model, read from the checkpoint again (a level-2 wake copies it in)."""
        _, weights = load_model_files(self.config.model, self.config.cache_dir, self.packed)
        return self._build_model(weights)

    def _plan_pools(self, num_blocks: int, graphs: bool) -> KVPools:
        """A model mixing windowed and full layers gets a pool for each (worker/kv_groups.py), except under
        CUDA graphs, whose padding rows write one block past a single pool."""
        if graphs:
            return KVPools(num_blocks, 0, 0)
        config = self.config
        return plan_pools(
            self.model_config,
            num_blocks,
            self.block_size,
            self.max_model_len,
            config.max_num_seqs,
            config.max_num_batched_tokens,
            explicit=bool(config.num_kv_blocks),
        )

    def _bytes_per_block(self) -> int:
        mc = self.model_config
        halves, heads, width = mc.kv_entry
        return halves * self.block_size * heads * width * mc.num_layers * self.dtype.itemsize

    def _num_blocks_for(self, num_bytes: int) -> int:
        return max(num_bytes // self._bytes_per_block(), 1)

    def model_info(self) -> ModelInfo:
        names, vision = self.config.served_model_names or [self.config.model], self.model_config.vision
        return ModelInfo(
            model=self.config.model,
            served_model_names=names,
            max_model_len=self.max_model_len,
            block_size=self.block_size,
            vocab_size=self.model_config.vocab_size,
            eos_token_ids=self.eos_token_ids,
            dtype=str(self.dtype).removeprefix("torch."),
            num_kv_blocks=self.num_kv_blocks,
            engine_version=__version__,
            structured_outputs_backend=resolve_backend_name(self.config.structured_outputs_backend),
            batch_invariant=self.batch_invariant,
            notices=self.notices,
            runner="pooling"
            if self.pooling is not None
            else "transcription"
            if self.cross is not None
            else "generate",
            pooling_tasks=[] if self.pooling is None else self.pooling.tasks,
            pooler=None if self.pooling is None else self.pooling.pooler,
            hidden_size=self.model_config.hidden_size,
            id2label={str(index): label for index, label in self.model_config.id2label.items()},
            is_encoder=self.model_config.is_encoder,
            kv_window=self.model_config.kv_window or self.pools.window,
            num_window_blocks=self.pools.num_window_blocks,
            rope_switch_len=self.rope_switch,
            rope_dynamic_len=self.rope_dynamic,
            encoder_len=self.model_config.encoder_len,
            num_mel_bins=self.model_config.num_mel_bins,
            max_num_encoder_outputs=self.cross.max_entries if self.cross is not None else 0,
            image_token_id=vision.image_token_id if vision is not None else -1,
            max_image_tokens=vision.num_image_tokens if vision is not None else 0,
            whole_image_spans=vision is not None and vision.bidirectional,
        )

    # ---- one step ----

    @torch.inference_mode()
    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        with self.step_threads.step(scheduler_output):
            return self._execute(scheduler_output)

    def _execute(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        self._update_states(scheduler_output)
        if scheduler_output.total_num_scheduled_tokens == 0:
            return ModelRunnerOutput({})
        kv_errors = (
            self.kv_transfer.load(scheduler_output.kv_loads, self.kv_caches) if self.kv_transfer else {}
        )
        inputs = self.batch.prepare_inputs(
            scheduler_output.num_scheduled_tokens, bool(self.pools.num_window_blocks)
        )
        lora = self._lora_batch(inputs)
        image_errors, mm_embeds = self.images.step(scheduler_output, inputs) if self.images else ({}, None)
        if self.pooling_step is not None:
            step = self.pooling_step
            pooled = step.execute(self.model, inputs, self.batch, self.kv_caches, self.backend, lora)
            return self._with_lora_errors(pooled, inputs)
        assert not isinstance(self.model, BertModel)  # an encoder only pools
        ends = np.cumsum(inputs.counts)
        sample_pos = [
            i
            for i in range(len(inputs.rows))
            if inputs.starts[i] + inputs.counts[i] >= self._num_tokens(i, inputs)
        ]
        prompt_rows = self._prompt_logprob_rows(inputs, ends)
        score_rows = [int(ends[i]) - 1 for i in sample_pos] + [r for _, rows, _ in prompt_rows for r in rows]
        # The model returns the scored rows only (a decode step scores every row, in order).
        every_row = len(score_rows) == len(inputs.input_ids) and score_rows == list(range(len(score_rows)))
        out_rows = None if every_row else torch.tensor(score_rows, dtype=torch.long, device=self.device)
        sampling_ids = [inputs.request_ids[i] for i in sample_pos]
        bitmask = self.grammar.start_bitmask(sampling_ids)  # filled while the forward runs
        # a decode step whose every row samples runs its batch size's CUDA graph, where there is one
        graphs = self.graphs if out_rows is None and lora is None and mm_embeds is None else None
        logits = graphs.run(inputs) if graphs is not None else None
        if logits is None:
            if self.device.type == "cuda":
                inputs = to_device(inputs, self.device, self.backend)
            model = self.model
            if isinstance(model, WhisperModel):
                assert self.cross is not None
                hidden = model(inputs.input_ids, inputs.positions, self.kv_caches, inputs.metadata, self.backend,
                               out_rows, self.cross.batch(inputs))  # fmt: skip
            else:
                hidden = model(
                    inputs.input_ids,
                    inputs.positions,
                    self.kv_caches,
                    inputs.metadata,
                    self.backend,
                    out_rows,
                    lora,
                    **({"mm_embeds": mm_embeds} if mm_embeds is not None else {}),
                )  # [len(score_rows), hidden]
            logits = self.model.compute_logits(hidden) if score_rows else None  # [n, vocab]
        if self.tp is not None and logits is not None:
            logits = self.tp.gather_logits(logits, self.model_config.vocab_size)  # rank 0's alone
            if logits is None:
                return self._follow(inputs, sampling_ids)
        if logits is not None and self.device.type == "cuda":
            # NOTE: the sampler (its generators, masks, penalties) runs on the host
            logits = logits.float().cpu()

        output = ModelRunnerOutput({}, errors=image_errors)
        for encoder in (self.images, self.cross):  # a vision tower's images, a Whisper encoder's inputs
            if encoder is not None:
                output.num_encoder_inputs += encoder.step_inputs
                output.encoder_seconds += encoder.step_seconds
        if sample_pos:
            assert logits is not None
            states = [self.batch.requests[request_id] for request_id in sampling_ids]
            grammar_mask, grammar_errors = self.grammar.apply(bitmask)
            output.errors.update(grammar_errors)
            sampled_rows = logits[: len(sample_pos)]
            if grammar_mask is None and all(state.argmax_only for state in states):
                # what sample() gives such rows, without their SamplingBatch (~0.1-0.2 ms of Python a step)
                sampled = SamplerOutput(argmax(sampled_rows, self.ops))
            else:
                vocab_size = self.model_config.vocab_size
                sampling = sampling_batch(
                    self.batch, states, vocab_size, self.eos_token_ids, self.generator, self.ops, grammar_mask
                )
                sampled = sample(sampled_rows, sampling)
            if self.tp is not None:
                self.tp.broadcast_token_ids(sampled.token_ids)
            token_ids = sampled.token_ids.tolist()
            for j, state in enumerate(states):
                self.batch.append_token(state.row, token_ids[j])
                self.grammar.accept(state.request_id, token_ids[j])
                output.sampled_token_ids[state.request_id] = [token_ids[j]]
                if state.sampling_params.logprobs is not None:
                    output.logprobs[state.request_id] = sampled_logprobs(sampled, j, state.sampling_params)
        if prompt_rows:
            assert logits is not None
            offset = len(sample_pos)
            for request_id, rows, next_ids in prompt_rows:
                part = torch.log_softmax(logits[offset : offset + len(rows)].float(), dim=-1)
                offset += len(rows)
                k = self.batch.requests[request_id].sampling_params.prompt_logprobs or 0
                ids, values, ranks = gather_logprobs(part, torch.tensor(next_ids), k)
                output.prompt_logprobs[request_id] = Logprobs(ids.tolist(), values.tolist(), ranks.tolist())
        for i, row in enumerate(inputs.rows):
            self.batch.num_computed_tokens[row] = inputs.starts[i] + inputs.counts[i]
        if self.kv_transfer is not None:
            self.kv_transfer.save(scheduler_output.kv_saves, self.kv_caches)
            output.kv_load_errors = kv_errors
        return self._with_lora_errors(output, inputs)

    def _follow(self, inputs: StepInputs, sampling_ids: list[str]) -> ModelRunnerOutput:
        """A rank past 0 after the forward: rank 0's sampled tokens become its next inputs too. Its output
        goes nowhere (rank 0 answers the engine)."""
        if sampling_ids:
            assert self.tp is not None
            token_ids = self.tp.broadcast_token_ids(torch.empty(len(sampling_ids), dtype=torch.long)).tolist()
            for request_id, token_id in zip(sampling_ids, token_ids, strict=True):
                self.batch.append_token(self.batch.requests[request_id].row, token_id)
        for i, row in enumerate(inputs.rows):
            self.batch.num_computed_tokens[row] = inputs.starts[i] + inputs.counts[i]
        return ModelRunnerOutput({})

    def _lora_batch(self, inputs: StepInputs) -> LoraBatch | None:
        if self.lora is None:
            return None
        held = {state.lora.lora_id for state in self.batch.requests.values() if state.lora is not None}
        loras = [self.batch.requests[r].lora for r in inputs.request_ids]
        return self.lora.batch(loras, inputs.counts, held)

    def _with_lora_errors(self, output: ModelRunnerOutput, inputs: StepInputs) -> ModelRunnerOutput:
        """Requests whose adapter could not be read again end with that error (their rows ran on the base
        model this step, and what they produced is dropped by the engine)."""
        if self.lora is None or not self.lora.failed:
            return output
        for request_id in inputs.request_ids:
            lora = self.batch.requests[request_id].lora
            if lora is not None and lora.lora_id in self.lora.failed:
                output.errors[request_id] = RequestError("model", self.lora.failed[lora.lora_id])
        return output

    def _num_tokens(self, i: int, inputs: StepInputs) -> int:
        return int(self.batch.num_tokens[inputs.rows[i]])

    def _update_states(self, scheduler_output: SchedulerOutput) -> None:
        for request_id in scheduler_output.finished_request_ids:
            self.batch.remove(request_id)
            self.grammar.remove(request_id)
            if self.pooling_step is not None:
                self.pooling_step.remove(request_id)
            if self.cross is not None:
                self.cross.drop(request_id)
            if self.images is not None:
                self.images.drop(request_id)
        if self.images is not None:
            self.images.add(scheduler_output.new_requests)
        for new in scheduler_output.new_requests:
            self.batch.add(new)
            if new.sampling_params.structured_outputs is not None and self.config.rank == 0:  # it samples
                self.grammar.add(new.request_id, new.sampling_params.structured_outputs, new.output_token_ids)
        for cached in scheduler_output.cached_requests:
            self.batch.update(cached)
        if self.cross is not None:
            self.cross.add(scheduler_output.new_requests)  # each new request's encoder, once

    def _prompt_logprob_rows(
        self, inputs: StepInputs, ends: np.ndarray
    ) -> list[tuple[str, list[int], list[int]]]:
        """For requests asking prompt logprobs: (id, hidden rows, the prompt token each row predicts)."""
        result = []
        for i, request_id in enumerate(inputs.request_ids):
            state = self.batch.requests[request_id]
            if state.sampling_params.prompt_logprobs is None:
                continue
            start, n = int(inputs.starts[i]), int(inputs.counts[i])
            last = min(start + n, state.num_prompt_tokens - 1)  # position p predicts prompt token p + 1
            if last <= start:
                continue
            first_row = int(ends[i]) - n
            rows = [first_row + p - start for p in range(start, last)]
            next_ids = self.batch.token_ids[state.row, start + 1 : last + 1].tolist()
            result.append((request_id, rows, next_ids))
        return result
