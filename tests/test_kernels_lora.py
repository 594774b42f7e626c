"""csrc lora_add against the torch reference (worker/lora/slots.py add_reference) and float64, across
shapes, parts, ranks below the slots' width and base rows; each row's result the same in any batch."""

from __future__ import annotations

import pytest
import torch

from worker.lora.slots import add_reference

# (rows, in, part widths, slots, rank): qkv-like (3 parts of unequal width), a single part, wide outputs
SHAPES = [
    (7, 64, [64, 32, 32], 4, 16),
    (1, 96, [80], 2, 8),
    (33, 48, [128, 128], 3, 32),
    (130, 40, [24], 1, 4),
]


def setup(rows: int, in_features: int, widths: list[int], num_slots: int, rank: int, dtype: torch.dtype):  # type: ignore[no-untyped-def]
    generator = torch.Generator().manual_seed(rows * 7 + in_features)
    parts, out = len(widths), sum(widths)
    bounds = torch.tensor([0, *torch.tensor(widths).cumsum(0).tolist()])
    ranks = torch.randint(1, rank + 1, (num_slots, len(widths)), generator=generator)
    ranks[0] = rank
    ranks[-1, 0] = 0 if len(widths) > 1 else ranks[-1, 0]  # a part the adapter does not target
    a = torch.zeros(num_slots, parts * rank, in_features)
    bt = torch.zeros(num_slots, parts * rank, out)
    for s in range(num_slots):
        for p in range(parts):
            r = int(ranks[s, p])
            a[s, p * rank : p * rank + r] = torch.randn(r, in_features, generator=generator)
            bt[s, p * rank : p * rank + r, bounds[p] : bounds[p + 1]] = (
                torch.randn(r, widths[p], generator=generator) * 0.1
            )
    x = torch.randn(rows, in_features, generator=generator)
    y = torch.randn(rows, out, generator=generator)
    row_slots = torch.randint(-1, num_slots, (rows,), generator=generator)
    return [t.to(dtype) for t in (x, y, a, bt)], row_slots, bounds, ranks


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", SHAPES)
def test_lora_add_matches_reference(ops, dtype, shape) -> None:  # type: ignore[no-untyped-def]
    (x, y, a, bt), row_slots, bounds, ranks = setup(*shape, dtype)
    exact = y.double()
    add_reference(x.double(), exact, a.double(), bt.double(), row_slots)
    reference = y.clone()
    add_reference(x, reference, a, bt, row_slots)
    ours = y.clone()
    ops.lora_add(x, ours, a, bt, row_slots, bounds, ranks)
    base = row_slots < 0
    assert torch.equal(ours[base], y[base]), "base rows are not touched"
    tolerance = 1e-4 if dtype == torch.float32 else 3e-2
    scale = exact.abs().max().item()
    assert (ours.double() - exact).abs().max().item() <= tolerance * scale
    assert (ours.double() - exact).abs().max() <= (reference.double() - exact).abs().max() + tolerance * scale


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_lora_add_rows_do_not_depend_on_the_batch(ops, dtype) -> None:  # type: ignore[no-untyped-def]
    (x, y, a, bt), row_slots, bounds, ranks = setup(33, 48, [128, 128], 3, 32, dtype)
    together = y.clone()
    ops.lora_add(x, together, a, bt, row_slots, bounds, ranks)
    for r in (0, 5, 32):
        alone = y[r : r + 1].clone()
        ops.lora_add(
            x[r : r + 1].contiguous(), alone, a, bt, row_slots[r : r + 1].contiguous(), bounds, ranks
        )
        assert torch.equal(alone[0], together[r])


def test_lora_add_refuses_what_does_not_fit(ops) -> None:  # type: ignore[no-untyped-def]
    (x, y, a, bt), row_slots, bounds, ranks = setup(7, 64, [64, 32, 32], 4, 16, torch.float32)
    with pytest.raises(RuntimeError, match="row_slots < S"):
        ops.lora_add(x, y, a, bt, torch.full_like(row_slots, 4), bounds, ranks)
    with pytest.raises(RuntimeError, match="fit x and y"):
        ops.lora_add(x[:, :32].contiguous(), y, a, bt, row_slots, bounds, ranks)
