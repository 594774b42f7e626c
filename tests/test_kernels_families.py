"""The csrc kernels the families beyond Llama's shape add (Gemma's 1 + w norm as a float32 weight, GELU(tanh)
gating) against their torch forms, as tests/test_kernels.py does for the rest."""

from __future__ import annotations

import pytest
import torch

from tests.test_kernels import DTYPES, _close


@pytest.mark.parametrize("dtype", DTYPES)
def test_gemma_s_offset_norm_on_the_kernel_matches_its_torch_form(ops, dtype) -> None:  # type: ignore[no-untyped-def]
    """rms_norm with a float32 weight (1 + w): Gemma's one rounding, x and its heads, and the fused add."""
    from worker.models.norms import OffsetRMSNorm

    generator = torch.Generator().manual_seed(5)
    reference, fused = OffsetRMSNorm(640, 1e-6, dtype), OffsetRMSNorm(640, 1e-6, dtype, ops)
    weight = (0.3 * torch.randn(640, generator=generator)).to(dtype)
    for norm in (reference, fused):
        norm.weight.data.copy_(weight)
        norm.finalize()
    x = (3 * torch.randn(13, 640, generator=generator)).to(dtype)
    residual = torch.randn(13, 640, generator=generator).to(dtype)
    with torch.no_grad():
        _close(fused(x), reference(x))
        expected_out, expected_residual = reference.add_and_norm(x.clone(), residual.clone())
        out, new_residual = fused.add_and_norm(x.clone(), residual.clone())
    _close(new_residual, expected_residual)
    _close(out, expected_out)
    heads_reference, heads_fused = OffsetRMSNorm(64, 1e-6, dtype), OffsetRMSNorm(64, 1e-6, dtype, ops)
    for norm in (heads_reference, heads_fused):  # a q/k norm over each head of a [tokens, heads, 64] view
        norm.weight.data.copy_(weight[:64])
        norm.finalize()
    heads = x.view(13, 10, 64)[:, 2:8]
    with torch.no_grad():
        _close(heads_fused(heads), heads_reference(heads))


@pytest.mark.parametrize("dtype", DTYPES)
def test_gelu_tanh_and_mul_matches_reference(ops, dtype) -> None:  # type: ignore[no-untyped-def]
    from worker.models.mlp import activation

    gate_up = (4 * torch.randn(9, 2 * 1536, generator=torch.Generator().manual_seed(4))).to(dtype)
    gate, up = gate_up.chunk(2, dim=-1)
    _close(ops.gelu_tanh_and_mul(gate_up), activation("gelu_tanh", gate) * up)
    wide = torch.cat([gate_up, gate_up], dim=1)[:, : 2 * 1536]  # rows strided in a wider tensor
    assert ops.gelu_tanh_and_mul(wide).equal(ops.gelu_tanh_and_mul(gate_up))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(
    "num_heads,num_kv_heads,head_dim,block_size,window",
    [(8, 2, 64, 16, 0), (8, 2, 64, 16, 5), (4, 4, 32, 8, 0), (16, 4, 64, 32, 20)],
)
def test_attention_sinks_match_reference(
    ops, dtype, num_heads, num_kv_heads, head_dim, block_size, window
) -> None:  # type: ignore[no-untyped-def]
    """gpt-oss's sinks (a logit per head in the softmax's sum, some above every score, some far below), with
    and without a window, on decode rows and prefill chunks' rows, the register kernel's and the portable
    one's (fewer rows than tasks)."""
    from tests.test_kernels import check_paged_rows, prefill_rows

    rows = prefill_rows(num_heads, num_kv_heads, head_dim, block_size, dtype, seed=num_heads + window)
    sinks = torch.linspace(-6.0, 4.0, num_heads)
    check_paged_rows(ops, *rows, window=window, sinks=sinks)
    query, cache, tables, seq_lens = rows
    few = slice(0, 3)
    check_paged_rows(ops, query[few], cache, tables[few], seq_lens[few], window=window, sinks=sinks)
