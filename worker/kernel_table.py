"""Which kernel serves each piece of a step, on this CPU, dtype and mode: logged when a worker starts (a
one-line summary at info, the table at debug). docs/performance.md holds the measurements per CPU.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

import torch

from worker.attention.cpu import CpuAttentionBackend
from worker.csrc_ops import a8_vector_form, cpu_isa_flags
from worker.models.causal_lm import CausalLM
from worker.models.layers import Linear
from worker.models.whisper import WhisperModel
from worker.quant.int_pack import IntType

if TYPE_CHECKING:
    from worker.attention.base import AttentionBackend
    from worker.models.bert import BertModel

logger = logging.getLogger("engine.worker")


def isa_summary() -> str:
    flags = set(cpu_isa_flags())
    kinds = [name for name in ("amx_tile", "avx512_bf16", "avx512f", "avx2", "fma") if name in flags]
    return " ".join(kinds) or "no AVX2"


def product_kernel(linear: Linear) -> str:
    if linear.quant_parts is not None:
        if int(linear.quant_parts[0, 0]) == IntType.I8_A8:
            return "csrc linear_w8a8 (int8 rows, every row count)"
        if linear.int8_activations:
            form = a8_vector_form() or "the portable loop"
            return (
                f"csrc linear_quant_a8 on the packed blocks (int8 rows per 32 dims: {form}; every row count)"
            )
        form = "AMX tiles" if linear.ops is not None and linear.ops.has_amx() else "AVX-512 BF16 pairs"
        return f"csrc linear_quant on the packed blocks (bf16 rows: {form}; float32: FMA chains; every row count)"
    if linear.rows is not None:
        return "csrc linear_rows (every row count)"
    if linear.amx:
        return "csrc linear_amx (AMX tiles, every row count)"
    if linear.pairs is not None:
        rows = "every row count" if linear.pairs_rows >= 1 << 62 else f"<= {linear.pairs_rows} rows"
        tail = "" if linear.pairs_rows >= 1 << 62 else ", oneDNN packed above"
        return f"csrc linear_pairs ({rows}{tail})"
    if linear.packed is not None:
        return "oneDNN packed (mkldnn._linear_pointwise)"
    return "torch F.linear (MKL in float32)"


def kernel_table(
    model: CausalLM | BertModel | WhisperModel, backend: AttentionBackend, dtype: torch.dtype
) -> list[tuple[str, str]]:
    linears = {name: module for name, module in model.named_modules() if isinstance(module, Linear)}
    first = next(iter(linears.values()))
    kernels = model.ops is not None
    encoder = "csrc encoder_attention, every input in one call" if kernels else "torch SDPA per input"
    if isinstance(model, WhisperModel):  # worker/models/whisper.py
        cross = "csrc paged rows" if kernels else "torch SDPA per request"
        return [("products", product_kernel(first)), ("encoder attention", encoder),
                ("cross attention", cross), ("self attention", type(backend).__name__)]  # fmt: skip
    if not isinstance(model, CausalLM):  # an encoder (worker/models/bert.py)
        return [("products", product_kernel(first)), ("attention", f"{encoder}, bidirectional")]
    table = [
        ("products", product_kernel(first)),
        ("lm_head", product_kernel(model.lm_head)),
    ]
    if isinstance(backend, CpuAttentionBackend):
        table.append(("decode attention", "csrc paged rows"))
        if backend.batch_invariant:
            table.append(("prefill attention", "csrc paged rows, every chunk (no tiles)"))
        else:
            tiles = backend.ops.prefill_tiles() if dtype == torch.bfloat16 else ""
            table.append(
                (
                    "prefill attention",
                    f"csrc tiles ({tiles})" if tiles else "csrc paged rows when short, else SDPA",
                )
            )
    else:
        table.append(("attention", f"torch reference ({type(backend).__name__})"))
    table.append(("decoder layers", "one csrc call" if model.native_layers is not None else "Python layers"))
    return table


def log_kernel_table(
    model: CausalLM | BertModel | WhisperModel, backend: AttentionBackend, dtype: torch.dtype
) -> None:
    device = next(model.parameters()).device
    if device.type == "cuda":  # the CPU's table below does not apply
        logger.info(
            "kernels (%s; %s): products torch F.linear (cuBLAS), attention %s",
            torch.cuda.get_device_name(device),
            str(dtype).removeprefix("torch."),
            getattr(backend, "name", type(backend).__name__),
        )
        return
    mode = "batch-invariant" if model.batch_invariant else "batch-variant"
    table = kernel_table(model, backend, dtype)
    logger.info(
        "kernels (%s; %s, %s): products %s, prefill attention %s",
        isa_summary(),
        str(dtype).removeprefix("torch."),
        mode,
        table[0][1],
        next(kernel for piece, kernel in table if "attention" in piece and "decode" not in piece),
    )
    for piece, kernel in table:
        logger.debug("  %-18s %s", piece, kernel)
