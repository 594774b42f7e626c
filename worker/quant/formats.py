"""Safetensors checkpoints quantized as vLLM's CPU build takes them, read into IntBlocks: AutoAWQ's GEMM
format, GPTQ (AutoGPTQ's and GPTQModel's v2 zero points), and compressed-tensors' pack-quantized (W4A16)
and int-quantized (W8A8, activations quantized per token at run time) formats. Each format's
`quantization_config` is read field by field: what is not served is a start error naming the field,
never a model that runs and answers otherwise. The layouts, from each format's writer:
  AWQ   qweight int32 [K, N / 8]: 8 output columns a word, column 8c + j in nibble AWQ_ORDER[j] of word c;
        qzeros int32 [K / g, N / 8] the same way; scales f16 [K / g, N]; weight = (q - zero) * scale.
  GPTQ  qweight int32 [K * bits / 32, N]: input dims packed along the rows, dim 8r + i (4-bit) in nibble i
        of row r; qzeros int32 [K / g, N * bits / 32] along the columns, stored less one (v1; gptq_v2 as
        they are); scales f16 [K / g, N]; g_idx [K] the group of each input dim (in order, or with
        desc_act any order, g dims a group: act-order, whose products permute their inputs).
  compressed-tensors pack-quantized: weight_packed int32 [N, K * bits / 32] along the input dims, lowest
        bits first, each value stored plus 2^(bits - 1); weight_scale [N, K / g]; weight_zero_point (when
        asymmetric) packed along the output rows; int-quantized: weight int8 [N, K] as it is.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from worker.model_config import UnsupportedModelError
from worker.quant.blocks import IntBlocks
from worker.quant.int_pack import int_type

logger = logging.getLogger("engine.worker")

AWQ_ORDER = (0, 4, 1, 5, 2, 6, 3, 7)  # column j of 8 lies in nibble AWQ_ORDER[j]
INT8_TOKEN = "int8-token"


@dataclass(frozen=True)
class Scheme:
    """How one module's tensors are read."""

    bits: int
    group: int  # input dims a scale covers; -1: a whole row
    activations: str | None = None


@dataclass(frozen=True)
class Format:
    method: str
    schemes: tuple[tuple[tuple[str, ...], Scheme], ...]  # (targets, scheme), first match wins
    zero_shift: int = 0  # GPTQ v1 stores its zero points less one
    layout: str = ""  # compressed-tensors: "pack-quantized" or "int-quantized"

    @property
    def marker(self) -> str:
        """The tensor that says a module is quantized."""
        return "qweight" if self.method in ("awq", "gptq") else "weight_scale"

    @property
    def parts(self) -> tuple[str, ...]:
        if self.method in ("awq", "gptq"):
            return ("qweight", "qzeros", "scales", "g_idx")
        return (
            "weight_packed",
            "weight_scale",
            "weight_shape",
            "weight_zero_point",
            "weight_g_idx",
            "weight",
        )

    def scheme_of(self, module: str) -> Scheme:
        for targets, scheme in self.schemes:
            if any(_matches(module, target) for target in targets):
                return scheme
        raise UnsupportedModelError(
            f"quantization_config: no config group targets {module!r}, which is quantized"
        )


def _matches(module: str, target: str) -> bool:
    if target == "Linear":
        return True
    if target.startswith("re:"):
        return re.match(target[3:], module) is not None
    return module == target or module.endswith("." + target)


def read_format(config: dict[str, Any]) -> Format:
    """The format a checkpoint's quantization_config describes; an UnsupportedModelError naming what is
    not served."""
    method = config.get("quant_method")
    if method == "awq":
        _require(config, "version", "gemm", ("gemm",))
        _require(config, "zero_point", True, (True,))
        return Format(
            "awq", ((("Linear",), Scheme(_bits(config, (4,)), int(config.get("group_size", 128)))),)
        )
    if method == "gptq":
        _require(config, "checkpoint_format", "gptq", ("gptq", "gptq_v2"))
        shift = 1 if config.get("checkpoint_format", "gptq") == "gptq" else 0
        scheme = Scheme(_bits(config, (4, 8)), int(config.get("group_size", 128)))
        return Format("gptq", ((("Linear",), scheme),), zero_shift=shift)
    if method == "compressed-tensors":
        return _compressed_tensors(config)
    raise UnsupportedModelError(f"quantization_config quant_method {method!r} is not served")


def _require(config: dict[str, Any], key: str, default: Any, allowed: tuple[Any, ...]) -> None:
    value = config.get(key, default)
    if value not in allowed:
        raise UnsupportedModelError(f"quantization_config {key}: {value!r} is not served (only {allowed})")


def _bits(config: dict[str, Any], allowed: tuple[int, ...]) -> int:
    bits = int(config.get("bits", config.get("w_bit", 4)))
    if bits not in allowed:
        raise UnsupportedModelError(f"quantization_config bits: {bits} is not served (only {allowed})")
    return bits


def _compressed_tensors(config: dict[str, Any]) -> Format:
    for key in ("kv_cache_scheme", "sparsity_config", "transform_config"):
        if config.get(key):
            raise UnsupportedModelError(f"quantization_config {key} is not served")
    layout = config.get("format")
    schemes = []
    for name, group in (config.get("config_groups") or {}).items():
        where = f"quantization_config config_groups.{name}"
        group_layout = group.get("format") or layout
        if group_layout not in ("pack-quantized", "int-quantized", "naive-quantized"):
            raise UnsupportedModelError(f"{where} format {group_layout!r} is not served")
        layout = group_layout
        if group.get("output_activations"):
            raise UnsupportedModelError(f"{where}.output_activations is not served")
        weights = group.get("weights") or {}
        if weights.get("type", "int") != "int" or weights.get("dynamic", False):
            raise UnsupportedModelError(f"{where}.weights: only static integer weights are served")
        if weights.get("actorder") not in (None, "group"):  # "group": weight_g_idx (act-order)
            raise UnsupportedModelError(f"{where}.weights.actorder {weights.get('actorder')!r} is not served")
        strategy = weights.get("strategy", "tensor")
        if strategy not in ("channel", "group", "tensor"):
            raise UnsupportedModelError(f"{where}.weights.strategy {strategy!r} is not served")
        size = int(weights["group_size"]) if strategy == "group" else -1
        activations = group.get("input_activations")
        act = None
        if activations:
            wanted = {"num_bits": 8, "type": "int", "strategy": "token", "dynamic": True, "symmetric": True}
            differing = sorted(k for k, v in wanted.items() if activations.get(k) != v)
            if differing:
                raise UnsupportedModelError(
                    f"{where}.input_activations {', '.join(differing)}: only dynamic symmetric int8 per token"
                )
            act = INT8_TOKEN
            if strategy == "group" or not weights.get("symmetric", True):
                raise UnsupportedModelError(
                    f"{where}.weights: int8 activations take symmetric weights with a scale per row (strategy "
                    f"'channel' or 'tensor'), not {strategy!r}, symmetric {weights.get('symmetric')}"
                )
        schemes.append(
            (tuple(group.get("targets") or ("Linear",)), Scheme(int(weights.get("num_bits", 8)), size, act))
        )
    if not schemes:
        raise UnsupportedModelError("quantization_config config_groups: none given")
    return Format("compressed-tensors", tuple(schemes), layout=str(layout))


def quantized_weights(
    weights: Iterable[tuple[str, torch.Tensor]], names: set[str], fmt: Format
) -> Iterator[tuple[str, torch.Tensor | IntBlocks]]:
    """The checkpoint's tensors with each quantized module's tensors read into one `module.weight`
    IntBlocks (names: every tensor name of the checkpoint, to know which modules are quantized and when
    a module's tensors are all in)."""
    modules = {name.rpartition(".")[0] for name in names if name.rpartition(".")[2] == fmt.marker}
    pending: dict[str, dict[str, torch.Tensor]] = {}
    act_order = 0
    for name, tensor in weights:
        module, _, part = name.rpartition(".")
        if module not in modules or part not in fmt.parts:
            yield name, tensor
            continue
        tensors = pending.setdefault(module, {})
        tensors[part] = tensor
        if all(f"{module}.{p}" not in names or p in tensors for p in fmt.parts):
            blocks = _read(module, pending.pop(module), fmt)
            act_order += blocks.order is not None
            yield f"{module}.weight", blocks
    if pending:
        raise UnsupportedModelError(f"quantized modules with tensors missing: {sorted(pending)[:3]}")
    if act_order:
        logger.info(
            "%d act-order products (their groups not in input order) take their inputs permuted",
            act_order,
        )


def _words(packed: torch.Tensor) -> np.ndarray:
    return packed.numpy().view(np.uint32)


def _unpack(packed: torch.Tensor, bits: int, axis: int) -> np.ndarray:
    """int32 words -> their values along `axis` (value i of a word at bits * i), as uint8."""
    words = _words(packed)
    per = 32 // bits
    shifts = (np.arange(per, dtype=np.uint32) * bits).astype(np.uint32)
    if axis == 1:
        values = (words[:, :, None] >> shifts) & ((1 << bits) - 1)
        return values.reshape(words.shape[0], -1).astype(np.uint8)
    values = (words[:, None, :] >> shifts[:, None]) & ((1 << bits) - 1)
    return values.reshape(-1, words.shape[1]).astype(np.uint8)


def _read(module: str, tensors: dict[str, torch.Tensor], fmt: Format) -> IntBlocks:
    scheme = fmt.scheme_of(module)
    try:
        if fmt.method == "awq":
            blocks = _awq(tensors, scheme)
        elif fmt.method == "gptq":
            blocks = _gptq(tensors, scheme, fmt.zero_shift)
        else:
            blocks = _compressed(tensors, scheme, fmt.layout)
        expected = blocks.shape[1] if scheme.group == -1 else scheme.group
        if blocks.group != expected:  # the config says one group size, the tensors hold another
            raise ValueError(
                f"its scales cover groups of {blocks.group} dims, the config's group_size is {expected}"
            )
        return blocks
    except (KeyError, ValueError) as e:
        raise UnsupportedModelError(f"{module}: {fmt.method} tensors not served as they are: {e}") from e


def _blocks(
    bits: int,
    u: np.ndarray,
    scale: torch.Tensor,
    zero: np.ndarray,
    act: str | None = None,
    order: np.ndarray | None = None,
) -> IntBlocks:
    """u [N, K] the unsigned stored values, scale [N, G], zero [N, G] in the same offset: weight = (u - zero) *
    scale. 8-bit values are kept signed (u - 128)."""
    s = scale.float().numpy().astype(np.float32)
    if bits == 8:
        q: np.ndarray = (u.astype(np.int16) - 128).astype(np.int8)
        zero = zero.astype(np.float32) - 128
    else:
        q = u
    offset = -(s * zero.astype(np.float32))
    int_type(
        bits, u.shape[1] // s.shape[1], u.shape[1]
    )  # a group the kernels take, or a ValueError naming it
    return IntBlocks(
        bits, np.ascontiguousarray(q), np.ascontiguousarray(s), np.ascontiguousarray(offset), act, order
    )


def _awq(t: dict[str, torch.Tensor], scheme: Scheme) -> IntBlocks:
    order = np.arange(t["qweight"].shape[1] * 8).reshape(-1, 8)[:, AWQ_ORDER].reshape(-1)
    u = _unpack(t["qweight"], 4, axis=1)[:, order]  # [K, N]
    zero = _unpack(t["qzeros"], 4, axis=1)[:, order]  # [K / g, N]
    return _blocks(4, np.ascontiguousarray(u.T), t["scales"].T, zero.T)


def _gptq(t: dict[str, torch.Tensor], scheme: Scheme, shift: int) -> IntBlocks:
    bits = scheme.bits
    u = _unpack(t["qweight"], bits, axis=0)  # [K, N]
    k = u.shape[0]
    zero = _unpack(t["qzeros"], bits, axis=1)[:, : u.shape[1]].astype(np.int32) + shift  # [K / g, N]
    group = k // t["scales"].shape[0]
    order = _act_order(t["g_idx"].numpy(), group) if "g_idx" in t else None
    if order is not None:
        u = u[order]  # the input dims in group order
    return _blocks(bits, np.ascontiguousarray(u.T), t["scales"].T, zero.T, order=order)


def _act_order(g_idx: np.ndarray, group: int) -> np.ndarray | None:
    """g_idx [K] the group of each input dim -> None where the groups are runs of `group` dims in order,
    else the input dims in group order (act-order), each group `group` dims."""
    k = g_idx.shape[0]
    if np.array_equal(g_idx, np.arange(k) // group):
        return None
    order = np.argsort(g_idx, kind="stable")
    if not np.array_equal(g_idx[order], np.arange(k) // group):
        raise ValueError(f"g_idx does not give each of the {k // group} groups {group} input dims")
    return order


def _compressed(t: dict[str, torch.Tensor], scheme: Scheme, layout: str) -> IntBlocks:
    bits, half = scheme.bits, 1 << (scheme.bits - 1)
    if layout == "pack-quantized":
        n, k = (int(v) for v in t["weight_shape"].tolist())
        u = _unpack(t["weight_packed"], bits, axis=1)[:, :k]  # stored plus 2^(bits - 1)
    else:
        n, k = t["weight"].shape
        u = (t["weight"].numpy().astype(np.int16) + half).astype(np.uint8)
    scale = t["weight_scale"].reshape(n if t["weight_scale"].numel() > 1 else 1, -1).expand(n, -1)
    if "weight_zero_point" in t:
        zp = t["weight_zero_point"]
        zero = (
            _unpack(zp, bits, axis=0)[:n]
            if layout == "pack-quantized"
            else zp.numpy().astype(np.int16) + half
        )
        zero = np.broadcast_to(zero.reshape(n if zero.size > 1 else 1, -1), scale.shape)
    else:
        zero = np.full(scale.shape, half)
    order = None
    if "weight_g_idx" in t:  # actorder "group"
        order = _act_order(t["weight_g_idx"].numpy(), k // scale.shape[1])
        if order is not None:
            u = u[:, order]
    return _blocks(bits, np.ascontiguousarray(u), scale, np.asarray(zero), scheme.activations, order)
