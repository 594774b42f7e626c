"""--activation-quantization int8 (csrc/quant_a8.cpp): the products on packed blocks multiply each row
quantized to int8 per 32 dims. Through the LLM API on the bundled SmolLM2 Q4_1 file: every packed product
takes it (the parts' types carry the bit), the answers stay close to the default's without being its bits;
the csrc decoder stack and expert loop give the Python layers' bits; asked for where no weights are kept
packed, or on a W8A8 checkpoint, a start error naming why."""

from __future__ import annotations

import logging

import pytest

from engine_core.engine_core import EngineCore
from frontend.offline.llm import LLM
from protocol.config import EngineConfig, WorkerConfig
from protocol.sampling import SamplingParams
from tests.test_quantized_gguf import experts_too, mixed_types, tiny_gguf, tokens_and_logprobs
from worker.executor import InprocExecutor
from worker.kernel_table import product_kernel
from worker.model_config import UnsupportedModelError
from worker.models.layers import A8_BIT, Linear
from worker.quant.method import int8_activations

PROMPTS = ["The capital of France is", "def fibonacci(n):", "Once upon a time, in a land far away,"]
GREEDY = SamplingParams(temperature=0.0, max_tokens=8, logprobs=1)


def test_smollm2_with_int8_rows_answers_close_to_the_default(smollm2_gguf: str) -> None:
    worker = WorkerConfig(model=smollm2_gguf, dtype="bfloat16", num_kv_blocks=16, max_model_len=256,
                          activation_quantization="int8")  # fmt: skip
    core = EngineCore(EngineConfig(worker=worker), InprocExecutor(worker))
    try:
        model = core.executor.runner.model  # type: ignore[attr-defined]
        products = [m for m in model.modules() if isinstance(m, Linear) and m.quant_parts is not None]
        assert len(products) == 30 * 4 + 1  # 4 a layer and the tied lm_head
        assert all(bool((m.quant_parts[:, 0] & A8_BIT).all()) for m in products)
        assert "csrc linear_quant_a8" in product_kernel(products[0])  # the worker's kernel table says so
    finally:
        core.shutdown()
    runs = {}
    for mode in (None, "int8"):
        with LLM(smollm2_gguf, dtype="float32", max_model_len=256, num_kv_blocks=32,
                 activation_quantization=mode) as llm:  # fmt: skip
            runs[mode] = llm.generate(PROMPTS, GREEDY)
    differ = 0
    for base, int8 in zip(runs[None], runs["int8"], strict=True):
        first, other = base.outputs[0], int8.outputs[0]
        assert first.token_ids[0] == other.token_ids[0]  # the first token, and its logprob within 0.05
        logprob = first.logprobs[0][first.token_ids[0]].logprob
        assert abs(other.logprobs[0][first.token_ids[0]].logprob - logprob) < 0.05
        differ += logprob != other.logprobs[0][first.token_ids[0]].logprob
    assert differ > 0, "int8 rows gave the default's bits: the flag was not taken"


@pytest.mark.parametrize("name", ["qwen2", "mixtral"])
def test_the_csrc_stack_gives_the_python_layers_bits(name: str, tmp_path) -> None:  # type: ignore[no-untyped-def]
    """The csrc decoder stack (and expert_loop) against the Python layers (and Experts.packed_experts), both
    with int8 rows: the same tokens and logprobs, bit for bit."""
    path = tiny_gguf(tmp_path, name, experts_too if name == "mixtral" else mixed_types)
    native = tokens_and_logprobs(path, "gguf", "bfloat16", activation_quantization="int8")
    python = tokens_and_logprobs(path, "gguf", "bfloat16", expert_loop=True, activation_quantization="int8")
    assert native == python
    assert native != tokens_and_logprobs(path, "gguf", "bfloat16")  # (the default's rows are not int8)


def test_asked_for_without_packed_weights_is_refused(smollm2_gguf: str, tmp_path) -> None:  # type: ignore[no-untyped-def]
    config = WorkerConfig(model=smollm2_gguf, quantization="none", activation_quantization="int8")
    with pytest.raises(UnsupportedModelError, match="--activation-quantization int8 .* kept packed"):
        int8_activations(config, packed=False)
    (tmp_path / "config.json").write_text(
        '{"quantization_config": {"quant_method": "compressed-tensors", "format": "int-quantized", '
        '"config_groups": {"g": {"targets": ["Linear"], "weights": {"num_bits": 8, "type": "int", '
        '"strategy": "channel", "symmetric": true}, "input_activations": {"num_bits": 8, "type": "int", '
        '"strategy": "token", "dynamic": true, "symmetric": true}}}}}'
    )
    w8a8 = WorkerConfig(model=str(tmp_path), activation_quantization="int8")
    with pytest.raises(UnsupportedModelError, match="quantizes its activations itself"):
        int8_activations(w8a8, packed=True)
    with pytest.raises(UnsupportedModelError, match="the choice is int8"):
        int8_activations(WorkerConfig(model=smollm2_gguf, activation_quantization="fp8"), packed=True)


def test_a_cpu_without_the_vector_form_is_warned_of_the_portable_loop(
    smollm2_gguf: str, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """Without AVX2 the int8 products run their portable loop, far slower than the default: the worker's
    start says so (it still serves: the loop gives the same bits). AVX-512 VNNI (Zen 4, Sapphire Rapids) and
    AVX2 (Zen 3) have vector forms."""
    from worker import csrc_ops

    config = WorkerConfig(model=smollm2_gguf, activation_quantization="int8")
    cases = (
        (["avx2", "avx512f", "avx512_vnni", "avx512vbmi"], False),
        (["avx2", "f16c", "fma"], False),
        (["sse4_2", "ssse3"], True),
    )
    for flags, warned in cases:
        monkeypatch.setattr(csrc_ops, "cpu_isa_flags", lambda flags=flags: flags)
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger="engine.worker"):
            assert int8_activations(config, packed=True)
        assert ("no AVX2" in caplog.text) == warned


@pytest.mark.slow
def test_engine_serve_takes_the_flag(smollm2_gguf: str) -> None:
    """`engine serve --activation-quantization int8` on the bundled SmolLM2, the openai SDK's completions: the
    tokens and logprobs the LLM API gives with int8 rows (float32: bit for bit through the JSON), which are
    not the default's."""
    import openai

    from tests.serve_helpers import serving

    expected = {}
    for mode in (None, "int8"):
        with LLM(smollm2_gguf, dtype="float32", max_model_len=256, num_kv_blocks=32,
                 activation_quantization=mode) as llm:  # fmt: skip
            outputs = [out.outputs[0] for out in llm.generate(PROMPTS, GREEDY)]
        expected[mode] = [
            (
                list(o.token_ids),
                [step[t].logprob for step, t in zip(o.logprobs or [], o.token_ids, strict=True)],
            )
            for o in outputs
        ]
    flags = ["--dtype", "float32", "--max-model-len", "256", "--num-kv-blocks", "32"]
    with serving(smollm2_gguf, *flags, "--activation-quantization", "int8") as served:
        client = openai.OpenAI(base_url=f"{served.base}/v1", api_key="none")
        answers = []
        for prompt in PROMPTS:
            done = client.completions.create(model=smollm2_gguf, prompt=prompt, max_tokens=GREEDY.max_tokens,
                                             temperature=0.0, logprobs=1,
                                             extra_body={"return_tokens_as_token_ids": True})  # fmt: skip
            logprobs = done.choices[0].logprobs
            assert logprobs is not None and logprobs.tokens and logprobs.token_logprobs
            tokens = [int(token.removeprefix("token_id:")) for token in logprobs.tokens]
            answers.append((tokens, [float(p) for p in logprobs.token_logprobs]))
    assert answers == expected["int8"]
    assert answers != expected[None]
