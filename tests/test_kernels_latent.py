"""csrc paged_decode_attention on multi-head latent attention's cache ([blocks, 1, block_size, 1, width]: a
token's one latent row is its key and its value): against a float64 softmax attention over each row's keys,
at widths a multiple of 64 (the AVX-512 latent kernel where the CPU has AVX-512; DeepSeek's 512 + 64) and
not (the portable kernel), head counts that are not a multiple of 4, lengths that are not a multiple of 4,
a window, one row (its heads split over the threads) and many; each row's bits the same alone and in a
batch."""

from __future__ import annotations

import pytest
import torch

from worker.csrc_ops import load_cpu_ops

NONE = torch.empty(0)


@pytest.fixture(scope="module")
def ops():  # type: ignore[no-untyped-def]
    ops = load_cpu_ops()
    if ops is None:
        pytest.skip("no C++ compiler: the csrc kernels did not build")
    return ops


def reference(q: torch.Tensor, cache: torch.Tensor, tables: torch.Tensor, lens: torch.Tensor, scale: float,
              window: int) -> torch.Tensor:  # fmt: skip
    """Each row against its keys (its last `window` where window > 0), in float64."""
    block_size = cache.shape[2]
    out = torch.empty(q.shape, dtype=torch.float64)
    for r in range(q.shape[0]):
        length = int(lens[r])
        first = max(0, length - window) if window else 0
        keys = torch.stack(
            [cache[tables[r, t // block_size], 0, t % block_size, 0] for t in range(first, length)]
        )
        probs = torch.softmax((q[r].double() * scale) @ keys.double().T, dim=-1)
        out[r] = probs @ keys.double()
    return out


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["float32", "bf16"])
@pytest.mark.parametrize(
    ("heads", "width", "rows", "window"),
    [(9, 576, 16, 0), (16, 576, 1, 0), (3, 576, 5, 0), (5, 128, 2, 0), (4, 64, 6, 7), (2, 72, 3, 0)],
)
def test_latent_rows_against_float64(ops, dtype, heads: int, width: int, rows: int, window: int) -> None:  # type: ignore[no-untyped-def]
    generator = torch.Generator().manual_seed(heads * width + rows)
    block_size, blocks = 16, 40
    cache = torch.randn(blocks, 1, block_size, 1, width, generator=generator).to(dtype)
    lens = torch.tensor([1 + (37 * i + 5) % 120 for i in range(rows)])
    tables = torch.stack([torch.randperm(blocks, generator=generator)[:8] for _ in range(rows)])
    q = torch.randn(rows, heads, width, generator=generator).to(dtype)
    out = ops.paged_decode_attention(q, cache, tables, lens, 0.07, window, 0.0, NONE)
    expected = reference(q, cache, tables, lens, 0.07, window)
    # float32: its sums' rounding; bf16: the output's one rounding to bf16 (values up to ~3)
    tolerance = 1e-5 if dtype == torch.float32 else 1.6e-2
    torch.testing.assert_close(out.double(), expected, atol=tolerance, rtol=0)
    for r in range(rows):
        alone = ops.paged_decode_attention(q[r : r + 1].contiguous(), cache, tables[r : r + 1], lens[r : r + 1],
                                           0.07, window, 0.0, NONE)  # fmt: skip
        assert torch.equal(alone[0], out[r]), f"row {r} differs alone"
