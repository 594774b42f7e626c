"""LoRA adapters made with peft for the tests (random non-zero B, so an adapter that is not applied shows),
and peft's greedy output as the oracle."""

from __future__ import annotations

from typing import Any

import torch


def make_adapter(
    base_folder: str,
    out_folder: str,
    rank: int,
    alpha: float,
    targets: list[str] | str,
    *,
    rslora: bool = False,
    seed: int = 0,
    scale: float = 0.2,
    parameters: list[str] | None = None,
) -> str:
    """A PEFT LoRA folder for the model in base_folder; B drawn from N(0, scale) so the adapter matters.
    parameters: PEFT's target_parameters (a mixture of experts' stacked experts.gate_up_proj, down_proj)."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(base_folder, dtype=torch.float32)
    config = LoraConfig(
        r=rank,
        lora_alpha=alpha,
        target_modules=targets,
        use_rslora=rslora,
        lora_dropout=0.0,
        target_parameters=parameters,
    )
    model = get_peft_model(base, config)
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "lora_B" in name or "lora_A" in name:
                param.copy_(torch.randn(param.shape, generator=generator) * scale)
    model.save_pretrained(out_folder)
    return out_folder


def peft_model(base_folder: str, adapter_folder: str, dtype: torch.dtype = torch.float32) -> Any:
    """HF transformers + peft with the adapter applied (the oracle)."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(base_folder, dtype=dtype)
    return PeftModel.from_pretrained(base, adapter_folder).eval()
