"""A checkpoint with a real model's shape and random weights, for speed runs where the weights cannot travel
(deploy/gpu-check-offline.sh): SPEC holds a config.json and tokenizer files; FOLDER gets them and bf16
weights drawn from N(0, 0.02), seeded, so the same SPEC gives the same checkpoint.

    python -m benchmarks.random_checkpoint SPEC FOLDER
"""

from __future__ import annotations

import shutil
import sys

import torch
from transformers import AutoConfig, AutoModelForCausalLM


def main(spec: str, folder: str) -> None:
    shutil.copytree(spec, folder, dirs_exist_ok=True)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(spec), dtype=torch.bfloat16)
    for parameter in model.parameters():
        torch.nn.init.normal_(parameter, std=0.02)
    model.save_pretrained(folder)
    print(f"{folder}: {sum(p.numel() for p in model.parameters())} parameters, random")


if __name__ == "__main__":
    main(*sys.argv[1:])
