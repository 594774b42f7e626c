"""csrc fused_experts (csrc/moe_cpu.cpp) against transformers' expert loop in torch (Experts.reference):
float32 and bf16, both weight layouts the CPU has, the three gated activations, with and without biases;
and batch invariance: a row's output has the same bits alone, among other rows, and among rows that chose
the same experts."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from worker.model_config import ModelConfig
from worker.models.experts import Experts

EXPERTS, HIDDEN, INTER, TOP = 8, 128, 96, 3
TOLERANCE = {torch.float32: 1e-4, torch.bfloat16: 3e-2}
BASE = ModelConfig(family="mixtral", vocab_size=16, hidden_size=HIDDEN, intermediate_size=INTER, num_layers=1,
                   num_heads=2, num_kv_heads=2, head_dim=64, rms_norm_eps=1e-6, rope_theta=1e4,
                   max_position_embeddings=64, tie_word_embeddings=False, num_experts=EXPERTS,
                   num_experts_per_tok=TOP, moe_intermediate_size=INTER)  # fmt: skip


def experts(ops, dtype: torch.dtype, act: str, bias: bool, seed: int = 0) -> tuple[Experts, Experts]:  # type: ignore[no-untyped-def]
    """(the torch loop, the same weights packed for the kernel)."""
    config = dataclasses.replace(BASE, moe_act=act, expert_bias=bias, swiglu_limit=1.5, swiglu_alpha=1.3)
    generator = torch.Generator().manual_seed(seed)
    pair = Experts(config, dtype, None), Experts(config, dtype, ops)
    for name, param in pair[0].named_parameters():
        value = (torch.randn(param.shape, generator=generator) * (0.2 if "bias" in name else 0.1)).to(dtype)
        for module in pair:
            getattr(module, name).data.copy_(value)
    return pair


def routed(tokens: int, dtype: torch.dtype, seed: int = 1) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    x = torch.randn(tokens, HIDDEN, generator=generator).to(dtype)
    ids = torch.stack([torch.randperm(EXPERTS, generator=generator)[:TOP] for _ in range(tokens)])
    weights = torch.softmax(torch.randn(tokens, TOP, generator=generator), dim=-1)
    return x, ids, weights


def layouts(ops, dtype: torch.dtype) -> list[bool]:  # type: ignore[no-untyped-def]
    """The `pairs` choices that give different layouts here: pairs only for bf16 with AVX-512 BF16."""
    return [True, False] if dtype == torch.bfloat16 and ops.pairs_available() else [False]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("act", ["silu", "gelu_tanh", "swiglu_clamped"])
@pytest.mark.parametrize("bias", [False, True])
def test_fused_experts_matches_the_torch_loop(ops, dtype, act, bias) -> None:  # type: ignore[no-untyped-def]
    x, ids, weights = routed(29, dtype)
    for pairs in layouts(ops, dtype):
        reference, fused = experts(ops, dtype, act, bias)
        fused.pack(pairs)
        assert fused.w13 is not None and fused.w13.dim() == (5 if pairs else 4)
        with torch.no_grad():
            expected, actual = reference(x, ids, weights), fused(x, ids, weights)
        assert actual.dtype == dtype and actual.shape == x.shape
        tolerance = TOLERANCE[dtype]
        torch.testing.assert_close(actual.float(), expected.float(), atol=tolerance, rtol=tolerance)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fused_experts_is_batch_invariant(ops, dtype) -> None:  # type: ignore[no-untyped-def]
    """Row 0 alone, in a batch of 40, and in a batch where 15 more rows chose its very experts (so that its
    expert's products run with 16 rows, in passes of 6): the same bits each time."""
    x, ids, weights = routed(40, dtype, seed=3)
    crowd_x = torch.cat([x[:1], x[1:16]])
    crowd_ids = torch.cat([ids[:1], ids[:1].expand(15, TOP)])
    crowd_weights = torch.cat([weights[:1], weights[1:16]])
    for pairs in layouts(ops, dtype):
        _, fused = experts(ops, dtype, "silu", True)
        fused.pack(pairs)
        with torch.no_grad():
            alone = fused(x[:1], ids[:1], weights[:1])
            assert fused(x, ids, weights)[:1].equal(alone)
            assert fused(crowd_x, crowd_ids, crowd_weights)[:1].equal(alone)
            assert fused(x[:1].expand(7, HIDDEN), ids[:1].expand(7, TOP), weights[:1].expand(7, TOP))[
                6:
            ].equal(alone)


def test_fused_experts_refuses_an_expert_out_of_range(ops) -> None:  # type: ignore[no-untyped-def]
    x, ids, weights = routed(3, torch.float32)
    _, fused = experts(ops, torch.float32, "silu", False)
    fused.pack()
    with pytest.raises(RuntimeError, match="out of range"):
        fused(x, ids + EXPERTS, weights)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("gated", [False, True])
def test_a_shared_expert_is_added_as_transformers_adds_it(ops, dtype, gated) -> None:  # type: ignore[no-untyped-def]
    """Qwen2-MoE's shared expert: its output times sigmoid(gate logit), added to the routed experts' sum."""
    x, ids, weights = routed(17, dtype, seed=6)
    generator = torch.Generator().manual_seed(7)
    shared = torch.randn(17, HIDDEN, generator=generator).to(dtype)
    gate = (3 * torch.randn(17, 1, generator=generator)).to(dtype) if gated else None
    reference, fused = experts(ops, dtype, "silu", False)
    fused.pack()
    with torch.no_grad():
        expected = reference(x, ids, weights, shared, gate)
        actual = fused(x, ids, weights, shared, gate)
    tolerance = TOLERANCE[dtype]
    torch.testing.assert_close(actual.float(), expected.float(), atol=tolerance, rtol=tolerance)
    assert not actual.equal(fused(x, ids, weights)), "the shared expert changes the output"


@pytest.mark.parametrize("router", ["softmax", "topk_softmax", "softmax_grouped", "sigmoid_grouped"])
@pytest.mark.parametrize("renormalize", [False, True])
def test_route_experts_matches_the_torch_routers(ops, router: str, renormalize: bool) -> None:  # type: ignore[no-untyped-def]
    """csrc route_experts against SparseMoE.route_reference (transformers' routers): the same experts for
    each row and their weights; and a row's choice the same alone as among the others."""
    from worker.models.moe import SparseMoE

    config = dataclasses.replace(BASE, num_experts=16, num_experts_per_tok=4, moe_router=router,
                                 norm_topk_prob=renormalize, n_group=4, topk_group=2,
                                 routed_scaling_factor=1.5)  # fmt: skip
    moe = SparseMoE(config, torch.float32, ops)
    generator = torch.Generator().manual_seed(11)
    if moe.score_bias is not None:
        moe.score_bias.data.copy_(0.1 * torch.randn(16, generator=generator))
    logits = 2 * torch.randn(23, 16, generator=generator)
    expected_ids, expected_weights = moe.route_reference(logits)
    bias = moe.score_bias if moe.score_bias is not None else torch.empty(0)
    kind = ["softmax", "topk_softmax", "softmax_grouped", "sigmoid_grouped"].index(router)
    ids, weights = ops.route_experts(logits, kind, 4, renormalize, 1.5, bias, 4, 2)
    order, expected_order = ids.argsort(dim=-1), expected_ids.argsort(dim=-1)
    assert ids.gather(1, order).equal(expected_ids.gather(1, expected_order))
    torch.testing.assert_close(
        weights.gather(1, order), expected_weights.gather(1, expected_order), atol=1e-6, rtol=1e-5
    )
    for row in (0, 7, 22):
        alone = ops.route_experts(logits[row : row + 1], kind, 4, renormalize, 1.5, bias, 4, 2)
        assert alone[0].equal(ids[row : row + 1]) and alone[1].equal(weights[row : row + 1])
