"""Weight updates' wire format without a server: the packing plan both sides compute, packed buffers
that unpack to the tensors sent, and the update info's checks."""

from __future__ import annotations

import pytest
import torch

from protocol.errors import InvalidParameterError
from protocol.weight_transfer import UpdateInfo, packing_plan, parse, parse_weight_transfer_config
from worker.weight_transfer import pack, unpack, wire_tensors


def test_the_packing_plan_fills_buffers_in_order() -> None:
    assert packing_plan([4, 4, 4, 10, 1, 1], 8) == [[0, 1], [2], [3], [4, 5]]  # 10 > 8 goes alone
    assert packing_plan([], 8) == [] and packing_plan([0, 0], 8) == [[0, 1]]


@pytest.mark.parametrize("packed", [True, False])
def test_packed_buffers_unpack_to_the_tensors_sent(packed: bool) -> None:
    sent = [torch.randn(3, 5), torch.randn(7).to(torch.bfloat16), torch.empty(0), torch.randn(2, 2).half()]
    info = UpdateInfo(names=["a", "b", "c", "d"], dtype_names=["float32", "bfloat16", "float32", "float16"],
                      shapes=[[3, 5], [7], [0], [2, 2]], packed=packed, packed_buffer_size_bytes=40)  # fmt: skip
    wire = pack(info, sent)
    received_wire, received = wire_tensors(info, torch.device("cpu"))
    assert [w.shape for w in received_wire] == [w.shape for w in wire]
    for target, source in zip(received_wire, wire, strict=True):
        target.copy_(source)  # what the broadcast does
    if packed:
        unpack(info, received_wire, received)
    for got, want in zip(received, sent, strict=True):
        assert got.dtype == want.dtype and torch.equal(got, want)


def test_update_info_checks() -> None:
    with pytest.raises(InvalidParameterError, match="one entry per tensor"):
        UpdateInfo(names=["a"], dtype_names=[], shapes=[[1]]).check()
    with pytest.raises(InvalidParameterError, match="int8"):
        UpdateInfo(names=["a"], dtype_names=["int8"], shapes=[[1]]).check()
    with pytest.raises(InvalidParameterError, match="checkpoint-format"):
        UpdateInfo(names=[], dtype_names=[], shapes=[], is_checkpoint_format=False).check()
    with pytest.raises(InvalidParameterError, match="update_info"):
        parse(UpdateInfo, {"names": [], "dtype_names": [], "shapes": [], "surprise": 1}, "update_info")
    with pytest.raises(InvalidParameterError, match="backend"):
        parse_weight_transfer_config({"backend": "ucx"})
