"""The decoder families by Hugging Face class and llama.cpp architecture (each a short file here)."""

from __future__ import annotations

from worker.models.families.base import Family, HFConfig
from worker.models.families.cohere import COHERE
from worker.models.families.deepseek import DEEPSEEK
from worker.models.families.gemma import GEMMA, GEMMA2, GEMMA3
from worker.models.families.glm import GLM, GLM4
from worker.models.families.gpt_neox import GPT_NEOX
from worker.models.families.gpt_oss import GPT_OSS
from worker.models.families.granite import GRANITE
from worker.models.families.llama import LLAMA, MISTRAL
from worker.models.families.moe import MIXTRAL, QWEN2_MOE, QWEN3_MOE
from worker.models.families.olmo import OLMO2, OLMO3
from worker.models.families.phi3 import PHI3
from worker.models.families.qwen import QWEN2, QWEN3
from worker.models.families.smollm3 import SMOLLM3
from worker.models.families.stablelm import STABLELM
from worker.models.families.starcoder2 import STARCODER2

FAMILIES = (
    LLAMA, MISTRAL, QWEN2, QWEN3, GEMMA, GEMMA2, GEMMA3, PHI3, GRANITE, OLMO2, OLMO3, SMOLLM3, GLM, GLM4,
    COHERE, STARCODER2, GPT_NEOX, STABLELM, MIXTRAL, QWEN2_MOE, QWEN3_MOE,
    GPT_OSS, DEEPSEEK,
)  # fmt: skip
BY_ARCHITECTURE = {architecture: family for family in FAMILIES for architecture in family.architectures}
BY_NAME = {family.name: family for family in FAMILIES}
BY_GGUF = {name: family for family in FAMILIES for name in family.gguf_architectures}
# the prefixes a checkpoint's decoder tensors may carry (a vision-language model's language model too)
PREFIXES = (
    "language_model.model.",
    "model.language_model.",
    "model.text_model.",
    "language_model.",
    "model.",
)


def our_name(family_name: str, name: str) -> str:
    """A checkpoint tensor's name as our modules have it: the family's renames, then no model prefix."""
    family = BY_NAME.get(family_name)
    name = family.checkpoint_name(name) if family is not None else name
    for prefix in PREFIXES:
        if name.startswith(prefix):
            return name[len(prefix) :]
    return name


__all__ = ["BY_ARCHITECTURE", "BY_GGUF", "BY_NAME", "FAMILIES", "Family", "HFConfig", "our_name"]
