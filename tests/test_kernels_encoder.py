"""csrc encoder_attention (bidirectional attention of each segment of rows alone, for encoders such as BERT)
against a float64 softmax(q k^T) v per segment, and each segment's bits the same alone as among others. bf16
with even head dims takes the AVX-512 BF16 form where the build has it (an odd head dim, the float32 form).
And the encoders' product with GELU after it (Linear.gelu: oneDNN's fused GELU on its packed path)."""

from __future__ import annotations

import pytest
import torch

# float32 sums over at most a few hundred keys; bf16: the output's one rounding (2^-8 relative)
TOLERANCE = {torch.float32: 2e-5, torch.bfloat16: 2e-2}


def reference(qkv: torch.Tensor, segments: list[tuple[int, int]], heads: int, scale: float) -> torch.Tensor:
    rows, width = qkv.shape
    dim = width // 3 // heads
    x = qkv.double().view(rows, 3, heads, dim)
    out = torch.zeros(rows, heads, dim, dtype=torch.float64)
    for start, end in segments:
        q, k, v = x[start:end].permute(1, 2, 0, 3).unbind(0)  # [heads, n, dim]
        out[start:end] = ((q @ k.transpose(1, 2)) * scale).softmax(-1).matmul(v).transpose(0, 1)
    return out.view(rows, heads * dim)


def attend(ops, qkv: torch.Tensor, segments: list[tuple[int, int]], heads: int, scale: float) -> torch.Tensor:  # type: ignore[no-untyped-def]
    third = qkv.shape[1] // 3
    q, k, v = qkv[:, :third], qkv[:, third : 2 * third], qkv[:, 2 * third :]
    out: torch.Tensor = ops.encoder_attention(q, k, v, torch.tensor(segments).view(-1, 2), heads, scale)
    return out


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(
    ("heads", "dim", "lengths"),
    [
        (12, 32, [1, 2, 7, 8, 9, 16, 17, 73, 128]),
        (4, 64, [300]),
        (3, 24, [5, 40]),
        (2, 80, [33, 1]),
        (2, 7, [9, 3]),
    ],
)
def test_encoder_attention_matches_a_float64_softmax_per_segment(ops, dtype, heads, dim, lengths) -> None:  # type: ignore[no-untyped-def]
    generator = torch.Generator().manual_seed(len(lengths) * dim)
    segments, start = [], 0
    for n in lengths:
        segments.append((start, start + n))
        start += n
    qkv = (2 * torch.randn(start, 3 * heads * dim, generator=generator)).to(dtype)
    scale = dim**-0.5
    out = attend(ops, qkv, segments, heads, scale)
    expected = reference(qkv, segments, heads, scale)
    assert out.dtype == dtype and out.shape == expected.shape
    assert (out.double() - expected).abs().max().item() < TOLERANCE[dtype] * max(
        1.0, expected.abs().max().item()
    )
    # a segment alone gives the same bits as among the others (and the order of segments does not matter)
    for start, end in segments[::3]:
        alone = attend(ops, qkv[start:end].contiguous(), [(0, end - start)], heads, scale)
        assert torch.equal(alone, out[start:end])
    assert torch.equal(attend(ops, qkv, segments[::-1], heads, scale), out)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_scores_all_far_below_zero_beside_padded_keys(ops, dtype) -> None:  # type: ignore[no-untyped-def]
    """Every score near -128 (times log2 e: 2^-185, below every float): the softmax shifts by the largest
    score of the keys that exist. Shifted by a padded key's zero instead, every weight would be zero and the
    output NaN. Segments of 40 and 7 keys leave padding in the bf16 form's blocks of 32 keys."""
    generator = torch.Generator().manual_seed(7)
    heads, dim, rows = 2, 64, 47
    q = 4 + 0.1 * torch.randn(rows, heads * dim, generator=generator)
    k = -4 + 0.1 * torch.randn(rows, heads * dim, generator=generator)
    v = torch.randn(rows, heads * dim, generator=generator)
    qkv = torch.cat([q, k, v], 1).to(dtype)
    segments, scale = [(0, 40), (40, 47)], dim**-0.5
    out = attend(ops, qkv, segments, heads, scale)
    expected = reference(qkv, segments, heads, scale)
    assert torch.isfinite(out).all()
    assert (out.double() - expected).abs().max().item() < TOLERANCE[dtype] * max(
        1.0, expected.abs().max().item()
    )


def test_encoder_attention_refuses_bad_segments(ops) -> None:  # type: ignore[no-untyped-def]
    qkv = torch.randn(10, 3 * 64)
    for bad in ([(0, 11)], [(3, 3)], [(-1, 4)]):
        with pytest.raises(RuntimeError, match="rows of segment 0"):
            attend(ops, qkv, bad, 2, 0.1)
    with pytest.raises(RuntimeError, match="float32 or bf16"):
        attend(ops, qkv.half(), [(0, 10)], 2, 0.1)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_product_with_gelu_equals_gelu_of_the_product(dtype) -> None:  # type: ignore[no-untyped-def]
    """Linear.gelu (Whisper's encoder MLP): oneDNN's fused GELU on the packed bf16 path, F.gelu elsewhere."""
    import torch.nn.functional as F

    from worker.models.layers import Linear, can_pack

    generator = torch.Generator().manual_seed(11)
    linear = Linear(64, 256, bias=True, dtype=dtype)
    with torch.no_grad():
        linear.weight.copy_((0.2 * torch.randn(256, 64, generator=generator)).to(dtype))
        linear.bias.copy_(torch.randn(256, generator=generator).to(dtype))
    weight, bias = linear.weight.detach().double(), linear.bias.detach().double()
    if can_pack(dtype):
        linear.pack(None)  # oneDNN's layout, no pair kernel: every row count takes the fused path
    x = torch.randn(300, 64, generator=generator).to(dtype)
    with torch.inference_mode():
        out = linear.gelu(x)
        expected = F.gelu(F.linear(x.double(), weight, bias))
        unfused = F.gelu(linear(x))
    assert out.dtype == dtype and out.shape == (300, 256)
    assert (out.double() - expected).abs().max().item() < TOLERANCE[dtype] * expected.abs().max().item()
    if dtype == torch.float32:
        assert torch.equal(out, unfused)
    else:  # one rounding against two: at most one bf16 step apart
        assert (out.double() - unfused.double()).abs().max().item() <= 2**-7 * unfused.abs().max().item()
